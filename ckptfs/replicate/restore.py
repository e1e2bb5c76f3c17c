"""Restore on a replacement node: the newest manifest's tree at once, contents on demand and in the background.

`ckptfs mount /ckpt --devices ... --format --restore-from s3://BUCKET/PREFIX`
formats a fresh pool with the manifest's chunk size, and before the mount
goes live tree.py `build()` creates the manifest's whole tree through the core
(directories, files at their final sizes, symlinks, hard links, modes,
owners, times, xattrs); every step is an ordinary journal record. Each file
with contents gets a gate (`FileJob`, an fs/remote.py `Remote`) on its
`FileData`: the core's read path raises `NeedsRestore` for any chunk not
fetched yet, never the zeros of a hole, and the facade awaits `demand()`.

Fetching. A chunk is fetched with a ranged GET of its bytes in the object
that holds them (a segment of the file, or with a format 1 manifest the
whole file: `Manifest.pieces`; consecutive chunks of one object share one
GET, at most RUN_BYTES), in a worker
thread that also checks each chunk's CRC-32C against the manifest: a mismatch
is an error naming the object, the chunk and the file, never served, and
fails that chunk alone (the others of the same GET are delivered). The
bytes then go into the file with `FileData.fill` (the write path, past the
gate), so they drain to the devices and become durable like any write. A
segment several files hold (a copy, a checkpoint that repeats another) is
fetched once: the bytes of a GET also go to every other file that names
that segment and misses those chunks (`users`), which do not fetch them.
Demand fetches (a read that waits) have their own slots (`DEMAND_SLOTS`), so
they never queue behind the background, and start a read-ahead of the next
READAHEAD chunks. The background fetches every file, newest first, with
`concurrency` GETs in flight (twice as many of 4 MiB segments: the same
bytes; memory in flight at most (concurrency + DEMAND_SLOTS) x RUN_BYTES,
plus the arena, whose backpressure it waits on like any writer) and an
optional byte rate. Failed fetches are
retried with backoff; their causes show in `statistics()` (ckptfs status,
the control API, metrics) and in the log. Every object-store call goes
through client.py's `Target` (one line per failure, with its cause); tree.py's
`load_manifest` turns what it raises into `SourceError` for the CLI and the
daemon.

Crash safety. Two hidden journaled xattrs (plan.py) say what is still
remote: the root's ``ckptfs.restore.source`` (URL, endpoint, generation,
whether the tree is complete) and each unfinished file's
``ckptfs.restore.object``. A file's progress is committed every
COMMIT_BYTES or COMMIT_SECONDS as an ordinary content record; when it is complete its content
is committed and only then (the journal's prefix rule) its marker removed.
After a crash the remount finds the markers, reloads the same manifest and
counts a chunk done only if its durable extent has the manifest's length and
CRC-32C; everything else is fetched again, and until then the gate holds
reads. A crash while the tree was being built (root marker not complete)
restarts the restore on a freshly formatted pool (daemon.py): by the prefix
rule nothing else can have been committed yet.

Writes and size changes to a file still being restored wait for the whole
file (POSIX semantics); a truncate to zero (O_TRUNC) cancels its restore:
its new contents are committed, then its marker removed.
"""
from __future__ import annotations

import logging
import stat
import time
from collections import deque
from dataclasses import dataclass

import crc32c
import trio

from ..errors import DevicesFull, FsError, NoSpace
from ..fs.filemap import NeedsFetch
from ..fs.namespace import ROOT_INO
from ..fs.remote import NeedsRestore, Remote
from . import plan, tree
from .client import S3Error, Target
from .manifest import Entry, Manifest, parse_url
from .throttle import Throttle

log = logging.getLogger("ckptfs.restore")
RUN_BYTES = 8 << 20  # one GET fetches at most this many bytes of consecutive chunks
READAHEAD_BYTES = 16 << 20  # fetched ahead of a reader that waited
DEMAND_SLOTS = 4  # GETs in flight for reads that wait, beside the background's
MAX_WIDEN = 2  # background GETs in flight per `concurrency`, for segments of half a run or less
COMMIT_BYTES = 64 << 20  # a file's restored progress is committed at least every this many bytes
COMMIT_SECONDS = 1.0  # ... and every this many seconds while it grows (bounds the journal's share)
RETRY_MIN, RETRY_MAX = 0.5, 30.0  # seconds between retries of failed background fetches
ERRORS_KEPT = 10
LOADING, FETCHING, SYNCING, DONE = "loading", "fetching", "syncing", "done"


class RestoreError(FsError):
    """A chunk could not be restored; the message says why (EIO to a read that needed it)."""


class FileJob(Remote):
    """The gate of one file being restored, and its fetch bookkeeping."""

    def __init__(self, restorer: "Restorer", inode, obj: str, size: int, chunk_size: int, missing):
        super().__init__(inode.ino, size, chunk_size, missing)
        self.restorer = restorer
        self.inode = inode
        self.object = obj
        self.entry: Entry | None = None  # set once the manifest is loaded
        self.inflight: dict[int, trio.Event] = {}
        self.failed: dict[int, str] = {}  # chunk -> why its last fetch failed
        self.uncommitted = 0  # bytes filled since the last progress commit
        self.committed_at = 0.0  # trio time of the last progress commit
        self.active = True  # False once complete or cancelled
        self.span = 0  # chunks per object of its manifest entry (0: one object holds the file)

    @property
    def gone(self) -> bool:
        """Its inode was dropped (unlinked and closed): nothing to restore it into."""
        return self.inode.data is None

    def read_ahead(self, idx: int) -> None:
        self.restorer.read_ahead(self, idx)

    def cancelled(self) -> None:
        self.restorer.cancel(self)


def _get_range(target: Target, obj: str, start: int, end: int, crcs: list[int], first: int,
               chunk_size: int, what: str) -> tuple[bytes, dict[int, str]]:
    """In a worker thread: bytes [start, end) of the object, each chunk checked against its CRC-32C.
    Returns the bytes and, for each chunk whose CRC does not match, why: a corrupt chunk fails
    alone, its neighbours in the same GET are still good (a reader of those must not get EIO)."""
    try:
        data = target.get(obj, start, end)
    except S3Error as e:
        raise RestoreError(f"fetch of {what} failed: {e}") from None
    bucket, key = target.bucket, target.key(obj)
    if len(data) != end - start:
        raise RestoreError(f"short read of s3://{bucket}/{key} bytes {start}-{end - 1} ({what}): "
                           f"got {len(data)} bytes, wanted {end - start}")
    view = memoryview(data)
    bad: dict[int, str] = {}
    for k, off in enumerate(range(0, len(data), chunk_size)):
        got = crc32c.crc32c(view[off:off + chunk_size])
        if got != crcs[first + k]:
            bad[first + k] = (f"checksum mismatch restoring {what} chunk {first + k} from s3://{bucket}/{key} "
                              f"bytes {start + off}-{min(end, start + off + chunk_size) - 1}: "
                              f"manifest crc32c {crcs[first + k]:08x}, object {got:08x}")
    return data, bad


class Restorer:
    """The restore service of one mount: the gates of the files still remote (`jobs`), their
    fetches (demand and background), progress commits, and the counters `statistics()` shows."""

    def __init__(self, fs, store, source: plan.Source, *, concurrency: int = 8, rate: float | None = None,
                 target: Target | None = None):
        self.fs = fs
        self.store = store
        self.source = source
        self.url = parse_url(source.url)
        self.target = target
        self.concurrency = concurrency
        self.rate = Throttle(rate)
        self.bg_limiter = trio.CapacityLimiter(concurrency)
        self.demand_limiter = trio.CapacityLimiter(DEMAND_SLOTS)
        self.manifest: Manifest | None = None
        self.loaded = trio.Event()  # the manifest is known
        self.load_tried = trio.Event()  # the first attempt to load it is over (it may have failed)
        self.load_error: str | None = None
        self.jobs: dict[int, FileJob] = {}
        self.users: dict[str, list[tuple[FileJob, int]]] = {}  # segment key -> (job, its first chunk) naming it
        self.nursery: trio.Nursery | None = None
        self.running = trio.Event()  # run() has its nursery: fetches can start
        self.state = LOADING
        self.files_total = self.bytes_total = 0
        self.files_done = self.bytes_done = 0
        self.bytes_fetched = 0  # GET bytes, retries included
        self.demand_fetches = 0
        self.errors_total = 0
        self.errors: deque[str] = deque(maxlen=ERRORS_KEPT)
        self.started = time.time()
        self.finished: float | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.pending: Manifest | None = None  # a fresh restore's manifest, built by prepare()
        self.known_source = True  # False: files are marked but the source is not recorded

    # ---- setup (before serving, no awaits) ------------------------------------
    def _target(self) -> Target:
        if self.target is None:
            self.target = Target(self.url, self.source.endpoint,
                                 connections=self.concurrency * MAX_WIDEN + DEMAND_SLOTS + 2)
        return self.target

    def use_manifest(self, manifest: Manifest) -> None:
        """The manifest is known: find each file's entry and what is already on the devices."""
        by_object = {e.object: e for e in manifest.entries if stat.S_ISREG(e.mode) and e.object}
        cs = manifest.chunk_size
        if cs != self.store.chunk_size:
            raise tree.SourceError(f"the manifest's chunk size {cs} differs from the pool's {self.store.chunk_size}")
        if manifest.segment_size:  # GETs of a segment at most: more of them, the same bytes in flight
            widen = max(1, min(MAX_WIDEN, RUN_BYTES // manifest.segment_size))
            self.bg_limiter.total_tokens = self.concurrency * widen
        for job in list(self.jobs.values()):
            entry = by_object.get(job.object)
            if entry is None or entry.size != job.size:
                self.record_error(f"{self.source.url} generation {self.source.generation} has no object "
                                  f"{job.object} of {job.size} bytes for inode {job.ino}")
                continue
            job.entry = entry
            if manifest.segment_size:
                job.span = manifest.segment_size // cs
                for k, off, _ in manifest.pieces(entry):
                    self.users.setdefault(k, []).append((job, off // cs))
            data = job.inode.data
            extents = {i: c.extent for i, c in data.chunks.items() if c.extent is not None and c.drained}
            job.missing = set(plan.missing_chunks(entry.size, cs, entry.crcs, extents))
            for i in job.missing:
                chunk = data.drop(i)  # a stale or partial copy: fetched again
                if chunk is not None:
                    data.owner.chunk_dropped(chunk)
            if not job.missing:
                self._complete(job)  # all on the devices already: only its marker was left
        files = {}
        for e in manifest.entries:
            if stat.S_ISREG(e.mode):
                files.setdefault(e.ino or id(e), e.size)
        self.files_total, self.bytes_total = len(files), sum(files.values())
        self.files_done = self.files_total - len(self.jobs)
        self.bytes_done = self.bytes_total - sum(j.chunk_length(i) for j in self.jobs.values() for i in j.missing)
        self.manifest = manifest
        self.state = FETCHING
        self.loaded.set()
        self.load_tried.set()

    def add_job(self, inode, obj: str, size: int) -> FileJob:
        cs = self.store.chunk_size
        job = FileJob(self, inode, obj, size, cs, range(-(-size // cs)))
        inode.data.remote = job
        self.jobs[inode.ino] = job
        return job

    def prepare(self) -> None:
        """In the trio thread, before the mount is live: build a fresh restore's tree."""
        if self.pending is not None:
            manifest, self.pending = self.pending, None
            tree.build(self, manifest)

    # ---- the service --------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            self.running.set()
            task_status.started()
            if not self.known_source:
                self.load_tried.set()
                await trio.sleep_forever()  # reads of its files fail with the reason
            if self.manifest is None:
                await self._load()
            await self._background()
            await self._finish()
            if self.jobs:
                await trio.sleep_forever()  # unlinked files still open, or failures: reads still come here

    def stop(self) -> None:
        """Stop fetching (unmount): the markers stay, so the next mount goes on."""
        if self.nursery is not None:
            self.nursery.cancel_scope.cancel()

    def _soon(self, fn, *args) -> None:
        """Start a task from the trio thread or from a front end's worker thread (the native
        engine may call the core, and so these hooks, from its threads)."""
        if self.nursery is None:
            return
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            self.token.run_sync_soon(self.nursery.start_soon, fn, *args)
            return
        self.nursery.start_soon(fn, *args)

    async def _load(self) -> None:
        delay = RETRY_MIN
        while True:
            try:
                manifest = await trio.to_thread.run_sync(tree.load_manifest, self._target(), self.source.generation)
                self.use_manifest(manifest)
                self.load_error = None
                log.info("restore.resumed", extra={"fields": {
                    "source": self.source.url, "generation": self.source.generation, "files": len(self.jobs)}})
                return
            except tree.SourceError as e:
                self.load_error = str(e)
                self.record_error(f"cannot load the manifest: {e}")
                self.load_tried.set()
            await trio.sleep(delay)
            delay = min(RETRY_MAX, delay * 2)

    async def _background(self) -> None:
        delay = RETRY_MIN
        while True:
            for job in [j for j in self.jobs.values() if j.gone]:
                self._drop(job)
            jobs = [j for j in self.jobs.values() if j.active and j.entry is not None and j.inode.nlink > 0]
            if not jobs:
                break
            order = {id(e): k for k, e in enumerate(plan.fetch_order([j.entry for j in jobs]))}
            jobs.sort(key=lambda j: order[id(j.entry)])
            failures = self.errors_total
            async with trio.open_nursery() as batch:
                slots = trio.Semaphore(self.bg_limiter.total_tokens)
                for job in jobs:
                    for first, last in plan.runs(job.missing, max(1, RUN_BYTES // job.chunk_size), job.span):
                        if not job.active:
                            break
                        await slots.acquire()
                        batch.start_soon(self._background_run, job, first, last, slots)
            if all(not j.active for j in jobs):
                continue
            if self.errors_total > failures:
                await trio.sleep(delay)
                delay = min(RETRY_MAX, delay * 2)
            else:
                delay = RETRY_MIN
                await trio.sleep(RETRY_MIN)

    async def _background_run(self, job: FileJob, first: int, last: int, slots: trio.Semaphore) -> None:
        try:
            await self._get(job, list(range(first, last + 1)), demand=False)
        except FsError:
            pass  # recorded; retried by the next pass
        finally:
            slots.release()

    async def _finish(self) -> None:
        """Every file is local: make it all durable, then drop the root's marker."""
        if any(j.inode.nlink > 0 for j in self.jobs.values()):
            self.state = "failed"  # files whose objects the manifest lacks: nothing to fetch them from
            return
        self.state = SYNCING
        await self.store.sync(ROOT_INO)
        root = self.fs.ns.get(ROOT_INO)
        if plan.SOURCE_XATTR in root.xattrs:
            self.fs.ns.removexattr(ROOT_INO, plan.SOURCE_XATTR)
        await self.store.sync(ROOT_INO)
        self.state = DONE
        self.finished = time.time()
        log.info("restore.done", extra={"fields": {
            "source": self.source.url, "generation": self.source.generation, "files": self.files_total,
            "bytes": self.bytes_total, "seconds": round(self.finished - self.started, 3)}})

    # ---- fetching -------------------------------------------------------------
    async def demand(self, need: NeedsRestore) -> None:
        """A read (or a write, a truncate) waits for chunks of a file being restored. The engine
        serves as soon as the tree is built, a moment before the daemon starts `run`: a read that
        comes first waits for it (a fetch started without the nursery would never end)."""
        await self.running.wait()
        job = need.remote
        if not isinstance(job, FileJob) or not job.active:
            return  # completed or cancelled meanwhile: the caller retries
        if job.entry is None:
            await self.load_tried.wait()
            if job.entry is None:
                why = self.load_error if not self.loaded.is_set() else "its object is not in the manifest"
                raise RestoreError(f"cannot restore inode {job.ino}: {why}")
            return
        self.demand_fetches += 1
        await self._get(job, need.indexes, demand=True)
        self.read_ahead(job, max(need.indexes))

    def read_ahead(self, job: FileJob, idx: int) -> None:
        """A read was served up to chunk `idx`: keep the next READAHEAD_BYTES on their way (cheap
        when they are: it looks at one chunk half a window ahead)."""
        if self.nursery is None or not job.active or job.entry is None:
            return
        n = max(1, READAHEAD_BYTES // job.chunk_size)
        probe = min(job.nchunks - 1, idx + max(1, n // 2))
        if probe <= idx or probe not in job.missing or probe in job.inflight:
            return
        self._soon(self._read_ahead, job, idx, n)

    async def _read_ahead(self, job: FileJob, idx: int, n: int) -> None:
        if not job.active:
            return
        ahead = [i for i in range(idx + 1, min(job.nchunks, idx + 1 + n))
                 if i in job.missing and i not in job.inflight]
        for first, last in plan.runs(ahead, max(1, RUN_BYTES // job.chunk_size), job.span):
            self._start_fetch(job, first, last, demand=True)

    async def _get(self, job: FileJob, indexes: list[int], *, demand: bool) -> None:
        """Wait until chunks `indexes` are in the file; RestoreError with the cause if one failed."""
        todo = [i for i in indexes if i in job.missing and i not in job.inflight]
        for first, last in plan.runs(todo, max(1, RUN_BYTES // job.chunk_size), job.span):
            self._start_fetch(job, first, last, demand=demand)
        for i in indexes:
            event = job.inflight.get(i)
            if event is not None:
                await event.wait()
        if not job.active:
            return
        bad = [i for i in indexes if i in job.missing]
        if bad:
            raise RestoreError(job.failed.get(bad[0]) or f"chunk {bad[0]} of inode {job.ino} was not restored")

    def _start_fetch(self, job: FileJob, first: int, last: int, *, demand: bool) -> None:
        """Chunks first..last of the job's file, and those of other files that name the same
        segment there (`_twins`), are in flight from now on: claimed here, in one step, so two
        fetches started back to back never both GET one segment."""
        for i in range(first, last + 1):
            job.inflight[i] = trio.Event()
        key, off = self._object_of(job, first)
        twins = self._twins(job, key, first, last) if job.span else []
        self.nursery.start_soon(self._fetch_run, job, first, last, demand, key, off, twins)

    def _object_of(self, job: FileJob, first: int) -> tuple[str, int]:
        """The key of the object holding chunk `first` of the job's file, and the file offset it starts at."""
        entry = job.entry
        if not job.span:
            return entry.object, 0
        p = first // job.span
        return entry.segments[p], p * job.span * job.chunk_size

    def _twins(self, job: FileJob, key: str, first: int, last: int) -> list[tuple[FileJob, int, list[int]]]:
        """Other files naming segment `key` whose chunks at the place of `first..last` are missing and
        not on their way: (job, the chunk at `first`'s place, those chunks), marked in flight."""
        base = first % job.span if job.span else 0
        out = []
        for other, start in self.users.get(key, ()):
            if (other is job and start + base == first) or not other.active or other.entry is None:
                continue
            at = start + base
            idx = [at + k for k in range(last - first + 1)
                   if at + k in other.missing and at + k not in other.inflight
                   and other.entry.crcs[at + k] == job.entry.crcs[first + k]]
            if idx:
                for i in idx:
                    other.inflight[i] = trio.Event()
                out.append((other, at, idx))
        return out

    async def _fetch_run(self, job: FileJob, first: int, last: int, demand: bool, key: str, off: int,
                         twins: list) -> None:
        entry, cs = job.entry, job.chunk_size
        start, end = plan.byte_range(first, last, entry.size, cs)
        what = f"/{entry.path}"
        try:
            if not demand:
                await self.rate.take(end - start)
            # a slot is held until the bytes are in the file: memory in flight stays bounded
            async with self.demand_limiter if demand else self.bg_limiter:
                data, bad = await trio.to_thread.run_sync(
                    _get_range, self._target(), key, start - off, end - off, entry.crcs, first, cs, what)
                self.bytes_fetched += len(data)
                await self._deliver(job, first, data, skip=bad)
                for other, at, idx in twins:
                    wanted = set(idx)
                    skip = {at + k for k in range(last - first + 1) if first + k in bad or at + k not in wanted}
                    await self._deliver(other, at, data, skip=skip)
                del data
            for i in range(first, last + 1):
                job.failed.pop(i, None)
            for i, why in bad.items():
                job.failed[i] = why
                self.record_error(why)
        except FsError as e:
            for i in range(first, last + 1):
                job.failed[i] = str(e)
            self.record_error(str(e))
        except Exception as e:  # noqa: BLE001 - a bug must not stop the restore
            log.exception("unexpected error restoring %s", what)
            for i in range(first, last + 1):
                job.failed[i] = f"internal error: {e}"
            self.record_error(f"internal error restoring {what}: {e}")
        finally:
            for owner, chunks in [(job, range(first, last + 1)), *((o, idx) for o, _, idx in twins)]:
                for i in chunks:
                    event = owner.inflight.pop(i, None)
                    if event is not None:
                        event.set()

    async def _deliver(self, job: FileJob, first: int, data: bytes, skip=()) -> None:
        """Write fetched chunks into the file (waiting for memory like any writer), but those in `skip`."""
        view = memoryview(data)
        cs = job.chunk_size
        inode, store = job.inode, self.store
        for k, off in enumerate(range(0, len(view), cs)):
            idx = first + k
            if idx in skip:
                continue
            piece = view[off:off + cs]
            while True:
                if job.gone:
                    self._drop(job)
                if not job.active or idx not in job.missing:
                    break
                try:
                    n = inode.data.fill(idx * cs, piece)
                except NoSpace as e:
                    if not await store.wait_for_room(isinstance(e, DevicesFull)):
                        raise RestoreError(f"no room to restore /{job.entry.path}: {e}") from None
                    continue
                except NeedsFetch as e:
                    await store.fetch(e.chunks)
                    continue
                store.absorbed(n)
                store.dirtied(inode)
                job.arrived(idx)
                job.uncommitted += n
                self.bytes_done += n
                break
        if not job.active:
            return
        if not job.missing:
            self._complete(job)
        elif job.uncommitted >= COMMIT_BYTES or (
                job.uncommitted and trio.current_time() - job.committed_at >= COMMIT_SECONDS):
            job.uncommitted = 0
            job.committed_at = trio.current_time()
            store.closed(inode)  # progress survives a crash

    def _complete(self, job: FileJob) -> None:
        """Every chunk is in: commit the contents, then (in journal order) drop the marker and
        name the object the bytes came from (plan.ORIGIN_XATTR)."""
        job.active = False
        inode = job.inode
        if inode.data is not None and inode.data.remote is job:
            inode.data.remote = None
        del self.jobs[job.ino]
        self.files_done += 1
        self.store.closed(inode)
        if inode.nlink > 0 and plan.FILE_XATTR in inode.xattrs:
            self.fs.ns.removexattr(inode.ino, plan.FILE_XATTR)
            if job.object:
                self.fs.ns.setxattr(inode.ino, plan.ORIGIN_XATTR, job.object.encode())

    def _drop(self, job: FileJob) -> None:
        """The file is gone: stop restoring it (the unlink in the journal took its marker along)."""
        if job.active:
            job.active = False
            self.jobs.pop(job.ino, None)
            self.files_done += 1
            self.bytes_done += sum(job.chunk_length(i) for i in job.missing)
            job.missing.clear()

    def cancel(self, job: FileJob) -> None:
        """The file was truncated to zero (called from inside the core: act after it returns)."""
        if job.active:
            self._drop(job)
            self._soon(self._commit_cancel, job)

    async def _commit_cancel(self, job: FileJob) -> None:
        inode = job.inode
        self.store.closed(inode)  # the truncated contents, before the marker goes
        if inode.nlink > 0 and inode.ino in self.fs.ns.inodes and plan.FILE_XATTR in inode.xattrs:
            self.fs.ns.removexattr(inode.ino, plan.FILE_XATTR)

    def record_error(self, message: str) -> None:
        self.errors_total += 1
        self.errors.append(message)
        log.error("restore.error", extra={"fields": {"error": message}})

    # ---- reporting --------------------------------------------------------------
    def statistics(self) -> "RestoreStats":
        """For `ckptfs status`, the control API and metrics."""
        return RestoreStats(self.source.url, self.source.endpoint, self.source.generation, self.state,
                            self.files_total, self.files_done, self.bytes_total, self.bytes_done,
                            self.bytes_fetched, self.demand_fetches, len(self.jobs), self.errors_total,
                            list(self.errors), self.errors[-1] if self.errors else None,
                            self.manifest.time_ns if self.manifest is not None else None,
                            round((self.finished or time.time()) - self.started, 3))


@dataclass(frozen=True)
class RestoreStats:
    """One reading of a restore (`Restorer.statistics()`; `restore` in `ckptfs status`)."""
    source: str
    endpoint: str | None
    generation: int
    state: str  # loading, fetching, syncing, done
    files_total: int
    files_restored: int
    bytes_total: int
    bytes_restored: int
    bytes_fetched: int  # GET bytes, retries included
    demand_fetches: int
    files_pending: int
    errors_total: int
    errors: list  # the last ERRORS_KEPT
    last_error: str | None
    manifest_time: int | None
    seconds: float


# ---- before serving (tree.py builds the tree) --------------------------------------------
def fresh(fs, store, manifest: Manifest, source: plan.Source, **kw) -> Restorer:
    """A Restorer that builds `manifest`'s tree in this freshly formatted pool (`prepare`)."""
    tree.check_fresh(fs, store, manifest)
    r = Restorer(fs, store, source, **kw)
    r.pending = manifest
    return r


def resume(fs, store, endpoint: str | None = None, **kw) -> Restorer | None:
    """After a remount: a Restorer for the files whose markers say they are still remote (None when
    nothing is). `endpoint` overrides the recorded one. Each such file stays gated until the
    manifest is loaded and its local chunks are checked against it."""
    found = tree.still_remote(fs.ns, endpoint)
    if found is None:
        return None
    source, marked = found
    r = Restorer(fs, store, source or plan.Source("s3://unknown-source", None, 0, True), **kw)
    for inode, marker in marked:
        r.add_job(inode, marker.object, marker.size)
    if source is None:
        r.known_source = False
        r.load_error = "the pool has files still to restore but no record of their source"
        r.record_error(r.load_error)
    return r
