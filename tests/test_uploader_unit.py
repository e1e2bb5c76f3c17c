"""The uploader's pure parts, without S3: the wire codec (wire.py) and the shared part memory
(partmem.py): framing fed a byte at a time, errors keeping their types, the free-range
bookkeeping against a model, and the budget's rules (room to wait for; a part larger than the
budget goes alone, in a region of its own)."""
from __future__ import annotations

import os
import random

import pytest
import trio

from ckptfs.replicate import wire
from ckptfs.replicate.client import NETWORK, OTHER, UPLOADER, S3Error
from ckptfs.replicate.manifest import BadManifest
from ckptfs.replicate.partmem import PAGE, PartMemory, Ranges

MiB = 1 << 20


def test_frames_decode_the_same_whether_fed_at_once_or_a_byte_at_a_time():
    msgs = [({"op": "call", "name": "put", "args": ["objects/a", 3], "body": [0, 4096, 123]}, 7, b""),
            ({"ok": wire.BLOB}, 8, os.urandom(100_000)),
            ({"error": {"type": "S3Error", "cause": "other", "message": "gone"}}, 9, b""),
            ({"ping": True, "text": "é\n\u2028"}, 0, b"\x00" * 3)]
    stream = b"".join(wire.frame(m, i, b) for m, i, b in msgs)
    want = [(i, m, b) for m, i, b in msgs]
    assert wire.Decoder().feed(stream) == want
    dec, got = wire.Decoder(), []
    for k in range(len(stream)):
        got += dec.feed(stream[k:k + 1])
    assert got == want and not dec.buf
    dec, got, rng = wire.Decoder(), [], random.Random(1)
    pos = 0
    while pos < len(stream):
        n = rng.randrange(1, 5000)
        got += dec.feed(stream[pos:pos + n])
        pos += n
    assert got == want


@pytest.mark.parametrize("bad", [
    wire.HEADER.pack(wire.MAX_FRAME + 1, 1, 2),  # too long
    wire.HEADER.pack(12, 1, 100),  # json longer than the frame
    wire.HEADER.pack(12 + 3, 1, 3) + b"{x}",  # not json
    wire.HEADER.pack(12 + 2, 1, 2) + b"[]",  # not an object
])
def test_a_garbled_stream_is_a_wire_error(bad):
    with pytest.raises(wire.WireError):
        wire.Decoder().feed(bad)


def test_errors_arrive_as_the_types_they_were_raised_as():
    for exc in (S3Error(NETWORK, "cannot reach the object store"), S3Error(OTHER, "no such object"),
                BadManifest("manifests/0000000001.json: not a ckptfs manifest"),
                S3Error(UPLOADER, "the uploader process died")):
        msg = wire.Decoder().feed(wire.frame({"error": wire.error(exc)}, 3))[0][1]
        back = wire.exception(msg["error"])
        assert type(back) is type(exc) and str(back) == str(exc)
        assert getattr(back, "cause", None) == getattr(exc, "cause", None)
    back = wire.exception(wire.error(KeyError("x")))  # anything else: an S3Error of cause other
    assert type(back) is S3Error and back.cause == OTHER and "KeyError" in str(back)


def test_a_frame_over_the_limit_is_refused_when_made_and_when_read(monkeypatch):
    ok = wire.frame({"x": 1}, 1, b"\0" * 50)
    monkeypatch.setattr(wire, "MAX_FRAME", 40)
    with pytest.raises(wire.WireError):
        wire.frame({"x": 1}, 1, b"\0" * 50)
    with pytest.raises(wire.WireError):
        wire.Decoder().feed(ok)


def test_ranges_against_a_model_of_what_is_in_use():
    rng = random.Random(7)
    cap = 64 * PAGE
    r = Ranges(cap)
    used: dict[int, int] = {}  # offset -> rounded size
    for _ in range(3000):
        if used and rng.random() < 0.45:
            off = rng.choice(list(used))
            r.give(off, used.pop(off))
        else:
            size = rng.randrange(1, 9 * PAGE)
            off = r.take(size)
            rounded = Ranges.rounded(size)
            taken = sorted(used.items())
            fits = any(b - a >= rounded for a, b in _gaps(taken, cap))
            assert (off is not None) == fits  # first fit finds room whenever there is a gap big enough
            if off is not None:
                assert off % PAGE == 0 and all(off + rounded <= o or o + n <= off for o, n in taken)
                used[off] = rounded
        r.check_invariants()
        assert r.in_use == sum(used.values())
    for off, n in list(used.items()):
        r.give(off, n)
    assert r.free == [(0, cap)] and r.in_use == 0


def _gaps(taken: list[tuple[int, int]], cap: int):
    pos = 0
    for off, n in taken:
        yield pos, off
        pos = off + n
    yield pos, cap


def test_giving_back_a_range_not_in_use_is_refused():
    r = Ranges(8 * PAGE)
    off = r.take(PAGE)
    r.give(off, PAGE)
    with pytest.raises(ValueError):
        r.give(off, PAGE)
    with pytest.raises(ValueError):
        r.give(6 * PAGE, 4 * PAGE)


def test_part_memory_waits_for_room_and_a_huge_part_goes_alone():
    async def main():
        mem = PartMemory(4 * MiB)
        a = await mem.take(2 * MiB)
        b = await mem.take(2 * MiB)
        assert mem.in_use == 4 * MiB and mem.take_nowait(MiB) is None  # the budget is full
        a.view[:5] = b"hello"
        assert mem.regions[0].map[a.offset:a.offset + 5] == b"hello"  # the shared region, no copy
        assert a.body(5) == [0, a.offset, 5]
        got = []

        async def huge():
            got.append(await mem.take(6 * MiB))  # more than the whole budget: waits for nothing in use

        async with trio.open_nursery() as n:
            n.start_soon(huge)
            await trio.sleep(0.01)
            assert not got
            mem.give_back(a)
            await trio.sleep(0.01)
            assert not got  # b is still out
            mem.give_back(b)
            await trio.sleep(0.01)
            assert got
        big = got[0]
        assert big.region != 0 and big.size == 6 * MiB and len(mem.regions) == 2
        assert mem.regions[0].map[a.offset:a.offset + 5] == bytes(5)  # region 0's pages were given back
        assert mem.take_nowait(MiB) is None  # it goes alone: nothing else meanwhile
        mem.give_back(big)
        assert list(mem.regions) == [0] and mem.in_use == 0
        c = mem.take_nowait(4 * MiB)  # the whole budget is one free range again
        assert c is not None and c.offset == 0
        mem.give_back(c)
        mem.ranges.check_invariants()
        mem.close()

    trio.run(main)


def test_a_buffer_given_back_wakes_one_waiter_first_come_first_served():
    """2,560 parts (a 20 GiB file of 8 MiB parts) wait on a budget of 4: each buffer given back is handed
    to the oldest waiter, so the attempts to take a buffer grow linearly with the parts (not with
    their square), and a cancelled waiter leaves nothing behind."""
    parts, budget = 2560, 4

    async def main():
        mem = PartMemory(budget * MiB)
        attempts = 0
        take_nowait = mem.take_nowait

        def counted(size):
            nonlocal attempts
            attempts += 1
            return take_nowait(size)

        mem.take_nowait = counted
        order = []

        async def part(i: int) -> None:
            buf = await mem.take(MiB)
            order.append(i)
            await trio.sleep(0)
            mem.give_back(buf)

        async with trio.open_nursery() as n:
            for i in range(parts):
                n.start_soon(part, i)
                await trio.sleep(0)  # start in order: part i asks before part i + 1
        assert order == list(range(parts)) and mem.in_use == 0 and not mem.waiters
        assert attempts <= 3 * parts, attempts

        held = [await mem.take(MiB) for _ in range(budget)]
        with trio.move_on_after(0.01):
            await mem.take(MiB)  # cancelled while waiting
        assert not mem.waiters
        for b in held:
            mem.give_back(b)
        assert mem.in_use == 0
        mem.close()

    trio.run(main)
