"""Engines side by side: the daemon's CPU per GiB and the metadata latency, pyfuse3 vs native.

For each FUSE front end (`--engine pyfuse3|native`), in one run, interleaved
round by round so both see the same machine noise, over two file-backed
devices and `--memory`:

  * dd: `dd if=/dev/zero of=MNT/f bs=64M count=16 oflag=direct` (a page-aligned
    writer);
  * unaligned: Python os.write of one 64 MiB `bytes` x16 (an unaligned buffer);
  * torch.save of a 1 GiB state dict (random fp32 tensors);
  * cold read: the torch.save file read back with 1 MiB reads after a remount
    and drop_caches (so every byte comes from the devices);
  * metadata: median latency of chmod, utime and os.stat of one file in the
    mount, and of the same calls on ext4 (a file under /tmp) as the baseline.

Each write is followed by a sync of the mount (not timed); its file is then
deleted. The daemon's CPU (utime + stime of all its threads, /proc/PID/stat)
is read around each write and each cold read, so CPU s per GiB counts what
the daemon spent while the bytes went in (the drain is held back meanwhile)
or came out. Prints one table per measure with the two engines' medians and
native / pyfuse3, then the issue's 2-core targets for the native engine;
writes benchmarks/results/engines.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py and the cases
from common import (GiB, ROOT, drop_caches, file_devices, finish, machine, mounted, proc_cpu_seconds,  # noqa: E402
                    random_state_dict, rotated, stats, sync_mount, target)

ENGINES = ("pyfuse3", "native")
BLOCK = 64 << 20
META_OPS = 2000


def _dd(path: Path) -> None:
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", "count=16", "oflag=direct"],
                   check=True, capture_output=True)


def _unaligned(path: Path) -> None:
    block = os.urandom(1 << 20) * 64  # a bytes object: its data is not page-aligned
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(16):
            if os.write(fd, block) != len(block):
                raise OSError(f"short write to {path}")
    finally:
        os.close(fd)


def _measure(pid: int, fn, path: Path, nbytes: int) -> tuple[float, float]:
    """(GB/s, daemon CPU s per GiB) of fn(path) moving `nbytes`."""
    c0, t0 = proc_cpu_seconds(pid), time.perf_counter()
    fn(path)
    t1, c1 = time.perf_counter(), proc_cpu_seconds(pid)
    return nbytes / (t1 - t0) / 1e9, (c1 - c0) / (nbytes / GiB)


def _read_all(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    buf = bytearray(1 << 20)
    n = 0
    try:
        while True:
            got = os.readv(fd, [buf])
            if not got:
                return n
            n += got
    finally:
        os.close(fd)


def metadata(path: Path, n: int = META_OPS) -> dict[str, float]:
    """Median microseconds of chmod, utime and stat of `path`."""
    out = {}
    for name, call in (("chmod", lambda i: os.chmod(path, 0o600 | (i & 1) << 2)),
                       ("utime", lambda i: os.utime(path, (i, i))),
                       ("stat", lambda i: os.stat(path))):
        times = []
        for i in range(n):
            t0 = time.perf_counter_ns()
            call(i)
            times.append(time.perf_counter_ns() - t0)
        out[name] = statistics.median(times) / 1000
    return out


def one_round(engine: str, scratch: Path, memory: str, sd: dict) -> dict:
    mnt = scratch / f"mnt-{engine}"
    devices = file_devices(scratch / f"devices-{engine}", 2, 4 * GiB)
    extra = ("--engine", engine)
    r: dict = {}
    with mounted(mnt, devices, memory, extra=extra) as pid:
        import torch
        for name, fn in (("dd", _dd), ("unaligned", _unaligned),
                         ("torch_save", lambda p: torch.save(sd, p))):
            f = mnt / f"{name}.bin"
            nbytes = GiB if name != "torch_save" else None
            if nbytes is None:
                c0, t0 = proc_cpu_seconds(pid), time.perf_counter()
                fn(f)
                t1, c1 = time.perf_counter(), proc_cpu_seconds(pid)
                size = f.stat().st_size
                r[name] = (size / (t1 - t0) / 1e9, (c1 - c0) / (size / GiB))
            else:
                r[name] = _measure(pid, fn, f, nbytes)
            sync_mount(mnt)
            if name != "torch_save":
                f.unlink()
        meta_file = mnt / "meta"
        meta_file.write_bytes(b"x" * 1000)
        r["meta"] = metadata(meta_file)
    with mounted(mnt, devices, memory, fmt=False, extra=extra) as pid:
        drop_caches()
        f = mnt / "torch_save.bin"
        c0, t0 = proc_cpu_seconds(pid), time.perf_counter()
        n = _read_all(f)
        t1, c1 = time.perf_counter(), proc_cpu_seconds(pid)
        r["cold_read"] = (n / (t1 - t0) / 1e9, (c1 - c0) / (n / GiB))
    return r


def main() -> int:
    p = argparse.ArgumentParser(description="pyfuse3 vs native engine: daemon CPU per GiB, metadata latency")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each measuring both engines (default 2)")
    p.add_argument("--memory", default="2G", help="ckptfs memory budget (default %(default)s)")
    p.add_argument("--scratch", type=Path, default=ROOT / "scratch" / "engines")
    args = p.parse_args()
    scratch = args.scratch.resolve()
    sd = random_state_dict(GiB)
    runs: dict[str, list[dict]] = {e: [] for e in ENGINES}
    for k in range(args.rounds):
        for engine in rotated(list(ENGINES), k):
            print(f"round {k + 1}: {engine}", flush=True)
            runs[engine].append(one_round(engine, scratch, args.memory, sd))
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        base = Path(d) / "meta"
        base.write_bytes(b"x" * 1000)
        ext4 = metadata(base)
    data: dict = {"machine": machine(), "rounds": args.rounds, "memory": args.memory, "ext4_meta_us": ext4}
    print("\n| measure | pyfuse3 | native | native / pyfuse3 |\n|---|---|---|---|")
    for key in ("dd", "unaligned", "torch_save", "cold_read"):
        for i, unit in ((0, "GB/s"), (1, "CPU s/GiB")):
            vals = {e: stats([r[key][i] for r in runs[e]]) for e in ENGINES}
            data[f"{key}_{'gbps' if i == 0 else 'cpu_per_gib'}"] = vals
            a, b = vals["pyfuse3"]["median"], vals["native"]["median"]
            print(f"| {key} {unit} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    for op in ("chmod", "utime", "stat"):
        vals = {e: stats([r["meta"][op] for r in runs[e]]) for e in ENGINES}
        data[f"{op}_us"] = vals
        a, b = vals["pyfuse3"]["median"], vals["native"]["median"]
        print(f"| {op} us (ext4 {ext4[op]:.1f}) | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    absorb = max(data[f"{k}_cpu_per_gib"]["native"]["median"] for k in ("dd", "unaligned", "torch_save"))
    data["targets"] = [
        target("native daemon CPU s per GiB absorbed (worst writer)", absorb, 0.25),
        target("native daemon CPU s per GiB on cold read", data["cold_read_cpu_per_gib"]["native"]["median"], 0.4),
        *(target(f"native median {op} us", data[f"{op}_us"]["native"]["median"], 60)
          for op in ("chmod", "utime", "stat")),
    ]
    return finish("engines", data)


if __name__ == "__main__":
    sys.exit(main())
