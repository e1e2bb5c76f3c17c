"""FUSE requests as typed values (pure: no I/O).

A request on /dev/fuse is a `fuse_in_header` (40 bytes) followed by the
opcode's fixed struct and then, for some opcodes, NUL-terminated names or a
data payload. `parse.py` turns those bytes into one dataclass per
opcode defined here (`Lookup`, `Write`, ...). Each carries the `Header`
(unique, nodeid, uid/gid/pid of the caller) and, as `method`, the name of the
handler method that serves it (session.py dispatches on it). Fields keep the
kernel's names; times are integer nanoseconds; names are bytes without their
NUL. `Write.pieces` are memoryviews of the buffers the payload was read into
(one, or several when the read scattered it, e.g. over arena slots);
`Write.data` is the payload in one buffer (a view when it is in one piece).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import abi


# Requests and replies are values, built once and never changed, but not `frozen=True`
# dataclasses: a frozen one's __init__ sets each field through object.__setattr__ (0.9 us for 8
# fields against 0.18), and every round trip builds a header, a request and a reply
# (docs/ENGINE.md, "Per-request cost").
value = dataclass(slots=True)


class ProtocolError(ValueError):
    """A request the codec cannot make sense of (truncated, garbled, inconsistent)."""


@value
class Header:
    """fuse_in_header: the request's `length`, `opcode` and `unique`, its inode (`nodeid`), and the
    caller's uid, gid and pid."""

    length: int
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int
    total_extlen: int = 0  # extensions after the arguments, in 8-byte units


class Request:
    """Base of every request: `header`, plus `unique` and `nodeid` from it."""

    __slots__ = ()
    method = ""
    header: Header

    @property
    def unique(self) -> int:
        return self.header.unique

    @property
    def nodeid(self) -> int:
        return self.header.nodeid


def _request(method: str):
    def wrap(cls):
        cls = value(cls)
        cls.method = method
        return cls
    return wrap


@_request("init")
class Init(Request):
    """INIT: the kernel's protocol version (`major`, `minor`), read-ahead and capability `flags`."""

    header: Header
    major: int
    minor: int
    max_readahead: int
    flags: int  # 64 bits: flags2 << 32 folded in when FUSE_INIT_EXT is set


@_request("lookup")
class Lookup(Request):  # nodeid: the parent directory
    """LOOKUP: the entry `name` in directory `header.nodeid`."""

    header: Header
    name: bytes


@_request("forget")
class Forget(Request):  # no reply
    """FORGET: inode `header.nodeid` loses `nlookup` of the kernel's lookups (no reply)."""

    header: Header
    nlookup: int

    @property
    def items(self) -> tuple[tuple[int, int], ...]:
        return ((self.header.nodeid, self.nlookup),)


@_request("batch_forget")
class BatchForget(Request):  # no reply
    """BATCH_FORGET: `items`, the (nodeid, nlookup) lookups the kernel drops at once (no reply)."""

    header: Header
    items: tuple[tuple[int, int], ...]  # (nodeid, nlookup) pairs


@_request("getattr")
class Getattr(Request):
    """GETATTR: the attributes of inode `header.nodeid` (`fh` when `flags` has FUSE_GETATTR_FH)."""

    header: Header
    flags: int
    fh: int  # meaningful when flags & FUSE_GETATTR_FH


@_request("setattr")
class Setattr(Request):
    """SETATTR: new attributes of inode `header.nodeid`; only those the FATTR_* bits of `valid` name apply."""

    header: Header
    valid: int  # FATTR_* bits saying which fields below apply
    fh: int
    size: int
    lock_owner: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    mode: int
    uid: int
    gid: int


@_request("readlink")
class Readlink(Request):
    """READLINK: the target of symlink `header.nodeid`."""

    header: Header


@_request("symlink")
class Symlink(Request):  # nodeid: the parent directory
    """SYMLINK: a symlink `name` to `target` in directory `header.nodeid`."""

    header: Header
    name: bytes
    target: bytes


@_request("mknod")
class Mknod(Request):
    """MKNOD: a node `name` of `mode` (device `rdev`) in directory `header.nodeid`; `umask`: the caller's."""

    header: Header
    name: bytes
    mode: int
    rdev: int
    umask: int


@_request("mkdir")
class Mkdir(Request):
    """MKDIR: a directory `name` of `mode` in directory `header.nodeid`; `umask`: the caller's."""

    header: Header
    name: bytes
    mode: int
    umask: int


@_request("unlink")
class Unlink(Request):
    """UNLINK: the entry `name` to remove from directory `header.nodeid`."""

    header: Header
    name: bytes


@_request("rmdir")
class Rmdir(Request):
    """RMDIR: the directory `name` to remove from directory `header.nodeid`."""

    header: Header
    name: bytes


@_request("rename")
class Rename(Request):  # RENAME and RENAME2; nodeid: the old parent
    """RENAME / RENAME2: `name` in directory `header.nodeid` becomes `newname` in `newdir`, as `flags` say."""

    header: Header
    name: bytes
    newdir: int
    newname: bytes
    flags: int  # RENAME_NOREPLACE / RENAME_EXCHANGE / RENAME_WHITEOUT; 0 for plain RENAME


@_request("link")
class Link(Request):  # nodeid: the new parent
    """LINK: a new name `name` in directory `header.nodeid` for inode `oldnodeid`."""

    header: Header
    oldnodeid: int
    name: bytes


@_request("open")
class Open(Request):
    """OPEN: open inode `header.nodeid` with the open(2) `flags`; `open_flags`: FUSE_OPEN_* bits."""

    header: Header
    flags: int       # the open(2) flags
    open_flags: int  # FUSE_OPEN_KILL_SUIDGID


@_request("read")
class Read(Request):
    """READ: `size` bytes at `offset` of handle `fh`."""

    header: Header
    fh: int
    offset: int
    size: int
    read_flags: int
    lock_owner: int
    flags: int


@_request("write")
class Write(Request):
    """WRITE: `size` bytes at `offset` of handle `fh`, the data in `pieces`; `lock_owner` is the
    writer's file-descriptor table when `write_flags` has FUSE_WRITE_LOCKOWNER."""

    header: Header
    fh: int
    offset: int
    size: int
    write_flags: int  # FUSE_WRITE_KILL_SUIDGID, ...
    lock_owner: int
    flags: int
    # the data: views of the buffers it was read into, in order (one unless the read scattered it
    # over several); valid until the handler returns, unless it keeps the buffers (see session)
    pieces: tuple[memoryview, ...]

    @property
    def data(self) -> memoryview:
        """The data in one buffer: a view when it is in one piece, else a copy joining the pieces."""
        if len(self.pieces) == 1:
            return self.pieces[0]
        return memoryview(b"".join(self.pieces))


@_request("statfs")
class Statfs(Request):
    """STATFS: the filesystem's statistics."""

    header: Header


@_request("release")
class Release(Request):
    """RELEASE: the last reference to handle `fh` is gone (`flags`: those it was opened with)."""

    header: Header
    fh: int
    flags: int
    release_flags: int
    lock_owner: int


@_request("releasedir")
class Releasedir(Release):
    """RELEASEDIR: the last reference to directory handle `fh` is gone (fields as for RELEASE)."""


@_request("fsync")
class Fsync(Request):
    """FSYNC: make handle `fh`'s file durable (`datasync`: its data only)."""

    header: Header
    fh: int
    fsync_flags: int

    @property
    def datasync(self) -> bool:
        return bool(self.fsync_flags & abi.FUSE_FSYNC_FDATASYNC)


@_request("fsyncdir")
class Fsyncdir(Fsync):
    """FSYNCDIR: make directory handle `fh` durable (fields as for FSYNC)."""


@_request("setxattr")
class Setxattr(Request):
    """SETXATTR: extended attribute `name` of inode `header.nodeid` set to `value`, as `flags` allow."""

    header: Header
    name: bytes
    value: bytes
    flags: int  # XATTR_CREATE / XATTR_REPLACE
    setxattr_flags: int = 0


@_request("getxattr")
class Getxattr(Request):
    """GETXATTR: the value of extended attribute `name` of inode `header.nodeid`, `size` bytes at most."""

    header: Header
    name: bytes
    size: int  # 0: the caller asks for the value's size


@_request("listxattr")
class Listxattr(Request):
    """LISTXATTR: the extended attribute names of inode `header.nodeid`, `size` bytes at most."""

    header: Header
    size: int  # 0: the caller asks for the list's size


@_request("removexattr")
class Removexattr(Request):
    """REMOVEXATTR: extended attribute `name` of inode `header.nodeid`, to remove."""

    header: Header
    name: bytes


@_request("flush")
class Flush(Request):
    """FLUSH: a close() of a descriptor of handle `fh`, by file-descriptor table `lock_owner`."""

    header: Header
    fh: int
    lock_owner: int


@_request("opendir")
class Opendir(Request):
    """OPENDIR: open directory `header.nodeid` (`flags`, `open_flags` as for OPEN)."""

    header: Header
    flags: int
    open_flags: int


@_request("readdir")
class Readdir(Request):  # READDIR and READDIRPLUS
    """READDIR / READDIRPLUS (`plus`): `size` bytes at most of directory handle `fh`'s entries after
    cookie `offset`."""

    header: Header
    fh: int
    offset: int  # 0, or the `off` cookie of the last entry already returned
    size: int
    plus: bool


@_request("access")
class Access(Request):
    """ACCESS: whether the caller may use inode `header.nodeid` as `mask` (R_OK, W_OK, X_OK) asks."""

    header: Header
    mask: int


@_request("create")
class Create(Request):  # nodeid: the parent directory
    """CREATE: a regular file `name` of `mode` in directory `header.nodeid`, opened with `flags`."""

    header: Header
    name: bytes
    flags: int
    mode: int
    umask: int
    open_flags: int


@_request("interrupt")
class Interrupt(Request):
    """INTERRUPT: the kernel gives up on request `target` (its unique)."""

    header: Header
    target: int  # the unique of the request to interrupt


@_request("destroy")
class Destroy(Request):
    """DESTROY: the kernel is done with the filesystem."""

    header: Header


@_request("syncfs")
class Syncfs(Request):
    """SYNCFS: make the whole filesystem durable."""

    header: Header


@_request("lseek")
class Lseek(Request):
    """LSEEK: the next data or hole (`whence`) at or after `offset` of handle `fh`."""

    header: Header
    fh: int
    offset: int
    whence: int


@_request("fallocate")
class Fallocate(Request):
    """FALLOCATE: allocate, punch or zero `length` bytes at `offset` of handle `fh`, as `mode` says."""

    header: Header
    fh: int
    offset: int
    length: int
    mode: int


@_request("copy_file_range")
class CopyFileRange(Request):  # COPY_FILE_RANGE, or COPY_FILE_RANGE_64 (`wide`: a 64-bit reply)
    """COPY_FILE_RANGE(_64): `length` bytes from `off_in` of handle `fh_in` to `off_out` of `fh_out`
    (inode `nodeid_out`)."""

    header: Header
    fh_in: int
    off_in: int
    nodeid_out: int
    fh_out: int
    off_out: int
    length: int
    flags: int
    wide: bool


@_request("")
class Unsupported(Request):  # an opcode this codec does not parse: the session replies ENOSYS
    """Any request whose `opcode` this codec does not parse."""

    header: Header
    opcode: int
