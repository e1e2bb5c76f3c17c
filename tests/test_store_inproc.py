"""The durable store in-process on fault-injecting devices: recovery, crashes, errors."""
import os
import random
import threading
import time

import pytest

from faulty import crash_all, image_all
from inproc import Driver, PathOps, make_devices
from waiting import poll


def fresh(n=2, dev_size=8 << 20, **kw):
    devs = make_devices(n, dev_size)
    d = Driver(devs, fmt=True, **kw)
    return devs, d, PathOps(d)


def hold_writes(devs) -> threading.Event:
    """Device writes wait until the returned event is set: a drain stays in flight meanwhile."""
    hold = threading.Event()
    for dev in devs:
        dev.pwrite = (lambda write: lambda buf, off: (hold.wait(30), write(buf, off)))(dev.pwrite)
    return hold


def wait_for_drain(d, started) -> None:
    """Poll `started()` in the trio thread until it holds (10 s at most)."""
    poll(lambda: d.call_sync(started), "the drain to start", timeout=10, every=0.005)


def test_unmount_then_remount_keeps_everything():
    devs, d, p = fresh()
    data = random.randbytes(300_000)
    p.mkdir("/a")
    p.write_file("/a/x", data)
    p.write_file("/y", b"hello")
    d.unmount()
    d2 = Driver(image_all(devs))
    assert PathOps(d2).tree() == {"/a": None, "/a/x": data, "/y": b"hello"}
    d2.kill()


def test_fsynced_file_survives_a_power_cut():
    devs, d, p = fresh()
    data = random.randbytes(200_000)
    p.write_file("/f", data, fsync=True)
    d.kill()
    rng = random.Random(1)
    d2 = Driver(crash_all(devs, rng))
    assert PathOps(d2).read_file("/f") == data
    d2.kill()


def test_data_larger_than_memory_round_trips_through_eviction():
    devs, d, p = fresh(memory=256 << 10)  # 4 chunks of 64 KiB
    data = random.randbytes(2_000_000)
    p.write_file("/big", data)
    assert p.read_file("/big") == data
    d.unmount()
    d2 = Driver(image_all(devs), memory=256 << 10)
    assert PathOps(d2).read_file("/big") == data
    d2.kill()


def test_write_error_makes_fsync_fail_and_keeps_serving():
    devs, d, p = fresh()
    p.write_file("/ok", b"durable", fsync=True)
    for x in devs:
        x.fail_writes_at(0, x.size)
    import pyfuse3
    with pytest.raises(pyfuse3.FUSEError) as e:
        p.write_file("/bad", random.randbytes(100_000), fsync=True)
    assert e.value.errno == 5
    assert p.read_file("/ok") == b"durable"
    d.kill()


def test_stale_data_is_not_drained():
    """Saving every step to the same path must not queue stale copies (promise 7)."""
    devs, d, p = fresh(memory=8 << 20, queue_depth=2, dev_size=32 << 20)
    for x in devs:
        x.write_delay = 0.05  # devices far slower than the saves
    size = 40 * 65536 - 1000  # 40 chunks of 64 KiB
    versions = [random.randbytes(size) for _ in range(12)]
    for i, v in enumerate(versions):
        if i % 2:
            p.write_file("/ckpt", v, piece=1 << 16)  # overwrite in place (O_TRUNC)
        else:
            p.write_file("/ckpt.tmp", v, piece=1 << 16)
            p.rename("/ckpt.tmp", "/ckpt")
    d.unmount()
    store = d.store
    saved = size * len(versions)
    # what may be drained: the last version, plus what was in flight (queue depth x devices
    # chunks at a time) while each earlier version was being written
    st = store.statistics()
    assert st.bytes_drained < saved / 3, (st.bytes_drained, saved)
    assert st.bytes_skipped > 0 and st.records_voided > 0
    d2 = Driver(image_all(devs), memory=4 << 20)
    assert PathOps(d2).read_file("/ckpt") == versions[-1]
    d2.kill()


def test_max_lag_commits_a_path_rewritten_faster_than_it_drains():
    """Superseding skips stale versions but never starves the path: a file rewritten in place
    faster than one version drains still reaches the journal within max_lag + drain time."""
    devs, d, p = fresh(memory=8 << 20, queue_depth=2, dev_size=32 << 20, max_lag=0.3)
    for x in devs:
        x.write_delay = 0.02  # one version (40 chunks) takes ~0.2 s to drain; saves come faster
    size = 40 * 65536 - 1000
    versions = [random.randbytes(size) for _ in range(4)]
    t_end = time.monotonic() + 3.0
    written = 0
    worst = 0.0
    while time.monotonic() < t_end:
        p.write_file("/last.ckpt", versions[written % 4], piece=1 << 16)
        written += 1
        worst = max(worst, d.call_sync(d.store.lag))
    assert written > 20
    assert worst < 0.3 + 2.0, f"a commit waited {worst:.2f}s"
    st = d.call_sync(d.store.statistics)
    assert d.store.log.committed > 0 and st.records_voided > 0  # some versions skipped, not all
    d.kill()  # a crash: whatever reached the journal is what survives
    d2 = Driver(image_all(devs), memory=4 << 20)
    assert PathOps(d2).read_file("/last.ckpt") in versions  # without the bound: absent
    d2.kill()


def test_unmount_marks_the_journal_clean_and_a_kill_does_not():
    devs, d, p = fresh()
    p.write_file("/a", b"x" * 1000, fsync=True)
    d.unmount()
    devs2 = image_all(devs)
    d2 = Driver(devs2)
    assert d2.store.recovery["clean"]
    PathOps(d2).write_file("/b", b"y" * 1000, fsync=True)
    d2.kill()
    d3 = Driver(image_all(devs2))
    rec = d3.store.recovery
    assert not rec["clean"] and rec["time_ns"] and rec["discarded"] == []
    assert PathOps(d3).read_file("/b") == b"y" * 1000
    d3.kill()


def test_counters_add_up_after_random_workloads():
    """absorbed = drained + skipped + in memory, at any moment, whatever was overwritten, truncated,
    deleted or drained twice (Store.statistics())."""
    rng = random.Random(5)
    devs, d, p = fresh(memory=2 << 20, dev_size=32 << 20)
    for x in devs:
        x.write_delay = 0.002

    def check():
        st = d.call_sync(d.store.statistics)
        assert st.bytes_absorbed == st.bytes_drained + st.bytes_skipped + st.bytes_in_memory, st
        return st

    names = [f"/f{i}" for i in range(4)]
    for step in range(60):
        op = rng.choice(["write", "write", "rewrite", "unlink", "rename", "sync"])
        name = rng.choice(names)
        if op in ("write", "rewrite"):
            size = rng.choice([1, 5000, 65536, 200_000])
            p.write_file(name, rng.randbytes(size), piece=rng.choice([4096, 65536, 100_000]))
        elif op == "unlink":
            try:
                p.unlink(name)
            except Exception:  # noqa: BLE001 - not there
                pass
        elif op == "rename":
            try:
                p.rename(name, rng.choice(names))
            except Exception:  # noqa: BLE001
                pass
        else:
            d.call(d.store.sync, None)
        check()
    d.call(d.store.drain_all)
    st = check()
    assert st.bytes_in_memory == 0 and st.files == {}, st  # everything durable: nothing left in memory
    assert st.bytes_absorbed > 0 and st.bytes_drained > 0 and st.bytes_skipped > 0
    d.kill()



def test_read_ahead_loads_runs_of_units_with_one_read_each_and_verifies_every_chunk():
    """A sequential reader of an evicted file gets its read-ahead in runs (one preadv per run of
    consecutive units, drain.FETCH_RUN chunks at most), every chunk checked: a corrupted one in a
    run is EIO for the read that needs it, its neighbours read fine."""
    import os
    import pyfuse3
    from inproc import CTX
    cs = 65536
    devs, d, p = fresh(memory=4 << 20, dev_size=16 << 20)
    data = random.randbytes(40 * cs)  # 40 chunks, 20 per device
    p.write_file("/big", data, piece=cs)
    d.unmount()
    devs = image_all(devs)
    d2 = Driver(devs, memory=4 << 20)
    assert PathOps(d2).read_file("/big") == data
    reads = sum(x.reads for x in d2.store.stats)
    assert reads < 40 * 0.6, f"{reads} device reads for 40 chunks: read-ahead did not batch"
    ext = d2.store.ns.inodes[PathOps(d2).ino("/big")].data.chunks[20].extent
    offset = d2.store.sbs[ext.dev].unit_offset(ext.unit)
    d2.kill()

    bad = image_all(devs)
    blk = offset // 4096
    bad[ext.dev].durable[blk] = bytes(b ^ 0xFF for b in bad[ext.dev].durable[blk])
    d3 = Driver(bad, memory=4 << 20)
    p3 = PathOps(d3)
    fh = p3._call("open", p3.ino("/big"), os.O_RDONLY, CTX).fh
    for idx in range(40):
        if idx == 20:
            with pytest.raises(pyfuse3.FUSEError) as e:
                p3._call("read", fh, idx * cs, cs)
            assert e.value.errno == 5
        else:
            assert bytes(p3._call("read", fh, idx * cs, cs)) == data[idx * cs:(idx + 1) * cs]
    p3._call("release", fh)
    d3.kill()


def test_read_ahead_of_a_file_sharing_every_other_chunk_takes_one_thread_job_per_batch(monkeypatch):
    """With --dedupe on, a file that shares every other chunk with an earlier one lies in runs of
    one unit; its read-ahead still takes one worker-thread job per `fetch_run` chunks (a preadv
    per run inside), not one per run (38 before batching), and reads back whole after a remount."""
    from ckptfs.store import drain
    cs = 65536
    devs, d, p = fresh(n=1, memory=4 << 20, dev_size=16 << 20, dedupe=True)
    first = random.randbytes(40 * cs)
    second = b"".join(first[i * cs:(i + 1) * cs] if i % 2 else random.randbytes(cs) for i in range(40))
    p.write_file("/first", first, piece=cs)
    d.call(d.store.drain_all)
    p.write_file("/second", second, piece=cs)
    d.call(d.store.drain_all)
    assert d.store.dedupe.statistics().chunks_shared == 20
    d.unmount()
    hops, runs = [], []  # worker-thread jobs of batches (their runs each); runs read
    one, many = drain._read_run_and_checksum, drain._read_runs_and_checksum

    def read_run(dev, *args):
        runs.append(1)
        return one(dev, *args)

    def read_runs(dev, batch):
        hops.append(len(batch))
        return many(dev, batch)  # (its runs through read_run)

    monkeypatch.setattr(drain, "_read_run_and_checksum", read_run)
    monkeypatch.setattr(drain, "_read_runs_and_checksum", read_runs)
    d2 = Driver(image_all(devs), memory=4 << 20, dedupe=True)
    assert PathOps(d2).read_file("/second") == second
    alone = len(runs) - sum(hops)  # jobs of one run: a reader's miss, a long run
    assert len(runs) >= 30 and len(hops) + alone <= 16, (hops, alone)
    d2.kill()


def test_the_read_ahead_window_grows_with_the_devices_up_to_a_quarter_of_the_arena():
    """READAHEAD_BYTES per device, so one reader keeps every device fetching; never more than a
    quarter of the arena's slots."""
    from types import SimpleNamespace

    from ckptfs.store.drain import READAHEAD_BYTES, Drainer

    cs = 1 << 20

    def window(devices: int, slots: int) -> int:
        host = SimpleNamespace(devices=[None] * devices, chunk_size=cs, arena=SimpleNamespace(nslots=slots))
        return Drainer(host, queue_depth=2).readahead

    per_device = READAHEAD_BYTES // cs
    assert window(1, 1 << 16) == per_device
    assert window(2, 1 << 16) == 2 * per_device
    assert window(8, 1 << 16) == 8 * per_device
    assert window(8, 256) == 64  # a 256 MiB arena: a quarter of it
    assert window(2, 4) == 2  # the least, whatever the arena


def test_reads_before_the_trio_thread_runs_ask_for_read_ahead_once():
    """Reads in FUSE workers call `read_ahead` before the trio thread starts any load: they ask
    it once, for the furthest window reached, and the chunks it starts count as fetching at
    once, so later reads neither ask for them again nor load them twice."""
    from types import SimpleNamespace

    from ckptfs.format.records import Extent
    from ckptfs.fs.filemap import Chunk
    from ckptfs.store.drain import Drainer

    cs = 1 << 20
    queued, started = [], []

    def soon(fn, *args):  # as LoopLock.soon from another thread: an argument-less call is queued once
        if args or (fn, ()) not in queued:
            queued.append((fn, args))

    host = SimpleNamespace(
        devices=[None, None], chunk_size=cs, arena=SimpleNamespace(nslots=4096, free_slots=4096),
        alloc=SimpleNamespace(per_unit=1), evictable=lambda: 0,
        loop=SimpleNamespace(soon=soon))
    drainer = Drainer(host, queue_depth=2)
    drainer.nursery = SimpleNamespace(start_soon=lambda fn, batch, events: started.append(batch))
    data = SimpleNamespace(chunks={})
    for idx in range(600):  # on the devices only, striped, consecutive units on each
        data.chunks[idx] = c = Chunk(None, 7, idx)
        c.extent = Extent(idx % 2, idx // 2, cs, 0)
    for idx in range(40):  # the reads of 40 chunks, before the trio thread runs
        drainer.read_ahead(data, idx)
    assert len(queued) == 1  # one call queued for the trio thread
    fn, args = queued.pop()
    fn(*args)
    loaded = [c.idx for batch in started for c in batch]
    assert sorted(loaded) == list(range(40, 40 + drainer.readahead))  # the furthest window, each chunk once
    assert all(id(data.chunks[i]) in drainer.fetching for i in loaded)
    for idx in range(40, 60):  # reads inside that window: nothing more to ask
        drainer.read_ahead(data, idx)
    assert not queued


@pytest.mark.parametrize("closed", [False, True], ids=["draining", "draining-and-committed"])
def test_a_shifted_first_piece_adopted_over_a_chunk_being_drained(closed):
    """The native engine's shifted run adopts the rest of a chunk (FileData.adopt, `at`) whose
    drain is in flight (busy), and, `closed`, that a pending commit holds too (pins): the drain
    finishes with the old slot, the new chunk drains after it, the old bytes head the new chunk,
    every slot and absorbed byte is accounted for, and a remount reads the new contents."""
    import os
    from ckptfs.fs.namespace import ROOT_INO

    cs = 64 << 10
    r = 333
    devs, d, _ = fresh()
    afs, store = d.afs, d.store
    hold = hold_writes(devs)
    rng = random.Random(9)
    model = bytearray(rng.randbytes(2 * cs))
    fh = d.call_sync(lambda: afs.create_nowait(ROOT_INO, b"f", 0o644, os.O_RDWR, 0, 0, None)[0].fh)
    assert d.call_sync(afs.write_nowait, fh, 0, bytes(model)) == 2 * cs  # two full chunks: queued
    if closed:
        d.call_sync(afs.flush_nowait, fh)  # a commit captures them (pins)
    inode = d.call_sync(lambda: d.fs.handle(fh).inode)
    old = inode.data.chunks[0]
    wait_for_drain(d, lambda: old.busy)
    tail = rng.randbytes(cs - r)

    def adopt():
        slot = d.fs.arena.lend_nowait()
        view = d.fs.arena.view(slot)
        view[r:] = tail
        assert afs.writev_nowait(fh, r, [view[r:]], slots=[slot], shift=r) == cs - r
        new = inode.data.chunks[0]
        assert new is not old and new.slot == slot and not d.fs.arena.is_lent(slot)
        assert not old.live and old.slot is not None  # its slot stays the drain's until it returns
        # the old bytes move on with the new chunk, unless the commit still holds the old one
        assert (new.absorbed, old.absorbed) == ((cs - r, cs) if closed else (2 * cs - r, 0))
    d.call_sync(adopt)
    model[r:cs] = tail
    assert d.call_sync(lambda: bytes(afs.fs.read(fh, 0, 2 * cs))) == model
    hold.set()
    d.call_sync(afs.flush_nowait, fh)
    d.call_sync(afs.release_nowait, fh)
    d.call(store.drain_all)
    assert d.call_sync(lambda: old.slot) is None  # freed once its drain (and commit) let go
    d.call_sync(store.check_invariants)
    st = d.call_sync(store.statistics)
    assert st.bytes_absorbed == 3 * cs - r and st.bytes_in_memory == 0
    d.unmount()
    d2 = Driver(image_all(devs))
    assert PathOps(d2).read_file("/f") == model
    d2.kill()


def test_a_full_arena_of_clean_chunks_still_lends_receive_buffers():
    # after a synced save the arena is full of cached chunks already on the devices; a worker's
    # receive buffer must come from evicting one (least recently used), or every WRITE is copied
    devs, d, p = fresh(memory=512 << 10)  # 8 chunks of 64 KiB
    data = random.randbytes(8 * (64 << 10))
    p.write_file("/f", data, fsync=True)

    def lend():
        arena = d.fs.arena
        full = arena.free_slots
        slot = d.afs.lend_slot(2)
        got = (full, slot, arena.free_slots)
        if slot is not None:
            d.afs.unlend_slot(slot)
        arena.check_invariants()
        d.store.check_invariants()
        return got

    full, slot, after = d.call_sync(lend)
    assert full <= 2 and slot is not None and after == 2, (full, slot, after)
    assert p.read_file("/f") == data  # the evicted chunks come back from the devices
    d.unmount()


def test_a_file_closed_while_its_chunks_drain_writes_each_chunk_once():
    """Closing a file queues its chunks for the drain; those already being written (busy) must
    not be queued again: a second worker would write the same bytes into a second extent (twice
    the bandwidth, promise 7, and a unit taken that the space check cannot see)."""
    import os
    from ckptfs.fs.namespace import ROOT_INO
    from ckptfs.store.device import round_up

    cs = 64 << 10
    devs, d, _ = fresh()
    afs, store = d.afs, d.store
    hold = hold_writes(devs)
    data = random.randbytes(2 * cs + 5000)
    fh = d.call_sync(lambda: afs.create_nowait(ROOT_INO, b"f", 0o644, os.O_RDWR, 0, 0, None)[0].fh)
    assert d.call_sync(afs.write_nowait, fh, 0, data) == len(data)
    inode = d.call_sync(lambda: d.fs.handle(fh).inode)
    chunks = [inode.data.chunks[i] for i in range(3)]
    wait_for_drain(d, lambda: chunks[0].busy and chunks[1].busy)
    d.call_sync(afs.flush_nowait, fh)
    d.call_sync(afs.release_nowait, fh)  # queues the partial third chunk, not the two in flight
    hold.set()
    d.call(store.drain_all)
    d.call_sync(store.check_invariants)
    written = d.call_sync(lambda: sum(s.bytes_written for s in store.stats))
    assert written == 2 * cs + round_up(5000)
    d.unmount()
    d2 = Driver(image_all(devs))
    assert PathOps(d2).read_file("/f") == data
    d2.kill()


def test_the_space_check_counts_a_chunk_being_written_only_once_it_changes():
    """A chunk whose current bytes a drain is writing has its device space (the allocator counts
    it used): the space check leaves it out, or near full a write is refused with room left. If
    it changes meanwhile that copy is stale, its space comes back when the write ends, and the
    chunk needs space again: counted from the change on."""
    import os
    from ckptfs.fs.namespace import ROOT_INO

    cs = 64 << 10
    devs, d, _ = fresh()
    afs, store = d.afs, d.store
    hold = hold_writes(devs)
    data = bytearray(random.randbytes(2 * cs + 5000))
    fh = d.call_sync(lambda: afs.create_nowait(ROOT_INO, b"f", 0o644, os.O_RDWR, 0, 0, None)[0].fh)
    assert d.call_sync(afs.write_nowait, fh, 0, bytes(data)) == len(data)
    inode = d.call_sync(lambda: d.fs.handle(fh).inode)
    c0, c1, c2 = (inode.data.chunks[i] for i in range(3))
    wait_for_drain(d, lambda: c0.writing == c0.gen and c1.writing == c1.gen)

    def undrained():
        return {c.idx for c in store._undrained_chunks()}
    assert d.call_sync(undrained) == {2}  # the partial one waits; 0 and 1 have their space
    assert d.call_sync(afs.write_nowait, fh, 100, b"x" * 10) == 10
    data[100:110] = b"x" * 10
    assert d.call_sync(undrained) == {0, 2}
    d.call_sync(afs.flush_nowait, fh)
    d.call_sync(afs.release_nowait, fh)
    hold.set()
    d.call(store.drain_all)
    assert d.call_sync(undrained) == set()
    d.call_sync(store.check_invariants)
    d.unmount()
    d2 = Driver(image_all(devs))
    assert PathOps(d2).read_file("/f") == data
    d2.kill()


@pytest.mark.parametrize("seed", range(20))
def test_random_writes_near_full_never_leave_a_drain_without_room(seed):
    """The space check and the drain together (store/reserve.py, drain.py), on slow devices so
    chunks are often in flight: random writes, rewrites, truncates, closes and deletes of a few
    files held open on a small pool. A write gets ENOSPC when what it adds would not fit; what
    was acknowledged always drains (never a drain that finds no room), and a remount reads
    exactly what was acknowledged."""
    import errno as errno_
    import os
    import pyfuse3
    import trio
    from inproc import CTX, _SizeFields, _size_attr

    rng = random.Random(seed)
    cs = 64 << 10
    devs, d, p = fresh(dev_size=2 << 20, memory=2 << 20)
    for x in devs:
        x.write_delay = 0.002
    store = d.store
    errors = []
    retry = store.retry_later

    async def spy(error, *args, **kw):
        errors.append(error)
        await retry(error, *args, **kw)
    store.retry_later = spy
    model: dict[str, bytearray] = {}
    handles: dict[str, int] = {}
    refused = 0
    for step in range(250):
        op = rng.random()
        if op < 0.15 and len(handles) < 6:  # open a file for writing, a new one or an old one
            path = f"/f{rng.randrange(12)}"
            if path in handles:
                continue
            if path in model:
                handles[path] = p._call("open", p.ino(path), os.O_WRONLY, CTX).fh
            else:
                parent, name = p._parent(path)
                handles[path] = p._call("create", parent, name, 0o644, os.O_WRONLY | os.O_CREAT, CTX)[0].fh
                model[path] = bytearray()
        elif op < 0.65 and handles:  # write: small, a piece, or whole chunks
            path = rng.choice(sorted(handles))
            size = len(model[path])
            off = rng.choice([size, rng.randrange(size + 1), rng.randrange(0, size + cs, 4096)])
            data = rng.randbytes(rng.choice([rng.randrange(1, 5000), rng.randrange(1, cs), 3 * cs]))
            try:
                n = p._call("write", handles[path], off, data)
            except pyfuse3.FUSEError as e:
                assert e.errno == errno_.ENOSPC, e
                refused += 1
                continue
            f = model[path]
            if off > len(f):
                f.extend(bytes(off - len(f)))
            f[off:off + n] = data[:n]
        elif op < 0.72 and handles:  # truncate shorter
            path = rng.choice(sorted(handles))
            size = rng.randrange(len(model[path]) + 1)
            try:
                p._call("setattr", p.ino(path), _size_attr(size), _SizeFields(), handles[path], CTX)
            except pyfuse3.FUSEError as e:  # a chunk on a device cut into a smaller piece: room for it
                assert e.errno == errno_.ENOSPC, e
                refused += 1
                continue
            del model[path][size:]
        elif op < 0.9 and handles:  # close
            path = rng.choice(sorted(handles))
            fh = handles.pop(path)
            p._call("flush", fh)
            p._call("release", fh)
        elif model:  # delete a closed file
            closed = sorted(set(model) - set(handles))
            if closed:
                path = rng.choice(closed)
                p.unlink(path)
                del model[path]
    for fh in handles.values():
        p._call("flush", fh)
        p._call("release", fh)

    async def drain():
        with trio.fail_after(30):
            await store.drain_all()
            while store.drainer.in_flight:  # (stale copies still being written hold their slots)
                await trio.sleep(0.005)
    d.call(drain)
    d.call_sync(store.check_invariants)
    assert not errors, errors  # (a drain that found no room retries: it was let in wrongly)
    assert p.tree() == {k: bytes(v) for k, v in model.items()}
    d.unmount()
    d2 = Driver(image_all(devs), memory=2 << 20)
    assert PathOps(d2).tree() == {k: bytes(v) for k, v in model.items()}
    d2.kill()
    print("refused", refused, "of", step + 1)


def test_a_truncate_inside_a_chunk_on_the_devices_writes_nothing():
    """Cutting a drained chunk that still takes the same unit (or piece) keeps it where it is,
    as fewer bytes with their own checksum (Store.shorten): nothing is drained again and no
    new room is taken; the old copy stays intact until the truncate is committed, and a
    remount and fsck read the new length."""
    import os
    from ckptfs.store.pool import fsck
    from inproc import CTX, _SizeFields, _size_attr

    cs = 64 << 10
    devs, d, p = fresh()
    data = random.randbytes(3 * cs)
    p.write_file("/f", data)
    d.call(d.store.drain_all)
    before = d.call_sync(lambda: (sum(s.bytes_written for s in d.store.stats), d.store.alloc.used_units()))
    fh = p._call("open", p.ino("/f"), os.O_WRONLY, CTX)
    p._call("setattr", p.ino("/f"), _size_attr(2 * cs + 40000), _SizeFields(), fh.fh, CTX)  # 40000: a whole unit still
    p._call("release", fh.fh)
    d.call(d.store.drain_all)
    after = d.call_sync(lambda: (sum(s.bytes_written for s in d.store.stats), d.store.alloc.used_units()))
    assert after == before  # (the journal has its own area)
    d.call_sync(d.store.check_invariants)
    d.unmount()
    d2 = Driver(image_all(devs))
    assert PathOps(d2).read_file("/f") == data[:2 * cs + 40000]
    d2.unmount()
    assert fsck(image_all(devs)) == []


def test_a_read_of_more_chunks_than_memory_frees_waits_for_room_instead_of_fetching_in_circles():
    """A read needs two evicted chunks; memory has one slot to spare (the others are lent to the
    FUSE workers as receive buffers). Each chunk fetched stays in memory until the read is
    served: without that, fetching the second evicted the first, the retry fetched the first
    again, evicting the second, and so on, reading the devices without end (found as a native
    mount spinning at 70% CPU with a READ that never returned, tight-memory model test)."""
    from inproc import CTX
    cs = 64 << 10
    devs, d, p = fresh(memory=4 * cs)  # 4 slots
    data = random.randbytes(10 * cs)
    p.write_file("/big", data, fsync=True)  # on the devices; all but the last chunks evicted
    lent = [d.call_sync(d.afs.lend_slot, 0) for _ in range(3)]  # one clean chunk left in memory
    assert None not in lent and d.call_sync(lambda: d.store.arena.free_slots) == 0
    rfh = p._call("open", p.ino("/big"), os.O_RDONLY, CTX).fh

    def reads() -> int:
        return sum(s.reads for s in d.store.stats)
    before = d.call_sync(reads)
    out = {}
    reader = threading.Thread(target=lambda: out.update(got=bytes(p._call("read", rfh, 0, 2 * cs))))
    reader.start()
    try:
        time.sleep(0.1)
        d.call_sync(d.store.wake)  # something else moved (a commit, a release): waiters look again
        time.sleep(0.4)
        assert reader.is_alive(), "the read found room it should not have had"
        fetched = d.call_sync(reads) - before
        assert fetched <= 3, f"{fetched} chunk reads in 0.5 s for a read of two chunks"
    finally:
        for slot in lent:  # the workers give their buffers back: room comes, and the read is woken
            d.call_sync(d.afs.unlend_slot, slot)
        reader.join(30)
    assert out.get("got") == data[:2 * cs]
    p._call("release", rfh)
    d.kill()


def test_st_blocks_follow_a_drained_chunk_cut_in_place():
    """A truncate of a file already on the devices keeps a chunk whose shorter self still fits
    its piece on the device (Store.shorten): st_blocks comes down with it, and the count kept
    as chunks change agrees with one summed chunk by chunk."""
    from inproc import CTX, _SizeFields, _size_attr
    devs, d, p = fresh()
    p.write_file("/f", random.randbytes(120_000), fsync=True)  # chunk 1: 54,464 bytes, a whole unit
    ino = p.ino("/f")
    blocks = lambda: p._call("getattr", ino, CTX).st_blocks  # noqa: E731
    assert blocks() == -(-120_000 // 4096) * 8
    CUT = 100_000  # five blocks fewer, still more than half a unit: it stays on its unit
    cut = []
    shorten = d.store.shorten
    d.store.shorten = lambda chunk, hwm: cut.append(shorten(chunk, hwm)) or cut[-1]
    fh = p._call("open", ino, os.O_WRONLY, CTX).fh
    p._call("setattr", ino, _size_attr(CUT), _SizeFields(), fh, CTX)
    p._call("release", fh)
    assert cut == [True]  # kept on its extent, cut in place
    assert blocks() == -(-CUT // 4096) * 8
    data = d.fs.ns.inodes[ino].data
    assert d.call_sync(lambda: (data.allocated_bytes, data.count_held())) == (-(-CUT // 4096) * 4096,) * 2
    d.call_sync(d.fs.check_invariants)
    d.kill()


def test_a_devices_bandwidth_estimate_is_not_fooled_by_a_throttles_first_burst():
    """A throttled device (blkio here, a cloud volume's burst credits elsewhere) takes the first
    writes of a burst far above its rate: measured on a loop device held to 200 MiB/s, 8 MiB
    writes in 6-13 ms. Judged from single writes it looked faster than SLOW_DEVICE, the drain
    was held back during a save, and the device idled. The estimate moves only once per
    BANDWIDTH_WINDOW bytes, from their total time."""
    from ckptfs.store.drain import SLOW_DEVICE
    from ckptfs.store.store import BANDWIDTH_WINDOW, DeviceStats

    st = DeviceStats()
    mib8 = 8 << 20
    burst, steady = [0.0065, 0.008], [0.04] * 6  # 1.3 and 1.0 GB/s, then 210 MB/s (200 MiB/s)
    for seconds in burst:
        st.observe(mib8, seconds)
        assert st.bandwidth is None  # unknown yet: slow until shown otherwise
    for seconds in steady:
        st.observe(mib8, seconds)
    assert 8 * mib8 == BANDWIDTH_WINDOW
    assert st.bandwidth == pytest.approx(8 * mib8 / sum(burst + steady))
    assert st.bandwidth < SLOW_DEVICE
    for _ in range(8):  # a fast device is still seen as one
        st.observe(mib8, 0.002)
    assert st.bandwidth > 0.3 * mib8 / 0.002 > SLOW_DEVICE
