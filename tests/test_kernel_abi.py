"""The FUSE kernel codec driven directly (pure: no /dev/fuse, no mount).

The tests play the kernel: they build requests byte by byte from the layouts
of include/uapi/linux/fuse.h, parse them, and decode the replies the codec
encodes. Sizes are pinned to the numbers checked on the kernel.
"""
import errno
import os
import random

import pytest

from ckptfs.fuse.kernel import abi
from ckptfs.fuse.kernel.abi import Op
from ckptfs.fuse.kernel.negotiate import DEFAULT_WANT, negotiate
from ckptfs.fuse.kernel.replies import (Attr, AttrOut, CopiedOut, CreateOut, DirentBuffer, EntryOut, InitOut, LseekOut,
                                   OpenOut, StatfsOut, WriteOut, XattrSize, error_reply, frame, out_header)
from ckptfs.fuse.kernel.parse import RequestDecoder, parse_header, parse_request
from ckptfs.fuse.kernel.requests import (BatchForget, CopyFileRange, Create, Fallocate, Forget, Getattr, Getxattr,
                                    Init, Link, Listxattr, Lookup, Lseek, Mkdir, Mknod, Open, ProtocolError, Read,
                                    Readdir, Release, Releasedir, Rename, Setattr, Setxattr, Symlink, Unsupported,
                                    Write)

UID, GID, PID = 1000, 1001, 4242


def raw(opcode: int, body: bytes, *, unique: int = 2, nodeid: int = 1, extlen: int = 0,
        length: int | None = None) -> bytes:
    """A request as the kernel writes it."""
    n = abi.IN_HEADER.size + len(body) if length is None else length
    return abi.IN_HEADER.pack(n, opcode, unique, nodeid, UID, GID, PID, extlen, 0) + body


def parse(data: bytes, **kw):
    return parse_request(data[:40], memoryview(data)[40:], **kw)


def test_sizes_match_the_kernel():
    layouts = {
        "fuse_in_header": abi.IN_HEADER.size, "fuse_out_header": abi.OUT_HEADER.size,
        "fuse_write_in": abi.WRITE_IN.size, "fuse_read_in": abi.READ_IN.size, "fuse_attr": abi.ATTR.size,
        "fuse_entry_out": abi.ENTRY_OUT_SIZE, "fuse_attr_out": abi.ATTR_OUT_SIZE,
        "fuse_open_out": abi.OPEN_OUT.size, "fuse_init_out": abi.INIT_OUT.size,
        "fuse_kstatfs": abi.KSTATFS.size, "fuse_setattr_in": abi.SETATTR_IN.size,
        "fuse_dirent": abi.DIRENT.size, "fuse_release_in": abi.RELEASE_IN.size, "fuse_flush_in": abi.FLUSH_IN.size,
        "fuse_create_in": abi.CREATE_IN.size, "fuse_mknod_in": abi.MKNOD_IN.size,
        "fuse_rename2_in": abi.RENAME2_IN.size, "fuse_fallocate_in": abi.FALLOCATE_IN.size,
        "fuse_lseek_in": abi.LSEEK_IN.size, "fuse_backing_map": abi.BACKING_MAP.size,
        "fuse_copy_file_range_in": abi.COPY_FILE_RANGE_IN.size,
        "fuse_copy_file_range_out": abi.COPY_FILE_RANGE_OUT.size,
    }
    assert layouts == abi.SIZES
    # the field notes' numbers, spelled out
    assert (abi.IN_HEADER.size, abi.OUT_HEADER.size, abi.WRITE_IN.size, abi.ATTR.size, abi.ENTRY_OUT_SIZE,
            abi.ATTR_OUT_SIZE, abi.OPEN_OUT.size, abi.INIT_OUT.size, abi.KSTATFS.size) == (40, 16, 40, 88, 128,
                                                                                             104, 16, 64, 80)
    assert abi.INIT_IN.size + 44 == abi.INIT_IN_SIZE == 64
    assert abi.WRITE_HEADER_SIZE == 80


def test_ioctl_numbers():
    assert abi.FUSE_DEV_IOC_CLONE == 0x8004E500
    assert abi.FUSE_DEV_IOC_BACKING_OPEN == 0x4010E501
    assert abi.FUSE_DEV_IOC_BACKING_CLOSE == 0x4004E502
    assert abi.FUSE_PASSTHROUGH == 1 << 37 and abi.FUSE_INIT_EXT == 1 << 30 and abi.FUSE_MAX_PAGES == 1 << 22


def test_header():
    h = parse_header(raw(Op.GETATTR, b"", unique=77, nodeid=9))
    assert (h.length, h.opcode, h.unique, h.nodeid, h.uid, h.gid, h.pid) == (40, Op.GETATTR, 77, 9, UID, GID, PID)
    with pytest.raises(ProtocolError, match="needs 40 bytes"):
        parse_header(b"\0" * 39)
    with pytest.raises(ProtocolError, match="shorter than its own header"):
        parse_header(raw(Op.GETATTR, b"", length=12))


SETATTR = abi.SETATTR_IN.pack(abi.FATTR_MODE | abi.FATTR_SIZE | abi.FATTR_MTIME, 0, 5, 1 << 40, 0, 1, 2, 3,
                              10, 20, 30, 0o100600, 0, 7, 8, 0)
# (opcode, body, expected type, expected fields); every strict prefix of each body must be refused
CASES = [
    (Op.LOOKUP, b"name\0", Lookup, {"name": b"name", "nodeid": 1}),
    (Op.FORGET, abi.FORGET_IN.pack(3), Forget, {"nlookup": 3, "items": ((1, 3),)}),
    (Op.BATCH_FORGET, abi.BATCH_FORGET_IN.pack(2, 0) + abi.FORGET_ONE.pack(5, 1) + abi.FORGET_ONE.pack(6, 9),
     BatchForget, {"items": ((5, 1), (6, 9))}),
    (Op.GETATTR, abi.GETATTR_IN.pack(abi.FUSE_GETATTR_FH, 0, 12), Getattr, {"flags": 1, "fh": 12}),
    (Op.SETATTR, SETATTR, Setattr, {"valid": abi.FATTR_MODE | abi.FATTR_SIZE | abi.FATTR_MTIME, "fh": 5,
                                    "size": 1 << 40, "atime_ns": 1_000_000_010, "mtime_ns": 2_000_000_020,
                                    "ctime_ns": 3_000_000_030, "mode": 0o100600, "uid": 7, "gid": 8}),
    (Op.SYMLINK, b"link\0/some/target\0", Symlink, {"name": b"link", "target": b"/some/target"}),
    (Op.MKNOD, abi.MKNOD_IN.pack(0o10644, 0, 0o22, 0) + b"fifo\0", Mknod,
     {"name": b"fifo", "mode": 0o10644, "rdev": 0, "umask": 0o22}),
    (Op.MKDIR, abi.MKDIR_IN.pack(0o755, 0o22) + b"d\0", Mkdir, {"name": b"d", "mode": 0o755, "umask": 0o22}),
    (Op.RENAME, abi.RENAME_IN.pack(4) + b"a\0bb\0", Rename, {"name": b"a", "newdir": 4, "newname": b"bb", "flags": 0}),
    (Op.RENAME2, abi.RENAME2_IN.pack(4, 1, 0) + b"a\0bb\0", Rename,
     {"name": b"a", "newdir": 4, "newname": b"bb", "flags": 1}),
    (Op.LINK, abi.LINK_IN.pack(9) + b"hard\0", Link, {"oldnodeid": 9, "name": b"hard"}),
    (Op.OPEN, abi.OPEN_IN.pack(os.O_WRONLY | os.O_TRUNC, abi.FUSE_OPEN_KILL_SUIDGID), Open,
     {"flags": os.O_WRONLY | os.O_TRUNC, "open_flags": 1}),
    (Op.READ, abi.READ_IN.pack(3, 4096, 131072, 0, 0, os.O_RDONLY, 0), Read, {"fh": 3, "offset": 4096, "size": 131072}),
    (Op.WRITE, abi.WRITE_IN.pack(3, 10, 5, abi.FUSE_WRITE_KILL_SUIDGID, 0, 0, 0) + b"hello", Write,
     {"fh": 3, "offset": 10, "size": 5, "write_flags": abi.FUSE_WRITE_KILL_SUIDGID}),
    (Op.RELEASE, abi.RELEASE_IN.pack(3, os.O_RDWR, abi.FUSE_RELEASE_FLUSH, 0), Release,
     {"fh": 3, "flags": os.O_RDWR, "release_flags": 1}),
    (Op.RELEASEDIR, abi.RELEASE_IN.pack(8, 0, 0, 0), Releasedir, {"fh": 8}),
    (Op.SETXATTR, abi.SETXATTR_IN.pack(3, os.XATTR_CREATE) + b"user.k\0v\0w", Setxattr,
     {"name": b"user.k", "value": b"v\0w", "flags": os.XATTR_CREATE}),
    (Op.GETXATTR, abi.GETXATTR_IN.pack(0, 0) + b"user.k\0", Getxattr, {"name": b"user.k", "size": 0}),
    (Op.LISTXATTR, abi.GETXATTR_IN.pack(4096, 0), Listxattr, {"size": 4096}),
    (Op.READDIRPLUS, abi.READ_IN.pack(8, 3, 4096, 0, 0, 0, 0), Readdir,
     {"fh": 8, "offset": 3, "size": 4096, "plus": True}),
    (Op.READDIR, abi.READ_IN.pack(8, 0, 4096, 0, 0, 0, 0), Readdir, {"plus": False}),
    (Op.CREATE, abi.CREATE_IN.pack(os.O_WRONLY | os.O_CREAT, 0o100644, 0o22, 0) + b"f.pt\0", Create,
     {"name": b"f.pt", "flags": os.O_WRONLY | os.O_CREAT, "mode": 0o100644, "umask": 0o22}),
    (Op.LSEEK, abi.LSEEK_IN.pack(3, 1 << 33, os.SEEK_HOLE, 0), Lseek, {"fh": 3, "offset": 1 << 33, "whence": 4}),
    (Op.FALLOCATE, abi.FALLOCATE_IN.pack(3, 10, 1 << 30, 3, 0), Fallocate,
     {"fh": 3, "offset": 10, "length": 1 << 30, "mode": 3}),
    (Op.COPY_FILE_RANGE, abi.COPY_FILE_RANGE_IN.pack(3, 7, 12, 4, 9, 1 << 20, 0), CopyFileRange,
     {"fh_in": 3, "off_in": 7, "nodeid_out": 12, "fh_out": 4, "off_out": 9, "length": 1 << 20, "wide": False}),
    (Op.COPY_FILE_RANGE_64, abi.COPY_FILE_RANGE_IN.pack(3, 0, 12, 4, 0, 1 << 40, 0), CopyFileRange,
     {"length": 1 << 40, "flags": 0, "wide": True}),
]


@pytest.mark.parametrize("opcode,body,cls,fields", CASES, ids=[f"{c[0].name}" for c in CASES])
def test_request_round_trip(opcode, body, cls, fields):
    req = parse(raw(opcode, body, unique=88))
    assert type(req) is cls and req.unique == 88 and req.header.uid == UID and req.header.pid == PID
    for k, v in fields.items():
        assert getattr(req, k) == v, k
    assert req.method  # every parsed opcode names its handler method


@pytest.mark.parametrize("opcode,body,cls,fields", CASES, ids=[f"{c[0].name}" for c in CASES])
def test_every_truncation_is_refused(opcode, body, cls, fields):
    for cut in range(len(body)):
        with pytest.raises(ProtocolError):
            parse(raw(opcode, body[:cut]))


@pytest.mark.parametrize("opcode,body,cls,fields", CASES, ids=[f"{c[0].name}" for c in CASES])
def test_length_field_must_match(opcode, body, cls, fields):
    with pytest.raises(ProtocolError, match="length field"):
        parse(raw(opcode, body, length=40 + len(body) + 1))


def test_names_need_their_nul_and_nothing_after():
    with pytest.raises(ProtocolError, match="not NUL-terminated"):
        parse(raw(Op.LOOKUP, b"abc"))
    with pytest.raises(ProtocolError, match="stray bytes"):
        parse(raw(Op.UNLINK, b"abc\0x"))
    with pytest.raises(ProtocolError, match="name 2 of 2"):
        parse(raw(Op.SYMLINK, b"a\0target"))
    long = b"x" * 255
    assert parse(raw(Op.LOOKUP, long + b"\0")).name == long


def test_setxattr_sizes():
    with pytest.raises(ProtocolError, match="value of 1 bytes"):
        parse(raw(Op.SETXATTR, abi.SETXATTR_IN.pack(2, 0) + b"user.k\0v"))
    req = parse(raw(Op.SETXATTR, abi.SETXATTR_IN_EXT.pack(1, 0, 1, 0) + b"user.k\0v"), setxattr_ext=True)
    assert (req.name, req.value, req.setxattr_flags) == (b"user.k", b"v", 1)
    big = os.urandom(65536)
    assert parse(raw(Op.SETXATTR, abi.SETXATTR_IN.pack(len(big), 0) + b"user.big\0" + big)).value == big


def test_init_with_and_without_flags2():
    body = abi.INIT_IN.pack(7, 45, 131072, abi.FUSE_INIT_EXT | abi.FUSE_ASYNC_READ, 1 << 5) + bytes(44)
    req = parse(raw(Op.INIT, body))
    assert isinstance(req, Init) and (req.major, req.minor, req.max_readahead) == (7, 45, 131072)
    assert req.flags == abi.FUSE_INIT_EXT | abi.FUSE_ASYNC_READ | abi.FUSE_PASSTHROUGH
    # flags2 without FUSE_INIT_EXT means nothing; the pre-7.36 16-byte body still parses
    assert parse(raw(Op.INIT, abi.INIT_IN.pack(7, 45, 0, 1, 1 << 5) + bytes(44))).flags == 1
    assert parse(raw(Op.INIT, abi.INIT_IN_V1.pack(7, 31, 0, 3))).flags == 3
    with pytest.raises(ProtocolError):
        parse(raw(Op.INIT, b"\0" * 15))


def test_write_payload_is_not_copied():
    payload = bytearray(b"z" * 4096)
    head = raw(Op.WRITE, abi.WRITE_IN.pack(1, 0, 4096, 0, 0, 0, 0), length=80 + 4096)
    req = parse_request(head[:40], memoryview(head)[40:], memoryview(payload))
    assert isinstance(req, Write) and req.data.obj is payload and bytes(req.data) == bytes(payload)
    short = raw(Op.WRITE, abi.WRITE_IN.pack(1, 0, 4096, 0, 0, 0, 0), length=80 + 4095)
    with pytest.raises(ProtocolError, match="4095 bytes of data, fuse_write_in.size says 4096"):
        parse_request(short[:40], memoryview(short)[40:], memoryview(payload)[:4095])


def test_scattered_write_payload_stays_in_its_buffers():
    """A readv that scattered a WRITE over several buffers (lent arena slots): one piece per
    buffer, each a view of it, in order; `data` joins them."""
    chunk = 4096
    slots = [bytearray(b"a" * chunk), bytearray(b"b" * chunk), bytearray(chunk)]
    size = 2 * chunk + 100  # the last buffer only partly filled
    head = raw(Op.WRITE, abi.WRITE_IN.pack(1, 3 * chunk, size, 0, 0, 0, 0), length=80 + size)
    filled = [memoryview(slots[0]), memoryview(slots[1]), memoryview(slots[2])[:100]]
    req = parse_request(head[:40], memoryview(head)[40:], filled)
    assert [p.obj for p in req.pieces] == slots and [p.nbytes for p in req.pieces] == [chunk, chunk, 100]
    assert bytes(req.data) == b"a" * chunk + b"b" * chunk + bytes(100) and req.size == size
    # empty trailing buffers are left out; a length that disagrees is refused
    req = parse_request(head[:40], memoryview(head)[40:], filled + [memoryview(bytearray(0))])
    assert len(req.pieces) == 3
    with pytest.raises(ProtocolError, match="length field says 8372 bytes, the request has 8371"):
        parse_request(head[:40], memoryview(head)[40:], filled[:2] + [filled[2][:99]])
    short = raw(Op.WRITE, abi.WRITE_IN.pack(1, 0, size, 0, 0, 0, 0), length=80 + size - 1)
    with pytest.raises(ProtocolError, match="8291 bytes of data, fuse_write_in.size says 8292"):
        parse_request(short[:40], memoryview(short)[40:], filled[:2] + [filled[2][:99]])
    # a zero-length write has one empty piece
    head = raw(Op.WRITE, abi.WRITE_IN.pack(1, 0, 0, 0, 0, 0, 0))
    req = parse_request(head[:40], memoryview(head)[40:], [])
    assert req.size == 0 and bytes(req.data) == b""


def test_scattered_non_write_is_joined():
    name = b"n" * 5000
    data = raw(Op.LOOKUP, name + b"\0")
    rest = data[80:]
    req = parse_request(data[:40], memoryview(data)[40:80], [memoryview(bytearray(rest[:4096])),
                                                              memoryview(bytearray(rest[4096:]))])
    assert req.name == name


def test_split_read_of_a_long_name_is_joined():
    """A non-WRITE request spilling past the 80-byte header buffer into the payload buffer."""
    name = b"n" * 200
    data = raw(Op.LOOKUP, name + b"\0")
    req = parse_request(data[:40], memoryview(data)[40:80], memoryview(bytearray(data[80:])))
    assert req.name == name


def test_extensions_are_stripped():
    body = abi.CREATE_IN.pack(os.O_RDWR, 0o100600, 0, 0) + b"f\0"
    ext = abi.BATCH_FORGET_IN.pack(16, 32) + bytes(8)  # a 16-byte fuse_ext_header + payload, 2 units
    req = parse(raw(Op.CREATE, body + ext, extlen=2))
    assert req.name == b"f"
    with pytest.raises(ProtocolError, match="extensions"):
        parse(raw(Op.GETATTR, b"", extlen=1))


def test_unknown_opcodes_are_unsupported_not_errors():
    for op in (Op.GETLK, Op.IOCTL, Op.STATX, 999):
        req = parse(raw(op, b"\0" * 24))
        assert isinstance(req, Unsupported) and req.opcode == op and req.method == ""


def test_garbage_only_ever_raises_protocol_error():
    rng = random.Random(1)
    ops = [int(o) for o in Op] + [0, 1000]
    for _ in range(3000):
        body = rng.randbytes(rng.choice([0, 1, 7, 8, 16, 24, 40, 41, 64, 100, 300]))
        if rng.random() < 0.5:
            body = body.replace(b"\0", b"\1")
        data = raw(rng.choice(ops), body, extlen=rng.choice([0, 0, 0, 1, 40]))
        try:
            parse(data)
        except ProtocolError:
            pass


def test_decoder_fed_one_byte_at_a_time():
    stream = b"".join(raw(op, body, unique=2 * i + 2) for i, (op, body, _, _) in enumerate(CASES))
    whole = RequestDecoder()
    whole.feed(stream)
    expected = []
    while (r := whole.next_request()) is not None:
        expected.append(r)
    assert len(expected) == len(CASES) and whole.pending == 0
    dec, got = RequestDecoder(), []
    for i in range(len(stream)):
        dec.feed(stream[i:i + 1])
        while (r := dec.next_request()) is not None:
            got.append(r)
    assert [(type(r), r.unique) for r in got] == [(type(r), r.unique) for r in expected]
    assert [r.header for r in got] == [r.header for r in expected]
    assert dec.pending == 0


# ---- replies ---------------------------------------------------------------------------------
ATTR = Attr(ino=9, mode=0o100644, size=5 << 30, blocks=10 << 21, atime_ns=-1_500_000_000,
            mtime_ns=1_700_000_000_123456789, ctime_ns=0, nlink=2, uid=1000, gid=1001, rdev=0, blksize=1 << 20)


def unpack_attr(buf) -> tuple:
    return abi.ATTR.unpack(bytes(buf))


def test_entry_and_attr_out():
    e = EntryOut(9, ATTR, generation=3, entry_timeout=1.5, attr_timeout=0.25).pack()
    assert len(e) == 128
    nodeid, gen, ev, av, evn, avn = abi.ENTRY_OUT_HEAD.unpack_from(e)
    assert (nodeid, gen, ev, evn, av, avn) == (9, 3, 1, 500_000_000, 0, 250_000_000)
    a = unpack_attr(e[40:])
    assert a[:3] == (9, 5 << 30, 10 << 21)
    assert a[3] == (1 << 64) - 2 and a[6] == 500_000_000  # -1.5 s: seconds -2 as u64, +0.5 s
    assert a[4] == 1_700_000_000 and a[7] == 123456789
    assert a[9:15] == (0o100644, 2, 1000, 1001, 0, 1 << 20)
    out = AttrOut(ATTR, attr_timeout=2).pack()
    assert len(out) == 104 and abi.ATTR_OUT_HEAD.unpack_from(out)[:2] == (2, 0) and out[16:] == ATTR.pack()


def test_small_replies():
    assert OpenOut(7, abi.FOPEN_DIRECT_IO | abi.FOPEN_PARALLEL_DIRECT_WRITES).pack() == abi.OPEN_OUT.pack(7, 65, 0)
    assert len(CreateOut(EntryOut(9, ATTR), OpenOut(7)).pack()) == 144
    assert WriteOut(1 << 20).pack() == abi.WRITE_OUT.pack(1 << 20, 0)
    assert XattrSize(17).pack() == abi.GETXATTR_OUT.pack(17, 0)
    assert LseekOut(12345).pack() == abi.LSEEK_OUT.pack(12345)
    assert CopiedOut(5 << 32).pack() == abi.COPY_FILE_RANGE_OUT.pack(5 << 32)
    st = StatfsOut(100, 50, 40, 1000, 900, 4096, 255, 4096).pack()
    assert len(st) == 80 and abi.KSTATFS.unpack(st)[:8] == (100, 50, 40, 1000, 900, 4096, 255, 4096)


def test_init_out_splits_flags2():
    out = InitOut(7, 40, 131072, abi.FUSE_INIT_EXT | abi.FUSE_MAX_PAGES | abi.FUSE_PASSTHROUGH, 64, 48, 1 << 20,
                  max_pages=256, max_stack_depth=1).pack()
    assert len(out) == 64
    fields = abi.INIT_OUT.unpack(out)
    assert fields == (7, 40, 131072, abi.FUSE_INIT_EXT | abi.FUSE_MAX_PAGES, 64, 48, 1 << 20, 1, 256, 0, 1 << 5, 1)


def test_errors_and_frames():
    e = error_reply(10, errno.ENOENT)
    assert abi.OUT_HEADER.unpack(e) == (16, -errno.ENOENT, 10)
    assert abi.OUT_HEADER.unpack(error_reply(10, 0))[1] == -errno.EIO
    assert abi.OUT_HEADER.unpack(error_reply(10, 4096))[1] == -errno.EIO
    view = memoryview(bytearray(100))[10:60]
    parts = frame(12, [b"abc", view])
    assert parts[1] == b"abc" and parts[2] is view  # data is handed on, not copied
    assert abi.OUT_HEADER.unpack(parts[0]) == (16 + 53, 0, 12)
    assert frame(3, None) == [out_header(3, 0, 0)]
    assert abi.OUT_HEADER.unpack(frame(3, WriteOut(5))[0])[0] == 24


def decode_dirents(buf: bytes, plus: bool) -> list:
    out, pos = [], 0
    while pos < len(buf):
        entry = None
        if plus:
            entry = abi.ENTRY_OUT_HEAD.unpack_from(buf, pos)[0]
            pos += abi.ENTRY_OUT_SIZE
        ino, off, namelen, typ = abi.DIRENT.unpack_from(buf, pos)
        name = buf[pos + 24:pos + 24 + namelen]
        rec = abi.align8(24 + namelen)
        assert buf[pos + 24 + namelen:pos + rec] == b"\0" * (rec - 24 - namelen)
        out.append((entry, ino, off, typ, name))
        pos += rec
    assert pos == len(buf)
    return out


@pytest.mark.parametrize("plus", [False, True])
def test_dirents_are_aligned_and_stop_when_full(plus):
    names = [b"x" * n for n in range(1, 30)] + [b"."]
    size = 2000 if plus else 600
    buf = DirentBuffer(size, plus=plus)
    added = []
    for i, name in enumerate(names):
        mode = 0o40755 if i % 2 else 0o100644
        ok = buf.add(name, i + 1, ino=100 + i, mode=mode, entry=EntryOut(100 + i, Attr(100 + i, mode)))
        if not ok:
            before = len(buf)
            assert not buf.add(name, i + 1, ino=1, mode=mode, entry=EntryOut(1, Attr(1, mode)))
            assert len(buf) == before
            break
        added.append((name, i, mode))
    data = buf.pack()
    assert len(data) == len(buf) <= size and len(data) % 8 == 0 and buf.count == len(added)
    assert 0 < len(added) < len(names)  # it filled up
    for (entry, ino, off, typ, name), (want, i, mode) in zip(decode_dirents(data, plus), added):
        assert (ino, off, name, typ) == (100 + i, i + 1, want, (mode >> 12) & 0xF)
        assert entry == (100 + i if plus else None)


def test_dirent_rejects_bad_names():
    buf = DirentBuffer(4096)
    for bad in (b"", b"a/b", b"a\0", b"x" * 256):
        with pytest.raises(ValueError):
            buf.add(bad, 1, ino=1, mode=0o100644)


# ---- INIT negotiation -------------------------------------------------------------------------
def init_req(flags: int, minor: int = 45, readahead: int = 131072) -> Init:
    return parse(raw(Op.INIT, abi.INIT_IN.pack(7, minor, readahead, flags & 0xFFFFFFFF, flags >> 32) + bytes(44)))


def test_negotiate_takes_only_what_is_offered():
    offered = (abi.FUSE_ASYNC_READ | abi.FUSE_MAX_PAGES | abi.FUSE_INIT_EXT | abi.FUSE_PARALLEL_DIROPS
               | abi.FUSE_HANDLE_KILLPRIV_V2 | abi.FUSE_PASSTHROUGH | abi.FUSE_WRITEBACK_CACHE)
    out, neg = negotiate(init_req(offered), max_pages_limit=256)
    assert neg.flags == DEFAULT_WANT & offered and neg.flags & ~offered == 0
    assert not neg.has(abi.FUSE_WRITEBACK_CACHE) and not neg.has(abi.FUSE_PASSTHROUGH)
    assert (out.max_write, out.max_pages, out.minor, out.max_readahead) == (1 << 20, 256, abi.KERNEL_MINOR, 131072)
    assert out.congestion_threshold <= out.max_background


def test_negotiate_passthrough_only_when_wanted_and_then_with_a_stack_depth():
    """The kernel turns passthrough on only with max_stack_depth >= 1 (fs/fuse/inode.c), and a
    stack depth says the backing files may themselves be on a stacked filesystem: asked for
    when passthrough is, never otherwise."""
    offered = abi.FUSE_INIT_EXT | abi.FUSE_PASSTHROUGH | abi.FUSE_MAX_PAGES
    out, neg = negotiate(init_req(offered))
    assert not neg.has(abi.FUSE_PASSTHROUGH) and out.max_stack_depth == 0
    out, neg = negotiate(init_req(offered), want=DEFAULT_WANT | abi.FUSE_PASSTHROUGH)
    assert neg.has(abi.FUSE_PASSTHROUGH) and out.max_stack_depth == 1
    assert abi.INIT_OUT.unpack(out.pack())[-1] == 1 and abi.INIT_OUT.unpack(out.pack())[-2] & (1 << 5)
    out, neg = negotiate(init_req(offered & ~abi.FUSE_PASSTHROUGH), want=DEFAULT_WANT | abi.FUSE_PASSTHROUGH)
    assert not neg.has(abi.FUSE_PASSTHROUGH) and out.max_stack_depth == 0  # not offered: not asked


def test_negotiate_request_size():
    base = abi.FUSE_ASYNC_READ | abi.FUSE_INIT_EXT
    out, _ = negotiate(init_req(base | abi.FUSE_MAX_PAGES), max_pages_limit=1024)
    assert (out.max_write, out.max_pages) == (4 << 20, 1024)
    # a spare page for writers whose buffers are not page-aligned, where the limit allows it
    out, _ = negotiate(init_req(base | abi.FUSE_MAX_PAGES), max_pages_limit=1024, max_write=1 << 20)
    assert (out.max_write, out.max_pages) == (1 << 20, 257)
    out, _ = negotiate(init_req(base | abi.FUSE_MAX_PAGES), max_pages_limit=256, max_write=1 << 20)
    assert (out.max_write, out.max_pages) == (1 << 20, 256)
    # by default a power of two: a limit raised to 257 gives 1 MiB requests with the spare page
    out, _ = negotiate(init_req(base | abi.FUSE_MAX_PAGES), max_pages_limit=257)
    assert (out.max_write, out.max_pages) == (1 << 20, 257)
    out, neg = negotiate(init_req(base), max_pages_limit=1024, max_write=8 << 20)  # no MAX_PAGES offered
    assert (out.max_write, out.max_pages, neg.max_write) == (128 << 10, 0, 128 << 10)
    out, _ = negotiate(init_req(base | abi.FUSE_MAX_PAGES), max_write=1000)
    assert out.max_write == 4096


def test_negotiate_reads_larger_than_writes():
    """max_read: max_pages covers it (with the spare page) within the limit; max_write stays."""
    flags = abi.FUSE_ASYNC_READ | abi.FUSE_INIT_EXT | abi.FUSE_MAX_PAGES
    kw = dict(max_write=4 << 20, grain=1 << 20, max_read=16 << 20)
    for limit, pages in ((4097, 4097), (65535, 4097), (2000, 2000), (1025, 1025)):
        out, neg = negotiate(init_req(flags), max_pages_limit=limit, **kw)
        assert (out.max_write, out.max_pages) == (4 << 20, pages) == (neg.max_write, neg.max_pages)
    out, _ = negotiate(init_req(flags), max_pages_limit=4097, max_write=4 << 20, max_read=1 << 20)
    assert out.max_pages == 1025  # never fewer pages than writes need
    out, _ = negotiate(init_req(abi.FUSE_ASYNC_READ | abi.FUSE_INIT_EXT), max_pages_limit=4097, **kw)
    assert out.max_pages == 0  # no MAX_PAGES offered: the kernel's default


@pytest.mark.parametrize("limit, want", [
    (1025, (4 << 20, 1025)),   # raised as root: 4 chunks and the spare page
    (65535, (4 << 20, 1025)),
    (1024, (3 << 20, 769)),    # 4 chunks would leave no spare page: 3 whole chunks with it
    (800, (3 << 20, 769)),
    (257, (1 << 20, 257)),     # one chunk, as before requests of several chunks
    (256, (1 << 20, 256)),     # the default limit: one chunk, no spare page (unaligned writers are cut)
])
def test_negotiate_whole_chunks(limit, want):
    """max_write of several chunks (grain): cut by the limit to whole chunks, never 1 MiB + 4 KiB."""
    flags = abi.FUSE_ASYNC_READ | abi.FUSE_INIT_EXT | abi.FUSE_MAX_PAGES
    out, neg = negotiate(init_req(flags), max_pages_limit=limit, max_write=4 << 20, grain=1 << 20)
    assert (out.max_write, out.max_pages) == want == (neg.max_write, neg.max_pages)
    # without MAX_PAGES the kernel's 32 pages: less than a chunk, left as it is
    out, _ = negotiate(init_req(abi.FUSE_ASYNC_READ), max_pages_limit=limit, max_write=4 << 20, grain=1 << 20)
    assert out.max_write == 128 << 10


def test_negotiate_flags2_only_with_init_ext():
    out, neg = negotiate(init_req(abi.FUSE_ASYNC_READ), want=DEFAULT_WANT | abi.FUSE_PASSTHROUGH)
    assert neg.flags == abi.FUSE_ASYNC_READ and abi.INIT_OUT.unpack(out.pack())[10] == 0


def test_negotiate_refuses_other_protocols():
    with pytest.raises(ProtocolError, match="FUSE 8"):
        negotiate(Init(parse_header(raw(Op.INIT, b"\0" * 64)), 8, 0, 0, 0))
    with pytest.raises(ProtocolError, match="7.22"):
        negotiate(init_req(0, minor=22))
    _, neg = negotiate(init_req(0, minor=31))
    assert neg.minor == 31


def test_raising_max_pages_limit_stops_at_the_kernels_ceiling(tmp_path):
    """With 16 MiB chunks the session wishes for 65537 pages (256 MiB READs); the sysctl refuses
    anything past 65535 (EINVAL), which used to leave the limit where it was with a warning."""
    from ckptfs.fuse.kernel.mount import MAX_MAX_PAGES, raise_max_pages_limit
    sysctl = tmp_path / "max_pages_limit"
    sysctl.write_text("256\n")
    assert raise_max_pages_limit(1025, str(sysctl)) == 1025
    assert raise_max_pages_limit(512, str(sysctl)) == 1025  # never lowered
    assert raise_max_pages_limit(65537, str(sysctl)) == MAX_MAX_PAGES == 65535
    assert sysctl.read_text().strip() == "65535"
