"""Pure unit tests of the core, no FUSE: arena, file map, namespace, Filesystem.

Each test drives the sans-I/O pieces directly (the way h11 is tested) and calls
`check_invariants()` after mutating, so bookkeeping errors fail here first.
"""
from __future__ import annotations

import errno
import functools
import os
import random
import stat

import pytest
from hypothesis import given, settings, strategies as st

from ckptfs.fs.arena import Arena
from ckptfs.fs.prefault import fault_in
from ckptfs.fs.core import Durability, Filesystem, setid_bits_to_drop
from ckptfs.fs.creds import Caller, caller
from ckptfs.errors import FsError, NoSpace, UsageError
from ckptfs.fs.filemap import FileData
from ckptfs.fs.namespace import RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INO, Namespace

CS = 4096
REG = stat.S_IFREG | 0o644
DIR = stat.S_IFDIR | 0o755


def errno_of(fn, *args, **kw) -> int:
    with pytest.raises(FsError) as info:
        fn(*args, **kw)
    return info.value.errno


# ---- arena ----------------------------------------------------------------

def test_arena_alloc_free_accounting():
    a = Arena(8 * CS, CS, prefault=False)
    assert (a.nslots, a.capacity, a.free_slots, a.used_slots) == (8, 8 * CS, 8, 0)
    slots = [a.alloc_nowait() for _ in range(8)]
    assert sorted(slots) == list(range(8))
    assert (a.free_slots, a.used_slots) == (0, 8)
    with pytest.raises(NoSpace) as info:
        a.alloc_nowait()
    assert info.value.errno == errno.ENOSPC
    a.check_invariants()
    for s in slots[:3]:
        a.free(s)
    assert (a.free_slots, a.used_slots) == (3, 5)
    again = {a.alloc_nowait() for _ in range(3)}
    assert again == set(slots[:3])
    stats = a.statistics()
    assert stats.allocations == 11 and stats.full_events == 1 and stats.used_slots == 8
    a.check_invariants()
    a.close()


def test_arena_views_are_aligned_and_disjoint():
    a = Arena(4 * CS, CS, prefault=False)
    s0, s1 = a.alloc_nowait(), a.alloc_nowait()
    v0, v1 = a.view(s0), a.view(s1)
    assert len(v0) == CS and len(v1) == CS
    v0[:] = b"\x01" * CS
    v1[:] = b"\x02" * CS
    assert bytes(a.view(s0)) == b"\x01" * CS
    assert bytes(a.view(s1)) == b"\x02" * CS
    del v0, v1
    a.close()


def test_arena_double_free_breaks_invariants():
    a = Arena(4 * CS, CS, prefault=False)
    s = a.alloc_nowait()
    a.free(s)
    a.free(s)
    with pytest.raises(AssertionError):
        a.check_invariants()


def smaps_of(address: int) -> dict[str, int]:
    """The kB figures (and THPeligible) of this process's mapping that holds `address`."""
    fields: dict[str, int] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.split()[1].isdigit():
                fields[head.rstrip(":")] = int(line.split()[1])
    return fields


@pytest.mark.parametrize("threads,slots,chunk", [(1, 16, 2 << 20), (3, 16, 2 << 20), (2, 2, 4096), (4, 3, 1 << 20)])
def test_fault_in_makes_every_page_resident_in_huge_pages_keeping_what_was_written(threads, slots, chunk):
    """Every page of the arena is resident before the first write (no faults on the absorb path),
    the mapping is eligible for transparent huge pages where the kernel has them, and faulting a
    mapping in keeps the bytes already in it."""
    a = Arena(slots * chunk, chunk)
    fields = smaps_of(a._base)
    assert fields["Rss"] * 1024 >= a.capacity
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if a.capacity >= 2 << 20 and os.path.exists(thp) and "[never]" not in open(thp).read():
        assert fields["THPeligible"] == 1
    a.close()
    m = Arena(slots * chunk, chunk, prefault=False)
    written = range(0, m.nslots, 3)
    for slot in written:
        m.view(slot)[:1] = bytes([slot + 1])
    fault_in(m._base, m.capacity, threads)
    assert smaps_of(m._base)["Rss"] * 1024 >= m.capacity
    assert [bytes(m.view(slot)[:1])[0] for slot in range(m.nslots)] == [
        slot + 1 if slot in written else 0 for slot in range(m.nslots)]
    m.close()


@pytest.mark.parametrize("capacity,chunk", [(CS, CS), (8 * CS, 3000), (8 * CS, 6000), (8 * CS, 2048)])
def test_arena_rejects_bad_sizes(capacity, chunk):
    with pytest.raises(UsageError):
        Arena(capacity, chunk, prefault=False)


# ---- file map ---------------------------------------------------------------

@pytest.fixture
def arena():
    a = Arena(64 * CS, CS, prefault=False)
    yield a
    a.close()


def read_all(fd: FileData, size: int) -> bytes:
    return bytes(fd.read(0, size + 10, size))


def test_filemap_odd_offsets_and_lengths(arena):
    fd = FileData(arena)
    ref = bytearray()
    rnd = random.Random(1)
    for off, n in [(0, 1), (1, 4095), (4095, 2), (4097, 10000), (3, 7), (8191, 1), (20000, 4096),
                   (12287, 8193)]:
        buf = rnd.randbytes(n)
        assert fd.write(off, buf) == n
        if off + n > len(ref):
            ref.extend(bytes(off + n - len(ref)))
        ref[off:off + n] = buf
    assert read_all(fd, len(ref)) == bytes(ref)
    for off in range(0, len(ref), 997):
        assert bytes(fd.read(off, 5000, len(ref))) == bytes(ref[off:off + 5000])
    fd.clear()
    assert arena.used_slots == 0


def test_filemap_one_byte_at_a_time(arena):
    fd = FileData(arena)
    data = os.urandom(3 * CS + 11)
    for i in range(len(data)):
        assert fd.write(i, data[i:i + 1]) == 1
    assert read_all(fd, len(data)) == data
    assert len(fd.chunks) == 4
    # and read back one byte at a time
    assert b"".join(bytes(fd.read(i, 1, len(data))) for i in range(len(data))) == data


def test_filemap_allocated_bytes_are_the_4k_blocks_held():
    """st_blocks as ext4 counts it: written bytes rounded up to 4 KiB, per chunk; holes count nothing."""
    a = Arena(8 * (64 << 10), 64 << 10, prefault=False)
    fd = FileData(a)
    assert fd.allocated_bytes == 0
    fd.write(0, b"x" * 210 * 1024)  # 210 KiB over four 64 KiB chunks
    assert fd.allocated_bytes == 212 * 1024
    fd.write(7 * (64 << 10) + 1, b"y")  # one byte far out: one more block, the hole is free
    assert fd.allocated_bytes == 216 * 1024
    fd.truncate(4096)
    assert fd.allocated_bytes == 4096
    fd.punch(0, 4096)  # the whole chunk's bytes: it goes
    assert fd.allocated_bytes == 0 == fd.count_held()
    fd.write(64 << 10, b"z" * 5000)
    fd.punch((64 << 10) + 4000, 1000)  # to its end: its high-water mark comes down
    assert fd.allocated_bytes == 4096 == fd.count_held()
    fd.clear()
    assert fd.allocated_bytes == 0
    a.close()


def test_filemap_holes_read_as_zeros(arena):
    fd = FileData(arena)
    fd.write(10 * CS + 5, b"tail")
    size = 10 * CS + 9
    assert len(fd.chunks) == 1  # the hole allocates nothing
    got = read_all(fd, size)
    assert got == bytes(10 * CS + 5) + b"tail"
    # a write that skips over never-written bytes inside a chunk zero-fills them
    slot = fd.chunks[10].slot
    arena.view(slot)[:] = b"\xff" * CS  # garbage left in a recycled slot
    fd2 = FileData(arena)
    fd2.write(100, b"a")
    assert bytes(fd2.read(0, 101, 101)) == bytes(100) + b"a"


def test_filemap_recycled_slot_reads_zeros_past_hwm(arena):
    fd = FileData(arena)
    fd.write(0, b"\xee" * CS)
    fd.clear()
    fd.write(0, b"x")  # same slot again, full of old bytes
    assert bytes(fd.read(0, CS, CS)) == b"x" + bytes(CS - 1)
    fd.write(CS - 1, b"y")
    assert bytes(fd.read(0, CS, CS)) == b"x" + bytes(CS - 2) + b"y"


@pytest.mark.parametrize("down", [0, 1, CS - 1, CS, CS + 1, 2 * CS + 100])
def test_filemap_truncate_down_then_up_reads_zeros(arena, down):
    fd = FileData(arena)
    data = b"\xab" * (3 * CS + 7)
    fd.write(0, data)
    fd.truncate(down)
    assert read_all(fd, down) == data[:down]
    assert arena.used_slots == len(fd.chunks) == -(-down // CS)
    up = len(data)
    assert read_all(fd, up) == data[:down] + bytes(up - down)
    fd.write(up + 3, b"z")  # extending write after the truncate
    assert read_all(fd, up + 4) == data[:down] + bytes(up - down + 3) + b"z"


def test_filemap_punch_drops_whole_chunks_and_zeroes_the_ends(arena):
    fd = FileData(arena)
    data = os.urandom(5 * CS)
    fd.write(0, data)
    fd.punch(CS + 10, 3 * CS)  # chunk 1 from 10 on, chunks 2 and 3 whole, chunk 4 up to 10
    want = data[:CS + 10] + bytes(3 * CS) + data[4 * CS + 10:]
    assert read_all(fd, 5 * CS) == want
    assert sorted(fd.chunks) == [0, 1, 4] and arena.used_slots == 3  # nothing of 2 and 3 drains
    assert fd.chunks[1].hwm == 10  # the tail of what it held: its mark lowered, nothing zeroed
    assert fd.seek(CS + 10, 5 * CS, hole=False) == 4 * CS
    assert fd.seek(0, 5 * CS, hole=True) == CS + 10
    fd.punch(4 * CS, CS)  # the last chunk whole: the file ends in a hole
    assert fd.seek(CS + 10, 5 * CS, hole=False) is None and sorted(fd.chunks) == [0, 1]
    fd.punch(10, 5)  # inside what chunk 0 holds: zeroed in place
    assert read_all(fd, CS)[:20] == data[:10] + bytes(5) + data[15:20]
    fd.clear()
    arena.check_invariants()


def test_filemap_short_write_on_nospace():
    a = Arena(3 * CS, CS, prefault=False)
    fd = FileData(a)
    buf = os.urandom(5 * CS)
    assert fd.write(100, buf) == 3 * CS - 100
    assert bytes(fd.read(100, 3 * CS, 3 * CS)) == buf[:3 * CS - 100]
    with pytest.raises(NoSpace):
        fd.write(3 * CS, b"more")
    # writes inside allocated chunks still succeed when the arena is full
    assert fd.write(0, b"head") == 4
    fd.clear()
    assert a.free_slots == 3
    a.check_invariants()


def check_seek(fd: FileData, ref: bytes) -> None:
    """Walk the file with SEEK_DATA / SEEK_HOLE: every hole reads as zeros (a copy that skips
    holes loses nothing), and the walk ends at the end of the file."""
    pos, size = 0, len(ref)
    while pos < size:
        d = fd.seek(pos, size, hole=False)
        if d is None:
            assert not ref[pos:].strip(b"\0"), f"data after {pos} but SEEK_DATA says none"
            return
        assert pos <= d < size and not ref[pos:d].strip(b"\0"), (pos, d)
        h = fd.seek(d, size, hole=True)
        assert d < h <= size, (d, h)
        assert fd.seek(h - 1, size, hole=False) == h - 1
        pos = h


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("w"), st.integers(0, 6 * CS), st.integers(0, 2 * CS + 3)),
    st.tuples(st.just("t"), st.integers(0, 7 * CS), st.just(0)),
    st.tuples(st.just("p"), st.integers(0, 7 * CS), st.integers(1, 3 * CS + 5))), max_size=25))
def test_filemap_matches_bytearray(ops):
    a = Arena(32 * CS, CS, prefault=False)
    fd = FileData(a)
    ref = bytearray()
    rnd = random.Random(len(ops))
    for kind, off, n in ops:
        if kind == "w":
            buf = rnd.randbytes(n)
            assert fd.write(off, buf) == n
            if off + n > len(ref):
                ref.extend(bytes(off + n - len(ref)))
            ref[off:off + n] = buf
        elif kind == "p":
            if off < len(ref):
                end = min(off + n, len(ref))
                fd.punch(off, end - off)
                ref[off:end] = bytes(end - off)
        else:
            if off < len(ref):
                fd.truncate(off)
                del ref[off:]
            else:
                ref.extend(bytes(off - len(ref)))
        assert read_all(fd, len(ref)) == bytes(ref)
        check_seek(fd, bytes(ref))
        assert fd.allocated_bytes == fd.count_held()  # kept as it goes, not summed per stat
    fd.clear()
    assert a.used_slots == 0
    a.close()


# ---- namespace --------------------------------------------------------------

@pytest.fixture
def ns():
    dropped = []
    n = Namespace(on_drop=dropped.append)
    n.dropped = dropped
    yield n
    n.check_invariants()


def mk(ns, parent, name, mode=REG):
    return ns.make(parent, name, mode, 0, 0)


def test_namespace_create_lookup_unlink(ns):
    f = mk(ns, ROOT_INO, b"f")
    assert ns.lookup(ROOT_INO, b"f") is f
    assert f.lookups == 2 and f.nlink == 1
    assert errno_of(mk, ns, ROOT_INO, b"f") == errno.EEXIST
    assert errno_of(ns.lookup, ROOT_INO, b"nope") == errno.ENOENT
    assert errno_of(mk, ns, ROOT_INO, b"a/b") == errno.EINVAL
    assert errno_of(mk, ns, ROOT_INO, b"x" * 256) == errno.ENAMETOOLONG
    assert errno_of(mk, ns, f.ino, b"child") == errno.ENOTDIR
    ns.unlink(ROOT_INO, b"f")
    assert errno_of(ns.lookup, ROOT_INO, b"f") == errno.ENOENT
    assert f.ino in ns.inodes and not ns.dropped  # the kernel still knows it
    ns.forget(f.ino, 2)
    assert f.ino not in ns.inodes and ns.dropped == [f]
    assert errno_of(ns.unlink, ROOT_INO, b"f") == errno.ENOENT


def test_namespace_long_names_are_enametoolong_not_enoent(ns):
    """A name over 255 bytes cannot exist: looking it up says so, whatever the operation (as ext4)."""
    d = mk(ns, ROOT_INO, b"d", DIR)
    f = mk(ns, ROOT_INO, b"f")
    mk(ns, ROOT_INO, b"n" * 255)  # the longest name there can be
    long = b"n" * 256
    assert errno_of(ns.lookup, ROOT_INO, long) == errno.ENAMETOOLONG
    assert errno_of(ns.unlink, ROOT_INO, long) == errno.ENAMETOOLONG
    assert errno_of(ns.rmdir, ROOT_INO, long) == errno.ENAMETOOLONG
    assert errno_of(ns.rename, ROOT_INO, long, ROOT_INO, b"g") == errno.ENAMETOOLONG
    assert errno_of(ns.rename, ROOT_INO, b"f", ROOT_INO, long) == errno.ENAMETOOLONG
    assert errno_of(ns.rename, ROOT_INO, b"missing", ROOT_INO, long) == errno.ENOENT  # source first
    assert errno_of(ns.link, f.ino, d.ino, long) == errno.ENAMETOOLONG
    assert errno_of(ns.make, ROOT_INO, b"x" * 1024, DIR, 0, 0) == errno.ENAMETOOLONG
    assert errno_of(ns.lookup, f.ino, long) == errno.ENOTDIR  # the parent is checked first
    assert errno_of(ns.lookup, ROOT_INO, b"n" * 254) == errno.ENOENT
    assert ns.lookup(ROOT_INO, b"n" * 255).nlink == 1


def test_namespace_xattr_name_and_value_limits(ns):
    f = mk(ns, ROOT_INO, b"f")
    ns.setxattr(f.ino, b"u" * 255, b"v" * 65536)
    assert ns.getxattr(f.ino, b"u" * 255) == b"v" * 65536
    for op, args in ((ns.setxattr, (b"v",)), (ns.getxattr, ()), (ns.removexattr, ())):
        assert errno_of(op, f.ino, b"u" * 256, *args) == errno.ERANGE
        assert errno_of(op, f.ino, b"", *args) == errno.ERANGE
    assert errno_of(ns.setxattr, f.ino, b"user.big", bytes(65537)) == errno.E2BIG
    ns.removexattr(f.ino, b"u" * 255)
    assert f.xattrs == {}


def test_namespace_dirs_nlink_and_rmdir(ns):
    d = mk(ns, ROOT_INO, b"d", DIR)
    root = ns.get(ROOT_INO)
    assert d.nlink == 2 and root.nlink == 3
    sub = mk(ns, d.ino, b"sub", DIR)
    mk(ns, d.ino, b"file")
    assert d.nlink == 3
    assert ns.child(d.ino, b"..") is root
    assert ns.child(sub.ino, b"..") is d
    assert errno_of(ns.rmdir, ROOT_INO, b"d") == errno.ENOTEMPTY
    assert errno_of(ns.unlink, ROOT_INO, b"d") == errno.EISDIR
    assert errno_of(ns.rmdir, d.ino, b"file") == errno.ENOTDIR
    ns.check_invariants()
    ns.unlink(d.ino, b"file")
    ns.rmdir(d.ino, b"sub")
    assert d.nlink == 2
    ns.rmdir(ROOT_INO, b"d")
    assert root.nlink == 2
    ns.check_invariants()


def test_namespace_rename_over_file(ns):
    a, b = mk(ns, ROOT_INO, b"a"), mk(ns, ROOT_INO, b"b")
    ns.forget(b.ino, 1)
    replaced = ns.rename(ROOT_INO, b"a", ROOT_INO, b"b")
    assert replaced is b
    assert ns.child(ROOT_INO, b"b") is a
    assert errno_of(ns.child, ROOT_INO, b"a") == errno.ENOENT
    assert b.ino not in ns.inodes and ns.dropped == [b]
    ns.check_invariants()


def test_namespace_rename_dir_rules(ns):
    d1 = mk(ns, ROOT_INO, b"d1", DIR)
    d2 = mk(ns, ROOT_INO, b"d2", DIR)
    mk(ns, ROOT_INO, b"f")
    mk(ns, d2.ino, b"inner")
    assert errno_of(ns.rename, ROOT_INO, b"d1", ROOT_INO, b"f") == errno.ENOTDIR
    assert errno_of(ns.rename, ROOT_INO, b"f", ROOT_INO, b"d1") == errno.EISDIR
    assert errno_of(ns.rename, ROOT_INO, b"d1", ROOT_INO, b"d2") == errno.ENOTEMPTY
    assert errno_of(ns.rename, ROOT_INO, b"missing", ROOT_INO, b"x") == errno.ENOENT
    ns.check_invariants()
    # a dir over an empty dir
    e = mk(ns, ROOT_INO, b"empty", DIR)
    ns.rename(ROOT_INO, b"d1", ROOT_INO, b"empty")
    assert ns.child(ROOT_INO, b"empty") is d1 and e.nlink == 0
    ns.check_invariants()
    # move a dir into another dir: nlink of both parents follows
    root = ns.get(ROOT_INO)
    before = root.nlink
    ns.rename(ROOT_INO, b"empty", d2.ino, b"moved")
    assert d1.parent == d2.ino and ns.child(d1.ino, b"..") is d2
    assert root.nlink == before - 1 and d2.nlink == 3
    ns.check_invariants()


def test_namespace_rename_dir_into_itself(ns):
    a = mk(ns, ROOT_INO, b"a", DIR)
    b = mk(ns, a.ino, b"b", DIR)
    c = mk(ns, b.ino, b"c", DIR)
    assert errno_of(ns.rename, ROOT_INO, b"a", a.ino, b"x") == errno.EINVAL
    assert errno_of(ns.rename, ROOT_INO, b"a", c.ino, b"x") == errno.EINVAL
    assert errno_of(ns.rename, ROOT_INO, b"a", c.ino, b"x", RENAME_NOREPLACE) == errno.EINVAL
    mk(ns, c.ino, b"x", DIR)
    assert errno_of(ns.rename, ROOT_INO, b"a", c.ino, b"x", RENAME_EXCHANGE) == errno.EINVAL
    assert errno_of(ns.rename, c.ino, b"x", ROOT_INO, b"a", RENAME_EXCHANGE) == errno.EINVAL
    ns.rename(a.ino, b"b", ROOT_INO, b"b2")  # moving a child out is fine
    assert b.parent == ROOT_INO
    ns.check_invariants()


def test_namespace_rename_noreplace_and_exchange(ns):
    f = mk(ns, ROOT_INO, b"f")
    d = mk(ns, ROOT_INO, b"d", DIR)
    g = mk(ns, d.ino, b"g")
    assert errno_of(ns.rename, ROOT_INO, b"f", d.ino, b"g", RENAME_NOREPLACE) == errno.EEXIST
    assert errno_of(ns.rename, ROOT_INO, b"f", d.ino, b"nope", RENAME_EXCHANGE) == errno.ENOENT
    assert errno_of(ns.rename, ROOT_INO, b"f", d.ino, b"g", RENAME_EXCHANGE | RENAME_NOREPLACE) == errno.EINVAL
    ns.rename(ROOT_INO, b"f", d.ino, b"new", RENAME_NOREPLACE)
    assert ns.child(d.ino, b"new") is f
    ns.rename(d.ino, b"new", d.ino, b"g", RENAME_EXCHANGE)
    assert ns.child(d.ino, b"new") is g and ns.child(d.ino, b"g") is f
    # exchange a file with a directory across parents: dir parents and nlinks follow
    sub = mk(ns, ROOT_INO, b"sub", DIR)
    root = ns.get(ROOT_INO)
    before = (root.nlink, d.nlink)
    ns.rename(ROOT_INO, b"sub", d.ino, b"g", RENAME_EXCHANGE)
    assert ns.child(ROOT_INO, b"sub") is f and ns.child(d.ino, b"g") is sub
    assert sub.parent == d.ino
    assert (root.nlink, d.nlink) == (before[0] - 1, before[1] + 1)
    assert f.nlink == 1 and g.nlink == 1
    ns.check_invariants()


def test_namespace_hard_links(ns):
    f = mk(ns, ROOT_INO, b"f")
    d = mk(ns, ROOT_INO, b"d", DIR)
    ns.link(f.ino, d.ino, b"l1")
    ns.link(f.ino, ROOT_INO, b"l2")
    assert f.nlink == 3
    assert ns.child(d.ino, b"l1") is f
    assert errno_of(ns.link, d.ino, ROOT_INO, b"dl") == errno.EPERM
    assert errno_of(ns.link, f.ino, ROOT_INO, b"l2") == errno.EEXIST
    ns.check_invariants()
    # rename of one name onto another name of the same inode does nothing
    assert ns.rename(ROOT_INO, b"f", ROOT_INO, b"l2") is None
    assert ns.child(ROOT_INO, b"f") is f and f.nlink == 3
    ns.unlink(ROOT_INO, b"f")
    ns.unlink(d.ino, b"l1")
    assert f.nlink == 1 and ns.child(ROOT_INO, b"l2") is f
    ns.check_invariants()
    ns.unlink(ROOT_INO, b"l2")
    assert f.nlink == 0
    assert errno_of(ns.link, f.ino, ROOT_INO, b"again") == errno.ENOENT


def test_namespace_unlinked_open_inode_lives_until_release_and_forget(ns):
    f = mk(ns, ROOT_INO, b"f")
    f.opens += 1
    ns.unlink(ROOT_INO, b"f")
    ns.forget(f.ino, 1)
    assert f.ino in ns.inodes and not ns.dropped  # still open
    f.opens -= 1
    ns.maybe_drop(f)
    assert f.ino not in ns.inodes and ns.dropped == [f]
    # the other order: released first, forgotten last
    g = mk(ns, ROOT_INO, b"g")
    g.opens += 1
    ns.unlink(ROOT_INO, b"g")
    g.opens -= 1
    ns.maybe_drop(g)
    assert g.ino in ns.inodes
    ns.forget(g.ino, 1)
    assert g.ino not in ns.inodes and ns.dropped == [f, g]


def test_namespace_make_with_explicit_inode_and_observer():
    seen = []
    ns = Namespace(observer=lambda rec: seen.append(rec.op))
    ns.make(ROOT_INO, b"x", REG, 0, 0, ino=100)
    f = ns.make(ROOT_INO, b"y", REG, 0, 0)
    assert f.ino == 101
    assert errno_of(ns.make, ROOT_INO, b"z", REG, 0, 0, ino=100) == errno.EEXIST
    assert errno_of(ns.unlink, ROOT_INO, b"missing") == errno.ENOENT
    ns.rename(ROOT_INO, b"x", ROOT_INO, b"x2")
    assert seen == ["make", "make", "rename"]  # failed calls are not observed
    ns.check_invariants()


def listing(ns, ino, after=0, limit=None):
    out = []
    for name, _ino, cookie in ns.get(ino).dir.list_from(after):
        out.append((name, cookie))
        if limit is not None and len(out) == limit:
            break
    return out


def test_namespace_readdir_cookies_stable_with_10000_entries(ns):
    d = mk(ns, ROOT_INO, b"big", DIR)
    names = [b"f%05d" % i for i in range(10_000)]
    for n in names:
        mk(ns, d.ino, n)
    full = listing(ns, d.ino)
    assert [n for n, _ in full] == names
    cookies = dict(full)
    assert len(set(cookies.values())) == 10_000 and all(c > 0 for c in cookies.values())

    # read in pages; between pages delete already-seen and not-yet-seen entries and add new ones
    rnd = random.Random(7)
    seen: list[bytes] = []
    deleted: set[bytes] = set()
    after = 0
    extra = 0
    while True:
        page = listing(ns, d.ino, after, limit=333)
        if not page:
            break
        for name, cookie in page:
            assert name not in deleted
            if name in cookies:
                assert cookies[name] == cookie  # a cookie never changes
            seen.append(name)
        after = page[-1][1]
        alive = sorted(set(cookies) - deleted)
        for victim in rnd.sample(alive, min(150, len(alive))):
            ns.unlink(d.ino, victim)
            deleted.add(victim)
        for _ in range(50 if extra < 1500 else 0):
            mk(ns, d.ino, b"new%05d" % extra)
            extra += 1
    assert len(seen) == len(set(seen)), "an entry was listed twice"
    # every entry that existed throughout the listing was listed exactly once
    survivors = set(names) - deleted
    assert survivors <= set(seen)
    assert set(n for n, _ in listing(ns, d.ino)) == survivors | {b"new%05d" % i for i in range(extra)}
    ns.check_invariants()


# ---- Filesystem ---------------------------------------------------------------

@pytest.fixture
def fs():
    a = Arena(32 * CS, CS, prefault=False)
    f = Filesystem(a, capacity_bytes=1 << 30)
    yield f
    f.check_invariants()
    a.close()


def create(fs, name, parent=ROOT_INO, flags=os.O_RDWR):
    r, inode = fs.create(parent, name, 0o644, flags, 0, 0)
    return r.fh, inode


def test_fs_write_read_truncate(fs):
    fh, inode = create(fs, b"f")
    assert fs.write(fh, 5, b"hello") == 5
    assert inode.size == 10
    assert bytes(fs.read(fh, 0, 100)) == bytes(5) + b"hello"
    fs.setattr(inode.ino, size=7)
    assert bytes(fs.read(fh, 0, 100)) == bytes(5) + b"he"
    fs.setattr(inode.ino, size=3 * CS)
    assert bytes(fs.read(fh, 0, 3 * CS)) == bytes(5) + b"he" + bytes(3 * CS - 7)
    assert bytes(fs.read(fh, 3 * CS, 10)) == b""
    assert errno_of(fs.setattr, ROOT_INO, size=0) == errno.EISDIR
    assert errno_of(fs.truncate, inode, -1) == errno.EINVAL
    fs.check_invariants()
    fs.release(fh)


def test_fs_fallocate_modes(fs):
    from ckptfs.fs.core import FALLOC_FL_KEEP_SIZE as KEEP, FALLOC_FL_PUNCH_HOLE as PUNCH, \
        FALLOC_FL_ZERO_RANGE as ZERO
    fh, inode = create(fs, b"f")
    fs.write(fh, 0, b"\xff" * (3 * CS))
    v = inode.version
    fs.fallocate(fh, 0, 10 * CS, 0)  # allocate: a hole to 10 chunks, nothing held
    assert inode.size == 10 * CS and fs.arena.used_slots == 3 and inode.version > v
    fs.fallocate(fh, 0, 20 * CS, KEEP)
    assert inode.size == 10 * CS
    fs.fallocate(fh, CS, CS, PUNCH | KEEP)
    assert bytes(fs.read(fh, 0, 3 * CS)) == b"\xff" * CS + bytes(CS) + b"\xff" * CS
    assert fs.arena.used_slots == 2
    fs.fallocate(fh, 2 * CS + 1, 12 * CS, ZERO)  # zeroes, and extends the file
    assert inode.size == 14 * CS + 1 and bytes(fs.read(fh, 2 * CS, 2)) == b"\xff\0"
    fs.fallocate(fh, 20 * CS, CS, PUNCH | KEEP)  # past the end: nothing
    assert inode.size == 14 * CS + 1
    assert fs.seek(fh, CS, os.SEEK_DATA) == 2 * CS and fs.seek(fh, 2 * CS, os.SEEK_HOLE) == 2 * CS + 1
    assert errno_of(fs.seek, fh, 14 * CS + 1, os.SEEK_DATA) == errno.ENXIO
    assert errno_of(fs.seek, fh, 3 * CS, os.SEEK_DATA) == errno.ENXIO  # only a hole after it
    assert errno_of(fs.fallocate, fh, 0, CS, 0x08) == errno.EOPNOTSUPP  # COLLAPSE_RANGE
    assert errno_of(fs.fallocate, fh, 0, 0, 0) == errno.EINVAL
    assert errno_of(fs.fallocate, fh, 0, 2 << 30, 0) == errno.ENOSPC  # more than the free space
    assert inode.size == 14 * CS + 1
    ro = fs.open(inode.ino, os.O_RDONLY).fh
    assert errno_of(fs.fallocate, ro, 0, CS, 0) == errno.EBADF
    fs.release(ro)
    fs.release(fh)


def test_fs_any_change_to_the_bytes_drops_the_attributes_that_described_them(fs):
    """CONTENT_XATTR attributes (a restore's object) go with a write, a truncate, an fallocate or a
    copy into the file; a chmod, a rename, a user attribute or a read keep them."""
    from ckptfs.fs.core import FALLOC_FL_KEEP_SIZE as KEEP, FALLOC_FL_PUNCH_HOLE as PUNCH
    from ckptfs.fs.namespace import CONTENT_XATTR
    tag = CONTENT_XATTR + b"object"
    fh, inode = create(fs, b"f")
    fs.write(fh, 0, b"x" * (2 * CS))
    other, _ = create(fs, b"g")
    fs.write(other, 0, b"y" * 10)
    changes = [lambda: fs.write(fh, 3, b"z"), lambda: fs.setattr(inode.ino, size=CS),
               lambda: fs.fallocate(fh, 0, CS, PUNCH | KEEP), lambda: fs.copy_range(other, 0, fh, 5, 10),
               lambda: fs.setattr(inode.ino, size=4 * CS)]
    for change in changes:
        fs.ns.setxattr(inode.ino, tag, b"objects/abc")
        fs.setattr(inode.ino, mode=0o600)
        fs.rename(ROOT_INO, b"f", ROOT_INO, b"f2")
        fs.rename(ROOT_INO, b"f2", ROOT_INO, b"f")
        fs.ns.setxattr(inode.ino, b"user.k", b"v")
        fs.read(fh, 0, 10)
        assert inode.xattrs[tag] == b"objects/abc"
        change()
        assert tag not in inode.xattrs and inode.xattrs[b"user.k"] == b"v"
    for h in (fh, other):
        fs.release(h)


def test_fs_copy_range(fs):
    """copy_file_range: from any offset to any offset, clipped at the source's end (0 at it), a
    hole in the source written as zeros, the destination grown; two ranges of one file in one
    chunk; a destination not open for writing is EBADF."""
    data = random.Random(7).randbytes(3 * CS + 100)
    fh, src = create(fs, b"src")
    fs.write(fh, 0, data)
    fs.write(fh, 5 * CS, b"tail")  # chunks 3 (past 100) and 4: a hole
    whole = data + bytes(5 * CS - len(data)) + b"tail"
    out, dst = create(fs, b"dst")
    fs.write(out, 0, b"\xee" * (CS // 2))
    v = dst.version
    assert fs.copy_range(fh, 10, out, CS // 4, 9 * CS) == src.size - 10
    assert dst.size == CS // 4 + src.size - 10 and dst.version > v
    assert bytes(fs.read(out, 0, dst.size)) == b"\xee" * (CS // 4) + whole[10:]
    assert fs.copy_range(fh, src.size, out, 0, CS) == 0 and fs.copy_range(fh, src.size + 5, out, 0, CS) == 0
    assert fs.copy_range(fh, 0, fh, CS - 100, 50) == 50  # one chunk, ranges apart
    assert bytes(fs.read(fh, CS - 100, 50)) == data[:50] and bytes(fs.read(fh, 0, 50)) == data[:50]
    ro = fs.open(dst.ino, os.O_RDONLY).fh
    assert errno_of(fs.copy_range, fh, 0, ro, 0, 10) == errno.EBADF
    for h in (ro, out, fh):
        fs.release(h)


def _copy_pair(slots: int, chunks: int):
    """A filesystem over an arena of `slots` chunks, with a file "src" of `chunks` random chunks
    and an empty "dst", both open: (fs, arena, fh, src, data, out, dst)."""
    a = Arena(slots * CS, CS, prefault=False)
    fs = Filesystem(a, capacity_bytes=1 << 30)
    fh, src = create(fs, b"src")
    data = random.Random(chunks).randbytes(chunks * CS)
    fs.write(fh, 0, data)
    out, dst = create(fs, b"dst")
    return fs, a, fh, src, data, out, dst


def test_fs_copy_range_is_short_when_memory_fills_and_nospace_when_nothing_fits():
    fs, a, fh, _, data, out, dst = _copy_pair(4, 3)
    assert fs.copy_range(fh, 0, out, 0, 3 * CS) == CS  # one slot was free
    with pytest.raises(NoSpace):
        fs.copy_range(fh, CS, out, CS, 2 * CS)
    assert dst.size == CS and bytes(fs.read(out, 0, CS)) == data[:CS]
    fs.check_invariants()
    a.close()


def test_facade_a_copy_from_evicted_chunks_fetches_those_ahead_once_then_copies():
    """The source's chunks only on a device: the copy stops short before them; asked for the rest
    it raises NeedsFetch naming every evicted chunk ahead (one fetch, not one per chunk), and the
    facade's copy fetches them and copies it all."""
    import trio
    from ckptfs.fs.facade import AsyncFilesystem, Backend
    from ckptfs.fs.filemap import NeedsFetch
    fs, a, fh, src, data, out, _ = _copy_pair(16, 4)
    for idx in (1, 2, 3):  # evicted, as the store leaves drained chunks
        chunk = src.data.chunks[idx]
        a.free(chunk.slot)
        chunk.slot = None
    fetched = []

    async def fetch(chunks, held):
        fetched.append([c.idx for c in chunks])
        for c in chunks:
            c.slot = a.alloc_nowait()
            a.view(c.slot)[:CS] = data[c.idx * CS:(c.idx + 1) * CS]

    afs = AsyncFilesystem(fs, Backend(fetch=fetch))
    assert afs.copy_range_nowait(fh, 0, out, 0, 4 * CS) == CS
    with pytest.raises(NeedsFetch) as e:
        afs.copy_range_nowait(fh, CS, out, CS, 3 * CS)
    assert [c.idx for c in e.value.chunks] == [1, 2, 3]
    assert trio.run(functools.partial(afs.copy_range, fh, CS, out, CS, 3 * CS)) == 3 * CS
    assert fetched == [[1, 2, 3]] and bytes(fs.read(out, 0, 4 * CS)) == data
    fs.check_invariants()
    a.close()


def test_fs_append_and_readonly_handles(fs):
    fh, inode = create(fs, b"f")
    fs.write(fh, 0, b"abc")
    fs.release(fh)
    app = fs.open(inode.ino, os.O_WRONLY | os.O_APPEND).fh
    assert fs.write(app, 0, b"def") == 3  # offset ignored under O_APPEND
    ro = fs.open(inode.ino, os.O_RDONLY).fh
    assert bytes(fs.read(ro, 0, 10)) == b"abcdef"
    assert errno_of(fs.write, ro, 0, b"x") == errno.EBADF
    assert errno_of(fs.read, 999, 0, 1) == errno.EBADF
    fs.release(app)
    fs.release(ro)
    tr = fs.open(inode.ino, os.O_WRONLY | os.O_TRUNC).fh
    assert inode.size == 0
    fs.write(tr, 0, b"again")
    fs.release(tr)
    ro_tr = fs.open(inode.ino, os.O_RDONLY | os.O_TRUNC).fh  # Linux truncates here too
    assert inode.size == 0 and bytes(fs.read(ro_tr, 0, 10)) == b""
    fs.release(ro_tr)


def test_fs_open_errors(fs):
    d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
    s = fs.symlink(ROOT_INO, b"s", b"target", 0, 0)
    assert errno_of(fs.open, d.ino, os.O_RDONLY) == errno.EISDIR
    assert errno_of(fs.open, s.ino, os.O_RDONLY) == errno.ELOOP
    assert fs.readlink(s.ino) == b"target" and s.size == 6
    fh, f = create(fs, b"f")
    assert errno_of(fs.readlink, f.ino) == errno.EINVAL
    assert errno_of(fs.symlink, ROOT_INO, b"long", b"x" * 4096, 0, 0) == errno.ENAMETOOLONG
    fs.release(fh)


def test_fs_unlinked_open_file_lives_until_release(fs):
    fh, inode = create(fs, b"f")
    fs.write(fh, 0, os.urandom(5 * CS))
    assert fs.arena.used_slots == 5
    fs.unlink(ROOT_INO, b"f")
    assert bytes(fs.read(fh, 0, 3))  # still readable
    fs.check_invariants()
    fs.release(fh)
    # no name and no handle: the data goes at once; the inode waits for the kernel's forget
    assert fs.arena.used_slots == 0
    assert inode.ino in fs.ns.inodes
    fs.check_invariants()
    fs.forget(inode.ino, 1)
    assert inode.ino not in fs.ns.inodes
    fs.check_invariants()


def test_fs_rename_over_frees_replaced_data(fs):
    fh1, a = create(fs, b"a")
    fh2, b = create(fs, b"b")
    fs.write(fh1, 0, b"A" * CS)
    fs.write(fh2, 0, b"B" * 2 * CS)
    fs.release(fh1)
    fs.release(fh2)
    fs.forget(b.ino, 1)
    fs.rename(ROOT_INO, b"a", ROOT_INO, b"b")
    assert fs.arena.used_slots == 1
    fs.check_invariants()


def test_fs_short_write_then_nospace(fs):
    fh, inode = create(fs, b"big")
    n = fs.write(fh, 0, bytes(40 * CS))
    assert n == 32 * CS and inode.size == n
    with pytest.raises(NoSpace):
        fs.write(fh, n, b"x")
    assert inode.size == n
    st_ = fs.statfs()
    assert st_.bfree == (1 << 30) // 4096 - 32
    fs.setattr(inode.ino, size=0)
    assert fs.arena.used_slots == 0
    fs.release(fh)


def test_fs_direct_reads_make_read_only_opens_of_all_but_small_files_direct_io(fs):
    fh, inode = create(fs, b"f")
    fs.write(fh, 0, b"v1v1v")
    fs.release(fh)
    fs.direct_reads = True  # the native engine, where the kernel maps direct_io files shared
    fs.cached_read_max = 4
    for _ in range(2):  # unchanged, yet no page cache: every read reaches the filesystem
        r = fs.open(inode.ino, os.O_RDONLY)
        assert r.direct_io and not r.keep_cache and r.noflush
        fs.release(r.fh)
    w = fs.open(inode.ino, os.O_RDWR)
    assert w.direct_io and not w.keep_cache and not w.noflush  # a writer's close commits: FLUSH
    fs.setattr(inode.ino, size=4)  # small now: read through the page cache, kept while unchanged
    fs.release(w.fh)
    r1 = fs.open(inode.ino, os.O_RDONLY)
    assert not r1.direct_io and not r1.keep_cache and r1.noflush
    fs.release(r1.fh)
    r2 = fs.open(inode.ino, os.O_RDONLY)
    assert not r2.direct_io and r2.keep_cache
    fs.release(r2.fh)


def test_fs_keep_cache_only_when_unchanged(fs):
    fh, inode = create(fs, b"f")
    fs.write(fh, 0, b"v1")
    fs.release(fh)
    r1 = fs.open(inode.ino, os.O_RDONLY)
    assert not r1.direct_io and not r1.keep_cache
    fs.release(r1.fh)
    r2 = fs.open(inode.ino, os.O_RDONLY)
    assert r2.keep_cache  # nothing changed since r1
    fs.release(r2.fh)
    w = fs.open(inode.ino, os.O_WRONLY)
    assert w.direct_io
    r3 = fs.open(inode.ino, os.O_RDONLY)
    assert not r3.keep_cache  # a writer is open
    fs.write(w.fh, 0, b"v2")
    fs.release(w.fh)
    fs.release(r3.fh)
    r4 = fs.open(inode.ino, os.O_RDONLY)
    assert not r4.keep_cache  # data changed since the cache was filled
    fs.release(r4.fh)
    fs.setattr(inode.ino, size=1)
    r5 = fs.open(inode.ino, os.O_RDONLY)
    assert not r5.keep_cache  # truncated
    fs.release(r5.fh)


def test_fs_xattrs(fs):
    fh, inode = create(fs, b"f")
    fs.setxattr(inode.ino, b"user.a", b"1")
    assert fs.getxattr(inode.ino, b"user.a") == b"1"
    assert fs.listxattr(inode.ino) == [b"user.a"]
    assert errno_of(fs.getxattr, inode.ino, b"user.b") == errno.ENODATA
    assert errno_of(fs.removexattr, inode.ino, b"user.b") == errno.ENODATA
    assert errno_of(fs.setxattr, inode.ino, b"user.big", bytes(65537)) == errno.E2BIG
    fs.removexattr(inode.ino, b"user.a")
    assert fs.listxattr(inode.ino) == []
    fs.release(fh)


def test_fs_setattr_metadata(fs):
    fh, inode = create(fs, b"f")
    fs.setattr(inode.ino, mode=0o4700, uid=5, gid=6, atime_ns=123, mtime_ns=456_000_000_789)
    assert stat.S_ISREG(inode.mode) and stat.S_IMODE(inode.mode) == 0o4700
    assert (inode.uid, inode.gid, inode.atime_ns, inode.mtime_ns) == (5, 6, 123, 456_000_000_789)
    fs.release(fh)


def test_fs_setattr_of_nothing_moves_ctime(fs):
    """chown(path, -1, -1) reaches the core as a setattr of nothing: it moves ctime, as on ext4."""
    fh, inode = create(fs, b"f")
    inode.ctime_ns = inode.mtime_ns = 5
    fs.setattr(inode.ino)
    assert inode.ctime_ns > 5 and inode.mtime_ns == 5 and stat.S_IMODE(inode.mode) == 0o644
    fs.release(fh)


NOBODY = Caller(65534, 65534)
ROOT = Caller(0, 0, fsetid=True)


@pytest.mark.parametrize("mode, gid, caller, dropped", [
    (0o4777, 0, NOBODY, 0o4000),
    (0o2777, 0, NOBODY, 0o2000),
    (0o6777, 0, NOBODY, 0o6000),
    (0o2767, 0, NOBODY, 0o2000),  # not in the group: goes even without group-execute
    (0o2767, 65534, NOBODY, 0),  # in the group, no group-execute: stays
    (0o2767, 7, Caller(65534, 65534, frozenset({7})), 0),  # a supplementary group counts
    (0o2777, 65534, NOBODY, 0o2000),  # group-execute: goes whoever writes
    (0o6777, 0, ROOT, 0),  # CAP_FSETID keeps both
    (0o6777, 0, Caller(0, 0), 0o6000),  # uid 0 without CAP_FSETID does not
    (0o6777, 0, None, 0),  # the filesystem itself
    (0o0777, 0, NOBODY, 0),
])
def test_setid_bits_to_drop_follows_linux(mode, gid, caller, dropped):
    assert setid_bits_to_drop(stat.S_IFREG | mode, gid, caller) == dropped
    assert setid_bits_to_drop(stat.S_IFDIR | mode, gid, caller) == 0  # regular files only


def test_creds_caller_reads_capabilities_and_groups_from_proc():
    me = caller(os.getuid(), os.getgid(), os.getpid())
    assert me.groups == frozenset(os.getgroups())
    with open("/proc/self/status") as f:
        cap_eff = int(next(line for line in f if line.startswith("CapEff:")).split()[1], 16)
    assert me.fsetid == bool(cap_eff & (1 << 4))
    assert caller(0, 0, 0) == Caller(0, 0, frozenset(), True)  # no process to ask: uid 0 counts
    assert caller(5, 6, 0) == Caller(5, 6, frozenset(), False)
    assert caller(5, 6, 1 << 30).fsetid is False  # gone


def test_fs_unprivileged_write_truncate_and_o_trunc_clear_setid_bits():
    seen = []
    a = Arena(32 * CS, CS, prefault=False)
    fs = Filesystem(a, capacity_bytes=1 << 30)
    fs.ns.observer = seen.append
    fh, f = create(fs, b"f")
    fs.write(fh, 0, b"data")
    fs.release(fh)
    fs.setattr(f.ino, mode=0o6777)
    ro = fs.open(f.ino, os.O_RDONLY, NOBODY).fh
    w = fs.open(f.ino, os.O_WRONLY, NOBODY).fh
    assert stat.S_IMODE(f.mode) == 0o6777  # opening alone changes nothing
    seen.clear()
    before = f.ctime_ns
    fs.write(w, 0, b"D")
    assert stat.S_IMODE(f.mode) == 0o777 and f.ctime_ns > before
    assert [r[:3] for r in seen] == [("setattr", f.ino, 0o777)]  # journaled like a chmod
    fs.setattr(f.ino, mode=0o4777)  # put back while the writer is open: its next write clears again
    fs.write(w, 1, b"A")
    assert stat.S_IMODE(f.mode) == 0o777
    fs.release(w)
    fs.release(ro)
    fs.setattr(f.ino, mode=0o6777)
    fs.release(fs.open(f.ino, os.O_WRONLY | os.O_TRUNC, ROOT).fh)
    assert stat.S_IMODE(f.mode) == 0o6777  # CAP_FSETID keeps them
    fs.release(fs.open(f.ino, os.O_WRONLY | os.O_TRUNC, NOBODY).fh)  # empty already: still cleared
    assert stat.S_IMODE(f.mode) == 0o777
    fs.setattr(f.ino, mode=0o6766)
    fs.setattr(f.ino, size=1, mode=0o2766, caller=NOBODY)  # FUSE's own rule left the set-group-ID bit
    assert stat.S_IMODE(f.mode) == 0o766 and f.size == 1
    fs.check_invariants()
    a.close()


def test_fs_setgid_directory_passes_on_its_group(fs):
    d = fs.mkdir(ROOT_INO, b"d", 0o2775, 0, 1234)
    assert d.mode & stat.S_ISGID and d.gid == 1234
    fh, f = create(fs, b"f", parent=d.ino)
    sub = fs.mkdir(d.ino, b"sub", 0o755, 5, 6)
    assert f.gid == 1234 and sub.gid == 1234 and sub.mode & stat.S_ISGID
    plain = fs.mkdir(ROOT_INO, b"plain", 0o755, 5, 6)
    assert plain.gid == 6 and not plain.mode & stat.S_ISGID
    fs.release(fh)


class Closes(Durability):
    """A Durability that records the size of each commit point."""

    def __init__(self):
        self.sizes = []

    def closed(self, inode):
        self.sizes.append(inode.size)


def test_a_late_release_never_commits_the_state_a_new_writer_is_producing():
    # The kernel sends RELEASE after close() returned: a trainer rewriting last.pt in place may
    # already have reopened it with O_TRUNC. The close (FLUSH) commits; the late RELEASE must not
    # commit the truncated, half-rewritten file (a crash would then keep it).
    a = Arena(32 * CS, CS, prefault=False)
    closes = Closes()
    fs = Filesystem(a, capacity_bytes=1 << 30, durability=closes)
    r, inode = fs.create(ROOT_INO, b"last.pt", 0o644, os.O_WRONLY, 0, 0)
    fs.write(r.fh, 0, b"x" * 3 * CS)
    fs.flush(r.fh)
    assert closes.sizes == [3 * CS]
    again = fs.open(inode.ino, os.O_WRONLY | os.O_TRUNC)
    fs.release(r.fh)  # the first descriptor's RELEASE, late
    fs.write(again.fh, 0, b"y" * CS)
    assert closes.sizes == [3 * CS]
    fs.flush(again.fh)
    fs.release(again.fh)
    assert closes.sizes == [3 * CS, CS, CS]
    reader = fs.open(inode.ino, os.O_RDONLY)
    fs.flush(reader.fh)
    assert closes.sizes == [3 * CS, CS, CS]  # a reader's close commits nothing
    fs.check_invariants()
    a.close()


def test_writev_adopts_whole_chunks_copies_the_rest_and_stops_short_when_memory_runs_out():
    """core.writev: the pieces of one request scattered over lent slots. Whole chunks on the
    grid adopt their slot, and so does a last piece that starts a chunk holding nothing; pieces
    off the grid are copied; when the arena runs out partway the write is short (what went in
    stays), and with nothing written it raises NoSpace."""
    arena = Arena(6 * CS, CS)
    fs = Filesystem(arena, capacity_bytes=1 << 30)
    inode = fs.mknod(ROOT_INO, b"f", stat.S_IFREG | 0o644, 0, 0, 0)
    fh = fs.open(inode.ino, os.O_RDWR).fh
    slots = [arena.lend_nowait() for _ in range(3)]
    data = [random.Random(i).randbytes(CS) for i in range(3)]
    for slot, d in zip(slots, data):
        arena.view(slot)[:] = d
    pieces = [arena.view(slots[0]), arena.view(slots[1]), arena.view(slots[2])[:100]]
    assert fs.writev(fh, CS, pieces, slots=slots) == 2 * CS + 100
    assert not any(arena.is_lent(s) for s in slots)
    chunks = inode.data.chunks
    assert [chunks[i].slot for i in (1, 2, 3)] == slots and chunks[3].hwm == 100
    assert bytes(fs.read(fh, 0, 4 * CS)) == bytes(CS) + data[0] + data[1] + data[2][:100]
    # off the grid: nothing adopted, all copied; 2 slots free, then the arena runs out partway
    spare = arena.lend_nowait()
    arena.view(spare)[:] = data[2]
    assert arena.free_slots == 2  # 6 slots: chunks 1, 2, 3 and the one lent
    got = fs.writev(fh, 4 * CS + 7, [arena.view(spare)] * 3, slots=[spare, None, None])
    assert got == 2 * CS - 7  # chunks 4 and 5 allocated, chunk 6 found no slot: short
    assert arena.is_lent(spare) and inode.size == 6 * CS
    assert bytes(fs.read(fh, 4 * CS + 7, 2 * CS)) == data[2] + data[2][:CS - 7]
    with pytest.raises(NoSpace):
        fs.writev(fh, 6 * CS, [arena.view(spare)], slots=[None])
    arena.unlend(spare)
    arena.check_invariants()


def test_writev_adopts_a_piece_ending_inside_a_chunk_only_where_nothing_past_it_would_be_copied():
    """A piece from a chunk's start that ends inside it takes its lent slot when the chunk is new
    or holds no more than the piece; where the chunk holds bytes past the piece's end, they stay
    and the piece is copied into the chunk (the slot stays lent)."""
    arena = Arena(8 * CS, CS)
    fs = Filesystem(arena, capacity_bytes=1 << 30)
    inode = fs.mknod(ROOT_INO, b"f", stat.S_IFREG | 0o644, 0, 0, 0)
    fh = fs.open(inode.ino, os.O_RDWR).fh
    old = random.Random(1).randbytes(3000)
    assert fs.write(fh, 0, old) == 3000
    first = inode.data.chunks[0]

    def lent(payload: bytes) -> int:
        slot = arena.lend_nowait()
        arena.view(slot)[:] = b"\xee" * CS  # what an earlier use left: never read as data
        arena.view(slot)[:len(payload)] = payload
        return slot

    short = random.Random(2).randbytes(2000)
    slot = lent(short)
    assert fs.writev(fh, 0, [arena.view(slot)[:2000]], slots=[slot]) == 2000
    assert arena.is_lent(slot) and inode.data.chunks[0] is first  # copied: 1000 bytes of it stay
    assert bytes(fs.read(fh, 0, CS)) == short + old[2000:]
    arena.unlend(slot)
    longer = random.Random(3).randbytes(3500)
    slot = lent(longer)
    assert fs.writev(fh, 0, [arena.view(slot)[:3500]], slots=[slot]) == 3500
    chunk = inode.data.chunks[0]
    assert not arena.is_lent(slot) and chunk.slot == slot and chunk.hwm == 3500 and chunk is not first
    assert bytes(fs.read(fh, 0, CS)) == longer  # the slot's old bytes past 3500 read as the file's end
    fs.truncate(inode, 4000)
    assert bytes(fs.read(fh, 0, CS)) == longer + bytes(500)  # and as zeros once the file grows
    arena.check_invariants()


def _shifted_request(arena, r: int, data: bytes) -> tuple[list[int], list[memoryview]]:
    """A request read into a shifted run, as the native engine's workers do: `data` scattered over
    lent slots, the first starting `r` bytes into its slot (its head left as garbage)."""
    slots, pieces, done = [], [], 0
    while done < len(data):
        slot = arena.lend_nowait()
        view = arena.view(slot)
        view[:] = b"\xee" * CS
        at = r if not slots else 0
        n = min(CS - at, len(data) - done)
        view[at:at + n] = data[done:done + n]
        slots.append(slot)
        pieces.append(view[at:at + n])
        done += n
    return slots, pieces


def test_writev_adopts_a_shifted_first_piece_after_copying_the_chunks_head():
    """A request r bytes past a chunk boundary, read into a shifted run: its first piece, the rest
    of a chunk whose first r bytes the previous request wrote, adopts its slot too, after those
    r bytes are copied into it; the chunk counts the bytes of both requests (absorbed)."""
    r = 333
    arena = Arena(8 * CS, CS)
    fs = Filesystem(arena, capacity_bytes=1 << 30)
    inode = fs.mknod(ROOT_INO, b"f", REG, 0, 0, 0)
    fh = fs.open(inode.ino, os.O_RDWR).fh
    rng = random.Random(5)
    head = rng.randbytes(CS + r)  # the previous request: ends r bytes into chunk 1
    assert fs.write(fh, 0, head) == CS + r
    data = rng.randbytes(2 * CS)  # this one: chunk 1 from r, chunk 2, r bytes of chunk 3
    slots, pieces = _shifted_request(arena, r, data)
    assert fs.writev(fh, CS + r, pieces, slots=slots, shift=r) == 2 * CS
    chunks = inode.data.chunks
    assert not any(arena.is_lent(s) for s in slots)  # the last piece (r bytes, a new chunk) too
    assert [chunks[i].slot for i in (1, 2, 3)] == slots and chunks[3].hwm == r
    assert (chunks[1].hwm, chunks[1].absorbed) == (CS, CS)  # r from the first request, CS - r from this
    assert bytes(fs.read(fh, 0, 4 * CS)) == head + data
    fs.check_invariants()
    # a hole before it: the head reads as zeros; a whole piece later in a shifted run adopts as ever
    slots2, pieces2 = _shifted_request(arena, r, data[:CS - r])
    assert fs.writev(fh, 5 * CS + r, pieces2, slots=slots2, shift=r) == CS - r
    assert chunks[5].slot == slots2[0] and chunks[5].absorbed == CS - r and not arena.is_lent(slots2[0])
    assert bytes(fs.read(fh, 5 * CS, CS)) == bytes(r) + data[:CS - r]
    # a head shorter than r: zeros up to r, as a write past the high-water mark fills
    assert fs.write(fh, 6 * CS, b"ab") == 2
    slots3, pieces3 = _shifted_request(arena, r, data[:CS - r])
    assert fs.writev(fh, 6 * CS + r, pieces3, slots=slots3, shift=r) == CS - r
    assert chunks[6].slot == slots3[0] and chunks[6].absorbed == CS - r + 2
    assert bytes(fs.read(fh, 6 * CS, CS)) == b"ab" + bytes(r - 2) + data[:CS - r]
    fs.check_invariants()


def test_a_shifted_first_piece_off_its_place_or_short_is_copied():
    """The first piece is adopted only where it lies at its own offset in the chunk (the guessed
    shift was right), reaches the chunk's end and is no shorter than the chunk's head (which an
    adoption copies); otherwise it is copied, its slot stays lent."""
    r = 100
    arena = Arena(8 * CS, CS)
    fs = Filesystem(arena, capacity_bytes=1 << 30)
    inode = fs.mknod(ROOT_INO, b"f", REG, 0, 0, 0)
    fh = fs.open(inode.ino, os.O_RDWR).fh
    model = bytearray(random.Random(1).randbytes(3 * CS))
    fs.write(fh, 0, model)
    data = random.Random(2).randbytes(CS - r)
    for off, size in [(r + 1, CS - r), (CS + r, CS - r - 1)]:  # another offset; shorter than the tail
        slots, pieces = _shifted_request(arena, r, data[:size])
        assert fs.writev(fh, off, pieces, slots=slots, shift=r) == size
        assert arena.is_lent(slots[0]) and inode.data.chunks[off // CS].slot != slots[0]
        model[off:off + size] = data[:size]
        arena.unlend(slots[0])
    big = CS - CS // 16  # the last 64 KiB piece of a 1 MiB chunk: the head is 15 times the piece
    slots, pieces = _shifted_request(arena, big, data[:CS - big])
    assert fs.writev(fh, 2 * CS + big, pieces, slots=slots, shift=big) == CS - big
    assert arena.is_lent(slots[0]) and inode.data.chunks[2].slot != slots[0]
    model[2 * CS + big:] = data[:CS - big]
    arena.unlend(slots[0])
    half = CS // 2  # head and piece of one size: adopted
    slots, pieces = _shifted_request(arena, half, data[:half])
    assert fs.writev(fh, CS + half, pieces, slots=slots, shift=half) == half
    assert inode.data.chunks[1].slot == slots[0] and not arena.is_lent(slots[0])
    model[CS + half:2 * CS] = data[:half]
    assert bytes(fs.read(fh, 0, 3 * CS)) == model
    fs.check_invariants()


def test_a_shifted_first_piece_over_a_chunk_a_reply_shows_leaves_the_reply_its_bytes():
    """The chunk being adopted over has a READ reply in flight (readers): the reply keeps showing
    the old bytes (the old slot is freed only at read_done), the file has the new ones."""
    r = 64
    arena = Arena(8 * CS, CS)
    fs = Filesystem(arena, capacity_bytes=1 << 30)
    inode = fs.mknod(ROOT_INO, b"f", REG, 0, 0, 0)
    fh = fs.open(inode.ino, os.O_RDWR).fh
    old = random.Random(3).randbytes(2 * CS)
    fs.write(fh, 0, old)
    pinned = fs.read_pinned(fh, 0, 2 * CS)
    old_slot = inode.data.chunks[0].slot
    data = random.Random(4).randbytes(CS - r)
    slots, pieces = _shifted_request(arena, r, data)
    free = arena.free_slots
    assert fs.writev(fh, r, pieces, slots=slots, shift=r) == CS - r
    assert inode.data.chunks[0].slot == slots[0] and not arena.is_lent(slots[0])
    assert b"".join(pinned) == old and arena.free_slots == free  # the old slot is still the reply's
    assert bytes(fs.read(fh, 0, 2 * CS)) == old[:r] + data + old[CS:]
    fs.owner.read_done(pinned.chunks)
    assert arena.free_slots == free + 1 and old_slot in arena._free
    fs.check_invariants()


def test_a_shifted_first_piece_over_a_chunk_only_on_a_device_is_not_adopted():
    """Where the chunk's head is only on a device (evicted), the slot cannot be completed without
    a fetch: NeedsFetch, nothing changed, the slot still lent (the caller fetches and copies)."""
    from ckptfs.fs.filemap import NeedsFetch
    r = 10
    arena = Arena(4 * CS, CS)
    fs = Filesystem(arena, capacity_bytes=1 << 30)
    inode = fs.mknod(ROOT_INO, b"f", REG, 0, 0, 0)
    fh = fs.open(inode.ino, os.O_RDWR).fh
    fs.write(fh, 0, b"h" * r)
    chunk = inode.data.chunks[0]
    arena.free(chunk.slot)  # as an eviction leaves it (the store does this for drained chunks)
    chunk.slot = None
    slots, pieces = _shifted_request(arena, r, b"t" * (CS - r))
    with pytest.raises(NeedsFetch) as e:
        fs.writev(fh, r, pieces, slots=slots, shift=r)
    assert e.value.chunks == [chunk] and inode.data.chunks[0] is chunk and arena.is_lent(slots[0])
    arena.unlend(slots[0])
    fs.check_invariants()


def test_facade_a_truncate_that_must_copy_a_held_chunk_waits_for_memory():
    """A truncate into a chunk a READ reply still holds copies it first; with the arena full that
    raises NoSpace inside the core: the facade waits for room and retries (it used to fail the
    truncate with ENOSPC), and fails only when room never comes."""
    import trio
    from ckptfs.fs.facade import AsyncFilesystem, Backend
    a = Arena(2 * CS, CS, prefault=False)
    fs = Filesystem(a, capacity_bytes=1 << 30)
    fh, inode = create(fs, b"f")
    fs.write(fh, 0, b"x" * (2 * CS))  # every slot taken
    pinned = fs.read_pinned(fh, CS, 10)  # a reply in flight holds chunk 1
    waits = []

    async def room(devices_full: bool) -> bool:
        waits.append(devices_full)
        fs.owner.read_done(pinned.chunks)  # the reply went out
        return True

    afs = AsyncFilesystem(fs, Backend(room=room))
    trio.run(functools.partial(afs.setattr, inode.ino, size=CS + 5))
    assert waits == [False] and inode.size == CS + 5 and bytes(fs.read(fh, CS, 10)) == b"x" * 5
    pinned = fs.read_pinned(fh, CS, 5)

    async def never(devices_full: bool) -> bool:
        return False

    with pytest.raises(NoSpace):
        trio.run(functools.partial(AsyncFilesystem(fs, Backend(room=never)).setattr, inode.ino, size=CS + 2))
    fs.owner.read_done(pinned.chunks)
    fs.check_invariants()
    fs.release(fh)
