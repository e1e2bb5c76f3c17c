"""The mount daemon: open the pool, recover, serve until unmounted, drain, exit.

`assemble(config)` builds a mount's parts (the in-process test driver uses it
too); `serve(config)` runs the daemon in the foreground:

1. open the devices and check they form one pool (or format them first with
   --format), replay the journal, and rebuild the namespace;
2. compact the journal into a fresh half on every device, so all mirrors agree;
3. mount through the chosen front end and tell the waiting parent through
   `ready_fd` ("OK" or one error line): the native engine (fuse/native.py,
   the default) or pyfuse3 (fuse/pyfuse3_engine.py, an optional extra); a
   native engine that cannot start (no /dev/fuse permission, a kernel it
   cannot speak to) is logged in one line and pyfuse3 serves instead where
   it is installed, else the mount fails with that line;
4. serve FUSE requests while the store drains in the background (and, with
   --restore-from or after an interrupted restore, while the restorer of
   replicate/restore.py fetches contents from the object store);
5. on unmount (fusermount3 -u, `ckptfs umount`: the session ends) or
   SIGTERM/SIGINT (lazy unmount first): commit every changed file, wait until
   everything is on the devices, write the clean anchor, exit 0.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

import trio

from .errors import UsageError
from .format.layout import DEFAULT_JOURNAL_HALF
from .fs.arena import Arena
from .fs.core import Filesystem
from .fs.facade import AsyncFilesystem, Backend
from .fs.namespace import ROOT_INO
from .fuse.native import NativeEngine
from .fuse import pyfuse3_engine
from .fuse.pyfuse3_engine import Pyfuse3Engine
from .ops.control import XATTR as CONTROL_XATTR, ControlServer, plain, socket_path
from .ops.monitor import Monitor
from .replicate import lineage, restore, retention, tree
from .replicate.client import S3Error, Target
from .replicate.manifest import BadManifest, parse_url
from .replicate.plan import Source
from .replicate.replicator import Replicator
from .replicate.restore import Restorer
from .replicate.tree import SourceError, load_manifest
from .replicate.priority import DEFAULT_PRIORITY
from .store.pool import format_pool, live_namespace, open_pool, recover, upgrade_superblocks
from .store.store import DEFAULT_MAX_LAG, DURABLE, Store

log = logging.getLogger("ckptfs.daemon")
REPLICATED = "replicated"  # user.ckptfs.state of a durable file named in a standing manifest
READAHEAD_KIB = 4096


def _log_fields(stats) -> dict:
    """The engine's statistics as one flat log line: requests per method, then the rest, the
    lock's counts as lock_*."""
    d = plain(stats)
    session, lock = d.pop("session"), d.pop("lock") or {}
    return {**session.pop("requests"), **session, **d, **{f"lock_{k}": v for k, v in lock.items()}}


@dataclass
class MountConfig:
    """Everything one mount was asked for (the CLI's options, or a test's); `assemble` rewrites the
    restore fields itself when it finds a restore that was interrupted."""
    mountpoint: str
    devices: list[str]
    memory: int
    chunk_size: int
    ready_fd: int | None = None
    format: bool = False
    queue_depth: int = 8
    fsync_absorb: bool = False
    drain_policy: str = "absorb-first"
    dedupe: bool = True  # share the extents of chunks the devices hold already (store/dedupe.py)
    max_lag: float = DEFAULT_MAX_LAG
    force_recover: bool = False  # accept a journal older than its anchors promise (pool.recover)
    journal_half: int = DEFAULT_JOURNAL_HALF
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    metrics_addr: str = "127.0.0.1"
    engine: str = "native"  # the FUSE front end: "native" (fuse/native.py) or "pyfuse3" (fuse/pyfuse3_engine.py)
    threads: int | None = None  # native engine: worker threads (None: the CPUs this process may use)
    restore_from: str | None = None  # s3://BUCKET/PREFIX: build the newest manifest's tree (fresh pool)
    restore_generation: int | None = None  # the manifest to restore (None: the newest)
    s3_endpoint: str | None = None  # the object store's URL (None: AWS)
    restore_rate: float | None = None  # background restore bytes/s (None: no cap)
    restore_concurrency: int = 8  # background ranged GETs in flight
    replicate: str | None = None  # s3://BUCKET/PREFIX to replicate the durable state to (replicate/)
    replicate_rate: int | None = None  # bytes/s cap of the uploads (None: no cap)
    replicate_policy: retention.Policy = retention.DEFAULT  # which manifests the object store keeps
    replicate_memory: int = 256 << 20  # bytes of part buffers in flight
    replicate_priority: str = DEFAULT_PRIORITY  # CPU priority of the uploader process (replicate/uploader.py)
    replicate_finish: float = 30.0  # seconds an unmount waits for the last state to be replicated
    replicate_takeover: bool = False  # may replicate to a prefix another pool wrote (replicate/lineage.py)


def _wall_clock():
    """time.time; or, for tests of the retention policy over a simulated day (no sleeps), the time
    written in the file CKPTFS_CLOCK_FILE names."""
    path = os.environ.get("CKPTFS_CLOCK_FILE")
    if not path:
        return time.time

    def clock() -> float:
        with open(path) as f:
            return float(f.read())
    return clock


def _tell_parent(fd: int | None, line: str) -> None:
    if fd is None:
        return
    try:
        os.write(fd, line.encode() + b"\n")
        os.close(fd)
    except OSError:
        pass


def _tune_readahead(mountpoint: str, kib: int = READAHEAD_KIB) -> None:
    """Raise the kernel's read-ahead for this mount (128 KiB by default for FUSE) so sequential
    readers (torch.load) get large requests. Root only; any failure just keeps the default."""
    try:
        with open("/proc/self/mountinfo") as f:
            dev = next(line.split()[2] for line in f if line.split()[4] == mountpoint)
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as f:
            f.write(str(kib))
    except (OSError, StopIteration):
        log.debug("could not raise read-ahead for %s", mountpoint)


async def _tune_readahead_when_live(mountpoint: str) -> None:
    # the kernel sets read-ahead while it handles FUSE_INIT: a stat returns after that
    await trio.to_thread.run_sync(os.stat, mountpoint)
    _tune_readahead(mountpoint)


@dataclass
class Mount:
    """A mount's parts, wired: the core over the durable store, the monitor, the async facade."""
    fs: Filesystem
    store: Store
    monitor: Monitor
    afs: AsyncFilesystem
    restorer: Restorer | None = None  # a restore from an object store in progress (replicate/restore.py)
    replicator: Replicator | None = None  # --replicate (replicate/replicator.py)

    def operations(self):
        """The pyfuse3 front end's operations over the facade (needs the pyfuse3 extra)."""
        return pyfuse3_engine.operations(self.afs)


def assemble(cfg: MountConfig, devices: list | None = None, extra_xattrs: dict | None = None) -> Mount:
    """Open (formatting if asked) and recover the pool; build the parts of a mount, ready to serve.

    `devices` may hold device objects instead of paths (tests pass fault-injecting ones);
    `extra_xattrs` adds virtual xattrs (name -> callback(ino) -> bytes | None).
    """
    devices = devices or cfg.devices
    if cfg.format:
        format_pool(devices, chunk_size=cfg.chunk_size, journal_half=cfg.journal_half)
    pool, rec = _open_and_recover(cfg, devices)
    source = tree.interrupted_build(rec.durable.ns)
    if source is not None:
        # a crash while a restore built its tree: by the prefix rule nothing else was committed
        log.warning("restore.restarted", extra={"fields": {"source": source.url, "generation": source.generation,
                                                            "reason": "the tree was not completely built"}})
        sb = pool.sbs[0]
        pool.close()
        format_pool(devices, chunk_size=sb.chunk_size, journal_half=sb.journal_half, force=True)
        cfg.restore_from, cfg.restore_generation = source.url, source.generation
        cfg.s3_endpoint = cfg.s3_endpoint or source.endpoint
        pool, rec = _open_and_recover(cfg, devices)
    for w in rec.warnings:
        log.warning("%s", w)
    _log_recovery(rec)
    arena = Arena(cfg.memory, pool.sbs[0].chunk_size)
    store = Store(arena, pool.devices, pool.sbs, rec.durable, half=rec.half, tail=rec.tail,
                  seq=rec.seq, queue_depth=cfg.queue_depth, fsync_absorb=cfg.fsync_absorb,
                  drain_policy=cfg.drain_policy, dedupe=cfg.dedupe, max_lag=cfg.max_lag, anchor_gen=rec.anchor_gen,
                  recovery=rec.report())
    ns = live_namespace(rec.records, rec.durable.alloc, store)
    fs = Filesystem(arena, capacity_bytes=store.capacity_bytes(), owner=store, durability=store, ns=ns)
    store.attach(fs.ns)
    monitor = Monitor(store)
    store.on_commit.append(monitor.on_commit)
    replicator = None
    if cfg.replicate:
        replicator = Replicator(store, parse_url(cfg.replicate), cfg.s3_endpoint, rate=cfg.replicate_rate,
                                policy=cfg.replicate_policy, memory=cfg.replicate_memory,
                                priority=cfg.replicate_priority, takeover=cfg.replicate_takeover,
                                clock=_wall_clock())
        store.on_commit.append(replicator.notify)

    def state(ino: int) -> bytes | None:
        inode = fs.ns.inodes.get(ino)
        if inode is None or not (inode.is_reg or inode.is_dir):
            return None  # the kernel keeps user.* xattrs to files and folders
        st = store.state(ino)
        if st == DURABLE and replicator is not None and replicator.replicated(ino):
            st = REPLICATED
        return st.encode()

    def shared(ino: int) -> bytes | None:
        inode = fs.ns.inodes.get(ino)
        return str(store.durable.shared(ino)).encode() if inode is not None and inode.is_reg else None

    def store_shared(ino: int) -> bytes | None:
        inode = fs.ns.inodes.get(ino)
        got = replicator.store_shared(ino) if inode is not None and inode.is_reg else None
        return None if got is None else str(got).encode()

    xattrs = {b"user.ckptfs.pid": lambda ino: str(os.getpid()).encode() if ino == ROOT_INO else None,
              b"user.ckptfs.state": state, b"user.ckptfs.shared": shared, **(extra_xattrs or {})}
    if replicator is not None:
        xattrs[b"user.ckptfs.store_shared"] = store_shared
    try:
        restorer = _restorer(cfg, fs, store)
        if replicator is not None:
            if restorer is not None and restorer.pending is not None:  # its tree (and lineage) comes at mount
                replicator.ancestors = frozenset({restorer.pending.pool})
            _check_prefix(cfg, replicator)
    except BaseException:
        store.close()
        raise
    backend = Backend(fetch=store.fetch, let_go=store.let_go, room=monitor.room, sync=store.sync,
                      absorbed=store.absorbed, virtual_xattrs=xattrs)
    if restorer is not None:
        backend.restore = restorer.demand
    return Mount(fs, store, monitor, AsyncFilesystem(fs, backend), restorer, replicator)


def _open_and_recover(cfg: MountConfig, devices: list):
    pool = open_pool(devices)
    try:
        return pool, recover(pool, force=cfg.force_recover)
    except BaseException:
        pool.close()
        raise


def _restorer(cfg: MountConfig, fs: Filesystem, store: Store) -> Restorer | None:
    """A fresh restore (--restore-from: the manifest is loaded now, its tree built once serving
    starts), or the continuation of one that a crash or unmount interrupted."""
    kw = {"concurrency": cfg.restore_concurrency, "rate": cfg.restore_rate}
    if cfg.restore_from is None:
        return restore.resume(fs, store, cfg.s3_endpoint, **kw)
    try:
        url = parse_url(cfg.restore_from)
        manifest = load_manifest(Target(url, cfg.s3_endpoint, attempts=2), cfg.restore_generation)
        source = Source(cfg.restore_from, cfg.s3_endpoint, manifest.generation)
        return restore.fresh(fs, store, manifest, source, **kw)
    except (ValueError, SourceError) as e:
        raise UsageError(f"cannot restore from {cfg.restore_from}: {e}", 2) from None


def _check_prefix(cfg: MountConfig, replicator: Replicator) -> None:
    """Refuse (one line) to replicate to a prefix whose newest manifest another pool wrote
    (replicate/lineage.py). A store that cannot be asked now is no refusal: the replicator asks
    again when it starts, and stops there if it must."""
    target = Target(parse_url(cfg.replicate), cfg.s3_endpoint, attempts=1, connect_timeout=3)
    try:
        newest = target.newest()
    except (S3Error, BadManifest) as e:
        log.warning("replicate.prefix_unchecked", extra={"fields": {"target": str(target), "error": str(e)}})
        return
    why = lineage.refusal(newest, replicator.pool, replicator.lineage(), cfg.replicate_takeover, str(target.url))
    if why is not None:
        raise UsageError(f"cannot replicate: {why}", 2)
    if newest is not None and newest.pool != replicator.pool:
        log.info("replicate.continues", extra={"fields": {"target": str(target), "pool": newest.pool,
                                                          "generation": newest.generation,
                                                          "takeover": cfg.replicate_takeover}})


def _log_recovery(rec) -> None:
    """An unclean shutdown (or a forced roll-back) is recovered loudly: to what, and what was dropped."""
    if rec.rollback:
        log.warning("recovery.rolled_back", extra={"fields": {"reason": rec.rollback}})
    if rec.clean:
        return
    when = (time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(rec.time_ns / 1e9)) + "Z"
            if rec.time_ns else "unknown")
    log.warning("recovered.unclean_shutdown", extra={"fields": {
        "journal_seq": rec.seq, "epoch": rec.durable.epoch, "state_time": when,
        "discarded": "; ".join(rec.discarded) or "nothing"}})


def _start_metrics(cfg: MountConfig):
    from .ops.metrics import MetricsServer

    server = MetricsServer(cfg.metrics_addr, cfg.metrics_port)
    try:
        server.start()
    except OSError as e:
        raise UsageError(f"cannot serve metrics on {cfg.metrics_addr}:{cfg.metrics_port}: {e.strerror or e}", 1) \
            from None
    log.info("metrics.listening", extra={"fields": {"url": server.url}})
    return server


def serve(cfg: MountConfig) -> int:
    """Run the daemon in the foreground until unmounted; the exit status."""
    path = socket_path(cfg.mountpoint)
    try:
        mount = assemble(cfg, extra_xattrs={
            CONTROL_XATTR.encode(): lambda ino: path.encode() if ino == ROOT_INO else None})
    except UsageError as e:
        _tell_parent(cfg.ready_fd, str(e))
        raise
    except Exception as e:  # noqa: BLE001 - reported to the parent as one line
        log.exception("cannot start")
        _tell_parent(cfg.ready_fd, f"cannot start: {e}")
        return 1
    sections = {"restore": mount.restorer.statistics} if mount.restorer is not None else {}
    control = ControlServer(path, mount.store, mount.monitor,
                            info={"mountpoint": cfg.mountpoint, "devices": list(cfg.devices), "metrics_url": None,
                                  "engine": None}, sections=sections, replicator=mount.replicator)
    metrics = None
    if cfg.metrics_port is not None:
        try:
            metrics = _start_metrics(cfg)
        except UsageError as e:
            log.error("metrics.failed", extra={"fields": {"error": str(e)}})
            _tell_parent(cfg.ready_fd, str(e))
            mount.store.close()
            return 1
        control.info["metrics_url"] = metrics.url
    daemon = _Daemon(cfg, mount, control, metrics)
    try:
        trio.run(daemon.main)
    except Exception as e:
        if not daemon.mounted:
            log.exception("cannot mount")
            _tell_parent(cfg.ready_fd, f"cannot mount {cfg.mountpoint}: {e}")
            return 1
        raise
    finally:
        if daemon.mounted:
            daemon.close_front_end()
        control.close()
        if metrics is not None:
            metrics.stop()
        mount.store.close()
    log.info("unmounted", extra={"fields": {"mountpoint": cfg.mountpoint, "durable": True,
                                            "bytes_drained": mount.store.bytes_drained}})
    return 0


class _Daemon:
    """The daemon's life in the trio loop: prepare, mount, serve with the store's tasks, drain."""

    def __init__(self, cfg: MountConfig, mount: Mount, control: ControlServer, metrics):
        self.cfg = cfg
        self.mount = mount
        self.control = control
        self.metrics = metrics
        self.mounted = False
        self.stopped_by_signal = False  # unmount ourselves at close (fusermount3 -u failed)
        self.native: NativeEngine | None = None  # the native front end, when it serves
        self.pyfuse3: Pyfuse3Engine | None = None  # else this one

    async def main(self) -> None:
        cfg, store, monitor = self.cfg, self.mount.store, self.mount.monitor
        await store.compact()  # all mirrors agree again; also writes a fresh (not clean) anchor
        if upgrade_superblocks(store.devices, store.sbs):
            log.info("format.upgraded", extra={"fields": {"from_version": store.sbs[0].version}})
        await self.control.bind()
        if self.metrics is not None:
            from .ops.metrics import read_metrics
            token = trio.lowlevel.current_trio_token()
            sections, replicator = self.control.sections, self.mount.replicator
            self.metrics.read = lambda: trio.from_thread.run_sync(read_metrics, store, monitor, 2.0, sections,
                                                                  replicator, trio_token=token)
        restorer = self.mount.restorer
        if restorer is not None:
            restorer.prepare()  # a fresh restore's tree, before anyone can look
        if cfg.engine == "native":
            self.native = await self._start_native()
        if self.native is None:
            self.pyfuse3 = Pyfuse3Engine(self.mount.afs, cfg.mountpoint)
            self.pyfuse3.start()
        self.mounted = True
        self.control.info["engine"] = "pyfuse3" if self.native is None else "native"
        self.control.info["threads"] = 1 if self.native is None else self.native.session.threads
        self.control.info["reads"] = "direct" if self.mount.fs.direct_reads else "page cache"
        if self.native is not None:
            self.control.sections["engine_stats"] = self.native.statistics  # adopted/copied chunks, requests
        arena = self.mount.fs.arena
        log.info("mounted", extra={"fields": {
            "mountpoint": cfg.mountpoint, "memory": arena.capacity, "chunks": arena.nslots,
            "chunk_size": arena.chunk_size, "devices": ",".join(cfg.devices), "control": self.control.path,
            "metrics": self.control.info["metrics_url"], "engine": self.control.info["engine"]}})
        _tell_parent(cfg.ready_fd, "OK")
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            if restorer is not None:
                await nursery.start(restorer.run)
            nursery.start_soon(_tune_readahead_when_live, cfg.mountpoint)
            nursery.start_soon(monitor.run)
            if self.mount.replicator is not None:
                await nursery.start(self.mount.replicator.run)
            await nursery.start(self.control.serve)
            nursery.start_soon(self._watch_signals)
            if self.native is not None:
                await trio.to_thread.run_sync(self.native.wait, abandon_on_cancel=True)
                store.loop.uninstall()  # no worker thread is left to share the core with
                log.info("engine.statistics", extra={"fields": _log_fields(self.native.statistics())})
            else:
                await self.pyfuse3.serve()
            if restorer is not None:
                restorer.stop()  # what it fetched is committed by the drain below; a remount goes on
            stats = store.statistics()
            log.info("unmounting", extra={"fields": {"pending_records": stats.records_pending,
                                                     "bytes_to_drain": store.undrained_bytes()}})
            with trio.CancelScope(shield=True):
                await store.drain_all()
                await store.close_clean()
            await self._finish_replication()
            nursery.cancel_scope.cancel()

    async def _finish_replication(self) -> None:
        """Give replication a bounded chance to carry the final state before the daemon exits."""
        replicator = self.mount.replicator
        if replicator is None:
            return
        done = await replicator.finish(self.cfg.replicate_finish)
        st = replicator.statistics()
        log.info("replicate.stopped", extra={"fields": {
            "replicated": done, "generation": st.generation, "bytes_uploaded": st.bytes_uploaded,
            "failing": (st.failing or {}).get("message")}})

    async def _watch_signals(self) -> None:
        """SIGTERM/SIGINT: unmount (lazily) so the engine stops serving and the drain runs."""
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal", extra={"fields": {"signal": signal.Signals(signum).name,
                                                     "action": "unmount and drain"}})
                res = await trio.run_process(["fusermount3", "-u", "-z", self.cfg.mountpoint],
                                             check=False, capture_stderr=True)
                if res.returncode != 0:
                    self.stopped_by_signal = True
                    if self.native is not None:
                        try:
                            self.native.unmount()
                        except OSError as e:
                            log.error("unmount.failed", extra={"fields": {"error": str(e)}})
                    else:
                        self.pyfuse3.terminate()
                return

    async def _start_native(self) -> NativeEngine | None:
        """Mount through the native engine; None (and one log line) if it cannot start here and
        pyfuse3 can serve instead; without pyfuse3 the error stands."""
        loop = self.mount.store.loop
        loop.install()  # from now on the workers may take the trio thread's lock (fuse/native.py)
        engine = NativeEngine(self.mount.afs, self.cfg.mountpoint, trio.lowlevel.current_trio_token(),
                              threads=self.cfg.threads, loop=loop)
        try:
            await trio.to_thread.run_sync(engine.start)
        except Exception as e:  # noqa: BLE001 - any failure to start falls back to pyfuse3
            loop.uninstall()
            if not pyfuse3_engine.available():
                raise UsageError(f"the native FUSE engine cannot start ({type(e).__name__}: {e}) and the "
                                 "pyfuse3 fallback is not installed (pip install 'ckptfs[pyfuse3]')") from e
            log.warning("engine.fallback", extra={"fields": {
                "engine": "native", "error": f"{type(e).__name__}: {e}", "using": "pyfuse3"}})
            return None
        return engine

    def close_front_end(self) -> None:
        """After serving: release the FUSE session (unmounting if it is still mounted)."""
        if self.native is not None:
            self.native.close()
        elif self.pyfuse3 is not None:
            self.pyfuse3.close(unmount=self.stopped_by_signal)
