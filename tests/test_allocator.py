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
