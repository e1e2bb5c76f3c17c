"""Where the daemon's CPU goes: CPU s per GiB of repeated torch.saves, by daemon thread.

Mounts ckptfs (`--engine`, two file devices under scratch/), saves one state
dict of `--tensors` random fp32 tensors of `--tensor-mib` MiB each `--saves`
times (three file names in turn, `--pause` seconds between saves, like a
trainer checkpointing every step), waits until it is all durable, and prints
the CPU seconds per GiB saved of the saving process and of the daemon, the
daemon's split by thread name (/proc/PID/task/*/stat: the native engine's
FUSE workers show as "ckptfs-fuse N" (kernel/mount.py name_thread); the
trio thread as "python"; trio's worker threads, the drain's and
the journal's, as "Trio thread N"), and the native engine's counts
of adopted and copied WRITE pieces. A diagnostic, not a `make bench` case: no
targets, no results file. The saves are in one process, so the figures also
say what one rank costs.

    .venv/bin/python benchmarks/threadcpu.py --tensor-mib 20.25 --tensors 8 --saves 20
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import GiB, MiB, SCRATCH, file_devices, mounted, stat_cpu_seconds, sync_mount


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of each thread name of process `pid`, numbered names as one ("Trio
    thread N": trio's worker threads, the drain's and the journal's)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
        except FileNotFoundError:
            continue  # a thread that just ended
        name = re.sub(r" \d+$", " N", raw[raw.index("(") + 1:raw.rindex(")")])
        out[name] = out.get(name, 0.0) + stat_cpu_seconds(raw)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="native", choices=("native", "pyfuse3"))
    ap.add_argument("--tensor-mib", type=float, default=20.25, help="MiB per tensor (off the chunk grid unless whole)")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--saves", type=int, default=20)
    ap.add_argument("--pause", type=float, default=0.25, help="seconds between saves")
    ap.add_argument("--memory", default="2G")
    args = ap.parse_args()
    n = int(args.tensor_mib * MiB) // 4
    g = torch.Generator().manual_seed(0)
    sd = {f"w{i}": torch.rand(n, generator=g) for i in range(args.tensors)}
    size = args.tensors * n * 4
    mp = SCRATCH / "threadcpu" / "mnt"
    devices = file_devices(SCRATCH / "threadcpu", 2, 4 * GiB)
    with mounted(mp, devices, args.memory, extra=("--engine", args.engine)) as pid:
        torch.save(sd, mp / "warm.pt")  # the first save's set-up (lent slots, faults) not counted
        sync_mount(mp)
        before, mine = thread_cpu(pid), os.times()
        for i in range(args.saves):
            torch.save(sd, mp / f"ck{i % 3}.pt")
            time.sleep(args.pause)
        sync_mount(mp)
        after, mine2 = thread_cpu(pid), os.times()
        status = json.loads(subprocess.run([sys.executable, "-m", "ckptfs", "status", str(mp), "--json"],
                                           capture_output=True, text=True, check=True).stdout)
    gib = args.saves * size / GiB
    split = {k: v - before.get(k, 0.0) for k, v in after.items()}
    writer = (mine2.user - mine.user) + (mine2.system - mine.system)
    print(f"{args.saves} saves of {size / MiB:.0f} MiB ({args.tensors} x {args.tensor_mib} MiB), "
          f"engine {args.engine}: CPU s per GiB saved")
    print(f"  saving process  {writer / gib:.3f}")
    print(f"  daemon          {sum(split.values()) / gib:.3f}")
    for name, s in sorted(split.items(), key=lambda kv: -kv[1]):
        if s / gib >= 0.005:
            print(f"    {name:16s} {s / gib:.3f}")
    es = status.get("engine_stats") or {}
    counts = {k: es[k] for k in ("write", "adopted", "copied", "shifted", "shifted_adopted", "max_write") if k in es}
    if counts:
        print("  engine counts (whole mount): " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
