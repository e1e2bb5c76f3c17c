"""Device space of many small files: a source tree and a virtualenv written into a mount.

Mounts ckptfs (`--engine`, two file devices under scratch/), then writes what a
user's tools write: `git clone` of this repository, `python -m venv` (pip's
~1,600 files), and `--copies` copies of the checked-out tree with
`shutil.copytree`. It waits until everything is durable and prints the file
count, the bytes `du` counts (the 4 KiB blocks the files hold), the device
space the pool uses (`ckptfs status`: a data unit counts as used while any
piece of it is) and the wall time. A diagnostic, not a `make bench` case:
no targets, no results file. The pool's format decides the figure: from
format version 3 a small chunk takes a piece of a unit (docs/FORMAT.md);
`--format-version 2` rewrites the fresh pool's superblocks as version 2,
whose chunks each take a whole unit, for a side-by-side figure.

    .venv/bin/python benchmarks/probes/treespace.py [--engine native] [--copies 1] [--format-version 2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py and the cases
from common import GiB, MiB, ROOT, SCRATCH, ckptfs, file_devices, mounted, sync_mount  # noqa: E402


def tree_bytes(root: Path) -> tuple[int, int]:
    """(files, bytes of the 512-byte blocks they hold) under `root`, as `du` counts."""
    files = held = 0
    for d, _, names in os.walk(root):
        for n in names:
            st = os.lstat(os.path.join(d, n))
            files += 1
            held += st.st_blocks * 512
    return files, held


def as_version_2(devices: list[Path]) -> None:
    """Rewrite a freshly formatted pool's superblocks as format version 2 (whole units)."""
    from dataclasses import replace
    from ckptfs.format.layout import SB_SIZE, Superblock
    for d in devices:
        with open(d, "r+b") as f:
            sb = Superblock.decode(f.read(SB_SIZE))
            f.seek(0)
            f.write(replace(sb, version=2).encode())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", default="native", choices=["native", "pyfuse3"])
    ap.add_argument("--copies", type=int, default=1, help="copies of the checked-out tree")
    ap.add_argument("--format-version", type=int, default=3, choices=[2, 3])
    ap.add_argument("--scratch", default=str(SCRATCH / "treespace"))
    args = ap.parse_args(argv)
    scratch = Path(args.scratch)
    devices = file_devices(scratch / "devices", 2, 3 * GiB)
    mp = scratch / "mnt"
    try:
        ckptfs("format", "--devices", ",".join(map(str, devices)))
        if args.format_version == 2:
            as_version_2(devices)
        with mounted(mp, devices, "2G", fmt=False, extra=("--engine", args.engine),
                     log_file=scratch / "daemon.log"):
            t0 = time.perf_counter()
            subprocess.run(["git", "clone", "-q", str(ROOT), str(mp / "repo")], check=True)
            subprocess.run([sys.executable, "-m", "venv", str(mp / "venv")], check=True)
            for i in range(args.copies):
                shutil.copytree(mp / "repo", mp / f"copy{i}", ignore=shutil.ignore_patterns(".git"))
            elapsed = time.perf_counter() - t0
            sync_mount(mp)
            files, held = tree_bytes(mp)
            out = subprocess.run([sys.executable, "-m", "ckptfs", "status", str(mp), "--json"],
                                 capture_output=True, text=True, check=True, cwd=ROOT)
            used = json.loads(out.stdout)["pool"]["used"]
    finally:
        for d in devices:
            d.unlink(missing_ok=True)
    print(f"format version {args.format_version}, engine {args.engine}: {files} files, du {held / MiB:.1f} MiB, "
          f"devices used {used / MiB:.1f} MiB ({used / max(held, 1):.2f}x du), written in {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
