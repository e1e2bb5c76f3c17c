"""Case 3, restore: torch.load of checkpoints from ckptfs after a remount vs from ext4, cold.

N random state dicts (`--size` each, 1 GiB by default; N = the largest of
`--readers`, default 1 and 4) are saved once into a ckptfs mount per engine
(`--engines`, default pyfuse3 and native; two file-backed devices each on
the root disk) and fsynced, and once into ext4 on the same disk and fsynced;
the mounts are then unmounted, so their data is only on the devices. Each
round, for each reader count n, in rotated order:

  ckptfs-E  mount again with engine E (the journal is replayed; the mount
            time is recorded), drop the page cache, n processes released by
            one barrier each torch.load their own shard; unmount. Then the
            same with a plain sequential read (64 MiB read() calls);
  ext4      drop the page cache (echo 3 > /proc/sys/vm/drop_caches), the same
            n loads; then drop it again and the same n plain reads.

Every load is checked tensor by tensor against what was saved (in the
reader). Restore speed = bytes loaded / (last end - first start); the ratio
ckptfs / ext4 is taken round by round (target >= 1). Next to each: the
daemon's CPU seconds per GiB served; for one reader also the plain read once
more on the same mount, page cache dropped, every chunk now in the arena: no
device read and no crc32c, so what is left is the reply (the kernel's copy
into the reader), the floor under the cold figure.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

from common import (SCRATCH, GiB, MiB, drop_caches, file_devices, finish, fsync_path, machine, mounted, now,
                    pairwise, parse_size, proc_cpu_seconds, random_state_dict, rotated, run_together, stats,
                    target)

READ_BLOCK = 64 * MiB
EXT4 = "ext4"


def _check(path: Path, sd: dict, seed: int, size: int) -> None:
    """`sd` (loaded from `path`) is what was saved there: random_state_dict(size, seed)."""
    expect = random_state_dict(size, seed=seed)
    bad = [k for k in expect if not torch.equal(sd[k], expect[k])]
    if bad or set(sd) != set(expect):
        raise SystemExit(f"restore: {path} did not load back what was saved ({bad[:3]} ...)")


def _read(path: Path) -> None:
    buf = bytearray(READ_BLOCK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def _reader(what: str, path: str, seed: int | None, size: int, barrier, out) -> None:
    barrier.wait()
    t0 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
    if what == "load":
        sd = torch.load(path, map_location="cpu", weights_only=True)
    else:
        _read(Path(path))
    t1 = time.perf_counter()
    if what == "load" and seed is not None:  # checked after the clock stops, on what was loaded
        _check(Path(path), sd, seed, size)
    out.put((t0, t1))


def timed(what: str, directory: Path, n: int, size: int, check: bool) -> float:
    """n processes at once each load (or read) shard i of `directory`: seconds from first start to last end."""
    spans = run_together(_reader, [(what, str(directory / f"shard{i}.pt"), i if check else None, size)
                                   for i in range(n)], method="spawn")
    return max(e for _, e in spans) - min(s for s, _ in spans)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1G", help="bytes of each reader's shard")
    ap.add_argument("--readers", default="1,4", help="concurrent restoring processes")
    ap.add_argument("--engines", default="pyfuse3,native", help="FUSE engines, each its own pool")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory", default="3G")
    ap.add_argument("--scratch", type=Path, default=SCRATCH / "restore")
    args = ap.parse_args(argv)
    size, readers, engines = parse_size(args.size), [int(x) for x in args.readers.split(",")], args.engines.split(",")
    shards = max(readers)
    scratch = args.scratch.resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    dirs = {EXT4: scratch / "ext4", **{f"ckptfs-{e}": scratch / f"mnt-{e}" for e in engines}}
    shutil.rmtree(dirs[EXT4], ignore_errors=True)
    dirs[EXT4].mkdir()
    systems = [*dirs]
    devices = {e: file_devices(scratch / f"devices-{e}", 2, shards * size * 5 // 4 + GiB) for e in engines}
    log = scratch / "daemon.log"
    res = {(s, what, n): [] for s in systems for what in ("load", "read") for n in readers}
    cpu = {(s, what, n): [] for s in systems for what in ("load", "read") for n in readers}
    mount_s: dict[str, list[float]] = {s: [] for s in systems}
    in_memory: dict[str, list[float]] = {s: [] for s in systems}  # daemon CPU s/GiB, 1 reader, chunks in memory
    t_start = time.perf_counter()
    try:
        for i in range(shards):
            sd = random_state_dict(size, seed=i)
            for s in systems:
                if s == EXT4:
                    torch.save(sd, dirs[s] / f"shard{i}.pt")
                    fsync_path(dirs[s] / f"shard{i}.pt")
                    continue
                with mounted(dirs[s], devices[s.split("-", 1)[1]], args.memory, fmt=i == 0, log_file=log,
                             extra=("--engine", s.split("-", 1)[1])):
                    torch.save(sd, dirs[s] / f"shard{i}.pt")
                    fsync_path(dirs[s] / f"shard{i}.pt")
            del sd
        nbytes = (dirs[EXT4] / "shard0.pt").stat().st_size
        for rnd in range(args.repeats):
            for n in readers:
                for s in rotated(systems, rnd + n):
                    for what in ("load", "read"):
                        check = rnd == 0 and what == "load"
                        if s == EXT4:
                            drop_caches()
                            res[s, what, n].append(timed(what, dirs[s], n, size, check))
                            continue
                        engine = s.split("-", 1)[1]
                        t0 = time.perf_counter()
                        with mounted(dirs[s], devices[engine], args.memory, fmt=False, log_file=log,
                                     extra=("--engine", engine)) as pid:
                            mount_s[s].append(time.perf_counter() - t0)
                            drop_caches()
                            cpu0 = proc_cpu_seconds(pid)
                            res[s, what, n].append(timed(what, dirs[s], n, size, check))
                            cpu[s, what, n].append((proc_cpu_seconds(pid) - cpu0) / (n * nbytes / GiB))
                            if what == "read" and n == 1:  # again, every chunk in the arena now: the reply alone
                                drop_caches()
                                cpu0 = proc_cpu_seconds(pid)
                                timed(what, dirs[s], n, size, False)
                                in_memory[s].append((proc_cpu_seconds(pid) - cpu0) / (nbytes / GiB))
                    print(f"round {rnd + 1} {n} reader(s) {s:15s} torch.load {res[s, 'load', n][-1]:.3f} s, "
                          f"read {res[s, 'read', n][-1]:.3f} s", flush=True)
    finally:
        shutil.rmtree(dirs[EXT4], ignore_errors=True)
        for devs in devices.values():
            for d in devs:
                d.unlink(missing_ok=True)

    rows, ratios, tgts = {}, {}, []
    for n in readers:
        for s in systems:
            label = (f"torch.load ← {s} (remounted)" if s != EXT4 else "torch.load ← ext4 (cold cache)")
            row = {"label": label, "readers": n, "load_s": stats(res[s, "load", n]), "read_s": stats(res[s, "read", n]),
                   "load_gbps": stats([n * nbytes / t / 1e9 for t in res[s, "load", n]]),
                   "read_gbps": stats([n * nbytes / t / 1e9 for t in res[s, "read", n]])}
            if s != EXT4:
                row["mount_s"] = stats(mount_s[s])
                for what in ("load", "read"):
                    row[f"{what}_daemon_cpu_s_per_gib"] = stats(cpu[s, what, n])
                if n == 1:
                    row["in_memory_read_daemon_cpu_s_per_gib"] = stats(in_memory[s])
                for what in ("load", "read"):
                    key = f"{what}_speed_{s}_over_ext4_{n}_readers"
                    ratios[key] = pairwise(res[EXT4, what, n], res[s, what, n])
                tgts.append(target(f"restore, {n} reader(s): torch.load speed, {s} / ext4 cold cache",
                                   ratios[f"load_speed_{s}_over_ext4_{n}_readers"]["median"], 1.0, at_most=False))
                if n == 1:
                    floor = row["in_memory_read_daemon_cpu_s_per_gib"]["median"]
                    tgts.append(target(f"restore, 1 reader: {s} daemon CPU s per GiB served (plain read)",
                                       row["read_daemon_cpu_s_per_gib"]["median"], 0.3,
                                       note=f"the same read with every chunk in memory: {floor:.2f}"))
            rows[f"{s}@{n}"] = row
    data = {
        "benchmark": "restore", "when": now(), "seconds": time.perf_counter() - t_start, "machine": machine(),
        "config": {"size": args.size, "bytes": nbytes, "readers": readers, "engines": engines,
                   "repeats": args.repeats, "memory": args.memory,
                   "ckptfs_devices": "2 sparse files on the ext4 root disk", "read_block": READ_BLOCK,
                   "cold": "ckptfs: remount + drop_caches; ext4: drop_caches"},
        "rows": rows, "ratios": ratios, "targets": tgts,
    }
    for r in rows.values():
        print(f"  {r['readers']} reader(s) {r['label']:38s} torch.load {r['load_gbps']['median']:.2f} GB/s, "
              f"plain read {r['read_gbps']['median']:.2f} GB/s")
    return finish("restore", data, ratios)


if __name__ == "__main__":
    sys.exit(main())
