"""The allocator: reference-counted data units per device, placement, NoSpace (pure)."""
import random

import pytest

from ckptfs.store.allocator import Allocator
from ckptfs.errors import NoSpace


def test_alloc_hands_out_fresh_units_in_order_then_reuses_freed():
    a = Allocator([4, 4])
    assert [a.alloc(0) for _ in range(3)] == [(0, 0), (0, 1), (0, 2)]
    assert a.refs(0, 1) == 1 and a.free_units(0) == 1 and a.free_units() == 5
    a.release(0, 1)
    assert a.refs(0, 1) == 0 and a.free_units(0) == 2
    assert a.alloc(0) == (0, 1)  # the freed unit comes back before a fresh one
    assert a.alloc(0) == (0, 3)
    a.check_invariants()


def test_claim_and_release_count_references():
    a = Allocator([8])
    dev, unit = a.alloc(0)
    a.claim(dev, unit)
    a.claim(dev, unit)
    assert a.refs(dev, unit) == 3
    a.release(dev, unit)
    a.release(dev, unit)
    assert a.refs(dev, unit) == 1 and a.used_units() == 1
    a.release(dev, unit)
    assert a.refs(dev, unit) == 0 and a.used_units() == 0 and a.free_units() == 8
    a.check_invariants()


def test_release_of_an_unreferenced_unit_is_an_error():
    a = Allocator([2])
    with pytest.raises(KeyError):
        a.release(0, 0)


def test_claim_beyond_the_fresh_mark_frees_the_gap():
    a = Allocator([10, 10])
    a.claim(1, 6)  # rebuilding at mount: a record names unit 6 first
    assert a.refs(1, 6) == 1 and a.free_units(1) == 9 and a.used_units() == 1
    a.check_invariants()
    got = {a.alloc(1)[1] for _ in range(9)}
    assert got == set(range(10)) - {6}
    assert a.free_units(1) == 0
    a.check_invariants()
    a.claim(1, 2)  # below the mark, already referenced: just one more reference
    assert a.refs(1, 2) == 2


def test_claim_of_a_freed_unit_below_the_mark():
    a = Allocator([10])
    a.claim(0, 5)
    a.claim(0, 2)  # in the gap freed by the first claim
    assert a.refs(0, 2) == 1 and a.free_units(0) == 8
    a.check_invariants()
    assert 2 not in {a.alloc(0)[1] for _ in range(8)}
    a.check_invariants()


def test_claim_outside_the_pool_is_refused():
    a = Allocator([4, 4])
    for dev, unit in ((0, 4), (0, -1), (2, 0), (-1, 0)):
        with pytest.raises(ValueError):
            a.claim(dev, unit)
    assert a.used_units() == 0


def test_preferred_device_rotates_with_inode_and_chunk():
    a = Allocator([100] * 4)
    assert [a.preferred(7, i) for i in range(6)] == [3, 0, 1, 2, 3, 0]
    assert [a.preferred(ino, 0) for ino in range(5)] == [0, 1, 2, 3, 0]
    for ino in range(3):
        for idx in range(8):
            dev, _ = a.alloc(a.preferred(ino, idx))
            assert dev == (ino + idx) % 4


def test_full_device_falls_back_to_the_one_with_most_free_units():
    a = Allocator([2, 5, 3])
    a.alloc(0)
    a.alloc(0)
    assert a.free_units(0) == 0
    assert a.alloc(0)[0] == 1  # 5 free beats 3
    a.alloc(1)
    a.alloc(1)
    a.alloc(1)  # device 1: 1 free, device 2: 3 free
    assert a.alloc(0)[0] == 2
    a.check_invariants()


def test_no_space_when_every_device_is_full():
    a = Allocator([2, 1])
    got = [a.alloc(i % 2) for i in range(3)]
    assert sorted(got) == [(0, 0), (0, 1), (1, 0)]
    with pytest.raises(NoSpace):
        a.alloc(0)
    with pytest.raises(NoSpace):
        a.alloc(1)
    a.check_invariants()
    a.release(1, 0)
    assert a.alloc(0) == (1, 0)  # room again, on the other device


def test_zero_unit_device():
    a = Allocator([0, 3])
    assert a.alloc(0)[0] == 1
    a.check_invariants()


def test_random_operations_keep_invariants():
    rng = random.Random(1234)
    units = [rng.randrange(1, 40) for _ in range(3)]
    a = Allocator(units)
    model: dict[tuple[int, int], int] = {}
    for _ in range(5000):
        op = rng.random()
        if op < 0.4:
            try:
                key = a.alloc(rng.randrange(3))
            except NoSpace:
                assert sum(units) == len(model)
                continue
            assert key not in model and 0 <= key[1] < units[key[0]]
            model[key] = 1
        elif op < 0.55:
            dev = rng.randrange(3)
            key = (dev, rng.randrange(units[dev]))
            a.claim(*key)
            model[key] = model.get(key, 0) + 1
        elif model:
            key = rng.choice(sorted(model))
            a.release(*key)
            model[key] -= 1
            if not model[key]:
                del model[key]
        a.check_invariants()
        assert a.used_units() == len(model)
        assert a.free_units() == sum(units) - len(model)
        for d in range(3):
            assert a.free_units(d) == units[d] - sum(1 for k in model if k[0] == d)
    for key, n in model.items():
        assert a.refs(*key) == n


# ---- pieces (pools of format version 3: addresses in 4 KiB blocks, 256 per 1 MiB unit) ----

PER = 256


def test_small_extents_share_a_unit_in_pieces_of_a_power_of_two_blocks():
    a = Allocator([4, 4], PER)
    assert [a.piece_size(n) for n in (0, 1, 4096, 4097, 3 * 4096, 512 << 10, (512 << 10) + 1)] == \
        [1, 1, 1, 2, 4, 128, None]
    assert Allocator([4], 1).piece_size(1) is None  # a version-2 pool: always whole units
    got = [a.alloc(0, 3000) for _ in range(3)]
    assert got == [(0, 0), (0, 1), (0, 2)]  # three 4 KiB pieces of unit 0
    assert a.alloc(0, 10_000) == (0, PER)  # another size: its own unit (1), a piece of 4 blocks
    assert a.alloc(0, 10_000) == (0, PER + 4)
    assert a.alloc(0) == (0, 2 * PER)  # a whole unit
    assert a.used_units() == 3 and a.free_units(0) == 1
    a.check_invariants()
    for dev, addr in got:
        a.release(dev, addr)
    assert a.used_units() == 2 and a.free_units(0) == 2  # unit 0 is whole and free again
    a.check_invariants()


def test_a_full_unit_of_pieces_moves_on_and_freed_pieces_are_reused():
    a = Allocator([3], PER)
    size = 128 << 10  # 32 blocks: 8 pieces per unit
    got = [a.alloc(0, size) for _ in range(9)]
    assert [addr // PER for _, addr in got] == [0] * 8 + [1]
    assert a.free_units(0) == 1
    a.release(*got[3])
    assert a.alloc(0, size) == got[3]  # a split unit with room before a new one
    a.check_invariants()


def test_pieces_go_elsewhere_when_the_preferred_device_is_full():
    a = Allocator([1, 2], PER)
    a.alloc(0)
    assert a.alloc(0, 100)[0] == 1
    b = Allocator([1, 1], PER)
    first = b.alloc(1, 100)
    b.alloc(0)
    assert b.alloc(0, 100) == (1, first[1] + 1)  # device 0 full: a split unit of device 1
    with pytest.raises(NoSpace):
        b.alloc(1, 100_000)  # pieces of another size need a unit of their own: none is left
    with pytest.raises(NoSpace):
        b.alloc(0)
    b.check_invariants()


def test_a_piece_takes_a_free_piece_of_its_size_on_another_device_before_a_new_unit():
    a = Allocator([4, 4], PER)
    first = a.alloc(1, 3000)
    assert a.alloc(0, 3000) == (1, first[1] + 1)  # device 0 has room, but device 1 a free piece
    assert a.used_units() == 1 and a.free_pieces(1) == PER - 2
    assert a.alloc(0, 10_000)[0] == 0  # no free piece of that size anywhere: a unit of device 0
    a.check_invariants()


def test_fits_counts_free_pieces_then_units_split_for_each_size():
    a = Allocator([2, 1], PER)
    assert a.fits({None: 3}) and not a.fits({None: 4})
    assert a.fits({1: 3 * PER}) and not a.fits({1: 3 * PER + 1})
    assert a.fits({None: 2, 1: PER}) and not a.fits({None: 2, 1: PER, 128: 1})
    a.alloc(0, 3000)  # one 4 KiB piece: unit split, PER - 1 free pieces of size 1
    assert a.free_pieces(1) == PER - 1 and a.free_units() == 2
    assert a.fits({1: PER - 1, None: 2}) and not a.fits({1: PER, None: 2})
    assert a.fits({1: PER - 1 + PER, None: 1})
    assert a.fits({}) and a.fits({None: 0})


def test_fits_says_exactly_whether_the_extents_would_find_room():
    """A random model: after random allocations and releases, `fits(demand)` is True exactly
    when allocating every extent of `demand` (on a copy, from random devices, in random order)
    succeeds."""
    import copy
    rng = random.Random(7)
    lengths = [None, 1, 5000, 9000, 70_000, 300_000, 500_000, 600_000]
    for _ in range(300):
        a = Allocator([rng.randrange(0, 6) for _ in range(rng.randrange(1, 4))], PER)
        held = []
        for _ in range(rng.randrange(0, 60)):
            if held and rng.random() < 0.3:
                a.release(*held.pop(rng.randrange(len(held))))
                continue
            try:
                held.append(a.alloc(rng.randrange(a.ndev), rng.choice(lengths)))
            except NoSpace:
                pass
        want = [rng.choice(lengths) for _ in range(rng.randrange(0, 40))]
        demand: dict = {}
        for n in want:
            size = None if n is None else a.piece_size(n)
            demand[size] = demand.get(size, 0) + 1
        b = copy.deepcopy(a)
        try:
            for n in want:
                b.alloc(rng.randrange(b.ndev), n)
            ok = True
        except NoSpace:
            ok = False
        assert a.fits(demand) == ok, (demand, a.free_units(), a._free_pieces)
        b.check_invariants()


def test_claim_rebuilds_pieces_from_lengths_and_refuses_overlaps():
    a = Allocator([4], PER)
    a.claim(0, PER + 8, 10_000)  # a 4-block piece at block 8 of unit 1
    a.claim(0, PER + 8)  # one more reference (pinning): no length needed
    assert a.refs(0, PER + 8) == 2 and a.used_units() == 1
    a.check_invariants()
    for addr, length in ((PER + 9, 10_000), (PER + 16, 3000), (PER, None), (PER + 2, 1 << 20)):
        with pytest.raises(ValueError):
            a.claim(0, addr, length)  # misaligned, another size in the same unit, a whole unit over it
    a.claim(0, 0)  # whole unit 0
    with pytest.raises(ValueError):
        a.claim(0, 4, 3000)  # a piece inside it
    assert a.alloc(0, 10_000) == (0, PER)  # the free pieces of unit 1 are handed out
    a.check_invariants()
    a.release(0, PER + 8)
    a.release(0, PER + 8)
    a.release(0, PER)
    assert a.used_units() == 1 and a.free_units(0) == 3
    a.check_invariants()


def test_random_pieces_never_overlap_and_free_units_come_back():
    """A model of what is referenced: extents as block ranges; none may overlap while referenced,
    and once all are released every unit is free again."""
    rng = random.Random(99)
    units = [rng.randrange(1, 12) for _ in range(3)]
    a = Allocator(units, PER)
    model: dict[tuple[int, int], list] = {}  # (dev, addr) -> [refs, blocks it spans]
    for _ in range(6000):
        op = rng.random()
        if op < 0.5:
            length = rng.choice([None, rng.randrange(1, 1 << 20), rng.randrange(1, 20_000)])
            try:
                key = a.alloc(rng.randrange(3), length)
            except NoSpace:
                continue
            size = PER if length is None else (a.piece_size(length) or PER)
            assert key not in model and key[1] % size == 0
            start, end = key[1], key[1] + size
            for (d, other), (_, span) in model.items():
                assert d != key[0] or end <= other or other + span <= start, "overlapping extents"
            model[key] = [1, size]
        elif op < 0.6 and model:
            key = rng.choice(sorted(model))
            a.claim(*key)
            model[key][0] += 1
        elif model:
            key = rng.choice(sorted(model))
            a.release(*key)
            model[key][0] -= 1
            if not model[key][0]:
                del model[key]
        a.check_invariants()
    rebuilt = Allocator(units, PER)  # what a mount rebuilds from the same extents
    for (dev, addr), (n, size) in model.items():
        for _ in range(n):
            rebuilt.claim(dev, addr, size * 4096 if size < PER else None)
    rebuilt.check_invariants()
    assert rebuilt.free_units() == a.free_units()
    for key, (n, _) in model.items():
        assert a.refs(*key) == n == rebuilt.refs(*key)
        for _ in range(n):
            a.release(*key)
    assert a.free_units() == sum(units) and a.used_units() == 0
    a.check_invariants()
