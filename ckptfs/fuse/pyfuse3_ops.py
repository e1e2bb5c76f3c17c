"""pyfuse3 Operations: a thin 1:1 adapter from FUSE requests to the async facade.

Each handler converts arguments, awaits `fs.facade.AsyncFilesystem`, converts
the result. Everything else (fetching evicted data, waiting for memory,
fsync, virtual xattrs, lookup counts) is the facade's, so another front end
serves the same semantics. Errors go through `_guard`: `FsError` becomes
`FUSEError(errno)`; anything else is logged and becomes EIO (errors.py), so
no request can tear the mount down.

Credentials: open, create and truncate pass the caller (`creds.caller`, its
capabilities and groups read from /proc) to the facade, which decides from it
whether a write clears set-user-ID bits; pyfuse3's write carries none.
"""
from __future__ import annotations

import errno
import functools
import logging

import pyfuse3

from ..errors import FsError, errno_of
from ..fs.creds import caller
from ..fs.facade import AsyncFilesystem
from ..fs.namespace import Inode
from .common import ATTR_TIMEOUT, ENTRY_TIMEOUT

log = logging.getLogger("ckptfs.fuse")


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


class Operations(pyfuse3.Operations):
    """pyfuse3's operations over the facade `afs` (see the module docstring); no state of their own."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, afs: AsyncFilesystem):
        super().__init__()
        self.afs = afs
        self.chunk_size = afs.fs.arena.chunk_size

    def _attr(self, inode: Inode) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode.ino
        a.generation = 0
        a.entry_timeout = ENTRY_TIMEOUT
        a.attr_timeout = ATTR_TIMEOUT
        a.st_mode = inode.mode
        a.st_nlink = inode.nlink
        a.st_uid = inode.uid
        a.st_gid = inode.gid
        a.st_rdev = inode.rdev
        a.st_size = inode.size
        a.st_blksize = self.chunk_size
        a.st_blocks = self.afs.blocks(inode)
        a.st_atime_ns = inode.atime_ns
        a.st_mtime_ns = inode.mtime_ns
        a.st_ctime_ns = inode.ctime_ns
        return a

    # ---- names -----------------------------------------------------------
    @_guard
    async def lookup(self, parent_inode, name, ctx=None):
        try:
            return self._attr(await self.afs.lookup(parent_inode, name))
        except FsError as e:
            if e.errno != errno.ENOENT:
                raise
        a = pyfuse3.EntryAttributes()  # a negative entry: the kernel caches "no such name" (common.py)
        a.st_ino = 0
        a.entry_timeout = ENTRY_TIMEOUT
        return a

    @_guard
    async def getattr(self, inode, ctx=None):
        return self._attr(await self.afs.getattr(inode))

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
        return self._attr(await self.afs.setattr(inode, **kw))

    @_guard
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return self._attr(await self.afs.mknod(parent_inode, name, mode, rdev, ctx.uid, ctx.gid))

    @_guard
    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._attr(await self.afs.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @_guard
    async def symlink(self, parent_inode, name, target, ctx):
        return self._attr(await self.afs.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @_guard
    async def readlink(self, inode, ctx):
        return await self.afs.readlink(inode)

    @_guard
    async def link(self, inode, new_parent_inode, new_name, ctx):
        return self._attr(await self.afs.link(inode, new_parent_inode, new_name))

    @_guard
    async def unlink(self, parent_inode, name, ctx):
        await self.afs.unlink(parent_inode, name)

    @_guard
    async def rmdir(self, parent_inode, name, ctx):
        await self.afs.rmdir(parent_inode, name)

    @_guard
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        await self.afs.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    async def forget(self, inode_list):
        for ino, n in inode_list:
            try:
                self.afs.forget(ino, n)
            except Exception:  # noqa: BLE001 - forget has no reply; log and go on
                log.exception("forget(%d, %d) failed", ino, n)

    # ---- directories -----------------------------------------------------
    @_guard
    async def opendir(self, inode, ctx):
        return await self.afs.opendir(inode)

    @_guard
    async def readdir(self, fh, start_id, token):
        for name, inode, cookie in self.afs.readdir(fh, start_id):
            if not pyfuse3.readdir_reply(token, name, self._attr(inode), cookie):
                break
            self.afs.entry_sent(inode, cookie)

    async def releasedir(self, fh):
        return None

    @_guard
    async def fsyncdir(self, fh, datasync):
        await self.afs.fsyncdir()

    # ---- files -----------------------------------------------------------
    @staticmethod
    def _file_info(r) -> pyfuse3.FileInfo:
        return pyfuse3.FileInfo(fh=r.fh, direct_io=r.direct_io, keep_cache=r.keep_cache)

    @_guard
    async def open(self, inode, flags, ctx):
        return self._file_info(await self.afs.open(inode, flags, caller(ctx.uid, ctx.gid, ctx.pid)))

    @_guard
    async def create(self, parent_inode, name, mode, flags, ctx):
        r, inode = await self.afs.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid,
                                         caller(ctx.uid, ctx.gid, ctx.pid))
        return self._file_info(r), self._attr(inode)

    @_guard
    async def read(self, fh, off, size):
        return await self.afs.read(fh, off, size)

    @_guard
    async def write(self, fh, off, buf):
        return await self.afs.write(fh, off, buf)

    @_guard
    async def flush(self, fh):
        await self.afs.flush(fh)

    @_guard
    async def fsync(self, fh, datasync):
        await self.afs.fsync(fh)

    @_guard
    async def release(self, fh):
        await self.afs.release(fh)

    # ---- extended attributes ---------------------------------------------
    @_guard
    async def getxattr(self, inode, name, ctx):
        return await self.afs.getxattr(inode, name)

    @_guard
    async def setxattr(self, inode, name, value, ctx):
        await self.afs.setxattr(inode, name, value)

    @_guard
    async def listxattr(self, inode, ctx):
        return await self.afs.listxattr(inode)

    @_guard
    async def removexattr(self, inode, name, ctx):
        await self.afs.removexattr(inode, name)

    # ---- filesystem --------------------------------------------------------
    @_guard
    async def statfs(self, ctx):
        s = await self.afs.statfs()
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
