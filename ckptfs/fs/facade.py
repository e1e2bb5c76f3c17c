"""The async file-system facade: what any FUSE front end calls, one method per request.

`core.Filesystem` never blocks: a read or write of data that is only on a
device raises `NeedsFetch`, a write that finds memory full raises `NoSpace`.
This facade holds the protocol around that, so that a front end (pyfuse3
today, a native engine later) is a thin 1:1 translation of requests:

- NeedsFetch: load the chunks (`Backend.fetch`), held in memory until the
  retry is over (`Backend.let_go`), then retry; its kind
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
  never stored: EPERM to set or remove; read by name, never listed).

Every operation that never waits also has a synchronous twin, `x_nowait`
(trio's convention), for a front end that serves requests in its own threads
under the trio thread's lock (fuse/native.py): those that may wait raise
NeedsFetch / NoSpace from their twin instead, and the front end then awaits
the coroutine on the trio thread. `read_nowait` answers with views of the
arena slots pinned until `read_done`; `writev_nowait` takes the pieces of a
request and the lent slots they were read into (`lend_slot`), so each whole
chunk is adopted, not copied.

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
from .filemap import NeedsFetch, Pinned
from .namespace import Inode
from .remote import NeedsRestore

VIRTUAL_PREFIX = b"user.ckptfs."


async def _no_fetch(chunks, held) -> None:
    raise NotInMemory("data is not in memory and there is no device store")


async def _no_restore(need) -> None:
    raise NotInMemory("data is still to be restored and there is no restorer")


async def _no_room(devices_full: bool = False) -> bool:
    return False


@dataclass
class Backend:
    """What the facade asks of the store (defaults: a memory-only mount)."""
    # fetch(chunks, held): load them, each also held in memory (out of reach of eviction) and
    # appended to `held` until let_go(held): a retry that needs several chunks where memory has
    # room for fewer at a time would otherwise evict the first loaded to load the next, forever
    fetch: Callable[[list, list], Awaitable[None]] = _no_fetch
    let_go: Callable[[list], None] = lambda held: None
    restore: Callable[[NeedsRestore], Awaitable[None]] = _no_restore  # chunks not restored yet
    room: Callable[[bool], Awaitable[bool]] = _no_room  # wait for memory; False: it will not come
    sync: Callable[[int | None], Awaitable[None]] | None = None  # fsync(ino) / syncfs (None)
    absorbed: Callable[[int], None] = lambda n: None  # hears the byte count of every write
    virtual_xattrs: dict[bytes, Callable[[int], bytes | None]] = field(default_factory=dict)


class AsyncFilesystem:
    """What a FUSE front end calls, one method per request: the core `fs` and the store's
    `backend`, which it waits on for fetches and room; no state of its own."""

    def __init__(self, fs: Filesystem, backend: Backend | None = None):
        self.fs = fs
        self.backend = backend or Backend()

    async def _fetching(self, fn, *args, **kw):
        """fn(*args) retried after loading what it needs from the devices, or after waiting for
        memory (a truncate or a punched hole that must copy a chunk a commit holds); `fn` must
        be safe to call again after any of those. NoSpace when room never comes. The chunks
        fetched stay held in memory until fn is done with them (Backend.fetch)."""
        held: list = []
        try:
            while True:
                try:
                    return fn(*args, **kw)
                except (NeedsFetch, NoSpace) as e:
                    if not await self._wait_out(e, held):
                        raise
        finally:
            if held:
                self.backend.let_go(held)

    async def _wait_out(self, e: NeedsFetch | NoSpace, held: list) -> bool:
        """Wait for what `e` says is missing: chunks restored (NeedsRestore) or fetched (NeedsFetch:
        held in memory, appended to `held`), or room (NoSpace); False when room will never come."""
        if isinstance(e, NeedsRestore):
            await self.backend.restore(e)
        elif isinstance(e, NeedsFetch):
            await self.backend.fetch(e.chunks, held)
        else:
            return await self.backend.room(isinstance(e, DevicesFull))
        return True

    def blocks(self, inode: Inode) -> int:
        """st_blocks: the 512-byte blocks the file holds."""
        return self.fs.blocks(inode)

    # ---- names -----------------------------------------------------------
    def lookup_nowait(self, parent: int, name: bytes) -> Inode:
        return self.fs.lookup(parent, name)

    async def lookup(self, parent: int, name: bytes) -> Inode:
        return self.lookup_nowait(parent, name)

    def getattr_nowait(self, ino: int) -> Inode:
        return self.fs.getattr(ino)

    async def getattr(self, ino: int) -> Inode:
        return self.getattr_nowait(ino)

    def setattr_nowait(self, ino: int, caller: Caller | None = None, **kw) -> Inode:
        """Raises NeedsFetch when a truncate must load a chunk first (then call `setattr`)."""
        return self.fs.setattr(ino, caller=caller, **kw)

    async def setattr(self, ino: int, caller: Caller | None = None, **kw) -> Inode:
        return await self._fetching(self.fs.setattr, ino, caller=caller, **kw)

    def mknod_nowait(self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> Inode:
        return self.fs.mknod(parent, name, mode, rdev, uid, gid)

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> Inode:
        return self.mknod_nowait(parent, name, mode, rdev, uid, gid)

    def mkdir_nowait(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        return self.fs.mkdir(parent, name, mode, uid, gid)

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        return self.mkdir_nowait(parent, name, mode, uid, gid)

    def symlink_nowait(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        return self.fs.symlink(parent, name, target, uid, gid)

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        return self.symlink_nowait(parent, name, target, uid, gid)

    def readlink_nowait(self, ino: int) -> bytes:
        return self.fs.readlink(ino)

    async def readlink(self, ino: int) -> bytes:
        return self.readlink_nowait(ino)

    def link_nowait(self, ino: int, parent: int, name: bytes) -> Inode:
        return self.fs.link(ino, parent, name)

    async def link(self, ino: int, parent: int, name: bytes) -> Inode:
        return self.link_nowait(ino, parent, name)

    def unlink_nowait(self, parent: int, name: bytes) -> None:
        self.fs.unlink(parent, name)

    async def unlink(self, parent: int, name: bytes) -> None:
        self.unlink_nowait(parent, name)

    def rmdir_nowait(self, parent: int, name: bytes) -> None:
        self.fs.rmdir(parent, name)

    async def rmdir(self, parent: int, name: bytes) -> None:
        self.rmdir_nowait(parent, name)

    def rename_nowait(self, p_old: int, n_old: bytes, p_new: int, n_new: bytes, flags: int = 0) -> None:
        self.fs.rename(p_old, n_old, p_new, n_new, flags)

    async def rename(self, p_old: int, n_old: bytes, p_new: int, n_new: bytes, flags: int = 0) -> None:
        self.rename_nowait(p_old, n_old, p_new, n_new, flags)

    def forget(self, ino: int, n: int) -> None:
        self.fs.forget(ino, n)

    # ---- directories -----------------------------------------------------
    def opendir_nowait(self, ino: int) -> int:
        return self.fs.opendir(ino)

    async def opendir(self, ino: int) -> int:
        return self.opendir_nowait(ino)

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
    def open_nowait(self, ino: int, flags: int, caller: Caller | None = None) -> OpenResult:
        return self.fs.open(ino, flags, caller)

    async def open(self, ino: int, flags: int, caller: Caller | None = None) -> OpenResult:
        return self.open_nowait(ino, flags, caller)

    def create_nowait(self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int,
                      caller: Caller | None = None) -> tuple[OpenResult, Inode]:
        return self.fs.create(parent, name, mode, flags, uid, gid, caller)

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int,
                     caller: Caller | None = None) -> tuple[OpenResult, Inode]:
        return self.create_nowait(parent, name, mode, flags, uid, gid, caller)

    async def read(self, fh: int, off: int, size: int):
        return await self._fetching(self.fs.read, fh, off, size)

    def read_nowait(self, fh: int, off: int, size: int) -> Pinned:
        """The bytes as views of arena slots, pinned until `read_done`; raises NeedsFetch when
        some are only on a device (then call `read_pinned`)."""
        return self.fs.read_pinned(fh, off, size)

    async def read_pinned(self, fh: int, off: int, size: int) -> Pinned:
        return await self._fetching(self.fs.read_pinned, fh, off, size)

    def read_done(self, pinned: Pinned) -> None:
        """The reply showing `pinned` was written: its slots may change again."""
        self.fs.owner.read_done(pinned.chunks)

    def write_nowait(self, fh: int, off: int, buf, kill_setid: bool | None = None, slot: int | None = None) -> int:
        """What can be written of `buf` without waiting (short when memory filled up or data must
        be fetched; raises NoSpace / NeedsFetch when nothing could be): then call `write` for the
        rest. `slot`: `buf` lies in this lent arena slot (core.write may adopt it)."""
        return self.writev_nowait(fh, off, (buf,), kill_setid, (slot,))

    def writev_nowait(self, fh: int, off: int, pieces, kill_setid: bool | None = None, slots=None,
                      shift: int = 0) -> int:
        """`write_nowait` of `pieces` laid end to end from `off`; `slots[i]`: the lent arena slot
        `pieces[i]` lies in, or None, the first `shift` bytes into its slot (core.writev adopts
        whole chunks, and a first piece that is a chunk's tail from `shift`)."""
        n = self.fs.writev(fh, off, pieces, kill_setid, slots, shift)
        self.backend.absorbed(n)
        return n

    async def write(self, fh: int, off: int, buf, kill_setid: bool | None = None) -> int:
        """All of `buf` at `off`, waiting for memory as needed; short only if room never comes.

        `kill_setid`: what the kernel said of the writer (True: it lacks CAP_FSETID, so the write
        clears set-user-ID bits; False: it holds it); None: the opener decides (core.write)."""
        done = 0
        view = memoryview(buf)
        held: list = []
        try:
            while True:
                try:
                    done += self.fs.write(fh, off + done, view[done:], kill_setid)
                    if done == len(view):
                        return done
                except (NeedsFetch, NoSpace) as e:
                    if not await self._wait_out(e, held):
                        if done:
                            return done
                        raise
        finally:
            if held:
                self.backend.let_go(held)
            self.backend.absorbed(done)

    def fallocate_nowait(self, fh: int, off: int, length: int, mode: int) -> None:
        """Raises NeedsFetch / NoSpace when it must wait (then call `fallocate`)."""
        self.fs.fallocate(fh, off, length, mode)

    async def fallocate(self, fh: int, off: int, length: int, mode: int) -> None:
        await self._fetching(self.fs.fallocate, fh, off, length, mode)

    def copy_range_nowait(self, fh_in: int, off_in: int, fh_out: int, off_out: int, length: int) -> int:
        """Raises NeedsFetch / NoSpace when nothing can be copied without waiting (then call
        `copy_range`); short when something could (core.copy_range)."""
        return self.fs.copy_range(fh_in, off_in, fh_out, off_out, length)

    async def copy_range(self, fh_in: int, off_in: int, fh_out: int, off_out: int, length: int) -> int:
        return await self._fetching(self.fs.copy_range, fh_in, off_in, fh_out, off_out, length)

    def seek_nowait(self, fh: int, off: int, whence: int) -> int:
        return self.fs.seek(fh, off, whence)

    async def seek(self, fh: int, off: int, whence: int) -> int:
        return self.seek_nowait(fh, off, whence)

    def can_lend(self, keep_free: int) -> bool:
        """Might `lend_slot` give a slot? (Read without the lock: a wrong guess costs one lock.)"""
        return self.fs.arena.free_slots > keep_free or self.fs.owner.evictable() > 0

    def lend_slot(self, keep_free: int) -> int | None:
        """A free arena slot lent as a FUSE receive buffer, None when `keep_free` or fewer are free
        even after evicting clean chunks (the store's `make_free`)."""
        arena = self.fs.arena
        if arena.free_slots <= keep_free:
            self.fs.owner.make_free(keep_free + 1)
        return arena.lend_nowait() if arena.free_slots > keep_free else None

    def unlend_slot(self, slot: int) -> None:
        self.fs.arena.unlend(slot)
        self.fs.owner.wake()  # a write or a fetch waiting for room may go now

    def flush_nowait(self, fh: int, owner: int | None = None) -> None:
        self.fs.flush(fh, owner)

    async def flush(self, fh: int, owner: int | None = None) -> None:
        self.flush_nowait(fh, owner)

    def wrote_from(self, fh: int, owner: int) -> None:
        self.fs.wrote_from(fh, owner)

    async def fsync(self, fh: int) -> None:
        await self.sync(self.fs.handle(fh).inode.ino)

    def release_nowait(self, fh: int) -> None:
        self.fs.release(fh)

    async def release(self, fh: int) -> None:
        self.release_nowait(fh)

    # ---- extended attributes ---------------------------------------------
    def getxattr_nowait(self, ino: int, name: bytes) -> bytes:
        if name.startswith(VIRTUAL_PREFIX):
            fn = self.backend.virtual_xattrs.get(name)
            value = fn(ino) if fn is not None else None
            if value is None:
                raise NoAttribute()
            return value
        return self.fs.getxattr(ino, name)

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        return self.getxattr_nowait(ino, name)

    def setxattr_nowait(self, ino: int, name: bytes, value: bytes) -> None:
        if name.startswith(VIRTUAL_PREFIX):
            raise ReadOnlyAttribute("ckptfs's own attributes are read-only")
        self.fs.setxattr(ino, name, value)

    async def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        self.setxattr_nowait(ino, name, value)

    def listxattr_nowait(self, ino: int) -> list[bytes]:
        """The stored attributes only: ckptfs's own are read by name, never listed, so tools that
        copy every listed attribute (shutil.copystat, cp -a, rsync -X, tar --xattrs) neither try
        to set them here (two more round trips, then EPERM) nor carry them elsewhere."""
        return self.fs.listxattr(ino)

    async def listxattr(self, ino: int) -> list[bytes]:
        return self.listxattr_nowait(ino)

    def removexattr_nowait(self, ino: int, name: bytes) -> None:
        if name.startswith(VIRTUAL_PREFIX):
            raise ReadOnlyAttribute("ckptfs's own attributes are read-only")
        self.fs.removexattr(ino, name)

    async def removexattr(self, ino: int, name: bytes) -> None:
        self.removexattr_nowait(ino, name)

    # ---- filesystem --------------------------------------------------------
    def statfs_nowait(self) -> FsStat:
        return self.fs.statfs()

    async def statfs(self) -> FsStat:
        return self.statfs_nowait()
