"""Moving bytes between the arena and the devices: drain workers and fetches.

Each device has `queue_depth` worker tasks taking chunks from its ready
queue. A worker takes a few queued chunks at once, gives each a data unit
(consecutive units where it can), and writes each run of consecutive units
with one `pwritev` in a worker thread, the checksum computed there too, so
the trio thread (which serves FUSE) only does bookkeeping. When the write
returns, a chunk whose generation moved on, or that was deleted meanwhile,
gets its unit back instead (that copy is stale).

Fetches read evicted chunks back into arena slots, in parallel across
devices, and verify each chunk's crc32c: a mismatch is EIO and a logged
error, never wrong bytes.
"""
from __future__ import annotations

import errno
import logging

import crc32c
import trio

from .device import BlockDevice, round_up
from .errors import DeviceError, NoSpace
from .filemap import Chunk
from .journal import Extent
from .tasks import gather

log = logging.getLogger("ckptfs.drain")
BATCH = 8  # chunks one worker writes per trip to a device (8 MiB at the default chunk size)
READAHEAD = 16  # chunks loaded ahead of a sequential reader
SLOW_DEVICE = 1e9  # bytes/s under which a device keeps draining while saves stream in


class Drainer:
    def __init__(self, store):
        self.s = store

    def slow(self, dev: int) -> bool:
        """A device not known to be fast: worth keeping busy even while the drain is held."""
        bw = self.s.stats[dev].bandwidth
        return bw is None or bw < SLOW_DEVICE

    async def worker(self, dev: int, k: int = 0) -> None:
        queue = self.s.ready[dev]
        while True:
            while not queue:
                await self.s._work[dev].park()
            # while the drain is held back (absorb-first), worker 0 of a slow device still keeps
            # one batch in flight: a slow device idle during the save would cost time-to-durable,
            # while a fast one catches up quickly afterwards and costs CPU the save needs now
            if not self.s._gate.is_set() and not (k == 0 and self.slow(dev)):
                await self.s._gate.wait()
                continue
            batch = []
            while queue and len(batch) < BATCH:
                _, chunk = queue.popitem(last=False)
                chunk.queued = False
                if not chunk.drained and chunk.slot is not None and (chunk.live or chunk.pins):
                    batch.append(chunk)
            if not batch:
                continue
            self.s.in_flight_drains += len(batch)
            try:
                await self._drain_batch(dev, batch)
            except Exception as e:  # noqa: BLE001 - a bug must not stop the drain
                log.exception("unexpected error draining %d chunk(s) of inode %d", len(batch), batch[0].ino)
                self.s.last_error = f"internal error: {e}"
                self.s._progress.unpark_all()
                await trio.sleep(0.5)
                for c in batch:
                    self.s._queue(c)
            finally:
                self.s.in_flight_drains -= len(batch)

    async def _drain_batch(self, pref: int, batch: list[Chunk]) -> None:
        s = self.s
        placed = []  # (chunk, dev, unit, gen, hwm)
        for i, chunk in enumerate(batch):
            try:
                dev, unit = s.alloc.alloc(pref)
            except NoSpace:
                for c in batch[i:]:
                    s.errors[c.ino] = errno.ENOSPC
                log.error("no room on any device for %d chunk(s); will retry", len(batch) - i)
                s._progress.unpark_all()
                with trio.move_on_after(1):
                    await s._progress.park()  # until something is freed
                for c in batch[i:]:
                    s._queue(c)
                break
            placed.append((chunk, dev, unit, chunk.gen, chunk.hwm))
        runs: list[list[tuple]] = []
        for p in placed:
            chunk = p[0]
            if chunk.slot is None or chunk.gen != p[3] or not (chunk.live or chunk.pins):
                s.alloc.release(p[1], p[2])  # evicted, changed or dropped while we waited for room
                continue
            last = runs[-1][-1] if runs else None
            if (last is not None and last[1] == p[1] and last[2] + 1 == p[2]
                    and round_up(last[4]) == s.chunk_size):
                runs[-1].append(p)
            else:
                runs.append([p])
        # the views are taken now, before any await, and the slots stay theirs (busy) until the
        # writes return, even if the chunks are dropped meanwhile
        for run in runs:
            for p in run:
                p[0].busy = True
        try:
            await gather([(self._write_run, run, [s.arena.view(p[0].slot) for p in run]) for run in runs])
        finally:
            for run in runs:
                for p in run:
                    chunk = p[0]
                    chunk.busy = False
                    if not (chunk.live or chunk.pins) and chunk.slot is not None:
                        s.arena.free(chunk.slot)  # dropped while in flight: its slot is free now
                        chunk.slot = None

    async def _write_run(self, run: list[tuple], views: list[memoryview]) -> None:
        """Write chunks bound for consecutive units of one device with one pwritev."""
        s = self.s
        dev, first = run[0][1], run[0][2]
        t0 = trio.current_time()
        s.stats[dev].in_flight += 1
        sharing = s.stats[dev].in_flight  # I/Os sharing the device with this one, roughly
        try:
            crcs = await trio.to_thread.run_sync(_checksum_and_write, s.devices[dev], views,
                                                 [p[4] for p in run], s.sbs[dev].unit_offset(first),
                                                 limiter=s.limiters[dev])
        except DeviceError as e:
            s.stats[dev].in_flight -= 1
            s.stats[dev].errors += 1
            s.last_error = str(e)
            log.error("drain failed: %s (inode %d, %d chunk(s)); will retry", e, run[0][0].ino, len(run))
            for chunk, d, unit, _, _ in run:
                s.errors[chunk.ino] = e.errno
                s.alloc.release(d, unit)
            s._progress.unpark_all()
            await trio.sleep(0.5)
            for chunk, *_ in run:
                s._queue(chunk)
            return
        s.stats[dev].writes += 1
        s.stats[dev].in_flight -= 1
        s.stats[dev].observe(sharing * sum(round_up(p[4]) for p in run), trio.current_time() - t0)
        s.unflushed.add(dev)
        for (chunk, d, unit, gen, hwm), crc in zip(run, crcs):
            s.stats[d].bytes_written += round_up(hwm)
            if chunk.gen != gen or not (chunk.live or chunk.pins) or chunk.extent is not None:
                s.alloc.release(d, unit)  # changed or dropped while in flight: this copy is stale
                s.bytes_skipped += hwm
                if chunk.live and not chunk.drained and chunk.slot is not None and chunk.hwm >= s.chunk_size:
                    s._queue(chunk)
                continue
            chunk.extent = Extent(d, unit, hwm, crc)
            chunk.extent_gen = gen
            s.bytes_drained += hwm
            s.errors.pop(chunk.ino, None)
            if chunk.slot is not None:
                s.lru[id(chunk)] = chunk
        if s.last_error and not any(s.ready):
            s.last_error = None
        s._progress.unpark_all()
        s._journal_lot.unpark_all()

    async def fetch(self, chunks: list[Chunk]) -> None:
        """Load evicted chunks back into the arena, in parallel across devices."""
        await gather([(self._fetch_one, c) for c in chunks])

    def read_ahead(self, data, idx: int, nursery: trio.Nursery) -> None:
        """Sequential reads: keep the next READAHEAD chunks loading, in parallel across devices.

        Checked on every read but cheap: it acts only when the chunk half a window ahead is
        still on the devices, and only while the arena has room to spare.
        """
        s = self.s
        probe = data.chunks.get(idx + READAHEAD // 2)
        if probe is None or probe.slot is not None or id(probe) in s._fetching:
            return
        if s.arena.free_slots + len(s.lru) < 2 * READAHEAD:
            return
        for i in range(idx + 1, idx + 1 + READAHEAD):
            c = data.chunks.get(i)
            if c is not None and c.slot is None and c.extent is not None and id(c) not in s._fetching:
                nursery.start_soon(self._prefetch_one, c)

    async def _prefetch_one(self, chunk: Chunk) -> None:
        try:
            await self._fetch_one(chunk)
        except Exception as e:  # noqa: BLE001 - the read that needs it will retry and report
            log.debug("read-ahead of inode %d chunk %d failed: %s", chunk.ino, chunk.idx, e)

    async def _fetch_one(self, chunk: Chunk) -> None:
        key = id(chunk)
        if key in self.s._fetching:
            await self.s._fetching[key].wait()
            return
        if chunk.slot is not None or chunk.extent is None:
            return
        done = self.s._fetching[key] = trio.Event()
        try:
            while True:
                try:
                    slot = self.s.alloc_slot()
                    break
                except NoSpace:
                    if not await self.s.wait_for_room():
                        raise
            ext = chunk.extent
            view = self.s.arena.view(slot)
            length = round_up(ext.length)
            try:
                crc = await trio.to_thread.run_sync(_read_and_checksum, self.s.devices[ext.dev], view,
                                                    length, ext.length,
                                                    self.s.sbs[ext.dev].unit_offset(ext.unit),
                                                    limiter=self.s.limiters[ext.dev])
            except DeviceError:
                self.s.arena.free(slot)
                self.s.stats[ext.dev].errors += 1
                raise
            self.s.stats[ext.dev].bytes_read += length
            self.s.stats[ext.dev].reads += 1
            if crc != ext.crc:
                self.s.arena.free(slot)
                self.s.stats[ext.dev].errors += 1
                msg = (f"checksum mismatch reading inode {chunk.ino} chunk {chunk.idx} from "
                       f"{self.s.devices[ext.dev].path} unit {ext.unit}")
                log.error(msg)
                raise DeviceError(msg)
            if chunk.extent is not ext or not (chunk.live or chunk.pins) or chunk.slot is not None:
                self.s.arena.free(slot)
                return
            chunk.slot = slot
            self.s.lru[key] = chunk
        finally:
            del self.s._fetching[key]
            done.set()



def _read_and_checksum(device: BlockDevice, view: memoryview, length: int, valid: int, offset: int) -> int:
    """In a worker thread: read `length` bytes into `view`, return the crc32c of the first `valid`."""
    device.pread_into(view[:length], offset)
    return crc32c.crc32c(view[:valid])


def _checksum_and_write(device: BlockDevice, views: list[memoryview], hwms: list[int], offset: int
                        ) -> list[int]:
    """In a worker thread: zero-pad each chunk to 4 KiB, checksum its valid bytes, write them all
    with one pwritev at `offset`; returns the crcs.

    If a chunk changes meanwhile, the caller sees its generation moved and drops that copy.
    """
    bufs, crcs = [], []
    for view, hwm in zip(views, hwms):
        length = round_up(hwm)
        if length > hwm:
            view[hwm:length] = bytes(length - hwm)
        crcs.append(crc32c.crc32c(view[:hwm]))
        bufs.append(view[:length])
    device.pwritev(bufs, offset)
    return crcs
