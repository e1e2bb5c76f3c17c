"""Device space for what is not drained yet: may a new chunk be absorbed, may a chunk grow?

A write is acknowledged once its bytes are in memory, so before it adds a
chunk (or lets one grow) the store makes sure the devices could still hold
every chunk not yet drained; otherwise the write gets ENOSPC now instead of a
drain that finds no room later (DevicesFull). A chunk takes a whole unit when
it holds more than half a chunk, else a piece of a unit (allocator.py), so
what the undrained chunks need depends on their sizes.

Undrained means waiting (unsealed or queued) or taken by a drain worker and
not being written as it is now (drain.py `undrained`): a chunk whose current
bytes are being written has its space already, which the allocator counts as
used; one that changed meanwhile is counted again (that copy's space comes
back when its write ends). A chunk a commit holds that is written again
drains as it was and a copy takes its place: FileData asks for the copy as a
new chunk.

Fast path: while there are more free whole units than undrained chunks,
every one of them could have a whole unit, whatever its size: nothing to
count (the only check before pieces existed). Otherwise (a pool nearly
full, or many small files waiting) the chunks are counted by the piece each
would take at its size now, and `Allocator.fits` says whether they, and the
new or grown chunk, find room. Sizes change later only through this check
(a new chunk, a write that raises a chunk's high-water mark, or a cut that
lowers it into a smaller piece: that may need a unit split for its size even
though the piece it leaves is free), so the count stays true.

Counting walks every undrained chunk, so near full it is kept for a while:
`REUSE` checks use the last count plus what each check let in since (a new
chunk at its size; a grown one at its new size, its old size still counted),
and a refusal always counts again first. A chunk that needs space again
after the count (its extent released, or a drain's copy of it gone stale or
failed) drops the kept count (`changed`).

A chunk counts before the drain has hashed it, so with --dedupe on one that
will share an extent needs room until then: a refused write waits while the
drain takes what is queued, then checks again (store.py `wait_for_room`).
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable

from ..errors import DevicesFull
from ..fs.filemap import Chunk
from .allocator import Allocator

REUSE = 64  # checks a count serves near full (each adds what it let in)


class Reservation:
    """Whether the devices could hold every undrained chunk and one more or a grown one (`check`);
    it keeps the last count of what they need, renewed by `check`, dropped by `changed`."""

    def __init__(self, alloc: Allocator, count: Callable[[], int], chunks: Callable[[], Iterable[Chunk]]):
        self.alloc = alloc
        self.count = count  # how many chunks are undrained (cheap)
        self.chunks = chunks  # ... and which (a walk)
        self._kept: Counter | None = None  # the last count of pieces and units needed
        self._uses = 0  # checks left that may use it
        self._added: Counter = Counter()  # sizes let in since it was taken
        self.recounts = 0  # counts taken (statistics, tests)

    def check(self, chunk: Chunk | None = None, hwm: int | None = None) -> None:
        """Raise DevicesFull unless the devices could hold every undrained chunk and: a new chunk
        of `hwm` bytes (chunk None; hwm None: a whole unit), or `chunk` grown or cut to `hwm` bytes."""
        size = self._size(hwm)
        if chunk is not None and size == self._size(chunk.hwm):
            return  # within the piece (or unit) it will take anyway
        if self.alloc.free_units() > self.count():
            self._added[size] += 1  # (for a kept count: it must hold whatever came in since)
            return
        if self._kept is not None and self._uses > 0:
            self._uses -= 1
            demand = self._kept + self._added
            demand[size] += 1
            if self.alloc.fits(demand):
                self._added[size] += 1
                return
        demand = self._recount(chunk)
        demand[size] += 1
        if not self.alloc.fits(demand):
            raise DevicesFull("no space left on the devices")
        self._kept, self._uses, self._added = demand, REUSE, Counter()

    def changed(self) -> None:
        """A chunk needs device space again after the count (see the module doc): count afresh."""
        self._kept = None

    def _recount(self, growing: Chunk | None) -> Counter:
        """What the undrained chunks need by size, but for `growing` (the caller adds it)."""
        self.recounts += 1
        return Counter(self._size(c.hwm) for c in self.chunks() if c is not growing)

    def _size(self, hwm: int | None):
        return None if hwm is None else self.alloc.piece_size(hwm)
