"""The durable store: chunk bookkeeping between the arena, the drain and the journal.

It plugs under the core as both its `ChunkOwner` (who hands out arena slots
and hears about chunk changes) and its `Durability` (who hears namespace
records and file closes), and wires three parts that own their own state:

    ordering.CommitLog   the pending records and the prefix rule (pure)
    drain.Drainer        drain queues, workers, the absorb-first gate, fetches
    committer.Committer  the journal's position, frames, compaction, anchors
    reserve.Reservation  whether the devices could take a new or growing chunk

The store itself owns the chunks' places (which are waiting to fill, which
are cached on a device and may be evicted), the per-file drain errors, the
counters, and the one retry policy (`retry_later`). Where a chunk's bytes are:

    in memory only (slot, not drained) --(its drain: full, captured by a commit,
        or memory pressure)--> in memory and on a device (clean, in `lru`)
    clean --(the arena needs room)--> on a device only (evicted: slot freed)
    any --(written again)--> in memory only (a pinned chunk is copied first)

and where it is in the drain (idle, queued, busy, writing, again) is the
chunk's own state, changed only through its transitions (fs/filemap.py,
`Chunk`), which the drain calls.

No wasted bandwidth (promise 7): chunks deleted, truncated or rewritten
before their turn leave the queue, and superseded commits are voided
(ordering.py). Accounting: every byte written is absorbed, and stays "in
memory" (`Chunk.absorbed`) until the chunk holding it is drained or dropped
undrained (skipped), so absorbed = drained + skipped + in memory always.

All bookkeeping runs under the trio thread's `loop` lock (tasks.LoopLock): in
the trio thread itself, or in a native FUSE worker that holds the lock for a
request that needs no wait (fuse/native.py). So what wakes trio tasks goes
through `loop.soon` (the store's `wake`, the committer's, the drain's queues
and gate). Device calls run in trio's worker threads (one CapacityLimiter per
device, its queue depth) on slots marked busy.
"""
from __future__ import annotations

import errno
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import crc32c
import trio

from ..errors import FsError, NoSpace, StoreFailing, fs_error
from ..format.layout import Superblock
from ..format.records import Extent
from ..fs.arena import Arena
from ..fs.filemap import Chunk
from ..fs.namespace import Inode, Namespace
from .committer import Committer
from .device import BlockDevice
from .dedupe import ContentIndex
from .drain import Drainer
from .durable import DurableState
from .ordering import CommitLog, Pending
from .reserve import Reservation
from ..tasks import LoopLock

log = logging.getLogger("ckptfs.store")
DEFAULT_MAX_LAG = 2.0  # seconds a closed file's commit may be deferred (docs/SEMANTICS.md)
RETRY_DELAY = 0.5  # seconds between retries of a failed drain or commit
BANDWIDTH_WINDOW = 64 << 20  # bytes of drain writes behind each move of a device's bandwidth estimate
MEMORY, DRAINING, DURABLE, FAILED = "memory", "draining", "durable", "failed"


@dataclass
class DeviceStats:
    """One device's counters, moved only through the methods below (by the drain, the journal and
    the replication's reads)."""
    bytes_written: int = 0
    bytes_read: int = 0
    writes: int = 0
    reads: int = 0
    errors: int = 0
    bandwidth: float | None = None  # recent write bandwidth while busy (bytes/s, moving average)
    in_flight: int = 0  # drain writes in flight now
    _window_bytes: int = field(default=0, repr=False, compare=False)  # observed since `bandwidth` last moved
    _window_s: float = field(default=0.0, repr=False, compare=False)

    def write_started(self) -> int:
        """A drain write goes to the device; the writes in flight there now, this one included."""
        self.in_flight += 1
        return self.in_flight

    def write_ended(self) -> None:
        self.in_flight -= 1

    def wrote(self, nbytes: int, seconds: float, sharing: int = 1) -> None:
        """A write of `nbytes` took `seconds`, `sharing` writes in flight meanwhile."""
        self.writes += 1
        self.bytes_written += nbytes
        self.observe(sharing * nbytes, seconds)

    def read(self, nbytes: int) -> None:
        self.reads += 1
        self.bytes_read += nbytes

    def failed(self) -> None:
        """An I/O error, or bytes read back whose checksum did not match."""
        self.errors += 1

    def observe(self, nbytes: int, seconds: float) -> None:
        """A write of `nbytes` (times the writes sharing the device) took `seconds`. The estimate
        moves once per BANDWIDTH_WINDOW bytes, from their total time: single writes mislead, as
        a throttled device (blkio, a cloud volume's burst credits) takes the first ones of a
        burst at several times its rate (measured: 8 MiB writes at 0.6-1.3 GB/s on a device
        held to 200 MiB/s), and one such estimate made it look fast, so the drain was held
        back during a save and the device idled (drain.py: the gate, `Drainer.slow`)."""
        if seconds <= 0 or nbytes < 1 << 20:
            return
        self._window_bytes += nbytes
        self._window_s += seconds
        if self._window_bytes >= BANDWIDTH_WINDOW:
            bw = self._window_bytes / self._window_s
            self.bandwidth = bw if self.bandwidth is None else 0.7 * self.bandwidth + 0.3 * bw
            self._window_bytes, self._window_s = 0, 0.0


@dataclass(frozen=True)
class FileState:
    """A file that is not durable: its state and how much of it is on a device."""
    ino: int
    state: str  # memory, draining, failed
    errno: int | None = None  # why it failed
    size: int = 0  # the file's size now
    bytes: int = 0  # bytes that must reach the devices for it to be durable
    drained: int = 0  # of those, already on a device

    @property
    def xattr(self) -> str:
        """The value ``user.ckptfs.state`` gives for this file."""
        if self.state == FAILED:
            return f"{FAILED}:{errno.errorcode.get(self.errno, self.errno)}"
        return self.state


@dataclass(frozen=True)
class DeviceSnapshot:
    """One device in a `StoreStats` reading: its index and path, the capacity and used bytes
    of its data units, and its counters then."""
    index: int
    path: str
    capacity: int
    used: int
    bytes_written: int
    bytes_read: int
    writes: int
    reads: int
    errors: int


@dataclass(frozen=True)
class StoreStats:
    """One consistent reading of the store (`Store.statistics()`), for status, metrics and the xattr.

    INVARIANT: bytes_absorbed == bytes_drained + bytes_skipped + bytes_in_memory.
    """
    chunk_size: int
    bytes_absorbed: int
    bytes_drained: int  # absorbed bytes whose chunk reached a device
    bytes_skipped: int  # absorbed bytes dropped before they were drained (stale)
    bytes_in_memory: int  # absorbed bytes neither drained nor skipped yet
    arena: int
    arena_used: int
    arena_cached: int  # on a device too, kept for reads (evictable)
    arena_lent: int  # free slots lent to the FUSE workers as receive buffers (no file data yet)
    arena_free: int
    devices: tuple[DeviceSnapshot, ...]
    files: dict  # ino -> FileState of every file not durable
    records_pending: int
    records_voided: int
    lag: float
    max_lag: float
    oldest_closed: tuple[int, float] | None
    last_error: str | None
    recovery: dict

    @property
    def arena_undrained(self) -> int:
        return max(0, self.arena_used - self.arena_cached - self.arena_lent)

    def arena_parts(self) -> dict[str, int]:
        """The arena's bytes by what holds them (status and metrics show these)."""
        return {"undrained": self.arena_undrained, "cached": self.arena_cached, "lent": self.arena_lent,
                "free": self.arena_free}

    @property
    def all_durable(self) -> bool:
        return not self.files and not self.records_pending


class Store:
    """The durable store under the core (its ChunkOwner and Durability): it owns the chunks' places,
    the dirty files, drain errors and counters, and wires the parts the module docstring lists."""

    def __init__(self, arena: Arena, devices: list[BlockDevice], sbs: list[Superblock],
                 durable: DurableState, *, half: int, tail: int, seq: int, queue_depth: int = 8,
                 fsync_absorb: bool = False, drain_policy: str = "absorb-first", dedupe: bool = False,
                 max_lag: float = DEFAULT_MAX_LAG, anchor_gen: int = 0, recovery: dict | None = None):
        self.arena = arena
        self.chunk_size = arena.chunk_size
        self.devices = devices
        self.sbs = sbs
        self.durable = durable
        self.alloc = durable.alloc
        self.recovery = recovery or {}  # how this mount started (pool.Recovered.report)
        self.fsync_absorb = fsync_absorb
        self.max_lag = max_lag
        self.ns: Namespace | None = None  # the live namespace, set by attach()
        self.loop = LoopLock()  # shared with the native engine's workers (see the docstring)
        self.limiters = [trio.CapacityLimiter(queue_depth) for _ in devices]
        self.stats = [DeviceStats() for _ in devices]
        self.log = CommitLog(max_lag=max_lag, alive=self._alive)
        self.dedupe = ContentIndex(self.alloc) if dedupe else None
        if self.dedupe is not None:
            self.dedupe.load(durable.digests.values())  # what the saves before this mount wrote
        self.drainer = Drainer(self, queue_depth=queue_depth, policy=drain_policy)
        self.committer = Committer(self, half=half, tail=tail, seq=seq, anchor_gen=anchor_gen)
        self.reservation = Reservation(self.alloc, self.undrained, self._undrained_chunks)
        self.unsealed: OrderedDict[int, Chunk] = OrderedDict()  # partial chunks, not queued yet
        self.lru: OrderedDict[int, Chunk] = OrderedDict()  # drained chunks holding a slot
        self.dirty_inodes: set[int] = set()  # changed since their last commit
        self.errors: dict[int, int] = {}  # ino -> errno of a failed drain, until its next commit
        self.last_error: str | None = None
        self.sync_waiters = 0
        self.progress = trio.lowlevel.ParkingLot()  # drains, commits, frees
        self.bytes_absorbed = 0
        self.bytes_drained = 0
        self.bytes_skipped = 0
        self.on_commit: list = []  # callables(batch) after each journal commit (monitor.py)

    def attach(self, ns: Namespace) -> None:
        self.ns = ns

    def _alive(self, ino: int) -> bool:
        inode = self.ns.inodes.get(ino) if self.ns is not None else None
        return inode is not None and inode.nlink > 0

    # ---- ChunkOwner --------------------------------------------------------
    def alloc_slot(self) -> int:
        try:
            return self.arena.alloc_nowait()
        except NoSpace:
            pass
        slot = self._evict_one()
        if slot is not None:
            return slot
        # nothing clean to evict: let partial chunks drain too, then the caller waits
        self.drainer.open_gate()
        for key, chunk in list(self.unsealed.items()):
            del self.unsealed[key]
            self.drainer.queue(chunk)
        raise NoSpace("memory arena is full of data not yet on the devices")

    def _evict_one(self) -> int | None:
        """The slot of the least recently used chunk already on a device (now only there), or None."""
        while self.lru:
            _, chunk = self.lru.popitem(last=False)
            if chunk.slot is not None and chunk.drained and not chunk.readers:
                slot, chunk.slot = chunk.slot, None
                return slot
        return None

    def make_free(self, want: int) -> None:
        """Evict clean chunks (least recently used first) until `want` slots are free or none is left:
        the FUSE workers' receive buffers are lent from free slots only, and an arena full of
        cached checkpoints would otherwise copy every WRITE instead of adopting it."""
        while self.arena.free_slots < want:
            slot = self._evict_one()
            if slot is None:
                return
            self.arena.free(slot)

    def view(self, slot: int) -> memoryview:
        return self.arena.view(slot)

    def undrained(self) -> int:
        """At least the chunks that will need device space: waiting to drain, or taken by the
        drain (some of those have theirs: `_undrained_chunks` tells)."""
        return len(self.unsealed) + self.drainer.queued() + self.drainer.in_flight

    def _undrained_chunks(self):
        """The chunks that will need device space (reserve.py)."""
        yield from (c for c in self.unsealed.values() if not c.busy)  # (a busy one: the drain's)
        yield from self.drainer.undrained()

    def space_lost(self) -> None:
        self.reservation.changed()

    def reserve(self, chunk: Chunk | None = None, hwm: int | None = None) -> None:
        """DevicesFull unless the devices could hold a new chunk of `hwm` bytes (None: a whole
        one), or `chunk` grown or cut to `hwm` bytes, with every chunk not yet drained (reserve.py)."""
        self.reservation.check(chunk, hwm)

    def chunk_changed(self, chunk: Chunk) -> None:
        key = id(chunk)
        self.lru.pop(key, None)
        if chunk.extent is not None:
            self.alloc.release(chunk.extent.dev, chunk.extent.unit)
            chunk.extent = None
            chunk.extent_gen = -1
            self.reservation.changed()  # undrained again, maybe without a check
        elif chunk.busy:
            self.reservation.changed()  # (being written: that copy's space does not count any more)
        if chunk.hwm >= self.chunk_size:
            self.unsealed.pop(key, None)
            self.drainer.queue(chunk)
        elif not chunk.queued:
            self.unsealed[key] = chunk

    def shorten(self, chunk: Chunk, hwm: int) -> bool:
        """A drained chunk cut to `hwm` bytes keeps its extent, as `hwm` bytes with their own
        checksum, when that still takes the same piece or unit (the allocator tells a piece's
        size by its length, at mount too): no drain, no new room (the committed copy shares it).
        The chunk's high-water mark is its map's to cut (FileData._cut)."""
        ext = chunk.extent
        if self.alloc.piece_size(hwm) != self.alloc.piece_size(ext.length):
            return False
        chunk.extent = Extent(ext.dev, ext.unit, hwm, crc32c.crc32c(self.arena.view(chunk.slot)[:hwm]))
        chunk.gen += 1
        chunk.extent_gen = chunk.gen
        return True

    def chunk_dropped(self, chunk: Chunk) -> None:
        chunk.live = False
        self.unsealed.pop(id(chunk), None)
        if chunk.pins == 0:
            self._discard(chunk)

    def read_ahead(self, data, idx: int) -> None:
        """A read reached chunk `idx`: load the next chunks from the devices before they are asked for."""
        self.drainer.read_ahead(data, idx)

    def _discard(self, chunk: Chunk) -> None:
        key = id(chunk)
        self.lru.pop(key, None)
        self.unsealed.pop(key, None)
        self.drainer.unqueue(chunk)  # never drain it: its bytes are stale
        self.bytes_skipped += chunk.absorbed
        chunk.absorbed = 0
        if chunk.slot is not None and not chunk.busy and not chunk.readers:
            self.arena.free(chunk.slot)
            chunk.slot = None
        if chunk.extent is not None:
            self.alloc.release(chunk.extent.dev, chunk.extent.unit)
            chunk.extent = None
        self.wake()

    def adopt_slot(self, slot: int) -> None:
        self.arena.adopt(slot)

    def read_done(self, chunks) -> None:
        """Replies holding views of these chunks' slots were written: the slots may move again."""
        for chunk in chunks:
            chunk.readers -= 1
            if chunk.readers or chunk.slot is None:
                continue
            if not (chunk.wanted or chunk.busy):
                self.arena.free(chunk.slot)  # dropped while a reply still showed it
                chunk.slot = None
                self.wake()
            elif chunk.live and chunk.drained:
                self.lru[id(chunk)] = chunk  # evictable again

    def _unpin(self, chunks) -> None:
        for chunk in chunks:
            chunk.pins -= 1
            if chunk.pins == 0 and not chunk.live:
                self._discard(chunk)

    # ---- DrainHost -----------------------------------------------------------
    def pressing(self) -> bool:
        """Something needs the drain now: memory half full, someone waiting, or a commit past max_lag."""
        return bool(self.sync_waiters or self.arena.free_slots * 2 <= self.arena.nslots or self.log.overdue())

    def drained(self, chunk: Chunk, extent: Extent) -> None:
        chunk.extent = extent
        chunk.extent_gen = chunk.gen
        self.bytes_drained += chunk.absorbed
        chunk.absorbed = 0
        self.errors.pop(chunk.ino, None)
        if chunk.slot is not None:
            self.lru[id(chunk)] = chunk

    def wrote(self, dev: int) -> None:
        self.committer.wrote(dev)
        if self.last_error and not self.drainer.queued():
            self.last_error = None  # a drain write went through and nothing waits to be retried

    def cached(self, chunk: Chunk) -> None:
        self.lru[id(chunk)] = chunk

    def evictable(self) -> int:
        return len(self.lru)

    def wake(self) -> None:
        """Something moved (a drain, a commit, a free): waiters look again, the committer too
        (each only if parked: waiters check and park in one step of the trio thread), unless it
        would find nothing to commit (a save's close waits for all its chunks: without this,
        every drain trip woke the committer for nothing)."""
        self.loop.unpark(self.progress)
        if not self.log.idle():
            self.committer.wake()

    async def retry_later(self, error: FsError, inos=(), what: str = "") -> None:
        """The one retry policy of drain and journal failures: say so (log, last_error, the files'
        state: failed with the error's errno), let waiters see it, then wait RETRY_DELAY before
        the caller tries again. `what` says what failed, before the error's own message."""
        message = f"{what}: {error}" if what else str(error)
        log.error("%s; will retry", message)
        self.last_error = message
        for ino in inos:
            self.errors[ino] = error.errno
        self.progress.unpark_all()
        await trio.sleep(RETRY_DELAY)

    # ---- CommitHost ------------------------------------------------------------
    def committed(self, batch: list[Pending]) -> None:
        self._unpin(self.log.committed_batch(batch))
        for p in batch:
            if p.is_content and not p.void:
                self.errors.pop(p.ino, None)
        for hook in self.on_commit:
            hook(batch)
        self.wake()

    def urgent(self) -> bool:
        return bool(self.sync_waiters)

    # ---- Durability --------------------------------------------------------
    def record(self, rec: tuple) -> None:
        self._unpin(self.log.record(rec))
        self.committer.wake()

    def unnamed(self, inode: Inode) -> None:
        self.log.unnamed(inode.ino)

    def dirtied(self, inode: Inode) -> None:
        self.dirty_inodes.add(inode.ino)
        self.drainer.note_write()

    def closed(self, inode: Inode) -> None:
        if inode.ino not in self.dirty_inodes or inode.nlink == 0:
            self.dirty_inodes.discard(inode.ino)  # unlinked: nothing of it survives a crash anyway
            if self.log.flush_deferred(inode.ino) is not None:
                self.committer.wake()  # (a reader's close journals nothing: no wake-up, no trio pass)
            return
        self.dirty_inodes.discard(inode.ino)
        cs = self.chunk_size
        snap = {}
        for idx, c in inode.data.chunks.items():
            if c.hwm and idx * cs < inode.size:
                snap[idx] = c
                c.pins += 1
                self.unsealed.pop(id(c), None)
                self.drainer.queue(c)
        self._unpin(self.log.close(inode.ino, inode.size, inode.mtime_ns, inode.ctime_ns, snap))
        if all(c.drained for c in snap.values()):
            self.committer.wake()  # else its chunks' drain wakes the committer (a close that voids an
            # older commit groups everything up to the new one, so nothing else became ready)

    def usage(self) -> tuple[int, int]:
        return self.capacity_bytes(), self.used_bytes()

    def absorbed(self, nbytes: int) -> None:
        """A write put `nbytes` into the arena (the facade's counter hook)."""
        self.bytes_absorbed += nbytes

    # ---- waiting -------------------------------------------------------------
    async def wait_for_room(self, devices_full: bool = False) -> bool:
        """Wait until the arena may have a free slot; False when it never will (devices full)."""
        if devices_full:
            # a delete still on its way to the journal may free device space, and (--dedupe on) a
            # chunk waiting to drain may turn out to share an extent and need none: the drain
            # goes now, and the write tries again once either moved (until neither can)
            free, pending, draining = self.alloc.free_units(), len(self.log.pending), self._draining()
            if not pending and not draining:
                return False
            if draining:
                self.drainer.open_gate()

            def moved() -> bool:
                return (self.alloc.free_units() > free or len(self.log.pending) < pending
                        or self._draining() < draining)
            with trio.move_on_after(2):
                while not moved():
                    await self.progress.park()
            return moved()
        if self.arena.free_slots or self.lru:
            return True
        queued = self.drainer.queued()
        if not self.alloc.free_units() and not queued:
            return False
        if self.last_error and not queued and not self.unsealed:
            raise StoreFailing(self.last_error)
        await self.progress.park()
        return True

    def _draining(self) -> int:
        """Chunks the drain has or will take that may yet share an extent (0 with --dedupe off)."""
        return self.drainer.queued() + self.drainer.in_flight if self.dedupe is not None else 0

    async def sync(self, ino: int | None = None) -> None:
        """fsync(ino) / syncfs (ino None): return once the data and all records before it are durable."""
        if ino is None:
            for i in list(self.log.deferred):
                self.log.flush_deferred(i)
            for i in list(self.dirty_inodes):
                inode = self.ns.inodes.get(i)
                if inode is not None:
                    self.closed(inode)
        else:
            inode = self.ns.inodes.get(ino)
            if inode is not None:
                self.closed(inode)
        self.committer.wake()
        if self.fsync_absorb:
            return
        target = self.log.last_index()
        log.debug("sync(%s): waiting for record %d (committed %d)", ino, target, self.log.committed)
        self.sync_waiters += 1
        self.committer.hurry()
        self.drainer.open_gate()  # someone waits: drain at full speed
        try:
            while self.log.committed < target:
                if ino is not None and ino in self.errors:
                    raise fs_error(self.errors[ino], f"data of inode {ino} could not be written")
                if ino is None and self.last_error:
                    raise StoreFailing(self.last_error)
                await self.progress.park()
        finally:
            self.sync_waiters -= 1
        if ino is not None and ino in self.errors:
            raise fs_error(self.errors.pop(ino))

    # ---- tasks -----------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The background tasks: the drain (workers, gate, ticker) and the journal writer."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.drainer.run)
            nursery.start_soon(self.committer.run)
            task_status.started()

    async def fetch(self, chunks: list[Chunk], held: list | None = None) -> None:
        """Load evicted chunks back; with `held`, each one loaded is also held in memory and
        appended to it, until `let_go(held)` (facade.Backend.fetch says why)."""
        await self.drainer.fetch(chunks, held)

    def hold(self, chunk: Chunk, held: list) -> None:
        """Keep `chunk`'s slot from eviction (as a reply showing it would) until `let_go`."""
        if chunk.slot is not None and chunk.live:
            chunk.readers += 1
            self.lru.pop(id(chunk), None)
            held.append(chunk)

    def let_go(self, held: list) -> None:
        self.read_done(held)

    async def compact(self) -> None:
        await self.committer.compact()

    # ---- lifecycle -------------------------------------------------------------
    async def drain_all(self) -> None:
        """Commit every changed file and wait until everything is on the devices."""
        await self.sync(None)
        while self.log.pending:
            await self.progress.park()

    async def close_clean(self) -> None:
        """After drain_all: mark the journal closed cleanly (docs/FORMAT.md, journal anchor)."""
        await self.committer.write_anchor(clean=True)

    def close(self) -> None:
        for d in self.devices:
            d.close()

    # ---- accounting ------------------------------------------------------------
    def lag(self) -> float:
        return self.log.lag()

    def oldest_closed(self) -> tuple[int, float] | None:
        return self.log.oldest_closed()

    def file_states(self) -> dict[int, FileState]:
        """Every inode that is not durable, with its state and drain progress (one pass)."""
        content = self.log.content_pending()
        made = self.log.made_pending()
        inos = set(self.errors) | self.dirty_inodes | set(self.log.deferred) | set(content) | made
        out = {}
        for ino in inos:
            st = self._file_state(ino, content, made)
            if st is not None:
                out[ino] = st
        return out

    def state(self, ino: int) -> str:
        """memory (changed since its last commit, or never closed), draining (committed by a
        close or fsync, on its way to the devices), durable, or failed:ERRNO."""
        pending = self.log.content_of(ino)  # (this file's records only: the log may hold thousands)
        st = self._file_state(ino, {ino: pending} if pending else {},
                              {ino} if self.log.is_made_pending(ino) else set())
        return DURABLE if st is None else st.xattr

    def _file_state(self, ino: int, content: dict, made: set) -> FileState | None:
        """`ino`'s state, None when it is durable (or gone: nothing of it can become durable)."""
        inode = self.ns.inodes.get(ino) if self.ns is not None else None
        if self.ns is not None and inode is None:
            return None
        if ino in self.errors:
            state, code = FAILED, self.errors[ino]
        elif ino in self.dirty_inodes or ino in self.log.deferred:
            state, code = MEMORY, None
        elif ino in content or ino in made:
            state, code = DRAINING, None
        else:
            return None
        seen: set[int] = set()
        total = done = 0
        chunk_sets = [p.chunks.values() for p in content.get(ino, ())]
        if inode is not None and state != DRAINING and inode.data is not None:
            chunk_sets.append(inode.data.chunks.values())  # not committed yet: what it holds now
        for chunks in chunk_sets:
            for c in chunks:
                if id(c) not in seen:
                    seen.add(id(c))
                    total += c.hwm
                    done += c.hwm if c.drained else 0
        return FileState(ino, state, code, inode.size if inode is not None else 0, total, done)

    def statistics(self) -> StoreStats:
        """A frozen snapshot of everything status, metrics and the state xattr report."""
        cs = self.chunk_size
        in_memory = sum(c.absorbed for c in self._chunks())
        cached = sum(1 for c in self.lru.values() if c.slot is not None)
        devices = tuple(DeviceSnapshot(d, str(dev.path), self.alloc.units[d] * cs,
                                       (self.alloc.units[d] - self.alloc.free_units(d)) * cs,
                                       s.bytes_written, s.bytes_read, s.writes, s.reads, s.errors)
                        for d, (dev, s) in enumerate(zip(self.devices, self.stats)))
        return StoreStats(
            chunk_size=cs, bytes_absorbed=self.bytes_absorbed, bytes_drained=self.bytes_drained,
            bytes_skipped=self.bytes_skipped, bytes_in_memory=in_memory,
            arena=self.arena.capacity, arena_used=self.arena.used_slots * cs, arena_cached=cached * cs,
            arena_lent=self.arena.lent_slots * cs, arena_free=self.arena.free_slots * cs, devices=devices,
            files=self.file_states(),
            records_pending=len(self.log.pending), records_voided=self.log.records_voided,
            lag=self.log.lag(), max_lag=self.max_lag, oldest_closed=self.log.oldest_closed(),
            last_error=self.last_error, recovery=dict(self.recovery))

    def _chunks(self):
        """Every chunk that may hold absorbed bytes: the live files' and those pinned by commits."""
        seen: set[int] = set()
        if self.ns is not None:
            for inode in self.ns.inodes.values():
                if inode.data is not None:
                    for c in inode.data.chunks.values():
                        seen.add(id(c))
                        yield c
        for p in self.log.pending:
            for c in p.chunks.values():
                if id(c) not in seen:
                    seen.add(id(c))
                    yield c

    def check_invariants(self) -> None:
        """Quiescent checks (no drain, fetch or reply in flight): every arena slot is free, lent, or
        held by exactly one chunk (of a file, or of a pending record); the byte accounting adds up."""
        self.arena.check_invariants()
        self.alloc.check_invariants()
        self.log.check_invariants()
        chunks = list(self._chunks())
        held = [c.slot for c in chunks if c.slot is not None]
        assert len(held) == len(set(held)), "slot held by two chunks"
        assert len(held) + self.arena.free_slots + self.arena.lent_slots == self.arena.nslots, \
            f"leaked arena slots: {len(held)} held, {self.arena.free_slots} free, {self.arena.lent_slots} lent"
        assert not any(c.readers for c in chunks), "a chunk still pinned by a reply"
        in_memory = sum(c.absorbed for c in chunks)
        assert self.bytes_absorbed == self.bytes_drained + self.bytes_skipped + in_memory, "accounting"

    def used_bytes(self) -> int:
        return self.alloc.used_units() * self.chunk_size

    def capacity_bytes(self) -> int:
        return sum(self.alloc.units) * self.chunk_size

    def undrained_bytes(self) -> int:
        return self.drainer.queued_bytes() + sum(c.hwm for c in self.unsealed.values())
