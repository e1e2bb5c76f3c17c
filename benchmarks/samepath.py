"""Case 5, every-step checkpointing to the same path: bytes written to the devices vs bytes saved.

A training loop that saves every step overwrites its checkpoint long before
the previous one could reach the devices; ckptfs promises not to drain such
stale data. Here a random state dict (`--size`, 256 MiB) is saved `--saves`
times, `--gap` seconds apart (the step's compute, slept: the CPU is left to
the daemon), into a fresh ckptfs mount over two loop devices throttled to
`--throttle` each (so the drain is slower than the saves, as on a real
array under a fast trainer), then the mount is synced. Patterns:

  same-path  torch.save to ckpt.pt every time (truncate + rewrite);
  rename     torch.save to ckpt.pt.tmp, then os.replace onto ckpt.pt (examples/train.py);
  distinct   a new file every save, nothing deleted: the control, where every
             byte saved must reach the devices.

Device bytes are sectors written, from /sys/block/loopN/stat (and the
daemon's /proc/<pid>/io write_bytes as a cross-check), before and after;
they include the journal. The figure is device bytes / bytes saved.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from common import (SCRATCH, block_sectors_written, finish, machine, mounted, now, parse_size, proc_io,
                    random_state_dict, stats, sync_mount, target)
from drain import DATA_OFFSET, Devices

PATTERNS = ["same-path", "rename", "distinct"]


def save_loop(mnt: Path, sd: dict, pattern: str, saves: int, gap: float) -> list[float]:
    """Seconds each save blocked."""
    blocked = []
    for i in range(saves):
        t0 = time.perf_counter()
        if pattern == "same-path":
            torch.save(sd, mnt / "ckpt.pt")
        elif pattern == "rename":
            torch.save(sd, mnt / "ckpt.pt.tmp")
            os.replace(mnt / "ckpt.pt.tmp", mnt / "ckpt.pt")
        else:
            torch.save(sd, mnt / f"ckpt-{i:03d}.pt")
        blocked.append(time.perf_counter() - t0)
        time.sleep(gap)
    return blocked


def one_run(devs: Devices, scratch: Path, sd: dict, pattern: str, saves: int, gap: float, memory: str) -> dict:
    mnt = scratch / "mnt"
    with mounted(mnt, devs.paths, memory, log_file=scratch / "daemon.log") as pid:
        devs.confine(pid)
        sync_mount(mnt)
        sectors0 = sum(block_sectors_written(d) for d in devs.paths)
        io0 = proc_io(pid)["write_bytes"]
        t0 = time.perf_counter()
        blocked = save_loop(mnt, sd, pattern, saves, gap)
        sync_mount(mnt)
        durable = time.perf_counter() - t0
        device_bytes = (sum(block_sectors_written(d) for d in devs.paths) - sectors0) * 512
        daemon_bytes = proc_io(pid)["write_bytes"] - io0
        files = sorted(mnt.iterdir())
        file_bytes = files[0].stat().st_size
        states = {os.getxattr(f, "user.ckptfs.state").decode() for f in files}
    return {"saved_bytes": saves * file_bytes, "device_bytes": device_bytes, "daemon_write_bytes": daemon_bytes,
            "blocked_s": blocked, "durable_s": durable, "final_states": sorted(states)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="256M")
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--gap", type=float, default=0.1, help="seconds between saves")
    ap.add_argument("--throttle", default="100M", help="write limit per device: slower than the saves")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    ap.add_argument("--memory", default="3G")
    ap.add_argument("--scratch", type=Path, default=SCRATCH / "samepath")
    args = ap.parse_args(argv)
    size, throttle = parse_size(args.size), parse_size(args.throttle)
    patterns = args.patterns.split(",")
    scratch = args.scratch.resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    sd = random_state_dict(size, seed=5)
    # room for every distinct save, half on each device, plus ckptfs's superblock and journal
    devs = Devices(scratch, 2, DATA_OFFSET + args.saves * size // 2 + size + (256 << 20), throttle, loop=True)
    runs: dict[str, list[dict]] = {p: [] for p in patterns}
    t_start = time.perf_counter()
    try:
        for rnd in range(args.repeats):
            for pattern in patterns[rnd % len(patterns):] + patterns[:rnd % len(patterns)]:
                r = one_run(devs, scratch, sd, pattern, args.saves, args.gap, args.memory)
                runs[pattern].append(r)
                print(f"round {rnd + 1} {pattern:9s}: saved {r['saved_bytes'] / 2**20:.0f} MiB, devices got "
                      f"{r['device_bytes'] / 2**20:.0f} MiB ({r['device_bytes'] / r['saved_bytes']:.2f}); "
                      f"durable after {r['durable_s']:.1f} s; {r['final_states']}", flush=True)
    finally:
        devs.close()

    rows = {}
    for pattern, rs in runs.items():
        rows[pattern] = {
            "saved_bytes": rs[0]["saved_bytes"],
            "device_bytes": stats([r["device_bytes"] for r in rs]),
            "daemon_write_bytes": stats([r["daemon_write_bytes"] for r in rs]),
            "device_over_saved": stats([r["device_bytes"] / r["saved_bytes"] for r in rs]),
            "blocked_s": stats([b for r in rs for b in r["blocked_s"]]),
            "durable_s": stats([r["durable_s"] for r in rs]),
            "final_states": sorted({s for r in rs for s in r["final_states"]}),
        }
    checks = []  # what this case shows (no numeric target in the issue): stale copies are skipped
    for pattern in ("same-path", "rename"):
        if pattern in rows:
            checks.append(target(f"every step to one path ({pattern}): device bytes / bytes saved",
                                 rows[pattern]["device_over_saved"]["median"], 0.9,
                                 note="below 1: overwritten saves were not drained"))
    data = {
        "benchmark": "samepath", "when": now(), "seconds": time.perf_counter() - t_start, "machine": machine(),
        "config": {"size": args.size, "saves": args.saves, "gap_s": args.gap, "throttle_bps": throttle,
                   "repeats": args.repeats, "memory": args.memory, "patterns": patterns,
                   "devices": f"2 loop devices (--direct-io=on) over sparse files, each throttled to "
                              f"{args.throttle}/s of writes by cgroup v1 blkio"},
        "rows": rows, "checks": checks,
    }
    for pattern, r in rows.items():
        print(f"  {pattern:9s}: saved {r['saved_bytes'] / 2**20:.0f} MiB, devices "
              f"{r['device_bytes']['median'] / 2**20:.0f} MiB, ratio {r['device_over_saved']['median']:.2f}")
    return finish("samepath", data)


if __name__ == "__main__":
    sys.exit(main())
