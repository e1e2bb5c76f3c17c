"""The native FUSE session serving tests/kernel_memfs.py on real mounts (4 threads).

Covers what ckptfs needs of the engine: names, 64 MiB written by several
writers at once and read back, readdir of thousands of entries, rename,
unlink, xattrs, statfs, fsync, `sync`, interrupts, suid killing, a clean
unmount after which every worker exits, and a killed server whose dead mount
`umount -l` clears. The last tests drive a session over a socket pair
instead of /dev/fuse, to feed it requests no kernel would send.
"""
import contextlib
import errno
import hashlib
import mmap
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import nobody
from kernel_memfs import CHUNK, HOLD_XATTR, WAIT_XATTR, MemFS, serve
from ckptfs.fuse.kernel import abi
from ckptfs.fuse.kernel.abi import Op
from ckptfs.fuse.kernel.session import Session, SessionConfig
from mounting import is_mounted
from waiting import poll

MEMFS = Path(__file__).with_name("kernel_memfs.py")


def unmount_quietly(path) -> None:
    if is_mounted(path):
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@pytest.fixture
def memfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fs, session = serve(str(mnt), 4)
    try:
        yield fs, session, mnt
    finally:
        unmount_quietly(mnt)
        session.wait(15)
        session.close()


@pytest.mark.mount
def test_names_and_attributes(memfs):
    fs, s, mnt = memfs
    assert is_mounted(mnt) and s.alive() == 4 and s.negotiated.max_write >= 128 << 10
    def named() -> bool:  # each worker names itself as it starts: alive may come first
        comms = {(Path("/proc/self/task") / t / "comm").read_text().strip() for t in os.listdir("/proc/self/task")}
        return {f"ckptfs-fuse {i}" for i in range(4)} <= comms

    poll(named, "the workers named for top -H and perf")
    (mnt / "d" / "e").mkdir(parents=True)
    f = mnt / "d" / "e" / "f"
    f.write_bytes(b"hello")
    st = f.stat()
    assert (st.st_size, stat.S_IFMT(st.st_mode), st.st_nlink) == (5, stat.S_IFREG, 1)
    assert (mnt / "d").stat().st_nlink == 3
    os.chmod(f, 0o640)
    os.chown(f, 1234, 5678)
    os.utime(f, ns=(1_000_000_123, 2_000_000_456))
    st = f.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_atime_ns, st.st_mtime_ns) == (
        0o640, 1234, 5678, 1_000_000_123, 2_000_000_456)
    os.truncate(f, 3)
    assert f.read_bytes() == b"hel"
    with open(f, "wb") as w:  # O_TRUNC arrives inside OPEN (FUSE_ATOMIC_O_TRUNC)
        assert os.fstat(w.fileno()).st_size == 0
    os.symlink("e/f", mnt / "d" / "ln")
    assert os.readlink(mnt / "d" / "ln") == "e/f"
    os.link(f, mnt / "hard")
    assert f.stat().st_nlink == 2 and (mnt / "hard").stat().st_ino == f.stat().st_ino
    os.mkfifo(mnt / "fifo")
    assert stat.S_ISFIFO((mnt / "fifo").stat().st_mode)
    with pytest.raises(FileNotFoundError):
        (mnt / "missing").stat()
    with pytest.raises(FileExistsError):
        (mnt / "d").mkdir()


# Writes from page-aligned (mmap) memory, as dd oflag=direct or a pinned staging buffer would.
WRITER = r"""
import mmap, os, random, sys
path, start, size, seed, piece = sys.argv[1], *map(int, sys.argv[2:6])
data = random.Random(seed).randbytes(size)
buf = mmap.mmap(-1, piece)
fd = os.open(path, os.O_WRONLY)
pos = 0
while pos < size:
    take = min(piece, size - pos)
    buf[:take] = data[pos:pos + take]
    n = os.pwrite(fd, memoryview(buf)[:take], start + pos)
    if n <= 0:
        sys.exit(f"pwrite returned {n}")
    pos += n
os.close(fd)
"""


@pytest.mark.mount
def test_64mib_from_four_writer_processes_at_once(memfs):
    fs, s, mnt = memfs
    f = mnt / "ckpt.pt"
    f.touch()
    quarter = 16 << 20
    pieces = [CHUNK, CHUNK, 4 << 20, CHUNK + 4096 + 17]  # aligned whole chunks are kept in place, the rest copied
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(f), str(i * quarter), str(quarter), str(i),
                               str(pieces[i])]) for i in range(4)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0, 0]
    want = hashlib.sha256(b"".join(random.Random(i).randbytes(quarter) for i in range(4))).hexdigest()
    assert f.stat().st_size == 64 << 20
    h = hashlib.sha256()
    with open(f, "rb") as r:  # a page-cached reader: READs come from readahead, in parallel
        while block := r.read(3 << 20):
            h.update(block)
    assert h.hexdigest() == want
    assert fs.adopted >= 32 and fs.copied > 0  # most payloads landed in their chunk with no copy
    assert s.statistics().requests.get("write", 0) >= 16 + 16 + 4 + 16  # at least one request per write()


@pytest.mark.mount
def test_a_client_sending_one_request_at_a_time_is_served_by_one_worker(memfs):
    """While requests come one at a time, one worker reads and serves them all, the other three
    park (readers.py): the kernel would otherwise hand each to the worker that waited longest
    (without parking: 140-257 of 300 on the busiest worker, the next request on another worker
    about every other time). A parked worker reads only when woken (a request queued behind
    another: on a loaded machine the kernel's FORGETs), and each such wake-up moves the requests to
    another worker at most three times (there, back while the woken one is still reading, and
    there again if it read the next one first)."""
    fs, s, mnt = memfs
    f = mnt / "f"
    f.write_bytes(b"x")
    os.setxattr(f, "user.a", b"1")
    time.sleep(0.1)  # whatever the write left queued (RELEASE) is served
    poll(lambda: os.getxattr(f, "user.a") and s.readers.parked == 3, "three workers parked")
    st0, start = s.statistics(), len(fs.getxattr_by)
    for _ in range(300):
        assert os.getxattr(f, "user.a") == b"1"  # a round trip each (xattrs are never cached)
    st1, by = s.statistics(), fs.getxattr_by[start:]
    assert len(by) == 300
    switches = sum(a != b for a, b in zip(by, by[1:]))
    woken = st1.readers_woken - st0.readers_woken
    assert st1.readers_activated == st0.readers_activated  # nothing made every worker read
    assert switches <= 3 * woken, f"{switches} switches of worker, {woken} wake-ups: {by}"


@pytest.mark.mount
def test_requests_queued_behind_a_slow_handler_wake_parked_workers(memfs):
    """The one reader held in a slow handler that does not say `waiting()`: requests queue meanwhile
    (nobody reads, as in a single-threaded server). Once it is back, the backlog it finds wakes
    parked workers one at a time (readers.py `wake_one`), so the queued requests are served by more
    than one worker."""
    fs, s, mnt = memfs
    f = mnt / "f"
    f.write_bytes(b"x")
    os.setxattr(f, "user.a", b"1")
    # ... and no parked worker let through to read once (`wake_one`'s pass, still counted as parked
    # until it runs): it would read the queued requests itself while the reader is held
    poll(lambda: os.getxattr(f, "user.a") and s.readers.parked == 3 and not s.readers._passes,
         "one worker reading, three parked")
    held = threading.Thread(target=os.getxattr, args=(f, HOLD_XATTR))
    held.start()
    assert fs.holding.wait(10)
    before = s.statistics()
    got, tids = [], []

    def client():
        tids.append(threading.get_native_id())
        got.append(os.getxattr(f, "user.a"))
    clients = [threading.Thread(target=client) for _ in range(6)]
    for t in clients:
        t.start()

    def wchan(tid: int) -> str:
        try:
            return Path(f"/proc/self/task/{tid}/wchan").read_text()
        except FileNotFoundError:
            return "done"  # answered already: a worker woken meanwhile read it (counted below)

    def queued() -> bool:  # every client asleep in the kernel waiting for its answer, or answered
        return len(tids) == 6 and all(wchan(tid) in ("request_wait_answer", "done") for tid in tids)
    poll(queued, "six requests queued behind the held one")
    fs.released.set()
    held.join(10)
    for t in clients:
        t.join(10)
    assert got == [b"1"] * 6
    after = s.statistics()
    assert after.readers_woken + after.readers_activated > before.readers_woken + before.readers_activated


class Settle:
    """A `settle` hook as tasks.LoopLock's: armed by every reply, due after `quiet` seconds without
    a request."""

    def __init__(self, quiet: float):
        self.quiet = quiet
        self.due = False
        self.wakes = 0

    def arm(self) -> None:
        self.due = True

    def due_in(self):
        return self.quiet if self.due else None

    def wake_due(self) -> None:
        if self.due:
            self.due = False
            self.wakes += 1


@contextlib.contextmanager
def settling(tmp_path, *, threads: int, quiet: float):
    """A memfs session with a `Settle` hook armed by every reply: (settle, a file `f` with the
    xattr user.a); unmounted after (a reader waiting in poll() sees the unmount too)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    settle = Settle(quiet=quiet)
    fs, s = serve(str(mnt), threads, settle=settle, after_reply=settle.arm)
    try:
        f = mnt / "f"
        f.write_bytes(b"x")
        os.setxattr(f, "user.a", b"1")
        yield settle, f
    finally:
        unmount_quietly(mnt)
        assert s.wait(15)
        s.close()


@pytest.mark.mount
def test_a_wake_up_due_after_replies_waits_for_requests_to_pause(tmp_path):
    """The session's `settle` hook: before each read the reader waits up to `due_in()` for a
    request and calls `wake_due()` only if none came (ckptfs: the trio thread's work after a
    close waits until the client pauses instead of competing with its next requests)."""
    with settling(tmp_path, threads=2, quiet=30.0) as (settle, f):
        for _ in range(300):
            assert os.getxattr(f, "user.a") == b"1"
        assert settle.wakes == 0 and settle.due  # no pause of 30 s: due all along, never woken
        settle.quiet = 0.01
        os.getxattr(f, "user.a")  # the reader polls again, for 10 ms now
        poll(lambda: settle.wakes == 1, "the wake-up once requests paused")
        assert not settle.due


@pytest.mark.mount
def test_a_wake_up_due_is_never_left_with_a_worker_that_parks(tmp_path):
    """With several workers, the one that replied last may find another already waiting in its
    read and park: it must not take the due wake-up with it (nobody would wake the trio thread
    until the next request). Every worker waits for the pause itself before it parks or reads.
    Rounds of four clients at once (every worker reads, then parks again), then nothing: each
    time the wake-up comes."""
    with settling(tmp_path, threads=4, quiet=0.005) as (settle, f):
        def client():
            for _ in range(30):
                os.getxattr(f, "user.a")
        for rnd in range(15):
            clients = [threading.Thread(target=client) for _ in range(4)]
            for t in clients:
                t.start()
            for t in clients:
                t.join()
            poll(lambda: not settle.due, f"round {rnd}: the wake-up once requests paused", timeout=5)


@pytest.mark.mount
@pytest.mark.skipif(os.geteuid() != 0, reason="raising fs.fuse.max_pages_limit needs root")
def test_requests_of_four_chunks_scatter_over_four_buffers(tmp_path):
    """max_write of 4 chunks (the limit raised to 1025 pages): one 4 MiB request per 4 MiB of a
    write(), read into 4 spare chunk buffers and adopted piece by piece, from a page-aligned
    buffer and from an unaligned one (the spare page); an unaligned offset copies every piece."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fs, s = serve(str(mnt), 2, max_write=4 * CHUNK, grain=CHUNK, raise_max_pages=True)
    try:
        assert (s.negotiated.max_write, s.negotiated.max_pages) == (4 * CHUNK, 1025)
        rng = random.Random(5)
        aligned = mmap.mmap(-1, 16 * CHUNK)
        aligned[:] = rng.randbytes(16 * CHUNK)
        unaligned = rng.randbytes(16 * CHUNK)  # a bytes object: its data is not page-aligned
        odd = rng.randbytes(8 * CHUNK + 3)
        fd = os.open(mnt / "f", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            assert os.pwrite(fd, aligned, 0) == 16 * CHUNK
            assert os.pwrite(fd, unaligned, 16 * CHUNK) == 16 * CHUNK
            assert (fs.adopted, fs.copied, s.statistics().requests["write"]) == (32, 0, 8)
            assert os.pwrite(fd, odd, 40 * CHUNK + 5) == len(odd)
        finally:
            os.close(fd)
        assert fs.adopted == 32 and s.statistics().requests["write"] == 8 + 3 and fs.copied == 9  # 4 + 4 + 1 pieces
        want = bytes(aligned) + unaligned + bytes(8 * CHUNK + 5) + odd
        fd = os.open(mnt / "f", os.O_RDONLY)
        try:
            got = bytearray()
            while piece := os.pread(fd, 5 * CHUNK + 1, len(got)):  # READs of several chunks
                got += piece
        finally:
            os.close(fd)
        assert got == want
    finally:
        unmount_quietly(mnt)
        s.wait(15)
        s.close()


@pytest.mark.mount
def test_writer_threads_on_separate_files(memfs):
    fs, s, mnt = memfs
    data = {i: random.Random(100 + i).randbytes(8 << 20) for i in range(4)}
    errors = []

    def write(i):
        try:
            with open(mnt / f"t{i}", "wb") as w:
                for pos in range(0, len(data[i]), 1 << 20):
                    w.write(data[i][pos:pos + (1 << 20)])
                os.fsync(w.fileno())
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    for i in range(4):
        assert (mnt / f"t{i}").read_bytes() == data[i]
    assert fs.fsyncs >= 4


@pytest.mark.mount
def test_readdir_of_thousands_rename_unlink(memfs):
    fs, s, mnt = memfs
    d = mnt / "many"
    d.mkdir()
    names = {f"file-{i:05d}-" + "x" * (i % 40) for i in range(3000)}
    for name in names:
        os.close(os.open(d / name, os.O_CREAT | os.O_WRONLY, 0o644))
    assert set(os.listdir(d)) == names
    with os.scandir(d) as it:  # READDIRPLUS: attributes arrive with the names
        seen = {e.name: (e.inode(), e.is_file()) for e in it}
    assert len(seen) == 3000 and all(is_file for _, is_file in seen.values())
    one = sorted(names)[0]
    assert os.stat(d / one).st_ino == seen[one][0]
    # rename: over an existing file, into another directory, a directory over an empty one
    os.rename(d / one, d / "renamed")
    os.replace(d / sorted(names)[1], d / "renamed")
    assert not (d / sorted(names)[1]).exists() and (d / "renamed").exists()
    (mnt / "other").mkdir()
    os.rename(d / "renamed", mnt / "other" / "moved")
    (mnt / "empty").mkdir()
    os.rename(mnt / "other", mnt / "empty")
    assert (mnt / "empty" / "moved").exists() and not (mnt / "other").exists()
    (mnt / "full").mkdir()
    (mnt / "full" / "x").touch()
    with pytest.raises(OSError) as e:
        os.rename(mnt / "empty", mnt / "full")
    assert e.value.errno in (errno.ENOTEMPTY, errno.EEXIST)
    with pytest.raises(OSError) as e:
        os.rmdir(mnt / "full")
    assert e.value.errno == errno.ENOTEMPTY
    for name in os.listdir(d):
        os.unlink(d / name)
    assert os.listdir(d) == []
    os.rmdir(d)
    assert sorted(os.listdir(mnt)) == ["empty", "full"]


@pytest.mark.mount
def test_xattrs(memfs):
    fs, s, mnt = memfs
    f = mnt / "x"
    f.touch()
    os.setxattr(f, "user.a", b"1")
    big = os.urandom(60000)
    os.setxattr(f, "user.big", big)  # os.getxattr starts small: the ERANGE round trip happens too
    assert os.getxattr(f, "user.a") == b"1" and os.getxattr(f, "user.big") == big
    assert sorted(os.listxattr(f)) == ["user.a", "user.big"]
    with pytest.raises(FileExistsError):
        os.setxattr(f, "user.a", b"2", os.XATTR_CREATE)
    with pytest.raises(OSError) as e:
        os.setxattr(f, "user.none", b"2", os.XATTR_REPLACE)
    assert e.value.errno == errno.ENODATA
    os.removexattr(f, "user.a")
    with pytest.raises(OSError) as e:
        os.getxattr(f, "user.a")
    assert e.value.errno == errno.ENODATA
    assert os.listxattr(f) == ["user.big"]


@pytest.mark.mount
def test_statfs_fsync_and_sync(memfs):
    fs, s, mnt = memfs
    (mnt / "f").write_bytes(b"x" * (3 << 20))
    sv = os.statvfs(mnt)
    assert (sv.f_bsize, sv.f_blocks, sv.f_files, sv.f_namemax) == (4096, 1 << 22, 1 << 20, 255)
    assert sv.f_bfree == (1 << 22) - 3 * (CHUNK // 4096)
    before = fs.fsyncs
    with open(mnt / "f", "r+b") as w:
        os.fsync(w.fileno())
        os.fdatasync(w.fileno())
    dfd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    assert fs.fsyncs == before + 3
    assert subprocess.run(["sync"], timeout=60).returncode == 0
    assert (mnt / "f").stat().st_size == 3 << 20  # the mount still answers


SLOW_CLIENT = r"""
import os, signal, sys
def stop(*a):
    raise InterruptedError("interrupted")
signal.signal(signal.SIGUSR1, stop)
try:
    os.getxattr(sys.argv[1], "user.slow")
except InterruptedError:
    sys.exit(0)
except OSError as e:
    sys.exit(f"errno {e.errno}")
sys.exit("no error")
"""


@pytest.mark.mount
def test_interrupt_reaches_a_waiting_handler(memfs):
    fs, s, mnt = memfs
    (mnt / "f").touch()
    p = subprocess.Popen([sys.executable, "-c", SLOW_CLIENT, str(mnt / "f")])
    try:
        assert fs.slow_entered.wait(30)
        p.send_signal(signal.SIGUSR1)
        assert p.wait(timeout=8) == 0  # the handler saw the interrupt long before its 10 s
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert s.statistics().requests.get("interrupt", 0) >= 1


@pytest.mark.mount
def test_a_spare_worker_serves_while_every_worker_waits_and_leaves_after(tmp_path):
    """One worker, waiting in a handler (`Session.waiting`): a spare reads the other requests
    meanwhile; once the wait is over the spare leaves after a request (`worker_exit` runs)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fs, s = serve(str(mnt), 1)
    try:
        (mnt / "f").write_bytes(b"x")
        got = []
        t = threading.Thread(target=lambda: got.append(os.getxattr(mnt / "f", WAIT_XATTR)))
        t.start()
        poll(lambda: s.statistics().spares_started == 1, "a spare worker")
        for i in range(20):  # served by the spare while the only worker waits
            (mnt / f"g{i}").write_bytes(b"y")
        assert sorted(os.listdir(mnt))[:2] == ["f", "g0"] and not got
        fs.released.set()
        t.join(10)
        assert got == [b"released"]

        def left() -> bool:
            os.stat(mnt / "f")  # a request: the spare that reads one while the worker is free leaves
            return s.alive() == 1
        poll(left, "the spare to leave")
        assert fs.exits == 1 and s.statistics().spares_started == 1
    finally:
        fs.released.set()
        unmount_quietly(mnt)
        s.wait(15)
        s.close()


@pytest.mark.mount
def test_unprivileged_write_kills_suid():
    if nobody.python() is None:
        pytest.skip("no interpreter the user nobody can run")
    mnt = Path(tempfile.mkdtemp(prefix="ckptfs-kernel-"))  # pytest's tmp_path is closed to nobody
    mnt.chmod(0o755)
    fs, s = serve(str(mnt), 2)
    try:
        f = mnt / "suid"
        f.write_bytes(b"x")
        os.chmod(f, 0o6777)
        assert f.stat().st_mode & 0o6000 == 0o6000
        res = nobody.run(["-c", f"import os; fd = os.open({str(f)!r}, os.O_WRONLY); os.write(fd, b'y'); os.close(fd)"])
        assert res.returncode == 0, res.stderr
        time.sleep(1.1)  # past the attribute timeout
        assert f.stat().st_mode & 0o7777 == 0o0777  # FUSE_WRITE_KILL_SUIDGID (HANDLE_KILLPRIV_V2)
        assert f.read_bytes() == b"y"
    finally:
        unmount_quietly(mnt)
        s.wait(15)
        s.close()
        mnt.rmdir()


@pytest.mark.mount
def test_umount_ends_every_worker(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fs, s = serve(str(mnt), 4)
    try:
        (mnt / "f").write_bytes(b"data")
        assert s.alive() == 4
        res = subprocess.run(["umount", str(mnt)], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        assert s.wait(15) and s.alive() == 0
        assert not is_mounted(mnt)
    finally:
        unmount_quietly(mnt)
        s.close()


@pytest.mark.mount
def test_fusermount_path(tmp_path):
    """The non-root path (fusermount3 and SCM_RIGHTS), exercised as root."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fs = MemFS()
    s = Session(fs, str(mnt), SessionConfig(threads=2, use_fusermount=True))
    fs.session = s
    s.mount()
    try:
        s.start()
        (mnt / "f").write_bytes(b"via fusermount3")
        assert (mnt / "f").read_bytes() == b"via fusermount3"
        s.unmount()
        assert s.wait(15) and not is_mounted(mnt)
    finally:
        unmount_quietly(mnt)
        s.close()


@pytest.mark.mount
def test_killed_server_leaves_a_mount_umount_l_clears(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    p = subprocess.Popen([sys.executable, str(MEMFS), str(mnt), "4"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        (mnt / "f").write_bytes(b"x")
        p.kill()
        p.wait(30)
        with pytest.raises(OSError) as e:
            os.stat(mnt / "f")
        assert e.value.errno == errno.ENOTCONN
        assert is_mounted(mnt)
        assert subprocess.run(["umount", "-l", str(mnt)], timeout=30).returncode == 0
        assert not is_mounted(mnt) and os.listdir(mnt) == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        unmount_quietly(mnt)


# ---- a session over a socket pair: requests no kernel would send -------------------------------
def request(opcode: int, body: bytes = b"", unique: int = 2, nodeid: int = 1, length: int | None = None) -> bytes:
    n = 40 + len(body) if length is None else length
    return abi.IN_HEADER.pack(n, opcode, unique, nodeid, 0, 0, 1, 0, 0) + body


class Socketed:
    """A Session whose 'device' is one end of a SOCK_SEQPACKET pair (one message = one request)."""

    def __init__(self, handler):
        self.kernel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.session = Session(handler, "/nonexistent", SessionConfig(threads=1))
        self.session.fd = os.dup(theirs.fileno())
        theirs.close()
        self.session._pages_limit = 256
        init = abi.INIT_IN.pack(7, 45, 131072, abi.FUSE_INIT_EXT | abi.FUSE_MAX_PAGES | abi.FUSE_ASYNC_READ, 0)
        self.kernel.send(request(Op.INIT, init + bytes(44), unique=1))
        self.session.start()
        self.init_reply = self.kernel.recv(1 << 16)

    def ask(self, data: bytes) -> tuple[int, int, bytes]:
        self.kernel.send(data)
        self.kernel.settimeout(10)
        reply = self.kernel.recv(1 << 21)
        length, err, unique = abi.OUT_HEADER.unpack_from(reply)
        assert length == len(reply)
        return -err, unique, reply[16:]

    def close(self):
        self.kernel.close()
        assert self.session.wait(10)
        os.close(self.session.fd)


class Recorder:
    def __init__(self):
        self.syncfs_calls = 0

    def getattr(self, req):
        raise RuntimeError("a bug in the handler")

    def statfs(self, req):
        return "not a StatfsOut"

    def syncfs(self, req):
        self.syncfs_calls += 1

    def getxattr(self, req):
        return b"v" * 100

    def read(self, req):
        return [b"a" * 10, memoryview(b"b" * 10)]


def test_session_survives_garbage_and_bad_handlers():
    h = Recorder()
    k = Socketed(h)
    try:
        length, err, _ = abi.OUT_HEADER.unpack_from(k.init_reply)
        assert err == 0 and length == 16 + 64
        assert k.ask(request(Op.SYNCFS, bytes(8), unique=4)) == (0, 4, b"") and h.syncfs_calls == 1
        assert k.ask(request(Op.LOOKUP, b"no-nul", unique=6))[:2] == (errno.EIO, 6)  # garbled: EIO, served on
        assert k.ask(request(Op.GETATTR, bytes(16), unique=8, length=200))[:2] == (errno.EIO, 8)
        assert k.ask(request(Op.GETATTR, bytes(16), unique=10))[:2] == (errno.EIO, 10)  # handler raised
        assert k.ask(request(Op.STATFS, unique=12))[:2] == (errno.EIO, 12)  # handler returned junk
        assert k.ask(request(Op.MKDIR, abi.MKDIR_IN.pack(0o755, 0) + b"d\0", unique=14))[:2] == (errno.ENOSYS, 14)
        assert k.ask(request(Op.IOCTL, bytes(32), unique=16))[:2] == (errno.ENOSYS, 16)
        size0 = k.ask(request(Op.GETXATTR, abi.GETXATTR_IN.pack(0, 0) + b"user.v\0", unique=18))
        assert size0 == (0, 18, abi.GETXATTR_OUT.pack(100, 0))
        assert k.ask(request(Op.GETXATTR, abi.GETXATTR_IN.pack(50, 0) + b"user.v\0", unique=20))[:2] == (
            errno.ERANGE, 20)
        read = k.ask(request(Op.READ, abi.READ_IN.pack(1, 0, 20, 0, 0, 0, 0), unique=22))
        assert read == (0, 22, b"a" * 10 + b"b" * 10)
        assert k.ask(request(Op.READ, abi.READ_IN.pack(1, 0, 19, 0, 0, 0, 0), unique=24))[:2] == (errno.EIO, 24)
        # an INTERRUPT for a request not in flight asks the kernel to send it again later
        assert k.ask(request(Op.INTERRUPT, abi.INTERRUPT_IN.pack(1000), unique=1001))[:2] == (errno.EAGAIN, 1001)
        k.kernel.send(request(Op.FORGET, abi.FORGET_IN.pack(1), unique=26))  # no reply, ENOSYS or not
        assert k.ask(request(Op.SYNCFS, bytes(8), unique=28))[:2] == (0, 28)
        stats = k.session.statistics()
        assert stats.requests["syncfs"] == 2 and stats.errors >= 6
        assert stats.requests["unsupported_ioctl"] == 1
    finally:
        k.close()
