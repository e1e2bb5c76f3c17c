"""The native engine under concurrent load, with the store's invariants checked at the end.

ckptfs runs in this process (tests/inproc.py's Driver: the daemon's own
wiring over in-memory fault-free devices) and is mounted through the native
engine with 4 worker threads serving requests under the trio thread's loop
lock. At once: 8 writer processes (whole-chunk, unaligned and tiny writes,
fsync now and then, each version published by rename over the last), reader
threads reading whatever is there, and churn threads doing chmod, utime,
stat, xattrs, rename, unlink, mkdir and rmdir. The memory budget is small,
so writes wait for the drain and reads fetch evicted chunks too.

Then, with everything quiet: `Store.check_invariants()` and the namespace's
on the trio thread (every arena slot free, lent or held by one chunk; byte
accounting), every writer's final files compared by hash through the mount,
and again after an orderly unmount and a remount of the same devices.
"""
import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time

import pytest

from ckptfs.fuse.native import NativeEngine
from inproc import Driver, PathOps, make_devices
from waiting import poll

pytestmark = pytest.mark.mount

WRITERS = 8
SECONDS = 6.0
MiB = 1 << 20

WRITER = r"""
import hashlib, json, os, random, sys, time
root, wid, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
rng = random.Random(wid)
final = {}
end = time.monotonic() + seconds
k = 0
while time.monotonic() < end or k < 3:
    name = f"w{wid}-{k % 3}"
    size = rng.choice([MiB, 2 * MiB, 3 * MiB + 12345, 777, 0, 5 * MiB - 1, 13 * MiB + 777])
    data = rng.randbytes(size)
    tmp = os.path.join(root, f".{name}.tmp{k}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    off = 0
    while off < size:
        n = rng.choice([MiB, MiB, 4096, 100000, 2 * MiB + 1, 11 * MiB + 5])  # the last: shifted runs
        piece = memoryview(data)[off:off + n]
        assert os.write(fd, piece) == len(piece)
        off += len(piece)
    if rng.random() < 0.2:
        os.fsync(fd)
    os.close(fd)
    os.rename(tmp, os.path.join(root, name))
    final[name] = hashlib.sha256(data).hexdigest()
    k += 1
print(json.dumps(final))
""".replace("MiB", str(MiB))


def _readers(root: str, stop: threading.Event, errors: list) -> None:
    rng = random.Random(1)
    while not stop.is_set():
        try:
            names = [n for n in os.listdir(root) if n.startswith("w")]
            if names:
                with open(os.path.join(root, rng.choice(names)), "rb") as f:
                    while f.read(3 * MiB + 7):
                        pass
        except FileNotFoundError:
            pass
        except OSError as e:
            errors.append(f"reader: {e!r}")


def _churn(root: str, tid: int, stop: threading.Event, errors: list) -> None:
    rng = random.Random(100 + tid)
    d = os.path.join(root, f"churn{tid}")
    os.mkdir(d)
    i = 0
    while not stop.is_set():
        try:
            p = os.path.join(d, f"f{i % 5}")
            with open(p, "wb") as f:
                f.write(rng.randbytes(rng.choice([10, 70000, MiB])))
            os.chmod(p, 0o600 + (i & 0o44))
            os.utime(p, (i, i))
            os.stat(p)
            os.setxattr(p, b"user.k", str(i).encode())
            assert os.getxattr(p, b"user.k") == str(i).encode()
            os.rename(p, p + ".r")
            if i % 3 == 0:
                os.unlink(p + ".r")
            sub = os.path.join(d, f"sub{i % 2}")
            try:
                os.mkdir(sub)
            except FileExistsError:
                os.rmdir(sub)
            os.listdir(d)
        except OSError as e:
            errors.append(f"churn {tid}: {e!r}")
        i += 1


def _tree_hashes(ops: PathOps) -> dict[str, str]:
    return {path.lstrip("/"): hashlib.sha256(data).hexdigest()
            for path, data in ops.tree().items() if data is not None and path.lstrip("/").startswith("w")}


def test_many_writers_readers_and_churn_keep_every_invariant(tmp_path):
    devices = make_devices(2, 256 * MiB)
    driver = Driver(devices, memory=48 * MiB, chunk_size=MiB, fmt=True, queue_depth=4, journal_half=2 * MiB)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    loop = driver.store.loop
    driver.call_sync(loop.install)
    engine = NativeEngine(driver.afs, str(mnt), driver.token, threads=4, loop=loop)
    engine.start()
    errors: list[str] = []
    stop = threading.Event()
    try:
        procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(mnt), str(w), str(SECONDS)],
                                  stdout=subprocess.PIPE, text=True) for w in range(WRITERS)]
        threads = [threading.Thread(target=_readers, args=(str(mnt), stop, errors)) for _ in range(2)]
        threads += [threading.Thread(target=_churn, args=(str(mnt), t, stop, errors)) for t in range(2)]
        for t in threads:
            t.start()
        expected: dict[str, str] = {}
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, f"writer failed ({p.returncode})"
            expected.update(json.loads(out))
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors[:5]
        for name, digest in expected.items():
            assert hashlib.sha256((mnt / name).read_bytes()).hexdigest() == digest, name
        stats = engine.statistics()
        assert stats.adopted > 0 and stats.copied > 0  # both paths ran
        if os.geteuid() == 0:  # requests of 3 chunks (48 slots for 4 workers), read into 3 lent slots
            assert stats.max_write == 3 * MiB
    finally:
        stop.set()
        engine.session.unmount()
        engine.wait()  # gives the lent slots back
        engine.close()
    driver.call_sync(loop.uninstall)
    driver.call_sync(_check_invariants, driver)
    assert _tree_hashes(PathOps(driver)) == expected
    driver.unmount()
    again = Driver(devices, memory=48 * MiB, chunk_size=MiB, journal_half=2 * MiB)
    try:
        assert _tree_hashes(PathOps(again)) == expected
        again.call_sync(_check_invariants, again)
    finally:
        again.kill()


def _check_invariants(driver: Driver) -> None:
    driver.fs.ns.check_invariants()
    driver.store.check_invariants()
    arena = driver.fs.arena
    assert arena.lent_slots == 0


def test_loop_lock_serializes_threads_with_the_trio_thread(tmp_path):
    """A thread holding the loop lock stops the trio thread between two checkpoints; wake-ups it
    asks for run on the trio thread; the store's invariants hold after threads write through the
    facade's nowait calls while the drain runs."""
    devices = make_devices(2, 64 * MiB)
    driver = Driver(devices, memory=8 * MiB, chunk_size=MiB, fmt=True)
    loop = driver.store.loop
    driver.call_sync(loop.install)
    try:
        ticks = [0]

        async def ticker():
            import trio
            while True:
                ticks[0] += 1
                await trio.sleep(0)
        driver.call_sync(lambda: driver.nursery.start_soon(ticker))
        time.sleep(0.05)
        trio_thread = driver.call_sync(threading.get_ident)
        with loop:  # taken although the trio thread is busy (never idle): it lets us go first
            before = ticks[0]
            time.sleep(0.05)
            assert ticks[0] == before  # the trio thread waits for the lock
            ran = []
            for _ in range(3):
                loop.soon(lambda: ran.append(threading.get_ident()))
            assert not ran
        poll(lambda: len(ran) >= 3, None, timeout=5, every=0.01)
        assert ran == [trio_thread] * 3

        afs = driver.afs
        fh_of = {}
        with loop:
            for t in range(4):
                r, _ = afs.create_nowait(1, f"t{t}".encode(), 0o644, os.O_WRONLY, 0, 0)
                fh_of[t] = r.fh
        datas = {t: random.Random(t).randbytes(5 * MiB + 333) for t in range(4)}

        def writer(t: int) -> None:
            view = memoryview(datas[t])
            off = 0
            while off < len(view):
                piece = view[off:off + 300000]
                try:
                    with loop:
                        n = afs.write_nowait(fh_of[t], off, piece)
                except Exception:  # noqa: BLE001 - must wait: the trio thread's path, outside the lock
                    n = driver.call(afs.write, fh_of[t], off, piece)
                off += n
        threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        with loop:
            for fh in fh_of.values():
                afs.release_nowait(fh)
        driver.call(driver.store.drain_all)
        driver.call_sync(_check_invariants, driver)
        ops = PathOps(driver)
        for t in range(4):
            assert ops.read_file(f"/t{t}") == datas[t]
    finally:
        driver.call_sync(loop.uninstall)
        driver.kill()


def _mount_native(driver: Driver, mnt, threads: int = 2, request_bytes: int = 4 * MiB) -> NativeEngine:
    """A native mount of `driver`'s filesystem; requests of 4 chunks at most, as these tests expect."""
    driver.call_sync(driver.store.loop.install)
    engine = NativeEngine(driver.afs, str(mnt), driver.token, threads=threads, loop=driver.store.loop,
                          request_bytes=request_bytes)
    engine.start()
    return engine


def _unmount_native(driver: Driver, engine: NativeEngine):
    stats = engine.statistics()
    engine.session.unmount()
    engine.wait()  # gives the lent slots back
    engine.close()
    driver.call_sync(driver.store.loop.uninstall)
    return stats


def _multichunk_writes(path, model: bytearray, rng: random.Random) -> None:
    """Writes of several chunks: page-aligned and unaligned buffers, on and off the chunk grid,
    overwriting earlier ones in part, extending, leaving a hole; `model` gets the same bytes."""
    import mmap

    def put(fd, off, data) -> None:
        if os.pwrite(fd, data, off) != len(data):
            raise OSError(f"short write at {off}")
        end = off + len(data)
        if end > len(model):
            model.extend(bytes(end - len(model)))
        model[off:end] = data

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        aligned = mmap.mmap(-1, 8 * MiB)  # page-aligned: 4 MiB requests need no spare page
        for i in range(4):  # 0..32 MiB in 8 MiB writes: requests of whole chunks, adopted
            aligned[:] = rng.randbytes(8 * MiB)
            put(fd, i * 8 * MiB, aligned)
        put(fd, 32 * MiB, rng.randbytes(4 * MiB))  # an unaligned bytes buffer: whole chunks with the spare page
        for off, size in [(12345, 4 * MiB + 7), (3 * MiB - 1, 2), (5 * MiB, 3 * MiB + 4095),
                          (17 * MiB + 4096, 6 * MiB), (MiB, MiB), (40 * MiB + 100, 9 * MiB)]:
            put(fd, off, rng.randbytes(size))  # off the grid, across chunks, over adopted chunks
        for _ in range(20):
            off = rng.randrange(0, 50 * MiB)
            put(fd, off, rng.randbytes(rng.choice([1, 4096, MiB - 1, MiB + 1, 4 * MiB, 5 * MiB + 3])))
        put(fd, 64 * MiB, rng.randbytes(4 * MiB))  # after a hole
        put(fd, 70 * MiB + 333, rng.randbytes(40 * MiB))  # one write off the grid: later requests shifted
    finally:
        os.close(fd)


def _read_back(path, size: int) -> bytes:
    """The file read with READs of several chunks off the grid (4 MiB + 5 at odd offsets)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        out = bytearray(os.pread(fd, 333, 0))
        while len(out) < size:
            piece = os.pread(fd, 4 * MiB + 5, len(out))
            if not piece:
                break
            out += piece
        return bytes(out)
    finally:
        os.close(fd)


def test_multichunk_writes_byte_for_byte_after_remount(tmp_path):
    """Requests of 4 chunks scattered over 4 lent slots: every byte where it belongs, through the
    mount and after a remount (READs of several chunks fetched from the devices), the store's
    invariants intact, aligned writes adopted."""
    devices = make_devices(2, 256 * MiB)
    driver = Driver(devices, memory=64 * MiB, chunk_size=MiB, fmt=True, queue_depth=4, journal_half=2 * MiB)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    model = bytearray()
    engine = _mount_native(driver, mnt)
    try:
        _multichunk_writes(mnt / "f", model, random.Random(7))
        assert _read_back(mnt / "f", len(model)) == model
    finally:
        stats = _unmount_native(driver, engine)
    if os.geteuid() == 0:
        assert stats.max_write == 4 * MiB  # 64 slots for 2 workers: 4 chunks a request
        assert stats.adopted >= 36  # the first 36 MiB: aligned 8 MiB writes, then a 4 MiB bytes
        assert stats.shifted > 0  # the 40 MiB write 333 bytes off the grid
        assert stats.shifted_adopted > 0  # ... its requests' first pieces too, each chunk's head copied in
        assert stats.realigned > 0  # writes off the grid read at another shift, moved onto it first
    assert stats.copied > 0
    driver.call_sync(_check_invariants, driver)
    driver.unmount()

    def cold() -> None:
        assert (mnt / "f").stat().st_size == len(model)
        assert _read_back(mnt / "f", len(model)) == model  # cold: fetched in READs of 4 MiB + 5
    _after_remount(devices, 64 * MiB, mnt, cold)


def _after_remount(devices, memory: int, mnt, check) -> None:
    """Mount `devices` again (native engine, not formatted) at `mnt`, run `check()` through it,
    unmount; the store's invariants intact."""
    again = Driver(devices, memory=memory, chunk_size=MiB, journal_half=2 * MiB)
    try:
        engine = _mount_native(again, mnt)
        try:
            check()
        finally:
            _unmount_native(again, engine)
        again.call_sync(_check_invariants, again)
    finally:
        again.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="requests of 4 chunks need the max_pages sysctl raised (root)")
def test_a_sequential_writers_next_write_is_read_shifted_from_its_first_request(tmp_path):
    """A writer's next write() starts where its last ended (torch.save: a zip member's header and
    data, then the next), so the end of every WRITE, a write()'s short last request included,
    predicts the shift of the next read: every full request of each off-grid write() adopts its
    first piece, not only those after the write()'s first (one worker: reads follow serves)."""
    devices = make_devices(2, 256 * MiB)
    driver = Driver(devices, memory=64 * MiB, chunk_size=MiB, fmt=True, queue_depth=4, journal_half=2 * MiB)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    rng = random.Random(11)
    data = [rng.randbytes(333)] + [rng.randbytes(8 * MiB + 100 + i) for i in range(3)]
    engine = _mount_native(driver, mnt, threads=1)
    try:
        with open(mnt / "f", "wb", buffering=0) as f:
            for piece in data:
                assert f.write(piece) == len(piece)  # each write() r bytes past a boundary, r new each time
        assert (mnt / "f").read_bytes() == b"".join(data)
    finally:
        stats = _unmount_native(driver, engine)
    assert stats.max_write == 4 * MiB
    assert stats.shifted_adopted == 6  # 2 full requests per 8 MiB write(), the first ones included
    driver.call_sync(_check_invariants, driver)
    driver.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="requests of 4 chunks need the max_pages sysctl raised (root)")
def test_writes_that_interleave_at_other_shifts_are_moved_onto_the_grid(tmp_path):
    """Two files written in turn, each write() r bytes past a chunk boundary with an r of its own
    (two ranks saving at once): the first request of each write() is read at the other file's
    shift, and its worker moves the payload onto the grid before serving it, so its first piece
    and whole chunks are adopted instead of copied; every byte where it belongs, through the
    mount and after a remount (one worker: reads follow serves)."""
    devices = make_devices(2, 256 * MiB)
    driver = Driver(devices, memory=96 * MiB, chunk_size=MiB, fmt=True, queue_depth=4, journal_half=2 * MiB)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    rng = random.Random(13)
    files = {name: [rng.randbytes(head)] + [rng.randbytes(8 * MiB + 100 + i) for i in range(3)]
             for name, head in (("a", 333), ("b", 777))}
    engine = _mount_native(driver, mnt, threads=1)
    try:
        fds = {name: os.open(mnt / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for name in files}
        try:
            for i in range(4):
                for name, parts in files.items():
                    assert os.write(fds[name], parts[i]) == len(parts[i])  # the other file's shift read last
        finally:
            for fd in fds.values():
                os.close(fd)
        for name, parts in files.items():
            assert (mnt / name).read_bytes() == b"".join(parts)
    finally:
        stats = _unmount_native(driver, engine)
    assert stats.max_write == 4 * MiB
    assert stats.realigned == 6  # the first request of each 8 MiB write()
    assert stats.shifted_adopted == 12  # every full request's first piece (6 without the move)
    driver.call_sync(_check_invariants, driver)
    driver.unmount()

    def cold() -> None:
        for name, parts in files.items():
            assert (mnt / name).read_bytes() == b"".join(parts)  # from the devices
    _after_remount(devices, 96 * MiB, mnt, cold)
