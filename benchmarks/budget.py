"""Case: budget. The daemon's CPU and interpreter-lock time per GiB saved, made durable and restored.

Whatever Python time the daemon spends per GiB caps one mount at 1 / (that
time) GiB/s on any number of cores: its threads share one interpreter lock.
This case measures that time on two checkpoints (`--payloads`):

  adam    a model + Adam state dict: 20 nn.Linear(1024, 1024) after one step
          (~240 MiB: 60 tensors of 4 MiB, 60 of 4 KiB, 20 scalars), what a
          trainer really saves;
  tensor  one 1 GiB fp32 tensor.

Per round, on one mount (two file devices under scratch/, `--engine`,
`--chunk-size`, `--memory`, `--dedupe`, off unless asked: the saves repeat one
state dict), with the daemon idle before and after each pass:

  absorb   `--saves` torch.saves, each into a fresh name, the previous file
           deleted first (its undrained chunks are dropped, never drained);
           the window ends when the last save returns; "drained" says how
           much of it reached the devices meanwhile (absorb-first drains
           while a save pauses);
  durable  the same saves, each followed by fsync of the file (start of
           torch.save to durable, summed); the last files are kept;
  drain    durable - absorb, per GiB: what making the bytes durable adds;
  restore  remount, drop caches, torch.load of the kept files (>= 1 GiB).

For each: wall GiB/s; the daemon's user and system CPU seconds per GiB
(/proc/PID/task/*/stat, the clock ticks 10 ms: hence many saves); the seconds
per GiB the daemon held the interpreter lock (lockprobe.py: py-spy's GIL
samples), split by thread (trio thread, FUSE workers, worker threads); the
ceiling it implies (1 / lock s per GiB, GiB/s); lock microseconds per FUSE
request and per chunk; the saving or loading process's CPU per GiB. Medians of
`--repeats` rounds (min-max).

    .venv/bin/python benchmarks/budget.py                     # ~3 minutes on 2 cores
    .venv/bin/python benchmarks/budget.py --payloads adam --chunk-size 4M --repeats 1
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from common import (SCRATCH, GiB, MiB, ckptfs, clear_dir, drop_caches, file_devices, finish, fsync_path, machine,
                    now, parse_size, remove_worktrees, revision, stat_user_system, stats, target, worktree)
from lockprobe import LockProbe

ROLES = ("trio", "fuse", "threads")
# issue 40's targets: lock seconds per GiB (a ceiling of 12, 20 and 12 GiB/s), user CPU through durable
LOCK_TARGETS = {"absorb": 0.08, "drain": 0.05, "restore": 0.08}
USER_TARGETS = {"adam": 0.20, "tensor": 0.15}


def payload(kind: str) -> dict:
    import torch
    torch.manual_seed(0)
    if kind == "tensor":
        return {"w": torch.rand(GiB // 4)}
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(20)])
    optim = torch.optim.Adam(model.parameters())
    model(torch.rand(8, 1024)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def daemon_cpu(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of every thread of `pid` so far (threads that ended included)."""
    with open(f"/proc/{pid}/stat") as f:
        return stat_user_system(f.read())


def thread_user(pid: int) -> dict[int, tuple[str, float]]:
    """Each live thread of `pid`: (its role, user CPU seconds so far). Names as the kernel keeps them:
    the FUSE workers "ckptfs-fuse N", the trio thread the process name, trio's worker threads
    "Trio thread N" (or the job's name)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
        except FileNotFoundError:
            continue
        name = raw[raw.index("(") + 1:raw.rindex(")")]
        kind = "fuse" if "-fuse " in name else "trio" if int(tid) == pid else "threads"
        out[int(tid)] = (kind, stat_user_system(raw)[0])
    return out


def user_by_role(before: dict, after: dict) -> dict[str, float]:
    """User CPU seconds per role between two `thread_user` readings (threads that came and went
    meanwhile are missing here, not in the process's total)."""
    out = dict.fromkeys(ROLES, 0.0)
    for tid, (kind, t) in after.items():
        out[kind] += t - before.get(tid, (kind, 0.0))[1]
    return out


def counters(mp: Path) -> dict[str, int]:
    """The native engine's request counts so far, by method (none for pyfuse3), and the bytes
    written to the devices ("device bytes"), from the control socket (no process started)."""
    from ckptfs.fuse.kernel.abi import Op
    from ckptfs.ops.control import Client, control_path
    with Client(control_path(str(mp))) as c:
        st = c.request({"op": "status", "limit": 0})["status"]
    names = {op.name.lower() for op in Op}
    got = {k: v for k, v in ((st.get("engine_stats") or {}).get("session") or {}).get("requests", {}).items()
           if k in names}
    got["device bytes"] = sum(d["bytes_written"] for d in st["pool"]["devices"])
    return got


class Window:
    """One measured pass: the daemon's CPU and lock time, the client's CPU, wall time, requests."""

    def __init__(self, mp: Path, pid: int):
        self.mp, self.pid = mp, pid

    def __enter__(self) -> "Window":
        self.req0 = counters(self.mp)
        self.probe = LockProbe(self.pid).__enter__()
        self.threads0 = thread_user(self.pid)
        self.cpu0, self.me0, self.t0 = daemon_cpu(self.pid), os.times(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.t0
        cpu1, me1 = daemon_cpu(self.pid), os.times()
        self.user_roles = user_by_role(self.threads0, thread_user(self.pid))
        req1 = counters(self.mp)  # before the probe ends: the drain goes on meanwhile
        self.probe.__exit__(*exc)
        self.user, self.system = (b - a for a, b in zip(self.cpu0, cpu1))
        self.client = (me1.user - self.me0.user) + (me1.system - self.me0.system)
        self.requests = {k: v - self.req0.get(k, 0) for k, v in req1.items() if v != self.req0.get(k, 0)}
        self.device_bytes = self.requests.pop("device bytes", 0)

    def figures(self, nbytes: int, chunk: int) -> dict:
        gib = nbytes / GiB
        lock = self.probe.seconds if LockProbe.available else None
        nreq = sum(self.requests.values())
        return {"bytes": nbytes, "drained": self.device_bytes / nbytes, "gibps": gib / self.wall, "user": self.user / gib, "system": self.system / gib,
                "client": self.client / gib, "lock": None if lock is None else lock / gib,
                "lock_roles": {r: self.probe.by_role.get(r, 0.0) / gib for r in ROLES},
                "user_roles": {r: self.user_roles[r] / gib for r in ROLES},
                "requests": self.requests, "lock_us_per_request": lock / nreq * 1e6 if lock and nreq else None,
                "lock_us_per_chunk": lock / (nbytes / chunk) * 1e6 if lock is not None else None,
                "top": self.probe.top(12), "probe_behind": self.probe.behind, "stacks": self.probe.stacks}


def one_round(kind: str, sd: dict, args, saves: int, scratch: Path) -> dict:
    import torch
    mp = scratch / "mnt"
    devices = file_devices(scratch, 2, 8 * GiB)
    opts = ["--devices", ",".join(map(str, devices)), "--memory", args.memory, "--engine", args.engine,
            "--chunk-size", args.chunk_size, "--dedupe", args.dedupe]
    mp.mkdir(parents=True, exist_ok=True)
    ckptfs("mount", str(mp), *opts, "--format", "--force")
    chunk = parse_size(args.chunk_size)
    out = {}
    try:
        pid = int(os.getxattr(mp, "user.ckptfs.pid"))
        torch.save(sd, mp / "warm.pt")  # first-save set-up (lent slots, page faults) not counted
        fsync_path(mp / "warm.pt")
        size = os.path.getsize(mp / "warm.pt")
        os.unlink(mp / "warm.pt")
        keep = max(1, math.ceil(GiB / size))
        with Window(mp, pid) as w:
            for i in range(saves):
                if i:  # first: its chunks are dropped, never drained, whatever pauses the save has
                    os.unlink(mp / f"a{i - 1}.pt")
                torch.save(sd, mp / f"a{i}.pt")
        out["absorb"] = w.figures(saves * size, chunk)
        clear_dir(mp)
        fsync_path(mp)
        time.sleep(0.5)
        with Window(mp, pid) as w:
            for i in range(saves):
                torch.save(sd, mp / f"d{i}.pt")
                fsync_path(mp / f"d{i}.pt")
                if i >= keep:
                    os.unlink(mp / f"d{i - keep}.pt")
        out["durable"] = w.figures(saves * size, chunk)
        kept = sorted(mp.glob("d*.pt"))
        if args.skip_restore:
            return out | {"checkpoint_bytes": size}
        ckptfs("umount", str(mp))
        ckptfs("mount", str(mp), *opts)
        pid = int(os.getxattr(mp, "user.ckptfs.pid"))
        drop_caches()
        time.sleep(0.5)
        with Window(mp, pid) as w:
            for p in kept:
                torch.load(p, map_location="cpu", weights_only=True)
        out["restore"] = w.figures(sum(p.stat().st_size for p in kept), chunk)
    finally:
        ckptfs("umount", str(mp))
        for d in devices:
            d.unlink(missing_ok=True)
    out["checkpoint_bytes"] = size
    return out


def drain(absorb: dict, durable: dict) -> dict:
    """What making the bytes durable adds, per GiB: durable - absorb (same saves, same sizes)."""
    keys = ("user", "system", "client", "lock")
    out = {k: (durable[k] - absorb[k]) if durable[k] is not None else None for k in keys}
    for k in ("lock_roles", "user_roles"):
        out[k] = {r: durable[k][r] - absorb[k][r] for r in ROLES}
    return out


def summarize(rounds: list[dict]) -> dict:
    """Per phase, stats() over the rounds of each figure."""
    out = {}
    for phase in ("absorb", "durable", "drain", "restore"):
        rs = [r[phase] for r in rounds if phase in r]
        if not rs:
            continue
        fig = {}
        for k in ("gibps", "drained", "user", "system", "client", "lock", "lock_us_per_request", "lock_us_per_chunk"):
            xs = [r[k] for r in rs if r.get(k) is not None]
            if xs:
                fig[k] = stats(xs)
        for k in ("lock_roles", "user_roles"):
            fig[k] = {role: stats([r[k][role] for r in rs]) for role in ROLES}
        if "lock" in fig:
            fig["ceiling_gibps"] = stats([1 / x for x in fig["lock"]["runs"] if x > 0] or [math.inf])
        if "requests" in rs[0]:
            fig["requests"] = rs[-1]["requests"]
            fig["top"] = rs[-1]["top"]
        out[phase] = fig
    return out


def payload_saves(sd: dict) -> int:
    """Saves per pass: about 4 GiB of the payload, at least 4."""
    import io
    import torch
    buf = io.BytesIO()
    torch.save(sd, buf)
    return max(4, round(4 * GiB / buf.tell()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--payloads", default="adam,tensor")
    ap.add_argument("--engine", default="native", choices=("native", "pyfuse3"))
    ap.add_argument("--chunk-size", default="1M")
    ap.add_argument("--memory", default="8G", help="enough that the absorb pass never presses the drain")
    ap.add_argument("--dedupe", default="off", choices=("on", "off"),
                    help="off (default): every save is written, as the targets assume (the saves repeat one "
                         "state dict, so with dedupe on nearly all of each would be shared); on: what the "
                         "digests add")
    ap.add_argument("--saves", type=int, default=None, help="saves per pass (default: ~4 GiB of each payload)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-restore", action="store_true")
    ap.add_argument("--revs", help="A/B: comma-separated git revisions ('.': the working tree), each round in "
                                   "turn, the order reversed every other round; prints ratios to the first, "
                                   "writes no results file")
    ap.add_argument("--scratch", type=Path, default=SCRATCH / "budget")
    ap.add_argument("--top", action="store_true", help="print where the lock time went (innermost frames)")
    ap.add_argument("--stacks", type=Path, help="write each pass's lock samples here (collapsed stacks, for "
                                                "flamegraph.pl or speedscope)")
    args = ap.parse_args(argv)
    args.scratch = args.scratch.resolve()
    args.scratch.mkdir(parents=True, exist_ok=True)
    if args.stacks:
        args.stacks.mkdir(parents=True, exist_ok=True)
    if not LockProbe.available:
        print("budget: py-spy is not installed (make bench-setup): no lock figures", file=sys.stderr)
    revs = args.revs.split(",") if args.revs else ["."]
    trees = {rev: worktree(rev, args.scratch / "revisions") for rev in revs}
    t_start = time.perf_counter()
    data = {"benchmark": "budget", "when": now(), "machine": machine(),
            "config": {"engine": args.engine, "chunk_size": args.chunk_size, "memory": args.memory,
                       "dedupe": args.dedupe,
                       "repeats": args.repeats, "lock_probe": "py-spy --gil" if LockProbe.available else None},
            "payloads": {}}
    results: dict[str, dict[str, dict]] = {rev: {} for rev in revs}
    try:
        for kind in args.payloads.split(","):
            sd = payload(kind)
            saves = args.saves or payload_saves(sd)
            rounds: dict[str, list] = {rev: [] for rev in revs}
            for rnd in range(args.repeats):
                for rev in (revs if rnd % 2 == 0 else revs[::-1]):
                    with revision(trees[rev]):
                        r = one_round(kind, sd, args, saves, args.scratch / kind)
                    r["drain"] = drain(r["absorb"], r["durable"])
                    for ph in ("absorb", "durable", "restore"):
                        stacks = r.get(ph, {}).pop("stacks", None)
                        if args.stacks and stacks:
                            (args.stacks / f"{kind}-{ph}-{rev.replace('/', '_')}-{rnd}.txt").write_text(
                                "".join(f"{st} {n}\n" for st, n in stacks.items()))
                    rounds[rev].append(r)
                    print(f"round {rnd + 1} {kind} {rev}: " + ", ".join(
                        f"{ph} user {r[ph]['user']:.3f} lock {_fmt(r[ph]['lock'])}"
                        for ph in ("absorb", "drain", "durable", "restore") if ph in r), flush=True)
            for rev in revs:
                s = summarize(rounds[rev])
                s["checkpoint_bytes"] = rounds[rev][0]["checkpoint_bytes"]
                s["saves"] = saves
                s["rounds"] = rounds[rev]
                results[rev][kind] = s
    finally:
        remove_worktrees(trees)
    if len(revs) > 1:
        for rev in revs:
            print(f"\n=== {rev}")
            print_table(results[rev], data["config"], args.top)
        print_ratios(results, revs)
        return 0
    data["payloads"] = results["."]
    for s in data["payloads"].values():
        s.pop("rounds")
    data["seconds"] = time.perf_counter() - t_start
    data["targets"] = targets(data["payloads"])
    print_table(data["payloads"], data["config"], args.top)
    return finish("budget", data)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def targets(payloads: dict) -> list[dict]:
    out = []
    for kind, s in payloads.items():
        out.append(target(f"budget, {kind}: daemon user CPU s per GiB through durable",
                          s["durable"]["user"]["median"], USER_TARGETS[kind]))
        for phase, limit in LOCK_TARGETS.items():
            if phase in s:
                value = s[phase]["lock"]["median"] if "lock" in s[phase] else None
                out.append(target(f"budget, {kind}: daemon lock s per GiB, {phase}", value, limit,
                                  note="" if value is not None else "py-spy missing"))
    return out


def print_ratios(results: dict, revs: list[str]) -> None:
    """Each figure of each revision over the first's, round by round (median, min-max)."""
    first = revs[0]
    print(f"\nratios to {first}, round by round: median (min-max)")
    for kind in results[first]:
        for phase in ("absorb", "drain", "durable", "restore"):
            for key in ("lock", "user", "system"):
                base = [r[phase][key] for r in results[first][kind]["rounds"] if phase in r]
                if not base or None in base:
                    continue
                cells = []
                for rev in revs[1:]:
                    other = [r[phase][key] for r in results[rev][kind]["rounds"]]
                    ratio = stats([o / b for o, b in zip(other, base) if b > 0] or [math.nan])
                    cells.append(f"{rev}: {ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})")
                print(f"  {kind:6s} {phase:8s} {key:6s} " + "  ".join(cells))


def print_table(payloads: dict, config: dict, top: bool) -> None:
    """Per payload and phase: medians per GiB; user CPU and lock time with their split by thread
    (trio thread / FUSE workers / worker threads)."""
    for kind, s in payloads.items():
        print(f"\n{kind}: {s['checkpoint_bytes'] / MiB:.0f} MiB x {s['saves']} saves, engine "
              f"{config['engine']}, chunk {config['chunk_size']} (medians; seconds per GiB unless said)")
        print(f"  {'phase':8s} {'GiB/s':>6s} {'user':>6s} {'(trio fuse thrds)':>20s} {'sys':>6s} {'lock':>6s} "
              f"{'(trio fuse thrds)':>20s} {'ceiling':>8s} {'us/req':>7s} {'us/chunk':>8s} {'client':>6s} "
              f"{'drained':>7s}")
        for phase in ("absorb", "drain", "durable", "restore"):
            f = s.get(phase)
            if f is None:
                continue
            m = lambda k, d=3: f"{f[k]['median']:.{d}f}" if k in f else "-"  # noqa: E731
            split = lambda k: " ".join(f"{f[k][r]['median']:6.3f}" for r in ROLES)  # noqa: E731
            print(f"  {phase:8s} {m('gibps', 2):>6s} {m('user'):>6s} {split('user_roles'):>20s} {m('system'):>6s} "
                  f"{m('lock'):>6s} {split('lock_roles'):>20s} {m('ceiling_gibps', 1):>8s} "
                  f"{m('lock_us_per_request', 0):>7s} {m('lock_us_per_chunk', 0):>8s} {m('client'):>6s} "
                  f"{m('drained'):>7s}")
            if top and f.get("top"):
                for frame, sec in f["top"][:8]:
                    print(f"      {sec:7.3f} s  {frame}")
        print("  ceiling: GiB/s one mount could move with the lock alone (1 / lock); drain = durable - absorb")


if __name__ == "__main__":
    sys.exit(main())
