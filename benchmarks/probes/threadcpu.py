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
of adopted, copied and realigned WRITE pieces and of waits for the loop lock
over the measured saves. A diagnostic, not
a `make bench` case: no targets, no results file. With `--writers 1` (the
default) the saves are in one process, so the figures also say what one rank
costs; `--writers N`: N processes save at once, each into its own files (the
ranks of a node), and the saving processes' CPU is theirs together.

    .venv/bin/python benchmarks/probes/threadcpu.py --tensor-mib 20.25 --tensors 8 --saves 20
    .venv/bin/python benchmarks/probes/threadcpu.py --tensor-mib 64.5 --tensors 8 --saves 4 --writers 4 --memory 6G
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py and the cases
from common import GiB, MiB, SCRATCH, file_devices, mounted, stat_user_system, sync_mount  # noqa: E402


def thread_cpu(pid: int, split: bool = False) -> dict[str, float]:
    """CPU seconds so far of each thread name of process `pid`, numbered names as one ("Trio
    thread N": trio's worker threads, the drain's and the journal's); with `split`, user and
    system time apart ("NAME usr", "NAME sys")."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
        except FileNotFoundError:
            continue  # a thread that just ended
        name = re.sub(r" \d+$", " N", raw[raw.index("(") + 1:raw.rindex(")")])
        user, system = stat_user_system(raw)
        for key, s in ({f"{name} usr": user, f"{name} sys": system} if split else {name: user + system}).items():
            out[key] = out.get(key, 0.0) + s
    return out


def engine_counts(mp: Path) -> dict[str, int]:
    """The native engine's WRITE counts so far (whole mount; empty for pyfuse3)."""
    status = json.loads(subprocess.run([sys.executable, "-m", "ckptfs", "status", str(mp), "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    es = status.get("engine_stats") or {}
    if not es:
        return {}
    lock = es.get("lock") or {}
    counts = {"write": es["session"]["requests"].get("write", 0), "lock_waits": lock.get("waits", 0),
              "lock_wait_s": lock.get("wait_s", 0.0)}
    counts.update({k: es[k] for k in ("adopted", "copied", "shifted", "shifted_adopted", "realigned",
                                      "realigned_bytes")})
    return counts


def saves(sd: dict, mp: Path, rank: int, n: int, pause: float, start=None) -> None:
    """One writer's `n` saves into three file names in turn (after `start`, a barrier, if given)."""
    if start is not None:
        start.wait()
    for i in range(n):
        torch.save(sd, mp / f"r{rank}-ck{i % 3}.pt")
        time.sleep(pause)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="native", choices=("native", "pyfuse3"))
    ap.add_argument("--tensor-mib", type=float, default=20.25, help="MiB per tensor (off the chunk grid unless whole)")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--saves", type=int, default=20)
    ap.add_argument("--pause", type=float, default=0.25, help="seconds between saves")
    ap.add_argument("--memory", default="2G")
    ap.add_argument("--writers", type=int, default=1, help="processes saving at once, each into its own files")
    ap.add_argument("--user-system", action="store_true", help="each thread's user and system CPU apart")
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
        counts0 = engine_counts(mp)
        before, mine = thread_cpu(pid, args.user_system), os.times()
        if args.writers == 1:
            saves(sd, mp, 0, args.saves, args.pause)
        else:
            ctx = multiprocessing.get_context("fork")
            start = ctx.Barrier(args.writers)
            procs = [ctx.Process(target=saves, args=(sd, mp, r, args.saves, args.pause, start))
                     for r in range(args.writers)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        sync_mount(mp)
        after, mine2 = thread_cpu(pid, args.user_system), os.times()
        counts = {k: v - counts0.get(k, 0) for k, v in engine_counts(mp).items()}
    gib = args.writers * args.saves * size / GiB
    split = {k: v - before.get(k, 0.0) for k, v in after.items()}
    writer = sum(getattr(mine2, f) - getattr(mine, f) for f in ("user", "system", "children_user", "children_system"))
    print(f"{args.writers} x {args.saves} saves of {size / MiB:.0f} MiB ({args.tensors} x {args.tensor_mib} MiB), "
          f"engine {args.engine}: CPU s per GiB saved")
    print(f"  saving process  {writer / gib:.3f}")
    print(f"  daemon          {sum(split.values()) / gib:.3f}")
    for name, s in sorted(split.items(), key=lambda kv: -kv[1]):
        if s / gib >= 0.005:
            print(f"    {name:16s} {s / gib:.3f}")
    if counts:
        print("  engine counts (these saves): " + ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
