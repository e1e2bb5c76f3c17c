"""Case 1, save: blocked time and time-to-durable of one checkpoint, ckptfs next to the alternatives.

A state dict of random fp32 tensors (1 GiB and a second size, 2 GiB by
default) is saved by each system in turn, the order rotated every round,
`--repeats` rounds after one warm-up round (unmeasured: first-touch page
faults, DCP's staging buffers, the aio handle):

  shm          torch.save into /dev/shm (tmpfs): the memory floor, never durable;
  ckptfs       torch.save into a ckptfs mount over two file-backed devices on the
               same disk as ext4; durable = fsync on the file returns;
  ext4         torch.save into ext4 (blocked), then fsync: "ext4" is the save
               alone (not durable), "ext4+fsync" the save plus fsync (durable);
               one run gives both, so no dirty pages of a never-fsynced save
               spill into the next system's time;
  dcp_save     torch.distributed.checkpoint.save, FileSystemWriter(thread_count=4),
               into ext4; DCP fsyncs every file and .metadata (sync_files=True),
               so blocked = durable;
  dcp_async    dcp.async_save with a DefaultStager (async staging, plain memory:
               this torch has no accelerator); blocked = until the call returned
               and staging completed, durable = when the upload future completed
               (fsynced by DCP as above);
  fastpersist  torch.save through DeepSpeed's FastFileWriter (libaio, O_DIRECT)
               into ext4; durable when close() returns (it fsyncs). Skipped with
               the reason recorded where deepspeed or its ops are missing.

Ratios are pair by pair (run i of ckptfs over run i of the other, same round).
The ckptfs daemon's CPU seconds per GiB (from /proc/<pid>/stat) are recorded
as evidence of where the time goes.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from common import (SCRATCH, GiB, file_devices, finish, fsync_path, machine, mounted, now, pairwise,
                    parse_size, proc_cpu_seconds, random_state_dict, rotated, shm_dir, stats, target)
from fastpersist import open_writer, version

ALL = ["shm", "ckptfs", "ext4", "dcp_save", "dcp_async", "fastpersist"]
LABELS = {
    "shm": "torch.save → /dev/shm",
    "ckptfs": "torch.save → ckptfs",
    "ext4": "torch.save → ext4",
    "ext4_fsync": "torch.save → ext4 + fsync",
    "dcp_save": "dcp.save (4 threads) → ext4",
    "dcp_async": "dcp.async_save → ext4",
    "fastpersist": "FastPersist → ext4",
}
DURABLE = {"ckptfs", "ext4_fsync", "dcp_save", "dcp_async", "fastpersist"}


class Savers:
    """One save of each system: returns {result name: (blocked s, durable s or None)}."""

    def __init__(self, mnt: Path, ext4: Path, shm: Path, daemon_pid: int, fastpersist):
        self.mnt, self.ext4, self.shm = mnt, ext4, shm
        self.daemon_pid = daemon_pid
        self.fastpersist = fastpersist
        self.stagers: dict[int, object] = {}
        self.daemon_cpu: list[tuple[int, float]] = []  # (bytes, daemon CPU s) per ckptfs save
        # CPU seconds per GiB of this (writer) process while torch.save ran: the rest of the
        # blocked time it waited (for FUSE round trips, page allocation, ...)
        self.writer_cpu: dict[str, list[float]] = {"shm": [], "ckptfs": []}

    def _timed_save(self, sd: dict, p: Path, name: str) -> float:
        c0, t0 = os.times(), time.perf_counter()
        torch.save(sd, p)
        blocked = time.perf_counter() - t0
        c1 = os.times()
        self.writer_cpu[name].append((c1.user + c1.system - c0.user - c0.system) / (p.stat().st_size / GiB))
        return blocked

    def shm_save(self, sd: dict) -> dict:
        p = self.shm / "ckpt.pt"
        blocked = self._timed_save(sd, p, "shm")
        p.unlink()
        return {"shm": (blocked, None)}

    def ckptfs_save(self, sd: dict) -> dict:
        p = self.mnt / "ckpt.pt"
        cpu0 = proc_cpu_seconds(self.daemon_pid)
        t0 = time.perf_counter()
        blocked = self._timed_save(sd, p, "ckptfs")
        fsync_path(p)
        durable = time.perf_counter() - t0
        self.daemon_cpu.append((p.stat().st_size, proc_cpu_seconds(self.daemon_pid) - cpu0))
        p.unlink()
        return {"ckptfs": (blocked, durable)}

    def ext4_save(self, sd: dict) -> dict:
        p = self.ext4 / "ckpt.pt"
        t0 = time.perf_counter()
        torch.save(sd, p)
        blocked = time.perf_counter() - t0
        fsync_path(p)
        durable = time.perf_counter() - t0
        p.unlink()
        return {"ext4": (blocked, None), "ext4_fsync": (durable, durable)}

    def dcp_save_save(self, sd: dict) -> dict:
        import torch.distributed.checkpoint as dcp
        d = self.ext4 / "dcp"
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(d, thread_count=4, sync_files=True), no_dist=True)
        durable = time.perf_counter() - t0
        shutil.rmtree(d)
        return {"dcp_save": (durable, durable)}

    def dcp_async_save(self, sd: dict) -> dict:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        stager = self.stagers.get(id(sd))
        if stager is None:  # one per state dict, reused as a training loop would
            stager = self.stagers[id(sd)] = DefaultStager(StagingOptions(
                use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                use_non_blocking_copy=False))
        d = self.ext4 / "dcp_async"
        t0 = time.perf_counter()
        resp = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(d, thread_count=4, sync_files=True),
                              async_stager=stager, no_dist=True)
        resp.staging_completion.result()
        blocked = time.perf_counter() - t0
        resp.upload_completion.result()
        durable = time.perf_counter() - t0
        shutil.rmtree(d)
        return {"dcp_async": (blocked, durable)}

    def fastpersist_save(self, sd: dict) -> dict:
        p = self.ext4 / "fastpersist.pt"
        t0 = time.perf_counter()
        self.fastpersist.save(sd, p)
        durable = time.perf_counter() - t0
        p.unlink()
        return {"fastpersist": (durable, durable)}

    def run(self, system: str, sd: dict) -> dict:
        return getattr(self, f"{system}_save")(sd)

    def close(self) -> None:
        for s in self.stagers.values():
            s.close()
        if self.fastpersist is not None:
            self.fastpersist.close()


def summarize(runs: dict, size: int) -> dict:
    """runs[name] = list of (blocked, durable|None): stats and GB/s per result name, and the
    pair-by-pair ratios the targets use."""
    out: dict = {"bytes": size, "systems": {}}
    for name, rs in runs.items():
        blocked = [b for b, _ in rs]
        entry = {"label": LABELS[name], "blocked_s": stats(blocked),
                 "blocked_gbps": stats([size / b / 1e9 for b in blocked]), "durable_s": None}
        if name in DURABLE:
            durable = [d for _, d in rs]
            entry["durable_s"] = stats(durable)
            entry["durable_gbps"] = stats([size / d / 1e9 for d in durable])
        out["systems"][name] = entry

    def col(name, i):
        return [r[i] for r in runs[name]]
    ratios = {}
    if "ckptfs" in runs and "shm" in runs:
        ratios["blocked_ckptfs_over_shm"] = pairwise(col("ckptfs", 0), col("shm", 0))
    for other in ("ext4_fsync", "dcp_save", "dcp_async", "fastpersist"):
        if "ckptfs" in runs and other in runs:
            ratios[f"durable_ckptfs_over_{other}"] = pairwise(col("ckptfs", 1), col(other, 1))
    if "ckptfs" in runs and "dcp_async" in runs:
        ratios["blocked_ckptfs_over_dcp_async"] = pairwise(col("ckptfs", 0), col("dcp_async", 0))
    out["ratios"] = ratios
    return out


def targets_for(label: str, s: dict) -> list[dict]:
    r = s["ratios"]
    out = []
    if "blocked_ckptfs_over_shm" in r:
        out.append(target(f"save {label}: blocked, ckptfs / /dev/shm", r["blocked_ckptfs_over_shm"]["median"], 1.1))
    if "durable_ckptfs_over_ext4_fsync" in r:
        out.append(target(f"save {label}: time to durable, ckptfs / ext4+fsync",
                          r["durable_ckptfs_over_ext4_fsync"]["median"], 0.8))
    if "durable_ckptfs_over_fastpersist" in r:
        out.append(target(f"save {label}: time to durable, ckptfs / FastPersist",
                          r["durable_ckptfs_over_fastpersist"]["median"], 1.0))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1G,2G", help="state dict sizes (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured rounds at the first size")
    ap.add_argument("--systems", default=",".join(ALL))
    ap.add_argument("--memory", default=None, help="ckptfs budget (default: largest size + 1G, at least 3G)")
    ap.add_argument("--scratch", type=Path, default=SCRATCH / "save")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(ALL)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; choose from {ALL}")
    memory = args.memory or f"{max(3, -(-max(sizes) // GiB) + 1)}G"

    skipped = {}
    fastpersist = None
    if "fastpersist" in systems:
        fastpersist, why = open_writer()
        if fastpersist is None:
            skipped["fastpersist"] = why
            systems.remove("fastpersist")
            print(f"skipping FastPersist: {why}", flush=True)

    scratch = args.scratch.resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    ext4 = scratch / "ext4"
    shutil.rmtree(ext4, ignore_errors=True)
    ext4.mkdir()
    devices = file_devices(scratch / "devices", 2, 2 * max(sizes) + GiB)
    print(f"making random state dicts of {', '.join(args.sizes.split(','))} ...", flush=True)
    sds = {size: random_state_dict(size, seed=i) for i, size in enumerate(sizes)}
    runs: dict[int, dict[str, list]] = {size: {} for size in sizes}
    t_start = time.perf_counter()
    savers = None
    try:
        with shm_dir("save") as shm, mounted(scratch / "mnt", devices, memory,
                                             log_file=scratch / "daemon.log") as pid:
            savers = Savers(scratch / "mnt", ext4, shm, pid, fastpersist)
            for rnd in range(args.warmup + args.repeats):
                measured = rnd >= args.warmup
                for size in (sizes if measured else sizes[:1]):
                    for system in rotated(systems, rnd):
                        res = savers.run(system, sds[size])
                        for name, (b, d) in res.items():
                            if measured:
                                runs[size].setdefault(name, []).append((b, d))
                            dur = f", durable {d:.3f} s" if d is not None else ""
                            print(f"{'round ' + str(rnd - args.warmup + 1) if measured else 'warm-up'} "
                                  f"{size / GiB:g} GiB {name:11s} blocked {b:.3f} s{dur}", flush=True)
            daemon_cpu, writer_cpu = savers.daemon_cpu, savers.writer_cpu
    finally:
        if savers is not None:
            savers.close()
        shutil.rmtree(ext4, ignore_errors=True)
        for d in devices:
            d.unlink(missing_ok=True)

    results = {}
    tgts = []
    for size in sizes:
        label = f"{size / GiB:g} GiB"
        results[label] = summarize(runs[size], size)
        tgts += targets_for(label, results[label])
    cpu_bytes = sum(b for b, _ in daemon_cpu)
    data = {
        "benchmark": "save",
        "when": now(),
        "seconds": time.perf_counter() - t_start,
        "machine": machine() | {"deepspeed": version() if "fastpersist" not in skipped else None},
        "config": {"sizes": [s for s in args.sizes.split(",")], "repeats": args.repeats, "warmup": args.warmup,
                   "systems": systems, "memory": memory,
                   "ckptfs_devices": "2 sparse files on the ext4 root disk (same disk as the ext4 runs)",
                   "ext4_dir": str(ext4), "state_dict": "random fp32 4096x4096 tensors (64 MiB each)",
                   "dcp": "FileSystemWriter(thread_count=4, sync_files=True), no_dist=True; async_save with "
                          "DefaultStager(StagingOptions(False, False, True, False))",
                   "fastpersist": "FastFileWriter, aio block 1 MiB, queue depth 8, 64 MiB pinned double buffer"},
        "skipped": skipped,
        "sizes": results,
        "ckptfs_daemon_cpu_s_per_gib": (sum(c for _, c in daemon_cpu) / (cpu_bytes / GiB)) if cpu_bytes else None,
        "writer_cpu_s_per_gib": {k: stats(v) for k, v in writer_cpu.items() if v},
        "targets": tgts,
    }
    for label, r in results.items():
        print(f"\nsave {label}, median of {args.repeats} (min-max)")
        for name, e in r["systems"].items():
            d = e["durable_s"]
            print(f"  {e['label']:32s} blocked {e['blocked_s']['median']:.3f} s"
                  + (f", durable {d['median']:.3f} s" if d else ""))
    return finish("save", data)


if __name__ == "__main__":
    sys.exit(main())
