"""The native front end without a kernel: the bridge to trio, interrupts, the daemon's fallback."""
import errno
import logging
import os
import signal
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest
import trio

from ckptfs import daemon
from ckptfs.errors import FsError, UsageError
from ckptfs.fuse.native import TrioHandler
from ckptfs.fuse.native_ops import Blocked
from ckptfs.tasks import QUIET_S, SETTLE_MAX_S, LoopLock
from ckptfs.fuse.kernel.requests import Fsync, Getattr, Header, Write
from waiting import poll


def _header(unique: int) -> Header:
    return Header(length=0, opcode=0, unique=unique, nodeid=1, uid=0, gid=0, pid=0)


class FakeOps:
    def __init__(self):
        self.thread = None

    async def getattr(self, req):
        self.thread = threading.get_ident()
        return "attr"

    async def readlink(self, req):
        raise KeyError("a bug")

    def lookup(self, req):  # synchronous: in the worker under the loop lock, if there is one
        self.thread = threading.get_ident()
        if req.unique == 9:
            raise Blocked(self.lookup_wait, req, "waited")
        return "entry"

    async def lookup_wait(self, req, what):
        self.thread = threading.get_ident()
        await trio.sleep(0)
        return what

    def mknod(self, req):
        raise Blocked(self.mknod_wait, req)

    async def mknod_wait(self, req):
        await trio.sleep(0)
        raise FsError("no space left on the devices", errno.ENOSPC)


def _serve(fn, *, loop: bool = False):
    """Run fn(handler, trio thread id) in a worker thread while trio runs; its result."""
    out = {}

    async def main():
        lock = None
        if loop:
            lock = LoopLock()
            lock.install()
        handler = TrioHandler(FakeOps(), trio.lowlevel.current_trio_token(), lock)
        out["result"] = await trio.to_thread.run_sync(fn, handler, threading.get_ident())
        if lock is not None:
            lock.uninstall()

    trio.run(main)
    return out["result"]


def test_a_workers_wake_ups_of_the_trio_thread_wait_for_its_kick():
    """A worker defers the trio thread's wake-ups until its reply is out (the session's
    after_reply hook kicks): woken sooner, the trio thread would compete for the GIL with it."""
    out = {}

    async def main():
        lock = LoopLock()
        lock.install()
        ran = []

        def worker():
            lock.defer()
            with lock:
                lock.soon(ran.append, "deferred")
            time.sleep(0.05)  # the trio thread is free to run it, but nothing woke it
            before = list(ran)
            lock.kick()
            with lock:  # after kick() a wake-up is immediate again
                lock.soon(ran.append, "at once")
            return before

        out["before"] = await trio.to_thread.run_sync(worker)
        with trio.fail_after(5):
            while len(ran) < 2:
                await trio.sleep(0.001)
        out["ran"] = ran
        lock.uninstall()

    trio.run(main)
    assert out["before"] == []
    assert out["ran"] == ["deferred", "at once"]


def _settling(worker):
    """worker(lock, ran) in a thread while trio runs, with a settling LoopLock; (its result, ran
    once every call it queued has run)."""
    out = {}

    async def main():
        lock = LoopLock()
        lock.install()
        lock.settle = True
        ran = []
        out["result"] = await trio.to_thread.run_sync(worker, lock, ran)
        with trio.fail_after(5):
            while lock._pending:
                await trio.sleep(0.001)
        out["ran"] = ran
        lock.uninstall()

    trio.run(main)
    return out["result"], out["ran"]


def _wait_for(pred) -> None:
    """In the worker thread: until pred() holds (5 s at most; the caller's asserts say what failed)."""
    poll(pred, None, timeout=5, every=0.001)


def _queue(lock: LoopLock, what) -> None:
    """What a worker's request does: a deferred soon(), then the after_reply kick()."""
    lock.defer()
    with lock:
        lock.soon(what)
    lock.kick()


def test_a_settling_kick_leaves_the_wake_up_to_the_reader_once_requests_pause():
    """Settling: the kick() after a reply does not wake the trio thread; the session's reader
    does (`wake_due`) once no request came for `due_in()` seconds (at most QUIET_S)."""
    def worker(lock, ran):
        _queue(lock, lambda: ran.append("first"))
        due = lock.due_in()
        _queue(lock, lambda: ran.append("second"))  # a later request's calls join the same wake-up
        time.sleep(0.05)  # the trio thread is free to run them, but nothing woke it
        before = list(ran)
        lock.wake_due()
        return due, before

    (due, before), ran = _settling(worker)
    assert due is not None and 0 <= due <= QUIET_S
    assert before == [] and ran == ["first", "second"]


def test_a_settling_kick_wakes_at_once_after_settle_max():
    """Requests that never pause still get the trio thread's work done: a kick SETTLE_MAX_S or
    more after the first one carried wakes it at once."""
    def worker(lock, ran):
        _queue(lock, lambda: ran.append("first"))
        time.sleep(SETTLE_MAX_S * 2)
        _queue(lock, lambda: ran.append("second"))
        _wait_for(lambda: len(ran) == 2)
        return lock.due_in()

    due, ran = _settling(worker)
    assert ran == ["first", "second"] and due is None


def test_the_trio_thread_woken_for_anything_else_runs_the_settling_calls():
    """A request that waits for the trio thread (`trio.from_thread`) wakes it; the calls that were
    settling run in that pass too, so nothing waits on a reader that may be busy."""
    def worker(lock, ran):
        _queue(lock, lambda: ran.append("settling"))
        trio.from_thread.run_sync(lambda: None)
        _wait_for(lambda: ran)
        return lock.due_in()

    due, ran = _settling(worker)
    assert ran == ["settling"] and due is None


def test_a_blocked_request_wakes_the_trio_thread_at_once_while_settling():
    """A request that must wait (`Blocked`) kicks with now=True: its continuation and the calls
    queued before it do not wait for a pause."""
    def worker(lock, ran):
        lock.defer()
        with lock:
            lock.soon(lambda: ran.append("before the wait"))
        lock.kick(now=True)
        _wait_for(lambda: ran)
        return lock.due_in()

    due, ran = _settling(worker)
    assert ran == ["before the wait"] and due is None


@pytest.mark.parametrize("loop", [False, True])
def test_synchronous_operations_run_in_the_worker_under_the_loop_lock_else_on_trio(loop):
    def fn(h, trio_thread):
        assert h.lookup(Getattr(_header(1), 0, 0)) == "entry"
        assert h.ops.thread == (threading.get_ident() if loop else trio_thread)
        assert h.lookup(Getattr(_header(9), 0, 0)) == "waited"  # Blocked: the rest on the trio thread
        assert h.ops.thread == trio_thread
        return True
    assert _serve(fn, loop=loop)


def test_a_continuation_that_fails_keeps_its_errno():
    """ENOSPC from a WRITE's wait for room must reach the writer as ENOSPC (a nursery around
    the wait once turned it into an exception group: EIO)."""
    def fn(h, trio_thread):
        with pytest.raises(FsError) as e:
            h.mknod(Getattr(_header(3), 0, 0))
        return e.value.errno
    assert _serve(fn, loop=True) == errno.ENOSPC


def test_requests_run_on_the_trio_thread_and_missing_ones_are_enosys():
    def fn(h, trio_thread):
        assert h.getattr(Getattr(_header(1), 0, 0)) == "attr"
        assert h.ops.thread == trio_thread != threading.get_ident()
        assert not hasattr(h, "lseek") and not hasattr(h, "_scopes_x")
        with pytest.raises(FsError) as e:
            h.readlink(Getattr(_header(2), 0, 0))
        return e.value.errno
    assert _serve(fn) == errno.EIO


class WaitingOps:
    """Requests that must wait until `room` is set: a synchronous one that turns out to need
    memory (`setattr`, as a WRITE: Blocked, the rest on the trio thread), and an FSYNC waiting
    for the devices (a coroutine, on the trio thread from the start)."""

    def __init__(self):
        self.room = None

    def setattr(self, req):
        raise Blocked(self.write_rest, req)

    async def write_rest(self, req):
        if self.room is None:
            self.room = trio.Event()
        await self.room.wait()
        return "written"

    async def fsync(self, req):
        return await self.write_rest(req)


def _blocked_write(pid: int, release_after: float | None, method: str = "setattr"):
    """A request from `pid` that waits (`method`: setattr, as a WRITE waiting for memory; fsync,
    waiting for the devices), interrupted by the kernel (a signal) again and again; room comes
    after `release_after` seconds (None: never). Its result, or the FsError."""
    out = {}

    async def main():
        lock = LoopLock()
        lock.install()
        ops = WaitingOps()
        h = TrioHandler(ops, trio.lowlevel.current_trio_token(), lock)

        def worker():
            try:
                header = Header(0, 0, 11, 1, 0, 0, pid)
                req = Getattr(header, 0, 0) if method == "setattr" else Fsync(header, 1, 0)
                return getattr(h, method)(req)
            except FsError as e:
                return e

        def interrupter(done: threading.Event):
            while not done.wait(0.03):
                h.interrupt(11)

        done = threading.Event()
        t = threading.Thread(target=interrupter, args=(done,))
        t.start()
        try:
            async with trio.open_nursery() as nursery:
                async def release():
                    await trio.sleep(release_after)
                    while ops.room is None:
                        await trio.sleep(0.01)
                    ops.room.set()
                if release_after is not None:
                    nursery.start_soon(release)
                with trio.fail_after(10):  # (abandoned then: a request that never ends must fail the test)
                    out["result"] = await trio.to_thread.run_sync(worker, abandon_on_cancel=True)
        finally:
            done.set()
            t.join()
        out["killed"] = h.killed
        lock.uninstall()

    trio.run(main)
    return out["result"], out["killed"]


@pytest.mark.parametrize("method", ["setattr", "fsync"])
@pytest.mark.parametrize("who", ["alive", "another pid namespace"])
def test_an_interrupted_write_or_fsync_that_waits_goes_on_while_its_caller_lives(who, method):
    """A signal the caller handles (SIGCHLD, SIGINT in Python) interrupts the request: a write
    still waits for memory and an fsync for the devices, and completes, as on an ext4 file
    (an fsync once answered EINTR here: Python retries it, Rust's sync_all and most C code do
    not); where /proc cannot tell (pid 0), it waits as before."""
    pid = os.getpid() if who == "alive" else 0
    assert _blocked_write(pid, release_after=0.5, method=method) == ("written", 0)


@pytest.mark.parametrize("method", ["setattr", "fsync"])
def test_an_interrupted_write_or_fsync_whose_caller_is_being_killed_gives_up_with_eintr(method):
    child = subprocess.Popen(["sleep", "60"])
    child.kill()
    child.wait()  # gone, as a killed writer's thread is once its exit ends
    result, killed = _blocked_write(child.pid, release_after=None, method=method)
    assert isinstance(result, FsError) and result.errno == errno.EINTR and killed == 1


def test_being_killed_reads_a_pending_sigkill_from_proc():
    from ckptfs.fs.creds import being_killed
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert being_killed(child.pid) is False and being_killed(os.getpid()) is False
        os.kill(child.pid, signal.SIGSTOP)  # stopped: a SIGKILL stays visible until it runs
        poll(lambda: open(f"/proc/{child.pid}/status").read().count("\tT (stopped)"), "the child to stop")
        assert being_killed(child.pid) is False
        os.kill(child.pid, signal.SIGKILL)
        assert being_killed(child.pid) is True  # pending or already exiting: either says so
    finally:
        child.kill()
        child.wait()
    assert being_killed(child.pid) is True and being_killed(0) is None


def test_a_syncfs_through_the_native_front_end_makes_a_closed_file_durable():
    """SYNCFS through the native front end reaches the store: once answered, a power cut that
    keeps no unflushed write still keeps a file written and closed before it (not yet committed:
    a closed file's commit may wait --max-lag). Kernel 6.18 sends SYNCFS only over virtiofs,
    never for `sync` on a /dev/fuse mount, so no real mount can show this."""
    import random

    from faulty import crash_all
    from inproc import Driver, PathOps, make_devices
    from ckptfs.fuse.kernel.requests import Syncfs
    from ckptfs.fuse.native_ops import Operations

    devs = make_devices(2)
    driver = Driver(devs, fmt=True)
    data = random.randbytes(300_000)
    try:
        PathOps(driver).write_file("/closed", data)
        TrioHandler(Operations(driver.afs), driver.token).syncfs(Syncfs(_header(5)))
    finally:
        driver.kill()
    after = Driver(crash_all(devs, random.Random(1), keep=lambda offset: False))
    try:
        assert PathOps(after).read_file("/closed") == data
    finally:
        after.kill()


class Refused:
    def __init__(self, *a, **kw):
        pass

    def start(self):
        raise PermissionError(errno.EACCES, "Permission denied", "/dev/fuse")


def _refusing_daemon(monkeypatch):
    monkeypatch.setattr(daemon, "NativeEngine", Refused)
    cfg = SimpleNamespace(mountpoint="/nowhere", threads=None)
    store = SimpleNamespace(loop=LoopLock())
    return daemon._Daemon(cfg, SimpleNamespace(afs=None, store=store), control=None, metrics=None)


def test_a_native_engine_that_cannot_start_falls_back_in_one_log_line(monkeypatch, caplog):
    d = _refusing_daemon(monkeypatch)
    loop = d.mount.store.loop
    with caplog.at_level(logging.INFO, logger="ckptfs.daemon"):
        assert trio.run(d._start_native) is None
    assert not loop.installed and loop.lock.acquire(blocking=False)  # given back with the fallback
    lines = [r for r in caplog.records if r.getMessage() == "engine.fallback"]
    assert len(lines) == 1 and "Permission denied" in lines[0].fields["error"]


def test_without_pyfuse3_a_native_engine_that_cannot_start_fails_with_its_cause(monkeypatch):
    d = _refusing_daemon(monkeypatch)
    monkeypatch.setattr(daemon.pyfuse3_engine, "available", lambda: False)
    with pytest.raises(UsageError, match=r"native FUSE engine cannot start \(PermissionError.*Permission denied.*"
                                         r"pyfuse3 fallback is not installed"):
        trio.run(d._start_native)
    assert not d.mount.store.loop.installed


def test_write_buffer_lends_runs_of_slots_and_shifts_them():
    """write_buffer without a kernel: a run of K lent slots per worker (one chunk each) and one
    more (room to move a payload onto the grid), lending stops at keep_free (the rest of the run
    is the worker's own memory), a shifted run starts `shift` bytes into its first slot and has
    one position more; close() gives every slot back."""
    from inproc import Driver, make_devices
    from ckptfs.fuse.native import request_chunks
    from ckptfs.fuse.native_ops import Operations

    MiB = 1 << 20
    driver = Driver(make_devices(1, 64 * MiB), memory=16 * MiB, chunk_size=MiB, fmt=True)
    loop = driver.store.loop
    driver.call_sync(loop.install)
    arena = driver.fs.arena
    try:
        h = TrioHandler(Operations(driver.afs), driver.token, loop, keep_free=10)
        h.session = SimpleNamespace(payload_size=4 * MiB, negotiated=SimpleNamespace(max_write=4 * MiB))
        bufs = h.write_buffer(0)
        assert [b.nbytes for b in bufs] == [MiB] * 4 and arena.lent_slots == 5
        assert all(map(arena.owns, bufs))  # views of the arena
        again = h.write_buffer(0)  # nothing adopted: the same run
        assert all(b is c for b, c in zip(bufs, again)) and arena.lent_slots == 5

        h.shift = 333
        shifted = h.write_buffer(0)  # K + 1 positions, every one a slot lent already
        assert [b.nbytes for b in shifted] == [MiB - 333, MiB, MiB, MiB, MiB]
        assert all(map(arena.owns, shifted)) and h._local.shift == 333 and arena.lent_slots == 5

        other = []  # a second worker: 11 free, lent down to keep_free, the rest its own memory
        t = threading.Thread(target=lambda: other.extend(h.write_buffer(1)))
        t.start()
        t.join()
        assert [b.nbytes for b in other] == [MiB - 333, MiB, MiB, MiB, MiB] and arena.lent_slots == 6
        assert [arena.owns(b) for b in other] == [True, False, False, False, False]
        with loop:
            h.close()
        assert arena.lent_slots == 0 and arena.free_slots == arena.nslots
        assert request_chunks(16, 2, 16) == 2 and request_chunks(2048, 2, 16) == 16 and request_chunks(4, 4, 16) == 1
    finally:
        driver.call_sync(loop.uninstall)
        driver.kill()


def _write_req(offset: int, pieces) -> Write:
    size = sum(p.nbytes for p in pieces)
    return Write(Header(80 + size, 16, 7, 2, 0, 0, 1), 1, offset, size, 0, 0, 0, tuple(pieces))


def _scatter(bufs, payload: bytes) -> list:
    """The payload as a readv puts it over `bufs`: the views it fills, in order."""
    out, pos = [], 0
    for b in bufs:
        if pos == len(payload):
            break
        n = min(b.nbytes, len(payload) - pos)
        b[:n] = payload[pos:pos + n]
        out.append(b[:n])
        pos += n
    return out


def test_a_payload_read_at_the_wrong_shift_is_moved_onto_the_grid_before_it_is_served():
    """_realign without a kernel: a WRITE 333 bytes past a boundary read into an unshifted run
    comes out as a shifted run's pieces (first MiB - 333 bytes into slot 0 at 333, whole chunks,
    the 333-byte tail), same bytes; one read shifted by 333 but starting on the grid moves down;
    nothing moves where the guess was right, where no piece would adopt its slot, or where the
    payload lies in the worker's own memory."""
    import random

    from inproc import Driver, make_devices
    from ckptfs.fuse.native_ops import Operations

    MiB = 1 << 20
    driver = Driver(make_devices(1, 64 * MiB), memory=16 * MiB, chunk_size=MiB, fmt=True)
    loop = driver.store.loop
    driver.call_sync(loop.install)
    arena = driver.fs.arena
    rng = random.Random(3)
    try:
        h = TrioHandler(Operations(driver.afs), driver.token, loop, keep_free=10)
        h.session = SimpleNamespace(payload_size=4 * MiB, negotiated=SimpleNamespace(max_write=4 * MiB))
        payload = rng.randbytes(4 * MiB)
        req = _write_req(5 * MiB + 333, _scatter(h.write_buffer(0), payload))
        run = h._local.reading
        assert h._realign(req, run, 333) is None  # the guess was right
        moved, r = h._realign(req, run, 0)
        assert r == 333 and b"".join(moved.pieces) == payload
        assert [p.nbytes for p in moved.pieces] == [MiB - 333, MiB, MiB, MiB, 333]
        assert bytes(arena.view(run[0])[333:MiB]) == payload[:MiB - 333] and all(map(arena.owns, moved.pieces))

        h.shift = 333
        req = _write_req(8 * MiB, _scatter(h.write_buffer(0), payload))
        moved, r = h._realign(req, h._local.reading, 333)
        assert r == 0 and [p.nbytes for p in moved.pieces] == [MiB] * 4 and b"".join(moved.pieces) == payload

        small = _write_req(MiB + 333, _scatter(h.write_buffer(0), payload[:4000]))
        assert h._realign(small, h._local.reading, 333 + 1) is None  # no piece of it would adopt
        own = memoryview(bytearray(5 * MiB))
        req = _write_req(333, _scatter([own[:MiB], own[MiB:2 * MiB], own[2 * MiB:3 * MiB], own[3 * MiB:4 * MiB]],
                                       payload))
        assert h._realign(req, h._local.reading, 0) is None  # not the arena's memory
        with loop:
            h.close()
        assert arena.lent_slots == 0
    finally:
        driver.call_sync(loop.uninstall)
        driver.kill()
