"""The reservation before a chunk is absorbed (store/reserve.py), on a real Allocator. Pure."""
import random
from collections import Counter

import pytest

from ckptfs.errors import DevicesFull, NoSpace
from ckptfs.store.allocator import Allocator
from ckptfs.store.reserve import REUSE, Reservation

PER = 256  # 4 KiB addresses per 1 MiB unit
MiB = 1 << 20


class C:
    """A chunk as the reservation sees it."""

    def __init__(self, hwm):
        self.hwm = hwm


def setup(units):
    a = Allocator(units, PER)
    undrained: list[C] = []
    return a, undrained, Reservation(a, lambda: len(undrained), lambda: iter(undrained))


def admit(r, undrained, hwm):
    r.check(None, hwm)
    c = C(hwm)
    undrained.append(c)
    return c


def test_small_chunks_count_as_pieces_not_units():
    a, undrained, r = setup([2, 2])
    for _ in range(4):
        admit(r, undrained, 3000)  # free units > undrained: nothing counted
    assert r.recounts == 0
    for _ in range(100):  # the rule before pieces refused the fifth: 4 free units
        admit(r, undrained, 3000)
    assert r.recounts >= 1
    for _ in range(3):  # whole chunks: 3 units, the 104 pieces one more
        admit(r, undrained, None)
    with pytest.raises(DevicesFull):
        r.check(None, None)
    with pytest.raises(DevicesFull):
        r.check(undrained[0], MiB)  # a small one growing into a whole one: no unit left for it
    r.check(undrained[0], 4096)  # growing within its piece size
    assert isinstance(DevicesFull("x"), NoSpace)


def test_a_kept_count_serves_a_while_and_a_refusal_counts_afresh():
    a, undrained, r = setup([3])
    for _ in range(3):
        admit(r, undrained, 3000)
    n = r.recounts
    for _ in range(REUSE + 1):
        admit(r, undrained, 3000)
    assert r.recounts == n + 1  # one count, then REUSE checks on it, each adding its piece
    admit(r, undrained, 3000)
    assert r.recounts == n + 2
    r.changed()
    admit(r, undrained, 3000)
    assert r.recounts == n + 3
    admit(r, undrained, None)
    admit(r, undrained, None)  # 2 whole units, the third holds the pieces
    before = r.recounts
    with pytest.raises(DevicesFull):
        r.check(None, None)
    assert r.recounts == before + 1  # the kept count said no: counted afresh before refusing


def test_random_admissions_always_drain_and_refusals_are_real():
    """A model: chunks are admitted (new, or grown) through the reservation while others drain
    (take their extent from the allocator), are dropped, or are deleted after draining. After
    every step every undrained chunk can still be allocated; every refusal is one an exact
    count also refuses."""
    for seed in range(150):
        rng = random.Random(seed)
        a, undrained, r = setup([rng.randrange(1, 6) for _ in range(rng.randrange(1, 4))])
        drained: list[tuple[int, int]] = []
        sizes = [1, 3000, 9000, 70_000, 300_000, 600_000, MiB]
        for _ in range(400):
            op = rng.random()
            if op < 0.45:
                hwm = rng.choice(sizes)
                exact = Counter(a.piece_size(c.hwm) for c in undrained) + Counter([a.piece_size(hwm)])
                try:
                    admit(r, undrained, hwm)
                except DevicesFull:
                    assert not a.fits(exact), (seed, exact)
            elif op < 0.6 and undrained:
                c = rng.choice(undrained)
                hwm = min(MiB, c.hwm + rng.choice(sizes))
                exact = Counter(a.piece_size(x.hwm) for x in undrained if x is not c) + \
                    Counter([a.piece_size(hwm)])
                try:
                    r.check(c, hwm)
                    c.hwm = hwm
                except DevicesFull:
                    assert not a.fits(exact), (seed, exact)
            elif op < 0.85 and undrained:
                c = undrained.pop(rng.randrange(len(undrained)))
                drained.append(a.alloc(rng.randrange(a.ndev), c.hwm))  # never NoSpace: see below
            elif op < 0.92 and undrained:
                undrained.pop(rng.randrange(len(undrained)))  # deleted before it drained
            elif drained and rng.random() < 0.5:  # deleted after it drained
                a.release(*drained.pop(rng.randrange(len(drained))))
            elif drained:  # written again: checked while its old extent still counts, then freed
                hwm = rng.choice(sizes)
                try:
                    r.check(None, hwm)
                except DevicesFull:
                    continue
                a.release(*drained.pop(rng.randrange(len(drained))))
                undrained.append(C(hwm))
                r.changed()
            assert a.fits(Counter(a.piece_size(c.hwm) for c in undrained)), seed
        a.check_invariants()


def test_file_data_asks_for_room_for_what_each_write_adds():
    """FileData calls reserve for a new chunk at the size the write gives it, for a chunk that
    grows past its piece size, and as a new chunk for a copy of one a commit holds (that one
    still drains as it was): nothing becomes undrained without the check."""
    from ckptfs.fs.arena import Arena
    from ckptfs.fs.filemap import FileData, MemoryOwner

    class Recording(MemoryOwner):
        def __init__(self, arena):
            super().__init__(arena)
            self.asked = []

        def reserve(self, chunk=None, hwm=None):
            self.asked.append(("new" if chunk is None else "grow", hwm))

    cs = 64 << 10
    owner = Recording(Arena(16 * cs, cs))
    fd = FileData(owner, 5)
    fd.write(0, b"a" * 3000)
    fd.write(3000, b"b" * 1000)
    fd.write(4000, b"c" * 10_000)
    assert owner.asked == [("new", 3000), ("grow", 4000), ("grow", 14_000)]
    owner.asked.clear()
    fd.chunks[0].pins = 1  # a commit captured it
    fd.write(0, b"d" * 100)  # within what it holds: a copy, new device space
    assert owner.asked == [("new", 14_000)]
    owner.asked.clear()
    fd.write(cs - 10, b"e" * 20)  # the tail of chunk 0, the head of a new chunk 1
    assert owner.asked == [("grow", cs), ("new", 10)]
