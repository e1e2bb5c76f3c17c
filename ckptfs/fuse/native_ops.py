"""Native-engine operations: typed kernel requests -> the async facade -> typed replies.

The twin of pyfuse3_ops.py for the engine in fuse/kernel/: one async method per
request, each a few lines: convert the request (requests.py), await
`fs.facade.AsyncFilesystem`, convert the result into a reply (replies.py).
Everything else (fetching evicted data, waiting for memory, fsync to durable,
virtual xattrs, lookup counts) is the facade's, so both engines serve the
same semantics. These methods run on the daemon's trio thread (native.py
carries each request there from the session's worker threads), because the
core, the store and the facade are not thread-safe; so does every read of an
inode (attributes, st_blocks) and the packing of READDIR replies.

Errors: the facade raises `FsError`; native.py turns anything else into EIO,
logged, as pyfuse3_ops does. The GETXATTR/LISTXATTR size probe (size 0: the
length; ERANGE when the caller's buffer is too small) is the session's.

Set-user-ID bits: as with pyfuse3, open, create and a size change pass the
caller (`creds.caller`, read from /proc) to the facade, and the kernel does
the rest of Linux's rules itself (chown clears set-user-ID: it sends the new
mode in the SETATTR), because this engine does not ask for
FUSE_HANDLE_KILLPRIV_V2 (`WANT`): with it the kernel leaves chown and
truncate to the filesystem and says nothing on a chown(-1, -1), which on
ext4 clears set-user-ID (tests/test_ext4_parity.py). A WRITE still says
whether the writer lacks CAP_FSETID (FUSE_WRITE_KILL_SUIDGID, sent for every
direct_io write): that flag decides, the writer rather than the opener.
"""
from __future__ import annotations

import errno
import os
import time

from ..errors import NoAttribute, fs_error
from ..fs.creds import Caller, caller
from ..fs.facade import AsyncFilesystem
from ..fs.namespace import Inode
from .common import ATTR_TIMEOUT
from .kernel import abi
from .kernel.negotiate import DEFAULT_WANT
from .kernel.replies import Attr, AttrOut, CreateOut, DirentBuffer, EntryOut, OpenOut, StatfsOut, WriteOut

# What the engine asks of the kernel at INIT: the session's defaults but HANDLE_KILLPRIV_V2 (see above).
WANT = DEFAULT_WANT & ~abi.FUSE_HANDLE_KILLPRIV_V2


class Operations:
    """The native session's operations, as coroutines on the trio thread (see native.TrioHandler)."""

    def __init__(self, afs: AsyncFilesystem):
        self.afs = afs
        self.chunk_size = afs.fs.arena.chunk_size

    # ---- conversions -------------------------------------------------------
    def _attr(self, inode: Inode) -> Attr:
        return Attr(ino=inode.ino, mode=inode.mode, size=inode.size, blocks=self.afs.blocks(inode),
                    atime_ns=inode.atime_ns, mtime_ns=inode.mtime_ns, ctime_ns=inode.ctime_ns,
                    nlink=inode.nlink, uid=inode.uid, gid=inode.gid, rdev=inode.rdev, blksize=self.chunk_size)

    def _entry(self, inode: Inode) -> EntryOut:
        return EntryOut(inode.ino, self._attr(inode), entry_timeout=ATTR_TIMEOUT, attr_timeout=ATTR_TIMEOUT)

    def _attr_out(self, inode: Inode) -> AttrOut:
        return AttrOut(self._attr(inode), attr_timeout=ATTR_TIMEOUT)

    @staticmethod
    def _open_out(r) -> OpenOut:
        flags = (abi.FOPEN_DIRECT_IO | abi.FOPEN_PARALLEL_DIRECT_WRITES) if r.direct_io else 0
        if r.keep_cache:
            flags |= abi.FOPEN_KEEP_CACHE
        return OpenOut(r.fh, flags)

    @staticmethod
    def _caller(req) -> Caller:
        h = req.header
        return caller(h.uid, h.gid, h.pid)

    # ---- names -------------------------------------------------------------
    async def lookup(self, req) -> EntryOut:
        return self._entry(await self.afs.lookup(req.nodeid, req.name))

    async def forget(self, req) -> None:
        for ino, n in req.items:
            self.afs.forget(ino, n)

    batch_forget = forget

    async def getattr(self, req) -> AttrOut:
        return self._attr_out(await self.afs.getattr(req.nodeid))

    async def setattr(self, req) -> AttrOut:
        v = req.valid
        kw = {}
        if v & abi.FATTR_MODE:
            kw["mode"] = req.mode
        if v & abi.FATTR_UID:
            kw["uid"] = req.uid
        if v & abi.FATTR_GID:
            kw["gid"] = req.gid
        if v & abi.FATTR_ATIME:
            kw["atime_ns"] = time.time_ns() if v & abi.FATTR_ATIME_NOW else req.atime_ns
        if v & abi.FATTR_MTIME:
            kw["mtime_ns"] = time.time_ns() if v & abi.FATTR_MTIME_NOW else req.mtime_ns
        if v & abi.FATTR_SIZE:
            kw["size"] = req.size
            kw["caller"] = self._caller(req)
        return self._attr_out(await self.afs.setattr(req.nodeid, **kw))

    async def mknod(self, req) -> EntryOut:
        h = req.header
        return self._entry(await self.afs.mknod(req.nodeid, req.name, req.mode, req.rdev, h.uid, h.gid))

    async def mkdir(self, req) -> EntryOut:
        h = req.header
        return self._entry(await self.afs.mkdir(req.nodeid, req.name, req.mode, h.uid, h.gid))

    async def symlink(self, req) -> EntryOut:
        h = req.header
        return self._entry(await self.afs.symlink(req.nodeid, req.name, req.target, h.uid, h.gid))

    async def readlink(self, req) -> bytes:
        return bytes(await self.afs.readlink(req.nodeid))

    async def link(self, req) -> EntryOut:
        return self._entry(await self.afs.link(req.oldnodeid, req.nodeid, req.name))

    async def unlink(self, req) -> None:
        await self.afs.unlink(req.nodeid, req.name)

    async def rmdir(self, req) -> None:
        await self.afs.rmdir(req.nodeid, req.name)

    async def rename(self, req) -> None:
        await self.afs.rename(req.nodeid, req.name, req.newdir, req.newname, req.flags)

    # ---- directories ---------------------------------------------------------
    async def opendir(self, req) -> OpenOut:
        return OpenOut(await self.afs.opendir(req.nodeid))

    async def readdir(self, req) -> DirentBuffer:
        buf = DirentBuffer(req.size, plus=req.plus)
        for name, inode, cookie in self.afs.readdir(req.fh, req.offset):
            if req.plus:
                if not buf.add(name, cookie, entry=self._entry(inode)):
                    break
                self.afs.entry_sent(inode, cookie)
            elif not buf.add(name, cookie, ino=inode.ino, mode=inode.mode):
                break
        return buf

    async def releasedir(self, req) -> None:
        return None

    async def fsyncdir(self, req) -> None:
        await self.afs.fsyncdir()

    # ---- files -------------------------------------------------------------
    async def open(self, req) -> OpenOut:
        return self._open_out(await self.afs.open(req.nodeid, req.flags, self._caller(req)))

    async def create(self, req) -> CreateOut:
        h = req.header
        r, inode = await self.afs.create(req.nodeid, req.name, req.mode, req.flags, h.uid, h.gid,
                                         self._caller(req))
        return CreateOut(self._entry(inode), self._open_out(r))

    async def read(self, req) -> bytes:
        # A copy, made here on the trio thread: a view of an arena slot could change (a write,
        # an eviction) while the worker thread hands it to the kernel.
        return bytes(await self.afs.read(req.fh, req.offset, req.size))

    async def write(self, req) -> WriteOut:
        # the flag present: the writer lacks CAP_FSETID; absent: the opener decides (as with pyfuse3)
        kill = True if req.write_flags & abi.FUSE_WRITE_KILL_SUIDGID else None
        return WriteOut(await self.afs.write(req.fh, req.offset, req.data, kill))

    async def flush(self, req) -> None:
        await self.afs.flush(req.fh)

    async def fsync(self, req) -> None:
        await self.afs.fsync(req.fh)

    async def release(self, req) -> None:
        await self.afs.release(req.fh)

    # ---- extended attributes -------------------------------------------------
    async def getxattr(self, req) -> bytes:
        return await self.afs.getxattr(req.nodeid, req.name)

    async def setxattr(self, req) -> None:
        # XATTR_CREATE / XATTR_REPLACE checked through getxattr first, as pyfuse3 does
        if req.flags & os.XATTR_CREATE:
            try:
                await self.afs.getxattr(req.nodeid, req.name)
            except NoAttribute:
                pass
            else:
                raise fs_error(errno.EEXIST)
        elif req.flags & os.XATTR_REPLACE:
            await self.afs.getxattr(req.nodeid, req.name)
        await self.afs.setxattr(req.nodeid, req.name, bytes(req.value))

    async def listxattr(self, req) -> list[bytes]:
        return await self.afs.listxattr(req.nodeid)

    async def removexattr(self, req) -> None:
        await self.afs.removexattr(req.nodeid, req.name)

    # ---- filesystem ------------------------------------------------------------
    async def statfs(self, req) -> StatfsOut:
        s = await self.afs.statfs()
        return StatfsOut(blocks=s.blocks, bfree=s.bfree, bavail=s.bfree, files=s.files, ffree=s.ffree,
                         bsize=s.frsize, namelen=s.namemax, frsize=s.frsize)

    async def access(self, req) -> None:
        return None  # mounted with default_permissions: the kernel checks modes itself

    async def syncfs(self, req) -> None:
        await self.afs.sync(None)

    async def destroy(self, req) -> None:
        return None  # the daemon drains once every worker has exited
