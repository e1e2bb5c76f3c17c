"""POSIX details compared with ext4 on a real mount, as root and as nobody (uid 65534).

Each test runs the same operations in a directory of the mount and in one on
ext4 (tests/ext4.py) and compares what comes back: errnos, modes, whether
times moved, st_blocks. Unprivileged runs happen in a forked child that
became nobody (tests/nobody.py); the test directories are 0777 under 0755
parents so that it can reach them.

- names over 255 bytes fail with ENAMETOOLONG in every operation; the
  extended attribute name and value limits;
- a write, an O_TRUNC open or a truncate by a caller without CAP_FSETID
  clears set-user-ID / set-group-ID bits (root keeps them), also after a remount;
- chown/lchown(path, -1, -1) moves ctime;
- st_blocks counts the 4 KiB blocks a file holds.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from ext4 import ext4_tmpdir
from mounting import reachable_mount
from nobody import NOBODY, as_user

pytestmark = pytest.mark.mount


@pytest.fixture(scope="module")
def mnt(engine):
    # under a 0755 folder, so that other users (the tests as nobody) can reach the mount
    with reachable_mount("ckptfs-parity-", engine) as m:
        yield m


@pytest.fixture(scope="module")
def ref_root():
    p = ext4_tmpdir()
    yield p
    shutil.rmtree(p, ignore_errors=True)


@pytest.fixture
def sides(mnt, ref_root, request) -> tuple[Path, Path]:
    """(a directory on the mount, one on ext4), fresh, empty and 0777."""
    name = re.sub(r"[^\w.-]", "_", request.node.name)
    out = []
    for base in (mnt.path, ref_root):
        p = base / name
        p.mkdir()
        p.chmod(0o777)
        out.append(p)
    return tuple(out)


def outcome(fn, *args):
    """('ok', value) or ('err', errno name)."""
    try:
        return "ok", fn(*args)
    except OSError as e:
        return "err", errno.errorcode.get(e.errno, e.errno)


def run_as(who: str, fn, *args):
    """fn(*args) as root (here) or as nobody (a forked child)."""
    return fn(*args) if who == "root" else as_user(fn, *args)


def diff(label: str, mine, ext4) -> list[str]:
    return [] if mine == ext4 else [f"{label}: ckptfs {mine!r}, ext4 {ext4!r}"]


# ---- 1. names longer than 255 bytes ----------------------------------------------------

LENGTHS = [255, 256, 300, 1024, 1025, 4096]


def name_ops(d: str, n: str) -> list[tuple[str, object]]:
    """Every operation that takes the name `n` in directory `d`: (label, thunk)."""
    p, f, x = f"{d}/{n}", f"{d}/f", f"{d}/x"
    return [
        ("stat", lambda: os.stat(p) and None),
        ("lstat", lambda: os.lstat(p) and None),
        ("open", lambda: os.close(os.open(p, os.O_RDONLY))),
        ("chmod", lambda: os.chmod(p, 0o600)),
        ("chown", lambda: os.chown(p, os.getuid(), os.getgid())),
        ("lchown", lambda: os.lchown(p, -1, -1)),
        ("truncate", lambda: os.truncate(p, 0)),
        ("utime", lambda: os.utime(p)),
        ("readlink", lambda: os.readlink(p)),
        ("listdir", lambda: os.listdir(p)),
        ("getxattr", lambda: os.getxattr(p, "user.a")),
        ("setxattr", lambda: os.setxattr(p, "user.a", b"1")),
        ("listxattr", lambda: os.listxattr(p)),
        ("removexattr", lambda: os.removexattr(p, "user.a")),
        ("rename-source", lambda: os.rename(p, x)),
        ("link-source", lambda: os.link(p, x)),
        ("stat-below", lambda: os.stat(f"{p}/x") and None),
        ("create-below", lambda: os.close(os.open(f"{p}/x", os.O_CREAT | os.O_WRONLY, 0o644))),
        ("unlink", lambda: os.unlink(p)),
        ("rmdir", lambda: os.rmdir(p)),
        ("create", lambda: os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))),
        ("unlink-created", lambda: os.unlink(p)),
        ("mkdir", lambda: os.mkdir(p)),
        ("rmdir-made", lambda: os.rmdir(p)),
        ("mknod", lambda: os.mknod(p, 0o644 | stat.S_IFREG)),
        ("unlink-node", lambda: os.unlink(p)),
        ("symlink", lambda: os.symlink("f", p)),
        ("unlink-symlink", lambda: os.unlink(p)),
        ("link-target", lambda: os.link(f, p)),
        ("unlink-link", lambda: os.unlink(p)),
        ("rename-target", lambda: os.rename(f, p)),
        ("rename-back", lambda: os.rename(p, f)),
    ]


def long_name_outcomes(d: str) -> dict:
    with open(f"{d}/f", "wb"):
        pass
    out = {}
    for length in LENGTHS:
        for label, thunk in name_ops(d, "n" * length):
            kind, value = outcome(thunk)
            out[f"{length}:{label}"] = kind if kind == "ok" else value
    return out


@pytest.mark.parametrize("who", ["root", "nobody"])
def test_long_names_fail_like_ext4(sides, who):
    """Looking up a name over 255 bytes says ENAMETOOLONG, never ENOENT, whatever the operation."""
    mine, ext4 = (run_as(who, long_name_outcomes, str(d)) for d in sides)
    assert mine["256:stat"] == "ENAMETOOLONG" and mine["255:stat"] == "ENOENT"
    bad = [line for k in ext4 for line in diff(k, mine[k], ext4[k])]
    assert not bad, "\n".join(bad)


def xattr_limit_outcomes(d: str) -> dict:
    p = f"{d}/f"
    with open(p, "wb"):
        pass
    out = {}
    for label, thunk in [
        ("set-ok", lambda: os.setxattr(p, "user.ok", b"1")),
        ("get-ok", lambda: os.getxattr(p, "user.ok")),
        ("set-name-256", lambda: os.setxattr(p, "user." + "n" * 251, b"1")),
        ("get-name-256", lambda: os.getxattr(p, "user." + "n" * 251)),
        ("remove-name-256", lambda: os.removexattr(p, "user." + "n" * 251)),
        ("set-name-1000", lambda: os.setxattr(p, "user." + "n" * 995, b"1")),
        ("set-empty-name", lambda: os.setxattr(p, "", b"1")),
        ("get-empty-name", lambda: os.getxattr(p, "")),
        ("set-value-65537", lambda: os.setxattr(p, "user.big", bytes(65537))),
        ("get-missing", lambda: os.getxattr(p, "user.missing")),
    ]:
        out[label] = outcome(thunk)
    return out


@pytest.mark.parametrize("who", ["root", "nobody"])
def test_xattr_name_and_value_limits_like_ext4(sides, who):
    """Names over 255 bytes (or empty): ERANGE; values over 64 KiB: E2BIG."""
    mine, ext4 = (run_as(who, xattr_limit_outcomes, str(d)) for d in sides)
    assert mine["set-name-256"] == ("err", "ERANGE") and mine["set-value-65537"] == ("err", "E2BIG")
    bad = [line for k in ext4 for line in diff(k, mine[k], ext4[k])]
    assert not bad, "\n".join(bad)


def test_xattr_value_of_64k_is_kept(sides):
    """ckptfs keeps values up to the kernel's 64 KiB limit; ext4 stops at its block size (ENOSPC)."""
    p = sides[0] / "f"
    p.write_bytes(b"")
    os.setxattr(p, "user.big", b"v" * 65536)
    assert os.getxattr(p, "user.big") == b"v" * 65536


# ---- 2. set-user-ID and set-group-ID bits ----------------------------------------------

MODES = [0o4777, 0o2777, 0o6777, 0o2767, 0o6766, 0o4666, 0o0777]
HOWS = {  # how the writer changes the file: open flags, then what it does with the descriptor
    "write": (os.O_WRONLY, "write"),
    "append": (os.O_WRONLY | os.O_APPEND, "write"),
    "pwrite-rdwr": (os.O_RDWR, "pwrite"),
    "open-trunc": (os.O_WRONLY | os.O_TRUNC, None),
    "open-trunc-write": (os.O_WRONLY | os.O_TRUNC, "write"),
    "open-rdonly-trunc": (os.O_RDONLY | os.O_TRUNC, None),
    "open-rdwr-only": (os.O_RDWR, None),
    "ftruncate": (os.O_RDWR, "ftruncate"),
    "truncate": (None, "truncate"),
}


def change(p: str, how: str):
    """As the writer: change `p` as `how` says; the mode fstat sees on its descriptor (or None)."""
    flags, act = HOWS[how]
    if flags is None:
        os.truncate(p, 1)
        return None
    fd = os.open(p, flags)
    try:
        if act == "write":
            os.write(fd, b"y")
        elif act == "pwrite":
            os.pwrite(fd, b"y", 1)
        elif act == "ftruncate":
            os.ftruncate(fd, 1)
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def setid_outcome(p: Path, mode: int, how: str, who: str, owner=(0, 0), groups=()) -> tuple:
    """Make `p` (mode, owner), let `who` change it; (errno or fstat mode, stat mode, ctime moved)."""
    p.write_bytes(b"data")
    os.chown(p, *owner)
    os.chmod(p, mode)
    before = os.stat(p).st_ctime_ns
    if who == "root":
        got = outcome(change, str(p), how)
    else:
        got = outcome(lambda: as_user(change, str(p), how, groups=groups))
    st = os.stat(p)
    got = got if got[0] == "err" else ("ok", None if got[1] is None else oct(got[1]))
    return got, oct(stat.S_IMODE(st.st_mode)), st.st_ctime_ns != before


@pytest.mark.parametrize("who", ["nobody", "root"])
@pytest.mark.parametrize("how", list(HOWS))
def test_setid_bits_after_a_change_like_ext4(sides, how, who):
    """A change by nobody clears set-user-ID (and set-group-ID where Linux does); root keeps them."""
    bad = []
    for mode in MODES:
        mine, ext4 = (setid_outcome(d / f"f{mode:o}", mode, how, who) for d in sides)
        bad += diff(f"{mode:o}", mine, ext4)
        if who == "nobody" and how != "open-rdwr-only":  # not in group 0: both bits go
            assert mine[1] == oct(mode & 0o777), f"{mode:o}"
    assert not bad, f"{how} by {who}:\n" + "\n".join(bad)


@pytest.mark.parametrize("owner, groups", [((NOBODY, NOBODY), ()), ((0, NOBODY), ()), ((0, 1234), (1234,)),
                                           ((0, 1234), ())],
                         ids=["nobody-owns", "nobody-group", "supplementary-group", "other-group"])
def test_setid_bits_by_owner_and_group_like_ext4(sides, owner, groups):
    """The owner clears them too; a set-group-ID bit without group-execute stays for a group member."""
    bad = []
    for mode in (0o6777, 0o2767, 0o2777, 0o6766):
        for how in ("write", "open-trunc"):
            mine, ext4 = (setid_outcome(d / f"f{mode:o}{how}", mode, how, "nobody", owner, groups)
                          for d in sides)
            bad += diff(f"{mode:o} {how}", mine, ext4)
    assert not bad, "\n".join(bad)


def test_setid_bits_cleared_by_nobody_stay_cleared_after_remount(mnt, sides):
    p = sides[0] / "f"
    p.write_bytes(b"data")
    os.chmod(p, 0o6777)
    as_user(change, str(p), "write")
    st = os.stat(p)
    assert stat.S_IMODE(st.st_mode) == 0o777 and p.read_bytes() == b"yata"
    blocks = st.st_blocks
    assert mnt.umount().returncode == 0
    mnt.mount()
    st2 = os.stat(p)
    assert stat.S_IMODE(st2.st_mode) == 0o777 and p.read_bytes() == b"yata"
    assert (st2.st_ctime_ns, st2.st_blocks) == (st.st_ctime_ns, blocks) == (st.st_ctime_ns, 8)


# ---- 3. chown(path, -1, -1) moves ctime -------------------------------------------------

def chown_outcomes(d: Path) -> dict:
    (d / "f").write_bytes(b"x")
    (d / "suid").write_bytes(b"x")
    os.chmod(d / "suid", 0o4755)
    os.mkdir(d / "dir")
    os.symlink("f", d / "link")
    (d / "nobodys").write_bytes(b"x")
    os.chown(d / "nobodys", NOBODY, NOBODY)
    out = {}
    for who in ("root", "nobody"):
        for name in ("f", "suid", "dir", "link", "nobodys"):
            for op in (os.chown, os.lchown):
                p = str(d / name)
                before = os.lstat(p)
                res = outcome(run_as, who, op, p, -1, -1)
                after = os.lstat(p)
                out[f"{who} {op.__name__} {name}"] = (res[0] if res[0] == "ok" else res[1],
                                                      after.st_ctime_ns != before.st_ctime_ns,
                                                      after.st_mtime_ns == before.st_mtime_ns,
                                                      oct(after.st_mode))
    return out


def test_chown_minus_one_moves_ctime_like_ext4(sides):
    mine, ext4 = (chown_outcomes(d) for d in sides)
    assert mine["root chown f"] == ("ok", True, True, oct(stat.S_IFREG | 0o666 & ~_umask()))
    bad = [line for k in ext4 for line in diff(k, mine[k], ext4[k])]
    assert not bad, "\n".join(bad)


def _umask() -> int:
    u = os.umask(0)
    os.umask(u)
    return u


# ---- 4. st_blocks -----------------------------------------------------------------------

def block_cases(d: Path) -> dict:
    def written(name, *pieces, size=None):
        with open(d / name, "wb") as f:
            for off, n in pieces:
                f.seek(off)
                f.write(b"x" * n)
            if size is not None:
                f.truncate(size)
        return os.stat(d / name).st_blocks
    mib = 1 << 20
    out = {f"size {n}": written(f"s{n}", (0, n)) for n in (0, 1, 4095, 4096, 4097, 210 * 1024, mib,
                                                            mib + 1, 3_000_000)}
    out["sparse head+tail"] = written("sparse", (0, 1), (5 * mib, 1))
    out["only far out"] = written("far", (7 * mib + 5, 10))
    out["truncated up"] = written("up", size=10 * mib)
    out["truncated down"] = written("down", (0, 3 * mib), size=100_000)
    out["across a chunk boundary"] = written("across", (0, mib - 10), (mib - 10, 20))
    return out


def test_st_blocks_like_ext4(sides):
    mine, ext4 = (block_cases(d) for d in sides)
    bad = [line for k in ext4 for line in diff(k, mine[k], ext4[k])]
    assert not bad, "\n".join(bad)


def test_st_blocks_hole_inside_a_chunk_is_held(sides):
    """Documented difference: below a chunk's last written byte ckptfs holds zeros (and counts them)."""
    p = sides[0] / "f"
    with open(p, "wb") as f:
        f.write(b"x")
        f.seek((1 << 20) - 1)  # the last byte of the first 1 MiB chunk
        f.write(b"x")
    assert os.stat(p).st_blocks == (1 << 20) // 512  # ext4: 16 (two 4 KiB blocks)


def test_ls_s_total_like_ext4(sides):
    """Two 210 KiB files: `ls -s` says total 424 (1 KiB units), not 2048."""
    totals = []
    for d in sides:
        for name in ("a", "b"):
            (d / name).write_bytes(os.urandom(210 * 1024))
        out = subprocess.run(["ls", "-s", str(d)], capture_output=True, text=True, check=True).stdout
        totals.append(out.splitlines()[0])
    assert totals == ["total 424", "total 424"]
