"""POSIX behaviour on a real mount: each test uses plain os calls on ckptfs.

One mount serves the module (mounting costs ~1.5 s); every test works in a
fresh directory of its own, so tests stay independent.
"""
from __future__ import annotations

import errno
import json
import mmap
import os
import stat
import subprocess
from pathlib import Path

import pytest

from ckptfs.format.layout import plan
from mounting import ckptfs, reachable_mount
from syscalls import (FALLOC_FL_COLLAPSE_RANGE, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE,
                      RENAME_EXCHANGE, RENAME_NOREPLACE, copy_range, fallocate, renameat2)

pytestmark = pytest.mark.mount


@pytest.fixture(scope="module")
def mnt(engine):
    # under a 0755 folder, so that other users (the tests as nobody) can reach the mount
    with reachable_mount("ckptfs-posix-", engine) as m:
        yield m


@pytest.fixture
def d(mnt, request) -> Path:
    """A fresh, empty directory on the mount for one test."""
    p = mnt.path / request.node.name.replace("[", "_").replace("]", "")
    p.mkdir()
    return p


def err(fn, *args, **kw) -> int:
    with pytest.raises(OSError) as info:
        fn(*args, **kw)
    return info.value.errno


# ---- open flags -------------------------------------------------------------

def test_open_creat_excl_trunc(d):
    p = d / "f"
    fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640)
    assert os.write(fd, b"hello world") == 11
    os.close(fd)
    assert err(os.open, p, os.O_CREAT | os.O_EXCL | os.O_WRONLY) == errno.EEXIST
    assert err(os.open, d / "missing", os.O_RDONLY) == errno.ENOENT
    fd = os.open(p, os.O_CREAT | os.O_RDWR)  # exists: plain open
    assert os.read(fd, 100) == b"hello world"
    os.close(fd)
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    assert os.fstat(fd).st_size == 0
    os.write(fd, b"new")
    os.close(fd)
    assert p.read_bytes() == b"new"
    fd = os.open(p, os.O_RDONLY | os.O_TRUNC)  # truncates on Linux, as on ext4
    assert os.fstat(fd).st_size == 0 and os.read(fd, 10) == b""
    os.close(fd)
    assert os.stat(p).st_size == 0
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640 & ~_umask()


def _umask() -> int:
    u = os.umask(0)
    os.umask(u)
    return u


def test_open_append(d):
    p = d / "log"
    p.write_bytes(b"start;")
    a = os.open(p, os.O_WRONLY | os.O_APPEND)
    b = os.open(p, os.O_WRONLY | os.O_APPEND)
    os.write(a, b"a1;")
    os.write(b, b"b1;")
    os.lseek(a, 0, os.SEEK_SET)  # O_APPEND ignores the offset
    os.write(a, b"a2;")
    os.close(a)
    os.close(b)
    assert p.read_bytes() == b"start;a1;b1;a2;"


def test_pread_pwrite_any_offset(d):
    p = d / "f"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    ref = bytearray()
    rnd = __import__("random").Random(3)
    for off, n in [(0, 1), (1, 4095), (4095, 3), (1 << 20, 17), ((1 << 20) - 1, 2), (5, 1 << 20),
                   (3 * (1 << 20) + 1, 70000)]:
        buf = rnd.randbytes(n)
        assert os.pwrite(fd, buf, off) == n
        if off + n > len(ref):
            ref.extend(bytes(off + n - len(ref)))
        ref[off:off + n] = buf
    assert os.fstat(fd).st_size == len(ref)
    for off in (0, 1, 4094, 4095, 1 << 20, (1 << 20) + 7, len(ref) - 1):
        assert os.pread(fd, 9000, off) == bytes(ref[off:off + 9000])
    assert os.pread(fd, 10, len(ref) + 100) == b""
    os.close(fd)
    assert p.read_bytes() == bytes(ref)


def test_sparse_file_holes_read_zeros(d):
    p = d / "sparse"
    with open(p, "wb") as f:
        f.write(b"head")
        f.seek(100 << 20)
        f.write(b"tail")
    st = os.stat(p)
    assert st.st_size == (100 << 20) + 4
    assert st.st_blocks * 512 < 8 << 20  # the hole takes no memory
    with open(p, "rb") as f:
        assert f.read(4) == b"head"
        f.seek(50 << 20)
        assert f.read(1 << 20) == bytes(1 << 20)
        f.seek((100 << 20) - 2)
        assert f.read() == b"\0\0tail"


def test_fallocate_and_seek_data_hole(d, mnt, engine):
    """native: allocating holds nothing (no zeros absorbed or drained) and refuses more than the
    free space; a punched hole frees its chunks and reads as zeros; SEEK_DATA / SEEK_HOLE follow
    the chunks. pyfuse3 serves neither (libfuse's FALLOCATE and LSEEK are not in pyfuse3):
    fallocate(2) is EOPNOTSUPP and SEEK_HOLE finds the end of the file."""
    chunk = _status(mnt)["pool"]["chunk_size"]
    p = d / "f"
    data = os.urandom(8 * chunk)
    p.write_bytes(data)
    fd = os.open(p, os.O_RDWR)
    try:
        if engine != "native":
            assert err(fallocate, fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, chunk) == errno.EOPNOTSUPP
            assert os.lseek(fd, 0, os.SEEK_HOLE) == len(data)
            return
        blocks = os.fstat(fd).st_blocks
        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, chunk + 5, 4 * chunk)
        want = data[:chunk + 5] + bytes(4 * chunk) + data[5 * chunk + 5:]
        assert os.pread(fd, len(data) + 1, 0) == want
        st = os.fstat(fd)
        assert st.st_size == len(data) and st.st_blocks * 512 <= blocks * 512 - 3 * chunk
        assert os.lseek(fd, 0, os.SEEK_HOLE) == chunk + 5
        assert os.lseek(fd, chunk + 5, os.SEEK_DATA) == 5 * chunk
        assert err(os.lseek, fd, len(data), os.SEEK_DATA) == errno.ENXIO
        os.posix_fallocate(fd, 0, 64 * chunk)  # mode 0: the size grows, nothing is written
        st = os.fstat(fd)
        assert st.st_size == 64 * chunk and st.st_blocks * 512 <= blocks * 512
        assert os.lseek(fd, 8 * chunk, os.SEEK_HOLE) == 8 * chunk
        assert err(os.lseek, fd, 8 * chunk, os.SEEK_DATA) == errno.ENXIO
        assert os.pread(fd, chunk, 40 * chunk) == bytes(chunk)
        fallocate(fd, FALLOC_FL_ZERO_RANGE, 63 * chunk, 2 * chunk)  # zeroes and extends
        assert os.fstat(fd).st_size == 65 * chunk
        free = os.statvfs(p).f_bavail * os.statvfs(p).f_frsize
        assert err(os.posix_fallocate, fd, 0, free + 100 * chunk) == errno.ENOSPC
        assert err(fallocate, fd, FALLOC_FL_COLLAPSE_RANGE, 0, chunk) == errno.EOPNOTSUPP
        assert os.fstat(fd).st_size == 65 * chunk
    finally:
        os.close(fd)
    assert p.read_bytes()[:len(want)] == want


def test_copy_file_range(d, mnt, engine):
    """copy_file_range inside the mount gives the bytes read() would, at any offsets, and stops at
    the source's end; two overlapping ranges of one file are EINVAL (the kernel's check). native:
    the daemon copies arena to arena (COPY_FILE_RANGE_64), no WRITE crosses /dev/fuse; pyfuse3
    serves no COPY_FILE_RANGE, so the kernel copies through splice (64 KiB WRITEs)."""
    chunk = _status(mnt)["pool"]["chunk_size"]
    data = os.urandom(5 * chunk + 123)
    (d / "src").write_bytes(data)
    (d / "dst").write_bytes(b"\xee" * 100)
    before = _status(mnt).get("engine_stats", {}).get("session", {}).get("requests", {})
    fin, fout = os.open(d / "src", os.O_RDONLY), os.open(d / "dst", os.O_RDWR)
    try:
        assert copy_range(fin, fout, len(data) + 1000, 0, 0) == len(data)
        assert os.pread(fout, len(data) + 1, 0) == data
        assert copy_range(fin, fout, 2 * chunk, chunk // 3, 7) == 2 * chunk
        assert os.pread(fout, 2 * chunk + 7, 0) == data[:7] + data[chunk // 3:chunk // 3 + 2 * chunk]
        assert os.copy_file_range(fin, fout, chunk, len(data), 0) == 0  # at the source's end
        assert copy_range(fout, fout, 100, 0, 3 * chunk) == 100  # one file, ranges apart
        assert os.pread(fout, 100, 3 * chunk) == os.pread(fout, 100, 0)
        assert err(os.copy_file_range, fout, fout, chunk, 0, 50) == errno.EINVAL
        assert os.fstat(fout).st_size == len(data)
    finally:
        os.close(fin)
        os.close(fout)
    after = _status(mnt).get("engine_stats", {}).get("session", {}).get("requests", {})
    if engine == "native":
        assert after["copy_file_range"] > before.get("copy_file_range", 0)
        assert after["write"] - before["write"] <= 2  # the two write_bytes' own, no copy's


def test_truncate_and_ftruncate(d):
    p = d / "f"
    data = os.urandom(3 * (1 << 20) + 5)
    p.write_bytes(data)
    os.truncate(p, 1000)
    assert os.stat(p).st_size == 1000
    os.truncate(p, 2 << 20)
    assert p.read_bytes() == data[:1000] + bytes((2 << 20) - 1000)
    fd = os.open(p, os.O_RDWR)
    os.ftruncate(fd, 10)
    assert os.fstat(fd).st_size == 10
    os.ftruncate(fd, 20)
    assert os.pread(fd, 100, 0) == data[:10] + bytes(10)
    os.pwrite(fd, b"X", 30)
    assert os.pread(fd, 100, 0) == data[:10] + bytes(20) + b"X"
    os.close(fd)
    assert err(os.truncate, d, 0) == errno.EISDIR


# ---- attributes -----------------------------------------------------------

def test_stat_fstat_sizes_times_modes(d):
    p = d / "f"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o600)
    st0 = os.fstat(fd)
    assert stat.S_ISREG(st0.st_mode) and stat.S_IMODE(st0.st_mode) == 0o600
    assert st0.st_size == 0 and st0.st_nlink == 1
    assert (st0.st_uid, st0.st_gid) == (os.getuid(), os.getgid())
    os.utime(fd, ns=(1_000_000_000, 1_000_000_000))
    os.write(fd, b"x" * 12345)
    st1 = os.fstat(fd)
    os.close(fd)
    assert st1.st_size == 12345
    assert st1.st_mtime_ns > 1_000_000_000  # a write moves mtime
    st2 = os.stat(p)
    assert st2.st_size == 12345 and st2.st_ino == st0.st_ino
    assert stat.S_ISDIR(os.stat(d).st_mode)
    assert os.stat(d).st_nlink == 2


def test_chmod_chown_utime(d):
    p = d / "f"
    p.write_bytes(b"x")
    os.chmod(p, 0o4751)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o4751
    os.chmod(p, 0o600)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert stat.S_ISREG(os.stat(p).st_mode)
    os.chown(p, 1234, 5678)
    st = os.stat(p)
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    os.utime(p, ns=(1_234_567_890_123_456_789, 1_111_111_111_987_654_321))
    st = os.stat(p)
    assert st.st_atime_ns == 1_234_567_890_123_456_789
    assert st.st_mtime_ns == 1_111_111_111_987_654_321
    os.chmod(d, 0o700)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700 and stat.S_ISDIR(os.stat(d).st_mode)


def test_mkdir_rmdir(d):
    sub = d / "a" / "b"
    os.makedirs(sub)
    assert os.stat(d / "a").st_nlink == 3
    (sub / "f").write_bytes(b"x")
    assert err(os.rmdir, d / "a") == errno.ENOTEMPTY
    assert err(os.rmdir, sub / "f") == errno.ENOTDIR
    assert err(os.mkdir, sub) == errno.EEXIST
    assert err(os.unlink, sub) in (errno.EISDIR, errno.EPERM)
    os.unlink(sub / "f")
    os.rmdir(sub)
    assert os.stat(d / "a").st_nlink == 2
    os.rmdir(d / "a")
    assert os.listdir(d) == []


# ---- directories -----------------------------------------------------------

def test_readdir_10000_entries(d):
    names = [f"entry-{i:05d}" for i in range(10_000)]
    for n in names:
        os.mknod(d / n, 0o644 | stat.S_IFREG)
    listed = os.listdir(d)
    assert len(listed) == 10_000 and sorted(listed) == names
    with os.scandir(d) as it:
        entries = [(e.name, e.is_file(), e.inode()) for e in it]
    assert sorted(n for n, _, _ in entries) == names
    assert all(is_file for _, is_file, _ in entries)
    assert len({ino for _, _, ino in entries}) == 10_000


def test_readdir_while_deleting(d):
    """Deleting (and adding) during a listing repeats nothing and skips no survivor.

    POSIX leaves open whether entries removed or added meanwhile are listed.
    """
    names = sorted(f"n{i:04d}" for i in range(3000))
    for n in names:
        os.mknod(d / n, 0o644 | stat.S_IFREG)
    seen: list[str] = []
    deleted: set[str] = set()
    ahead = names[::-1]  # delete from the end of the listing order, ahead of the reader
    with os.scandir(d) as it:
        for i, e in enumerate(it):
            seen.append(e.name)
            if i % 3 == 0 and e.name not in deleted:
                os.unlink(d / e.name)  # the entry just listed
                deleted.add(e.name)
            if i % 3 == 1 and ahead:
                victim = ahead.pop(0)
                if victim not in deleted and victim != e.name:
                    os.unlink(d / victim)
                    deleted.add(victim)
            if i % 10 == 0:
                (d / f"new{i:05d}").write_bytes(b"")
    assert len(seen) == len(set(seen)), "an entry was listed twice"
    survivors = set(names) - deleted
    assert survivors <= set(seen), f"{len(survivors - set(seen))} survivors were skipped"
    assert set(os.listdir(d)) == survivors | {n for n in os.listdir(d) if n.startswith("new")}


def test_unlink_open_file_still_readable(d):
    p = d / "f"
    data = os.urandom((2 << 20) + 3)
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    wfd = os.open(p, os.O_RDWR)
    os.unlink(p)
    assert not p.exists()
    assert os.fstat(fd).st_nlink == 0
    assert os.pread(fd, len(data) + 10, 0) == data
    os.pwrite(wfd, b"changed", 0)
    assert os.pread(wfd, 7, 0) == b"changed"
    os.close(wfd)
    os.close(fd)
    p.write_bytes(b"other")  # the name is free again
    assert p.read_bytes() == b"other"


def test_rename_over_existing_file(d):
    (d / "a").write_bytes(b"AAAA")
    (d / "b").write_bytes(b"BB")
    keep = os.open(d / "b", os.O_RDONLY)
    os.rename(d / "a", d / "b")
    assert (d / "b").read_bytes() == b"AAAA"
    assert not (d / "a").exists()
    assert os.read(keep, 10) == b"BB"  # the replaced file lives on through its fd
    os.close(keep)
    assert sorted(os.listdir(d)) == ["b"]


def test_rename_directories(d):
    os.makedirs(d / "x" / "y")
    (d / "x" / "y" / "f").write_bytes(b"f")
    os.mkdir(d / "empty")
    os.mkdir(d / "full")
    (d / "full" / "g").write_bytes(b"g")
    os.rename(d / "x", d / "z")
    assert (d / "z" / "y" / "f").read_bytes() == b"f"
    assert err(os.rename, d / "z", d / "z" / "y" / "inside") == errno.EINVAL
    assert err(os.rename, d / "z", d / "full") == errno.ENOTEMPTY
    assert err(os.rename, d / "z", d / "z" / "y" / "f") in (errno.ENOTDIR, errno.EINVAL)
    assert err(os.rename, d / "z" / "y" / "f", d / "empty") == errno.EISDIR
    os.rename(d / "z", d / "empty")  # over an empty directory
    assert sorted(os.listdir(d)) == ["empty", "full"]
    os.rename(d / "empty" / "y", d / "full" / "y")  # across parents
    assert os.stat(d / "full").st_nlink == 3 and os.stat(d / "empty").st_nlink == 2
    assert (d / "full" / "y" / "f").read_bytes() == b"f"
    assert os.path.samefile(d / "full" / "y" / "..", d / "full")


def test_rename_noreplace_and_exchange(d):
    (d / "a").write_bytes(b"A")
    (d / "b").write_bytes(b"B")
    assert err(renameat2, d / "a", d / "b", RENAME_NOREPLACE) == errno.EEXIST
    assert (d / "a").read_bytes() == b"A" and (d / "b").read_bytes() == b"B"
    renameat2(d / "a", d / "c", RENAME_NOREPLACE)
    assert sorted(os.listdir(d)) == ["b", "c"]
    renameat2(d / "b", d / "c", RENAME_EXCHANGE)
    assert (d / "b").read_bytes() == b"A" and (d / "c").read_bytes() == b"B"
    assert err(renameat2, d / "b", d / "nothing", RENAME_EXCHANGE) == errno.ENOENT
    os.mkdir(d / "dir")
    (d / "dir" / "in").write_bytes(b"in")
    renameat2(d / "b", d / "dir", RENAME_EXCHANGE)  # a file and a directory swap
    assert (d / "b" / "in").read_bytes() == b"in" and (d / "dir").read_bytes() == b"A"


def test_symlink_readlink(d):
    (d / "target").write_bytes(b"data")
    os.symlink("target", d / "link")
    os.symlink("/nowhere/at/all", d / "dangling")
    assert os.readlink(d / "link") == "target"
    assert os.readlink(d / "dangling") == "/nowhere/at/all"
    assert (d / "link").read_bytes() == b"data"
    assert stat.S_ISLNK(os.lstat(d / "link").st_mode)
    assert os.lstat(d / "link").st_size == len("target")
    assert err(os.readlink, d / "target") == errno.EINVAL
    assert err(os.stat, d / "dangling") == errno.ENOENT
    assert err(os.symlink, "x", d / "link") == errno.EEXIST


def test_hard_links(d):
    p = d / "orig"
    p.write_bytes(b"shared")
    os.mkdir(d / "sub")
    os.link(p, d / "l1")
    os.link(p, d / "sub" / "l2")
    assert os.stat(p).st_nlink == 3
    assert os.stat(d / "sub" / "l2").st_ino == os.stat(p).st_ino
    with open(d / "l1", "r+b") as f:
        f.write(b"SH")
    assert (d / "sub" / "l2").read_bytes() == b"SHared"
    os.unlink(p)
    assert os.stat(d / "l1").st_nlink == 2
    assert err(os.link, d / "sub", d / "sublink") == errno.EPERM
    assert err(os.link, d / "l1", d / "sub" / "l2") == errno.EEXIST
    os.unlink(d / "l1")
    assert os.stat(d / "sub" / "l2").st_nlink == 1
    assert (d / "sub" / "l2").read_bytes() == b"SHared"


# ---- the filesystem --------------------------------------------------------

def test_statfs_reports_device_capacity(mnt, d):
    """f_blocks is the devices' data area: 2 x 1 GiB less each device's superblock and journal."""
    sv = os.statvfs(d)
    data_units = sum(plan(os.path.getsize(dev), 1 << 20)[1] for dev in mnt.devices)
    assert sv.f_frsize * sv.f_blocks == data_units << 20
    assert 0.9 * (2 << 30) < sv.f_frsize * sv.f_blocks <= 2 << 30
    assert sv.f_namemax == 255
    assert sv.f_bfree <= sv.f_blocks and sv.f_bavail == sv.f_bfree
    fd = os.open(mnt.path, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)  # let what earlier tests deleted be freed first
    os.close(fd)
    before = os.statvfs(d).f_bfree
    with open(d / "f", "wb") as f:
        f.write(os.urandom(8 << 20))
        os.fsync(f.fileno())  # durable: the data now takes device space
    after = os.statvfs(d).f_bfree
    assert before - after >= (8 << 20) // sv.f_frsize


def test_fsync_fdatasync_flush(d):
    p = d / "f"
    with open(p, "wb") as f:
        f.write(b"x" * 100)
        f.flush()
        os.fsync(f.fileno())
        os.fdatasync(f.fileno())
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)
    os.sync()
    assert p.read_bytes() == b"x" * 100


def stored_xattrs(p) -> list[str]:
    """listxattr less ckptfs's own read-only virtual attributes (user.ckptfs.*)."""
    return [n for n in os.listxattr(p) if not n.startswith("user.ckptfs.")]


def test_xattrs(d):
    p = d / "f"
    p.write_bytes(b"")
    os.setxattr(p, "user.one", b"1")
    os.setxattr(p, "user.two", b"\x00binary\xff")
    assert os.getxattr(p, "user.one") == b"1"
    assert os.getxattr(p, "user.two") == b"\x00binary\xff"
    assert sorted(stored_xattrs(p)) == ["user.one", "user.two"]
    assert err(os.getxattr, p, "user.missing") == errno.ENODATA
    assert err(os.removexattr, p, "user.missing") == errno.ENODATA
    assert err(os.setxattr, p, "user.one", b"x", os.XATTR_CREATE) == errno.EEXIST
    assert err(os.setxattr, p, "user.new", b"x", os.XATTR_REPLACE) == errno.ENODATA
    os.setxattr(p, "user.one", b"replaced", os.XATTR_REPLACE)
    assert os.getxattr(p, "user.one") == b"replaced"
    os.removexattr(p, "user.one")
    assert stored_xattrs(p) == ["user.two"]
    os.setxattr(d, "user.ondir", b"d")
    assert os.getxattr(d, "user.ondir") == b"d"


def test_mmap_readonly_sees_bytes(d):
    p = d / "m"
    data = os.urandom((3 << 20) + 123)
    p.write_bytes(data)
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert len(m) == len(data)
        assert m[:100] == data[:100]
        assert m[(1 << 20) - 5:(1 << 20) + 5] == data[(1 << 20) - 5:(1 << 20) + 5]
        assert m[-7:] == data[-7:]
        assert bytes(m) == data


def _read_via(p: Path, how: str) -> bytes:
    if how == "read":
        with open(p, "rb") as f:
            return f.read()
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return bytes(m)


@pytest.mark.parametrize("how", ["read", "mmap"])
@pytest.mark.parametrize("rewrite", ["in_place", "truncate", "rename"])
def test_rewritten_file_shows_new_contents(d, how, rewrite):
    p = d / "f"
    old = os.urandom(256 << 10)
    p.write_bytes(old)
    for _ in range(2):  # the second read-only open keeps the page cache
        assert _read_via(p, how) == old
    new = os.urandom(256 << 10)
    if rewrite == "in_place":
        fd = os.open(p, os.O_WRONLY)
        os.pwrite(fd, new[:4096], 0)
        os.pwrite(fd, new[4096:], 4096)
        os.close(fd)
    elif rewrite == "truncate":
        p.write_bytes(new)
    else:
        (d / "tmp").write_bytes(new)
        os.rename(d / "tmp", p)
    assert _read_via(p, how) == new
    assert _read_via(p, how) == new


def test_mmap_held_across_rewrite(d):
    """A mapping made before a rewrite may show either version; a new open shows the new one."""
    p = d / "f"
    old = b"o" * 8192
    p.write_bytes(old)
    f = open(p, "rb")
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    assert m[:] == old
    new = b"n" * 8192
    with open(p, "r+b") as w:
        w.write(new)
    assert _read_via(p, "read") == new
    assert _read_via(p, "mmap") == new
    m.close()
    f.close()


@pytest.mark.parametrize("how", ["read", "mmap"])
def test_rewrite_with_restored_mtime_shows_new_contents(d, how):
    """Same size, same mtime (as cp -p / rsync -t leave it): only the open's keep_cache
    decision can drop the stale page cache."""
    p = d / "f"
    old = b"1" * (64 << 10)
    p.write_bytes(old)
    st = os.stat(p)
    for _ in range(2):
        assert _read_via(p, how) == old
    with open(p, "r+b") as f:
        f.write(b"2" * (64 << 10))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(p).st_mtime_ns == st.st_mtime_ns
    assert _read_via(p, how) == b"2" * (64 << 10)


def test_dot_entries_listed(d):
    (d / "x").write_bytes(b"")
    out = subprocess.run(["ls", "-a1", str(d)], capture_output=True, text=True, check=True).stdout.split()
    assert sorted(out) == [".", "..", "x"]


def _status(mnt) -> dict:
    return json.loads(ckptfs("status", str(mnt.path), "--json", check=True).stdout)


def _reads(mnt) -> str:
    return _status(mnt)["reads"]


def _kernel_at_least(major: int, minor: int) -> bool:
    return tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2]) >= (major, minor)


def test_read_only_opens_go_direct_where_the_kernel_maps_direct_io_files(d, mnt, engine):
    """native engine, kernel >= 6.6 (FUSE_DIRECT_IO_ALLOW_MMAP): read-only opens bypass the page
    cache, so the second read of an unchanged file reaches the daemon too (READ requests), and
    status says so; pyfuse3 reads through the page cache."""
    want = "direct" if engine == "native" and _kernel_at_least(6, 6) else "page cache"
    assert _reads(mnt) == want
    p = d / "f"
    data = os.urandom(40 << 20)
    p.write_bytes(data)
    assert p.read_bytes() == data
    if engine != "native":
        return
    before = _status(mnt)["engine_stats"]["session"]["requests"]["read"]
    with open(p, "rb", buffering=0) as f:
        assert f.read(len(data)) == data
    n = _status(mnt)["engine_stats"]["session"]["requests"]["read"] - before
    assert (n > 0) == (want == "direct")
    if want == "direct" and os.geteuid() == 0:  # max_pages raised: READs of up to 16 chunks
        assert n <= 4, f"{n} READ requests for 40 MiB"


def test_small_files_are_read_through_the_page_cache_and_stay_coherent(d, mnt):
    """Where read-only opens go direct, a file of at most core.CACHED_READ_MAX (8 MiB) is still read
    through the page cache: the kernel's read-ahead brings it in (torch.load's dozen small read()
    calls of a 1.6 MB checkpoint cost one READ instead of twelve here), an unchanged file read
    again costs no READ (kept cache), and a rewrite through another descriptor is seen by the next
    open, by read and mmap."""
    if _reads(mnt) != "direct":
        pytest.skip("read-only opens use the page cache here anyway")
    reads = lambda: _status(mnt)["engine_stats"]["session"]["requests"].get("read", 0)  # noqa: E731
    p = d / "ck"
    old = os.urandom(1_600_000)
    p.write_bytes(old)
    before = reads()
    with open(p, "rb", buffering=0) as f:  # as torch.load: small reads here and there
        assert f.read(4096) == old[:4096]
        f.seek(1_597_867)
        assert f.read(4096) == old[1_597_867:]
        f.seek(454)
        assert f.read(400_000) == old[454:400_454]
    first = reads() - before
    assert first > 0
    for _ in range(3):
        with open(p, "rb", buffering=0) as f:
            assert f.read(4096) == old[:4096]
            f.seek(1_597_867)
            assert f.read(4096) == old[1_597_867:]
        assert p.read_bytes() == old
        assert _read_via(p, "mmap") == old
    assert reads() - before == first  # kept: no READ for an unchanged file (direct: 3 per loop)
    new = os.urandom(1_600_000)
    with open(p, "rb") as reader:
        assert reader.read(10) == old[:10]
        with open(p, "r+b") as w:  # a direct_io writer beside a cached reader
            w.write(new)
        assert p.read_bytes() == new  # a new open sees the rewrite
        assert _read_via(p, "mmap") == new
    assert reads() - before > first


def test_shared_writable_mmap_of_writable_open(d, mnt):
    """Where read-only opens go direct (the kernel maps direct_io files: native engine), a file
    open for writing may be mapped shared-writable and its bytes arrive (tests/test_writers.py
    checks their durability); elsewhere refused with ENODEV, as for every direct_io file."""
    p = d / "f"
    p.write_bytes(b"abc" * 4096)
    want = bytearray(b"abc" * 4096)
    with open(p, "r+b") as f:
        if _reads(mnt) == "direct":
            want[4096:4099] = b"XYZ"
            with mmap.mmap(f.fileno(), 0) as m:
                m[4096:4099] = b"XYZ"
        else:
            with pytest.raises(OSError) as info:
                mmap.mmap(f.fileno(), 0)
            assert info.value.errno == errno.ENODEV
        # a private (copy-on-write) mapping works, and writing to it changes nothing on disk
        with mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
            assert m[:6] == b"abcabc"
            m[:3] = b"XYZ"
    assert p.read_bytes() == want


def test_timestamps(d):
    t0 = os.stat(d).st_mtime_ns
    (d / "f").write_bytes(b"1")
    t1 = os.stat(d).st_mtime_ns
    assert t1 > t0 and os.stat(d).st_ctime_ns > t0  # creating an entry moves the directory's times
    st = os.stat(d / "f")
    os.chmod(d / "f", 0o600)
    st2 = os.stat(d / "f")
    assert st2.st_mtime_ns == st.st_mtime_ns and st2.st_ctime_ns > st.st_ctime_ns
    os.utime(d / "f", ns=(5, 5))
    os.utime(d / "f")  # UTIME_NOW
    import time
    assert abs(os.stat(d / "f").st_mtime_ns - time.time_ns()) < 60 * 10**9
    os.unlink(d / "f")
    assert os.stat(d).st_mtime_ns > t1


def test_other_users_get_their_own_ids_and_permissions(mnt, d):
    """The mount is shared (allow_other) and enforces modes (default_permissions)."""
    os.chmod(d, 0o777)
    (d / "roots").write_bytes(b"secret")
    os.chmod(d / "roots", 0o600)

    def as_nobody(*cmd):
        return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd],
                              capture_output=True, text=True)
    res = as_nobody("sh", "-c", f"echo hi > {d}/mine && cat {d}/mine")
    assert res.returncode == 0 and res.stdout == "hi\n", res.stderr
    st = os.stat(d / "mine")
    assert (st.st_uid, st.st_gid) == (65534, 65534)
    res = as_nobody("cat", str(d / "roots"))
    assert res.returncode != 0 and "Permission denied" in res.stderr
    res = as_nobody("sh", "-c", f"echo x >> {d}/roots")
    assert res.returncode != 0 and "Permission denied" in res.stderr
    assert (d / "roots").read_bytes() == b"secret"


def test_setgid_directory_passes_on_its_group(d):
    os.chown(d, 0, 1234)
    os.chmod(d, 0o2775)
    (d / "f").write_bytes(b"")
    os.mkdir(d / "sub")
    assert os.stat(d / "f").st_gid == 1234
    st = os.stat(d / "sub")
    assert st.st_gid == 1234 and st.st_mode & stat.S_ISGID
