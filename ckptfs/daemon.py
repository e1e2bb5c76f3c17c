"""The mount daemon: open the pool, recover, serve until unmounted, drain, exit.

`serve(config)` runs in the foreground:

1. open the devices and check they form one pool (or format them first with
   --format), replay the journal, and rebuild the namespace;
2. compact the journal into a fresh half on every device, so all mirrors agree;
3. mount (pyfuse3.init) and tell the waiting parent through `ready_fd`
   ("OK" or one error line);
4. serve FUSE requests while the store drains in the background;
5. on unmount (fusermount3 -u, `ckptfs umount`) or SIGTERM/SIGINT: commit
   every changed file, wait until everything is on the devices, exit 0.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

import pyfuse3
import trio

from .arena import Arena
from .control import XATTR as CONTROL_XATTR, ControlServer, socket_path
from .core import Filesystem
from .errors import UsageError
from .fuse_ops import Operations
from .layout import DEFAULT_JOURNAL_HALF
from .monitor import Monitor
from .namespace import ROOT_INO
from .pool import format_pool, live_namespace, open_pool, recover, upgrade_superblocks
from .store import DEFAULT_MAX_LAG, Store

log = logging.getLogger("ckptfs.daemon")
READAHEAD_KIB = 4096


@dataclass
class MountConfig:
    mountpoint: str
    devices: list[str]
    memory: int
    chunk_size: int
    capacity: int
    ready_fd: int | None = None
    format: bool = False
    queue_depth: int = 8
    fsync_absorb: bool = False
    drain_policy: str = "absorb-first"
    max_lag: float = DEFAULT_MAX_LAG
    force_recover: bool = False  # accept a journal older than its anchors promise (pool.recover)
    journal_half: int = DEFAULT_JOURNAL_HALF
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    metrics_addr: str = "127.0.0.1"


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


def _mount_options() -> set[str]:
    opts = set(pyfuse3.default_options)
    opts |= {"fsname=ckptfs", "subtype=ckptfs"}
    if os.getuid() == 0:
        opts.add("allow_other")
    return opts


def build(cfg: MountConfig, devices: list | None = None) -> tuple[Filesystem, Store]:
    """Open (formatting if asked) and recover the pool; the core and store, ready to serve.

    `devices` may hold device objects instead of paths (tests pass fault-injecting ones).
    """
    devices = devices or cfg.devices
    if cfg.format:
        format_pool(devices, chunk_size=cfg.chunk_size, journal_half=cfg.journal_half)
    pool = open_pool(devices)
    try:
        rec = recover(pool, force=cfg.force_recover)
    except BaseException:
        pool.close()
        raise
    for w in rec.warnings:
        log.warning("%s", w)
    _log_recovery(rec)
    arena = Arena(cfg.memory, pool.sbs[0].chunk_size)
    store = Store(arena, pool.devices, pool.sbs, rec.durable, half=rec.half, tail=rec.tail,
                  seq=rec.seq, queue_depth=cfg.queue_depth, fsync_absorb=cfg.fsync_absorb,
                  drain_policy=cfg.drain_policy, max_lag=cfg.max_lag, anchor_gen=rec.anchor_gen,
                  recovery=rec.report())
    ns = live_namespace(rec.records, rec.durable.alloc, store)
    fs = Filesystem(arena, capacity_bytes=store.capacity_bytes(), owner=store, durability=store, ns=ns)
    store.attach(fs.ns)
    return fs, store


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


def operations(fs: Filesystem, store: Store, monitor: Monitor,
               extra_xattrs: dict | None = None) -> Operations:
    """The FUSE adapter over the store, with its hooks: backpressure (counted by the monitor),
    fetches, fsync, the absorbed-bytes counter and the virtual xattrs."""
    async def room(_fs, _fh, devices_full=False) -> bool:
        return await monitor.room(devices_full)

    def absorbed(n: int) -> None:
        store.bytes_absorbed += n

    def state(ino: int) -> bytes | None:
        inode = fs.ns.inodes.get(ino)
        if inode is None or not (inode.is_reg or inode.is_dir):
            return None  # the kernel keeps user.* xattrs to files and folders
        return store.state(ino).encode()

    xattrs = {b"user.ckptfs.pid": lambda ino: str(os.getpid()).encode() if ino == ROOT_INO else None,
              b"user.ckptfs.state": state, **(extra_xattrs or {})}
    return Operations(fs, wait_for_room=room, fetch=store.fetch, on_fsync=store.sync,
                      virtual_xattrs=xattrs, on_write=absorbed)


def _start_metrics(cfg: MountConfig):
    from .metrics import MetricsServer

    server = MetricsServer(cfg.metrics_addr, cfg.metrics_port)
    try:
        server.start()
    except OSError as e:
        raise UsageError(f"cannot serve metrics on {cfg.metrics_addr}:{cfg.metrics_port}: {e.strerror or e}", 1) \
            from None
    log.info("metrics.listening", extra={"fields": {"url": server.url}})
    return server


def serve(cfg: MountConfig) -> int:
    try:
        fs, store = build(cfg)
    except UsageError as e:
        _tell_parent(cfg.ready_fd, str(e))
        raise
    except Exception as e:  # noqa: BLE001 - reported to the parent as one line
        log.exception("cannot start")
        _tell_parent(cfg.ready_fd, f"cannot start: {e}")
        return 1

    monitor = Monitor(store)
    store.on_commit.append(monitor.on_commit)
    control = ControlServer(socket_path(cfg.mountpoint), store, monitor,
                            info={"mountpoint": cfg.mountpoint, "devices": list(cfg.devices), "metrics_url": None})
    ops = operations(fs, store, monitor, {
        CONTROL_XATTR.encode(): lambda ino: control.path.encode() if ino == ROOT_INO else None})
    metrics = None
    if cfg.metrics_port is not None:
        try:
            metrics = _start_metrics(cfg)
        except UsageError as e:
            log.error("metrics.failed", extra={"fields": {"error": str(e)}})
            _tell_parent(cfg.ready_fd, str(e))
            store.close()
            return 1
        control.info["metrics_url"] = metrics.url
    stopped_by_signal = False
    mounted = False

    async def main() -> None:
        nonlocal mounted
        await store.compact()  # also writes a fresh (not clean) journal anchor
        if upgrade_superblocks(store.devices, store.sbs):
            log.info("format.upgraded", extra={"fields": {"from_version": store.sb.version}})
        await control.bind()
        if metrics is not None:
            from .metrics import read_metrics
            token = trio.lowlevel.current_trio_token()
            metrics.read = lambda: trio.from_thread.run_sync(read_metrics, store, monitor, trio_token=token)
        pyfuse3.init(ops, cfg.mountpoint, _mount_options())
        mounted = True
        log.info("mounted", extra={"fields": {
            "mountpoint": cfg.mountpoint, "memory": fs.arena.capacity, "chunks": fs.arena.nslots,
            "chunk_size": fs.arena.chunk_size, "devices": ",".join(cfg.devices), "control": control.path,
            "metrics": control.info["metrics_url"]}})
        _tell_parent(cfg.ready_fd, "OK")
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            nursery.start_soon(_tune_readahead_when_live, cfg.mountpoint)
            nursery.start_soon(monitor.run)
            await nursery.start(control.serve)

            async def watch_signals() -> None:
                nonlocal stopped_by_signal
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        log.info("signal", extra={"fields": {"signal": signal.Signals(signum).name,
                                                             "action": "unmount and drain"}})
                        res = await trio.run_process(["fusermount3", "-u", "-z", cfg.mountpoint],
                                                     check=False, capture_stderr=True)
                        if res.returncode != 0:
                            stopped_by_signal = True
                            pyfuse3.terminate()
                        return

            nursery.start_soon(watch_signals)
            await pyfuse3.main()
            log.info("unmounting", extra={"fields": {"pending_records": len(store.pending),
                                                     "bytes_to_drain": store.undrained_bytes()}})
            with trio.CancelScope(shield=True):
                await store.drain_all()
                await store.committer.write_anchor(clean=True)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    except Exception as e:
        if not mounted:
            log.exception("cannot mount")
            _tell_parent(cfg.ready_fd, f"cannot mount {cfg.mountpoint}: {e}")
            return 1
        raise
    finally:
        if mounted:
            pyfuse3.close(unmount=stopped_by_signal)
        control.close()
        if metrics is not None:
            metrics.stop()
        store.close()
    log.info("unmounted", extra={"fields": {"mountpoint": cfg.mountpoint, "durable": True,
                                            "bytes_drained": store.bytes_drained}})
    return 0
