"""The journal codec and replay, driven directly (pure: no devices, no trio).

Replay must return a prefix of the committed frames for every prefix of the
log (a torn tail ends it quietly), stop at damage and report it when a later
frame shows the damage was in the middle, and never replay frames of another
pool, of an older epoch, or out of sequence.
"""
import random
import struct

import pytest

from ckptfs.format.journal import (BLOCK, RECORDS, Extent, decode_records, encode_frame, encode_record,
                            frame_size, replay_half)

POOL = bytes(range(16))
OTHER_POOL = bytes(range(1, 17))
HDR = 32  # magic, crc, seq, epoch, length, nrec


def sample_records(rng: random.Random) -> list[tuple]:
    """At least one record of every type, with edge values (None optionals, empty and long names)."""
    ext = [(i, Extent(rng.randrange(8), rng.randrange(1 << 40), rng.randrange(1, 1 << 20),
                      rng.getrandbits(32))) for i in range(rng.randrange(0, 40))]
    long_name = bytes(rng.randrange(1, 256) for _ in range(255))  # NAME_MAX
    return [
        ("make", 1, b"a", 0o100644, 0, 0, 0, b"", 2, 1_700_000_000_000_000_000),
        ("make", 1, long_name, 0o120777, 1000, 1000, 0, b"/some/target" * 50, 3, -5),
        ("make", 2, b"", 0o20644, 2**32 - 1, 2**32 - 1, 2**64 - 1, b"", 2**64 - 1, 2**63 - 1),
        ("link", 2, 1, b"hard", -(2**63)),
        ("link", 2, 1, b"", 0),
        ("unlink", 1, b"x" * 255, 7),
        ("unlink", 1, b"", 0),
        ("rmdir", 5, b"dir", 9),
        ("rename", 1, b"old", 4, b"new", 2, 11),
        ("rename", 1, b"", 4, long_name, 0, 0),
        ("setattr", 3, None, None, None, None, None, 12),
        ("setattr", 3, 0o755, 0, 2**32 - 1, -1, 2**63 - 1, 13),
        ("setattr", 3, 0, None, 5, None, 0, 0),
        ("setxattr", 3, b"user.k", b""),
        ("setxattr", 3, b"user.big", rng.randbytes(70_000)),
        ("removexattr", 3, b"user.k"),
        ("content", 3, 0, 0, 0, []),
        ("content", 3, 2**64 - 1, -1, 2**63 - 1, ext),
        ("content", 4, 12345, 1, 2, [(0, Extent(0, 0, 1, 0)), (2**64 - 1, Extent(65535, 2**64 - 1, 2**32 - 1, 2**32 - 1))]),
        ("digests", []),
        ("digests", [(Extent(1, 2**64 - 1, 2**32 - 1, 0), bytes(32))] + [(e, rng.randbytes(32)) for _, e in ext]),
        ("stamp", -(2**63)),
        ("stamp", 1_700_000_000_123_456_789),
        ("attrs", 1, 0o40755, 0, 0, 1, 2, 3),
        ("begin", 1, 2),
        ("snapend",),
    ]


def test_sample_covers_every_record_type():
    assert {r[0] for r in sample_records(random.Random(0))} == set(RECORDS)


@pytest.mark.parametrize("seed", range(5))
def test_record_round_trip(seed):
    recs = sample_records(random.Random(seed))
    for r in recs:
        raw = encode_record(r)
        assert decode_records(raw, 1) == [r]
    raw = b"".join(encode_record(r) for r in recs)
    assert decode_records(raw, len(recs)) == recs


def test_extents_decode_as_extent_tuples():
    (rec,) = decode_records(encode_record(("content", 9, 10, 1, 2, [(3, Extent(1, 2, 3, 4))])), 1)
    idx, ext = rec[5][0]
    assert isinstance(ext, Extent) and (idx, ext.dev, ext.unit, ext.length, ext.crc) == (3, 1, 2, 3, 4)


def test_encode_rejects_wrong_field_count():
    with pytest.raises(ValueError):
        encode_record(("unlink", 1, b"x"))
    with pytest.raises(KeyError):
        encode_record(("nosuch", 1))


def test_frame_round_trip_and_alignment():
    recs = sample_records(random.Random(1))
    recs = [recs[-2]] + recs[:-2] + [recs[-1]]  # begin first, snapend last
    f = encode_frame(POOL, 5, 3, recs)
    assert len(f) % BLOCK == 0
    r = replay_half(POOL, f)
    # stamps are not returned: the last one is the time of the state replayed
    assert r.records == [x for x in recs if x[0] != "stamp"] and r.time_ns == 1_700_000_000_123_456_789
    assert (r.epoch, r.first_seq, r.last_seq, r.frames) == (3, 5, 5, 1)
    assert r.complete and r.tail == len(f) and r.corrupt_at is None


# ---- a whole log ------------------------------------------------------------------


def random_record(rng: random.Random) -> tuple:
    return rng.choice(sample_records(rng)[:-3])  # anything but attrs, begin and snapend (snapshot only)


class Log:
    """A journal half: a snapshot frame (begin..snapend), then commit frames, laid end to end."""

    def __init__(self, seed: int, ncommits: int = 30, epoch: int = 7, seq0: int = 100,
                 pool: bytes = POOL, snapshot_frames: int = 1):
        rng = random.Random(seed)
        self.epoch, self.seq0 = epoch, seq0
        snap = [("begin", epoch, 50)] + [("make", 1, b"f%d" % i, 0o100644, 0, 0, 0, b"", 10 + i, i)
                                         for i in range(5)] + [("snapend",)]
        groups = [snap] if snapshot_frames == 1 else [snap[:3], snap[3:]]
        for _ in range(ncommits):
            groups.append([random_record(rng) for _ in range(rng.choice([1, 1, 2, 5]))])
        self.groups = groups
        self.frames = [encode_frame(pool, seq0 + i, epoch, g) for i, g in enumerate(groups)]
        self.starts = []
        off = 0
        for f in self.frames:
            self.starts.append(off)
            off += len(f)
        self.buf = b"".join(self.frames)

    def records_of(self, nframes: int) -> list[tuple]:
        return [r for g in self.groups[:nframes] for r in g if r[0] != "stamp"]

    def frames_within(self, n: int) -> int:
        """How many leading frames are intact in buf[:n] padded with zeros.

        The padding after a frame's records is not checksummed, and a cut
        inside the records whose remaining bytes are zeros leaves them intact.
        """
        k = 0
        while k < len(self.frames) and not any(self.buf[n:self.payload_end(k)]):
            k += 1
        return k

    def payload_end(self, i: int) -> int:
        """Offset just past the checksummed bytes of frame i (header and records)."""
        (length,) = struct.unpack_from("<I", self.frames[i], 24)
        return self.starts[i] + HDR + length


@pytest.fixture(scope="module")
def log():
    return Log(seed=42)


def cut_points(log: Log, rng: random.Random) -> list[int]:
    pts = {0, len(log.buf)}
    for s, f in zip(log.starts, log.frames):
        pe = s + HDR + struct.unpack_from("<I", f, 24)[0]
        pts.update({s, s + 1, s + HDR - 1, s + HDR, pe - 1, pe, s + len(f) - 1, s + len(f)})
        pts.update(rng.randrange(s, s + len(f)) for _ in range(3))
    return sorted(p for p in pts if 0 <= p <= len(log.buf))


def test_every_prefix_replays_whole_frames_only(log):
    rng = random.Random(3)
    n = len(log.buf)
    for i in cut_points(log, rng):
        buf = log.buf[:i] + bytes(n - i)
        r = replay_half(POOL, buf)
        whole = log.frames_within(i)
        if whole == 0:
            assert r.records == [] and not r.complete and r.frames == 0, i
            continue
        assert r.frames == whole, i
        assert r.records == log.records_of(whole), i
        assert r.complete
        assert r.epoch == log.epoch and r.first_seq == log.seq0 and r.last_seq == log.seq0 + whole - 1
        assert r.tail == log.starts[whole - 1] + len(log.frames[whole - 1])
        assert r.corrupt_at is None, i  # a torn tail is quiet


def test_prefix_without_padding_also_replays_whole_frames(log):
    for i in cut_points(log, random.Random(4)):
        r = replay_half(POOL, log.buf[:i])
        whole = sum(1 for k in range(len(log.frames)) if log.payload_end(k) <= i)
        assert r.records == log.records_of(whole), i


def test_padding_bytes_are_not_covered_but_harmless(log):
    # the bytes between a frame's records and the next 4 KiB boundary do not matter
    i = next(k for k in range(len(log.frames)) if log.payload_end(k) < log.starts[k] + len(log.frames[k]))
    buf = bytearray(log.buf)
    buf[log.payload_end(i)] ^= 0xFF
    r = replay_half(POOL, bytes(buf))
    assert r.records == log.records_of(len(log.frames)) and r.corrupt_at is None


def test_flipped_byte_stops_replay_at_its_frame(log):
    rng = random.Random(5)
    n = len(log.frames)
    for i in range(n):
        positions = {log.starts[i], log.starts[i] + 4, log.starts[i] + 8, log.starts[i] + 16,
                     log.starts[i] + 24, log.starts[i] + 28, log.payload_end(i) - 1}
        positions.update(rng.randrange(log.starts[i], log.payload_end(i)) for _ in range(4))
        for pos in sorted(positions):
            buf = bytearray(log.buf)
            buf[pos] ^= 1 << rng.randrange(8)
            r = replay_half(POOL, bytes(buf))
            assert r.records == log.records_of(i), (i, pos)
            if i == 0:
                assert not r.complete and r.frames == 0
                continue
            assert r.tail == log.starts[i]
            if i < n - 1:
                # a later valid frame of this epoch: the damage is in the middle and is reported
                assert r.corrupt_at == log.starts[i], (i, pos)
            else:
                assert r.corrupt_at is None, (i, pos)


def test_damage_in_a_later_frame_of_a_torn_log_is_not_mistaken(log):
    # cut after frame 10: frames beyond are zeros, nothing after the tail is valid
    end = log.starts[10]
    buf = log.buf[:end] + bytes(len(log.buf) - end)
    r = replay_half(POOL, buf)
    assert r.frames == 10 and r.corrupt_at is None


def test_frames_of_another_pool_never_replay():
    other = Log(seed=42, pool=OTHER_POOL)
    r = replay_half(POOL, other.buf)
    assert r.records == [] and not r.complete and r.epoch == -1
    mine = Log(seed=42)
    # our snapshot, then commits of another pool at the same place: only the snapshot replays
    mixed = mine.buf[:mine.starts[1]] + other.buf[other.starts[1]:]
    r = replay_half(POOL, mixed)
    assert r.records == mine.records_of(1) and r.corrupt_at is None


def test_stale_frames_after_the_tail_never_replay():
    """A new epoch's log over an old one: the old frames beyond the new tail must not replay."""
    old = Log(seed=1, ncommits=30, epoch=3, seq0=10)
    new = Log(seed=2, ncommits=4, epoch=4, seq0=10)
    buf = bytearray(old.buf)
    buf[:len(new.buf)] = new.buf
    buf = bytes(buf)
    r = replay_half(POOL, buf)
    assert r.records == new.records_of(len(new.frames))
    assert r.epoch == 4 and r.corrupt_at is None
    # same epoch, but the frame after the tail continues an older sequence (wrong seq)
    same_epoch_old = Log(seed=1, ncommits=30, epoch=4, seq0=1)
    buf2 = bytearray(same_epoch_old.buf)
    buf2[:len(new.buf)] = new.buf
    r = replay_half(POOL, bytes(buf2))
    assert r.records == new.records_of(len(new.frames))


def test_frame_with_wrong_seq_or_epoch_ends_replay():
    lg = Log(seed=9, ncommits=5)
    for bad in (encode_frame(POOL, lg.seq0 + 3, lg.epoch, [("unlink", 1, b"z", 0)]),   # skips a seq
                encode_frame(POOL, lg.seq0 + 1, lg.epoch, [("unlink", 1, b"z", 0)]),   # repeats one
                encode_frame(POOL, lg.seq0 + 2, lg.epoch + 1, [("unlink", 1, b"z", 0)]),  # other epoch
                encode_frame(POOL, lg.seq0 + 2, lg.epoch - 1, [("unlink", 1, b"z", 0)])):
        buf = lg.buf[:lg.starts[2]] + bad + bytes(4 * BLOCK)
        r = replay_half(POOL, buf)
        assert r.records == lg.records_of(2)
        assert r.tail == lg.starts[2]


def test_half_without_snapend_is_incomplete():
    lg = Log(seed=11, ncommits=3, snapshot_frames=2)
    r = replay_half(POOL, lg.buf[:lg.starts[1]] + bytes(len(lg.buf) - lg.starts[1]))
    assert r.frames == 1 and not r.complete
    r = replay_half(POOL, lg.buf)
    assert r.complete and r.records == lg.records_of(len(lg.frames))
    no_snapend = encode_frame(POOL, 1, 1, [("begin", 1, 2), ("attrs", 1, 0o40755, 0, 0, 0, 0, 0)])
    assert not replay_half(POOL, no_snapend).complete


def test_half_must_start_with_begin():
    f = encode_frame(POOL, 1, 1, [("unlink", 1, b"x", 0), ("snapend",)])
    r = replay_half(POOL, f)
    assert r.records == [] and not r.complete
    assert replay_half(POOL, bytes(8 * BLOCK)).records == []


def test_frame_size():
    assert frame_size(0) == BLOCK
    assert frame_size(BLOCK - HDR) == BLOCK
    assert frame_size(BLOCK - HDR + 1) == 2 * BLOCK
