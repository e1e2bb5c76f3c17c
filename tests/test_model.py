"""Model-based test: random operation sequences on the mount and on ext4 must agree.

A hypothesis state machine applies each operation (open/create with assorted
flags, pwrite at random offsets, append, read, truncate, unlink, rename over
files and directories, RENAME_NOREPLACE/EXCHANGE, mkdir, rmdir, link, symlink,
chmod (set-user-ID and set-group-ID modes too), chown(-1, -1), operations on
names over 255 bytes, writes by the unprivileged user nobody, fallocate
(allocate, keep size, punch a hole, zero a range), copy_file_range between any two open
descriptors, fsync, close)
both to a directory on ckptfs and to a reference directory on ext4. When an
operation fails, both sides must fail with the same errno; chown(-1, -1) must
move ctime on both or neither; after every step the trees must agree: names,
types, modes, sizes, link counts, contents, symlink targets, and what every
open descriptor sees; and what SEEK_DATA / SEEK_HOLE call a hole on the mount
reads as zeros.

One mount per memory setting serves the whole run, with a 64 KiB chunk so small
files cross chunk boundaries; the directories are emptied between examples.
CKPTFS_MODEL_EXAMPLES=1000 makes a longer hunt.

The first example that fails is written down as it fails (its operations and their
outcomes, and the traceback) and added as a note to whatever the test finally raises:
hypothesis replays a failing example to report it, and when the replay takes another
path (a step's outcome depending on what the failure left behind) it reports only
FlakyStrategyDefinition, which hides the original error.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
import sys
import traceback
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.errors import HypothesisException
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from ext4 import ext4_tmpdir
from mounting import CkptMount
from nobody import as_user
from syscalls import RENAME_EXCHANGE, RENAME_NOREPLACE, copy_range, fallocate, renameat2

CHUNK = 64 << 10
MAX_FDS = 6
EXAMPLES = int(os.environ.get("CKPTFS_MODEL_EXAMPLES", "50"))  # raise it for a longer hunt
# a long hunt takes up to ~0.3 s an example on a loaded 2-core machine: give it a second each
pytestmark = [pytest.mark.mount, pytest.mark.timeout(max(600, EXAMPLES))]

names = st.sampled_from(["a", "b"])
dirs = st.sampled_from(["", "d", "e", "d/f"])
paths = st.builds(lambda d, n: f"{d}/{n}" if d else n, dirs, names)
any_path = st.one_of(paths, dirs.filter(bool))
offsets = st.one_of(st.integers(0, 3 * CHUNK + 5), st.sampled_from([CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK]))
sizes = st.one_of(st.integers(0, 2 * CHUNK + 7), st.sampled_from([0, 1, CHUNK - 1, CHUNK, CHUNK + 1]))
# runs of one byte, often a whole chunk of 0x5A: identical chunks, which --dedupe shares
TWINS, TWIN = ("e/b", "d/f/a"), bytes([0x5A]) * (2 * CHUNK + 10)
payload = st.builds(lambda n, b: bytes([b]) * n if n > 64 else os.urandom(n),
                    st.one_of(st.integers(0, CHUNK + 100), st.just(CHUNK)),
                    st.one_of(st.integers(1, 255), st.just(0x5A)))
OPEN_FLAGS = [
    os.O_RDONLY,
    os.O_RDWR,
    os.O_WRONLY | os.O_APPEND,
    os.O_RDWR | os.O_CREAT,
    os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    os.O_RDWR | os.O_CREAT | os.O_EXCL,
    os.O_RDWR | os.O_APPEND | os.O_CREAT,
    os.O_RDONLY | os.O_TRUNC,
]
NOBODY_FLAGS = [os.O_WRONLY, os.O_WRONLY | os.O_TRUNC, os.O_RDWR | os.O_APPEND, os.O_RDONLY | os.O_TRUNC]
LONG_NAME_OPS = {
    "stat": lambda p: os.stat(p) and None,
    "unlink": os.unlink,
    "rmdir": os.rmdir,
    "chmod": lambda p: os.chmod(p, 0o600),
    "chown": lambda p: os.chown(p, 0, 0),
    "lchown": lambda p: os.lchown(p, -1, -1),
    "truncate": lambda p: os.truncate(p, 0),
    "rename-from": lambda p: os.rename(p, os.path.join(os.path.dirname(p), "a")),
    "link-from": lambda p: os.link(p, os.path.join(os.path.dirname(p), "b")),
    "rename-to": lambda p: os.rename(os.path.join(os.path.dirname(p), "a"), p),
    "create": lambda p: os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)),
    "mkdir": os.mkdir,
    "setxattr": lambda p: os.setxattr(p, "user.x", b"1"),
}


RENAME_FLAGS = [RENAME_NOREPLACE, RENAME_EXCHANGE]
# fallocate modes: allocate, KEEP_SIZE, PUNCH_HOLE | KEEP_SIZE, ZERO_RANGE, ZERO_RANGE | KEEP_SIZE
FALLOC_MODES = [0, 0x01, 0x03, 0x10, 0x11]


def holes_read_as_zeros(fd: int) -> None:
    """Walk `fd` with SEEK_DATA / SEEK_HOLE: what is reported as a hole reads as zeros (where
    the holes are is the filesystem's business: ext4 keeps 4 KiB blocks, ckptfs chunks)."""
    size = os.fstat(fd).st_size
    pos = 0
    while pos < size:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            assert e.errno == errno.ENXIO
            data = size
        assert pos <= data <= size and not os.pread(fd, data - pos, pos).strip(b"\0"), (pos, data)
        if data == size:
            return
        pos = os.lseek(fd, data, os.SEEK_HOLE)
        assert data < pos <= size


@pytest.fixture(scope="module", params=[("256M", "off"), ("1M", "off"), ("1M", "on")],
                ids=["roomy", "tight-memory", "tight-dedupe"])
def mnt(request, tmp_path_factory):
    """Three mounts: plenty of memory; 16 chunks only (writes wait for the drain, reads fetch
    evicted chunks back from the devices); and the same with --dedupe on (two files of one byte
    from the start, and the payloads' runs of one byte, make identical chunks: files share
    extents, which are overwritten, truncated and deleted under each other and read back after
    eviction)."""
    memory, dedupe = request.param
    m = CkptMount(tmp_path_factory.mktemp("model"), memory=memory,
                  extra=("--chunk-size", str(CHUNK), "--dedupe", dedupe))
    m.mount()
    try:
        yield m
        if dedupe == "on":  # the runs shared extents, or this mount tested nothing more
            st = m.status()["dedupe"]
            assert st["chunks_shared"] > 0 and st["shared_bytes"] >= 0, st
    finally:
        m.close()


OPS: list[str] = []        # this example's operations and outcomes, for the first-failure report
FIRST_FAILURE: list[str] = []  # that report, once an example has failed


def outcome(fn, *args):
    """('ok', value) or ('err', errno), logged in OPS."""
    try:
        res = "ok", fn(*args)
    except OSError as e:
        res = "err", e.errno
    OPS.append(f"{getattr(fn, '__name__', fn)}{args!r:.160} -> {res!r:.120}")
    return res


def snapshot(root: Path, rel: str = ".", out: dict | None = None) -> dict:
    """Everything observable about the tree under `root`, keyed by relative path."""
    out = {} if out is None else out
    d = root / rel
    st_ = os.stat(d)
    names = sorted(os.listdir(d))
    out[rel + "/"] = ("dir", names, st_.st_nlink, stat.S_IMODE(st_.st_mode))
    for n in names:
        key = os.path.normpath(os.path.join(rel, n))
        p = root / key
        st_ = os.lstat(p)
        if stat.S_ISLNK(st_.st_mode):
            out[key] = ("link", os.readlink(p), st_.st_size)
        elif stat.S_ISDIR(st_.st_mode):
            snapshot(root, key, out)
        else:
            with open(p, "rb") as f:
                data = f.read()
            assert len(data) == st_.st_size, f"{p}: read {len(data)} bytes, st_size {st_.st_size}"
            out[key] = ("file", st_.st_size, st_.st_nlink, stat.S_IMODE(st_.st_mode), data)
    return out


class FsModel(RuleBasedStateMachine):
    def __init__(self, mount_dir: Path, ref_dir: Path):
        super().__init__()
        self.roots = (mount_dir, ref_dir)
        for r in self.roots:
            for child in r.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        self.fds: list[tuple[int, int, int]] = []  # (mount fd, reference fd, flags)
        OPS.clear()

    # ---- helpers -----------------------------------------------------------
    def both(self, fn, *rel_args, raw=()):
        """Run fn(paths..., *raw) on both sides; same outcome required. Returns the outcomes."""
        res = [outcome(fn, *(str(root / a) for a in rel_args), *raw) for root in self.roots]
        (km, vm), (kr, vr) = res
        assert km == kr, f"{fn.__name__}{rel_args}{raw}: mount {res[0]}, reference {res[1]}"
        if km == "err":
            assert vm == vr, f"{fn.__name__}{rel_args}{raw}: errno mount {errno.errorcode.get(vm)}, " \
                             f"reference {errno.errorcode.get(vr)}"
        return res

    def both_fd(self, i: int, fn, *args):
        fm, fr, _ = self.fds[i % len(self.fds)]
        res = [outcome(fn, fm, *args), outcome(fn, fr, *args)]
        assert res[0][0] == res[1][0] and (res[0][0] == "ok" or res[0][1] == res[1][1]), \
            f"{fn.__name__}(fd, {args!r:.80}): mount {res[0]!r:.100}, reference {res[1]!r:.100}"
        return res

    @initialize(files=st.lists(st.tuples(paths, payload), max_size=3))
    def populate(self, files):
        for root in self.roots:
            for d in ("d", "e", "d/f"):
                (root / d).mkdir()
            for p, data in files:
                (root / p).write_bytes(data)
            for p in TWINS:  # identical chunks from the start (--dedupe shares them)
                (root / p).write_bytes(TWIN)

    # ---- whole-file and namespace rules ----------------------------------------
    @rule(p=paths, data=payload)
    def write_whole_file(self, p, data):
        def put(path, data):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                return os.write(fd, data)
            finally:
                os.close(fd)
        self.both(put, p, raw=(data,))

    @precondition(lambda self: len(self.fds) < MAX_FDS)
    @rule(p=paths, flags=st.sampled_from(OPEN_FLAGS), mode=st.sampled_from([0o644, 0o600, 0o755]))
    def open_file(self, p, flags, mode):
        (km, fm), (kr, fr) = self.both(os.open, p, raw=(flags, mode))
        if km == "ok":
            self.fds.append((fm, fr, flags))

    @rule(p=paths, size=sizes)
    def truncate_path(self, p, size):
        self.both(os.truncate, p, raw=(size,))

    @rule(p=any_path)
    def unlink(self, p):
        self.both(os.unlink, p)

    @rule(src=any_path, dst=any_path)
    def rename(self, src, dst):
        self.both(os.rename, src, dst)

    @rule(src=any_path, dst=any_path, flags=st.sampled_from(RENAME_FLAGS))
    def rename_flags(self, src, dst, flags):
        self.both(renameat2, src, dst, raw=(flags,))

    @rule(p=dirs.filter(bool))
    def mkdir(self, p):
        self.both(os.mkdir, p)

    @rule(p=any_path)
    def rmdir(self, p):
        self.both(os.rmdir, p)

    @rule(src=paths, dst=paths)
    def link(self, src, dst):
        self.both(os.link, src, dst)

    @rule(to=st.sampled_from(["a", "../a", "d/b", "nowhere"]), p=paths)
    def symlink(self, to, p):
        self.both(lambda path: os.symlink(to, path), p)

    @rule(p=any_path, mode=st.sampled_from([0o600, 0o755, 0o4711, 0o4777, 0o2777, 0o6777, 0o2767, 0o666]))
    def chmod(self, p, mode):
        self.both(os.chmod, p, raw=(mode,))

    @rule(p=any_path, follow=st.booleans())
    def chown_nothing(self, p, follow):
        """chown(p, -1, -1) changes no owner but moves ctime (on both sides or neither)."""
        fn = os.chown if follow else os.lchown
        before = [outcome(os.lstat, str(r / p)) for r in self.roots]
        self.both(fn, p, raw=(-1, -1))
        moved = [b[0] == "ok" and os.lstat(r / p).st_ctime_ns != b[1].st_ctime_ns
                 for r, b in zip(self.roots, before)]
        assert moved[0] == moved[1], f"{fn.__name__}({p}, -1, -1) moved ctime: mount {moved[0]}, ext4 {moved[1]}"

    @rule(d=dirs, length=st.sampled_from([255, 256, 1024]), op=st.sampled_from(sorted(LONG_NAME_OPS)))
    def long_name(self, d, length, op):
        """Names over 255 bytes: ENAMETOOLONG on both sides, whatever the operation."""
        name = "n" * length
        self.both(LONG_NAME_OPS[op], f"{d}/{name}" if d else name)

    @rule(p=paths, flags=st.sampled_from(NOBODY_FLAGS), data=payload,
          mode=st.sampled_from([None, 0o4777, 0o6777, 0o2767, 0o2777]))
    def write_as_nobody(self, p, flags, data, mode):
        """nobody opens and writes (after a chmod that lets it, often): same errno, and the
        set-user-ID bits go (or stay) on both sides."""
        if mode is not None:
            self.both(os.chmod, p, raw=(mode,))
        def put(dirfd):
            fd = os.open(p, flags, dir_fd=dirfd)
            try:
                if flags & os.O_ACCMODE != os.O_RDONLY:
                    os.write(fd, data)
                return stat.S_IMODE(os.fstat(fd).st_mode)
            finally:
                os.close(fd)
        res = []
        for root in self.roots:
            dirfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                res.append(outcome(as_user, put, dirfd))  # relative to dirfd: nobody need not reach root
            finally:
                os.close(dirfd)
        assert res[0] == res[1], f"write_as_nobody({p}, {flags:#o}): mount {res[0]}, reference {res[1]}"

    @rule(p=any_path)
    def readlink(self, p):
        self.both(os.readlink, p)

    @rule(p=paths, off=offsets, n=sizes)
    def read_path(self, p, off, n):
        def rd(path):
            with open(path, "rb") as f:
                f.seek(off)
                return f.read(n)
        self.both(rd, p)

    # ---- descriptor rules ------------------------------------------------------
    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_FDS), off=offsets, data=payload)
    def pwrite(self, i, off, data):
        flags = self.fds[i % len(self.fds)][2]
        if flags & os.O_APPEND:
            self.both_fd(i, os.write, data)  # appends wherever the offset is
        else:
            self.both_fd(i, os.pwrite, data, off)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_FDS), off=offsets, n=sizes)
    def pread(self, i, off, n):
        self.both_fd(i, os.pread, n, off)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_FDS), off=offsets, data=payload)
    def seek_write_read(self, i, off, data):
        self.both_fd(i, os.lseek, off, os.SEEK_SET)
        self.both_fd(i, os.write, data)
        self.both_fd(i, os.lseek, 0, os.SEEK_CUR)
        self.both_fd(i, os.read, 100)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_FDS), size=sizes)
    def ftruncate(self, i, size):
        self.both_fd(i, os.ftruncate, size)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_FDS), mode=st.sampled_from(FALLOC_MODES), off=offsets,
          n=sizes.filter(bool))
    def fallocate(self, i, mode, off, n):
        self.both_fd(i, fallocate, mode, off, n)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_FDS), j=st.integers(0, MAX_FDS), off_in=offsets, off_out=offsets, n=sizes)
    def copy_file_range(self, i, j, off_in, off_out, n):
        (sm, sr, _), (dm, dr, _) = self.fds[i % len(self.fds)], self.fds[j % len(self.fds)]
        res = [outcome(copy_range, sm, dm, n, off_in, off_out), outcome(copy_range, sr, dr, n, off_in, off_out)]
        assert res[0] == res[1], f"copy_file_range({n}, {off_in}, {off_out}): mount {res[0]}, reference {res[1]}"

    @precondition(lambda self: any(flags & os.O_ACCMODE != os.O_WRONLY for _, _, flags in self.fds))
    @rule(i=st.integers(0, MAX_FDS))
    def seek_data_and_holes(self, i):
        readable = [fm for fm, _, flags in self.fds if flags & os.O_ACCMODE != os.O_WRONLY]
        holes_read_as_zeros(readable[i % len(readable)])

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_FDS))
    def fsync(self, i):
        self.both_fd(i, os.fsync)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_FDS))
    def close(self, i):
        fm, fr, _ = self.fds.pop(i % len(self.fds))
        os.close(fm)
        os.close(fr)

    # ---- after every step ----------------------------------------------------------
    @invariant()
    def trees_agree(self):
        sm, sr = (snapshot(r) for r in self.roots)
        assert sm.keys() == sr.keys(), f"names differ: mount {sorted(sm)}, reference {sorted(sr)}"
        for k in sm:
            assert sm[k] == sr[k], f"{k}: mount {sm[k]!r:.200}, reference {sr[k]!r:.200}"

    @invariant()
    def open_descriptors_agree(self):
        for fm, fr, flags in self.fds:
            a, b = os.fstat(fm), os.fstat(fr)
            assert stat.S_IFMT(a.st_mode) == stat.S_IFMT(b.st_mode)
            if stat.S_ISDIR(a.st_mode):
                continue  # a directory opened read-only; its st_size is the filesystem's own
            assert (a.st_size, a.st_nlink) == (b.st_size, b.st_nlink)
            if flags & os.O_ACCMODE != os.O_WRONLY:
                assert os.pread(fm, a.st_size + 1, 0) == os.pread(fr, b.st_size + 1, 0)

    def teardown(self):
        """Also called while a failing step's exception unwinds (hypothesis calls it from a
        `finally`): the first such failure of the run is written down."""
        failure = sys.exc_info()[1]
        if (isinstance(failure, Exception) and not isinstance(failure, HypothesisException)
                and not FIRST_FAILURE):
            FIRST_FAILURE.append("the first failing example, as it ran:\n  " + "\n  ".join(OPS)
                                 + "\n" + "".join(traceback.format_exception(failure)))
        for fm, fr, _ in self.fds:
            os.close(fm)
            os.close(fr)
        self.fds.clear()


def test_mount_behaves_like_ext4(mnt):
    mount_dir = mnt.path / "model"
    ref_root = ext4_tmpdir()  # /tmp may be a tmpfs
    ref_dir = ref_root / "reference"
    mount_dir.mkdir()
    ref_dir.mkdir()
    FIRST_FAILURE.clear()
    try:
        run_state_machine_as_test(
            lambda: FsModel(mount_dir, ref_dir),
            settings=settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
                              suppress_health_check=list(HealthCheck)))
    except BaseException as e:
        for report in FIRST_FAILURE:
            e.add_note(report)
        raise
    finally:
        shutil.rmtree(ref_root, ignore_errors=True)
    os.kill(mnt.pid, 0)  # the daemon is still alive
