"""Parse what the kernel sends into the typed requests of requests.py (pure: no I/O).

`parse_header` reads the 40-byte `fuse_in_header`, `parse_request` the rest.
Nothing is trusted: a body shorter than its struct, a name without its NUL,
stray bytes after the last name, a payload whose size disagrees with its
struct, or a length field that disagrees with the bytes received raises
`ProtocolError` with a message naming the opcode, the unique and the numbers,
and nothing else. The session replies EIO to such a request and goes on.

WRITE payloads are never copied: `Write.pieces` are memoryviews of the
buffers they were read into (`payload`, when the session read the request
into more than one buffer, else the tail of `body`); `payload` may itself be
a list of buffers a readv scattered the data over, in order, and the pieces
are then views of each. Everything else is small and copied into
`bytes`. Request extensions (`total_extlen`: security contexts, supplementary
groups, never negotiated here) are cut off the end and ignored.

`RequestDecoder` is the same codec fed a byte stream in arbitrary pieces
(h11-style): /dev/fuse hands out one whole request per read, but tests and
recorded traces do not.
"""
from __future__ import annotations

from . import abi
from .abi import Op
from .requests import (Access, BatchForget, CopyFileRange, Create, Destroy, Fallocate, Flush, Forget, Fsync,
                       Fsyncdir, Getattr, Getxattr, Header, Init, Interrupt, Link, Listxattr, Lookup, Lseek, Mkdir,
                       Mknod, Open, Opendir, ProtocolError, Read, Readdir, Readlink, Release, Releasedir,
                       Removexattr, Rename, Request, Rmdir, Setattr, Setxattr, Statfs, Symlink, Syncfs, Unlink,
                       Unsupported, Write)


def parse_header(buf) -> Header:
    """The `fuse_in_header` at the start of `buf` (at least 40 bytes)."""
    if len(buf) < abi.IN_HEADER.size:
        raise ProtocolError(f"fuse_in_header needs {abi.IN_HEADER.size} bytes, got {len(buf)}")
    length, opcode, unique, nodeid, uid, gid, pid, extlen, _ = abi.IN_HEADER.unpack_from(buf, 0)
    if length < abi.IN_HEADER.size:
        raise ProtocolError(f"request length field {length} is shorter than its own header")
    return Header(length, opcode, unique, nodeid, uid, gid, pid, extlen)


# ---- parsing -----------------------------------------------------------------------------
def _op_name(opcode: int) -> str:
    try:
        return f"FUSE_{Op(opcode).name}"
    except ValueError:
        return f"opcode {opcode}"


def _fixed(h: Header, body, st, what: str) -> tuple:
    if len(body) < st.size:
        raise ProtocolError(f"{_op_name(h.opcode)} (unique {h.unique}): body of {len(body)} bytes "
                            f"is shorter than {what} ({st.size} bytes)")
    return st.unpack_from(body, 0)


def _names(h: Header, body, start: int, count: int) -> list[bytes]:
    """`count` NUL-terminated names filling body[start:] exactly."""
    raw = bytes(body[start:])
    out, pos = [], 0
    for i in range(count):
        end = raw.find(b"\0", pos)
        if end < 0:
            raise ProtocolError(f"{_op_name(h.opcode)} (unique {h.unique}): name {i + 1} of {count} "
                                f"is not NUL-terminated ({len(raw) - pos} bytes left)")
        out.append(raw[pos:end])
        pos = end + 1
    if pos != len(raw):
        raise ProtocolError(f"{_op_name(h.opcode)} (unique {h.unique}): {len(raw) - pos} stray bytes "
                            f"after the last name")
    return out


def _exact(h: Header, body, size: int, what: str) -> None:
    if len(body) != size:
        raise ProtocolError(f"{_op_name(h.opcode)} (unique {h.unique}): body of {len(body)} bytes, "
                            f"expected {size} ({what})")


def _ns(sec: int, nsec: int) -> int:
    if sec >= 1 << 63:  # the kernel's u64 seconds hold a signed time64_t
        sec -= 1 << 64
    return sec * 1_000_000_000 + nsec


def _parse_init(h, body, ext):
    if len(body) >= abi.INIT_IN.size:
        major, minor, readahead, flags, flags2 = abi.INIT_IN.unpack_from(body, 0)
        if flags & abi.FUSE_INIT_EXT:
            flags |= flags2 << 32
    else:
        major, minor, readahead, flags = _fixed(h, body, abi.INIT_IN_V1, "fuse_init_in")
    return Init(h, major, minor, readahead, flags)


def _parse_batch_forget(h, body, ext):
    count, _ = _fixed(h, body, abi.BATCH_FORGET_IN, "fuse_batch_forget_in")
    _exact(h, body, abi.BATCH_FORGET_IN.size + count * abi.FORGET_ONE.size, f"{count} forget entries")
    return BatchForget(h, tuple(abi.FORGET_ONE.iter_unpack(body[abi.BATCH_FORGET_IN.size:])))


def _parse_setattr(h, body, ext):
    (valid, _, fh, size, owner, atime, mtime, ctime, atimens, mtimens, ctimens, mode, _u4, uid, gid,
     _u5) = _fixed(h, body, abi.SETATTR_IN, "fuse_setattr_in")
    return Setattr(h, valid, fh, size, owner, _ns(atime, atimens), _ns(mtime, mtimens),
                   _ns(ctime, ctimens), mode, uid, gid)


def _parse_rename(h, body, ext):
    if h.opcode == Op.RENAME2:
        newdir, flags, _ = _fixed(h, body, abi.RENAME2_IN, "fuse_rename2_in")
        start = abi.RENAME2_IN.size
    else:
        (newdir,), flags, start = _fixed(h, body, abi.RENAME_IN, "fuse_rename_in"), 0, abi.RENAME_IN.size
    old, new = _names(h, body, start, 2)
    return Rename(h, old, newdir, new, flags)


def _parse_setxattr(h, body, ext):
    if ext:
        size, flags, sflags, _ = _fixed(h, body, abi.SETXATTR_IN_EXT, "fuse_setxattr_in (ext)")
        start = abi.SETXATTR_IN_EXT.size
    else:
        (size, flags), sflags, start = _fixed(h, body, abi.SETXATTR_IN, "fuse_setxattr_in"), 0, abi.SETXATTR_IN.size
    raw = bytes(body[start:])
    end = raw.find(b"\0")
    if end < 0:
        raise ProtocolError(f"FUSE_SETXATTR (unique {h.unique}): the name is not NUL-terminated")
    value = raw[end + 1:]
    if len(value) != size:
        raise ProtocolError(f"FUSE_SETXATTR (unique {h.unique}): value of {len(value)} bytes, "
                            f"fuse_setxattr_in.size says {size}")
    return Setxattr(h, raw[:end], value, flags, sflags)


def _parse_release(cls):
    def parse(h, body, ext):
        fh, flags, rflags, owner = _fixed(h, body, abi.RELEASE_IN, "fuse_release_in")
        return cls(h, fh, flags, rflags, owner)
    return parse


def _parse_fsync(cls):
    def parse(h, body, ext):
        fh, fflags, _ = _fixed(h, body, abi.FSYNC_IN, "fuse_fsync_in")
        return cls(h, fh, fflags)
    return parse


def _parse_readdir(h, body, ext):
    fh, offset, size, _rf, _owner, _flags, _ = _fixed(h, body, abi.READ_IN, "fuse_read_in")
    return Readdir(h, fh, offset, size, h.opcode == Op.READDIRPLUS)


def _parse_read(h, body, ext):
    fh, offset, size, rflags, owner, flags, _ = _fixed(h, body, abi.READ_IN, "fuse_read_in")
    return Read(h, fh, offset, size, rflags, owner, flags)


def _name_after(st, what, build):
    def parse(h, body, ext):
        fields = _fixed(h, body, st, what) if st is not None else ()
        (name,) = _names(h, body, st.size if st is not None else 0, 1)
        return build(h, fields, name)
    return parse


def _no_body(cls):
    return lambda h, body, ext: cls(h)


_PARSERS = {
    Op.INIT: _parse_init,
    Op.LOOKUP: _name_after(None, "", lambda h, f, n: Lookup(h, n)),
    Op.FORGET: lambda h, body, ext: Forget(h, _fixed(h, body, abi.FORGET_IN, "fuse_forget_in")[0]),
    Op.BATCH_FORGET: _parse_batch_forget,
    Op.GETATTR: lambda h, body, ext: Getattr(h, *_fixed(h, body, abi.GETATTR_IN, "fuse_getattr_in")[::2]),
    Op.SETATTR: _parse_setattr,
    Op.READLINK: _no_body(Readlink),
    Op.SYMLINK: lambda h, body, ext: Symlink(h, *_names(h, body, 0, 2)),
    Op.MKNOD: _name_after(abi.MKNOD_IN, "fuse_mknod_in", lambda h, f, n: Mknod(h, n, f[0], f[1], f[2])),
    Op.MKDIR: _name_after(abi.MKDIR_IN, "fuse_mkdir_in", lambda h, f, n: Mkdir(h, n, f[0], f[1])),
    Op.UNLINK: _name_after(None, "", lambda h, f, n: Unlink(h, n)),
    Op.RMDIR: _name_after(None, "", lambda h, f, n: Rmdir(h, n)),
    Op.RENAME: _parse_rename,
    Op.RENAME2: _parse_rename,
    Op.LINK: _name_after(abi.LINK_IN, "fuse_link_in", lambda h, f, n: Link(h, f[0], n)),
    Op.OPEN: lambda h, body, ext: Open(h, *_fixed(h, body, abi.OPEN_IN, "fuse_open_in")),
    Op.READ: _parse_read,
    Op.STATFS: _no_body(Statfs),
    Op.RELEASE: _parse_release(Release),
    Op.RELEASEDIR: _parse_release(Releasedir),
    Op.FSYNC: _parse_fsync(Fsync),
    Op.FSYNCDIR: _parse_fsync(Fsyncdir),
    Op.SETXATTR: _parse_setxattr,
    Op.GETXATTR: _name_after(abi.GETXATTR_IN, "fuse_getxattr_in", lambda h, f, n: Getxattr(h, n, f[0])),
    Op.LISTXATTR: lambda h, body, ext: Listxattr(h, _fixed(h, body, abi.GETXATTR_IN, "fuse_getxattr_in")[0]),
    Op.REMOVEXATTR: _name_after(None, "", lambda h, f, n: Removexattr(h, n)),
    Op.FLUSH: lambda h, body, ext: Flush(h, *_fixed(h, body, abi.FLUSH_IN, "fuse_flush_in")[::3]),
    Op.OPENDIR: lambda h, body, ext: Opendir(h, *_fixed(h, body, abi.OPEN_IN, "fuse_open_in")),
    Op.READDIR: _parse_readdir,
    Op.READDIRPLUS: _parse_readdir,
    Op.ACCESS: lambda h, body, ext: Access(h, _fixed(h, body, abi.ACCESS_IN, "fuse_access_in")[0]),
    Op.CREATE: _name_after(abi.CREATE_IN, "fuse_create_in",
                           lambda h, f, n: Create(h, n, f[0], f[1], f[2], f[3])),
    Op.INTERRUPT: lambda h, body, ext: Interrupt(h, _fixed(h, body, abi.INTERRUPT_IN, "fuse_interrupt_in")[0]),
    Op.DESTROY: _no_body(Destroy),
    Op.SYNCFS: _no_body(Syncfs),
    Op.LSEEK: lambda h, body, ext: Lseek(h, *_fixed(h, body, abi.LSEEK_IN, "fuse_lseek_in")[:3]),
    Op.FALLOCATE: lambda h, body, ext: Fallocate(h, *_fixed(h, body, abi.FALLOCATE_IN, "fuse_fallocate_in")[:4]),
    Op.COPY_FILE_RANGE: lambda h, body, ext: CopyFileRange(
        h, *_fixed(h, body, abi.COPY_FILE_RANGE_IN, "fuse_copy_file_range_in"), False),
    Op.COPY_FILE_RANGE_64: lambda h, body, ext: CopyFileRange(
        h, *_fixed(h, body, abi.COPY_FILE_RANGE_IN, "fuse_copy_file_range_in"), True),
}


def _buffers(payload) -> list[memoryview]:
    """`payload` (one buffer, or a list or tuple of them) as a list of byte views."""
    if isinstance(payload, (list, tuple)):
        return [memoryview(p).cast("B") for p in payload]
    return [memoryview(payload).cast("B")]


def parse_write(h: Header, body, payload=None) -> Write:
    """A WRITE: `body` starts with fuse_write_in; the data is `payload` if given (one buffer, or a
    list of them: the pieces of a scattered read, empty ones left out), else the rest of body."""
    fh, offset, size, wflags, owner, flags, _ = _fixed(h, body, abi.WRITE_IN, "fuse_write_in")
    if payload is None:
        pieces = [memoryview(body)[abi.WRITE_IN.size:]]
    else:
        pieces = [p for p in _buffers(payload) if p.nbytes] or [memoryview(b"")]
    got = sum(p.nbytes for p in pieces)
    if got != size:
        raise ProtocolError(f"FUSE_WRITE (unique {h.unique}): {got} bytes of data, "
                            f"fuse_write_in.size says {size}")
    return Write(h, fh, offset, size, wflags, owner, flags, tuple(pieces))


def parse_request(header, body, payload=None, *, setxattr_ext: bool = False) -> Request:
    """The typed request made of `header` (a Header or its 40 raw bytes) and the bytes after it.

    `payload` is what a split read put after the header buffer (see session.py): one buffer,
    or a list of buffers a readv scattered it over. A WRITE's data stays in it uncopied; for
    any other opcode it is joined to `body`.
    `setxattr_ext`: whether FUSE_SETXATTR_EXT was negotiated (a longer fuse_setxattr_in).
    Raises ProtocolError for anything truncated or inconsistent.
    """
    h = header if isinstance(header, Header) else parse_header(header)
    got = abi.IN_HEADER.size + len(body)
    if payload is not None:
        buffers = _buffers(payload)
        got += sum(b.nbytes for b in buffers)
    if got != h.length:
        raise ProtocolError(f"{_op_name(h.opcode)} (unique {h.unique}): length field says {h.length} "
                            f"bytes, the request has {got}")
    if h.opcode == Op.WRITE:
        return parse_write(h, body, None if payload is None else buffers)
    if payload is not None and any(b.nbytes for b in buffers):
        body = b"".join([bytes(body), *buffers])
    if h.total_extlen:
        ext = h.total_extlen * 8
        if ext > len(body):
            raise ProtocolError(f"{_op_name(h.opcode)} (unique {h.unique}): {ext} bytes of extensions "
                                f"in a body of {len(body)}")
        body = body[:len(body) - ext]  # security contexts / supplementary groups: not negotiated, ignored
    parser = _PARSERS.get(h.opcode)
    if parser is None:
        return Unsupported(h, h.opcode)
    return parser(h, memoryview(body), setxattr_ext)


class RequestDecoder:
    """Requests out of a byte stream fed in any pieces: ``feed(data)``, then
    ``next_request()`` until it returns None (it needs more bytes)."""

    def __init__(self, *, setxattr_ext: bool = False):
        self._buf = bytearray()
        self.setxattr_ext = setxattr_ext

    def feed(self, data) -> None:
        self._buf += data

    @property
    def pending(self) -> int:
        """Bytes received that are not yet a whole request."""
        return len(self._buf)

    def next_request(self) -> Request | None:
        if len(self._buf) < abi.IN_HEADER.size:
            return None
        h = parse_header(self._buf)
        if len(self._buf) < h.length:
            return None
        raw = bytes(self._buf[:h.length])
        del self._buf[:h.length]
        return parse_request(h, memoryview(raw)[abi.IN_HEADER.size:], setxattr_ext=self.setxattr_ext)
