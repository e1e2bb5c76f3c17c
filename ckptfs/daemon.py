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
from dataclasses import dataclass

import pyfuse3
import trio

from .arena import Arena
from .core import Filesystem
from .errors import UsageError
from .fuse_ops import Operations
from .layout import DEFAULT_JOURNAL_HALF
from .pool import format_pool, live_namespace, open_pool, recover
from .store import Store

log = logging.getLogger("ckptfs.daemon")


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
    journal_half: int = DEFAULT_JOURNAL_HALF


def _tell_parent(fd: int | None, line: str) -> None:
    if fd is None:
        return
    try:
        os.write(fd, line.encode() + b"\n")
        os.close(fd)
    except OSError:
        pass


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
        rec = recover(pool)
    except BaseException:
        pool.close()
        raise
    for w in rec.warnings:
        log.warning("%s", w)
    arena = Arena(cfg.memory, pool.sbs[0].chunk_size)
    store = Store(arena, pool.devices, pool.sbs, rec.durable, half=rec.half, tail=rec.tail,
                  seq=rec.seq, queue_depth=cfg.queue_depth, fsync_absorb=cfg.fsync_absorb,
                  drain_policy=cfg.drain_policy)
    ns = live_namespace(rec.records, rec.durable.alloc, store)
    fs = Filesystem(arena, capacity_bytes=store.capacity_bytes(), owner=store, durability=store, ns=ns)
    store.attach(fs.ns)
    return fs, store


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

    async def room(_fs, _fh, devices_full=False) -> bool:
        return await store.wait_for_room(devices_full)

    ops = Operations(fs, wait_for_room=room, fetch=store.fetch, on_fsync=store.sync,
                     virtual_xattrs={b"user.ckptfs.pid": lambda ino: str(os.getpid()).encode(),
                                     b"user.ckptfs.state": lambda ino: store.state(ino).encode()})
    stopped_by_signal = False
    mounted = False

    async def main() -> None:
        nonlocal stopped_by_signal, mounted
        await store.compact()
        pyfuse3.init(ops, cfg.mountpoint, _mount_options())
        mounted = True
        log.info("mounted %s: memory %d bytes in %d chunks of %d, devices %s",
                 cfg.mountpoint, fs.arena.capacity, fs.arena.nslots, fs.arena.chunk_size,
                 ",".join(cfg.devices))
        _tell_parent(cfg.ready_fd, "OK")
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)

            async def watch_signals() -> None:
                nonlocal stopped_by_signal
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        log.info("received %s: unmounting and draining", signal.Signals(signum).name)
                        res = await trio.run_process(["fusermount3", "-u", "-z", cfg.mountpoint],
                                                     check=False, capture_stderr=True)
                        if res.returncode != 0:
                            stopped_by_signal = True
                            pyfuse3.terminate()
                        return

            nursery.start_soon(watch_signals)
            await pyfuse3.main()
            log.info("unmounting: draining %d pending commits", len(store.pending))
            with trio.CancelScope(shield=True):
                await store.drain_all()
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
        store.close()
    log.info("unmounted %s: everything is on the devices", cfg.mountpoint)
    return 0
