"""Copying a file inside the mount: `cp` (copy_file_range) and shutil.copyfile (sendfile), ckptfs vs ext4.

Mounts ckptfs on each `--engines` engine (two file devices under scratch/),
writes one `--size` random file into each mount and into an ext4 folder under
scratch/, makes it durable, then for `--rounds` rounds copies it with `cp`
(coreutils: copy_file_range) and with Python's shutil.copyfile (sendfile), in
rotated order, checking every copy's bytes. Prints the median seconds per
copy and the ratio to ext4 round by round, and the FUSE requests one copy
made (the native engine's counts; `copy_file_range` 1 means the daemon copied
it in one request, `write` N means the kernel spliced it through N WRITEs).
A diagnostic, not a `make bench` case: no targets, no results file.

    .venv/bin/python benchmarks/probes/copyfile.py --size 256M --rounds 3
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py and the cases
from common import GiB, SCRATCH, file_devices, mounted, pairwise, parse_size, rotated, sync_mount  # noqa: E402

EXT4 = "ext4"
COPIERS = {"cp": lambda a, b: subprocess.run(["cp", str(a), str(b)], check=True),
           "shutil.copyfile": shutil.copyfile}


def engine_counts(mp: Path) -> dict[str, int]:
    out = subprocess.run(["ckptfs", "status", "--json", str(mp)], check=True, capture_output=True, text=True)
    es = json.loads(out.stdout).get("engine_stats") or {}
    return dict(es["session"]["requests"]) if es else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="256M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default="native,pyfuse3")
    ap.add_argument("--memory", default="2G")
    a = ap.parse_args(argv)
    size, engines = parse_size(a.size), a.engines.split(",")
    payload = os.urandom(size)
    scratch = SCRATCH / "copyfile"
    shutil.rmtree(scratch, ignore_errors=True)
    dirs = {EXT4: scratch / "ext4"}
    dirs[EXT4].mkdir(parents=True)
    times = {s: {c: [] for c in COPIERS} for s in [*engines, EXT4]}
    requests: dict[str, dict[str, dict]] = {e: {} for e in engines}
    try:
        with contextlib.ExitStack() as stack:
            for e in engines:
                devs = file_devices(scratch / f"devices-{e}", 2, 4 * size + 2 * GiB)
                dirs[e] = scratch / f"mnt-{e}"
                stack.enter_context(mounted(dirs[e], devs, a.memory, extra=("--engine", e)))
            for d in dirs.values():
                (d / "src").write_bytes(payload)
            for e in engines:
                sync_mount(dirs[e])
            os.sync()
            for rnd in range(a.rounds):
                for system in rotated(list(dirs), rnd):
                    for name, copy in COPIERS.items():
                        dst = dirs[system] / f"copy-{rnd}"
                        before = engine_counts(dirs[system]) if system != EXT4 else {}
                        t0 = time.perf_counter()
                        copy(dirs[system] / "src", dst)
                        times[system][name].append(time.perf_counter() - t0)
                        if system != EXT4:
                            after = engine_counts(dirs[system])
                            requests[system][name] = {k: v - before.get(k, 0) for k, v in after.items()
                                                      if v != before.get(k, 0) and k in ("write", "copy_file_range")}
                        if dst.read_bytes() != payload:
                            raise SystemExit(f"copyfile: {name} into {system} did not copy the bytes")
                        dst.unlink()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"copy of a {a.size} file inside the filesystem, {a.rounds} rounds (median seconds; ratio to ext4)")
    for name in COPIERS:
        base = times[EXT4][name]
        print(f"  {name}: ext4 {statistics.median(base):.3f} s")
        for e in engines:
            ratio = pairwise(times[e][name], base)["median"]
            print(f"    ckptfs-{e} {statistics.median(times[e][name]):.3f} s, {ratio:.2f}x ext4, "
                  f"requests {requests[e].get(name, {})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
