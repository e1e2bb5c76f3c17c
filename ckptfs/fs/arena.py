"""The memory arena: one pre-faulted allocation carved into aligned chunks.

At mount, `--memory` bytes are mapped once (anonymous mmap, in transparent
huge pages where the kernel has them), faulted in so that writes take no
page faults (fs/prefault.py), and cut into `chunk_size` slots. The mapping is
page-aligned and `chunk_size` is a power of two >= 4 KiB, so every slot is
4 KiB-aligned: a slot can be handed to an O_DIRECT write as it is.

A slot is the unit of absorb, drain and eviction. The arena only counts: it
hands out free slot numbers and takes them back. Who waits for room, and
when a full arena means ENOSPC or backpressure, is decided above it.

A slot may also be lent (`lend_nowait`) to a FUSE worker as one of the
buffers its next request is read into: the kernel copies a WRITE's payload
straight into them, one chunk per slot, and each piece that is exactly one
chunk then keeps its slot as that chunk's memory (`adopt`). Lent slots count
as used, so memory stays within the budget. A worker may move a payload
between the slots lent to it (`move`, plain memmove by address, GIL released)
to lay it on the chunk grid before it is served (fuse/realign.py).

INVARIANT: every slot number is either in `_free`, lent, or owned by exactly
one chunk (in a file, or pinned by a commit or a reply); `used + free == nslots`.
"""
from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass

from ..errors import NoSpace, UsageError
from .prefault import ask_huge_pages, fault_in, huge_pages_length

MIN_CHUNK = 4096
DEFAULT_CHUNK = 1 << 20


@dataclass(frozen=True)
class ArenaStats:
    """One reading of the arena (`Arena.statistics()`): its sizes, slots used and free, and how
    many allocations and full-arena refusals there have been."""
    capacity: int
    chunk_size: int
    slots: int
    used_slots: int
    free_slots: int
    allocations: int
    full_events: int


class Arena:
    """The `--memory` mapping cut into `chunk_size` slots. It owns the free list and the lent set:
    the chunk owner and the drain take and free slots, the facade lends them to FUSE workers."""

    def __init__(self, capacity: int, chunk_size: int = DEFAULT_CHUNK, *, prefault: bool = True):
        if chunk_size < MIN_CHUNK or chunk_size & (chunk_size - 1):
            raise UsageError(f"bad chunk size {chunk_size}: must be a power of two >= {MIN_CHUNK}")
        nslots = capacity // chunk_size
        if nslots < 2:
            raise UsageError(f"memory budget {capacity} bytes is too small: need at least 2 chunks of {chunk_size} bytes")
        self.chunk_size = chunk_size
        self.nslots = nslots
        self._map = mmap.mmap(-1, huge_pages_length(nslots * chunk_size), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        ask_huge_pages(self._map)
        self._view = memoryview(self._map)
        self._cref = ctypes.c_char.from_buffer(self._map)  # an export of the mapping, for its address
        self._base = ctypes.addressof(self._cref)
        if prefault:
            fault_in(self._base, self.capacity)
        self._free: list[int] = list(range(nslots - 1, -1, -1))
        self._allocations = 0
        self._full_events = 0
        self._lent: set[int] = set()

    @property
    def capacity(self) -> int:
        return self.nslots * self.chunk_size

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.nslots - len(self._free)

    def alloc_nowait(self) -> int:
        """A free slot number; raises NoSpace when every slot is taken."""
        if not self._free:
            self._full_events += 1
            raise NoSpace("memory arena is full")
        self._allocations += 1
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def lent_slots(self) -> int:
        return len(self._lent)

    def lend_nowait(self) -> int:
        """A free slot lent as a receive buffer (counted as used); raises NoSpace when none is free."""
        slot = self.alloc_nowait()
        self._lent.add(slot)
        return slot

    def is_lent(self, slot: int) -> bool:
        return slot in self._lent

    def adopt(self, slot: int) -> None:
        """A lent slot becomes a chunk's memory."""
        self._lent.remove(slot)

    def unlend(self, slot: int) -> None:
        """A lent slot comes back unused."""
        self._lent.remove(slot)
        self.free(slot)

    def view(self, slot: int) -> memoryview:
        """The slot's bytes, writable, `chunk_size` long, 4 KiB-aligned."""
        start = slot * self.chunk_size
        return self._view[start:start + self.chunk_size]

    def move(self, slots, steps) -> None:
        """Copy bytes between positions of the run `slots` (position p: byte p % chunk_size of
        slot slots[p // chunk_size]) as `steps` say ((to, frm, n), realign.moves), with
        memmove: the GIL is released meanwhile. The slots must be the caller's own (lent to it)."""
        cs, base, memmove = self.chunk_size, self._base, ctypes.memmove
        if self._cref is None:
            raise ValueError("the arena is closed")
        for to, frm, n in steps:
            a, b = slots[to // cs], slots[frm // cs]
            if not (0 < n <= cs - max(to % cs, frm % cs) and 0 <= a < self.nslots and 0 <= b < self.nslots):
                raise ValueError(f"bad move of {n} bytes from {frm} to {to} in slots {a}, {b}")
            memmove(base + a * cs + to % cs, base + b * cs + frm % cs, n)

    def owns(self, view: memoryview) -> bool:
        """Whether `view` is a view of this arena's memory."""
        return view.obj is self._map

    def statistics(self) -> ArenaStats:
        return ArenaStats(self.capacity, self.chunk_size, self.nslots, self.used_slots,
                          self.free_slots, self._allocations, self._full_events)

    def check_invariants(self) -> None:
        assert len(set(self._free)) == len(self._free), "slot freed twice"
        assert all(0 <= s < self.nslots for s in self._free), "foreign slot in free list"
        assert not self._lent.intersection(self._free), "lent slot in free list"

    def close(self) -> None:
        self._cref = None  # the export goes first: the mapping cannot close while it is held
        self._view.release()
        self._map.close()
