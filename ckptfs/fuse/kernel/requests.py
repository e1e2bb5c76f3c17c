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
    header: Header
    major: int
    minor: int
    max_readahead: int
    flags: int  # 64 bits: flags2 << 32 folded in when FUSE_INIT_EXT is set


@_request("lookup")
class Lookup(Request):  # nodeid: the parent directory
    header: Header
    name: bytes


@_request("forget")
class Forget(Request):  # no reply
    header: Header
    nlookup: int

    @property
    def items(self) -> tuple[tuple[int, int], ...]:
        return ((self.header.nodeid, self.nlookup),)


@_request("batch_forget")
class BatchForget(Request):  # no reply
    header: Header
    items: tuple[tuple[int, int], ...]  # (nodeid, nlookup) pairs


@_request("getattr")
class Getattr(Request):
    header: Header
    flags: int
    fh: int  # meaningful when flags & FUSE_GETATTR_FH


@_request("setattr")
class Setattr(Request):
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
    header: Header


@_request("symlink")
class Symlink(Request):  # nodeid: the parent directory
    header: Header
    name: bytes
    target: bytes


@_request("mknod")
class Mknod(Request):
    header: Header
    name: bytes
    mode: int
    rdev: int
    umask: int


@_request("mkdir")
class Mkdir(Request):
    header: Header
    name: bytes
    mode: int
    umask: int


@_request("unlink")
class Unlink(Request):
    header: Header
    name: bytes


@_request("rmdir")
class Rmdir(Request):
    header: Header
    name: bytes


@_request("rename")
class Rename(Request):  # RENAME and RENAME2; nodeid: the old parent
    header: Header
    name: bytes
    newdir: int
    newname: bytes
    flags: int  # RENAME_NOREPLACE / RENAME_EXCHANGE / RENAME_WHITEOUT; 0 for plain RENAME


@_request("link")
class Link(Request):  # nodeid: the new parent
    header: Header
    oldnodeid: int
    name: bytes


@_request("open")
class Open(Request):
    header: Header
    flags: int       # the open(2) flags
    open_flags: int  # FUSE_OPEN_KILL_SUIDGID


@_request("read")
class Read(Request):
    header: Header
    fh: int
    offset: int
    size: int
    read_flags: int
    lock_owner: int
    flags: int


@_request("write")
class Write(Request):
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
    header: Header


@_request("release")
class Release(Request):
    header: Header
    fh: int
    flags: int
    release_flags: int
    lock_owner: int


@_request("releasedir")
class Releasedir(Release):
    pass


@_request("fsync")
class Fsync(Request):
    header: Header
    fh: int
    fsync_flags: int

    @property
    def datasync(self) -> bool:
        return bool(self.fsync_flags & abi.FUSE_FSYNC_FDATASYNC)


@_request("fsyncdir")
class Fsyncdir(Fsync):
    pass


@_request("setxattr")
class Setxattr(Request):
    header: Header
    name: bytes
    value: bytes
    flags: int  # XATTR_CREATE / XATTR_REPLACE
    setxattr_flags: int = 0


@_request("getxattr")
class Getxattr(Request):
    header: Header
    name: bytes
    size: int  # 0: the caller asks for the value's size


@_request("listxattr")
class Listxattr(Request):
    header: Header
    size: int  # 0: the caller asks for the list's size


@_request("removexattr")
class Removexattr(Request):
    header: Header
    name: bytes


@_request("flush")
class Flush(Request):
    header: Header
    fh: int
    lock_owner: int


@_request("opendir")
class Opendir(Request):
    header: Header
    flags: int
    open_flags: int


@_request("readdir")
class Readdir(Request):  # READDIR and READDIRPLUS
    header: Header
    fh: int
    offset: int  # 0, or the `off` cookie of the last entry already returned
    size: int
    plus: bool


@_request("access")
class Access(Request):
    header: Header
    mask: int


@_request("create")
class Create(Request):  # nodeid: the parent directory
    header: Header
    name: bytes
    flags: int
    mode: int
    umask: int
    open_flags: int


@_request("interrupt")
class Interrupt(Request):
    header: Header
    target: int  # the unique of the request to interrupt


@_request("destroy")
class Destroy(Request):
    header: Header


@_request("syncfs")
class Syncfs(Request):
    header: Header


@_request("lseek")
class Lseek(Request):
    header: Header
    fh: int
    offset: int
    whence: int


@_request("fallocate")
class Fallocate(Request):
    header: Header
    fh: int
    offset: int
    length: int
    mode: int


@_request("copy_file_range")
class CopyFileRange(Request):  # COPY_FILE_RANGE, or COPY_FILE_RANGE_64 (`wide`: a 64-bit reply)
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
    header: Header
    opcode: int
