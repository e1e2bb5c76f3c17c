"""Two (or more) revisions of ckptfs side by side on the small-file cases: did a change help?

Each `--revs` revision (any git revision; `.` is the working tree as it is) is
checked out into a worktree under scratch/revisions/. Every round mounts each
revision in turn (the order reversed every other round, so a slow phase of a
shared machine hits them all) over its own two file devices, `--engine`, and
runs smallfiles.py's cases (`--cases`: meta, new-file, copystat, lightning,
hf-trainer, safetensors) in it. The daemon runs the revision's code (the CLI
starts in its worktree, with it on PYTHONPATH); the cases are this checkout's.
Prints each figure's runs and median per revision, and its ratio to the first
revision taken round by round. The way to measure a change on a noisy
machine: two runs of one revision an hour apart differ more than the change.
A diagnostic, not a `make bench` case: no targets, no results file.

    .venv/bin/python benchmarks/probes/revisions.py --revs 83bbc43,. --rounds 6 --cases meta,lightning,hf-trainer
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py and the cases
import smallfiles  # noqa: E402
from common import ROOT, SCRATCH, GiB, file_devices, mounted, pairwise, remove_worktrees, revision, stats, worktree

CASES = ["meta", *smallfiles.CASES]


def one_round(mp: Path, cases: list[str], files: int, n: int) -> dict[str, float]:
    out = {}
    for case in cases:
        sub = mp / case
        sub.mkdir()
        if case == "meta":
            out.update(smallfiles.meta(sub, files))
        else:
            out[case] = smallfiles.CASES[case](sub, n)
        shutil.rmtree(sub)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--revs", required=True, help="comma-separated git revisions; '.' is the working tree")
    ap.add_argument("--cases", default="meta,new-file,copystat,lightning,hf-trainer")
    ap.add_argument("--engine", default="native", choices=("native", "pyfuse3"))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--files", type=int, default=100, help="files for chmod/utime/stat (meta)")
    ap.add_argument("--n", type=int, default=15, help="saves per framework case and round")
    ap.add_argument("--memory", default="1G")
    ap.add_argument("--scratch", type=Path, default=SCRATCH / "revisions")
    args = ap.parse_args(argv)
    revs, cases = args.revs.split(","), args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown or len(revs) < 2:
        ap.error(f"unknown case(s) {unknown} (known: {', '.join(CASES)})" if unknown else "give two revisions or more")
    scratch = args.scratch.resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    trees = {rev: worktree(rev, scratch) for rev in revs}
    res: dict[str, dict[str, list[float]]] = {rev: {} for rev in revs}
    try:
        for rnd in range(args.rounds):
            for i, rev in enumerate(revs if rnd % 2 == 0 else revs[::-1]):
                devices = file_devices(scratch / f"devices{i}", 2, 2 * GiB)
                mp = scratch / f"mnt{i}"
                try:
                    with revision(trees[rev]), mounted(mp, devices, args.memory, extra=("--engine", args.engine)):
                        for k, v in one_round(mp, cases, args.files, args.n).items():
                            res[rev].setdefault(k, []).append(v)
                finally:
                    for d in devices:
                        d.unlink(missing_ok=True)
            print(f"round {rnd + 1} of {args.rounds} done", flush=True)
    finally:
        remove_worktrees(trees)
    first = revs[0]
    print(f"engine {args.engine}, {args.rounds} rounds; microseconds: median (runs); ratio to {first}, round by round")
    for k in res[first]:
        row = [f"{k:12s}"]
        for rev in revs:
            s = stats(res[rev][k])
            runs = " ".join(f"{x * 1e6:.0f}" for x in s["runs"])
            ratio = "" if rev == first else f" x{pairwise(res[rev][k], res[first][k])['median']:.2f}"
            row.append(f"{rev}: {s['median'] * 1e6:.0f} ({runs}){ratio}")
        print("  ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
