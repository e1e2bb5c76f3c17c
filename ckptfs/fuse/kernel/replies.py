"""FUSE replies as typed values, encoded to the kernel's bytes (pure: no I/O).

A reply is a `fuse_out_header` (16 bytes: total length, -errno, the request's
unique) followed by the opcode's reply struct or data. Handlers return the
typed values below; `frame()` turns one into the list of buffers the session
hands to `os.writev`, so data replies (READ from the arena, a device buffer)
go to the kernel without a copy in user space.

    EntryOut   LOOKUP, MKNOD, MKDIR, SYMLINK, LINK     fuse_entry_out (128 bytes)
    AttrOut    GETATTR, SETATTR                        fuse_attr_out (104)
    OpenOut    OPEN, OPENDIR                           fuse_open_out (16)
    CreateOut  CREATE                                  fuse_entry_out + fuse_open_out
    WriteOut   WRITE, COPY_FILE_RANGE                  fuse_write_out (8)
    CopiedOut  COPY_FILE_RANGE_64                      fuse_copy_file_range_out (8)
    StatfsOut  STATFS                                  fuse_statfs_out (80)
    XattrSize  GETXATTR / LISTXATTR with size 0        fuse_getxattr_out (8)
    LseekOut   LSEEK                                   fuse_lseek_out (8)
    InitOut    INIT                                    fuse_init_out (64)
    DirentBuffer  READDIR / READDIRPLUS                fuse_dirent / fuse_direntplus records
    bytes-like or a list of them: READ, READLINK, GETXATTR, LISTXATTR data

Errors are a bare header with a negative errno (`error_reply`); the kernel
accepts only 0 < errno < 512 (anything else is replaced by EIO here).
Times are integer nanoseconds in, (seconds, nanoseconds) out; timeouts are
float seconds.
"""
from __future__ import annotations

import errno as _errno
import functools
import stat as _stat

from . import abi
from .requests import value

_NS = 1_000_000_000
_U64 = 0xFFFF_FFFF_FFFF_FFFF  # a negative time64_t travels as its u64 image


@functools.lru_cache(maxsize=64)  # a filesystem uses a few timeouts, on every reply
def _split_timeout(seconds: float) -> tuple[int, int]:
    if seconds <= 0:
        return 0, 0
    whole = int(seconds)
    return whole, min(int((seconds - whole) * 1e9), 999_999_999)


_ATTR_PACK = abi.ATTR.pack


@value
class Attr:
    """struct fuse_attr."""

    ino: int
    mode: int
    size: int = 0
    blocks: int = 0  # 512-byte units
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    nlink: int = 1
    uid: int = 0
    gid: int = 0
    rdev: int = 0
    blksize: int = 4096
    flags: int = 0

    def pack(self) -> bytes:
        a, an = divmod(self.atime_ns, _NS)
        m, mn = divmod(self.mtime_ns, _NS)
        c, cn = divmod(self.ctime_ns, _NS)
        return _ATTR_PACK(self.ino, self.size, self.blocks, a & _U64, m & _U64, c & _U64, an, mn, cn, self.mode,
                          self.nlink, self.uid, self.gid, self.rdev, self.blksize, self.flags)


@value
class EntryOut:
    """A name's inode: nodeid 0 is a negative entry (cached ENOENT for entry_timeout)."""

    nodeid: int
    attr: Attr
    generation: int = 0
    entry_timeout: float = 1.0
    attr_timeout: float = 1.0

    def pack(self) -> bytes:
        es, en = _split_timeout(self.entry_timeout)
        as_, an = _split_timeout(self.attr_timeout)
        return abi.ENTRY_OUT_HEAD.pack(self.nodeid, self.generation, es, as_, en, an) + self.attr.pack()


@value
class AttrOut:
    """fuse_attr_out (GETATTR, SETATTR): the inode's `attr`, cached by the kernel `attr_timeout` seconds."""

    attr: Attr
    attr_timeout: float = 1.0

    def pack(self) -> bytes:
        s, n = _split_timeout(self.attr_timeout)
        return abi.ATTR_OUT_HEAD.pack(s, n, 0) + self.attr.pack()


@value
class OpenOut:
    """fuse_open_out (OPEN, OPENDIR): the handle `fh`, the FOPEN_* bits of `open_flags`, and
    `backing_id` with FOPEN_PASSTHROUGH."""

    fh: int
    open_flags: int = 0  # FOPEN_DIRECT_IO, FOPEN_KEEP_CACHE, FOPEN_PARALLEL_DIRECT_WRITES, ...
    backing_id: int = 0  # with FOPEN_PASSTHROUGH: an id from FUSE_DEV_IOC_BACKING_OPEN

    def pack(self) -> bytes:
        return abi.OPEN_OUT.pack(self.fh, self.open_flags, self.backing_id)


@value
class CreateOut:
    """CREATE's reply: the new file's `entry` (fuse_entry_out), then its `open` (fuse_open_out)."""

    entry: EntryOut
    open: OpenOut

    def pack(self) -> bytes:
        return self.entry.pack() + self.open.pack()


@value
class WriteOut:
    """fuse_write_out (WRITE, COPY_FILE_RANGE): the bytes written, `size`."""

    size: int

    def pack(self) -> bytes:
        return abi.WRITE_OUT.pack(self.size, 0)


@value
class StatfsOut:
    """fuse_statfs_out (STATFS): block and inode counts, block sizes and the longest name."""

    blocks: int
    bfree: int
    bavail: int
    files: int
    ffree: int
    bsize: int = 4096
    namelen: int = abi.NAME_MAX
    frsize: int = 4096

    def pack(self) -> bytes:
        return abi.KSTATFS.pack(self.blocks, self.bfree, self.bavail, self.files, self.ffree,
                                self.bsize, self.namelen, self.frsize, 0, 0, 0, 0, 0, 0, 0)


@value
class XattrSize:
    """The answer to GETXATTR/LISTXATTR with size 0: how many bytes the value or list takes."""

    size: int

    def pack(self) -> bytes:
        return abi.GETXATTR_OUT.pack(self.size, 0)


@value
class CopiedOut:
    """fuse_copy_file_range_out (COPY_FILE_RANGE_64): the bytes copied, `size`."""

    size: int

    def pack(self) -> bytes:
        return abi.COPY_FILE_RANGE_OUT.pack(self.size)


@value
class LseekOut:
    """fuse_lseek_out (LSEEK): the `offset` found."""

    offset: int

    def pack(self) -> bytes:
        return abi.LSEEK_OUT.pack(self.offset)


@value
class InitOut:
    """fuse_init_out (INIT): the protocol version, the limits and the capability `flags` agreed on."""

    major: int
    minor: int
    max_readahead: int
    flags: int  # 64 bits; the high half goes out as flags2
    max_background: int
    congestion_threshold: int
    max_write: int
    time_gran: int = 1
    max_pages: int = 0
    map_alignment: int = 0
    max_stack_depth: int = 0

    def pack(self) -> bytes:
        return abi.INIT_OUT.pack(self.major, self.minor, self.max_readahead, self.flags & 0xFFFF_FFFF,
                                 self.max_background, self.congestion_threshold, self.max_write,
                                 self.time_gran, self.max_pages, self.map_alignment,
                                 self.flags >> 32, self.max_stack_depth)


def dirent_type(mode: int) -> int:
    """The d_type of a dirent for an st_mode (DT_* = the S_IFMT bits >> 12)."""
    return _stat.S_IFMT(mode) >> 12


class DirentBuffer:
    """READDIR / READDIRPLUS reply data, filled entry by entry until `size` is reached.

    `add()` packs one entry and returns True, or returns False (packing nothing)
    when it would not fit: stop there, as with pyfuse3's readdir_reply. Every
    record is padded to 8 bytes. `off` is the cookie the kernel passes back as
    the next READDIR's offset to continue after this entry. For READDIRPLUS each
    packed entry with a nodeid other than "." and ".." counts as one lookup.
    """

    __slots__ = ("size", "plus", "_parts", "_used", "count")

    def __init__(self, size: int, plus: bool = False):
        self.size = size
        self.plus = plus
        self._parts: list[bytes] = []
        self._used = 0
        self.count = 0

    def add(self, name: bytes, off: int, *, ino: int = 0, mode: int = 0, entry: EntryOut | None = None) -> bool:
        if not name or len(name) > abi.NAME_MAX or b"/" in name or b"\0" in name:
            raise ValueError(f"invalid directory entry name {name!r}")
        if self.plus:
            if entry is None:
                raise ValueError("a READDIRPLUS entry needs its EntryOut")
            ino, mode = entry.attr.ino, entry.attr.mode
        head = abi.DIRENT.pack(ino, off, len(name), dirent_type(mode))
        rec = head + name
        pad = abi.align8(len(rec)) - len(rec)
        need = len(rec) + pad + (abi.ENTRY_OUT_SIZE if self.plus else 0)
        if self._used + need > self.size:
            return False
        if self.plus:
            self._parts.append(entry.pack())
        self._parts.append(rec + b"\0" * pad)
        self._used += need
        self.count += 1
        return True

    def __len__(self) -> int:
        return self._used

    def pack(self) -> bytes:
        return b"".join(self._parts)


def out_header(unique: int, error: int, payload_len: int) -> bytes:
    """fuse_out_header for a reply of payload_len bytes; `error` is 0 or a positive errno."""
    return abi.OUT_HEADER.pack(abi.OUT_HEADER.size + payload_len, -error, unique)


def error_reply(unique: int, err: int) -> bytes:
    """The whole reply for a failed request (an unknown or out-of-range errno becomes EIO)."""
    if not 0 < err < 512:
        err = _errno.EIO
    return out_header(unique, err, 0)


def frame(unique: int, reply) -> list:
    """The buffers of a successful reply, ready for os.writev: header first.

    `reply` is None (an empty reply), a typed reply with `pack()`, a bytes-like
    object, or a list/tuple of bytes-like objects (written as they are).
    """
    if reply is None:
        parts = []
    elif isinstance(reply, (bytes, bytearray, memoryview)):
        parts = [reply]
    elif isinstance(reply, (list, tuple)):
        parts = list(reply)
    else:
        body = reply.pack()
        return [out_header(unique, 0, len(body)), body]
    n = 0
    for p in parts:
        n += p.nbytes if isinstance(p, memoryview) else len(p)
    return [out_header(unique, 0, n), *parts]
