"""Device dedupe (`--dedupe on`, store/dedupe.py): a chunk the devices hold already is not written
again; its file shares the extent.

Pure parts first (the index, the drain's writes with a recording device), then real mounts: a
copy writes nothing and outlives its original across a remount and a kill -9, fsck is clean and
space comes back when the last file goes; a file changed after a copy leaves the copy as it was;
fine-tuning saves with torch write only what changed.
"""
from __future__ import annotations

import os
import random

import pytest

from ckptfs.format.records import Content, Extent, Make
from ckptfs.store.allocator import Allocator
from ckptfs.store.dedupe import ContentIndex, digest
from ckptfs.store.drain import _checksum_and_write_runs
from mounting import CkptMount, ckptfs

MiB = 1 << 20


# ---- pure -----------------------------------------------------------------------------------

def test_the_index_forgets_an_extent_when_its_last_reference_goes_and_adopt_then_refuses():
    alloc = Allocator([8, 8])
    index = ContentIndex(alloc, capacity=2)
    dev, unit = alloc.alloc(0, MiB)
    ext = Extent(dev, unit, 100, 7)
    d = digest(b"x" * 100)
    index.add(d, ext)
    assert index.find(d, 100) == ext and index.find(d, 99) is None
    assert index.adopt(ext, d, 100, 7) and alloc.refs(dev, unit) == 2
    assert not index.adopt(ext, d, 100, 8)  # another CRC: other bytes
    alloc.release(dev, unit)
    assert index.find(d, 100) == ext  # still referenced once
    alloc.release(dev, unit)
    assert index.find(d, 100) is None and not index.adopt(ext, d, 100, 7)
    assert alloc.refs(dev, unit) == 0
    for i in range(3):  # the newest `capacity` stay
        u = alloc.alloc(1, MiB)
        index.add(digest(bytes([i])), Extent(*u, 1, i))
    assert index.find(digest(b"\0"), 1) is None and index.find(digest(b"\2"), 1) is not None
    assert index.statistics().chunks_shared == 1


def test_the_durable_state_counts_every_naming_and_says_what_each_file_shares():
    """Two files naming one extent: two references, its length counted once as shared and in each
    file's `shared`; deleting one leaves the other's extent referenced, and nothing shared."""
    import stat as st
    from ckptfs.fs.namespace import ROOT_INO
    from ckptfs.store.durable import DurableState
    s = DurableState(Allocator([8, 8]))
    s.apply(("begin", 1, ROOT_INO + 1))
    s.apply(("attrs", ROOT_INO, st.S_IFDIR | 0o755, 0, 0, 0, 0, 0))
    s.apply(("snapend",))
    both, own = Extent(0, 3, 4096, 11), Extent(1, 2, 100, 12)
    for ino, name, exts in ((2, b"a", [(0, both)]), (3, b"b", [(0, both), (1, own)])):
        s.apply(("make", ROOT_INO, name, st.S_IFREG | 0o644, 0, 0, 0, b"", ino, 1))
        s.apply(("content", ino, 5000, 1, 1, exts))
    assert s.alloc.refs(0, 3) == 2 and s.shared_bytes == 4096 and (s.shared(2), s.shared(3)) == (4096, 4096)
    s.apply(("unlink", ROOT_INO, b"a", 2))
    assert s.alloc.refs(0, 3) == 1 and s.shared_bytes == 0 and s.shared(3) == 0
    s.apply(("content", 3, 100, 2, 2, [(1, own)]))
    assert s.alloc.refs(0, 3) == 0 and s.alloc.refs(1, 2) == 1 and len(s.names) == 1 and s.namings(own) == 1


def test_digests_follow_the_extents_named_and_a_snapshot_keeps_the_newest_that_fit():
    """A `digests` record keeps (extent, digest) for named extents (one for an extent nothing names
    is ignored: a later record of its frame freed it); an extent forgets its digest with its last
    naming; a snapshot round trip keeps them in order, and one given room for two keeps the newest two."""
    import stat as st
    from ckptfs.format.journal import DIGEST_ITEM, decode_records, encode_record
    from ckptfs.fs.namespace import ROOT_INO
    from ckptfs.store.durable import DurableState

    def fresh():
        s = DurableState(Allocator([8, 8]))
        for r in (("begin", 1, ROOT_INO + 1), ("attrs", ROOT_INO, st.S_IFDIR | 0o755, 0, 0, 0, 0, 0), ("snapend",)):
            s.apply(r)
        return s

    s = fresh()
    exts = [Extent(0, u, 4096, u) for u in range(3)]
    s.apply(("make", ROOT_INO, b"a", st.S_IFREG | 0o644, 0, 0, 0, b"", 2, 1))
    s.apply(("make", ROOT_INO, b"b", st.S_IFREG | 0o644, 0, 0, 0, b"", 3, 1))
    s.apply(("content", 2, 3 * 4096, 1, 1, list(enumerate(exts))))
    s.apply(("content", 3, 4096, 1, 1, [(0, exts[0])]))
    items = [(e, digest(bytes([i]))) for i, e in enumerate(exts)]
    s.apply(("digests", items + [(Extent(1, 5, 4096, 0), digest(b"gone"))]))
    assert list(s.digests.values()) == items
    for room, kept in ((None, items), (2 * DIGEST_ITEM, items[1:]), (DIGEST_ITEM - 1, [])):
        recs = [("begin", 2, s.ns.next_ino)] + s.snapshot(room) + [("snapend",)]
        t = fresh()
        for r in decode_records(b"".join(encode_record(r) for r in recs), len(recs)):
            t.apply(r)
        assert list(t.digests.values()) == kept
    s.apply(("content", 2, 4096, 2, 2, [(0, exts[0])]))  # units 1 and 2 go, unit 0 is still named
    assert list(s.digests.values()) == items[:1]
    s.apply(("unlink", ROOT_INO, b"a", 3))
    s.apply(("unlink", ROOT_INO, b"b", 3))
    assert not s.digests and not s.names


def test_an_extent_named_with_two_lengths_keeps_the_shared_count_whole():
    """A chunk shortened in place (a truncate that keeps its unit) names its extent with a shorter
    length while the longer naming is replaced: the extent's first length counts for every naming,
    so the shared bytes never go below zero and come back to zero when one naming is left (the
    model test saw -2380 when each naming counted its own length)."""
    import stat as st
    from ckptfs.fs.namespace import ROOT_INO
    from ckptfs.store.durable import DurableState
    s = DurableState(Allocator([8]))
    for r in (("begin", 1, ROOT_INO + 1), ("attrs", ROOT_INO, st.S_IFDIR | 0o755, 0, 0, 0, 0, 0), ("snapend",)):
        s.apply(r)
    s.apply(("make", ROOT_INO, b"a", st.S_IFREG | 0o644, 0, 0, 0, b"", 2, 1))
    s.apply(("make", ROOT_INO, b"b", st.S_IFREG | 0o644, 0, 0, 0, b"", 3, 1))
    s.apply(("content", 2, 5000, 1, 1, [(0, Extent(0, 0, 5000, 1))]))
    s.apply(("content", 2, 300, 2, 2, [(0, Extent(0, 0, 300, 2))]))  # a: shortened in place
    assert s.shared_bytes == 0 and s.namings(Extent(0, 0, 300, 2)) == 1
    s.apply(("content", 3, 300, 2, 2, [(0, Extent(0, 0, 300, 2))]))  # b shares the short one
    assert s.shared_bytes == 5000 and s.shared(3) == 300  # (the extent's first length stands for all)
    s.apply(("content", 3, 100, 3, 3, [(0, Extent(0, 0, 100, 3))]))  # b shortened in place too
    assert s.shared_bytes == 5000
    s.apply(("unlink", ROOT_INO, b"a", 4))
    assert s.shared_bytes == 0 and s.namings(Extent(0, 0, 100, 3)) == 1
    s.apply(("unlink", ROOT_INO, b"b", 4))
    assert s.shared_bytes == 0 and not s.names and s.alloc.refs(0, 0) == 0


def test_a_frame_carries_the_digests_of_extents_it_names_first_and_the_next_index_starts_from_them():
    """The index says which written extents' digests no frame holds yet; a frame naming them
    carries them (shared extents and extents of earlier frames not again); the index of the
    next mount, loaded from the durable state, finds them all."""
    alloc = Allocator([8])
    index = ContentIndex(alloc)
    a, b = Extent(0, 0, 10, 1), Extent(0, 1, 20, 2)
    index.add(digest(b"a"), a)
    index.add(digest(b"b"), b)
    frame = [Make(1, b"f", 0o100644, 0, 0, 0, b"", 2, 1), Content(2, 30, 1, 1, [(0, a), (1, b)])]
    assert index.to_journal(frame) == [(a, digest(b"a")), (b, digest(b"b"))]
    index.journaled(index.to_journal(frame[1:2]))
    assert index.to_journal(frame) == [] and not index.unjournaled
    index.load([(Extent(0, 2, 5, 3), digest(b"c"))])
    assert index.to_journal([Content(3, 5, 1, 1, [(0, Extent(0, 2, 5, 3))])]) == []
    after = ContentIndex(Allocator([8]))
    after.load([(a, digest(b"a")), (b, digest(b"b"))])
    assert after.find(digest(b"b"), 20) == b and not after.unjournaled


def test_fsck_checks_each_journaled_digest_against_the_extent_bytes():
    from test_pool import append_commits, fresh, sb_of, write
    from ckptfs.fs.namespace import ROOT_INO
    from ckptfs.store.pool import fsck
    import crc32c
    for right in (True, False):
        devs = fresh()
        data = b"checkpoint bytes" * 100
        write(devs[0], sb_of(devs[0]).unit_offset(3), data)
        ext = Extent(0, 3, len(data), crc32c.crc32c(data))
        append_commits(devs, [[("make", ROOT_INO, b"f", 0o100644, 0, 0, 0, b"", 2, 5),
                               ("content", 2, len(data), 6, 6, [(0, ext)]),
                               ("digests", [(ext, digest(data if right else data[1:]))])]])
        problems = fsck(devs)
        assert problems == [] if right else len(problems) == 1 and "content digest mismatch" in problems[0]


class Recording:
    """A device that keeps what was written where."""

    def __init__(self):
        self.writes: list[tuple[int, bytes]] = []

    def pwritev(self, bufs, offset: int) -> None:
        self.writes.append((offset, b"".join(bytes(b) for b in bufs)))


def test_the_drain_leaves_out_the_chunks_the_index_holds_and_keeps_the_others_offsets():
    cs = 8192
    chunks = [random.Random(i).randbytes(cs) for i in range(4)]
    index = ContentIndex(Allocator([8]))
    known = Extent(0, 5, cs, 1)
    index.add(digest(chunks[1]), known)
    dev = Recording()
    [(crcs, digests, found, _, _)] = _checksum_and_write_runs(
        dev, [([memoryview(c) for c in chunks], [cs] * 4, 1000)], cs, index, [])
    assert found == [None, known, None, None] and digests[2] == digest(chunks[2]) and len(crcs) == 4
    assert dev.writes == [(1000, chunks[0]), (1000 + 2 * cs, chunks[2] + chunks[3])]
    dev = Recording()
    [(_, digests, found, _, _)] = _checksum_and_write_runs(dev, [([memoryview(c) for c in chunks], [cs] * 4, 0)], cs)
    assert digests == [] and found == [None] * 4 and dev.writes == [(0, b"".join(chunks))]


def test_a_chunk_identical_to_one_in_flight_is_not_written_and_shares_its_write():
    """In one job and from another job (another worker thread) alike, a chunk whose twin is being
    written is left out of the writes and waits for the twin's flight; the drain lands it with
    the extent written, and the next twin finds that extent in the index."""
    cs = 8192
    a, b = random.Random(1).randbytes(cs), random.Random(2).randbytes(cs)
    index, led, dev = ContentIndex(Allocator([8])), [], Recording()
    [(crcs, digests, found, flights, _)] = _checksum_and_write_runs(
        dev, [([memoryview(c) for c in (a, b, a)], [cs] * 3, 0)], cs, index, led)
    assert found[:2] == [None, None] and found[2] is flights[0] and flights[2] is None
    assert dev.writes == [(0, a + b)] and led == [(digests[0], flights[0]), (digests[1], flights[1])]
    other = Recording()
    [(_, _, found2, _, _)] = _checksum_and_write_runs(other, [([memoryview(a)], [cs], 0)], cs, index, [])
    assert found2 == [flights[0]] and other.writes == []
    ext = Extent(0, 0, cs, crcs[0])
    index.add(digests[0], ext)
    index.land(digests[0], flights[0], ext)
    assert flights[0].done and flights[0].extent == ext and digests[0] not in index.flying
    [(_, _, found3, flights3, _)] = _checksum_and_write_runs(other, [([memoryview(a)], [cs], 0)], cs, index, [])
    assert found3 == [ext] and flights3 == [None]


# ---- real mounts ----------------------------------------------------------------------------

def written(m: CkptMount) -> int:
    return sum(d["bytes_written"] for d in m.status()["pool"]["devices"])


def durable(m: CkptMount) -> None:
    assert ckptfs("wait", str(m.path), timeout=120).returncode == 0


@pytest.mark.mount
def test_a_copy_writes_nothing_and_outlives_its_original(tmp_path):
    """A second file of the same bytes (odd size: a short last chunk, a piece) writes nothing and
    shares every extent; deleting the original, a remount and a kill -9 leave the copy whole; fsck
    is clean; the space comes back when the copy goes too."""
    m = CkptMount(tmp_path, extra=("--dedupe", "on"))
    m.mount()
    data = os.urandom(6 * MiB + 12345)
    try:
        (m.path / "step1.pt").write_bytes(data)
        durable(m)
        before, used = written(m), m.status()["pool"]["used"]
        (m.path / "last.pt").write_bytes(data)
        durable(m)
        st = m.status()
        assert written(m) == before and st["pool"]["used"] == used
        assert st["dedupe"]["chunks_shared"] == 7 and st["dedupe"]["bytes_shared"] == len(data)
        assert st["dedupe"]["shared_bytes"] == len(data)
        assert os.getxattr(m.path / "last.pt", "user.ckptfs.shared") == str(len(data)).encode()
        assert {(f["path"], f["size"], f["shared"]) for f in st["dedupe"]["newest"]} == {
            ("/step1.pt", len(data), len(data)), ("/last.pt", len(data), len(data))}
        out = ckptfs("status", str(m.path)).stdout
        assert "shared on the devices" in out and "/last.pt: 6.0 MiB, 100% shared with other files" in out, out
        os.unlink(m.path / "step1.pt")
        durable(m)
        assert os.getxattr(m.path / "last.pt", "user.ckptfs.shared") == b"0"
        assert m.status()["dedupe"]["shared_bytes"] == 0
        m.kill()
        m.mount()
        assert (m.path / "last.pt").read_bytes() == data and m.status()["pool"]["used"] == used
        m.umount()
        fsck = ckptfs("fsck", "--devices", m.device_arg)
        assert fsck.returncode == 0 and "clean" in fsck.stdout, fsck.stdout + fsck.stderr
        m.mount()
        assert (m.path / "last.pt").read_bytes() == data
        os.unlink(m.path / "last.pt")
        durable(m)
        assert m.status()["pool"]["used"] == 0
    finally:
        m.close()


@pytest.mark.mount
def test_saves_after_a_remount_or_a_kill_share_what_the_saves_before_wrote(tmp_path):
    """The digests are in the journal: after a kill -9 (replay) and after a clean remount (the
    snapshot each mount writes), copies of a file written before write nothing; fsck then reads
    every extent and checks its digest."""
    m = CkptMount(tmp_path, extra=("--dedupe", "on"))
    m.mount()
    data = os.urandom(5 * MiB + 999)
    try:
        (m.path / "step1.pt").write_bytes(data)
        durable(m)
        used = m.status()["pool"]["used"]
        for name, stop in (("after-kill.pt", m.kill), ("after-umount.pt", m.umount)):
            stop()
            m.mount()
            before = written(m)
            (m.path / name).write_bytes(data)
            durable(m)
            st = m.status()
            assert written(m) == before and st["pool"]["used"] == used, name
            assert st["dedupe"]["bytes_shared"] == len(data), name
        m.umount()
        fsck = ckptfs("fsck", "--devices", m.device_arg)
        assert fsck.returncode == 0 and "clean" in fsck.stdout, fsck.stdout + fsck.stderr
    finally:
        m.close()


@pytest.mark.mount
def test_a_second_save_of_the_same_bytes_while_the_first_is_in_memory_drains_once(tmp_path):
    """Two saves of the same bytes back to back reach the drain together (the gate holds it while
    writes stream in): each chunk is written once, the second file shares every extent, and both
    read back after a kill -9."""
    m = CkptMount(tmp_path, extra=("--dedupe", "on", "--memory", "256M"))
    m.mount()
    data = os.urandom(24 * MiB + 4321)
    try:
        (m.path / "step1.pt").write_bytes(data)
        (m.path / "last.pt").write_bytes(data)
        durable(m)
        st = m.status()
        assert written(m) == 24 * MiB + 8192, st  # each chunk once (the last one padded to 4 KiB)
        assert st["dedupe"]["bytes_shared"] == len(data) and st["dedupe"]["shared_bytes"] == len(data), st
        m.kill()
        m.mount()
        assert (m.path / "step1.pt").read_bytes() == data and (m.path / "last.pt").read_bytes() == data
    finally:
        m.close()


@pytest.mark.mount
def test_a_file_changed_after_a_copy_leaves_the_copy_as_it_was(tmp_path):
    """Shared extents are never written in place: rewriting a chunk of one file, truncating it or
    writing the same bytes a third time leaves every other file's bytes as they were, across a
    kill -9; the store then says so."""
    m = CkptMount(tmp_path, extra=("--dedupe", "on"))
    m.mount()
    data = os.urandom(4 * MiB)
    try:
        for name in ("a", "b", "c"):
            (m.path / name).write_bytes(data)
        durable(m)
        with open(m.path / "a", "r+b") as f:
            f.seek(MiB + 10)
            f.write(b"new bytes")
        os.truncate(m.path / "b", MiB + 1)
        durable(m)
        m.kill()
        m.mount()
        changed = bytearray(data)
        changed[MiB + 10:MiB + 19] = b"new bytes"
        assert (m.path / "a").read_bytes() == bytes(changed)
        assert (m.path / "b").read_bytes() == data[:MiB + 1]
        assert (m.path / "c").read_bytes() == data
    finally:
        m.close()
    fsck = ckptfs("fsck", "--devices", m.device_arg)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr


@pytest.mark.mount
def test_fine_tuning_saves_write_only_the_chunks_no_earlier_save_had(tmp_path):
    """torch.save of a model with frozen layers every step under a new name: each save writes to
    the devices exactly its chunks whose bytes no earlier save had (read back and compared here:
    the trained layer, its Adam moments, and the chunk holding each record's zip header, which
    carries the save's time), and loads back equal to what was saved."""
    torch = pytest.importorskip("torch")
    m = CkptMount(tmp_path, extra=("--dedupe", "on"), memory="1G", dev_size=2 << 30)
    m.mount()
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(8)))
    for p in list(net.parameters())[:-1]:
        p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    seen: set[bytes] = set()
    try:
        for step in range(3):
            net(torch.randn(4, 1024)).square().mean().backward()
            opt.step()
            before = written(m)
            state = {"model": net.state_dict(), "optim": opt.state_dict()}
            torch.save(state, m.path / f"step{step}.pt")
            durable(m)
            data = (m.path / f"step{step}.pt").read_bytes()
            chunks = [data[i:i + MiB] for i in range(0, len(data), MiB)]
            new = [c for c in chunks if c not in seen]
            assert written(m) - before == sum(-(-len(c) // 4096) * 4096 for c in new)
            if step:
                assert len(new) < 0.6 * len(chunks)  # 3 of 10 tensors changed, and 10 headers
            seen.update(chunks)
            back = torch.load(m.path / f"step{step}.pt", weights_only=True)
            assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
    finally:
        m.close()


@pytest.mark.mount
def test_a_copy_fits_a_pool_that_could_not_hold_its_bytes_twice(tmp_path):
    """A write near full is refused only once the chunks waiting to drain are known not to share:
    a copy of a file that fills most of the pool fits (each refusal waits for the drain to hash
    what is queued), while a file of new bytes the same size still gets ENOSPC."""
    import errno
    import shutil
    m = CkptMount(tmp_path, extra=("--dedupe", "on"), memory="256M", ndev=2, dev_size=100 << 20)
    m.mount()
    st = os.statvfs(m.path)
    size = st.f_blocks * st.f_frsize * 2 // 3
    data = os.urandom(size - 777)
    try:
        (m.path / "step1.pt").write_bytes(data)
        durable(m)
        used = m.status()["pool"]["used"]
        shutil.copyfile(m.path / "step1.pt", m.path / "last.pt")
        durable(m)
        assert m.status()["pool"]["used"] == used
        assert (m.path / "last.pt").read_bytes() == data
        with pytest.raises(OSError) as e:
            (m.path / "new.pt").write_bytes(os.urandom(len(data)))
        assert e.value.errno == errno.ENOSPC
        os.unlink(m.path / "new.pt")
        m.kill()
        m.mount()
        assert (m.path / "last.pt").read_bytes() == data and (m.path / "step1.pt").read_bytes() == data
    finally:
        m.close()
