"""Absorb: how fast does a write into ckptfs return (a probe: `make bench` measures it in save.py)?

Two measures, each taken into a ckptfs mount and into /dev/shm (tmpfs, the
fastest a file write can be on this machine), interleaved in one run so
both see the same machine noise:

  * torch.save of a 1 GiB state dict (16 random fp32 4096x4096 tensors);
    the figure of merit is the ratio of medians mount / shm (target <= 1.2);
  * raw throughput: 1 GiB written in 64 MiB write() calls (GB/s).

It mounts ckptfs itself over two file-backed devices under --scratch,
deletes each file before the next repetition (so the memory budget is
freed), unmounts at the end, prints a markdown table and writes
benchmarks/results/absorb.json with the machine it ran on.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py and the cases
from common import GiB, ROOT, file_devices, machine, mounted, random_state_dict, stats, write_bytes, write_results  # noqa: E402

RAW_BLOCK = 64 << 20
TARGET_RATIO = 1.2


def time_save(sd: dict, path: Path) -> float:
    t0 = time.perf_counter()
    torch.save(sd, path)
    return time.perf_counter() - t0


def time_raw(block: bytes, path: Path, total: int = GiB) -> float:
    """Seconds to open, write `total` bytes in len(block) write() calls, and close."""
    t0 = time.perf_counter()
    write_bytes(path, block, total)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description="torch.save and raw write absorb: ckptfs mount vs /dev/shm")
    p.add_argument("--repeats", type=int, default=5, help="measured repetitions per target (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured repetitions first (default 1)")
    p.add_argument("--memory", default="3G", help="ckptfs memory budget (default %(default)s)")
    p.add_argument("--scratch", type=Path, default=ROOT / "scratch" / "bench")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")

    scratch = args.scratch.resolve()
    mnt = scratch / "mnt"
    devices = file_devices(scratch / "devices", 2, 4 * GiB)

    print("making a 1 GiB state dict of random fp32 tensors ...", flush=True)
    sd = random_state_dict(GiB)
    block = os.urandom(RAW_BLOCK)
    shm = Path(f"/dev/shm/ckptfs-absorb-{os.getpid()}")
    shm.mkdir()
    targets = {"ckptfs": mnt, "shm": shm}
    save: dict[str, list[float]] = {k: [] for k in targets}
    raw: dict[str, list[float]] = {k: [] for k in targets}

    try:
        with mounted(mnt, devices, args.memory, log_file=scratch / "daemon.log"):
            for rep in range(args.warmup + args.repeats):
                measured = rep >= args.warmup
                order = list(targets) if rep % 2 == 0 else list(reversed(targets))
                for name in order:
                    path = targets[name] / "state.pt"
                    t = time_save(sd, path)
                    path.unlink()
                    r = time_raw(block, targets[name] / "raw.bin")
                    (targets[name] / "raw.bin").unlink()
                    if measured:
                        save[name].append(t)
                        raw[name].append(GiB / r / 1e9)
                    print(f"{'run' if measured else 'warm-up'} {rep + 1}: {name:6s} torch.save {t:.3f} s, "
                          f"raw write {GiB / r / 1e9:.2f} GB/s", flush=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)

    s = {k: stats(v) for k, v in save.items()}
    w = {k: stats(v) for k, v in raw.items()}
    ratio = s["ckptfs"]["median"] / s["shm"]["median"]
    result = {
        "benchmark": "absorb",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine() | {"torch": torch.__version__},
        "config": {"repeats": args.repeats, "warmup": args.warmup, "memory": args.memory, "devices": 2,
                   "state_dict": "16 x fp32 4096x4096 (1 GiB), random", "raw_block_bytes": RAW_BLOCK},
        "torch_save_seconds": s,
        "raw_write_gbps": w,
        "ratio_mount_over_shm": ratio,
        "target_ratio": TARGET_RATIO,
    }
    out = write_results("absorb", result)

    m = result["machine"]
    print(f"\nabsorb, 1 GiB, median of {args.repeats} (min-max); {m['cores']} cores, {m['ram_gib']} GiB RAM, "
          f"kernel {m['kernel']}\n")
    print("| target | torch.save (s) | raw write 64 MiB calls (GB/s) |")
    print("|---|---:|---:|")
    for k in targets:
        print(f"| {k} | {s[k]['median']:.3f} ({s[k]['min']:.3f}-{s[k]['max']:.3f}) "
              f"| {w[k]['median']:.2f} ({w[k]['min']:.2f}-{w[k]['max']:.2f}) |")
    verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
    print(f"\ntorch.save ratio mount/shm: {ratio:.2f} (target <= {TARGET_RATIO}: {verdict})")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
