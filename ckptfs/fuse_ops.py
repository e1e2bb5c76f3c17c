"""pyfuse3 Operations: a thin adapter from FUSE requests to `core.Filesystem`.

Each handler converts arguments, calls the core, converts the result. Errors
go through `_guard`: `FsError` becomes `FUSEError(errno)`; anything else is
logged and becomes EIO, so no request can tear the mount down.

Credentials: open, create and truncate pass the caller (`creds.caller`, its
capabilities and groups read from /proc) to the core, which decides from it
whether a write clears set-user-ID bits; pyfuse3's write carries none.

Writes: the core raises NoSpace when the arena has no free slot. The
`wait_for_room` hook decides what that means: by default the write fails
with ENOSPC; the durable store waits there for the drain (backpressure).

Virtual extended attributes under ``user.ckptfs.`` are answered by
`virtual_xattrs` callbacks (e.g. the daemon's pid on the root, used by
``ckptfs umount``; ``user.ckptfs.state`` on every file); they are never
stored. A callback returns None where its attribute does not apply (ENODATA,
and not listed); listxattr lists the others after the stored ones.
"""
from __future__ import annotations

import errno
import functools
import logging
from typing import Awaitable, Callable

import pyfuse3

from .core import Filesystem
from .creds import caller
from .errors import DevicesFull, NoSpace, errno_of, fs_error
from .filemap import NeedsFetch
from .namespace import Inode

log = logging.getLogger("ckptfs.fuse")

ATTR_TIMEOUT = 1.0
VIRTUAL_PREFIX = b"user.ckptfs."


def _guard(fn):
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except BaseException as exc:  # noqa: BLE001 - only FUSEError may leave a handler
            if not isinstance(exc, Exception):
                raise
            raise pyfuse3.FUSEError(errno_of(exc, name)) from None
    return wrapper


async def _no_room(fs: Filesystem, fh: int, devices_full: bool = False) -> bool:
    return False


async def _no_fetch(chunks) -> None:
    raise fs_error(errno.EIO, "data is not in memory and there is no device store")


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, fs: Filesystem, *,
                 wait_for_room: Callable[[Filesystem, int, bool], Awaitable[bool]] = _no_room,
                 virtual_xattrs: dict[bytes, Callable[[int], bytes]] | None = None,
                 on_fsync: Callable[[int | None], Awaitable[None]] | None = None,
                 fetch: Callable[[list], Awaitable[None]] = _no_fetch,
                 on_write: Callable[[int], None] | None = None):
        super().__init__()
        self.fs = fs
        self.wait_for_room = wait_for_room
        self.fetch = fetch
        self.virtual_xattrs = virtual_xattrs or {}
        self.on_fsync = on_fsync
        self.on_write = on_write  # hears the byte count of every write (the absorbed-bytes counter)

    def _attr(self, inode: Inode) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode.ino
        a.generation = 0
        a.entry_timeout = ATTR_TIMEOUT
        a.attr_timeout = ATTR_TIMEOUT
        a.st_mode = inode.mode
        a.st_nlink = inode.nlink
        a.st_uid = inode.uid
        a.st_gid = inode.gid
        a.st_rdev = inode.rdev
        a.st_size = inode.size
        a.st_blksize = self.fs.arena.chunk_size
        a.st_blocks = self.fs.blocks(inode)
        a.st_atime_ns = inode.atime_ns
        a.st_mtime_ns = inode.mtime_ns
        a.st_ctime_ns = inode.ctime_ns
        return a

    # ---- names -----------------------------------------------------------
    @_guard
    async def lookup(self, parent_inode, name, ctx=None):
        return self._attr(self.fs.lookup(parent_inode, name))

    @_guard
    async def getattr(self, inode, ctx=None):
        return self._attr(self.fs.getattr(inode))

    @_guard
    async def setattr(self, inode, attr, fields, fh, ctx):
        kw = {}
        if fields.update_mode:
            kw["mode"] = attr.st_mode
        if fields.update_uid:
            kw["uid"] = attr.st_uid
        if fields.update_gid:
            kw["gid"] = attr.st_gid
        if fields.update_size:
            kw["size"] = attr.st_size
        if fields.update_atime:
            kw["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            kw["mtime_ns"] = attr.st_mtime_ns
        if fields.update_size:
            kw["caller"] = caller(ctx.uid, ctx.gid, ctx.pid)
        while True:
            try:
                return self._attr(self.fs.setattr(inode, **kw))
            except NeedsFetch as e:
                await self.fetch(e.chunks)

    @_guard
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return self._attr(self.fs.mknod(parent_inode, name, mode, rdev, ctx.uid, ctx.gid))

    @_guard
    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._attr(self.fs.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @_guard
    async def symlink(self, parent_inode, name, target, ctx):
        return self._attr(self.fs.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @_guard
    async def readlink(self, inode, ctx):
        return self.fs.readlink(inode)

    @_guard
    async def link(self, inode, new_parent_inode, new_name, ctx):
        return self._attr(self.fs.link(inode, new_parent_inode, new_name))

    @_guard
    async def unlink(self, parent_inode, name, ctx):
        self.fs.unlink(parent_inode, name)

    @_guard
    async def rmdir(self, parent_inode, name, ctx):
        self.fs.rmdir(parent_inode, name)

    @_guard
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        self.fs.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    async def forget(self, inode_list):
        for ino, n in inode_list:
            try:
                self.fs.forget(ino, n)
            except Exception:  # noqa: BLE001 - forget has no reply; log and go on
                log.exception("forget(%d, %d) failed", ino, n)

    # ---- directories -----------------------------------------------------
    @_guard
    async def opendir(self, inode, ctx):
        return self.fs.opendir(inode)

    @_guard
    async def readdir(self, fh, start_id, token):
        for name, inode, cookie in self.fs.readdir(fh, start_id):
            if not pyfuse3.readdir_reply(token, name, self._attr(inode), cookie):
                break
            if cookie > 2:  # "." and ".." do not count as lookups
                inode.lookups += 1

    async def releasedir(self, fh):
        return None

    async def fsyncdir(self, fh, datasync):
        if self.on_fsync is not None:
            await self.on_fsync(None)

    # ---- files -----------------------------------------------------------
    def _file_info(self, r) -> pyfuse3.FileInfo:
        return pyfuse3.FileInfo(fh=r.fh, direct_io=r.direct_io, keep_cache=r.keep_cache)

    @_guard
    async def open(self, inode, flags, ctx):
        return self._file_info(self.fs.open(inode, flags, caller(ctx.uid, ctx.gid, ctx.pid)))

    @_guard
    async def create(self, parent_inode, name, mode, flags, ctx):
        r, inode = self.fs.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid,
                                  caller(ctx.uid, ctx.gid, ctx.pid))
        return self._file_info(r), self._attr(inode)

    @_guard
    async def read(self, fh, off, size):
        while True:
            try:
                return self.fs.read(fh, off, size)
            except NeedsFetch as e:
                await self.fetch(e.chunks)

    @_guard
    async def write(self, fh, off, buf):
        n = await self._write(fh, off, buf)
        if self.on_write is not None:
            self.on_write(n)
        return n

    async def _write(self, fh, off, buf):
        done = 0
        view = memoryview(buf)
        while True:
            try:
                done += self.fs.write(fh, off + done, view[done:])
                if done == len(view):
                    return done
            except NeedsFetch as e:
                await self.fetch(e.chunks)
            except NoSpace as e:
                if not await self.wait_for_room(self.fs, fh, isinstance(e, DevicesFull)):
                    if done:
                        return done
                    raise

    @_guard
    async def flush(self, fh):
        self.fs.handle(fh)

    @_guard
    async def fsync(self, fh, datasync):
        h = self.fs.handle(fh)
        if self.on_fsync is not None:
            await self.on_fsync(h.inode.ino)

    @_guard
    async def release(self, fh):
        self.fs.release(fh)

    # ---- extended attributes ---------------------------------------------
    @_guard
    async def getxattr(self, inode, name, ctx):
        if name.startswith(VIRTUAL_PREFIX):
            fn = self.virtual_xattrs.get(name)
            value = fn(inode) if fn is not None else None
            if value is None:
                raise pyfuse3.FUSEError(errno.ENODATA)
            return value
        return self.fs.getxattr(inode, name)

    @_guard
    async def setxattr(self, inode, name, value, ctx):
        if name.startswith(VIRTUAL_PREFIX):
            raise pyfuse3.FUSEError(errno.EPERM)
        self.fs.setxattr(inode, name, value)

    @_guard
    async def listxattr(self, inode, ctx):
        names = self.fs.listxattr(inode)
        return names + [name for name, fn in self.virtual_xattrs.items() if fn(inode) is not None]

    @_guard
    async def removexattr(self, inode, name, ctx):
        if name.startswith(VIRTUAL_PREFIX):
            raise pyfuse3.FUSEError(errno.EPERM)
        self.fs.removexattr(inode, name)

    # ---- filesystem --------------------------------------------------------
    @_guard
    async def statfs(self, ctx):
        s = self.fs.statfs()
        out = pyfuse3.StatvfsData()
        out.f_bsize = s.frsize
        out.f_frsize = s.frsize
        out.f_blocks = s.blocks
        out.f_bfree = s.bfree
        out.f_bavail = s.bfree
        out.f_files = s.files
        out.f_ffree = s.ffree
        out.f_favail = s.ffree
        out.f_namemax = s.namemax
        return out
