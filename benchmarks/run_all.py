"""The benchmark suite (`make bench`): every case, then tables, plots and docs/PERFORMANCE.md.

Runs benchmarks/<case>.py for save, training, restore, scale, samepath, smallfiles, replicate, budget
and incremental, each in its own process (its memory is returned before the next; a failing case
does not stop the others), writing benchmarks/results/<case>.json.
Then report.py turns whatever results exist into
benchmarks/results/summary.md, summary.json, <case>.png and
docs/PERFORMANCE.md. Exits non-zero if any case failed.

Budget: ~15 minutes on a 2-core machine with the defaults; --quick is a smoke
run of a few minutes (smaller sizes, one round): its numbers say little.

usage: python benchmarks/run_all.py [--cases save,training,...] [--quick] [--repeats N]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from common import RESULTS, ROOT
from report import CASES, build

# arguments every run of a case gets (training also measures a replicating mount: issue 13's overhead)
ALWAYS = {"training": ["--replicate"]}
# the smoke run's arguments per case
QUICK = {
    "save": ["--sizes", "256M,512M", "--repeats", "1"],
    "training": ["--repeats", "1", "--steps", "4", "--every", "1,4", "--batch-size", "128"],
    "restore": ["--size", "256M", "--repeats", "1"],
    "scale": ["--repeats", "1", "--per-writer", "128M", "--size", "256M", "--devices", "1,2"],
    "samepath": ["--repeats", "1", "--saves", "4", "--size", "128M"],
    "smallfiles": ["--repeats", "1", "--files", "50", "--n", "5"],
    "replicate": ["--repeats", "1", "--size", "256M", "--latency-size", "64M"],
    "budget": ["--repeats", "1", "--saves", "4"],
    "incremental": ["--layers", "4", "--steps", "2"],
}


def preflight() -> list[str]:
    problems = []
    if os.geteuid() != 0:
        problems.append("run as root (mounts, loop devices, drop_caches, cgroups)")
    if not os.path.exists("/dev/fuse"):
        problems.append("/dev/fuse is missing")
    if not os.path.isdir("/sys/fs/cgroup/blkio"):
        problems.append("no cgroup v1 blkio hierarchy: the throttled devices of scale and samepath need it")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, default all: %(default)s")
    ap.add_argument("--quick", action="store_true", help="smoke run: small sizes, one round")
    ap.add_argument("--repeats", type=int, help="rounds for every case (default: each case's own, 3)")
    ap.add_argument("--no-report", action="store_true", help="only the cases' JSON")
    args = ap.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    bad = set(cases) - set(CASES)
    if bad:
        ap.error(f"unknown cases {sorted(bad)}; choose from {CASES}")
    problems = preflight()
    if problems:
        print("run_all: cannot run the suite here:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2

    status: dict[str, dict] = {}
    t0 = time.perf_counter()
    for case in cases:
        extra = ALWAYS.get(case, []) + (list(QUICK[case]) if args.quick else [])
        if args.repeats is not None:
            extra += ["--repeats", str(args.repeats)]
        (RESULTS / f"{case}.json").unlink(missing_ok=True)  # a failed case must not leave an old result
        print(f"\n=== {case} ===", flush=True)
        t = time.perf_counter()
        rc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{case}.py"), *extra]).returncode
        status[case] = {"rc": rc, "seconds": time.perf_counter() - t}
        print(f"=== {case}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {status[case]['seconds']:.0f} s",
              flush=True)
    total = time.perf_counter() - t0
    print(f"\nsuite: {len(cases)} case(s) in {total / 60:.1f} min", flush=True)
    if not args.no_report:
        summary = build(status)
        print((RESULTS / "summary.md").read_text())
        print(f"plots: {', '.join(summary['plots'].values()) or 'none'}")
        print(f"wrote {RESULTS / 'summary.md'} and docs/PERFORMANCE.md")
    failed = [c for c, s in status.items() if s["rc"] != 0]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
