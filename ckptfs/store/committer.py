"""The journal writer: commits pending records in order, in frames, mirrored.

`Committer` owns the journal's position on the devices (`half`, `tail`,
`seq`, the anchor generation) and the set of devices holding data written
since their last flush (`unflushed`). One task asks the commit log
(ordering.py) for the next batch: the longest ready prefix of pending records
that does not split an atomic group. It flushes the devices holding data
written since the last commit, writes the frame at the journal tail on every
device, flushes again, applies the records to the durable state and reports
the batch committed. With `--dedupe on` a frame also carries the digests of
the extents its `content` records name for the first time (dedupe.py). A
batch that nobody waits for (no fsync, syncfs or unmount:
`CommitHost.urgent()`) first lingers LINGER seconds for company:
back-to-back metadata operations (a chmod loop, a checkpoint's renames and
copystat) then share one frame, one device flush and one wake-up of the trio
thread instead of paying each per operation; a sync arriving meanwhile
(`hurry()`) ends the linger. Every frame carries a `stamp` record (its wall-clock
time), so recovery can say when the state it recovered was current.

When a frame does not fit in the current half, it first compacts: a
snapshot of the durable state at the start of the other half, then a new
journal anchor naming that half (see docs/FORMAT.md). A clean unmount writes
an anchor marked clean (`write_anchor(clean=True)`).

It talks to the store through `CommitHost` (below).
"""
from __future__ import annotations

import logging
import time
from typing import Protocol

import outcome
import trio

from ..errors import DeviceError, FsError, StoreFailing
from ..format.journal import encode_frame
from ..format.layout import Anchor
from ..format.records import Begin, Digests, Snapend, Stamp
from ..tasks import LoopLock, in_threads
from .dedupe import ContentIndex
from .device import BlockDevice, aligned_buffer
from .durable import DurableState
from .ordering import CommitLog, Pending

log = logging.getLogger("ckptfs.journal")
LINGER = 0.002  # seconds a batch nobody waits for gathers more records before it is written
DIGEST_SHARE = 8  # a snapshot's digests take a half's 1/DIGEST_SHARE at most (the newest are kept)


class CommitHost(Protocol):
    """What the committer needs from the store."""
    devices: list[BlockDevice]
    sbs: list
    limiters: list[trio.CapacityLimiter]
    stats: list  # DeviceStats per device
    durable: DurableState
    log: CommitLog
    dedupe: ContentIndex | None  # --dedupe on: the digests each frame carries
    loop: LoopLock  # wake-ups from other threads go through loop.soon

    def committed(self, batch: list[Pending]) -> None: ...  # the batch is on the devices
    def urgent(self) -> bool: ...  # someone waits for a commit (fsync, syncfs, unmount)
    async def retry_later(self, error: FsError, inos=(), what: str = "") -> None: ...


class Committer:
    """The journal writer: it owns where the next frame goes (`half`, `tail`, `seq`), the anchor
    generation, and the devices to flush before it (`unflushed`, marked by `wrote`)."""

    def __init__(self, host: CommitHost, *, half: int, tail: int, seq: int, anchor_gen: int = 0):
        self.host = host
        self.sb = host.sbs[0]
        self.half, self.tail, self.seq = half, tail, seq  # where the next frame goes, and its seq - 1
        self.anchor_gen = anchor_gen  # the newest journal anchor's generation
        self.unflushed: set[int] = set()  # devices with data written since their last flush
        self.lot = trio.lowlevel.ParkingLot()  # the committer, idle
        self.lingering = trio.lowlevel.ParkingLot()  # the committer, gathering a batch (LINGER)

    def wrote(self, dev: int) -> None:
        """Data reached `dev`; it must be flushed before a frame that names it is written."""
        self.unflushed.add(dev)

    def wake(self) -> None:
        """Records were added or became ready: look for a batch again. Only a parked committer
        needs waking (a busy one takes the next batch when its commit returns): a wake-up of
        the trio thread per metadata operation cost more than the commit itself."""
        self.host.loop.unpark(self.lot)

    def hurry(self) -> None:
        """Someone now waits for a commit: end a linger."""
        self.host.loop.unpark(self.lingering)

    async def run(self) -> None:
        h = self.host
        while True:
            batch = h.log.take_batch(self.sb.journal_half // 4)
            if not batch:
                await self.lot.park()
                continue
            if LINGER and not h.urgent():
                with trio.move_on_after(LINGER):
                    await self.lingering.park()
                batch = h.log.take_batch(self.sb.journal_half // 4)
            try:
                await self._commit(batch)
            except Exception as e:  # noqa: BLE001 - device errors (and bugs) are retried
                if not isinstance(e, DeviceError):
                    log.exception("unexpected error in journal commit")
                error = e if isinstance(e, DeviceError) else StoreFailing(f"internal error: {e}")
                await h.retry_later(error, [p.ino for p in batch if p.is_content], "journal commit failed")
                continue
            h.committed(batch)

    async def _commit(self, batch: list[Pending]) -> None:
        records = [r for r in (p.record() for p in batch) if r is not None]
        await self._flush(list(self.unflushed))
        if not records:
            return
        digests = self.host.dedupe.to_journal(records) if self.host.dedupe is not None else []
        if digests:
            records.append(Digests(digests))
        durable = self.host.durable
        stamped = [Stamp(time.time_ns()), *records]
        frame = encode_frame(self.sb.pool_id, self.seq + 1, durable.epoch, stamped)
        if self.tail + len(frame) > self.sb.journal_half:
            await self.compact()
            frame = encode_frame(self.sb.pool_id, self.seq + 1, durable.epoch, stamped)
            if self.tail + len(frame) > self.sb.journal_half:
                raise DeviceError("journal is too small for one commit: format with a larger --journal-size")
        await self._write_journal(frame, self.tail)
        log.debug("committed frame seq %d at %d: %s", self.seq + 1, self.tail,
                  " ".join(f"{r.op}:{r[1]}" for r in records))
        self.seq += 1
        self.tail += len(frame)
        for r in records:
            durable.apply(r)
        if digests:
            self.host.dedupe.journaled(digests)

    async def _flush(self, devs: list[int]) -> None:
        await self._flushing([(d, self.host.devices[d].flush) for d in devs])

    async def _flushing(self, calls: list[tuple]) -> None:
        """Run `(dev, fn, *args)` calls at once, each ending with a flush of its device: those
        devices count as flushed from the start (data written meanwhile marks them again), and
        as not flushed again if a call fails. They bypass the devices' CapacityLimiters (one
        small write or flush per device beside the drain's queue depth) and wake the trio
        thread once for all devices (`in_threads`)."""
        if not calls:
            return
        devs = [c[0] for c in calls]
        self.unflushed.difference_update(devs)
        try:
            results = await in_threads([c[1:] for c in calls])
        except BaseException:
            self.unflushed.update(devs)
            raise
        failed = [r.error for r in results if isinstance(r, outcome.Error)]
        if failed:
            self.unflushed.update(devs)
            for d, r in zip(devs, results):
                if isinstance(r, outcome.Error) and isinstance(r.error, DeviceError):
                    self.host.stats[d].failed()
            raise failed[0]

    async def _write_all(self, block, offset_of) -> None:
        """Write `block` on every device at `offset_of(sb)` and flush each (one thread per device, all
        at once: the mirrors need no order among themselves)."""
        buf = aligned_buffer(len(block))
        buf[:len(block)] = block
        view = buf[:len(block)]
        await self._flushing([(d, _write_and_flush, self.host.devices[d], view, offset_of(sb))
                              for d, sb in enumerate(self.host.sbs)])

    async def _write_journal(self, frame: bytes, offset: int) -> None:
        await self._write_all(frame, lambda sb: sb.half_offset(self.half) + offset)

    async def compact(self) -> None:
        """Write a snapshot of the durable state at the start of the other half, then go on there."""
        durable = self.host.durable
        epoch = durable.epoch + 1
        recs = [Begin(epoch, durable.ns.next_ino), Stamp(time.time_ns()),
                *durable.snapshot(self.sb.journal_half // DIGEST_SHARE), Snapend()]
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
        durable.epoch = epoch
        self.seq, self.tail = seq, len(blob)
        await self.write_anchor(clean=False)
        log.info("journal compacted into half %d (epoch %d, %d records, %d bytes)", half, epoch, len(recs), len(blob))

    async def write_anchor(self, *, clean: bool) -> None:
        """Record on every device which half and epoch are current (and, when `clean`, that nothing
        follows the last frame: the pool was closed cleanly). Both slots alternate, so a torn anchor
        write leaves the previous one intact."""
        gen = self.anchor_gen + 1
        anchor = Anchor(generation=gen, epoch=self.host.durable.epoch, half=self.half, clean=clean,
                        seq=self.seq, time_ns=time.time_ns())
        await self._write_all(anchor.encode(self.sb.pool_id), lambda sb: anchor.offset)
        self.anchor_gen = gen


def _write_and_flush(dev: BlockDevice, view, offset: int) -> None:
    dev.pwrite(view, offset)
    dev.flush()
