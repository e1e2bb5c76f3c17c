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

All bookkeeping runs in the trio thread; only device calls run in worker
threads (one CapacityLimiter per device, its queue depth).
"""
from __future__ import annotations

import errno
import logging
import stat
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import crc32c
import trio

from .arena import Arena
from .device import BlockDevice, round_up
from .durable import DurableState
from .errors import DeviceError, DevicesFull, FsError, NoSpace, fs_error
from .filemap import Chunk
from .journal import Extent, encode_frame, frame_size
from .layout import Superblock
from .namespace import Inode, Namespace

log = logging.getLogger("ckptfs.store")


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


class Store:
    def __init__(self, arena: Arena, devices: list[BlockDevice], sbs: list[Superblock],
                 durable: DurableState, *, half: int, tail: int, seq: int, queue_depth: int = 8,
                 fsync_absorb: bool = False):
        self.arena = arena
        self.chunk_size = arena.chunk_size
        self.devices = devices
        self.sbs = sbs
        self.sb = sbs[0]
        self.durable = durable
        self.alloc = durable.alloc
        self.half, self.tail, self.seq = half, tail, seq
        self.queue_depth = queue_depth
        self.fsync_absorb = fsync_absorb
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
        self.dirty_inodes: set[int] = set()
        self.deferred: dict[int, tuple[int, bytes, tuple]] = {}  # ino -> (parent, name, make record)
        self.unflushed: set[int] = set()  # devices with data written since their last flush
        self.errors: dict[int, int] = {}  # ino -> errno of a failed drain, until its next commit
        self.last_error: str | None = None
        self._work = [trio.lowlevel.ParkingLot() for _ in devices]
        self._journal_lot = trio.lowlevel.ParkingLot()
        self._progress = trio.lowlevel.ParkingLot()  # drains, commits, frees
        self._fetching: dict[int, trio.Event] = {}
        self.closing = False
        self.bytes_absorbed = 0
        self.bytes_drained = 0
        self.bytes_skipped = 0
        self.records_voided = 0
        self.in_flight_drains = 0

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
        if chunk.slot is not None and key not in self._fetching:
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
        self.ready[dev][id(chunk)] = chunk
        self._work[dev].unpark()

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
        p = self._append(Pending(self.next_index, rec=(op, *args)))
        if op in ("unlink", "rename", "rmdir"):
            for q in self.pending:
                if q.rec is None and not q.void and q.index > self.in_flight:
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

    def closed(self, inode: Inode) -> None:
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
            if q is not p and q.rec is None and q.ino == inode.ino and not q.void and q.index > self.in_flight:
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
        while self.committed < target:
            if ino is not None and ino in self.errors:
                raise fs_error(self.errors[ino], f"data of inode {ino} could not be written")
            if ino is None and self.last_error:
                raise FsError(self.last_error, errno.EIO)
            await self._progress.park()
        if ino is not None and ino in self.errors:
            raise fs_error(self.errors.pop(ino))

    # ---- tasks ---------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for d in range(len(self.devices)):
                for _ in range(self.queue_depth):
                    nursery.start_soon(self._drain_worker, d)
            nursery.start_soon(self._journal_task)
            task_status.started()

    async def _drain_worker(self, dev: int) -> None:
        queue = self.ready[dev]
        while True:
            while not queue:
                await self._work[dev].park()
            _, chunk = queue.popitem(last=False)
            chunk.queued = False
            if chunk.drained or chunk.slot is None or not (chunk.live or chunk.pins):
                if not (chunk.live or chunk.pins) or chunk.slot is None:
                    self.bytes_skipped += chunk.hwm
                continue
            try:
                await self._drain_one(dev, chunk)
            except Exception as e:  # noqa: BLE001 - a bug must not stop the drain
                log.exception("unexpected error draining inode %d chunk %d", chunk.ino, chunk.idx)
                self.last_error = f"internal error: {e}"
                self._progress.unpark_all()
                await trio.sleep(0.5)

    async def _drain_one(self, pref: int, chunk: Chunk) -> None:
        self.in_flight_drains += 1
        try:
            await self._drain_unit(pref, chunk)
        finally:
            self.in_flight_drains -= 1

    async def _drain_unit(self, pref: int, chunk: Chunk) -> None:
        try:
            dev, unit = self.alloc.alloc(pref)
        except NoSpace:
            self.errors[chunk.ino] = errno.ENOSPC
            log.error("no room on any device for a chunk of inode %d; will retry", chunk.ino)
            self._progress.unpark_all()
            await self._progress.park()  # until something is freed
            self._queue(chunk)
            return
        gen, hwm = chunk.gen, chunk.hwm
        view = self.arena.view(chunk.slot)
        offset = self.sbs[dev].unit_offset(unit)
        try:
            crc = await trio.to_thread.run_sync(_checksum_and_write, self.devices[dev], view, hwm,
                                                offset, limiter=self.limiters[dev])
        except DeviceError as e:
            self.stats[dev].errors += 1
            self.errors[chunk.ino] = e.errno
            self.last_error = str(e)
            log.error("drain failed: %s (inode %d chunk %d); will retry", e, chunk.ino, chunk.idx)
            self.alloc.release(dev, unit)
            self._progress.unpark_all()
            await trio.sleep(0.5)
            self._queue(chunk)
            return
        self.stats[dev].bytes_written += round_up(hwm)
        self.stats[dev].writes += 1
        self.unflushed.add(dev)
        if chunk.gen != gen or not (chunk.live or chunk.pins) or chunk.extent is not None:
            self.alloc.release(dev, unit)  # changed or dropped while in flight: this copy is stale
            self.bytes_skipped += hwm
            if chunk.live and not chunk.drained and chunk.slot is not None and chunk.hwm >= self.chunk_size:
                self._queue(chunk)
        else:
            chunk.extent = Extent(dev, unit, hwm, crc)
            chunk.extent_gen = gen
            self.bytes_drained += hwm
            self.errors.pop(chunk.ino, None)
            if self.last_error and not any(s for s in self.ready):
                self.last_error = None
            if chunk.slot is not None:
                self.lru[id(chunk)] = chunk
        self._progress.unpark_all()
        self._journal_lot.unpark_all()

    def _take_batch(self) -> list[Pending]:
        """The longest prefix of pending records that can go in one frame now."""
        batch: list[Pending] = []
        need = -1
        budget = self.sb.journal_half // 4
        size = 0
        for p in self.pending:
            if not p.ready():
                break
            batch.append(p)
            need = max(need, p.group_end)
            size += 64 + len(p.chunks) * 30
            if size > budget and p.index >= need:
                break
        while batch and batch[-1].index < need:
            batch.pop()  # an atomic group is not complete yet: leave it for later
            need = max([q.group_end for q in batch], default=-1)
        return batch

    async def _journal_task(self) -> None:
        while True:
            batch = self._take_batch()
            if not batch:
                await self._journal_lot.park()
                continue
            self.in_flight = batch[-1].index
            try:
                await self._commit(batch)
            except Exception as e:  # noqa: BLE001 - device errors (and bugs) are retried
                if not isinstance(e, DeviceError):
                    log.exception("unexpected error in journal commit")
                self.last_error = str(e)
                for p in batch:
                    if p.rec is None:
                        self.errors[p.ino] = errno.EIO
                log.error("journal commit failed: %s; will retry", e)
                self._progress.unpark_all()
                await trio.sleep(0.5)
                continue
            for _ in batch:
                p = self.pending.popleft()
                for c in p.chunks.values():
                    self._unpin(c)
                if p.rec is None and not p.void:
                    self.errors.pop(p.ino, None)
            self.committed = batch[-1].index
            self._progress.unpark_all()

    async def _commit(self, batch: list[Pending]) -> None:
        records = [r for r in (p.record(self.chunk_size) for p in batch) if r is not None]
        await self._flush(list(self.unflushed))
        if records:
            frame = encode_frame(self.sb.pool_id, self.seq + 1, self.durable.epoch, records)
            if self.tail + len(frame) > self.sb.journal_half:
                await self.compact()
                frame = encode_frame(self.sb.pool_id, self.seq + 1, self.durable.epoch, records)
                if self.tail + len(frame) > self.sb.journal_half:
                    raise DeviceError("journal is too small for one commit: format with a larger --journal-size")
            await self._write_journal(frame, self.tail)
            log.debug("committed frame seq %d at %d: %s", self.seq + 1, self.tail,
                      " ".join(f"{r[0]}:{r[1]}" for r in records))
            self.seq += 1
            self.tail += len(frame)
            for r in records:
                self.durable.apply(r)

    async def _flush(self, devs: list[int]) -> None:
        self.unflushed.difference_update(devs)
        try:
            await _all([(self._run_on, d, self.devices[d].flush) for d in devs])
        except BaseException:
            self.unflushed.update(devs)
            raise

    async def _run_on(self, d: int, fn, *args) -> None:
        try:
            await trio.to_thread.run_sync(fn, *args, limiter=self.limiters[d])
        except DeviceError:
            self.stats[d].errors += 1
            raise

    async def _write_journal(self, frame: bytes, offset: int) -> None:
        from .device import aligned_buffer
        buf = aligned_buffer(len(frame))
        buf[:len(frame)] = frame
        await _all([(self._run_on, d, self.devices[d].pwrite, buf[:len(frame)],
                     sb.half_offset(self.half) + offset) for d, sb in enumerate(self.sbs)])
        await self._flush(list(range(len(self.devices))))

    async def compact(self) -> None:
        """Write a snapshot of the durable state at the start of the other half, then go on there."""
        epoch = self.durable.epoch + 1
        recs = [("begin", epoch, self.durable.ns.next_ino)] + self.durable.snapshot() + [("snapend",)]
        frames, seq = [], self.seq
        step = 2000
        for i in range(0, len(recs), step):
            seq += 1
            frames.append(encode_frame(self.sb.pool_id, seq, epoch, recs[i:i + step]))
        blob = b"".join(frames)
        if len(blob) > self.sb.journal_half:
            raise DeviceError("the namespace no longer fits in a journal half: format with a larger --journal-size")
        half = 1 - self.half
        old_half, self.half = self.half, half
        try:
            await self._write_journal(blob, 0)
        except BaseException:
            self.half = old_half
            raise
        self.durable.epoch = epoch
        self.seq, self.tail = seq, len(blob)
        log.info("journal compacted into half %d (epoch %d, %d records, %d bytes)", half, epoch, len(recs), len(blob))

    # ---- reads of evicted data -------------------------------------------------
    async def fetch(self, chunks: list[Chunk]) -> None:
        """Load evicted chunks back into the arena, in parallel across devices."""
        await _all([(self._fetch_one, c) for c in chunks])

    async def _fetch_one(self, chunk: Chunk) -> None:
        key = id(chunk)
        if key in self._fetching:
            await self._fetching[key].wait()
            return
        if chunk.slot is not None or chunk.extent is None:
            return
        done = self._fetching[key] = trio.Event()
        try:
            while True:
                try:
                    slot = self.alloc_slot()
                    break
                except NoSpace:
                    if not await self.wait_for_room():
                        raise
            ext = chunk.extent
            view = self.arena.view(slot)
            length = round_up(ext.length)
            try:
                await trio.to_thread.run_sync(self.devices[ext.dev].pread_into, view[:length],
                                              self.sbs[ext.dev].unit_offset(ext.unit),
                                              limiter=self.limiters[ext.dev])
            except DeviceError:
                self.arena.free(slot)
                self.stats[ext.dev].errors += 1
                raise
            self.stats[ext.dev].bytes_read += length
            self.stats[ext.dev].reads += 1
            if crc32c.crc32c(view[:ext.length]) != ext.crc:
                self.arena.free(slot)
                self.stats[ext.dev].errors += 1
                msg = (f"checksum mismatch reading inode {chunk.ino} chunk {chunk.idx} from "
                       f"{self.devices[ext.dev].path} unit {ext.unit}")
                log.error(msg)
                raise DeviceError(msg)
            if chunk.extent is not ext or not (chunk.live or chunk.pins) or chunk.slot is not None:
                self.arena.free(slot)
                return
            chunk.slot = slot
            self.lru[key] = chunk
        finally:
            del self._fetching[key]
            done.set()

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
    def usage(self) -> tuple[int, int]:
        return self.capacity_bytes(), self.used_bytes()

    def used_bytes(self) -> int:
        return self.alloc.used_units() * self.chunk_size

    def capacity_bytes(self) -> int:
        return sum(self.alloc.units) * self.chunk_size

    def undrained_bytes(self) -> int:
        return sum(c.hwm for q in self.ready for c in q.values()) + sum(c.hwm for c in self.unsealed.values())


def _checksum_and_write(device: BlockDevice, view: memoryview, hwm: int, offset: int) -> int:
    """In a worker thread: zero-pad to 4 KiB, checksum the valid bytes, write; returns the crc.

    If the chunk changes meanwhile, the caller sees its generation moved and drops this copy.
    """
    length = round_up(hwm)
    if length > hwm:
        view[hwm:length] = bytes(length - hwm)
    crc = crc32c.crc32c(view[:hwm])
    device.pwrite(view[:length], offset)
    return crc


async def _all(calls: list[tuple]) -> None:
    """Run `(afn, *args)` calls concurrently; raise the first failure itself (not a group)."""
    errors: list[BaseException] = []

    async def one(afn, *args) -> None:
        try:
            await afn(*args)
        except Exception as e:  # noqa: BLE001 - collected and re-raised below
            errors.append(e)

    async with trio.open_nursery() as n:
        for call in calls:
            n.start_soon(one, *call)
    if errors:
        raise errors[0]
