"""The plan that moves a WRITE's payload onto the chunk grid (fuse/realign.py), and Arena.move
carrying it out over real arena memory: random runs, guesses and offsets, byte for byte."""
import random

import pytest
from hypothesis import given, settings, strategies as st

from ckptfs.fs.arena import Arena
from ckptfs.fuse import realign

CS = 4096  # the arena's smallest chunk: small runs, every case at once


def _adopts(r: int, length: int, cs: int) -> bool:
    """core.writev's rule, piece by piece over the layout at r (a partial last piece left out:
    whether it adopts depends on its chunk's contents)."""
    for i, begin, end in realign.layout(r, length, cs):
        size = end - begin
        if i == 0 and begin == r and size == cs - r and r <= size:
            return True
        if begin == 0 and size == cs:
            return True
    return False


@given(st.integers(0, 63), st.integers(0, 300))
def test_worth_says_whether_the_layout_has_a_piece_that_adopts(r, length):
    assert realign.worth(r, length, 64) == _adopts(r, length, 64)


@given(st.integers(0, 63), st.integers(0, 400))
def test_layout_cuts_the_payload_at_slot_boundaries_from_its_offset(start, length):
    pieces = realign.layout(start, length, 64)
    assert sum(end - begin for _, begin, end in pieces) == length
    assert len(pieces) == realign.slots_spanned(start, length, 64)
    assert [i for i, _, _ in pieces] == list(range(len(pieces)))
    for i, begin, end in pieces:
        assert 0 <= begin < end <= 64 and (begin == 0 or i == 0)
    if pieces:
        assert pieces[0][1] == start


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_moves_over_a_run_of_scattered_slots_put_every_byte_at_its_offset(data):
    """A payload read at position `guess` of a run of k + 1 slots scattered over the arena ends up
    at position r, byte for byte, whichever way it moves; slots outside the run are untouched."""
    k = data.draw(st.integers(1, 4))
    guess = data.draw(st.integers(0, CS - 1))
    r = data.draw(st.integers(0, CS - 1))
    length = data.draw(st.integers(1, (k + 1) * CS - max(guess, r)))
    arena = Arena(12 * CS, CS, prefault=False)
    try:
        rng = random.Random(data.draw(st.integers(0, 2**32)))
        run = rng.sample(range(arena.nslots), k + 1)
        for slot in range(arena.nslots):
            arena.view(slot)[:] = rng.randbytes(CS)
        before = [bytes(arena.view(slot)) for slot in range(arena.nslots)]
        payload = rng.randbytes(length)
        for (i, begin, end), p in zip(realign.layout(guess, length, CS), _cuts(payload, guess)):
            arena.view(run[i])[begin:end] = p
        arena.move(run, realign.moves(guess, r, length, CS))
        got = b"".join(bytes(arena.view(run[i])[begin:end]) for i, begin, end in realign.layout(r, length, CS))
        assert got == payload
        for slot in set(range(arena.nslots)) - set(run):
            assert bytes(arena.view(slot)) == before[slot]
    finally:
        arena.close()


def _cuts(payload: bytes, start: int):
    pos = 0
    for _, begin, end in realign.layout(start, len(payload), CS):
        yield payload[pos:pos + end - begin]
        pos += end - begin


def test_move_refuses_a_step_past_a_slot_or_outside_the_arena():
    arena = Arena(4 * CS, CS, prefault=False)
    try:
        for steps, slots in [([(0, CS - 10, 20)], [0, 1]), ([(0, 10, 0)], [0]), ([(0, 10, 5)], [7])]:
            with pytest.raises(ValueError, match="bad move"):
                arena.move(slots, steps)
    finally:
        arena.close()
    with pytest.raises(ValueError, match="closed"):
        arena.move([0], [(0, 10, 5)])
