"""The status snapshot: what is in memory, draining, durable; rates; ETA. Pure.

`snapshot(store, monitor, ...)` takes one `Store.statistics()` reading (in
the trio thread, no awaits), adds paths and rates, and returns plain
JSON-able data; the control channel sends it, `ckptfs status` renders it.
Nothing here changes the store, and nothing here re-derives its state.

A file's state (the same words as the ``user.ckptfs.state`` xattr, which
asks `Store.state`):

    memory     changed since its last commit, or created and never closed
    draining   committed by a close or fsync; its chunks are on their way to the
               devices and its journal record is not written yet
    durable    everything it holds is on the devices (not listed)
    failed     a drain of its data failed (the daemon keeps retrying); `errno` says why

`Store.file_states()` computes all of them in one pass (the store's `state`
answers one file with the same rule). Progress is by bytes: the chunks
captured by the file's pending commit (or, for a file in memory, its
current chunks) that are already on a device, over all of them.

The ETA to all-durable is the bytes still to drain over the drain rate of
the last interval; None while nothing moves (unknown), 0 when nothing is left.
(A file in memory becomes durable only once closed or fsynced; the ETA
counts its bytes but cannot know when that will be.)

The snapshot (``ckptfs status --json``; sizes in bytes, rates in bytes/s):

    schema, mountpoint, devices, pid, control, metrics_url, time, uptime,
    engine            the FUSE front end: pyfuse3 or native; threads: its worker threads;
                      reads: direct (read-only opens bypass the page cache) or page cache
    engine_stats      (native) session {requests {method: count}, errors, dropped,
                      spares_started, readers_parked, readers_activated, readers_woken},
                      adopted, copied, shifted, shifted_adopted, realigned, realigned_bytes,
                      killed, threads, max_write, max_pages, order_gaps, lock {acquired,
                      waits, wait_s, max_wait_s, trio_passes, settled_wakes}
                      (fuse/native.py EngineStats)
    interval          the seconds the rates cover
    pool              capacity, used, chunk_size, devices: [{index, path, capacity,
                      used, health (ok | errors | failing: errors in the last
                      interval), write_bps, read_bps, bytes_written, bytes_read,
                      writes, reads, errors}]
    memory            arena, chunk_size, used, undrained (not yet on a device),
                      cached (on a device, kept for reads), lent (free slots lent to
                      the native engine's workers as receive buffers), free
    files             [{path (None: no name left), ino, state, errno, size, bytes
                      (to be on the devices), drained, progress (0..1)}], failed
                      first, then draining, then memory; files_omitted past --limit
    totals            files_not_durable, files_memory, files_draining, files_failed,
                      bytes_to_drain, bytes_absorbed, bytes_drained, bytes_skipped,
                      bytes_in_memory (absorbed = drained + skipped + in memory),
                      records_pending, records_voided, absorb_bps, drain_bps,
                      eta_seconds, backpressure_waits, backpressure_seconds,
                      drain_latency {count, sum, last}
    lag               seconds (the oldest journal record still pending has waited this
                      long; 0 when none), max_lag (the mount's bound), behind (seconds >
                      max_lag: the devices do not keep up), oldest {path, ino, age}: the
                      oldest closed or fsynced file whose commit is pending, or None
    recovery          how this mount started: clean (the last unmount was clean), seq and
                      time (journal frame and wall-clock time of the state recovered to),
                      epoch, half, discarded [what replay dropped: a torn tail, damaged
                      frames], warnings
    all_durable, last_error
    restore           only while a restore from an object store runs (replicate/restore.py RestoreStats):
                      source, endpoint, generation (of the manifest), state (loading |
                      fetching | syncing | done | failed), files_total, files_restored,
                      bytes_total, bytes_restored, bytes_fetched, demand_fetches,
                      files_pending, errors_total, errors [the last causes], last_error,
                      manifest_time, seconds
    replication       (only with --replicate; replicate/replicator.py ReplicationStats) target, started, lag (seconds the oldest
                      durable change not yet in a standing manifest has waited), cycle_running,
                      bytes_uploaded, objects_uploaded (segments), bytes_shared (of new
                      versions, not uploaded: the store held those segments), versions_uploaded,
                      kept_bytes (the distinct file versions the kept manifests name) and
                      stored_bytes (their distinct segments: kept_bytes - stored_bytes is
                      what content naming saves in the store),
                      objects (in the store), generation and
                      manifest_time (the newest manifest), journal_seq (its state), covered_seq,
                      manifests_written, objects_deleted, manifests_deleted, keep, rate, memory,
                      read_from_arena, read_from_devices, errors {cause: count}, errors_total,
                      failing {cause, message} (the last call failed; retrying) or None,
                      last_error {cause, message, time}, uploader {pid, priority, running,
                      calls (in flight), starts, restarts, last_exit (how the last process
                      ended), cpu_s (all its processes so far)}
    dedupe            (with --dedupe on, or shared extents on the pool) on, shared_bytes (the
                      pool's durable bytes that name an extent another chunk names: what the
                      devices would hold more without dedupe); since the mount (store/dedupe.py
                      DedupeStats): indexed (extents), chunks_shared, bytes_shared (not written);
                      newest: the NEWEST_FILES newest durable files, each {path, ino, size,
                      shared (its durable bytes that another chunk names: user.ckptfs.shared)}
"""
from __future__ import annotations

import errno as _errno
import heapq
from dataclasses import asdict
import os

from ..fs.namespace import ROOT_INO
from ..store.store import DRAINING, FAILED, MEMORY, FileState

SCHEMA = 2  # 2: engine_stats groups the session's counts and the lock's
NEWEST_FILES = 5  # durable files the dedupe block lists, newest (durable mtime) first
__all__ = ["SCHEMA", "file_states", "snapshot", "paths_of", "files_under", "MEMORY", "DRAINING", "FAILED"]


def file_states(store) -> dict[int, FileState]:
    """Every inode that is not durable, with its state and drain progress (the store's one pass)."""
    return store.file_states()


def dedupe_json(store) -> dict:
    """The `dedupe` block: the pool's shared bytes, what this mount's index did, and the newest
    durable files with the bytes of each that another file's chunks name too."""
    since = asdict(store.dedupe.statistics()) if store.dedupe is not None else {}
    durable = store.durable
    newest = heapq.nlargest(NEWEST_FILES, (ino for ino, extents in durable.files.items() if extents),
                            key=lambda ino: durable.ns.inodes[ino].mtime_ns)
    paths = paths_of(store.ns, newest) if store.ns is not None else {}
    files = [{"path": paths.get(ino), "ino": ino, "size": durable.ns.inodes[ino].size, "shared": durable.shared(ino)}
             for ino in newest]
    return {"on": store.dedupe is not None, "shared_bytes": durable.shared_bytes, **since, "newest": files}


def progress(f: FileState) -> float:
    return 1.0 if f.bytes == 0 else min(1.0, f.drained / f.bytes)


def file_json(f: FileState, path: str | None) -> dict:
    code = None if f.errno is None else _errno.errorcode.get(f.errno, str(f.errno))
    return {"path": path, "ino": f.ino, "state": f.state, "errno": code, "size": f.size,
            "bytes": f.bytes, "drained": f.drained, "progress": round(progress(f), 4)}


def paths_of(ns, inos) -> dict[int, str]:
    """ino -> one path, for the inos that have a name (a walk of the live namespace)."""
    want = set(inos)
    out: dict[int, str] = {}
    if ROOT_INO in want:
        out[ROOT_INO] = "/"
    stack = [(ROOT_INO, "")]
    while stack and len(out) < len(want):
        ino, prefix = stack.pop()
        inode = ns.inodes.get(ino)
        if inode is None or inode.dir is None:
            continue
        for name, child in inode.dir.entries.items():
            path = prefix + "/" + os.fsdecode(name)
            if child in want and child not in out:
                out[child] = path
            sub = ns.inodes.get(child)
            if sub is not None and sub.dir is not None:
                stack.append((child, path))
    return out


def files_under(ns, ino: int) -> set[int]:
    """The inos below directory `ino` (itself included)."""
    out = {ino}
    stack = [ino]
    while stack:
        inode = ns.inodes.get(stack.pop())
        if inode is None or inode.dir is None:
            continue
        for child in inode.dir.entries.values():
            if child not in out:
                out.add(child)
                stack.append(child)
    return out


_ORDER = {FAILED: 0, DRAINING: 1, MEMORY: 2}


def snapshot(store, monitor, *, window: float = 2.0, limit: int | None = None, info: dict | None = None,
             replication: dict | None = None) -> dict:
    """The whole status, as JSON-able data (see the docstring: `ckptfs status --json`)."""
    st = store.statistics()
    rates = monitor.rates(window)
    devices = []
    for d in st.devices:
        i = d.index
        if i < len(rates.new_errors) and rates.new_errors[i]:
            health = "failing"
        elif d.errors:
            health = "errors"
        else:
            health = "ok"
        devices.append({
            "index": i, "path": d.path, "capacity": d.capacity, "used": d.used, "health": health,
            "write_bps": rates.write_bps[i] if i < len(rates.write_bps) else 0.0,
            "read_bps": rates.read_bps[i] if i < len(rates.read_bps) else 0.0,
            "bytes_written": d.bytes_written, "bytes_read": d.bytes_read,
            "writes": d.writes, "reads": d.reads, "errors": d.errors,
        })
    memory = {"arena": st.arena, "chunk_size": st.chunk_size, "used": st.arena_used, **st.arena_parts()}
    wanted = set(st.files) | ({st.oldest_closed[0]} if st.oldest_closed else set())
    paths = paths_of(store.ns, wanted) if store.ns is not None else {}
    files = sorted(st.files.values(), key=lambda f: (_ORDER.get(f.state, 3), paths.get(f.ino) or ""))
    to_drain = sum(f.bytes - f.drained for f in files)
    counts = {MEMORY: 0, DRAINING: 0, FAILED: 0}
    for f in files:
        counts[f.state] += 1
    if to_drain == 0:
        eta = 0.0
    elif rates.drain_bps > 0:
        eta = to_drain / rates.drain_bps
    else:
        eta = None
    lat = monitor.latency
    shown = files if limit is None else files[:limit]
    oldest = None
    if st.oldest_closed is not None:
        ino, age = st.oldest_closed
        oldest = {"path": paths.get(ino), "ino": ino, "age": round(age, 3)}
    return {
        "schema": SCHEMA,
        **(info or {}),
        "uptime": round(monitor.uptime(), 3),
        "interval": round(rates.interval, 3),
        "pool": {"pool_id": store.sbs[0].pool_id.hex(), "capacity": sum(d["capacity"] for d in devices),
                 "used": sum(d["used"] for d in devices), "chunk_size": st.chunk_size, "devices": devices},
        "memory": memory,
        "files": [file_json(f, paths.get(f.ino)) for f in shown],
        "files_omitted": len(files) - len(shown),
        "totals": {
            "files_not_durable": len(files), "files_memory": counts[MEMORY],
            "files_draining": counts[DRAINING], "files_failed": counts[FAILED],
            "bytes_to_drain": to_drain, "bytes_absorbed": st.bytes_absorbed,
            "bytes_drained": st.bytes_drained, "bytes_skipped": st.bytes_skipped,
            "bytes_in_memory": st.bytes_in_memory,
            "records_pending": st.records_pending, "records_voided": st.records_voided,
            "absorb_bps": rates.absorb_bps, "drain_bps": rates.drain_bps, "eta_seconds": eta,
            "backpressure_waits": monitor.backpressure_waits,
            "backpressure_seconds": round(monitor.backpressure_seconds, 6),
            "drain_latency": {"count": lat.count, "sum": round(lat.sum, 6), "last": lat.last},
        },
        "lag": {"seconds": round(st.lag, 3), "max_lag": st.max_lag, "behind": st.lag > st.max_lag,
                "oldest": oldest},
        "recovery": st.recovery,
        "all_durable": st.all_durable,
        "last_error": st.last_error,
        **({"replication": replication} if replication is not None else {}),
        **({"dedupe": dedupe_json(store)} if store.dedupe is not None or store.durable.shared_bytes else {}),
    }
