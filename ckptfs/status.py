"""The status snapshot: what is in memory, draining, durable; rates; ETA. Pure.

`snapshot(store, monitor, ...)` reads the live store and namespace (in the
trio thread, no awaits) and returns plain JSON-able data; the control
channel sends it, `ckptfs status` renders it, the metrics endpoint exports
parts of it. Nothing here changes the store.

A file's state (the same words as the ``user.ckptfs.state`` xattr, which
asks `Store.state`):

    memory     changed since its last commit, or created and never closed
    draining   committed by a close or fsync; its chunks are on their way to the
               devices and its journal record is not written yet
    durable    everything it holds is on the devices (not listed)
    failed     a drain of its data failed (the daemon keeps retrying); `errno` says why

`file_states` computes all of them in one pass over the pending records
(`Store.state` for each of N files would cost N passes); a test checks the
two agree. Progress is by bytes: the chunks captured by the file's pending
commit (or, for a file in memory, its current chunks) that are already on a
device, over all of them.

The ETA to all-durable is the bytes still to drain over the drain rate of
the last interval; None while nothing moves (unknown), 0 when nothing is left.
(A file in memory becomes durable only once closed or fsynced; the ETA
counts its bytes but cannot know when that will be.)

The snapshot (``ckptfs status --json``; sizes in bytes, rates in bytes/s):

    schema, mountpoint, devices, pid, control, metrics_url, time, uptime,
    interval          the seconds the rates cover
    pool              capacity, used, chunk_size, devices: [{index, path, capacity,
                      used, health (ok | errors | failing: errors in the last
                      interval), write_bps, read_bps, bytes_written, bytes_read,
                      writes, reads, errors}]
    memory            arena, chunk_size, used, undrained (not yet on a device),
                      cached (on a device, kept for reads), free
    files             [{path (None: no name left), ino, state, errno, size, bytes
                      (to be on the devices), drained, progress (0..1)}], failed
                      first, then draining, then memory; files_omitted past --limit
    totals            files_not_durable, files_memory, files_draining, files_failed,
                      bytes_to_drain, bytes_absorbed, bytes_drained, bytes_skipped,
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
"""
from __future__ import annotations

import errno as _errno
import os
from dataclasses import dataclass

from .namespace import ROOT_INO

SCHEMA = 1
MEMORY, DRAINING, DURABLE, FAILED = "memory", "draining", "durable", "failed"


@dataclass
class FileState:
    ino: int
    state: str  # memory, draining, failed
    errno: str | None = None  # e.g. "EIO" when failed
    size: int = 0  # the file's size now
    bytes: int = 0  # bytes that must reach the devices for it to be durable
    drained: int = 0  # of those, already on a device
    path: str | None = None

    @property
    def progress(self) -> float:
        return 1.0 if self.bytes == 0 else min(1.0, self.drained / self.bytes)

    @property
    def xattr(self) -> str:
        """The value ``user.ckptfs.state`` gives for this file."""
        return f"{FAILED}:{self.errno}" if self.state == FAILED else self.state

    def to_json(self) -> dict:
        return {"path": self.path, "ino": self.ino, "state": self.state, "errno": self.errno, "size": self.size,
                "bytes": self.bytes, "drained": self.drained, "progress": round(self.progress, 4)}


def _count(chunks, seen: set[int]) -> tuple[int, int]:
    """(bytes, drained bytes) of chunks not counted before (by identity)."""
    total = done = 0
    for c in chunks:
        if id(c) in seen:
            continue
        seen.add(id(c))
        total += c.hwm
        if c.drained:
            done += c.hwm
    return total, done


def file_states(store) -> dict[int, FileState]:
    """Every inode that is not durable, with its state and drain progress (mirrors Store.state for
    the inodes that still exist)."""
    content: dict[int, list] = {}  # ino -> non-void pending content records
    made: set[int] = set()
    for p in store.pending:
        if p.rec is None:
            if not p.void:
                content.setdefault(p.ino, []).append(p)
        elif p.rec[0] == "make":
            made.add(p.rec[8])
    inos = set(store.errors) | set(store.dirty_inodes) | set(store.deferred) | set(content) | made
    ns = store.ns
    out: dict[int, FileState] = {}
    for ino in inos:
        if ns is not None and ino not in ns.inodes:
            continue  # gone (deleted and forgotten): nothing of it can become durable any more
        if ino in store.errors:
            code = store.errors[ino]
            st = FileState(ino, FAILED, _errno.errorcode.get(code, str(code)))
        elif ino in store.dirty_inodes or ino in store.deferred:
            st = FileState(ino, MEMORY)
        else:
            st = FileState(ino, DRAINING)
        seen: set[int] = set()
        for p in content.get(ino, ()):
            t, d = _count(p.chunks.values(), seen)
            st.bytes += t
            st.drained += d
        inode = ns.inodes.get(ino) if ns is not None else None
        if inode is not None:
            st.size = inode.size
            if st.state != DRAINING and inode.data is not None:
                # not committed yet (or failed): what it holds now must drain too
                t, d = _count(inode.data.chunks.values(), seen)
                st.bytes += t
                st.drained += d
        out[ino] = st
    return out


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


def sort_key(f: FileState):
    return (_ORDER.get(f.state, 3), f.path or "")


def snapshot(store, monitor, *, window: float = 2.0, limit: int | None = None, info: dict | None = None) -> dict:
    """The whole status, as JSON-able data (see docs: `ckptfs status --json`)."""
    cs = store.chunk_size
    rates = monitor.rates(window)
    alloc = store.alloc
    devices = []
    for d, dev in enumerate(store.devices):
        stats = store.stats[d]
        if rates.new_errors[d] if d < len(rates.new_errors) else 0:
            health = "failing"
        elif stats.errors:
            health = "errors"
        else:
            health = "ok"
        devices.append({
            "index": d, "path": str(dev.path), "capacity": alloc.units[d] * cs,
            "used": (alloc.units[d] - alloc.free_units(d)) * cs, "health": health,
            "write_bps": rates.write_bps[d] if d < len(rates.write_bps) else 0.0,
            "read_bps": rates.read_bps[d] if d < len(rates.read_bps) else 0.0,
            "bytes_written": stats.bytes_written, "bytes_read": stats.bytes_read,
            "writes": stats.writes, "reads": stats.reads, "errors": stats.errors,
        })
    arena = store.arena
    cached_slots = sum(1 for c in store.lru.values() if c.slot is not None)
    used_slots = arena.used_slots
    memory = {"arena": arena.capacity, "chunk_size": cs, "used": used_slots * cs,
              "undrained": max(0, used_slots - cached_slots) * cs, "cached": cached_slots * cs,
              "free": arena.free_slots * cs}

    states = file_states(store)
    paths = paths_of(store.ns, states) if store.ns is not None else {}
    for ino, st in states.items():
        st.path = paths.get(ino)
    files = sorted(states.values(), key=sort_key)
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
    return {
        "schema": SCHEMA,
        **(info or {}),
        "uptime": round(monitor.uptime(), 3),
        "interval": round(rates.interval, 3),
        "pool": {"capacity": sum(d["capacity"] for d in devices), "used": sum(d["used"] for d in devices),
                 "chunk_size": cs, "devices": devices},
        "memory": memory,
        "files": [f.to_json() for f in shown],
        "files_omitted": len(files) - len(shown),
        "totals": {
            "files_not_durable": len(files), "files_memory": counts[MEMORY],
            "files_draining": counts[DRAINING], "files_failed": counts[FAILED],
            "bytes_to_drain": to_drain, "bytes_absorbed": store.bytes_absorbed,
            "bytes_drained": store.bytes_drained, "bytes_skipped": store.bytes_skipped,
            "records_pending": len(store.pending), "records_voided": store.records_voided,
            "absorb_bps": rates.absorb_bps, "drain_bps": rates.drain_bps, "eta_seconds": eta,
            "backpressure_waits": monitor.backpressure_waits,
            "backpressure_seconds": round(monitor.backpressure_seconds, 6),
            "drain_latency": {"count": lat.count, "sum": round(lat.sum, 6), "last": lat.last},
        },
        "lag": lag_of(store),
        "recovery": store.recovery,
        "all_durable": not files and not store.pending,
        "last_error": store.last_error,
    }


def lag_of(store) -> dict:
    """The durability lag block of the snapshot (see the docstring)."""
    lag = store.lag()
    oldest = store.oldest_closed()
    if oldest is not None:
        path = paths_of(store.ns, [oldest[0]]).get(oldest[0]) if store.ns is not None else None
        oldest = {"path": path, "ino": oldest[0], "age": round(oldest[1], 3)}
    return {"seconds": round(lag, 3), "max_lag": store.max_lag, "behind": lag > store.max_lag,
            "oldest": oldest}
