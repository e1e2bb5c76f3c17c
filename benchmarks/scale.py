"""Case 4, scale: aggregate absorb with 1, 2, 4 writer processes; durable bandwidth over 1, 2, 4
emulated NVMe devices next to the raw O_DIRECT bandwidth of the same devices.

absorb   N processes (N = 1, 2, 4) each write `--per-writer` bytes of random
         data in 64 MiB write() calls into their own file, all released by one
         barrier; aggregate = N x per-writer / (last end - first start).
         Into a ckptfs mount (two file-backed devices) and into /dev/shm,
         alternating, `--repeats` rounds; files are deleted between runs.
durable  drain.py's measure(): for N = 1, 2, 4 loop devices throttled with
         cgroup v1 blkio to `--throttle` each (200M: an array of slow NVMe
         drives on one disk), raw O_DIRECT (rawwrite.py: 1 MiB blocks, the same
         queue depth) and ckptfs (a fresh mount, `--size` of 64 MiB writes,
         then fsync) alternate. Durable bandwidth = bytes / time-to-durable.
         Targets: >= 0.9 x raw (pair by pair) and >= 0.85 x N x throttle.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

from common import (SCRATCH, GiB, MiB, clear_dir, file_devices, finish, human_rate, machine, mounted, now,
                    pairwise, parse_size, proc_cpu_seconds, rotated, shm_dir, stats, sync_mount, target,
                    write_bytes)
from drain import QUEUE_DEPTH, measure

BLOCK = 64 * MiB


def _writer(path: str, total: int, barrier, out) -> None:
    block = os.urandom(BLOCK)
    barrier.wait()
    t0 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
    write_bytes(Path(path), block, total)
    out.put((t0, time.perf_counter()))


def absorb_once(directory: Path, n: int, per_writer: int) -> float:
    """Aggregate bytes/s of n concurrent writer processes into `directory`."""
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(directory / f"w{i}.bin"), per_writer, barrier, out))
             for i in range(n)]
    for p in procs:
        p.start()
    spans = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"writer process failed ({p.exitcode})")
    return n * per_writer / (max(e for _, e in spans) - min(s for s, _ in spans))


def absorb(scratch: Path, writers: list[int], per_writer: int, repeats: int, memory: str) -> dict:
    devices = file_devices(scratch / "devices", 2, max(writers) * per_writer + 2 * GiB)
    bw: dict[str, dict[int, list[float]]] = {"ckptfs": {n: [] for n in writers}, "shm": {n: [] for n in writers}}
    try:
        with shm_dir("scale") as shm, mounted(scratch / "mnt", devices, memory,
                                              log_file=scratch / "daemon.log") as pid:
            dirs = {"ckptfs": scratch / "mnt", "shm": shm}
            cpu0, absorbed = proc_cpu_seconds(pid), 0
            for rnd in range(repeats):
                for n in writers:
                    for system in rotated(["ckptfs", "shm"], rnd + n):
                        bw[system][n].append(absorb_once(dirs[system], n, per_writer))
                        clear_dir(dirs[system])
                        if system == "ckptfs":
                            absorbed += n * per_writer
                            sync_mount(dirs[system])
                        print(f"round {rnd + 1} absorb {n} writer(s) {system:6s} "
                              f"{human_rate(bw[system][n][-1])}", flush=True)
            daemon_cpu = proc_cpu_seconds(pid) - cpu0
    finally:
        for d in devices:
            d.unlink(missing_ok=True)
    rows = [{"writers": n, "ckptfs_bps": stats(bw["ckptfs"][n]), "shm_bps": stats(bw["shm"][n]),
             "ratio_ckptfs_over_shm": pairwise(bw["ckptfs"][n], bw["shm"][n])} for n in writers]
    return {"per_writer_bytes": per_writer, "block": BLOCK, "rows": rows,
            "ckptfs_daemon_cpu_s_per_gib": daemon_cpu / (absorbed / GiB)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--writers", default="1,2,4")
    ap.add_argument("--per-writer", default="512M", help="bytes each writer process writes")
    ap.add_argument("--devices", default="1,2,4", help="device counts for the durable part")
    ap.add_argument("--throttle", default="200M", help="write limit per loop device (blkio)")
    ap.add_argument("--size", default="1G", help="bytes saved in the durable part")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory", default="3G")
    ap.add_argument("--drain", default="absorb-first", choices=["absorb-first", "eager"])
    ap.add_argument("--parts", default="absorb,durable")
    ap.add_argument("--scratch", type=Path, default=SCRATCH / "scale")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    scratch = args.scratch.resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    throttle, size = parse_size(args.throttle), parse_size(args.size)
    t_start = time.perf_counter()
    data = {"benchmark": "scale", "when": now(), "machine": machine(),
            "config": {"writers": args.writers, "per_writer": args.per_writer, "devices": args.devices,
                       "throttle_bps": throttle, "size": size, "repeats": args.repeats, "memory": args.memory,
                       "drain": args.drain, "queue_depth": QUEUE_DEPTH,
                       "absorb_devices": "2 sparse files on the ext4 root disk",
                       "durable_devices": "loop devices (--direct-io=on) over sparse files on the root disk, "
                                          f"each throttled to {args.throttle} of writes by cgroup v1 blkio"}}
    tgts = []
    if "absorb" in parts:
        data["absorb"] = absorb(scratch, [int(x) for x in args.writers.split(",")], parse_size(args.per_writer),
                                args.repeats, args.memory)
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
            print(f"  absorb {r['writers']} writer(s): ckptfs {human_rate(r['ckptfs_bps']['median'])}, "
                  f"/dev/shm {human_rate(r['shm_bps']['median'])}, "
                  f"ratio {r['ratio_ckptfs_over_shm']['median']:.2f}")
    for r in data.get("durable", {}).get("rows", []):
        print(f"  durable {r['devices']} device(s): raw {human_rate(r['raw_bw'])}, ckptfs {human_rate(r['ckptfs_bw'])}"
              f" (ratio {r['ratio_pairwise']['median']:.2f}, {r['ckptfs_over_limit']:.2f} of N x limit)")
    return finish("scale", data)


if __name__ == "__main__":
    sys.exit(main())
