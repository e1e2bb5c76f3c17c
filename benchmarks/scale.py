"""Case 4, scale: aggregate absorb with 1, 2, 4, 8 concurrent savers on each FUSE engine next to
/dev/shm; durable bandwidth over 1, 2, 4 emulated NVMe devices next to the raw O_DIRECT bandwidth.

absorb   N processes (N = `--writers`, default 1, 2, 4, 8) each save
         `--per-writer` bytes into their own file, all released by one barrier;
         aggregate = N x per-writer / (last end - first start). `--saver write`:
         64 MiB write() calls of random data; `--saver torch`: torch.save of a
         state dict of random fp32 tensors (what every rank of a trainer does).
         Into one ckptfs mount per engine (`--engines`, default pyfuse3 and
         native, two file-backed devices each) and into /dev/shm, alternating,
         `--repeats` rounds; files are deleted (and the mount synced) between
         runs. Reported next to each rate: the daemon's CPU seconds per GiB
         absorbed (its /proc stat over the save, before the sync) and the
         writers' own CPU seconds per GiB.
durable  drain.py's measure(): for N = 1, 2, 4 loop devices throttled with
         cgroup v1 blkio to `--throttle` each (200M: an array of slow NVMe
         drives on one disk), raw O_DIRECT (rawwrite.py: 1 MiB blocks, the same
         queue depth) and ckptfs (a fresh mount, `--size` of 64 MiB writes,
         then fsync) alternate. Durable bandwidth = bytes / time-to-durable.
         Targets: >= 0.9 x raw (pair by pair) and >= 0.85 x N x throttle.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
import time
from pathlib import Path

from common import (SCRATCH, GiB, MiB, clear_dir, file_devices, finish, human_rate, machine, mounted, now,
                    pairwise, parse_size, proc_cpu_seconds, random_state_dict, rotated, run_together, shm_dir,
                    stats, sync_mount, target, write_bytes)
from drain import QUEUE_DEPTH, measure

BLOCK = 64 * MiB
SHM = "shm"


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _writer(path: str, total: int, saver: str, barrier, out) -> None:
    if saver == "torch":
        import torch
        sd = random_state_dict(total, seed=os.getpid())
        save = lambda: torch.save(sd, path)  # noqa: E731
    else:
        block = os.urandom(BLOCK)
        save = lambda: write_bytes(Path(path), block, total)  # noqa: E731
    barrier.wait()
    c0, t0 = _cpu_self(), time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
    save()
    out.put((t0, time.perf_counter(), _cpu_self() - c0, os.stat(path).st_size))


def absorb_once(directory: Path, n: int, per_writer: int, saver: str) -> tuple[float, float, int]:
    """n concurrent savers into `directory`: (aggregate bytes/s, writers' CPU seconds, bytes saved)."""
    runs = run_together(_writer, [(str(directory / f"w{i}.bin"), per_writer, saver) for i in range(n)])
    saved = sum(r[3] for r in runs)
    return saved / (max(r[1] for r in runs) - min(r[0] for r in runs)), sum(r[2] for r in runs), saved


def absorb(scratch: Path, writers: list[int], per_writer: int, repeats: int, memory: str, engines: list[str],
           saver: str) -> dict:
    systems = [f"ckptfs-{e}" for e in engines] + [SHM]
    bw = {s: {n: [] for n in writers} for s in systems}
    daemon_cpu = {s: {n: 0.0 for n in writers} for s in systems}
    writer_cpu = {s: {n: 0.0 for n in writers} for s in systems}
    saved = {s: {n: 0 for n in writers} for s in systems}
    devices = {e: file_devices(scratch / f"devices-{e}", 2, max(writers) * per_writer * 5 // 4 + 2 * GiB)
               for e in engines}
    try:
        with contextlib.ExitStack() as stack:
            dirs, pids = {SHM: stack.enter_context(shm_dir("scale"))}, {}
            for e in engines:
                mnt = scratch / f"mnt-{e}"
                pids[f"ckptfs-{e}"] = stack.enter_context(mounted(mnt, devices[e], memory, extra=("--engine", e),
                                                                  log_file=scratch / f"daemon-{e}.log"))
                dirs[f"ckptfs-{e}"] = mnt
            for rnd in range(repeats):
                for n in writers:
                    for system in rotated(systems, rnd + n):
                        pid = pids.get(system)
                        cpu0 = proc_cpu_seconds(pid) if pid else 0.0
                        rate, wcpu, nbytes = absorb_once(dirs[system], n, per_writer, saver)
                        if pid:
                            daemon_cpu[system][n] += proc_cpu_seconds(pid) - cpu0
                        bw[system][n].append(rate)
                        writer_cpu[system][n] += wcpu
                        saved[system][n] += nbytes
                        clear_dir(dirs[system])
                        if pid:
                            sync_mount(dirs[system])
                        print(f"round {rnd + 1} absorb {n} saver(s) {system:15s} {human_rate(rate)}", flush=True)
    finally:
        for devs in devices.values():
            for d in devs:
                d.unlink(missing_ok=True)
    rows = []
    for n in writers:
        rows.append({"writers": n, "bps": {s: stats(bw[s][n]) for s in systems},
                     "ratio_over_shm": {s: pairwise(bw[s][n], bw[SHM][n]) for s in systems if s != SHM},
                     "daemon_cpu_s_per_gib": {s: daemon_cpu[s][n] / (saved[s][n] / GiB) for s in systems if s != SHM},
                     "writer_cpu_s_per_gib": {s: writer_cpu[s][n] / (saved[s][n] / GiB) for s in systems}})
    return {"per_writer_bytes": per_writer, "saver": saver, "block": BLOCK, "systems": systems, "rows": rows}


def absorb_targets(a: dict) -> list[dict]:
    """Issue 12's targets: daemon CPU per GiB absorbed (any machine); on a node (>= 8 cores) the
    aggregate of 1 and of 8 savers against /dev/shm."""
    out, cores = [], len(os.sched_getaffinity(0))
    for r in a["rows"]:
        for s, ratio in r["ratio_over_shm"].items():
            if r["writers"] == 1:
                out.append(target(f"scale, 1 saver: {s} daemon CPU s per GiB absorbed",
                                  r["daemon_cpu_s_per_gib"][s], 0.25))
            if cores >= 8 and r["writers"] in (1, 8):
                out.append(target(f"scale, {r['writers']} saver(s): {s} / /dev/shm aggregate", ratio["median"],
                                  0.95 if r["writers"] == 1 else 0.9, at_most=False))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--writers", default="1,2,4,8", help="concurrent savers (up to the core count on a node)")
    ap.add_argument("--engines", default="pyfuse3,native", help="FUSE engines, each its own mount")
    ap.add_argument("--saver", default="write", choices=["write", "torch"])
    ap.add_argument("--per-writer", default="512M", help="bytes each writer process writes")
    ap.add_argument("--devices", default="1,2,4", help="device counts for the durable part")
    ap.add_argument("--throttle", default="200M", help="write limit per loop device (blkio)")
    ap.add_argument("--size", default="1G", help="bytes saved in the durable part")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory", default=None, help="--memory of each mount (default: what the largest absorb "
                                                   "round saves, plus 1G, so absorb never waits for the devices)")
    ap.add_argument("--drain", default="absorb-first", choices=["absorb-first", "eager"])
    ap.add_argument("--parts", default="absorb,durable")
    ap.add_argument("--scratch", type=Path, default=SCRATCH / "scale")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    scratch = args.scratch.resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    throttle, size = parse_size(args.throttle), parse_size(args.size)
    writers = [int(x) for x in args.writers.split(",")]
    if args.memory is None:
        args.memory = str(max(writers) * parse_size(args.per_writer) * 5 // 4 + GiB)
    t_start = time.perf_counter()
    data = {"benchmark": "scale", "when": now(), "machine": machine(),
            "config": {"writers": args.writers, "engines": args.engines, "saver": args.saver,
                       "per_writer": args.per_writer, "devices": args.devices,
                       "throttle_bps": throttle, "size": size, "repeats": args.repeats, "memory": args.memory,
                       "drain": args.drain, "queue_depth": QUEUE_DEPTH,
                       "absorb_devices": "2 sparse files on the ext4 root disk",
                       "durable_devices": "loop devices (--direct-io=on) over sparse files on the root disk, "
                                          f"each throttled to {args.throttle} of writes by cgroup v1 blkio"}}
    tgts = []
    if "absorb" in parts:
        data["absorb"] = absorb(scratch, writers, parse_size(args.per_writer),
                                args.repeats, args.memory, args.engines.split(","), args.saver)
        tgts += absorb_targets(data["absorb"])
    if "durable" in parts:
        rows = []
        for n in [int(x) for x in args.devices.split(",")]:
            row = measure(scratch, n, size, throttle, "bytes", args.repeats, args.memory, args.drain)
            row["limit_bps"] = n * throttle
            row["ckptfs_over_limit"] = row["ckptfs_bw"] / (n * throttle)
            rows.append(row)
            tgts.append(target(f"scale, {n} throttled device(s): durable bandwidth, ckptfs / raw O_DIRECT",
                               row["ratio_pairwise"]["median"], 0.9, at_most=False))
            tgts.append(target(f"scale, {n} throttled device(s): durable bandwidth / ({n} x {args.throttle}/s)",
                               row["ckptfs_over_limit"], 0.85, at_most=False))
        data["durable"] = {"rows": rows}
    data["seconds"] = time.perf_counter() - t_start
    data["targets"] = tgts
    if "absorb" in data:
        for r in data["absorb"]["rows"]:
            for s, ratio in r["ratio_over_shm"].items():
                print(f"  absorb {r['writers']} saver(s): {s} {human_rate(r['bps'][s]['median'])}, /dev/shm "
                      f"{human_rate(r['bps'][SHM]['median'])}, ratio {ratio['median']:.2f}, daemon CPU "
                      f"{r['daemon_cpu_s_per_gib'][s]:.2f} s/GiB, writers' CPU {r['writer_cpu_s_per_gib'][s]:.2f} s/GiB")
    for r in data.get("durable", {}).get("rows", []):
        print(f"  durable {r['devices']} device(s): raw {human_rate(r['raw_bw'])}, ckptfs {human_rate(r['ckptfs_bw'])}"
              f" (ratio {r['ratio_pairwise']['median']:.2f}, {r['ckptfs_over_limit']:.2f} of N x limit)")
    return finish("scale", data)


if __name__ == "__main__":
    sys.exit(main())
