"""What the trio thread does: its task steps and CPU per task, per GiB saved and restored.

Mounts ckptfs over two file devices under scratch/ with a trio Instrument in
the daemon (this script runs `ckptfs mount --foreground` itself, with
`trio.run` wrapped: `--serve`), saves budget.py's model + Adam state dict (20
`nn.Linear(1024, 1024)`, 240 MiB) `--saves` times under new
names and waits until they are durable, then remounts, drops the page cache
and `torch.load`s each. For each phase it prints, per GiB, the trio thread's
CPU and task steps by task (trio's name: the coroutine, or
`<TrioToken.run_sync_soon task>` for calls other threads queue, `LoopLock.soon`
among them), busiest first. Steps count the scheduler passes that ran a task:
each costs the interpreter lock even when the task finds nothing to do, so a
count far above the work done (batches, commits, fetches) points at wake-ups
to remove. A diagnostic, not a `make bench` case: no targets, no results file.

    .venv/bin/python benchmarks/probes/triotasks.py --saves 8
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py, budget.py
from budget import payload  # noqa: E402
from common import GiB, SCRATCH, ckptfs, clear_dir, drop_caches, file_devices, is_mounted  # noqa: E402

DUMP_EVERY = 0.1  # seconds between the daemon's dumps of its counters


def serve(out: str, argv: list[str]) -> int:
    """In the daemon: count steps and thread CPU per trio task, dump them to `out` as JSON every
    DUMP_EVERY seconds, and run the ckptfs command line `argv` (a `mount --foreground`)."""
    import trio

    counts: collections.Counter = collections.Counter()

    class Tasks(trio.abc.Instrument):
        def before_task_step(self, task):
            self.cpu = time.thread_time()

        def after_task_step(self, task):
            counts["steps", task.name] += 1
            counts["cpu", task.name] += time.thread_time() - self.cpu

    def dump():
        while True:
            time.sleep(DUMP_EVERY)
            snap = [[kind, name, n] for (kind, name), n in list(counts.items())]
            with open(out + ".tmp", "w") as f:
                json.dump(snap, f)
            os.replace(out + ".tmp", out)

    run = trio.run

    def instrumented(*args, **kw):
        kw["instruments"] = [*kw.get("instruments", ()), Tasks()]
        return run(*args, **kw)

    trio.run = instrumented
    threading.Thread(target=dump, daemon=True).start()
    from ckptfs.cli import main
    return main(argv)


def snapshot(out: Path) -> collections.Counter:
    time.sleep(3 * DUMP_EVERY)  # a dump taken after the phase ended
    return collections.Counter({(kind, name): n for kind, name, n in json.loads(out.read_text())})


def start(mp: Path, devices: list[Path], args, out: Path, fmt: bool) -> subprocess.Popen:
    out.unlink(missing_ok=True)
    mp.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--serve", str(out), "mount", str(mp), "--foreground",
           "--devices", ",".join(map(str, devices)), "--memory", args.memory, "--dedupe", args.dedupe]
    if fmt:
        cmd += ["--format", "--force"]
    daemon = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (is_mounted(mp) and out.exists()):
        if daemon.poll() is not None or time.monotonic() > deadline:
            daemon.kill()
            raise SystemExit(f"the mount did not start: {daemon.communicate()[1].strip()}")
        time.sleep(0.1)
    return daemon


def stop(mp: Path, daemon: subprocess.Popen) -> None:
    ckptfs("umount", str(mp))
    daemon.wait(timeout=120)


def report(phase: str, before: collections.Counter, after: collections.Counter, gib: float, top: int) -> None:
    delta = after - before
    names = {name for _, name in delta}
    rows = sorted(((delta["cpu", n] / gib * 1e3, delta["steps", n] / gib, n) for n in names), reverse=True)
    cpu = sum(r[0] for r in rows)
    steps = sum(r[1] for r in rows)
    print(f"\n{phase}: trio thread {cpu:.1f} CPU ms and {steps:.0f} task steps per GiB")
    print(f"  {'CPU ms/GiB':>10} {'steps/GiB':>9} {'us/step':>8}  task")
    for ms, n, name in rows[:top]:
        print(f"  {ms:10.2f} {n:9.1f} {ms * 1e3 / n if n else 0:8.1f}  {name}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return serve(argv[1], argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("--memory", default="4G", help="the mount's --memory: room for every save")
    p.add_argument("--dedupe", choices=["on", "off"], default="off",
                   help="off (default): every save is written (they repeat one state dict)")
    p.add_argument("--top", type=int, default=12, help="tasks shown per phase")
    p.add_argument("--scratch", type=Path, default=SCRATCH / "triotasks")
    args = p.parse_args(argv)

    import torch
    state = payload("adam")

    mp, out = args.scratch / "mnt", args.scratch / "tasks.json"
    devices = file_devices(args.scratch, 2, 8 * GiB)
    try:
        daemon = start(mp, devices, args, out, fmt=True)
        try:
            before = snapshot(out)
            for i in range(args.saves):
                torch.save(state, mp / f"save{i}.pt")
            ckptfs("wait", str(mp))
            gib = sum((mp / f"save{i}.pt").stat().st_size for i in range(args.saves)) / GiB
            report(f"{args.saves} saves until durable ({gib:.2f} GiB)", before, snapshot(out), gib, args.top)
        finally:
            stop(mp, daemon)
        daemon = start(mp, devices, args, out, fmt=False)
        try:
            drop_caches()
            before = snapshot(out)
            for i in range(args.saves):
                torch.load(mp / f"save{i}.pt")
            report("restore after a remount (torch.load)", before, snapshot(out), gib, args.top)
        finally:
            stop(mp, daemon)
    finally:
        clear_dir(args.scratch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
