"""Run the whole filesystem (FUSE adapter, core, store) in-process on fake devices.

`Driver` builds ckptfs exactly as the daemon does (`daemon.assemble`), but over `FaultyDevice`s and
without a kernel mount: a trio loop runs in a background thread (the store's
drain and journal tasks run there), and tests call the `Operations` handlers
through `trio.from_thread.run`. `kill()` stops the loop where it is, like
SIGKILL; the devices' `crash()` then decides what a power cut would leave.

`PathOps` offers path-based helpers (write a whole file, read it, list the
tree) over the inode-based handlers.
"""
from __future__ import annotations

import errno
import os
import posixpath
import threading

import pyfuse3
import trio

from ckptfs.ops.control import ControlServer
from ckptfs.daemon import MountConfig, assemble
from ckptfs.fs.namespace import ROOT_INO
from ckptfs.store.store import DEFAULT_MAX_LAG

from faulty import FaultyDevice, make_faulty


class Ctx:
    uid = 0
    gid = 0
    pid = 0
    umask = 0o022


CTX = Ctx()


def make_devices(n: int, size: int = 8 << 20) -> list[FaultyDevice]:
    return make_faulty(n, size)


class Driver:
    def __init__(self, devices: list[FaultyDevice], *, memory: int = 1 << 20, chunk_size: int = 64 << 10,
                 journal_half: int = 256 << 10, fmt: bool = False, queue_depth: int = 2,
                 control: str | None = None, max_lag: float = DEFAULT_MAX_LAG, force_recover: bool = False,
                 dedupe: bool = False):
        self.devices = devices
        cfg = MountConfig(mountpoint="", devices=[d.path for d in devices], memory=memory,
                          chunk_size=chunk_size, format=fmt, journal_half=journal_half,
                          queue_depth=queue_depth, max_lag=max_lag, force_recover=force_recover, dedupe=dedupe)
        mount = assemble(cfg, devices)  # the daemon's own wiring
        self.fs, self.store, self.monitor = mount.fs, mount.store, mount.monitor
        self.ops = mount.operations()
        self.afs = mount.afs
        # a control server on the socket path `control`, as the daemon runs one
        self.control = ControlServer(control, self.store, self.monitor) if control else None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error:
            raise self._error

    def _run(self) -> None:
        async def main() -> None:
            self.token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            await self.store.compact()
            async with trio.open_nursery() as n:
                self.nursery = n
                await n.start(self.store.run)
                n.start_soon(self.monitor.run)
                if self.control is not None:
                    await n.start(self.control.serve)
                self._ready.set()
                await self._stop.wait()
                n.cancel_scope.cancel()
        try:
            trio.run(main)
        except BaseException as e:  # noqa: BLE001
            self._error = e
            self._ready.set()

    def call(self, afn, *args):
        return trio.from_thread.run(afn, *args, trio_token=self.token)

    def call_sync(self, fn, *args):
        """Run `fn` in the trio thread (where the store's state may be read consistently)."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)

    def unmount(self) -> None:
        """An orderly unmount: commit and drain everything, mark the journal clean, then stop."""
        self.call(self.store.drain_all)
        self.call(self.store.close_clean)
        self.kill()

    def kill(self) -> None:
        """Stop at once (SIGKILL): nothing more reaches the devices."""
        trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
        self._thread.join(30)


class PathOps:
    def __init__(self, driver: Driver):
        self.d = driver
        self.ops = driver.ops

    def _call(self, name, *args):
        return self.d.call(getattr(self.ops, name), *args)

    def ino(self, path: str) -> int:
        ino = ROOT_INO
        for part in [p for p in path.split("/") if p]:
            ino = self._call("lookup", ino, part.encode(), CTX).st_ino
        return ino

    def _parent(self, path: str) -> tuple[int, bytes]:
        head, tail = posixpath.split(path.rstrip("/"))
        return self.ino(head), tail.encode()

    def write_file(self, path: str, data: bytes, *, fsync: bool = False, piece: int = 10000) -> None:
        parent, name = self._parent(path)
        try:
            ino = self._call("lookup", parent, name, CTX).st_ino
            fh = self._call("open", ino, os.O_WRONLY | os.O_TRUNC, CTX).fh
            self._call("setattr", ino, _size_attr(0), _SizeFields(), fh, CTX)
        except pyfuse3.FUSEError as e:
            if e.errno != errno.ENOENT:
                raise
            fh = self._call("create", parent, name, 0o644, os.O_WRONLY | os.O_CREAT, CTX)[0].fh
        try:
            for off in range(0, len(data), piece):
                n = self._call("write", fh, off, data[off:off + piece])
                assert n == len(data[off:off + piece])
            if fsync:
                self._call("fsync", fh, False)
        finally:
            self._call("release", fh)

    def fsync(self, path: str) -> None:
        fh = self._call("open", self.ino(path), os.O_RDONLY, CTX).fh
        try:
            self._call("fsync", fh, False)
        finally:
            self._call("release", fh)

    def read_file(self, path: str) -> bytes:
        ino = self.ino(path)
        fh = self._call("open", ino, os.O_RDONLY, CTX).fh
        try:
            size = self._call("getattr", ino, CTX).st_size
            out = bytearray()
            while len(out) < size:
                chunk = bytes(self._call("read", fh, len(out), 50000))
                assert chunk, "short read"
                out += chunk
            return bytes(out)
        finally:
            self._call("release", fh)

    def mkdir(self, path: str) -> None:
        parent, name = self._parent(path)
        self._call("mkdir", parent, name, 0o755, CTX)

    def rmdir(self, path: str) -> None:
        parent, name = self._parent(path)
        self._call("rmdir", parent, name, CTX)

    def unlink(self, path: str) -> None:
        parent, name = self._parent(path)
        self._call("unlink", parent, name, CTX)

    def rename(self, src: str, dst: str) -> None:
        p1, n1 = self._parent(src)
        p2, n2 = self._parent(dst)
        self._call("rename", p1, n1, p2, n2, 0, CTX)

    def tree(self) -> dict[str, bytes | None]:
        """path -> file contents (None for directories), read through the handlers."""
        out: dict[str, bytes | None] = {}

        def walk(ino: int, prefix: str) -> None:
            for name, inode, _ in list(self.d.fs.readdir(ino, 2)):  # past "." and ".."
                path = prefix + "/" + name.decode()
                if inode.is_dir:
                    out[path] = None
                    walk(inode.ino, path)
                else:
                    out[path] = self.read_file(path)
        walk(ROOT_INO, "")
        return out


class _SizeFields:
    update_size = True
    update_mode = update_uid = update_gid = update_atime = update_mtime = update_ctime = False


def _size_attr(size: int) -> pyfuse3.EntryAttributes:
    a = pyfuse3.EntryAttributes()
    a.st_size = size
    return a
