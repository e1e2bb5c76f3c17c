"""Part buffers in memory the uploader process maps too, within the --replicate-memory budget.

A segment on its way to the object store is read (source.py) into a buffer of
the daemon, then signed and sent by the uploader process (uploader.py). The
buffers are carved from shared memory so the payload is never copied between
the two: region 0 is one memfd of exactly the budget, mapped MAP_SHARED by
both processes, and a call names its payload as (region, offset, length).

`Ranges` is the bookkeeping of region 0, pure: first-fit over the free
ranges, merged again as they come back; every range is a whole number of
pages (O_DIRECT reads go straight into a buffer). Parts of the usual size
(a segment) come and go in equal sizes and never fragment it; larger parts
may wait until enough neighbours come back, and once nothing is in use the
whole region is free.

`PartMemory.take(size)` waits until the budget has room (the backpressure of
replication's reads), first come first served: a buffer given back is handed
to the oldest waiter it fits, so a returned buffer wakes one task, not all
of them (the cost of an upload stays linear in its parts); a part larger than the whole budget waits until
nothing else is in use and then goes alone: the pages region 0 holds are
given back to the kernel (MADV_REMOVE) and the part gets a region of its own
(a memfd of its size, dropped when the part comes back), so the memory held
stays within max(budget, that part) as it always did. `regions` is what the
uploader must map; `give_back` returns a buffer.
"""
from __future__ import annotations

import mmap
import os
from collections import deque
from dataclasses import dataclass
from itertools import count

import trio

PAGE = mmap.PAGESIZE


class Ranges:
    """Free byte ranges of [0, capacity): take a page-rounded range, give it back."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.free: list[tuple[int, int]] = [(0, capacity)] if capacity else []  # (offset, size), by offset
        self.in_use = 0

    @staticmethod
    def rounded(size: int) -> int:
        return -(-size // PAGE) * PAGE

    def take(self, size: int) -> int | None:
        """The offset of a free range of `size` bytes (rounded up to pages), or None if none is free."""
        size = self.rounded(size)
        for i, (off, n) in enumerate(self.free):
            if n >= size:
                if n == size:
                    del self.free[i]
                else:
                    self.free[i] = (off + size, n - size)
                self.in_use += size
                return off
        return None

    def give(self, offset: int, size: int) -> None:
        """Free the range `take` returned at `offset` for `size` bytes; merged with its free neighbours."""
        size = self.rounded(size)
        i = 0
        while i < len(self.free) and self.free[i][0] < offset:
            i += 1
        if (i > 0 and self.free[i - 1][0] + self.free[i - 1][1] > offset) or \
                (i < len(self.free) and offset + size > self.free[i][0]) or offset + size > self.capacity:
            raise ValueError(f"range {offset}+{size} is not in use")
        self.free.insert(i, (offset, size))
        if i + 1 < len(self.free) and offset + size == self.free[i + 1][0]:
            self.free[i] = (offset, size + self.free.pop(i + 1)[1])
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == offset:
            self.free[i - 1] = (self.free[i - 1][0], self.free[i - 1][1] + self.free.pop(i)[1])
        self.in_use -= size

    def check_invariants(self) -> None:
        """INVARIANT: the free ranges are sorted, apart, inside the capacity, and with what is in use add up to it."""
        end = -1
        for off, n in self.free:
            assert n > 0 and off > end and off + n <= self.capacity, self.free
            end = off + n
        assert sum(n for _, n in self.free) + self.in_use == self.capacity, (self.free, self.in_use)


class Region:
    """A memfd of `size` bytes mapped MAP_SHARED here; the uploader maps its `fd` too."""

    def __init__(self, id: int, size: int):
        self.id = id
        self.size = size
        self.fd = os.memfd_create(f"ckptfs-parts-{id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self.map)

    def drop_pages(self) -> None:
        """Give the pages back to the kernel (they read as zeros after)."""
        self.map.madvise(mmap.MADV_REMOVE)

    def close(self) -> None:
        """Close the fd; the mapping goes once no buffer of it is referenced any more."""
        try:
            self.view.release()
        except BufferError:  # a buffer of it is still exported: unmapped when that goes
            pass
        os.close(self.fd)


@dataclass
class Part:
    """A part buffer: `view` is `size` bytes at `offset` of region `region`."""
    region: int
    offset: int
    size: int
    view: memoryview

    def body(self, n: int) -> list[int]:
        """How a call names the first `n` bytes (wire.py)."""
        return [self.region, self.offset, n]


class _Waiter:
    """A task waiting in `PartMemory.take` for `size` bytes; `part` is set just before `ready`."""

    def __init__(self, size: int):
        self.size = size
        self.part: Part | None = None
        self.ready = trio.Event()


class PartMemory:
    """Part buffers within `budget` bytes (at least one part) of shared memory."""

    def __init__(self, budget: int):
        self.budget = budget
        self.ranges = Ranges(budget)
        self._ids = count(1)
        self.regions: dict[int, Region] = {0: Region(0, budget)}
        self.waiters: deque[_Waiter] = deque()  # oldest first
        self.alone = 0  # bytes of the part that goes alone (0: none)

    @property
    def in_use(self) -> int:
        return self.ranges.in_use + self.alone

    def take_nowait(self, size: int) -> Part | None:
        """A buffer of `size` bytes if the budget has room for it now, else None."""
        if self.alone:
            return None
        if size <= self.budget:
            off = self.ranges.take(size)
            if off is None:
                return None
            return Part(0, off, size, self.regions[0].view[off:off + size])
        if self.ranges.in_use:
            return None
        self.regions[0].drop_pages()
        region = Region(next(self._ids), size)
        self.regions[region.id] = region
        self.alone = size
        return Part(region.id, 0, size, region.view[:size])

    async def take(self, size: int) -> Part:
        """A buffer of `size` bytes, once the budget has room for it (a part larger than the whole
        budget waits until nothing else is in use)."""
        if not self.waiters:
            part = self.take_nowait(size)
            if part is not None:
                return part
        waiter = _Waiter(size)
        self.waiters.append(waiter)
        try:
            await waiter.ready.wait()
        except BaseException:
            if waiter.part is not None:
                self.give_back(waiter.part)
            else:
                self.waiters.remove(waiter)
                self._serve()  # a smaller waiter behind this one may fit now
            raise
        return waiter.part

    def _serve(self) -> None:
        """Hand free room to the waiters, oldest first, while the oldest fits."""
        while self.waiters:
            part = self.take_nowait(self.waiters[0].size)
            if part is None:
                return
            waiter = self.waiters.popleft()
            waiter.part = part
            waiter.ready.set()

    def give_back(self, part: Part) -> None:
        part.view.release()
        if part.region == 0:
            self.ranges.give(part.offset, part.size)
        else:
            self.regions.pop(part.region).close()
            self.alone = 0
        self._serve()

    def statistics(self) -> "PartMemoryStats":
        return PartMemoryStats(self.budget, self.in_use, len(self.regions))

    def close(self) -> None:
        for region in self.regions.values():
            region.close()
        self.regions.clear()


@dataclass(frozen=True)
class PartMemoryStats:
    """One reading of the part buffers (`PartMemory.statistics()`): the budget, bytes lent, regions."""
    budget: int
    in_use: int
    regions: int
