"""The replication service: copy the durable state to an object store, one manifest at a time.

`Replicator.run` is a trio task of the daemon. It never touches the write or
fsync path: it reads what the journal has made durable (the store's
`DurableState`) and the devices, and hears of changes through the store's
`on_commit` hook (`notify`), which only sets an event.

A cycle:

1. **Snapshot.** `snapshot.take` walks the durable state at the current
   journal sequence number: the manifest (every path, attributes, xattrs;
   per file a version key and per-chunk CRCs) and the file versions it names,
   with their segments' keys (segments.py) where they are known: the versions
   already replicated (`known`) and those whose digests the journal keeps.
   Only the newest durable version of each file is there: versions
   superseded before the cycle starts are never uploaded.
2. **Pin.** The device units of the versions with a segment the store does
   not hold yet (or not known) get one more allocator reference each, so a newer version cannot
   be written over them while they are read; released when the cycle ends.
   A cycle in progress finishes even while the files keep changing (the
   next cycle takes the newest state), so continuous rewrites cannot starve
   replication, as `--max-lag` keeps them from starving the journal.
3. **Upload** the missing segments, one PUT each. A segment is read
   (source.py: arena or devices, CRC-checked) into a part buffer; one whose
   key is not known yet is named from those bytes (BLAKE3, by the uploader
   process), and not sent when the store holds it (`bytes_shared`). A
   segment two versions share is uploaded once, the second waiting for the
   first. The buffers in use or kept for reuse never exceed
   `--replicate-memory`; a token bucket caps the bandwidth
   (`--replicate-rate`); `connections` calls run at once. The calls are made
   by the uploader process (uploader.py, at `--replicate-priority`, idle by
   default), not by the daemon's threads: the part buffers are shared memory
   both map (partmem.py) and a call names its payload there
   (uploader_proc.py), so the daemon only reads the segments and never signs
   or sends them.
4. **Manifest** generation + 1, written only now that every object it names
   is in the store (the prefix rule, docs/SEMANTICS.md); skipped when the
   tree is the same as the standing manifest's.
5. **Collect**: the manifests the retention policy (retention.py) no longer
   keeps, then the objects (segments, and format 1's whole objects) that no
   kept manifest names. Nothing else writes under the prefix (one writer,
   below) and this task does the cycle's uploads, its manifest and then the
   collection in turn, so a segment an upload is about to name is either in
   the manifest just written or uploaded after the collection.

One writer per prefix (lineage.py): at start, a prefix whose newest
manifest another pool wrote (not one this pool continues, and without
`--replicate-takeover`) stops the service before it writes or deletes
anything; at the end of each cycle (before its manifest and its collection)
the manifests are listed again, and one newer than the last this service
wrote or found stops it too (cause `conflict`).

A failed object-store call has a kind (client.py). A transient one (the
store unreachable, throttling, 5xx, the uploader process) is retried with
exponential backoff and full jitter (a delay drawn from 0 .. min(BACKOFF_MAX,
BACKOFF_MIN * 2^n)) until it succeeds: the mount never waits for the store.
A permanent one (credentials refused, no bucket, a segment the store rejects,
a version the devices cannot give back intact) ends the work it concerns:
the other objects of the cycle go on, the cycle ends without a manifest,
its pinned units are released, and the next cycle tries again after
PERMANENT_RETRY seconds (credentials are read again: client.py). Every failure is logged once per kind
with its call, key and what to do, counted, and shown in status with the
time it began until a call succeeds again. At start the service lists the
prefix and reads the manifests, so a remount (after a clean stop or a
SIGKILL) uploads no segment the store already holds, names the versions
they replicated without reading them, and continues the generations; an
upload cut off midway left whole segments or nothing, so it goes on where
it stopped.
"""
from __future__ import annotations

import logging
import random
import time
from collections import Counter
from dataclasses import dataclass

import trio

from ..errors import FsError
from ..fs.namespace import ROOT_INO
from . import lineage, retention
from . import segments
from .client import CONFLICT, DEVICE, GLOBAL, OTHER, S3Error, transient
from .manifest import BadManifest, MANIFESTS, OBJECTS, Manifest, S3Url, manifest_generation, manifest_name
from .partmem import Part, PartMemory
from .priority import DEFAULT_PRIORITY
from .snapshot import Version, name_segments, restoring, same_tree, take, version_key
from .source import read_part
from .throttle import Throttle
from .uploader_proc import Uploader, UploaderStats

log = logging.getLogger("ckptfs.replicate")

DEFAULT_MEMORY = 256 << 20
CONNECTIONS = 10  # object-store calls at once (s3transfer's default concurrency)
SEGMENTS_AT_ONCE = 32  # segments read and uploaded at once, at most (memory // segment size bounds it too)
BACKOFF_MIN, BACKOFF_MAX = 0.5, 10.0
PERMANENT_RETRY = 60.0  # seconds before a cycle that failed for good is tried again
SETTLE = 0.05  # seconds a change waits for company before a cycle starts


def backoff(attempt: int, rng=random) -> float:
    """Seconds before retry `attempt` (0, 1, ...): full jitter over an exponential cap."""
    return rng.uniform(0, min(BACKOFF_MAX, BACKOFF_MIN * 2 ** min(attempt, 30)))


class CycleFailed(Exception):
    """A cycle ended without its manifest: a permanent failure (already logged and counted)."""


@dataclass(frozen=True)
class ReplicationStats:
    """One reading of the replication (`Replicator.statistics()`; `replication` in `ckptfs status`)."""
    target: str
    started: bool
    lag: float  # seconds the oldest durable change not yet in a standing manifest has waited
    cycle_running: bool
    bytes_uploaded: int
    bytes_shared: int  # bytes of new versions not uploaded: the store held their segments
    kept_bytes: int  # bytes of the distinct file versions the kept manifests name
    stored_bytes: int  # bytes of their distinct segments: what the store holds for them
    objects_uploaded: int  # segments uploaded
    versions_uploaded: int  # file versions whose segments are all in the store now
    objects: int
    manifests_written: int
    objects_deleted: int
    manifests_deleted: int
    generation: int
    manifest_time: float | None
    journal_seq: int | None
    covered_seq: int
    retention: str  # the policy, in words
    rate: float | None
    memory: int
    read_from_arena: int
    read_from_devices: int
    errors: dict  # cause -> failed calls
    errors_total: int
    failing: dict | None  # {cause, message, since} of the call failing now (since: wall-clock time)
    waiting_bytes: int  # bytes of the newest snapshot not in the store yet
    waiting_commits: int  # durable changes (journal batches) no standing manifest holds yet
    last_error: dict | None  # {cause, message, time}
    uploader: UploaderStats


class Replicator:
    """The replication service of one mount: what is uploaded (objects, manifests, generation), the
    cycle that uploads the newest durable state, the garbage collection of what no kept manifest
    names, its failures, and the counters `statistics()` shows."""

    def __init__(self, store, url: S3Url, endpoint: str | None = None, *, rate: float | None = None,
                 policy: retention.Policy = retention.DEFAULT, memory: int = DEFAULT_MEMORY,
                 segment: int = segments.SEGMENT_BYTES,
                 connections: int = CONNECTIONS, priority: str = DEFAULT_PRIORITY, takeover: bool = False,
                 clock=time.time):
        self.store = store
        self.url = url
        self.takeover = takeover  # --replicate-takeover: may start on a prefix another pool wrote
        self.ancestors: frozenset[str] = frozenset()  # pools this one continues besides its lineage (a restore
        # that has not reached the journal yet: daemon.assemble)
        self.conflict: S3Error | None = None  # another writer under the prefix: stopped for good
        self.policy = policy
        self.clock = clock  # wall-clock seconds: manifest times and the retention policy's "now"
        self.segment = segments.segment_size(store.chunk_size, segment)
        self.memory = max(memory, self.segment)
        self.parts = PartMemory(self.memory)  # the part buffers, shared with the uploader process
        self.target = Uploader(url, endpoint, self.parts, connections=connections, priority=priority)
        self.throttle = Throttle(rate)
        self.rate = rate
        self.s3_limiter = trio.CapacityLimiter(connections)
        self.changed = trio.Event()  # the durable state changed since the last snapshot
        self.progress = trio.lowlevel.ParkingLot()  # a manifest stood, or an error came or went
        self.started = False  # the prefix was listed and the newest manifests read
        self.objects: set[str] = set()  # objects the store holds (relative keys)
        self.refs: Counter = Counter()  # (version key, segment size) -> kept manifests naming it
        self.known: dict[str, list[str]] = {}  # version key -> its segments, for the versions in kept manifests
        self.sizes: dict[str, int] = {}  # ... and its size
        self.uses: Counter = Counter()  # object key -> versions of kept manifests naming it
        self.unnamed: set[str] = set()  # objects in the store no kept manifest names: collected next
        self.kept_bytes = self.stored_bytes = 0  # bytes of those versions, and of their distinct objects
        self.uploading: dict[str, trio.Event] = {}  # segment key -> set once its upload in progress ends
        self.kept: dict[int, Manifest | None] = {}  # manifests in the store (None: unreadable)
        self.generation = 0  # the newest manifest's generation
        self.standing: Manifest | None = None  # the newest manifest (written or found)
        self.standing_files: dict[int, tuple[str, int]] = {}  # ino -> (object, mtime_ns) in the standing manifest
        self.standing_dirs: set[int] = set()
        self.covered_seq = -1  # the journal sequence number the standing manifest's tree holds
        # monotonic time of the oldest change not snapshotted: at start, whatever the journal holds
        # may not be replicated yet (a killed predecessor), so the lag counts from the start
        self.pending_since: float | None = time.monotonic()
        self.cycle_since: float | None = None  # ... of the oldest change the running cycle covers
        self.cycle_running = False
        self.last_manifest_time: float | None = None  # wall-clock time it was written
        self.bytes_uploaded = 0
        self.bytes_shared = 0  # bytes of new versions whose segments the store held already
        self.objects_uploaded = 0
        self.versions_uploaded = 0
        self.manifests_written = 0
        self.objects_deleted = 0
        self.manifests_deleted = 0
        self.read_from = Counter()  # bytes read for uploads: arena, device
        self.errors: Counter = Counter()  # failed calls by cause
        self.failing: S3Error | None = None  # the last call failed with this (until one succeeds)
        self.failing_since: float | None = None  # wall-clock time the failure began
        self.waiting_bytes = 0  # bytes of the running (or last failed) cycle's objects not uploaded yet
        self.waiting_commits = 0  # batches committed since the snapshot of the standing manifest
        self.last_error: dict | None = None  # {cause, message, time}

    # ---- hooks ------------------------------------------------------------------
    def notify(self, batch) -> None:
        """The store's on_commit hook: a batch reached the journal."""
        if any(not p.void for p in batch):
            self.waiting_commits += 1
            if self.pending_since is None:
                self.pending_since = time.monotonic()
            self.changed.set()

    # ---- queries ------------------------------------------------------------------
    def durable_version(self, ino: int) -> tuple[str, int] | None:
        """(content key, mtime) of the durable version of regular file `ino` (None: not a durable file)."""
        durable = self.store.durable
        inode = durable.ns.inodes.get(ino)
        if inode is None or not inode.is_reg:
            return None
        return version_key(inode, durable.files.get(ino, {})), inode.mtime_ns

    def replicated(self, ino: int) -> bool:
        """Is the durable version of `ino`, with its mtime, in the standing manifest? (Folders: is it
        named.) A utime re-uploads nothing, but the file is replicated only once a manifest has its time."""
        if ino in self.standing_dirs or (ino == ROOT_INO and self.standing is not None):
            return True
        version = self.standing_files.get(ino)
        return version is not None and version == self.durable_version(ino)

    def lag(self) -> float:
        """Seconds the oldest durable change not yet in a standing manifest has waited."""
        since = [t for t in (self.cycle_since, self.pending_since) if t is not None]
        return time.monotonic() - min(since) if since else 0.0

    def statistics(self) -> "ReplicationStats":
        """The replication block of `ckptfs status` (and the metrics)."""
        failing = None if self.failing is None else {"cause": self.failing.cause, "message": str(self.failing),
                                                     "since": self.failing_since}
        return ReplicationStats(
            str(self.target), self.started, round(self.lag(), 3), self.cycle_running, self.bytes_uploaded,
            self.bytes_shared, self.kept_bytes, self.stored_bytes, self.objects_uploaded, self.versions_uploaded,
            len(self.objects), self.manifests_written,
            self.objects_deleted, self.manifests_deleted, self.generation, self.last_manifest_time,
            self.standing.journal_seq if self.standing is not None else None, self.covered_seq,
            self.policy.describe(),
            self.rate, self.memory, self.read_from["arena"], self.read_from["device"], dict(self.errors),
            sum(self.errors.values()), failing, self.waiting_bytes, self.waiting_commits, self.last_error,
            self.target.statistics())

    # ---- waiting -------------------------------------------------------------------
    async def wait_covered(self, seq: int) -> None:
        """Return once a standing manifest holds the durable state of journal frame `seq` or later (or
        replication stopped: `conflict`)."""
        while self.covered_seq < seq and self.conflict is None:
            await self.progress.park()

    async def wait_files(self, inos: list[int]) -> None:
        """Return once each of `inos` is replicated or gone (or replication stopped: `conflict`)."""
        while self.conflict is None and not all(self.replicated(i) or i not in self.store.durable.ns.inodes for i in inos):
            await self.progress.park()

    # ---- the service ------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.target.run)  # the uploader process's tasks
                task_status.started()
                await self._guarded(self._start)
                while self.conflict is None:
                    await self._guarded(self._cycle)
                    await self.changed.wait()
                    await trio.sleep(SETTLE)
                await trio.sleep_forever()  # stopped (another writer): nothing more is written or deleted
        finally:
            self.parts.close()

    async def _guarded(self, step) -> None:
        """Run `step` until it completes. A permanent failure (already logged) is tried again after
        PERMANENT_RETRY seconds; a bug is logged and retried with backoff, and never takes the daemon
        down."""
        attempt = 0
        while True:
            try:
                return await step()
            except (CycleFailed, S3Error) as e:
                if isinstance(e, S3Error):
                    self._failed(e)
                delay = PERMANENT_RETRY
            except Exception as e:  # noqa: BLE001 - the mount must keep serving whatever replication does
                log.exception("unexpected error in replication")
                self._failed(S3Error(OTHER, f"internal error: {type(e).__name__}: {e}"))
                delay = backoff(attempt)
                attempt += 1
            self.cycle_running = False
            if self.cycle_since is not None:  # the change is still not replicated
                self.pending_since = min(self.cycle_since, self.pending_since or self.cycle_since)
                self.cycle_since = None
            await trio.sleep(delay)

    async def finish(self, timeout: float) -> bool:
        """At unmount: wait (at most `timeout` s) until the final durable state is replicated; False
        when it is not (the object store fails, or is too slow)."""
        if not self.started or self.failing is not None:
            return False
        with trio.move_on_after(timeout):
            await self.wait_covered(self.store.committer.seq)
            return True
        return False

    async def _start(self) -> None:
        """List the prefix, read the newest manifests and the uploads a stopped daemon left."""
        listing = await self._s3(self.target.list, "")
        self.objects = {k for k in listing if k.startswith((OBJECTS, segments.SEGMENTS))}
        gens = sorted(g for g in (manifest_generation(k) for k in listing) if g is not None)
        self.generation = gens[-1] if gens else 0
        for g in gens:
            self.kept[g] = None
        for g in gens:  # every one: the retention policy needs their times
            try:
                self.kept[g] = await self._s3(self.target.manifest, g)
            except BadManifest as e:
                log.warning("replicate.bad_manifest", extra={"fields": {"manifest": manifest_name(g), "error": str(e)}})
        newest = self.kept.get(self.generation)
        if gens and newest is None:  # the newest did not decode: whose it is cannot be told
            self._stop(lineage.conflict(str(self.url), self.generation, None))
            return
        why = lineage.refusal(newest, self.pool, self.lineage(), self.takeover, str(self.url))
        if why is not None:
            self._stop(why)
            return
        if newest is not None and newest.pool == self.pool:
            self._stand(newest, seq=-1)
        if newest is not None:
            self.last_manifest_time = newest.time_ns / 1e9
        for m in self.kept.values():
            if m is not None:
                self._name(m, 1)
        self.unnamed = {k for k in self.objects if k not in self.uses}
        self.started = True
        log.info("replicate.started", extra={"fields": {
            "target": str(self.target), "objects": len(self.objects), "generation": self.generation}})

    def _name(self, m: Manifest, sign: int) -> None:
        """Manifest `m` joins (sign 1) or leaves (-1) the kept ones: count its versions (`refs`), and
        for a version named first or no longer, its segments (`uses`, `unnamed`), `known`, `sizes`,
        `kept_bytes` and `stored_bytes`. The work per cycle is one pass over the manifest written
        and those dropped, plus the segments of versions that come or go."""
        seen = set()
        for e in m.entries:
            v = (e.object, m.segment_size)
            if not e.size or v in seen:
                continue
            seen.add(v)
            n = self.refs[v] + sign
            if n:
                self.refs[v] = n
            else:
                del self.refs[v]
            if not ((sign > 0 and n == 1) or n == 0):
                continue
            self.kept_bytes += sign * e.size
            if m.segment_size == self.segment:
                if sign > 0:
                    self.known[e.object], self.sizes[e.object] = e.segments, e.size
                else:
                    self.known.pop(e.object, None)
                    self.sizes.pop(e.object, None)
            for k, _, length in m.pieces(e):
                u = self.uses[k] + sign
                if u:
                    self.uses[k] = u
                else:
                    del self.uses[k]
                if sign > 0 and u == 1:
                    self.stored_bytes += length
                    self.unnamed.discard(k)
                elif u == 0:
                    self.stored_bytes -= length
                    if k in self.objects:
                        self.unnamed.add(k)

    def store_shared(self, ino: int) -> int | None:
        """Bytes of regular file `ino`'s replicated version (the standing manifest's) in segments that
        other kept versions name too (an earlier save, a copy); None when it has none replicated."""
        version = self.standing_files.get(ino)
        segs = self.known.get(version[0]) if version is not None else None
        size = self.sizes.get(version[0]) if version is not None else None
        if segs is None or size is None:
            return None
        return sum(segments.length(i, size, self.segment) for i, k in enumerate(segs) if self.uses[k] > 1)

    def _stand(self, manifest: Manifest, seq: int) -> None:
        self.standing = manifest
        self.standing_files = {e.ino: (e.object, e.mtime_ns) for e in manifest.entries if e.object}
        self.standing_dirs = {e.ino for e in manifest.entries if (e.mode & 0o170000) == 0o040000}
        self.covered_seq = seq

    async def _cycle(self) -> None:
        store = self.store
        self.changed = trio.Event()
        # retried at the next commit (the restore commits its progress). The live namespace too: a
        # restore's tree is built there before the journal has it, and the durable state of that
        # moment (empty) must not become the prefix's newest manifest
        if restoring(store.durable.ns) or (store.ns is not None and restoring(store.ns)):
            return
        self.cycle_since, self.pending_since = self.pending_since, None
        self.cycle_running = True
        seq = store.committer.seq
        commits = self.waiting_commits
        manifest, versions = take(store.durable, pool=self.pool, seq=seq,
                                  chunk_size=store.chunk_size, time_ns=int(self.clock() * 1e9),
                                  generation=self.generation + 1, segment_size=self.segment, known=self.known)
        missing = [v for v in versions.values() if v.segments is None or not self.objects.issuperset(v.segments)]
        sending = {v.key for v in missing}
        for v in versions.values():
            if v.key not in self.known and v.key not in sending:  # new, and every segment stored already
                self.bytes_shared += v.size
        self.waiting_bytes = sum(v.size for v in missing)
        units = [u for v in missing for u in v.units()]
        failed: list[S3Error] = []
        for dev, unit in units:
            store.alloc.claim(dev, unit)  # pinned: not reused while we read them
        try:
            await self._upload_all(missing, failed)
        finally:
            for dev, unit in units:
                store.alloc.release(dev, unit)
            store.wake()
        if failed:  # permanent: no manifest can name what is not there
            raise CycleFailed(str(failed[0]))
        name_segments(manifest, versions)
        if await self._intruder():  # before a manifest, and before any collection
            self.cycle_running = False
            return
        if self.standing is None or not same_tree(manifest, self.standing):
            name = manifest_name(manifest.generation)
            if not await self._s3(self.target.put_new, name, manifest.encode()):
                await self._lost_race(manifest.generation)  # another writer's, put since the check
                self.cycle_running = False
                return
            self.generation = manifest.generation
            self.kept[manifest.generation] = manifest
            self._name(manifest, 1)
            self.manifests_written += 1
            self.last_manifest_time = manifest.time_ns / 1e9
            log.info("replicate.manifest", extra={"fields": {
                "generation": manifest.generation, "journal_seq": seq, "entries": len(manifest.entries),
                "uploaded": len(missing)}})
            self._stand(manifest, seq)
        else:
            self.covered_seq = seq
        self.cycle_since = None
        self.cycle_running = False
        self.waiting_commits -= commits
        self.progress.unpark_all()
        await self._collect()

    # ---- one writer per prefix (lineage.py) --------------------------------------------------
    @property
    def pool(self) -> str:
        return self.store.sbs[0].pool_id.hex()

    def lineage(self) -> frozenset[str]:
        """The pools this one continues: its durable lineage, the live one (a restore's tree not yet
        committed) and `ancestors`."""
        return lineage.of(self.store.durable.ns) | lineage.of(self.store.ns) | self.ancestors

    async def _intruder(self) -> bool:
        """Before a manifest is written or anything collected: is there a manifest newer than the last
        one this service wrote or found (another writer's)? Then stop."""
        gens = [g for g in (manifest_generation(k) for k in await self._s3(self.target.list, MANIFESTS))
                if g is not None]
        newer = lineage.newer(gens, self.generation)
        if not newer:
            return False
        await self._lost_race(newer[-1])
        return True

    async def _lost_race(self, generation: int) -> None:
        """Manifest `generation` is another writer's: stop, naming its pool."""
        try:
            writer = await self._s3(self.target.manifest, generation)
        except BadManifest:
            writer = None
        self._stop(lineage.conflict(str(self.url), generation, writer))

    def _stop(self, why: str) -> None:
        """Another writer owns the prefix: write and delete nothing more (status and log say why)."""
        self.conflict = S3Error(CONFLICT, why)
        self._failed(self.conflict)
        self.cycle_since = self.cycle_since or self.pending_since

    async def _collect(self) -> None:
        """Delete the manifests the retention policy no longer keeps, then objects no kept manifest
        names (an unreadable manifest is kept: nothing is deleted on a guess)."""
        times = {g: (None if m is None else m.time_ns / 1e9) for g, m in self.kept.items()}
        drop = retention.forget(times, self.policy, self.clock())
        if drop:
            await self._s3(self.target.delete, [manifest_name(g) for g in drop])
            for g in drop:
                m = self.kept.pop(g)
                if m is not None:
                    self._name(m, -1)
            self.manifests_deleted += len(drop)
        garbage = sorted(self.unnamed)
        self.unnamed.clear()
        if garbage:
            await self._s3(self.target.delete, garbage)
            self.objects.difference_update(garbage)
            self.objects_deleted += len(garbage)

    # ---- uploads -------------------------------------------------------------------------
    async def _upload_all(self, missing: list[Version], failed: list) -> None:
        """Every segment of `missing` the store does not hold yet, `memory // segment` at once; a
        permanent failure is appended to `failed` (one that concerns every call, such as refused
        credentials, cancels the rest of the cycle)."""
        todo = iter([(v, i) for v in missing for i in range(segments.count(v.size, self.segment))])
        for v in missing:
            if v.segments is None:
                v.segments = [None] * segments.count(v.size, self.segment)

        async def worker() -> None:
            for v, i in todo:  # shared: each segment is taken by one worker
                try:
                    await self._segment(v, i)
                except S3Error as e:
                    self._failed(e)
                    failed.append(e)
                    if e.cause in GLOBAL:
                        nursery.cancel_scope.cancel()
                    return

        async with trio.open_nursery() as nursery:
            for _ in range(max(1, min(SEGMENTS_AT_ONCE, self.memory // self.segment))):
                nursery.start_soon(worker)
        self.versions_uploaded += sum(None not in v.segments for v in missing)

    async def _segment(self, v: Version, i: int) -> None:
        """Segment `i` of `v` into the store, unless it holds it already (its key known beforehand,
        or taken from the bytes read)."""
        n = segments.length(i, v.size, self.segment)
        k = v.segments[i]
        if k is not None and await self._stored(k):
            self._shared(v, i, k, n)
            return
        buf = await self.parts.take(self.segment)
        try:
            got = await self._read(v, i * self.segment, buf)
            if k is None:  # hashed by the uploader process, at its priority
                k = await self._s3(self.target.segment_key, buf.body(got),
                                   segments.layout(v.size, self.store.chunk_size, v.extents, i, self.segment))
                if await self._stored(k):
                    self._shared(v, i, k, n)
                    return
            self.uploading[k] = done = trio.Event()
            try:
                await self.throttle.take(got)
                await self._s3(self.target.put, k, buf.body(got))
            finally:
                del self.uploading[k]
                done.set()
            self.objects.add(k)
            if k not in self.uses:
                self.unnamed.add(k)  # until the manifest that names it stands
            v.segments[i] = k
            self.bytes_uploaded += got
            self.objects_uploaded += 1
            self.waiting_bytes = max(0, self.waiting_bytes - n)
        finally:
            self.parts.give_back(buf)

    async def _stored(self, k: str) -> bool:
        """Does the store hold segment `k` (after the upload of it in progress, if any)?"""
        while k in self.uploading:
            await self.uploading[k].wait()
        return k in self.objects

    def _shared(self, v: Version, i: int, k: str, n: int) -> None:
        v.segments[i] = k
        self.bytes_shared += n
        self.waiting_bytes = max(0, self.waiting_bytes - n)

    async def _read(self, v: Version, offset: int, buf: Part) -> int:
        """Read a segment; a device or checksum error is permanent for this version (S3Error DEVICE)."""
        try:
            return await read_part(self.store, v, offset, buf.view, self.read_from)
        except FsError as e:
            raise S3Error(DEVICE, f"reading inode {v.ino} (object {v.key}) from the devices for upload: {e}; "
                                  f"run ckptfs fsck; replication of this file resumes once it is "
                                  f"rewritten or removed") from None

    # ---- calls and their failures ------------------------------------------------------------
    async def _s3(self, fn, *args):
        """`await fn(*args)` (a call of the uploader process), at most `connections` at once; a transient
        failure is reported, then retried with backoff (forever); a permanent one is raised."""
        attempt = 0
        while True:
            try:
                async with self.s3_limiter:
                    result = await fn(*args)
            except S3Error as e:
                if not transient(e):
                    raise
                self._failed(e)
                await trio.sleep(backoff(attempt))
                attempt += 1
                continue
            if self.failing is not None and self.failing.cause != CONFLICT:
                log.info("replicate.recovered", extra={"fields": {"target": str(self.target)}})
                self.failing = self.failing_since = None
                self.progress.unpark_all()
            return result

    def _failed(self, e: S3Error) -> None:
        self.errors[e.cause] += 1
        self.last_error = {"cause": e.cause, "message": str(e), "time": time.time()}
        if self.failing is None or self.failing.cause != e.cause:  # once per failure, not per retry
            kind = "transient" if transient(e) else "permanent"
            retry = "with backoff" if transient(e) else (
                "never (another writer)" if e.cause == CONFLICT else f"the cycle in {PERMANENT_RETRY:g}s")
            log.error("replicate.failed", extra={"fields": {"cause": e.cause, "kind": kind, "error": str(e),
                                                            "retry": retry}})
            self.failing_since = time.time()
        self.failing = e
        self.progress.unpark_all()
