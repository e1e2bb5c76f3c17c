"""Case 3, restore: torch.load of a checkpoint from ckptfs after a remount vs from ext4, cold.

One random state dict (1 GiB by default) is saved once into a ckptfs mount
(two file-backed devices on the root disk) and fsynced, and once into ext4
on the same disk and fsynced; the mount is then unmounted, so its data is
only on the devices. Each round, in rotated order:

  ckptfs  mount again (the journal is replayed; the mount time is recorded),
          drop the page cache, time torch.load; unmount. Then the same with
          a plain sequential read (64 MiB read() calls) in place of torch.load;
  ext4    drop the page cache (echo 3 > /proc/sys/vm/drop_caches), time
          torch.load; then drop it again and time the plain read.

The first load from each is checked tensor by tensor against what was saved.
Restore speed = file bytes / seconds; the ratio ckptfs / ext4 is taken round
by round (target >= 1).
"""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import torch

from common import (GiB, MiB, case_args, drop_caches, file_devices, finish, fsync_path, machine, mounted, now,
                    pairwise, parse_size, proc_cpu_seconds, random_state_dict, rotated, stats, target)

READ_BLOCK = 64 * MiB


def timed_load(path: Path, expect: dict | None) -> float:
    t0 = time.perf_counter()
    sd = torch.load(path, map_location="cpu", weights_only=True)
    dt = time.perf_counter() - t0
    if expect is not None:
        bad = [k for k in expect if not torch.equal(sd[k], expect[k])]
        if bad or set(sd) != set(expect):
            raise SystemExit(f"restore: {path} did not load back what was saved ({bad[:3]} ...)")
    return dt


def timed_read(path: Path) -> float:
    buf = bytearray(READ_BLOCK)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = case_args(__doc__, argv, size="1G", memory="3G", scratch="restore")
    size = parse_size(args.size)
    scratch = args.scratch.resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    ext4 = scratch / "ext4"
    shutil.rmtree(ext4, ignore_errors=True)
    ext4.mkdir()
    mnt = scratch / "mnt"
    log = scratch / "daemon.log"
    devices = file_devices(scratch / "devices", 2, size + GiB)
    sd = random_state_dict(size, seed=3)
    res: dict[str, list[float]] = {k: [] for k in ("ckptfs_load", "ckptfs_read", "ckptfs_mount", "ext4_load",
                                                   "ext4_read", "ckptfs_load_daemon_cpu", "ckptfs_read_daemon_cpu")}
    t_start = time.perf_counter()
    try:
        with mounted(mnt, devices, args.memory, log_file=log):
            torch.save(sd, mnt / "ckpt.pt")
            fsync_path(mnt / "ckpt.pt")
        torch.save(sd, ext4 / "ckpt.pt")
        fsync_path(ext4 / "ckpt.pt")
        nbytes = (ext4 / "ckpt.pt").stat().st_size
        for rnd in range(args.repeats):
            expect = sd if rnd == 0 else None
            for system in rotated(["ckptfs", "ext4"], rnd):
                if system == "ckptfs":
                    for what in ("load", "read"):
                        t0 = time.perf_counter()
                        with mounted(mnt, devices, args.memory, fmt=False, log_file=log) as pid:
                            res["ckptfs_mount"].append(time.perf_counter() - t0)
                            drop_caches()
                            cpu0 = proc_cpu_seconds(pid)
                            dt = timed_load(mnt / "ckpt.pt", expect) if what == "load" else timed_read(mnt / "ckpt.pt")
                            res[f"ckptfs_{what}"].append(dt)
                            res[f"ckptfs_{what}_daemon_cpu"].append(proc_cpu_seconds(pid) - cpu0)
                else:
                    drop_caches()
                    res["ext4_load"].append(timed_load(ext4 / "ckpt.pt", expect))
                    drop_caches()
                    res["ext4_read"].append(timed_read(ext4 / "ckpt.pt"))
                print(f"round {rnd + 1} {system:6s} torch.load {res[system + '_load'][-1]:.3f} s, "
                      f"read {res[system + '_read'][-1]:.3f} s", flush=True)
    finally:
        shutil.rmtree(ext4, ignore_errors=True)
        for d in devices:
            d.unlink(missing_ok=True)

    rows = {}
    for system in ("ckptfs", "ext4"):
        rows[system] = {
            "label": "torch.load ← ckptfs (remounted)" if system == "ckptfs" else "torch.load ← ext4 (cold cache)",
            "load_s": stats(res[f"{system}_load"]), "read_s": stats(res[f"{system}_read"]),
            "load_gbps": stats([nbytes / t / 1e9 for t in res[f"{system}_load"]]),
            "read_gbps": stats([nbytes / t / 1e9 for t in res[f"{system}_read"]]),
        }
    rows["ckptfs"]["mount_s"] = stats(res["ckptfs_mount"])
    for what in ("load", "read"):  # where the time goes: the daemon's CPU per GiB served
        rows["ckptfs"][f"{what}_daemon_cpu_s_per_gib"] = stats([c / (nbytes / GiB)
                                                                for c in res[f"ckptfs_{what}_daemon_cpu"]])
    ratios = {"load_speed_ckptfs_over_ext4": pairwise(res["ext4_load"], res["ckptfs_load"]),
              "read_speed_ckptfs_over_ext4": pairwise(res["ext4_read"], res["ckptfs_read"])}
    tgts = [target("restore: torch.load speed, ckptfs / ext4 cold cache",
                   ratios["load_speed_ckptfs_over_ext4"]["median"], 1.0, at_most=False)]
    data = {
        "benchmark": "restore", "when": now(), "seconds": time.perf_counter() - t_start, "machine": machine(),
        "config": {"size": args.size, "bytes": nbytes, "repeats": args.repeats, "memory": args.memory,
                   "ckptfs_devices": "2 sparse files on the ext4 root disk", "read_block": READ_BLOCK,
                   "cold": "ckptfs: remount + drop_caches; ext4: drop_caches"},
        "rows": rows, "ratios": ratios, "targets": tgts,
    }
    for system, r in rows.items():
        print(f"  {r['label']:34s} torch.load {r['load_gbps']['median']:.2f} GB/s, "
              f"plain read {r['read_gbps']['median']:.2f} GB/s")
    return finish("restore", data, ratios)


if __name__ == "__main__":
    sys.exit(main())
