"""The mount daemon: assemble arena, core and FUSE adapter, serve until unmounted.

`serve(config)` runs in the foreground. It mounts (pyfuse3.init), tells the
waiting parent the mount is live through `ready_fd` ("OK" or one error line),
then runs the trio main loop until the filesystem is unmounted (fusermount3
-u, `ckptfs umount`) or SIGTERM/SIGINT arrives, which unmounts cleanly.
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
from .fuse_ops import Operations

log = logging.getLogger("ckptfs.daemon")


@dataclass
class MountConfig:
    mountpoint: str
    devices: list[str]
    memory: int
    chunk_size: int
    capacity: int
    ready_fd: int | None = None


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


def serve(cfg: MountConfig) -> int:
    try:
        arena = Arena(cfg.memory, cfg.chunk_size)
    except Exception as e:  # noqa: BLE001 - reported to the parent as one line
        _tell_parent(cfg.ready_fd, f"cannot allocate the memory arena: {e}")
        return 1
    fs = Filesystem(arena, capacity_bytes=cfg.capacity, uid=os.getuid(), gid=os.getgid())
    ops = Operations(fs, virtual_xattrs={b"user.ckptfs.pid": lambda ino: str(os.getpid()).encode()})
    try:
        pyfuse3.init(ops, cfg.mountpoint, _mount_options())
    except Exception as e:  # noqa: BLE001
        _tell_parent(cfg.ready_fd, f"cannot mount {cfg.mountpoint}: {e}")
        return 1
    log.info("mounted %s: memory %d bytes in %d chunks of %d, devices %s",
             cfg.mountpoint, arena.capacity, arena.nslots, arena.chunk_size, ",".join(cfg.devices))
    _tell_parent(cfg.ready_fd, "OK")
    stopped_by_signal = False

    async def main() -> None:
        nonlocal stopped_by_signal
        async with trio.open_nursery() as nursery:
            async def watch_signals() -> None:
                nonlocal stopped_by_signal
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        log.info("received %s: unmounting", signal.Signals(signum).name)
                        stopped_by_signal = True
                        pyfuse3.terminate()
                        return

            nursery.start_soon(watch_signals)
            await pyfuse3.main()
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        pyfuse3.close(unmount=stopped_by_signal)
    log.info("unmounted %s", cfg.mountpoint)
    return 0
