"""Moving bytes between the arena and the devices: drain queues, workers, the gate, fetches.

`Drainer` owns the per-device ready queues and everything that decides when
chunks move. Each device has `queue_depth` worker tasks taking chunks from
its queue. A worker takes a few queued chunks at once, gives each a data unit
(consecutive units where it can), and writes each run of consecutive units
with one `pwritev`, all the batch's runs in one worker-thread job, the
checksums computed there too, so the trio thread only does bookkeeping (and
zeroes each chunk's tail up to 4 KiB before the write starts: a write may
extend the chunk in place meanwhile, from the trio thread or a FUSE worker
holding the loop lock). A chunk a worker holds is never queued again until
that drain ends (`busy`, `again`): two workers would write the same bytes.
Wake-ups that may come from such a worker (a queued chunk, the gate, the
ticker, read-ahead) go through the store's `loop.soon`; writes note
themselves with `time.monotonic()` for the gate. When the write
returns, a chunk whose generation moved on, or that was deleted meanwhile,
gets its unit back instead (that copy is stale).

The gate (absorb-first policy): while writes stream in and nothing presses
(memory half full, an fsync waiting, a commit older than max_lag: the
store's `pressing()`), the gate is closed and workers wait, so the CPU goes to
absorbing the save; worker 0 of a device not known to be fast still keeps
one batch in flight. `--drain eager` never closes it. Partial batches wait
TICK seconds for company before they go.

Fetches read evicted chunks back into arena slots, in parallel across
devices, and verify each chunk's crc32c: a mismatch is EIO and a logged
error, never wrong bytes. Read-ahead for a sequential reader loads runs of
chunks at consecutive units of one device with one task and one `preadv`
(FETCH_RUN_BYTES at most), and short runs of one device together, one task and
one worker-thread job for FETCH_RUN_BYTES of them: not a task and a thread hop
per chunk.

It talks to the store through `DrainHost` (below): slots, unit allocation,
and reports of what happened to each chunk.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import NamedTuple, Protocol

import crc32c
import trio

from ..errors import ChecksumMismatch, DeviceError, DevicesFull, FsError, NoSpace, StoreFailing
from ..format.records import Extent
from ..fs.arena import Arena
from ..fs.filemap import Chunk
from ..tasks import LoopLock, gather
from .allocator import Allocator
from .dedupe import ContentIndex, Flight, digest
from .device import BlockDevice, round_up

log = logging.getLogger("ckptfs.drain")
# The units of work are sized in bytes, not chunks: each trip to a device costs the trio thread a
# thread hop and its bookkeeping (~100-200 us of interpreter-lock time), so the larger the trip, the
# less lock time per GiB, whatever the chunk size (docs/DESIGN.md, "The lock budget")
BATCH_BYTES = 32 << 20  # one worker's write trip to a device: its runs of chunks, one pwritev each
# loaded ahead of a sequential reader, per device: the window refills at its half, so each device
# gets about four FETCH_RUN_BYTES preadvs at a time (one at a time left it idle between them)
READAHEAD_BYTES = 128 << 20
FETCH_RUN_BYTES = 16 << 20  # read ahead with one preadv at most (longer runs keep the reader waiting)
SLOW_DEVICE = 1e9  # bytes/s under which a device keeps draining while saves stream in
TICK = 0.01  # seconds a partial batch of chunks may wait for more before it drains
HOLD_IDLE = 0.02  # absorb-first: writes paused this long (seconds) lets the drain go
HOLD_POLL = 0.005  # the gatekeeper looks again at least this long after a look


class Placement(NamedTuple):
    """A chunk of a drain batch and the device space it was given, for its bytes as they were then
    (generation `gen`, `hwm` valid bytes)."""
    chunk: Chunk
    dev: int
    unit: int
    gen: int
    hwm: int


class DrainHost(Protocol):
    """What the drain needs from the store."""
    arena: Arena
    alloc: Allocator
    devices: list[BlockDevice]
    sbs: list
    limiters: list[trio.CapacityLimiter]
    stats: list  # DeviceStats per device
    chunk_size: int
    dedupe: ContentIndex | None  # --dedupe on: the extents whose bytes a chunk may share (dedupe.py)

    def pressing(self) -> bool: ...  # something needs the drain now (memory, a waiter, max_lag)
    def alloc_slot(self) -> int: ...
    async def wait_for_room(self, devices_full: bool = False) -> bool: ...
    def drained(self, chunk: Chunk, extent: Extent) -> None: ...  # a chunk's copy is on a device
    def wrote(self, dev: int) -> None: ...  # data written to dev, not yet flushed
    def cached(self, chunk: Chunk) -> None: ...  # a fetched chunk holds a slot again
    def hold(self, chunk: Chunk, held: list) -> None: ...  # keep a fetched chunk from eviction (fetch)
    def evictable(self) -> int: ...  # slots held by chunks already on a device
    async def retry_later(self, error: FsError, inos=(), what: str = "") -> None: ...
    def wake(self) -> None: ...  # progress: waiters may look again
    def space_lost(self) -> None: ...  # chunks given device space need it again (their write failed)
    loop: LoopLock  # wake-ups from other threads go through loop.soon


class Drainer:
    """Moves chunks between the arena and the devices: it owns the per-device ready queues, the
    batches workers hold (`flying`), the fetches in progress and the gate."""

    def __init__(self, host: DrainHost, *, queue_depth: int, policy: str = "absorb-first"):
        self.host = host
        self.queue_depth = queue_depth
        self.policy = policy  # "absorb-first" or "eager"
        n = len(host.devices)
        self.ready: list[OrderedDict[int, Chunk]] = [OrderedDict() for _ in range(n)]
        self.flying: dict[int, list[Chunk]] = {}  # id -> a batch taken by a worker (its chunks are busy)
        self.fetching: dict[int, trio.Event] = {}  # id(chunk) -> set when its fetch ends
        self.ahead: dict[int, tuple] = {}  # id(file data) -> (its data, the furthest chunk read) (read_ahead)
        self.gate = trio.Event()  # workers pass only while it is set (see gatekeeper)
        self.gate.set()
        self.last_write = -1.0  # time.monotonic() of the last write into the arena (any thread writes it)
        self.work = [trio.lowlevel.ParkingLot() for _ in range(n)]
        self.tick = trio.Event()  # set when a partial batch waits for the ticker
        self.writes_started = trio.Event()
        self.nursery: trio.Nursery | None = None
        cs, slots = host.chunk_size, host.arena.nslots
        self.batch = max(1, BATCH_BYTES // cs)  # chunks a worker takes per trip
        # chunks kept loading ahead of a reader (a quarter of the arena at most), and per preadv
        self.readahead = max(2, min(n * READAHEAD_BYTES // cs, slots // 4))
        self.fetch_run = max(1, min(FETCH_RUN_BYTES // cs, self.readahead // 4))

    # ---- queues ----------------------------------------------------------------
    def queue(self, chunk: Chunk) -> None:
        """Queue a chunk for its device (nothing if it is queued, drained or not in memory). A chunk
        a worker holds (busy) is queued when that drain ends, and only if it left the chunk
        undrained: queued now, a second worker would write the same bytes again."""
        if not chunk.enqueue():
            return
        dev = self.host.alloc.preferred(chunk.ino, chunk.idx)
        queue = self.ready[dev]
        queue[id(chunk)] = chunk
        # wake a worker for a full batch (large I/Os, few thread hand-offs) or when someone
        # waits for this chunk; the ticker picks up partial batches a moment later. Only a
        # parked worker needs it: one busy or held at the gate looks at the queue when it comes
        # back (while a save streams in, a wake-up per chunk cost the trio thread more than the chunk)
        if len(queue) >= self.batch or chunk.pins or not self.host.arena.free_slots:
            self.host.loop.unpark(self.work[dev], every=False)
        elif not self.tick.is_set():
            self.host.loop.soon(self._set_tick)

    def _set_tick(self) -> None:
        self.tick.set()

    def unqueue(self, chunk: Chunk) -> bool:
        """Take a queued chunk back (its bytes went stale); True if it was queued."""
        if not chunk.dequeue():
            return False
        self.ready[self.host.alloc.preferred(chunk.ino, chunk.idx)].pop(id(chunk), None)
        return True

    @property
    def in_flight(self) -> int:
        """Chunks taken by the workers."""
        return sum(map(len, self.flying.values()))

    def queued(self) -> int:
        return sum(map(len, self.ready))

    def undrained(self):
        """The chunks that will need device space: queued, or taken by a worker and not being
        written as they are now into space it gave them (waiting for room, failed, or changed
        since: a stale copy's space is given back when its write ends)."""
        for q in self.ready:
            yield from q.values()
        for batch in self.flying.values():
            for c in batch:
                if c.needs_space:
                    yield c

    def queued_bytes(self) -> int:
        return sum(c.hwm for q in self.ready for c in q.values())

    def note_write(self) -> None:
        """The arena was written: under absorb-first the gatekeeper may close the gate (woken once
        per burst of writes, not per write)."""
        self.last_write = time.monotonic()
        if self.gate.is_set() and self.policy == "absorb-first" and not self.writes_started.is_set():
            self.host.loop.soon(self._writes_started)

    def _writes_started(self) -> None:
        self.writes_started.set()

    def open_gate(self) -> None:
        self.host.loop.soon(self._open_gate)

    def _open_gate(self) -> None:
        self.gate.set()

    def slow(self, dev: int) -> bool:
        """A device not known to be fast: worth keeping busy even while the drain is held."""
        bw = self.host.stats[dev].bandwidth
        return bw is None or bw < SLOW_DEVICE

    # ---- tasks -------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            for d in range(len(self.host.devices)):
                for k in range(self.queue_depth):
                    nursery.start_soon(self.worker, d, k)
            nursery.start_soon(self._ticker)
            nursery.start_soon(self._gatekeeper)
            task_status.started()

    def _hold_back(self) -> bool:
        """Absorb first: hold the drain while writes stream in and nothing presses."""
        return (self.policy == "absorb-first"
                and time.monotonic() - self.last_write < HOLD_IDLE
                and not self.host.pressing())

    async def _gatekeeper(self) -> None:
        """Opens the gate when writes pause or something presses; closes it while saves stream in."""
        while True:
            if self._hold_back():
                if self.gate.is_set():
                    self.gate = trio.Event()
                # look again once the writes could have paused for HOLD_IDLE (at least HOLD_POLL
                # from now), not every HOLD_POLL: each wake-up of a sleeping trio task costs a
                # cancellation; memory filling meanwhile is seen HOLD_IDLE late at most
                await trio.sleep(max(HOLD_POLL, self.last_write + HOLD_IDLE - time.monotonic()))
            else:
                self.gate.set()
                await self.writes_started.wait()
                self.writes_started = trio.Event()

    async def _ticker(self) -> None:
        """Start partial batches that waited TICK seconds for company."""
        while True:
            await self.tick.wait()
            await trio.sleep(TICK)
            self.tick = trio.Event()
            for d, queue in enumerate(self.ready):
                if queue:
                    self.work[d].unpark()

    async def worker(self, dev: int, k: int = 0) -> None:
        queue = self.ready[dev]
        while True:
            while not queue:
                await self.work[dev].park()
            # while the drain is held back (absorb-first), worker 0 of a slow device still keeps
            # one batch in flight: a slow device idle during the save would cost time-to-durable,
            # while a fast one catches up quickly afterwards and costs CPU the save needs now
            if not self.gate.is_set() and not (k == 0 and self.slow(dev)):
                await self.gate.wait()
                continue
            batch = []
            while queue and len(batch) < self.batch:
                _, chunk = queue.popitem(last=False)
                if chunk.take():  # (its slot stays ours until the batch ends, even if it is dropped)
                    batch.append(chunk)
            if not batch:
                continue
            self.flying[id(batch)] = batch
            try:
                await self._drain_batch(dev, batch)
            except Exception as e:  # noqa: BLE001 - a bug must not stop the drain
                log.exception("unexpected error draining %d chunk(s) of inode %d", len(batch), batch[0].ino)
                for c in batch:
                    c.write_lost()
                self.host.space_lost()
                await self.host.retry_later(StoreFailing(f"internal error: {e}"))
                for c in batch:
                    self.queue(c)
            finally:
                del self.flying[id(batch)]
                self._release(batch)

    def _release(self, batch: list[Chunk]) -> None:
        """A worker is done with its batch: free the slots of chunks dropped meanwhile, and queue
        those queued while it held them (written again, failed, or waiting for room)."""
        for chunk in batch:
            again = chunk.release()
            if not (chunk.wanted or chunk.readers) and chunk.slot is not None:
                self.host.arena.free(chunk.slot)  # dropped while in flight: its slot is free now
                chunk.slot = None
            if again:
                self.queue(chunk)

    async def _drain_batch(self, pref: int, batch: list[Chunk]) -> None:
        h = self.host
        placed: list[Placement] = []
        for i, chunk in enumerate(batch):
            try:
                dev, unit = h.alloc.alloc(pref, chunk.hwm)
            except NoSpace:
                await h.retry_later(DevicesFull(f"no room on any device for {len(batch) - i} chunk(s)"),
                                    [c.ino for c in batch[i:]])
                for c in batch[i:]:
                    self.queue(c)
                break
            placed.append(Placement(chunk, dev, unit, chunk.gen, chunk.hwm))
        runs: list[list[Placement]] = []  # each: consecutive units of one device, whole chunks but the last
        for p in placed:
            chunk = p.chunk
            if chunk.slot is None or chunk.gen != p.gen or not chunk.wanted:
                h.alloc.release(p.dev, p.unit)  # evicted, changed or dropped while we waited for room
                continue
            last = runs[-1][-1] if runs else None
            if (last is not None and last.dev == p.dev and last.unit + h.alloc.per_unit == p.unit
                    and round_up(last.hwm) == h.chunk_size):
                runs[-1].append(p)
            else:
                runs.append([p])
            chunk.start_write()  # (the undrained count leaves it out while that is its generation)
        # the views are taken now, before any await (the slots stay the batch's until it ends,
        # see worker). Each chunk's tail up to the next 4 KiB is zeroed here too, not in the
        # device thread: a write may extend the chunk in place while its drain runs (the copy is
        # then stale, but the new bytes must stay)
        for run in runs:
            for p in run:
                _zero_tail(h.arena.view(p.chunk.slot), p.hwm)
        by_dev: dict[int, list] = {}  # (almost always one device: the batch's preferred one)
        for run in runs:
            by_dev.setdefault(run[0].dev, []).append((run, [h.arena.view(p.chunk.slot) for p in run]))
        if len(by_dev) == 1:
            await self._write_runs(*next(iter(by_dev.items())))
        elif by_dev:
            await gather([(self._write_runs, dev, jobs) for dev, jobs in by_dev.items()])

    async def _write_runs(self, dev: int, jobs: list[tuple[list[Placement], list[memoryview]]]) -> None:
        """Write runs of chunks bound for consecutive units of device `dev`, one pwritev each, all
        in one worker-thread job (a task and a thread hop per run cost the trio thread more than
        the device's queue depth gains: the device's other workers keep it busy)."""
        h = self.host
        stats = h.stats[dev]
        sharing = stats.write_started()  # I/Os sharing the device with these, roughly
        led: list = []  # (digest, Flight) of every chunk this job writes while dedupe looks on
        try:
            try:
                results = await trio.to_thread.run_sync(
                    _checksum_and_write_runs, h.devices[dev],
                    [(views, [p.hwm for p in run], h.sbs[dev].unit_offset(run[0].unit)) for run, views in jobs],
                    h.chunk_size, h.dedupe, led, limiter=h.limiters[dev])
            finally:
                stats.write_ended()
            await self._written(dev, jobs, results, led, sharing)
        finally:
            if led:  # nothing waits for a write that did not happen
                h.dedupe.land_rest(led)

    async def _written(self, dev: int, jobs: list, results: list, led: list, sharing: int) -> None:
        """Account for the runs `_write_runs` wrote: each chunk drained into its extent, or into
        the extent it shares; failed runs retried later."""
        h = self.host
        stats = h.stats[dev]
        failed: list[tuple] = []
        lost: list[Chunk] = []
        waiting: list[tuple] = []  # chunks identical to one in flight: they share its extent
        for (run, _), result in zip(jobs, results):
            if isinstance(result, DeviceError):
                stats.failed()
                for p in run:
                    h.alloc.release(p.dev, p.unit)
                    p.chunk.write_lost()  # it needs device space again
                failed.append((run, result))
                continue
            crcs, digests, found, flights, seconds = result
            stats.wrote(sum(round_up(p.hwm) for p, hit in zip(run, found) if hit is None), seconds, sharing)
            for i, p in enumerate(run):
                chunk = p.chunk
                if chunk.gen != p.gen or not chunk.wanted or chunk.extent is not None:
                    h.alloc.release(p.dev, p.unit)  # changed or dropped while in flight: this copy is stale
                    continue  # (a change queued it again if it is to drain: see queue)
                hit = found[i]
                if hit is not None:
                    h.alloc.release(p.dev, p.unit)
                    if isinstance(hit, Flight):
                        waiting.append((p, hit, digests[i], crcs[i]))
                    elif h.dedupe.adopt(hit, digests[i], p.hwm, crcs[i]):
                        h.drained(chunk, hit)  # the bytes are there already: share them
                        if flights[i] is not None:
                            h.dedupe.land(digests[i], flights[i], hit)
                    else:
                        chunk.write_lost()  # that extent went meanwhile: write this chunk after all
                        lost.append(chunk)
                    continue
                ext = Extent(p.dev, p.unit, p.hwm, crcs[i])
                if digests:
                    h.dedupe.add(digests[i], ext)
                    if flights[i] is not None:
                        h.dedupe.land(digests[i], flights[i], ext)
                h.drained(chunk, ext)
        if led:  # every flight of this job lands before any wait (or two jobs could wait for each other)
            h.dedupe.land_rest(led)
        for p, flight, d, crc in waiting:
            if not flight.done:
                if flight.event is None:
                    flight.event = trio.Event()
                await flight.event.wait()
            chunk = p.chunk
            if chunk.gen != p.gen or not chunk.wanted or chunk.extent is not None:
                continue
            if flight.extent is not None and h.dedupe.adopt(flight.extent, d, p.hwm, crc):
                h.drained(chunk, flight.extent)
            else:
                chunk.write_lost()  # the write it waited for came to nothing: write it after all
                lost.append(chunk)
        for chunk in lost:
            self.queue(chunk)
        if len(failed) < len(jobs):
            h.wrote(dev)
            h.wake()
        if failed:
            chunks = [p.chunk for run, _ in failed for p in run]
            h.space_lost()
            await h.retry_later(failed[0][1], [c.ino for c in chunks],
                                f"drain of inode {chunks[0].ino} ({len(chunks)} chunk(s)) failed")
            for chunk in chunks:
                self.queue(chunk)

    # ---- fetches -------------------------------------------------------------------
    async def fetch(self, chunks: list[Chunk], held: list | None = None) -> None:
        """Load evicted chunks back into the arena, in parallel across devices; with `held`, each
        is held there as soon as it is loaded (`host.hold`), before the next can evict it."""
        if held is None:
            await gather([(self._fetch_one, c) for c in chunks])
        else:
            await gather([(self._fetch_held, c, held) for c in chunks])

    async def _fetch_held(self, chunk: Chunk, held: list) -> None:
        await self._fetch_one(chunk)
        self.host.hold(chunk, held)  # no checkpoint since it was placed: nothing evicted it meanwhile

    def read_ahead(self, data, idx: int) -> None:
        """Sequential reads: keep the next `readahead` chunks loading, in parallel across devices.

        Checked on every read but cheap: it acts only when the chunk half a window ahead is
        still on the devices, and only while the arena has room to spare. The trio thread starts
        the loads; the reads until it runs (in every FUSE worker) ask once, for the furthest
        window they reached.
        """
        if self.nursery is None:
            return
        probe = data.chunks.get(idx + self.readahead // 2)
        if probe is None or probe.slot is not None or id(probe) in self.fetching:
            return
        if self.host.arena.free_slots + self.host.evictable() < 2 * self.readahead:
            return
        asked = self.ahead.get(id(data))
        if asked is None or asked[1] < idx:
            self.ahead[id(data)] = (data, idx)
        self.host.loop.soon(self._read_ahead_asked)  # (queued once until it runs)

    def _read_ahead_asked(self) -> None:
        asked, self.ahead = self.ahead, {}
        for data, idx in asked.values():
            self._prefetch([c for c in map(data.chunks.get, range(idx + 1, idx + 1 + self.readahead))
                            if c is not None])

    def _prefetch(self, chunks: list[Chunk]) -> None:
        """Start loading those of `chunks` that are `_missing`: one task and one `preadv` per run
        of consecutive units on a device (the drain wrote them in such runs), `fetch_run` chunks
        at most, not a task and a thread hop per chunk. Short runs (a file sharing chunks with others, --dedupe) are
        gathered per device, `fetch_run` chunks to a task and one worker-thread job (a `preadv`
        per run inside); a long run keeps a task of its own, so runs still load in parallel."""
        todo = sorted((c.extent.dev, c.extent.unit, c.idx, c) for c in chunks if self._missing(c))
        runs: list[list[Chunk]] = []
        for _, _, _, c in todo:
            if not runs or not self._follows(runs[-1][-1].extent, c.extent) or len(runs[-1]) >= self.fetch_run:
                runs.append([])
            runs[-1].append(c)
        short: dict[int, list[Chunk]] = {}
        for run in runs:
            if 2 * len(run) >= self.fetch_run:
                self._start_prefetch(run)
                continue
            batch = short.setdefault(run[0].extent.dev, [])
            batch += run
            if len(batch) >= self.fetch_run:
                self._start_prefetch(short.pop(run[0].extent.dev))
        for batch in short.values():
            self._start_prefetch(batch)

    def _follows(self, prev: Extent, ext: Extent) -> bool:
        """Does `ext` start where the whole chunk at `prev` ends, on the same device (one read)?"""
        return (ext.dev == prev.dev and ext.unit == prev.unit + self.host.alloc.per_unit
                and round_up(prev.length) == self.host.chunk_size)

    def _start_prefetch(self, batch: list[Chunk]) -> None:
        """A task to load `batch`, its chunks counted as fetching from now on, not from when the
        task starts: reads meanwhile neither ask for them again nor fetch them twice."""
        events = [trio.Event() for _ in batch]
        for c, done in zip(batch, events):
            self.fetching[id(c)] = done
        self.nursery.start_soon(self._prefetch_batch, batch, events)

    async def _prefetch_batch(self, batch: list[Chunk], events: list[trio.Event]) -> None:
        try:
            await self._fetch_batch(batch)
        except Exception as e:  # noqa: BLE001 - the read that needs it will retry and report
            log.debug("read-ahead of inode %d chunks %s failed: %s", batch[0].ino, [c.idx for c in batch], e)
        finally:
            for c, done in zip(batch, events):
                del self.fetching[id(c)]
                done.set()

    async def _fetch_batch(self, batch: list[Chunk]) -> None:
        """Load chunks of one device (marked fetching by the caller), in unit order, with one
        worker-thread job: one read per run of consecutive units (read-ahead only: a chunk that
        changed meanwhile is dropped, and it takes only slots free now, never waits)."""
        h = self.host
        batch = [c for c in batch if self._evicted(c)]  # (still: a write may have come)
        slots = []
        try:
            for _ in batch:
                slots.append(h.alloc_slot())
        except NoSpace:
            pass
        batch = batch[:len(slots)]
        if not batch:
            return
        exts = [c.extent for c in batch]
        dev = exts[0].dev
        if any(e.dev != dev for e in exts):
            for slot in slots:
                h.arena.free(slot)
            return
        views = [h.arena.view(slot)[:round_up(e.length)] for slot, e in zip(slots, exts)]
        runs: list[tuple[list, list, int]] = []
        for i, (e, v) in enumerate(zip(exts, views)):
            if not i or not self._follows(exts[i - 1], e):
                runs.append(([], [], h.sbs[dev].unit_offset(e.unit)))
            runs[-1][0].append(v)
            runs[-1][1].append(e.length)
        try:
            crcs = await trio.to_thread.run_sync(_read_runs_and_checksum, h.devices[dev], runs,
                                                 limiter=h.limiters[dev])
        except DeviceError:
            h.stats[dev].failed()
            for slot in slots:
                h.arena.free(slot)
            raise
        h.stats[dev].read(sum(len(v) for v in views))
        for c, e, slot, crc in zip(batch, exts, slots, crcs):
            if not self._place(c, e, slot, crc):
                log.debug("read-ahead: checksum mismatch in inode %d chunk %d (the read that needs "
                          "it fetches it again and reports)", c.ino, c.idx)

    async def _fetch_one(self, chunk: Chunk) -> None:
        key = id(chunk)
        if key in self.fetching:
            await self.fetching[key].wait()
            return
        if not self._evicted(chunk):
            return
        h = self.host
        done = self.fetching[key] = trio.Event()
        try:
            while True:
                try:
                    slot = h.alloc_slot()
                    break
                except NoSpace:
                    if not await h.wait_for_room():
                        raise
            ext = chunk.extent
            view = h.arena.view(slot)
            length = round_up(ext.length)
            try:
                [crc] = await trio.to_thread.run_sync(_read_run_and_checksum, h.devices[ext.dev], [view[:length]],
                                                      [ext.length], h.sbs[ext.dev].unit_offset(ext.unit),
                                                      limiter=h.limiters[ext.dev])
            except DeviceError:
                h.arena.free(slot)
                h.stats[ext.dev].failed()
                raise
            h.stats[ext.dev].read(length)
            if not self._place(chunk, ext, slot, crc):
                msg = (f"checksum mismatch reading inode {chunk.ino} chunk {chunk.idx} from "
                       f"{h.devices[ext.dev].path} unit {ext.unit}")
                log.error(msg)
                raise ChecksumMismatch(msg)
        finally:
            del self.fetching[key]
            done.set()

    @staticmethod
    def _evicted(chunk: Chunk) -> bool:
        """On a device only: not in memory."""
        return chunk.slot is None and chunk.extent is not None

    def _missing(self, chunk: Chunk) -> bool:
        """On a device only, and no fetch of it under way."""
        return self._evicted(chunk) and id(chunk) not in self.fetching

    def _place(self, chunk: Chunk, ext: Extent, slot: int, crc: int) -> bool:
        """A copy of `chunk` read from `ext` into `slot`: it becomes the chunk's memory if it still is
        the chunk's data, else the slot is freed. False (slot freed, a device error counted) when
        its checksum is wrong."""
        h = self.host
        if crc != ext.crc:
            h.arena.free(slot)
            h.stats[ext.dev].failed()
            return False
        if chunk.extent is not ext or not chunk.wanted or chunk.slot is not None:
            h.arena.free(slot)
        else:
            chunk.slot = slot
            h.cached(chunk)
        return True


def _read_run_and_checksum(device: BlockDevice, views: list[memoryview], valid: list[int], offset: int
                           ) -> list[int]:
    """In a worker thread: fill `views` back to back from `offset` (one preadv), return the crc32c
    of each one's first `valid` bytes."""
    device.preadv_into(views, offset)
    return [crc32c.crc32c(v[:n]) for v, n in zip(views, valid)]


def _read_runs_and_checksum(device: BlockDevice, runs: list[tuple[list[memoryview], list[int], int]]) -> list[int]:
    """`_read_run_and_checksum` of each (views, valid lengths, offset) run; the crcs end to end."""
    out: list[int] = []
    for views, valid, offset in runs:
        out += _read_run_and_checksum(device, views, valid, offset)
    return out


def _zero_tail(view: memoryview, hwm: int) -> None:
    """Zero a chunk's bytes from `hwm` to the next 4 KiB (they go to the device with it)."""
    length = round_up(hwm)
    if length > hwm:
        view[hwm:length] = bytes(length - hwm)


def _checksum_and_write_runs(device: BlockDevice, runs: list[tuple[list[memoryview], list[int], int]],
                             chunk_size: int, index: ContentIndex | None = None, led: list | None = None) -> list:
    """In a worker thread: for each run (views, valid lengths, device offset), checksum each
    chunk's valid bytes and write them (zero-padded to 4 KiB already) with one pwritev at the
    offset. With an `index` (--dedupe on), each chunk's digest too; a chunk the index may hold
    already, or identical to one in flight (`take_off`), is left out of the writes (the run's
    other chunks keep their offsets), and each chunk written leads a flight, added to `led` as it
    is made. Per run: (crcs, digests, per chunk the extent or flight found or None, per chunk the
    flight it leads or None, seconds the writes took), or the DeviceError one raised (the other
    runs are still written).

    If a chunk changes meanwhile, the caller sees its generation moved and drops that copy.
    """
    out: list = []
    for views, hwms, offset in runs:
        crcs, digests, found, flights, segments = [], [], [], [], []
        current: list | None = None
        for i, (view, hwm) in enumerate(zip(views, hwms)):
            crcs.append(crc32c.crc32c(view[:hwm]))
            hit = flight = None
            if index is not None:
                d = digest(view[:hwm])
                digests.append(d)
                hit = index.find(d, hwm)
                if hit is None:
                    flight, mine = index.take_off(d, hwm)
                    if not mine:
                        hit, flight = flight, None
                    elif flight is not None:
                        led.append((d, flight))
                        # (an identical chunk's flight may have landed between find and take_off)
                        hit = index.find(d, hwm)
            found.append(hit)
            flights.append(flight)
            if hit is not None:
                current = None
                continue
            if current is None:
                current = []
                segments.append((offset + i * chunk_size, current))
            current.append(view[:round_up(hwm)])
        t0 = time.monotonic()
        try:
            for at, bufs in segments:
                device.pwritev(bufs, at)
        except DeviceError as e:
            out.append(e)
            continue
        out.append((crcs, digests, found, flights, time.monotonic() - t0))
    return out
