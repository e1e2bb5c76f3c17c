"""Pool-level format, open, recover and fsck on in-memory devices and plain files (no FUSE).

Recovery reads every device's journal mirror: the newest complete half with
the longest run of frames wins, and any damage (a frame broken in the middle,
a mirror with no valid half) is reported rather than silently skipped. The
journal anchors make the loss of the newest half (or of a cleanly closed
tail) on every mirror a refusal rather than a silent roll-back.
"""
from dataclasses import replace

import pytest

from ckptfs.errors import UsageError
from ckptfs.format.journal import Extent, encode_frame
from ckptfs.format.layout import ANCHOR_SLOTS, ANCHORED_VERSION, SB_SIZE, Anchor, Superblock
from ckptfs.fs.namespace import ROOT_INO
from ckptfs.store.pool import format_pool, fsck, open_pool, recover, upgrade_superblocks
from faulty import make_faulty
from mounting import ckptfs

CHUNK = 64 << 10
HALF = 256 << 10
SIZE = 4 << 20
REG = 0o100644


def fresh(n: int = 2):
    devs = make_faulty(n, SIZE)
    format_pool(devs, chunk_size=CHUNK, journal_half=HALF)
    return devs


def sb_of(dev) -> Superblock:
    return Superblock.decode(bytes(dev.pread(SB_SIZE, 0)), dev.path)


def write(dev, offset: int, data: bytes) -> None:
    """Write `data` at any offset (read-modify-write of the 4 KiB blocks it touches)."""
    lo, hi = offset // 4096 * 4096, -(-(offset + len(data)) // 4096) * 4096
    buf = bytearray(dev.pread(hi - lo, lo))
    buf[offset - lo:offset - lo + len(data)] = data
    dev.pwrite(memoryview(buf), lo)
    dev.flush()


def flip(dev, offset: int) -> None:
    """Damage the byte at `offset` for sure: a constant written there may already be its value."""
    write(dev, offset, bytes([dev.pread(4096, offset // 4096 * 4096)[offset % 4096] ^ 0xFF]))


def append_commits(devs, frames: list[list[tuple]], on=None) -> list[int]:
    """Append commit frames (epoch 1, seq 2...) after the format frame on each device; their offsets."""
    sb = sb_of(devs[0])
    offs, off = [], 4096  # the format frame is one block
    raws = []
    for i, recs in enumerate(frames):
        raw = encode_frame(sb.pool_id, 2 + i, 1, recs)
        offs.append(off)
        raws.append((off, raw))
        off += len(raw)
    for d in (on if on is not None else devs):
        for o, raw in raws:
            write(d, sb.half_offset(0) + o, raw)
    return offs


def test_format_then_recover_gives_an_empty_root():
    devs = fresh(3)
    pool = open_pool(devs)
    rec = recover(pool)
    assert list(rec.durable.ns.inodes) == [ROOT_INO]
    assert (rec.half, rec.seq, rec.tail, rec.warnings) == (0, 1, 4096, [])
    assert [sb.index for sb in pool.sbs] == [0, 1, 2]
    assert fsck(devs) == []


def test_recover_replays_commits_and_claims_their_extents():
    devs = fresh()
    append_commits(devs, [[("make", ROOT_INO, b"f", REG, 0, 0, 0, b"", 2, 5)],
                          [("content", 2, 10, 6, 6, [(0, Extent(0, 3, 10, 0))])]])
    rec = recover(open_pool(devs))
    assert rec.seq == 3 and rec.durable.ns.get(2).size == 10
    assert rec.durable.alloc.refs(0, 3) == 1 and rec.durable.alloc.used_units() == 1


def test_pieces_freed_and_used_again_replay_and_serve():
    """A 3000-byte chunk takes a 4 KiB piece of unit 0 (its second); the file then grows past half a unit
    and moves to unit 1, unit 0 is whole and free again, and another file's 30 KB chunk takes
    an 8-block piece of it. Replay follows the records in order, and the live namespace (a
    second replay) gets one more reference on each extent it serves, none on the old piece."""
    from types import SimpleNamespace
    from ckptfs.store.pool import live_namespace
    devs = fresh()
    per = CHUNK // 4096
    append_commits(devs, [[("make", ROOT_INO, b"f", REG, 0, 0, 0, b"", 2, 5),
                           ("make", ROOT_INO, b"g", REG, 0, 0, 0, b"", 3, 5)],
                          [("content", 2, 3000, 6, 6, [(0, Extent(0, 1, 3000, 0))])],
                          [("content", 2, 60_000, 7, 7, [(0, Extent(0, per, 60_000, 0))])],
                          [("content", 3, 30_000, 8, 8, [(0, Extent(0, 0, 30_000, 0))])]])
    rec = recover(open_pool(devs))
    alloc = rec.durable.alloc
    assert alloc.per_unit == per and alloc.used_units() == 2
    assert (alloc.refs(0, 0), alloc.refs(0, per)) == (1, 1)
    ns = live_namespace(rec.records, alloc, SimpleNamespace(chunk_size=CHUNK))
    assert (alloc.refs(0, 0), alloc.refs(0, per), alloc.refs(0, 1)) == (2, 2, 0)
    assert ns.get(3).data.chunks[0].extent == Extent(0, 0, 30_000, 0)
    alloc.check_invariants()


def test_the_longest_mirror_wins():
    devs = fresh()
    frames = [[("make", ROOT_INO, b"f%d" % i, REG, 0, 0, 0, b"", 2 + i, 5)] for i in range(4)]
    append_commits(devs, frames[:2], on=[devs[0]])
    append_commits(devs, frames, on=[devs[1]])
    rec = recover(open_pool(devs))
    assert rec.seq == 5 and len(rec.durable.ns.inodes) == 5 and rec.warnings == []


def test_damage_in_the_middle_of_a_mirror_is_reported():
    devs = fresh()
    frames = [[("make", ROOT_INO, b"f%d" % i, REG, 0, 0, 0, b"", 2 + i, 5)] for i in range(4)]
    offs = append_commits(devs, frames)
    sb = sb_of(devs[0])
    write(devs[0], sb.half_offset(0) + offs[1], bytes([0xFF]) * 64)
    rec = recover(open_pool(devs))
    assert rec.seq == 5 and len(rec.durable.ns.inodes) == 5  # device 1's mirror is whole
    assert len(rec.warnings) == 1 and "mem0" in rec.warnings[0] and "damaged" in rec.warnings[0]
    problems = fsck(devs)
    assert len(problems) == 1 and "damaged" in problems[0]


def test_a_wiped_mirror_is_reported():
    devs = fresh()
    append_commits(devs, [[("make", ROOT_INO, b"f", REG, 0, 0, 0, b"", 2, 5)]])
    sb = sb_of(devs[1])
    write(devs[1], sb.half_offset(0), bytes(4096))
    rec = recover(open_pool(devs))
    assert rec.seq == 2 and 2 in rec.durable.ns.inodes
    assert len(rec.warnings) == 1 and "mem1" in rec.warnings[0] and "no valid journal" in rec.warnings[0]
    assert len(fsck(devs)) == 1


def test_no_valid_journal_anywhere_is_an_error():
    devs = fresh()
    for d in devs:
        write(d, sb_of(d).half_offset(0), bytes(4096))
    with pytest.raises(UsageError, match="no valid journal"):
        recover(open_pool(devs))


def test_the_newest_complete_half_wins_and_an_incomplete_one_is_ignored():
    devs = fresh()
    sb = sb_of(devs[0])
    newer = encode_frame(sb.pool_id, 2, 2, [("begin", 2, 9), ("make", ROOT_INO, b"new", REG, 0, 0, 0, b"", 5, 1),
                                            ("snapend",)])
    for d in devs:
        write(d, sb.half_offset(1), newer)
    rec = recover(open_pool(devs))
    assert rec.half == 1 and b"new" in rec.durable.ns.get(ROOT_INO).dir.entries
    assert rec.durable.ns.next_ino == 9
    incomplete = encode_frame(sb.pool_id, 3, 3, [("begin", 3, 9), ("make", ROOT_INO, b"x", REG, 0, 0, 0, b"", 6, 1)])
    for d in devs:
        write(d, sb.half_offset(0), incomplete)
    rec = recover(open_pool(devs))
    assert rec.half == 1 and b"x" not in rec.durable.ns.get(ROOT_INO).dir.entries


def test_open_pool_refuses_sets_that_are_not_one_pool_in_order():
    a, b = fresh(), fresh()
    with pytest.raises(UsageError, match="mem1 belongs to another pool"):
        open_pool([a[0], b[1]])
    with pytest.raises(UsageError, match="mem1 is device 1 of its pool but was given in position 0"):
        open_pool([a[1], a[0]])
    with pytest.raises(UsageError, match="pool of 2 devices, but 1 were given"):
        open_pool([a[0]])
    small = make_faulty(1, SIZE // 2)[0]
    for blk, data in a[1].image().durable.items():
        if blk * 4096 < small.size:
            small.durable[blk] = data
    with pytest.raises(UsageError, match="smaller"):
        open_pool([a[0], small])


def test_format_checks_every_device_before_writing_any():
    devs = make_faulty(2, SIZE)
    write(devs[1], 1024, b"\x01" * 56 + b"\x53\xef")  # an ext superblock
    devs[1].writes = 0
    with pytest.raises(UsageError, match="mem1 holds"):
        format_pool(devs, chunk_size=CHUNK, journal_half=HALF)
    assert devs[0].writes == 0
    format_pool(devs, chunk_size=CHUNK, journal_half=HALF, force=True)
    assert recover(open_pool(devs)).warnings == []


def _files(tmp_path, n=2):
    out = []
    for i in range(n):
        p = tmp_path / f"d{i}.img"
        with open(p, "wb") as f:
            f.truncate(SIZE)
        out.append(str(p))
    return out


def test_an_open_pool_locks_its_devices_against_other_processes(tmp_path):
    paths = _files(tmp_path)
    format_pool(paths, chunk_size=CHUNK, journal_half=HALF)
    pool = open_pool(paths)
    try:
        for cmd, named in ((["fsck", "--devices", ",".join(paths)], "d0.img"),
                           (["fsck", "--devices", paths[1]], "d1.img"),
                           (["format", "--devices", ",".join(paths), "--force"], "d0.img")):
            res = ckptfs(*cmd)
            assert res.returncode == 1 and f"{named} is in use" in res.stderr, (cmd, res.stderr)
    finally:
        pool.close()
    assert ckptfs("fsck", "--devices", ",".join(paths)).returncode == 0
    assert fsck(paths) == []


def write_anchor(devs, **kw) -> Anchor:
    """Write a journal anchor on every device, as compaction or a clean unmount does."""
    sb = sb_of(devs[0])
    a = Anchor(**{"time_ns": 1, "clean": False, **kw})
    for d in devs:
        write(d, a.offset, a.encode(sb.pool_id))
    return a


def compact_into_half_1(devs) -> None:
    """What compaction does: a newer half (epoch 2) holding 'f', then its anchor."""
    sb = sb_of(devs[0])
    newer = [encode_frame(sb.pool_id, 2, 2, [("begin", 2, 9), ("stamp", 123), ("snapend",)]),
             encode_frame(sb.pool_id, 3, 2, [("stamp", 456), ("make", ROOT_INO, b"f", REG, 0, 0, 0, b"", 5, 1)])]
    for d in devs:
        write(d, sb.half_offset(1), b"".join(newer))
    write_anchor(devs, generation=2, epoch=2, half=1, seq=2)


def test_damage_to_the_newest_halfs_first_frame_is_reported():
    devs = fresh(2)
    compact_into_half_1(devs)
    rec = recover(open_pool(devs))
    assert b"f" in rec.durable.ns.get(ROOT_INO).dir.entries and rec.time_ns == 456 and not rec.clean
    sb = sb_of(devs[0])
    for d in devs:
        flip(d, sb.half_offset(1) + 40)  # bit rot in the begin frame, on every mirror
    with pytest.raises(UsageError, match=r"journal half 1 \(epoch 2\) is damaged on every device.*--force-recover"):
        recover(open_pool(devs))  # the commit of 'f' is never lost without a word
    rec = recover(open_pool(devs), force=True)  # the operator's choice: the older state
    assert b"f" not in rec.durable.ns.get(ROOT_INO).dir.entries and rec.durable.epoch == 1
    assert "epoch 2" in rec.rollback and "epoch 2" in rec.report()["warnings"][-1]
    assert any("journal half 1 (epoch 2) is damaged" in p for p in fsck(devs))


def test_damage_on_one_mirror_only_needs_no_force():
    devs = fresh(2)
    compact_into_half_1(devs)
    flip(devs[0], sb_of(devs[0]).half_offset(1) + 40)
    rec = recover(open_pool(devs))
    assert b"f" in rec.durable.ns.get(ROOT_INO).dir.entries and rec.rollback is None


def test_a_fresh_pool_is_clean_and_commits_make_it_unclean():
    devs = fresh(2)
    rec = recover(open_pool(devs))
    assert rec.clean and rec.discarded == [] and rec.anchor_gen == 1
    append_commits(devs, [[("stamp", 77), ("make", ROOT_INO, b"a", REG, 0, 0, 0, b"", 2, 1)]])
    rec = recover(open_pool(devs))  # frames after the clean anchor: a daemon died without unmounting
    assert not rec.clean and rec.seq == 2 and rec.time_ns == 77
    write_anchor(devs, generation=2, epoch=1, half=0, seq=2, clean=True)  # a clean unmount
    assert recover(open_pool(devs)).clean


def test_a_torn_commit_is_reported_as_discarded():
    devs = fresh(2)
    offs = append_commits(devs, [[("make", ROOT_INO, b"a", REG, 0, 0, 0, b"", 2, 1)],
                                 [("make", ROOT_INO, b"b", REG, 0, 0, 0, b"", 3, 1)]])
    sb = sb_of(devs[0])
    for d in devs:
        flip(d, sb.half_offset(0) + offs[1] + 40)  # the last frame was being written
    rec = recover(open_pool(devs))
    assert rec.seq == 2 and not rec.clean
    assert len(rec.discarded) == 1 and "torn" in rec.discarded[0] and str(offs[1]) in rec.discarded[0]
    assert rec.report()["discarded"] == rec.discarded


def test_a_lost_tail_after_a_clean_unmount_is_refused():
    devs = fresh(2)
    append_commits(devs, [[("make", ROOT_INO, b"a", REG, 0, 0, 0, b"", 2, 1)]])
    write_anchor(devs, generation=2, epoch=1, half=0, seq=3, clean=True)  # closed after frame 3
    with pytest.raises(UsageError, match="closed cleanly at frame 3, but only frames up to 2"):
        recover(open_pool(devs))


def test_the_newest_anchor_wins_and_a_torn_one_falls_back_to_the_other_slot():
    devs = fresh(2)
    compact_into_half_1(devs)  # generation 2, slot 0
    assert recover(open_pool(devs)).anchor_gen == 2
    for d in devs:
        flip(d, ANCHOR_SLOTS[0] + 20)  # torn on every device
    rec = recover(open_pool(devs))  # generation 1 (format's) remains: epoch 2 replays, newer than it
    assert rec.anchor_gen == 1 and rec.durable.epoch == 2 and rec.warnings == []


def test_a_version_1_pool_is_read_and_upgraded():
    devs = fresh(2)
    for d in devs:
        sb = sb_of(d)
        write(d, 0, replace(sb, version=1).encode())
        for off in ANCHOR_SLOTS:
            write(d, off, bytes(SB_SIZE))  # version 1 had no anchors
    pool = open_pool(devs)
    assert {sb.version for sb in pool.sbs} == {1}
    rec = recover(pool)
    assert rec.warnings == [] and rec.anchor_gen == 0 and not rec.clean
    assert upgrade_superblocks(pool.devices, pool.sbs)
    assert {sb_of(d).version for d in devs} == {ANCHORED_VERSION}  # not 3: its addresses differ
    assert not upgrade_superblocks(pool.devices, [sb_of(d) for d in devs])


def test_an_unknown_version_is_refused():
    devs = fresh(1)
    write(devs[0], 0, replace(sb_of(devs[0]), version=99).encode())
    with pytest.raises(UsageError, match="unsupported ckptfs format version 99"):
        open_pool(devs)
