"""The filesystem core: namespace + file contents + open handles, without FUSE.

`Filesystem` is what the FUSE adapter calls. Its methods take plain values
(inode numbers, bytes names, ints) and return `Inode` objects or buffers; they
raise `FsError` with the errno to report. Nothing here blocks: a write that
finds the arena full raises `NoSpace`; whether the caller then fails or waits
for the drain to free room is the adapter's business. That keeps this module
testable byte by byte with no mount.

Open handles remember how the file was opened (append, writable). Files
opened for writing are served with direct_io (no page cache in front, the
fast path measured in docs/PERFORMANCE.md). Read-only opens of files over
CACHED_READ_MAX too where the front end can still map such files shared
(`direct_reads`: the native engine with the kernel's FUSE_DIRECT_IO_ALLOW_MMAP):
a READ's reply then lands in the reader's own buffer, not in fresh page-cache
pages that the reader copies out of again. Smaller files there, and every file
elsewhere (pyfuse3), are read through the page cache, kept when the data has
not changed since the previous read-only open, so mmap readers (safetensors,
torch.load(mmap=True)) work and stay coherent, and the many small reads of a
small checkpoint are not a round trip each. A read-only handle's close commits
nothing (`noflush`: the front end may spare the kernel its FLUSH).

Set-user-ID and set-group-ID bits: a write, a truncate or an open with O_TRUNC
by a caller without CAP_FSETID clears them, by Linux's rules
(`setid_bits_to_drop`), and the change is a setattr like any other (it moves
ctime and reaches the journal). With direct_io the kernel leaves this to the
filesystem, and a FUSE write carries no credentials: a handle remembers the
`creds.Caller` that opened it, and each write checks the file's mode against
it. Callers pass None where no process is behind the request (the filesystem
itself, tests): None counts as privileged.

Extended attributes named ``ckptfs.*`` (no namespace prefix, so the kernel
never sends such a name) are ckptfs's own journaled bookkeeping, e.g. which
object a file being restored comes from (replicate/restore.py): hidden from
listxattr, never readable or writable through the filesystem.
"""
from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .arena import Arena
from ..errors import NoSpace, fs_error
from .creds import Caller
from .filemap import ChunkOwner, FileData, MemoryOwner, NeedsFetch
from .namespace import CONTENT_XATTR, HIDDEN_XATTR, Inode, Namespace

FRSIZE = 4096
SETID = stat.S_ISUID | stat.S_ISGID
# fallocate(2) modes (linux/falloc.h) that FUSE forwards; the kernel refuses the others itself
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE = 0x01, 0x02, 0x10
FALLOC_MODES = FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE
COPY_AHEAD = 16  # chunks of a copy's source fetched at once when it finds them evicted
# With direct reads, a read-only open of a file no larger than this still goes through the page
# cache: a small checkpoint is read in many small read() calls (torch.load: 12 for 1.6 MB), each a
# round trip when direct; cached, the kernel's read-ahead brings the file in one or two READs and
# an unchanged file read again costs none (keep_cache). docs/DESIGN.md "Why readers go direct".
CACHED_READ_MAX = 8 << 20


def setid_bits_to_drop(mode: int, gid: int, caller: Caller | None) -> int:
    """The set-user-ID / set-group-ID bits that a write or truncate by `caller` clears
    from a file of `mode` and group `gid`.

    Linux's setattr_should_drop_suidgid: regular files only, never for a caller with
    CAP_FSETID (or None); set-user-ID always; set-group-ID when group-execute is set
    or the caller is not in the file's group.
    """
    if not mode & SETID or caller is None or caller.fsetid or not stat.S_ISREG(mode):
        return 0
    drop = mode & stat.S_ISUID
    if mode & stat.S_ISGID and (mode & stat.S_IXGRP or not caller.in_group(gid)):
        drop |= stat.S_ISGID
    return drop


class Durability:
    """What the core tells the layer that makes things durable; this one does nothing.

    `record` hears every namespace mutation (the namespace observer), `dirtied`
    every change to a file's data, `closed` each point where a file's contents
    become a commit (last close of a writer, a truncate with no writer open).
    """

    def record(self, op: str, *args) -> None:
        pass

    def dirtied(self, inode: Inode) -> None:
        pass

    def closed(self, inode: Inode) -> None:
        pass

    def unnamed(self, inode: Inode) -> None:
        """`inode` (a file) lost its last name; `record` hears the mutation that did it next."""

    def usage(self) -> tuple[int, int] | None:
        """(capacity, used) bytes of the devices, or None when data lives only in memory."""
        return None


@dataclass
class Handle:
    """One open handle (`fh`): its inode, how it was opened and by whom. Made at open or create,
    dropped at release; `owners` grows as writes through it arrive (`wrote_from`)."""
    fh: int
    inode: Inode
    writable: bool
    append: bool
    caller: Caller | None = None  # who opened it: decides whether its writes clear setid bits
    owners: set[int] = field(default_factory=set)  # lock owners (fd tables) its writes came from


@dataclass(frozen=True)
class OpenResult:
    """What an open or create gives the front end: the handle number and how the kernel is to
    cache the file (`direct_io`, `keep_cache`, `noflush`)."""
    fh: int
    direct_io: bool
    keep_cache: bool
    noflush: bool = False  # a read-only handle: its close commits nothing, so it needs no FLUSH


@dataclass(frozen=True)
class FsStat:
    """What statfs reports: `blocks` and `bfree` in `frsize` units (the devices, or memory),
    inode counts and the longest name."""
    frsize: int
    blocks: int
    bfree: int
    files: int
    ffree: int
    namemax: int = 255


class Filesystem:
    """The core every front end calls (through the facade): it owns the namespace, the open
    handles and each file's data, and tells `durability` of every change and close."""

    def __init__(self, arena: Arena, *, capacity_bytes: int, uid: int = 0, gid: int = 0,
                 clock: Callable[[], int] = time.time_ns, owner: ChunkOwner | None = None,
                 durability: Durability | None = None, ns: Namespace | None = None):
        self.arena = arena
        self.capacity_bytes = capacity_bytes
        self.clock = clock
        self.owner = owner or MemoryOwner(arena)
        self.durability = durability or Durability()
        self.ns = ns or Namespace(uid=uid, gid=gid, clock=clock)
        self.ns.on_drop = self._on_drop
        self.ns.on_orphan = self._on_orphan
        self.ns.observer = self.durability.record
        self.ns.on_unnamed = self.durability.unnamed
        self.handles: dict[int, Handle] = {}
        self._next_fh = 1
        self._cached_version: dict[int, int] = {}  # ino -> data version the page cache holds
        self.direct_reads = False  # read-only opens direct_io too (set by the front end at INIT)...
        self.cached_read_max = CACHED_READ_MAX  # ...of files larger than this; smaller ones: page cache
        self._writers: dict[int, int] = {}  # ino -> open writable handles

    # ---- lifetime ------------------------------------------------------
    def _on_drop(self, inode: Inode) -> None:
        if inode.data is not None:
            inode.data.clear()
            inode.data = None
        self._cached_version.pop(inode.ino, None)

    def _on_orphan(self, inode: Inode) -> None:
        if inode.data is not None and inode.data.chunks:
            inode.data.clear()

    def _new_handle(self, inode: Inode, flags: int, caller: Caller | None) -> OpenResult:
        acc = flags & os.O_ACCMODE
        writable = acc in (os.O_WRONLY, os.O_RDWR)
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = Handle(fh, inode, writable, bool(flags & os.O_APPEND), caller)
        inode.opens += 1
        if writable:
            self._writers[inode.ino] = self._writers.get(inode.ino, 0) + 1
            return OpenResult(fh, direct_io=True, keep_cache=False)
        if self.direct_reads and inode.size > self.cached_read_max:
            return OpenResult(fh, direct_io=True, keep_cache=False, noflush=True)
        keep = (not self._writers.get(inode.ino)
                and self._cached_version.get(inode.ino) == inode.version)
        self._cached_version[inode.ino] = inode.version
        return OpenResult(fh, direct_io=False, keep_cache=keep, noflush=True)

    def handle(self, fh: int) -> Handle:
        try:
            return self.handles[fh]
        except KeyError:
            raise fs_error(errno.EBADF) from None

    # ---- namespace -----------------------------------------------------
    def lookup(self, parent: int, name: bytes) -> Inode:
        return self.ns.lookup(parent, name)

    def getattr(self, ino: int) -> Inode:
        return self.ns.get(ino)

    def _make(self, parent: int, name: bytes, mode: int, uid: int, gid: int, **kw) -> Inode:
        pdir = self.ns.get(parent)
        if pdir.mode & stat.S_ISGID and pdir.is_dir:
            # a setgid directory passes on its group (and, to subdirectories, the bit), as on ext4
            gid = pdir.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        inode = self.ns.make(parent, name, mode, uid, gid, **kw)
        if inode.is_reg:
            inode.data = FileData(self.owner, inode.ino)
        return inode

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> Inode:
        if stat.S_IFMT(mode) == 0:
            mode |= stat.S_IFREG
        if stat.S_ISDIR(mode) or stat.S_ISLNK(mode):
            raise fs_error(errno.EINVAL)
        return self._make(parent, name, mode, uid, gid, rdev=rdev)

    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        return self._make(parent, name, stat.S_IFDIR | (mode & 0o7777), uid, gid)

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        if len(target) > 4095:
            raise fs_error(errno.ENAMETOOLONG)
        return self._make(parent, name, stat.S_IFLNK | 0o777, uid, gid, target=bytes(target))

    @staticmethod
    def blocks(inode: Inode) -> int:
        """st_blocks: 512-byte units of the 4 KiB blocks the file's data holds (holes excluded)."""
        return inode.data.allocated_bytes // 512 if inode.data is not None else 0

    def readlink(self, ino: int) -> bytes:
        inode = self.ns.get(ino)
        if not stat.S_ISLNK(inode.mode):
            raise fs_error(errno.EINVAL)
        return inode.target

    def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int,
               caller: Caller | None = None) -> tuple[OpenResult, Inode]:
        inode = self._make(parent, name, stat.S_IFREG | (mode & 0o7777), uid, gid)
        return self._new_handle(inode, flags, caller), inode

    def link(self, ino: int, parent: int, name: bytes) -> Inode:
        return self.ns.link(ino, parent, name)

    def unlink(self, parent: int, name: bytes) -> None:
        self.ns.unlink(parent, name)

    def rmdir(self, parent: int, name: bytes) -> None:
        self.ns.rmdir(parent, name)

    def rename(self, p_old: int, n_old: bytes, p_new: int, n_new: bytes, flags: int = 0) -> None:
        self.ns.rename(p_old, n_old, p_new, n_new, flags)

    def forget(self, ino: int, n: int) -> None:
        self.ns.forget(ino, n)

    def readdir(self, ino: int, after: int) -> Iterator[tuple[bytes, Inode, int]]:
        """(name, inode, cookie) after cookie `after`: "." (1), ".." (2), then the entries."""
        dino = self.ns.dir_of(ino)
        d = dino.dir
        if after < 1:
            yield b".", dino, 1
        if after < 2:
            yield b"..", self.ns.get(dino.parent), 2
        for name, child, cookie in d.list_from(after):
            yield name, self.ns.inodes[child], cookie

    def opendir(self, ino: int) -> int:
        self.ns.dir_of(ino)
        return ino

    # ---- attributes ----------------------------------------------------
    def setattr(self, ino: int, *, mode: int | None = None, uid: int | None = None,
                gid: int | None = None, size: int | None = None, atime_ns: int | None = None,
                mtime_ns: int | None = None, caller: Caller | None = None) -> Inode:
        """Change what is given, and move ctime even when nothing is given: every attribute
        call moves it on Linux (chown(path, -1, -1) too, as on ext4; FUSE forwards that as a
        SETATTR with no fields, its ATTR_CTIME only with the writeback cache).

        A size change by `caller` clears setid bits as a write does, also from the mode the
        kernel sends along (FUSE's own rule keeps a set-group-ID bit without group-execute)."""
        inode = self.ns.get(ino)
        if size is not None:
            after = inode.mode if mode is None else stat.S_IFMT(inode.mode) | (mode & 0o7777)
            drop = setid_bits_to_drop(after, inode.gid, caller)
            if drop:
                mode = after & 0o7777 & ~drop
            self.truncate(inode, size)
        if size is None or any(v is not None for v in (mode, uid, gid, atime_ns, mtime_ns)):
            self.ns.setattr(ino, mode=mode, uid=uid, gid=gid, atime_ns=atime_ns, mtime_ns=mtime_ns)
        return inode

    def truncate(self, inode: Inode, size: int) -> None:
        if inode.is_dir:
            raise fs_error(errno.EISDIR)
        if not inode.is_reg:
            raise fs_error(errno.EINVAL)
        if size < 0:
            raise fs_error(errno.EINVAL)
        if size and inode.data.remote is not None:
            inode.data.remote.check_change()  # still being restored: wait for it (to zero cancels it)
        if size < inode.size:
            inode.data.truncate(size)
        inode.size = size
        self._contents_changed(inode)
        if not self._writers.get(inode.ino):
            self.durability.closed(inode)

    def getxattr(self, ino: int, name: bytes) -> bytes:
        if name.startswith(HIDDEN_XATTR):
            raise fs_error(errno.ENODATA)
        return self.ns.getxattr(ino, name)

    def listxattr(self, ino: int) -> list[bytes]:
        return [n for n in self.ns.get(ino).xattrs if not n.startswith(HIDDEN_XATTR)]

    def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        if name.startswith(HIDDEN_XATTR):
            raise fs_error(errno.EPERM, "reserved attribute")
        self.ns.setxattr(ino, name, value)

    def removexattr(self, ino: int, name: bytes) -> None:
        if name.startswith(HIDDEN_XATTR):
            raise fs_error(errno.EPERM, "reserved attribute")
        self.ns.removexattr(ino, name)

    # ---- data ----------------------------------------------------------
    def open(self, ino: int, flags: int, caller: Caller | None = None) -> OpenResult:
        inode = self.ns.get(ino)
        if inode.is_dir:
            raise fs_error(errno.EISDIR)
        if not inode.is_reg:
            raise fs_error(errno.ENXIO if not stat.S_ISLNK(inode.mode) else errno.ELOOP)
        result = self._new_handle(inode, flags, caller)
        # O_TRUNC truncates even with O_RDONLY, as on Linux (the kernel checked write permission)
        if flags & os.O_TRUNC:
            self._drop_setid(inode, caller)  # even when empty, as ext4
            if inode.size:
                self.truncate(inode, 0)
        return result

    def _drop_setid(self, inode: Inode, caller: Caller | None) -> None:
        drop = setid_bits_to_drop(inode.mode, inode.gid, caller)
        if drop:
            self.ns.setattr(inode.ino, mode=inode.mode & 0o7777 & ~drop)

    def read(self, fh: int, off: int, size: int):
        inode = self.handle(fh).inode
        return inode.data.read(off, size, inode.size)

    def read_pinned(self, fh: int, off: int, size: int):
        """As `read`, as views of the slots pinned until `owner.read_done` (filemap.Pinned)."""
        inode = self.handle(fh).inode
        return inode.data.read_pinned(off, size, inode.size)

    def write(self, fh: int, off: int, buf, kill_setid: bool | None = None, slot: int | None = None) -> int:
        """Write `buf` at `off` (at EOF for O_APPEND); short only when the arena filled up.

        Whether the write clears setid bits is decided by the caller that opened the handle,
        unless `kill_setid` says what the kernel knows of the writer itself (FUSE's
        FUSE_WRITE_KILL_SUIDGID: True, the writer lacks CAP_FSETID; False, it holds it).

        `slot`: `buf` lies at the start of this lent arena slot; a write of one whole chunk at a
        chunk boundary then adopts it instead of copying (the caller sees it is no longer lent)."""
        return self.writev(fh, off, (buf,), kill_setid, (slot,))

    def writev(self, fh: int, off: int, pieces, kill_setid: bool | None = None, slots=None, shift: int = 0) -> int:
        """`write` of `pieces` laid end to end from `off` (one request scattered over buffers);
        short only when the arena filled up (raises NoSpace / NeedsFetch when nothing was written).

        `slots[i]`: the lent arena slot `pieces[i]` starts at, or None; a piece that is one whole
        chunk at a chunk boundary adopts its slot, and so does a piece that starts a chunk and
        ends inside it (a write's last piece, or a small write) where the chunk holds nothing
        past its end (a new chunk, or one it overwrites whole: FileData.adoptable); the others
        are copied. `shift`: the first
        piece starts that many bytes into its slot instead; if it is the rest of a chunk from
        that offset in the chunk, it adopts its slot too (FileData.adopt, `at`), unless the
        chunk's head is the larger part: adopting copies those `at` bytes into the slot, so a
        piece shorter than the head is copied instead (a writer of 64 KiB pieces ends each
        chunk with one, and adopting it would copy 15/16 of the chunk)."""
        h = self.handle(fh)
        if not h.writable:
            raise fs_error(errno.EBADF)
        inode = h.inode
        if inode.mode & SETID:
            who = h.caller
            if kill_setid is not None and who is not None:
                who = who.with_fsetid(not kill_setid)
            self._drop_setid(inode, who)
        if h.append:
            off = inode.size
        cs = self.arena.chunk_size
        data = inode.data
        n = 0
        for i, piece in enumerate(pieces):
            slot = slots[i] if slots else None
            size = memoryview(piece).nbytes
            at = shift if i == 0 else 0  # where the piece starts in its slot
            idx, inner = divmod(off + n, cs)
            try:
                if slot is not None and inner == at and size == cs - at and at <= size:
                    got = data.adopt(idx, slot, at)
                elif slot is not None and inner == at == 0 and size < cs and data.adoptable(idx, size):
                    got = data.adopt(idx, slot, 0, size)
                else:
                    got = data.write(off + n, piece)
            except (NoSpace, NeedsFetch):
                if not n:
                    raise
                break  # short: what was written stays written
            n += got
            if got < size:
                break
        if off + n > inode.size:
            inode.size = off + n
        self._contents_changed(inode)
        return n

    def fallocate(self, fh: int, off: int, length: int, mode: int) -> None:
        """fallocate(2) through a writable handle. Mode 0 and KEEP_SIZE allocate: ckptfs holds no
        space for holes (its chunks take memory and device space as they are written), so this
        only checks that the range's missing chunks fit the free space now (ENOSPC otherwise, as
        ext4 would say) and, without KEEP_SIZE, extends the file with a hole; it reserves
        nothing, and st_blocks does not grow. PUNCH_HOLE (with KEEP_SIZE, the kernel sees to
        that) and ZERO_RANGE make the range read as zeros, freeing the chunks it covers
        (FileData.punch); ZERO_RANGE without KEEP_SIZE also extends the file. Other modes:
        EOPNOTSUPP. Raises NeedsFetch / NoSpace as a write does (nothing is half done that a
        retry would not finish); the change is committed at the writer's close, as a write's."""
        h = self.handle(fh)
        if not h.writable:
            raise fs_error(errno.EBADF)
        if mode & ~FALLOC_MODES:
            raise fs_error(errno.EOPNOTSUPP, "fallocate mode")
        if off < 0 or length <= 0:
            raise fs_error(errno.EINVAL)
        inode = h.inode
        if not inode.is_reg:
            raise fs_error(errno.ENODEV)
        end = off + length
        if mode & (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE):
            if off < inode.size:
                inode.data.punch(off, min(end, inode.size) - off)
        else:
            st = self.statfs()
            if inode.data.absent_bytes(off, length) > st.bfree * st.frsize:
                raise fs_error(errno.ENOSPC, "fallocate: not that much free space")
            if inode.data.remote is not None:
                inode.data.remote.check_change()
        if not mode & FALLOC_FL_KEEP_SIZE and end > inode.size:
            inode.size = end
        self._contents_changed(inode)

    def _contents_changed(self, inode: Inode) -> None:
        """A write, truncate or fallocate changed `inode`'s bytes: a new version and times, and the
        hidden attributes that described the old bytes (CONTENT_XATTR: a restore's object) go,
        journaled before the new bytes' commit, so no crash keeps them with other bytes."""
        inode.version += 1
        inode.mtime_ns = inode.ctime_ns = self.clock()
        if inode.xattrs:
            for name in [k for k in inode.xattrs if k.startswith(CONTENT_XATTR)]:
                self.ns.removexattr(inode.ino, name)
        self.durability.dirtied(inode)

    def copy_range(self, fh_in: int, off_in: int, fh_out: int, off_out: int, length: int) -> int:
        """copy_file_range(2) inside the mount: up to `length` bytes of `fh_in` from `off_in` to
        `fh_out` at `off_out`, returning how many were copied (0 at or past the source's end).
        The kernel has checked the modes, the limits and that a file's two ranges do not
        overlap. The bytes go from the source's slots straight into the destination's (a write,
        as `writev`: sizes, times, setid bits, committed at close), one destination chunk a
        step; a hole in the source is written as zeros. Short when, after some bytes, the source
        must be fetched or memory filled up (callers of copy_file_range ask again for the
        rest); raises NeedsFetch (the source's chunks missing from the next COPY_AHEAD chunks,
        so one fetch serves many steps) or NoSpace when nothing was copied."""
        src = self.handle(fh_in).inode
        if not self.handle(fh_out).writable:
            raise fs_error(errno.EBADF)
        if not src.is_reg:
            raise fs_error(errno.EINVAL)
        cs = self.arena.chunk_size
        end = min(off_in + length, src.size)
        n = 0
        while off_in + n < end:
            step = min(cs - (off_out + n) % cs, end - off_in - n)
            try:
                parts = src.data.read_pinned(off_in + n, step, src.size)
            except NeedsFetch as e:
                if n:
                    break
                if type(e) is NeedsFetch:  # not a restore: ask for the chunks ahead too
                    e = NeedsFetch(src.data.missing(off_in, min(end - off_in, COPY_AHEAD * cs), src.size))
                raise e from None
            try:
                got = self.writev(fh_out, off_out + n, parts)
            except (NoSpace, NeedsFetch):
                if n:
                    break
                raise
            finally:
                self.owner.read_done(parts.chunks)
            n += got
            if got < step:
                break
        return n

    def seek(self, fh: int, off: int, whence: int) -> int:
        """lseek's SEEK_DATA / SEEK_HOLE (the only kinds the kernel asks the filesystem): the
        offset, or ENXIO at or beyond the end of the file and for SEEK_DATA past the last data."""
        if whence not in (os.SEEK_DATA, os.SEEK_HOLE):
            raise fs_error(errno.EINVAL)
        inode = self.handle(fh).inode
        if off < 0 or off >= inode.size:
            raise fs_error(errno.ENXIO)
        pos = inode.data.seek(off, inode.size, whence == os.SEEK_HOLE)
        if pos is None:
            raise fs_error(errno.ENXIO)
        return pos

    def wrote_from(self, fh: int, owner: int) -> None:
        """A write through `fh` came from lock owner `owner` (the writer's file-descriptor table)."""
        self.handle(fh).owners.add(owner)

    def flush(self, fh: int, owner: int | None = None) -> None:
        """A close() of a descriptor (FLUSH comes synchronously with every close): a writer's close
        commits the file as it is now. `owner`: the closer's lock owner (its file-descriptor
        table; None where the front end cannot tell, pyfuse3): then only a close by a table the
        handle's writes came from (`wrote_from`) commits. A child that a fork gave a copy of the
        descriptor, closing it (exec, exit) while the parent is half way through the file, must
        not make that state, half written or just truncated, the one a crash keeps; a handle
        that wrote nothing commits at its RELEASE (below), as the last reference goes."""
        h = self.handle(fh)
        if h.writable and (owner is None or owner in h.owners):
            self.durability.closed(h.inode)

    def release(self, fh: int) -> None:
        """The last reference to a handle is gone. The kernel sends RELEASE asynchronously, after
        close() has returned, so the writer may already have opened the file again and be
        rewriting it: commit here only when no writer is left (otherwise that writer's close
        will), never a state another writer is still producing."""
        h = self.handles.pop(fh, None)
        if h is None:
            return
        inode = h.inode
        inode.opens -= 1
        if h.writable:
            left = self._writers[inode.ino] - 1
            if left:
                self._writers[inode.ino] = left
            else:
                del self._writers[inode.ino]
        if not self._writers.get(inode.ino):
            self.durability.closed(inode)
        self.ns.maybe_drop(inode)

    # ---- whole filesystem ----------------------------------------------
    def statfs(self) -> FsStat:
        usage = self.durability.usage()
        capacity, used = usage or (self.capacity_bytes, self.arena.used_slots * self.arena.chunk_size)
        blocks = capacity // FRSIZE
        free = max(0, capacity - used) // FRSIZE
        return FsStat(FRSIZE, blocks, free, 1 << 32, (1 << 32) - len(self.ns.inodes))

    def check_invariants(self) -> None:
        self.ns.check_invariants()
        self.arena.check_invariants()
        owned = [c.slot for i in self.ns.inodes.values() if i.data is not None for c in i.data.chunks.values()
                 if c.slot is not None]
        assert len(owned) == len(set(owned)), "slot owned by two chunks"
        for i in self.ns.inodes.values():
            if i.data is not None:
                assert i.data.allocated_bytes == i.data.count_held(), f"inode {i.ino}: allocated bytes miscounted"
        assert len(owned) + self.arena.free_slots + self.arena.lent_slots == self.arena.nslots, \
            "leaked arena slots"
