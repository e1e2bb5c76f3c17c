"""The journal writer: commits pending records in order, in frames, mirrored.

One task takes the longest prefix of pending records that is ready (every
chunk a `content` record captured is drained) and does not split an atomic
group, flushes the devices holding data written since the last commit, writes
the frame at the journal tail on every device, flushes again, then applies the
records to the durable state and wakes fsync waiters. Every frame carries a
`stamp` record (its wall-clock time), so recovery can say when the state it
recovered was current. When a frame does not fit in the current half, it first
compacts: a snapshot of the durable state at the start of the other half, then
a new journal anchor naming that half (see docs/FORMAT.md). A clean unmount
writes an anchor marked clean (`write_anchor(clean=True)`).
"""
from __future__ import annotations

import errno
import logging
import time
from typing import TYPE_CHECKING

import trio

from .device import aligned_buffer
from .errors import DeviceError
from .journal import encode_frame
from .layout import Anchor
from .tasks import gather

if TYPE_CHECKING:
    from .store import Pending

log = logging.getLogger("ckptfs.journal")


class Committer:
    def __init__(self, store):
        self.s = store

    def _take_batch(self) -> list[Pending]:
        """The longest prefix of pending records that can go in one frame now."""
        batch: list[Pending] = []
        need = -1
        budget = self.s.sb.journal_half // 4
        size = 0
        for p in self.s.pending:
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

    async def run(self) -> None:
        while True:
            batch = self._take_batch()
            if not batch:
                await self.s._journal_lot.park()
                continue
            self.s.in_flight = batch[-1].index
            try:
                await self._commit(batch)
            except Exception as e:  # noqa: BLE001 - device errors (and bugs) are retried
                if not isinstance(e, DeviceError):
                    log.exception("unexpected error in journal commit")
                self.s.last_error = str(e)
                for p in batch:
                    if p.rec is None:
                        self.s.errors[p.ino] = errno.EIO
                log.error("journal commit failed: %s; will retry", e)
                self.s._progress.unpark_all()
                await trio.sleep(0.5)
                continue
            for _ in batch:
                p = self.s.pending.popleft()
                for c in p.chunks.values():
                    self.s._unpin(c)
                if p.rec is None and not p.void:
                    self.s.errors.pop(p.ino, None)
            self.s.committed = batch[-1].index
            for hook in self.s.on_commit:
                hook(batch)
            self.s._progress.unpark_all()

    async def _commit(self, batch: list[Pending]) -> None:
        records = [r for r in (p.record(self.s.chunk_size) for p in batch) if r is not None]
        await self._flush(list(self.s.unflushed))
        if records:
            stamped = [("stamp", time.time_ns()), *records]
            frame = encode_frame(self.s.sb.pool_id, self.s.seq + 1, self.s.durable.epoch, stamped)
            if self.s.tail + len(frame) > self.s.sb.journal_half:
                await self.compact()
                frame = encode_frame(self.s.sb.pool_id, self.s.seq + 1, self.s.durable.epoch, stamped)
                if self.s.tail + len(frame) > self.s.sb.journal_half:
                    raise DeviceError("journal is too small for one commit: format with a larger --journal-size")
            await self._write_journal(frame, self.s.tail)
            log.debug("committed frame seq %d at %d: %s", self.s.seq + 1, self.s.tail,
                      " ".join(f"{r[0]}:{r[1]}" for r in records))
            self.s.seq += 1
            self.s.tail += len(frame)
            for r in records:
                self.s.durable.apply(r)

    async def _flush(self, devs: list[int]) -> None:
        self.s.unflushed.difference_update(devs)
        try:
            await gather([(self._run_on, d, self.s.devices[d].flush) for d in devs])
        except BaseException:
            self.s.unflushed.update(devs)
            raise

    async def _run_on(self, d: int, fn, *args) -> None:
        try:
            await trio.to_thread.run_sync(fn, *args, limiter=self.s.limiters[d])
        except DeviceError:
            self.s.stats[d].errors += 1
            raise

    async def _write_journal(self, frame: bytes, offset: int) -> None:
        buf = aligned_buffer(len(frame))
        buf[:len(frame)] = frame
        await gather([(self._run_on, d, self.s.devices[d].pwrite, buf[:len(frame)],
                     sb.half_offset(self.s.half) + offset) for d, sb in enumerate(self.s.sbs)])
        await self._flush(list(range(len(self.s.devices))))

    async def compact(self) -> None:
        """Write a snapshot of the durable state at the start of the other half, then go on there."""
        epoch = self.s.durable.epoch + 1
        recs = [("begin", epoch, self.s.durable.ns.next_ino), ("stamp", time.time_ns()),
                *self.s.durable.snapshot(), ("snapend",)]
        frames, seq = [], self.s.seq
        step = 2000
        for i in range(0, len(recs), step):
            seq += 1
            frames.append(encode_frame(self.s.sb.pool_id, seq, epoch, recs[i:i + step]))
        blob = b"".join(frames)
        if len(blob) > self.s.sb.journal_half:
            raise DeviceError("the namespace no longer fits in a journal half: format with a larger --journal-size")
        half = 1 - self.s.half
        old_half, self.s.half = self.s.half, half
        try:
            await self._write_journal(blob, 0)
        except BaseException:
            self.s.half = old_half
            raise
        self.s.durable.epoch = epoch
        self.s.seq, self.s.tail = seq, len(blob)
        await self.write_anchor(clean=False)
        log.info("journal compacted into half %d (epoch %d, %d records, %d bytes)", half, epoch, len(recs), len(blob))

    async def write_anchor(self, *, clean: bool) -> None:
        """Record on every device which half and epoch are current (and, when `clean`, that nothing
        follows the last frame: the pool was closed cleanly). Both slots alternate, so a torn anchor
        write leaves the previous one intact."""
        gen = self.s.anchor_gen + 1
        anchor = Anchor(generation=gen, epoch=self.s.durable.epoch, half=self.s.half, clean=clean,
                        seq=self.s.seq, time_ns=time.time_ns())
        block = anchor.encode(self.s.sb.pool_id)
        buf = aligned_buffer(len(block))
        buf[:] = block
        await gather([(self._run_on, d, self.s.devices[d].pwrite, buf, anchor.offset)
                      for d in range(len(self.s.devices))])
        await self._flush(list(range(len(self.s.devices))))
        self.s.anchor_gen = gen
