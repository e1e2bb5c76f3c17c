"""Native-engine operations: typed kernel requests -> the file-system facade -> typed replies.

The twin of pyfuse3_ops.py for the engine in fuse/kernel/: one method per
request, each a few lines: convert the request (requests.py), call
`fs.facade.AsyncFilesystem`, convert the result into a reply (replies.py).
Everything else (fetching evicted data, waiting for memory, fsync to durable,
virtual xattrs, lookup counts) is the facade's, so both engines serve the
same semantics.

Two kinds of methods. Most are synchronous: native.py runs them in the
session's worker thread holding the trio thread's loop lock
(tasks.LoopLock), through the facade's `x_nowait` twins. When one finds it
must wait (data only on a device, memory full) it raises `Blocked(afn,
*args)` and native.py awaits ``afn(*args)`` on the trio thread instead (a
WRITE that got partway continues from where it stopped). FSYNC, FSYNCDIR
and SYNCFS always wait, so they are coroutines, run on the trio thread.

READ answers with views of the arena slots (`filemap.Pinned`), pinned until
the reply is written (native.py releases them). WRITE takes the arena slots
the worker read the request into (`slots`, one per piece of `Write.pieces`,
or None): each piece that is a whole chunk at a chunk boundary is adopted in
place, the rest copied.

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

Reads: the engine also asks for FUSE_DIRECT_IO_ALLOW_MMAP (`WANT`). Where the
kernel grants it, read-only opens of files over 8 MiB are direct_io too (`init`,
core's `direct_reads` and CACHED_READ_MAX; smaller files keep the page cache):
a READ's reply is copied once, from the arena slot into the
reader's buffer, instead of into fresh page-cache pages first; mmap of such an
open, shared or private, still works through the page cache (the kernel drops
the file's cached pages at each new mapping). It also lets a file open for
writing be mapped shared-writable: its dirty pages come back as WRITEs and
count from the next close or fsync, like any write (docs/SEMANTICS.md).
Read-only opens answer FOPEN_NOFLUSH (core's `noflush`): their close sends no
FLUSH, which would commit nothing.
"""
from __future__ import annotations

import errno
import os
import time

from ..errors import FsError, NoAttribute, NoSpace, fs_error
from ..fs.creds import Caller, caller
from ..fs.facade import AsyncFilesystem
from ..fs.filemap import NeedsFetch, Pinned
from ..fs.namespace import Inode
from .common import ATTR_TIMEOUT, ENTRY_TIMEOUT
from .kernel import abi
from .kernel.negotiate import DEFAULT_WANT
from .kernel.replies import (Attr, AttrOut, CopiedOut, CreateOut, DirentBuffer, EntryOut, LseekOut, OpenOut,
                             StatfsOut, WriteOut)

# What the engine asks of the kernel at INIT: the session's defaults but HANDLE_KILLPRIV_V2, and
# DIRECT_IO_ALLOW_MMAP (see above).
WANT = (DEFAULT_WANT & ~abi.FUSE_HANDLE_KILLPRIV_V2) | abi.FUSE_DIRECT_IO_ALLOW_MMAP
COPY_MAX_32 = (1 << 32) - abi.PAGE_SIZE  # the most a COPY_FILE_RANGE reply (fuse_write_out) can count


# "no such name", cached by the kernel for ENTRY_TIMEOUT (common.py)
NEGATIVE_ENTRY = EntryOut(0, Attr(0, 0), entry_timeout=ENTRY_TIMEOUT, attr_timeout=0)


class Blocked(Exception):
    """The request must wait: await ``afn(req, *args)`` on the trio thread for its reply."""

    def __init__(self, afn, *args):
        super().__init__(getattr(afn, "__name__", "wait"))
        self.afn, self.args = afn, args


class Operations:
    """The native session's operations (see the module docstring and native.TrioHandler)."""

    def __init__(self, afs: AsyncFilesystem):
        self.afs = afs
        self.chunk_size = afs.fs.arena.chunk_size

    def init(self, neg) -> None:
        """INIT answered (kernel.negotiate.Negotiated): read-only opens go direct where the kernel
        still maps direct_io files shared (see the module docstring)."""
        self.afs.fs.direct_reads = neg.has(abi.FUSE_DIRECT_IO_ALLOW_MMAP)

    # ---- conversions -------------------------------------------------------
    def _attr(self, inode: Inode) -> Attr:
        return Attr(ino=inode.ino, mode=inode.mode, size=inode.size, blocks=self.afs.blocks(inode),
                    atime_ns=inode.atime_ns, mtime_ns=inode.mtime_ns, ctime_ns=inode.ctime_ns,
                    nlink=inode.nlink, uid=inode.uid, gid=inode.gid, rdev=inode.rdev, blksize=self.chunk_size)

    def _entry(self, inode: Inode) -> EntryOut:
        return EntryOut(inode.ino, self._attr(inode), entry_timeout=ENTRY_TIMEOUT, attr_timeout=ATTR_TIMEOUT)

    def _attr_out(self, inode: Inode) -> AttrOut:
        return AttrOut(self._attr(inode), attr_timeout=ATTR_TIMEOUT)

    @staticmethod
    def _open_out(r) -> OpenOut:
        flags = (abi.FOPEN_DIRECT_IO | abi.FOPEN_PARALLEL_DIRECT_WRITES) if r.direct_io else 0
        if r.keep_cache:
            flags |= abi.FOPEN_KEEP_CACHE
        if r.noflush:
            flags |= abi.FOPEN_NOFLUSH  # no FLUSH round trip at close() (a read-only handle's does nothing)
        return OpenOut(r.fh, flags)

    @staticmethod
    def _caller(req) -> Caller:
        h = req.header
        return caller(h.uid, h.gid, h.pid)

    # ---- names -------------------------------------------------------------
    def lookup(self, req) -> EntryOut:
        try:
            return self._entry(self.afs.lookup_nowait(req.nodeid, req.name))
        except FsError as e:
            if e.errno != errno.ENOENT:
                raise
        return NEGATIVE_ENTRY

    def forget(self, req) -> None:
        for ino, n in req.items:
            self.afs.forget(ino, n)

    batch_forget = forget

    def getattr(self, req) -> AttrOut:
        return self._attr_out(self.afs.getattr_nowait(req.nodeid))

    def setattr(self, req) -> AttrOut:
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
        try:
            return self._attr_out(self.afs.setattr_nowait(req.nodeid, **kw))
        except (NoSpace, NeedsFetch):
            raise Blocked(self.setattr_wait, req, kw) from None

    async def setattr_wait(self, req, kw: dict) -> AttrOut:
        return self._attr_out(await self.afs.setattr(req.nodeid, **kw))

    def mknod(self, req) -> EntryOut:
        h = req.header
        return self._entry(self.afs.mknod_nowait(req.nodeid, req.name, req.mode, req.rdev, h.uid, h.gid))

    def mkdir(self, req) -> EntryOut:
        h = req.header
        return self._entry(self.afs.mkdir_nowait(req.nodeid, req.name, req.mode, h.uid, h.gid))

    def symlink(self, req) -> EntryOut:
        h = req.header
        return self._entry(self.afs.symlink_nowait(req.nodeid, req.name, req.target, h.uid, h.gid))

    def readlink(self, req) -> bytes:
        return bytes(self.afs.readlink_nowait(req.nodeid))

    def link(self, req) -> EntryOut:
        return self._entry(self.afs.link_nowait(req.oldnodeid, req.nodeid, req.name))

    def unlink(self, req) -> None:
        self.afs.unlink_nowait(req.nodeid, req.name)

    def rmdir(self, req) -> None:
        self.afs.rmdir_nowait(req.nodeid, req.name)

    def rename(self, req) -> None:
        self.afs.rename_nowait(req.nodeid, req.name, req.newdir, req.newname, req.flags)

    # ---- directories ---------------------------------------------------------
    def opendir(self, req) -> OpenOut:
        return OpenOut(self.afs.opendir_nowait(req.nodeid))

    def readdir(self, req) -> DirentBuffer:
        buf = DirentBuffer(req.size, plus=req.plus)
        for name, inode, cookie in self.afs.readdir(req.fh, req.offset):
            if req.plus:
                if not buf.add(name, cookie, entry=self._entry(inode)):
                    break
                self.afs.entry_sent(inode, cookie)
            elif not buf.add(name, cookie, ino=inode.ino, mode=inode.mode):
                break
        return buf

    def releasedir(self, req) -> None:
        return None

    async def fsyncdir(self, req) -> None:
        await self.afs.fsyncdir()

    # ---- files -------------------------------------------------------------
    def open(self, req) -> OpenOut:
        return self._open_out(self.afs.open_nowait(req.nodeid, req.flags, self._caller(req)))

    def create(self, req) -> CreateOut:
        h = req.header
        r, inode = self.afs.create_nowait(req.nodeid, req.name, req.mode, req.flags, h.uid, h.gid,
                                          self._caller(req))
        return CreateOut(self._entry(inode), self._open_out(r))

    def read(self, req) -> Pinned:
        try:
            return self.afs.read_nowait(req.fh, req.offset, req.size)
        except NeedsFetch:
            raise Blocked(self.read_wait, req) from None

    async def read_wait(self, req) -> Pinned:
        return await self.afs.read_pinned(req.fh, req.offset, req.size)

    def write(self, req, slots=None, shift: int = 0) -> WriteOut:
        """`slots[i]`: the lent arena slot `req.pieces[i]` was read into (its data starts there, the
        first piece's `shift` bytes into its slot), or None."""
        if req.write_flags & abi.FUSE_WRITE_LOCKOWNER:
            self.afs.wrote_from(req.fh, req.lock_owner)  # whose close commits it (core.flush)
        try:
            done = self.afs.writev_nowait(req.fh, req.offset, req.pieces, self._kill(req), slots, shift)
        except (NoSpace, NeedsFetch):
            done = 0
        if done == req.size:
            return WriteOut(done)
        raise Blocked(self.write_rest, req, done)

    async def write_rest(self, req, done: int) -> WriteOut:
        """The rest of a WRITE after `done` bytes, waiting for memory or a fetch as needed."""
        written, skip = done, done
        for piece in req.pieces:
            if skip >= piece.nbytes:
                skip -= piece.nbytes
                continue
            n = await self.afs.write(req.fh, req.offset + written, piece[skip:], self._kill(req))
            written += n
            if n < piece.nbytes - skip:
                break  # room never came: short
            skip = 0
        return WriteOut(written)

    @staticmethod
    def _kill(req) -> bool | None:
        # the flag present: the writer lacks CAP_FSETID; absent: the opener decides (as with pyfuse3)
        return True if req.write_flags & abi.FUSE_WRITE_KILL_SUIDGID else None

    def fallocate(self, req) -> None:
        try:
            self.afs.fallocate_nowait(req.fh, req.offset, req.length, req.mode)
        except (NoSpace, NeedsFetch):
            raise Blocked(self.fallocate_wait, req) from None

    async def fallocate_wait(self, req) -> None:
        await self.afs.fallocate(req.fh, req.offset, req.length, req.mode)

    def copy_file_range(self, req) -> WriteOut | CopiedOut:
        if req.flags:
            raise fs_error(errno.EINVAL)
        try:
            return self._copied(req, self.afs.copy_range_nowait(*self._copy_args(req)))
        except (NoSpace, NeedsFetch):
            raise Blocked(self.copy_file_range_wait, req) from None

    async def copy_file_range_wait(self, req) -> WriteOut | CopiedOut:
        return self._copied(req, await self.afs.copy_range(*self._copy_args(req)))

    @staticmethod
    def _copy_args(req) -> tuple:
        # COPY_FILE_RANGE answers in 32 bits: at most 4 GiB less a page per request
        length = req.length if req.wide else min(req.length, COPY_MAX_32)
        return req.fh_in, req.off_in, req.fh_out, req.off_out, length

    @staticmethod
    def _copied(req, n: int) -> WriteOut | CopiedOut:
        return CopiedOut(n) if req.wide else WriteOut(n)

    def lseek(self, req) -> LseekOut:
        return LseekOut(self.afs.seek_nowait(req.fh, req.offset, req.whence))

    def flush(self, req) -> None:
        self.afs.flush_nowait(req.fh, req.lock_owner)

    async def fsync(self, req) -> None:
        await self.afs.fsync(req.fh)

    def release(self, req) -> None:
        self.afs.release_nowait(req.fh)

    # ---- extended attributes -------------------------------------------------
    def getxattr(self, req) -> bytes:
        return self.afs.getxattr_nowait(req.nodeid, req.name)

    def setxattr(self, req) -> None:
        # XATTR_CREATE / XATTR_REPLACE checked through getxattr first, as pyfuse3 does
        if req.flags & os.XATTR_CREATE:
            try:
                self.afs.getxattr_nowait(req.nodeid, req.name)
            except NoAttribute:
                pass
            else:
                raise fs_error(errno.EEXIST)
        elif req.flags & os.XATTR_REPLACE:
            self.afs.getxattr_nowait(req.nodeid, req.name)
        self.afs.setxattr_nowait(req.nodeid, req.name, bytes(req.value))

    def listxattr(self, req) -> list[bytes]:
        return self.afs.listxattr_nowait(req.nodeid)

    def removexattr(self, req) -> None:
        self.afs.removexattr_nowait(req.nodeid, req.name)

    # ---- filesystem ------------------------------------------------------------
    def statfs(self, req) -> StatfsOut:
        s = self.afs.statfs_nowait()
        return StatfsOut(blocks=s.blocks, bfree=s.bfree, bavail=s.bfree, files=s.files, ffree=s.ffree,
                         bsize=s.frsize, namelen=s.namemax, frsize=s.frsize)

    def access(self, req) -> None:
        return None  # mounted with default_permissions: the kernel checks modes itself

    async def syncfs(self, req) -> None:
        await self.afs.sync(None)

    def destroy(self, req) -> None:
        return None  # the daemon drains once every worker has exited
