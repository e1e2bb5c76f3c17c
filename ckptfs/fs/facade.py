"""The async file-system facade: what any FUSE front end calls, one method per request.

`core.Filesystem` never blocks: a read or write of data that is only on a
device raises `NeedsFetch`, a write that finds memory full raises `NoSpace`.
This facade holds the protocol around that, so that a front end (pyfuse3
today, a native engine later) is a thin 1:1 translation of requests:

- NeedsFetch: load the chunks (`Backend.fetch`), then retry; its kind
  NeedsRestore (a file still being restored from an object store):
  `Backend.restore` fetches those chunks with priority, then retry;
- NoSpace: wait for room (`Backend.room`: backpressure while the drain frees
  memory), then retry; False means room will never come (ENOSPC, or the
  bytes written so far);
- fsync, fsyncdir and syncfs (`sync`): `Backend.sync`;
- the absorbed-bytes counter (`Backend.absorbed`);
- lookup counts of READDIRPLUS entries (`entry_sent`);
- who is asking: open, create and a size change take the caller
  (`creds.Caller`), which decides whether writes clear set-user-ID bits;
- virtual extended attributes under ``user.ckptfs.`` (answered by callbacks,
  never stored: EPERM to set or remove, not listed where the callback says
  None).

Errors leave as `FsError` (errors.py decides every errno); the front end
converts them. `Backend` is a plain object of callables so that tests and a
memory-only mount can supply their own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterator

from ..errors import DevicesFull, NoAttribute, NoSpace, NotInMemory, ReadOnlyAttribute
from .core import Filesystem, FsStat, OpenResult
from .creds import Caller
from .filemap import NeedsFetch
from .namespace import Inode
from .remote import NeedsRestore

VIRTUAL_PREFIX = b"user.ckptfs."


async def _no_fetch(chunks) -> None:
    raise NotInMemory("data is not in memory and there is no device store")


async def _no_restore(need) -> None:
    raise NotInMemory("data is still to be restored and there is no restorer")


async def _no_room(devices_full: bool = False) -> bool:
    return False


@dataclass
class Backend:
    """What the facade asks of the store (defaults: a memory-only mount)."""
    fetch: Callable[[list], Awaitable[None]] = _no_fetch
    restore: Callable[[NeedsRestore], Awaitable[None]] = _no_restore  # chunks not restored yet
    room: Callable[[bool], Awaitable[bool]] = _no_room  # wait for memory; False: it will not come
    sync: Callable[[int | None], Awaitable[None]] | None = None  # fsync(ino) / syncfs (None)
    absorbed: Callable[[int], None] = lambda n: None  # hears the byte count of every write
    virtual_xattrs: dict[bytes, Callable[[int], bytes | None]] = field(default_factory=dict)


class AsyncFilesystem:
    def __init__(self, fs: Filesystem, backend: Backend | None = None):
        self.fs = fs
        self.backend = backend or Backend()

    async def _fetching(self, fn, *args, **kw):
        """fn(*args) retried after loading what it needs from the devices."""
        while True:
            try:
                return fn(*args, **kw)
            except NeedsRestore as e:
                await self.backend.restore(e)
            except NeedsFetch as e:
                await self.backend.fetch(e.chunks)

    def blocks(self, inode: Inode) -> int:
        """st_blocks: the 512-byte blocks the file holds."""
        return self.fs.blocks(inode)

    # ---- names -----------------------------------------------------------
    async def lookup(self, parent: int, name: bytes) -> Inode:
        return self.fs.lookup(parent, name)

    async def getattr(self, ino: int) -> Inode:
        return self.fs.getattr(ino)

    async def setattr(self, ino: int, caller: Caller | None = None, **kw) -> Inode:
        return await self._fetching(self.fs.setattr, ino, caller=caller, **kw)

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> Inode:
        return self.fs.mknod(parent, name, mode, rdev, uid, gid)

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        return self.fs.mkdir(parent, name, mode, uid, gid)

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        return self.fs.symlink(parent, name, target, uid, gid)

    async def readlink(self, ino: int) -> bytes:
        return self.fs.readlink(ino)

    async def link(self, ino: int, parent: int, name: bytes) -> Inode:
        return self.fs.link(ino, parent, name)

    async def unlink(self, parent: int, name: bytes) -> None:
        self.fs.unlink(parent, name)

    async def rmdir(self, parent: int, name: bytes) -> None:
        self.fs.rmdir(parent, name)

    async def rename(self, p_old: int, n_old: bytes, p_new: int, n_new: bytes, flags: int = 0) -> None:
        self.fs.rename(p_old, n_old, p_new, n_new, flags)

    def forget(self, ino: int, n: int) -> None:
        self.fs.forget(ino, n)

    # ---- directories -----------------------------------------------------
    async def opendir(self, ino: int) -> int:
        return self.fs.opendir(ino)

    def readdir(self, fh: int, after: int) -> Iterator[tuple[bytes, Inode, int]]:
        """(name, inode, cookie) after `after`; call `entry_sent` for each one the reply holds."""
        return self.fs.readdir(fh, after)

    @staticmethod
    def entry_sent(inode: Inode, cookie: int) -> None:
        """An entry went to the kernel with its attributes: the kernel now holds a lookup of it
        ("." and ".." do not count)."""
        if cookie > 2:
            inode.lookups += 1

    async def fsyncdir(self) -> None:
        await self.sync(None)

    async def sync(self, ino: int | None = None) -> None:
        """Wait until file `ino` (None: everything, as syncfs) and all before it are durable."""
        if self.backend.sync is not None:
            await self.backend.sync(ino)

    # ---- files -----------------------------------------------------------
    async def open(self, ino: int, flags: int, caller: Caller | None = None) -> OpenResult:
        return self.fs.open(ino, flags, caller)

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int,
                     caller: Caller | None = None) -> tuple[OpenResult, Inode]:
        return self.fs.create(parent, name, mode, flags, uid, gid, caller)

    async def read(self, fh: int, off: int, size: int):
        return await self._fetching(self.fs.read, fh, off, size)

    async def write(self, fh: int, off: int, buf, kill_setid: bool | None = None) -> int:
        """All of `buf` at `off`, waiting for memory as needed; short only if room never comes.

        `kill_setid`: what the kernel said of the writer (True: it lacks CAP_FSETID, so the write
        clears set-user-ID bits; False: it holds it); None: the opener decides (core.write)."""
        done = 0
        view = memoryview(buf)
        try:
            while True:
                try:
                    done += self.fs.write(fh, off + done, view[done:], kill_setid)
                    if done == len(view):
                        return done
                except NeedsRestore as e:
                    await self.backend.restore(e)
                except NeedsFetch as e:
                    await self.backend.fetch(e.chunks)
                except NoSpace as e:
                    if not await self.backend.room(isinstance(e, DevicesFull)):
                        if done:
                            return done
                        raise
        finally:
            self.backend.absorbed(done)

    async def flush(self, fh: int) -> None:
        self.fs.flush(fh)

    async def fsync(self, fh: int) -> None:
        await self.sync(self.fs.handle(fh).inode.ino)

    async def release(self, fh: int) -> None:
        self.fs.release(fh)

    # ---- extended attributes ---------------------------------------------
    async def getxattr(self, ino: int, name: bytes) -> bytes:
        if name.startswith(VIRTUAL_PREFIX):
            fn = self.backend.virtual_xattrs.get(name)
            value = fn(ino) if fn is not None else None
            if value is None:
                raise NoAttribute()
            return value
        return self.fs.getxattr(ino, name)

    async def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        if name.startswith(VIRTUAL_PREFIX):
            raise ReadOnlyAttribute("ckptfs's own attributes are read-only")
        self.fs.setxattr(ino, name, value)

    async def listxattr(self, ino: int) -> list[bytes]:
        virtual = [name for name, fn in self.backend.virtual_xattrs.items() if fn(ino) is not None]
        return self.fs.listxattr(ino) + virtual

    async def removexattr(self, ino: int, name: bytes) -> None:
        if name.startswith(VIRTUAL_PREFIX):
            raise ReadOnlyAttribute("ckptfs's own attributes are read-only")
        self.fs.removexattr(ino, name)

    # ---- filesystem --------------------------------------------------------
    async def statfs(self) -> FsStat:
        return self.fs.statfs()
