"""The durable store: drain chunks to the devices, commit the journal, evict, fetch.

It plugs under the core as both its `ChunkOwner` (who hands out arena slots
and hears about chunk changes) and its `Durability` (who hears namespace
records and file closes). State machine of a chunk:

    DIRTY --(full, or captured by a commit, or memory pressure)--> QUEUED
    QUEUED --(drain task: pwrite to a unit of its device)--> DRAINED (clean)
    DRAINED --(arena needs room)--> EVICTED (slot freed; bytes on the device)
    any --(written again)--> DIRTY (a pinned chunk is copied first)

Records (namespace operations in order, and a `content` record at each close
or fsync of a changed file) wait in `pending`, strictly in order: the journal
task writes a prefix of them as one frame once every chunk a `content` record
captured is drained, after flushing the devices that hold that data. So the
journal is always a prefix of what happened (design.md promise 5).

No wasted bandwidth (promise 7): the drain skips chunks that were deleted,
truncated or rewritten before their turn; a pending `content` record whose
file lost its last name, or that a newer close of the same file supersedes,
is voided, and the records from it to the one that voided it are written
as one atomic frame, so no intermediate state can ever be observed.

Bounded lag (`max_lag` seconds): deferring and voiding may delay the journal,
never starve it. Once the oldest pending record (the head of `pending`) is
older than `max_lag`, (1) the absorb-first gate opens, so the drain runs even
while saves stream in, and (2) every record pending at that moment becomes
unvoidable (`void_floor`): voids can no longer chain atomic groups onto it, nor
supersede its closes, so that prefix commits within the time it takes to drain
it. Newer records may still void each other until they, in turn, are overdue.

All bookkeeping runs in the trio thread; only device calls run in worker
threads (one CapacityLimiter per device, its queue depth).
"""
from __future__ import annotations

import errno
import logging
import stat
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import trio

from .arena import Arena
from .committer import Committer
from .device import BlockDevice
from .drain import BATCH, Drainer
from .durable import DurableState
from .errors import DevicesFull, FsError, NoSpace, fs_error
from .filemap import Chunk
from .layout import Superblock
from .namespace import Inode, Namespace

log = logging.getLogger("ckptfs.store")
TICK = 0.01  # seconds a partial batch of chunks may wait for more before it drains
HOLD_IDLE = 0.02  # absorb-first: writes paused this long (seconds) lets the drain go
HOLD_POLL = 0.005
DEFAULT_MAX_LAG = 2.0  # seconds a closed file's commit may be deferred (docs/SEMANTICS.md)


@dataclass
class Pending:
    index: int
    rec: tuple | None = None  # a namespace record, or None for a content record
    ino: int = 0
    size: int = 0
    mtime: int = 0
    ctime: int = 0
    chunks: dict = field(default_factory=dict)  # idx -> Chunk (pinned) for content records
    void: bool = False
    group_end: int = -1  # this record and all up to group_end go in one frame
    born: float = field(default_factory=time.monotonic)  # for the drain latency (monitor.py)

    def ready(self) -> bool:
        return self.void or all(c.drained for c in self.chunks.values())

    def record(self, cs: int) -> tuple | None:
        if self.void:
            return None
        if self.rec is not None:
            return self.rec
        ext = [(idx, c.extent) for idx, c in sorted(self.chunks.items())]
        return ("content", self.ino, self.size, self.mtime, self.ctime, ext)


@dataclass
class DeviceStats:
    bytes_written: int = 0
    bytes_read: int = 0
    writes: int = 0
    reads: int = 0
    errors: int = 0
    bandwidth: float | None = None  # recent write bandwidth while busy (bytes/s, moving average)
    in_flight: int = 0  # drain writes in flight now

    def observe(self, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes >= 1 << 20:
            bw = nbytes / seconds
            self.bandwidth = bw if self.bandwidth is None else 0.7 * self.bandwidth + 0.3 * bw


class Store:
    def __init__(self, arena: Arena, devices: list[BlockDevice], sbs: list[Superblock],
                 durable: DurableState, *, half: int, tail: int, seq: int, queue_depth: int = 8,
                 fsync_absorb: bool = False, drain_policy: str = "absorb-first",
                 max_lag: float = DEFAULT_MAX_LAG, anchor_gen: int = 0, recovery: dict | None = None):
        self.arena = arena
        self.chunk_size = arena.chunk_size
        self.devices = devices
        self.sbs = sbs
        self.sb = sbs[0]
        self.durable = durable
        self.alloc = durable.alloc
        self.half, self.tail, self.seq = half, tail, seq
        self.anchor_gen = anchor_gen  # the newest journal anchor's generation (committer.write_anchor)
        self.recovery = recovery or {}  # how this mount started (pool.Recovered.report)
        self.queue_depth = queue_depth
        self.fsync_absorb = fsync_absorb
        self.drain_policy = drain_policy  # "absorb-first" or "eager"
        self.max_lag = max_lag
        self.ns: Namespace | None = None  # the live namespace, set by attach()
        self.limiters = [trio.CapacityLimiter(queue_depth) for _ in devices]
        self.stats = [DeviceStats() for _ in devices]
        self.ready: list[OrderedDict[int, Chunk]] = [OrderedDict() for _ in devices]
        self.unsealed: OrderedDict[int, Chunk] = OrderedDict()
        self.lru: OrderedDict[int, Chunk] = OrderedDict()  # drained chunks holding a slot
        self.pending: deque[Pending] = deque()
        self.next_index = 0
        self.committed = -1  # index of the last record on the devices
        self.in_flight = -1  # records up to here are being written; no longer voidable
        self.void_floor = -1  # records up to here were overdue (max_lag): no longer voidable
        self.dirty_inodes: set[int] = set()
        self.deferred: dict[int, tuple[int, bytes, tuple]] = {}  # ino -> (parent, name, make record)
        self.unflushed: set[int] = set()  # devices with data written since their last flush
        self.errors: dict[int, int] = {}  # ino -> errno of a failed drain, until its next commit
        self.last_error: str | None = None
        self._work = [trio.lowlevel.ParkingLot() for _ in devices]
        self._journal_lot = trio.lowlevel.ParkingLot()
        self._progress = trio.lowlevel.ParkingLot()  # drains, commits, frees
        self._tick = trio.Event()  # set when a partial batch waits for the ticker
        self._gate = trio.Event()  # drain workers pass only while it is set (see _gatekeeper)
        self._gate.set()
        self._writes_started = trio.Event()
        self._last_write = -1.0
        self._sync_waiters = 0
        self._fetching: dict[int, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        self.drainer = Drainer(self)
        self.committer = Committer(self)
        self.bytes_absorbed = 0
        self.bytes_drained = 0
        self.bytes_skipped = 0
        self.records_voided = 0
        self.in_flight_drains = 0
        self.on_commit: list = []  # callables(batch) after each journal commit (monitor.py)

    def attach(self, ns: Namespace) -> None:
        self.ns = ns

    # ---- ChunkOwner --------------------------------------------------------
    def alloc_slot(self) -> int:
        try:
            return self.arena.alloc_nowait()
        except NoSpace:
            pass
        while self.lru:
            _, chunk = self.lru.popitem(last=False)
            if chunk.slot is not None and chunk.drained:
                slot, chunk.slot = chunk.slot, None
                return slot
        # nothing clean to evict: let partial chunks drain too, then the caller waits
        self._gate.set()
        for key, chunk in list(self.unsealed.items()):
            del self.unsealed[key]
            self._queue(chunk)
        raise NoSpace("memory arena is full of data not yet on the devices")

    def view(self, slot: int) -> memoryview:
        return self.arena.view(slot)

    def undrained(self) -> int:
        """Chunks that will need a device unit: waiting to drain, or draining now."""
        return len(self.unsealed) + sum(len(q) for q in self.ready) + self.in_flight_drains

    def reserve(self) -> None:
        if self.alloc.free_units() <= self.undrained():
            raise DevicesFull("no space left on the devices")

    def chunk_changed(self, chunk: Chunk) -> None:
        key = id(chunk)
        self.lru.pop(key, None)
        if chunk.extent is not None:
            self.alloc.release(chunk.extent.dev, chunk.extent.unit)
            chunk.extent = None
            chunk.extent_gen = -1
        if chunk.hwm >= self.chunk_size:
            self.unsealed.pop(key, None)
            self._queue(chunk)
        elif not chunk.queued:
            self.unsealed[key] = chunk

    def chunk_dropped(self, chunk: Chunk) -> None:
        chunk.live = False
        self.unsealed.pop(id(chunk), None)
        if chunk.pins == 0:
            self._discard(chunk)

    def _discard(self, chunk: Chunk) -> None:
        key = id(chunk)
        self.lru.pop(key, None)
        self.unsealed.pop(key, None)
        if chunk.queued:  # never drain it: its bytes are stale
            self.ready[self.alloc.preferred(chunk.ino, chunk.idx)].pop(key, None)
            chunk.queued = False
            self.bytes_skipped += chunk.hwm
        if chunk.slot is not None and not chunk.busy:
            self.arena.free(chunk.slot)
            chunk.slot = None
        if chunk.extent is not None:
            self.alloc.release(chunk.extent.dev, chunk.extent.unit)
            chunk.extent = None
        self._progress.unpark_all()

    def _queue(self, chunk: Chunk) -> None:
        if chunk.queued or chunk.drained or chunk.slot is None:
            return
        chunk.queued = True
        dev = self.alloc.preferred(chunk.ino, chunk.idx)
        queue = self.ready[dev]
        queue[id(chunk)] = chunk
        # wake a worker for a full batch (large I/Os, few thread hand-offs) or when someone
        # waits for this chunk; the drain ticker picks up partial batches a moment later
        if len(queue) >= BATCH or chunk.pins or not self.arena.free_slots:
            self._work[dev].unpark()
        else:
            self._tick.set()

    # ---- Durability --------------------------------------------------------
    def _append(self, p: Pending) -> Pending:
        self.pending.append(p)
        self.next_index += 1
        self._journal_lot.unpark_all()
        return p

    def record(self, op: str, *args) -> None:
        if op == "make" and stat.S_ISREG(args[2]):
            # a new file becomes part of the journal at its first close or fsync (a file
            # never closed is absent after a crash), or as soon as a later record needs it
            self.deferred[args[7]] = (args[0], args[1], (op, *args))
            return
        if self.deferred and self._settle_deferred(op, args):
            return
        self._freeze_if_overdue()
        p = self._append(Pending(self.next_index, rec=(op, *args)))
        if op in ("unlink", "rename", "rmdir"):
            for q in self.pending:
                if q.rec is None and self._voidable(q):
                    inode = self.ns.inodes.get(q.ino) if self.ns is not None else None
                    if inode is None or inode.nlink == 0:
                        self._void(q, p.index)

    def _deferred_named(self, parent: int, name: bytes) -> int | None:
        for ino, (p, n, _) in self.deferred.items():
            if p == parent and n == name:
                return ino
        return None

    def _settle_deferred(self, op: str, args: tuple) -> bool:
        """Journal deferred creates that `op` depends on; True when `op` cancels one out entirely."""
        if op in ("link", "setattr", "setxattr", "removexattr"):
            self._flush_deferred(args[0])
        elif op == "unlink":
            ino = self._deferred_named(args[0], args[1])
            if ino is not None:
                del self.deferred[ino]  # created and deleted before it was ever closed: no trace
                return True
        elif op == "rename":
            src = self._deferred_named(args[0], args[1])
            dst = self._deferred_named(args[2], args[3])
            flags = args[4]
            if dst is not None and not flags:
                del self.deferred[dst]  # replaced before it was ever closed
            elif dst is not None:
                self._flush_deferred(dst)
            if src is not None:
                self._flush_deferred(src)
        return False

    def _flush_deferred(self, ino: int) -> Pending | None:
        entry = self.deferred.pop(ino, None)
        if entry is None:
            return None
        return self._append(Pending(self.next_index, rec=entry[2]))

    def lag(self) -> float:
        """Seconds the oldest record not yet in the journal has waited (0 when none waits)."""
        return time.monotonic() - self.pending[0].born if self.pending else 0.0

    def oldest_closed(self) -> tuple[int, float] | None:
        """(inode, seconds waited) of the oldest close or fsync whose commit is still pending."""
        for p in self.pending:
            if p.rec is None and not p.void:
                return p.ino, time.monotonic() - p.born
        return None

    def overdue(self) -> bool:
        return bool(self.pending) and self.lag() >= self.max_lag

    def _freeze_if_overdue(self) -> None:
        """Past max_lag, everything pending now must commit as it is: no more voiding of it."""
        if self.overdue():
            self.void_floor = self.next_index - 1

    def _voidable(self, q: Pending) -> bool:
        return not q.void and q.index > self.in_flight and q.index > self.void_floor

    def _void(self, q: Pending, until: int) -> None:
        self.records_voided += 1
        q.void = True
        for c in q.chunks.values():
            self._unpin(c)
        q.chunks = {}
        for r in self.pending:
            if q.index <= r.index <= until:
                r.group_end = max(r.group_end, until)

    def dirtied(self, inode: Inode) -> None:
        self.dirty_inodes.add(inode.ino)
        self._last_write = trio.current_time()
        if self._gate.is_set() and self.drain_policy == "absorb-first":
            self._writes_started.set()  # the gatekeeper may hold the drain back

    def closed(self, inode: Inode) -> None:
        self._freeze_if_overdue()
        made = self._flush_deferred(inode.ino)
        if inode.ino not in self.dirty_inodes:
            return
        self.dirty_inodes.discard(inode.ino)
        if inode.nlink == 0:
            return  # unlinked: nothing of it survives a crash anyway
        cs = self.chunk_size
        snap = {}
        for idx, c in inode.data.chunks.items():
            if c.hwm and idx * cs < inode.size:
                snap[idx] = c
                c.pins += 1
                self.unsealed.pop(id(c), None)
                self._queue(c)
        p = self._append(Pending(self.next_index, ino=inode.ino, size=inode.size,
                                 mtime=inode.mtime_ns, ctime=inode.ctime_ns, chunks=snap))
        if made is not None:
            made.group_end = p.index  # the file appears with its contents, never empty
        for q in self.pending:
            if q is not p and q.rec is None and q.ino == inode.ino and self._voidable(q):
                self._void(q, p.index)

    def _unpin(self, chunk: Chunk) -> None:
        chunk.pins -= 1
        if chunk.pins == 0 and not chunk.live:
            self._discard(chunk)

    # ---- waiting -------------------------------------------------------------
    async def wait_for_room(self, devices_full: bool = False) -> bool:
        """Wait until the arena may have a free slot; False when it never will (devices full)."""
        if devices_full:
            # a delete still on its way to the journal may free device space: give it a moment
            free, pending = self.alloc.free_units(), len(self.pending)
            if not pending:
                return False
            with trio.move_on_after(2):
                while self.alloc.free_units() <= free and len(self.pending) >= pending:
                    await self._progress.park()
            return self.alloc.free_units() > free or len(self.pending) < pending
        if self.arena.free_slots or self.lru:
            return True
        if not self.alloc.free_units() and not any(self.ready):
            return False
        if self.last_error and not any(self.ready) and not self.unsealed:
            raise FsError(self.last_error, errno.EIO)
        await self._progress.park()
        return True

    async def sync(self, ino: int | None = None) -> None:
        """fsync(ino) / syncfs (ino None): return once the data and all records before it are durable."""
        if ino is None:
            for i in list(self.deferred):
                self._flush_deferred(i)
            for i in list(self.dirty_inodes):
                inode = self.ns.inodes.get(i)
                if inode is not None:
                    self.closed(inode)
        else:
            inode = self.ns.inodes.get(ino)
            if inode is not None:
                self.closed(inode)
        if self.fsync_absorb:
            return
        target = self.next_index - 1
        log.debug("sync(%s): waiting for record %d (committed %d)", ino, target, self.committed)
        self._sync_waiters += 1
        self._gate.set()  # someone waits: drain at full speed
        try:
            while self.committed < target:
                if ino is not None and ino in self.errors:
                    raise fs_error(self.errors[ino], f"data of inode {ino} could not be written")
                if ino is None and self.last_error:
                    raise FsError(self.last_error, errno.EIO)
                await self._progress.park()
        finally:
            self._sync_waiters -= 1
        if ino is not None and ino in self.errors:
            raise fs_error(self.errors.pop(ino))

    # ---- tasks -----------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The background tasks: queue-depth drain workers per device, and the journal writer."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for d in range(len(self.devices)):
                for k in range(self.queue_depth):
                    nursery.start_soon(self.drainer.worker, d, k)
            nursery.start_soon(self.committer.run)
            nursery.start_soon(self._ticker)
            nursery.start_soon(self._gatekeeper)
            task_status.started()

    def _hold_back(self) -> bool:
        """Absorb first: hold the drain while writes stream in and nothing presses (memory, a
        waiter, or a commit older than max_lag)."""
        return (self.drain_policy == "absorb-first"
                and trio.current_time() - self._last_write < HOLD_IDLE
                and not self._sync_waiters
                and self.arena.free_slots * 2 > self.arena.nslots
                and not self.overdue())

    async def _gatekeeper(self) -> None:
        """Opens the drain gate when writes pause, memory fills up, or someone waits."""
        while True:
            if self._hold_back():
                if self._gate.is_set():
                    self._gate = trio.Event()
                await trio.sleep(HOLD_POLL)
            else:
                self._gate.set()
                await self._writes_started.wait()
                self._writes_started = trio.Event()

    async def _ticker(self) -> None:
        """Start partial batches that waited TICK seconds for company."""
        while True:
            await self._tick.wait()
            await trio.sleep(TICK)
            self._tick = trio.Event()
            for d, queue in enumerate(self.ready):
                if queue:
                    self._work[d].unpark()

    async def fetch(self, chunks: list[Chunk]) -> None:
        await self.drainer.fetch(chunks)

    def read_ahead(self, data, idx: int) -> None:
        """A read reached chunk `idx`: load the next chunks from the devices before they are asked for."""
        if self._nursery is not None:
            self.drainer.read_ahead(data, idx, self._nursery)

    async def compact(self) -> None:
        await self.committer.compact()

    # ---- lifecycle -------------------------------------------------------------
    async def drain_all(self) -> None:
        """Commit every changed file and wait until everything is on the devices."""
        await self.sync(None)
        while self.pending:
            await self._progress.park()

    def close(self) -> None:
        for d in self.devices:
            d.close()

    # ---- accounting ------------------------------------------------------------
    def state(self, ino: int) -> str:
        """memory (changed since its last commit, or never closed), draining (committed by a
        close or fsync, on its way to the devices), durable, or failed:ERRNO."""
        if ino in self.errors:
            return f"failed:{errno.errorcode.get(self.errors[ino], self.errors[ino])}"
        if ino in self.dirty_inodes or ino in self.deferred:
            return "memory"
        if any(p.ino == ino and p.rec is None and not p.void for p in self.pending):
            return "draining"
        if any(p.rec is not None and p.rec[0] == "make" and p.rec[8] == ino for p in self.pending):
            return "draining"
        return "durable"

    def usage(self) -> tuple[int, int]:
        return self.capacity_bytes(), self.used_bytes()

    def used_bytes(self) -> int:
        return self.alloc.used_units() * self.chunk_size

    def capacity_bytes(self) -> int:
        return sum(self.alloc.units) * self.chunk_size

    def undrained_bytes(self) -> int:
        return sum(c.hwm for q in self.ready for c in q.values()) + sum(c.hwm for c in self.unsealed.values())
