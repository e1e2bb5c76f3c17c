"""Device space: data units per device, small pieces of them, with reference counts. Pure.

A device's data area is cut into units of chunk_size bytes. An extent names
where it starts by an address (`Extent.unit`) counted in `grain` bytes from
the data area: in pools formatted before version 3 the grain is the chunk
size, so an address is a unit and every extent takes a whole unit. From
version 3 the grain is 4 KiB (`per_unit` = chunk_size / 4 KiB addresses per
unit): a whole chunk still takes a whole unit (address unit x per_unit), but
a chunk of at most half a unit (a small file, a file's last chunk) takes a
*piece*: a unit is split into equal pieces of a power of two of 4 KiB blocks,
the smallest that holds the chunk, and pieces of one size are handed out
until the unit is full. A split unit is whole again once its last piece is
freed. So a 3 KiB file takes 4 KiB of a device, not a whole chunk, and a
piece wastes less than half of itself.

An extent is referenced by the live chunk that drained into it and by the
durable state once a journal record names it; it is free again only when no
one refers to it. Nothing of this is stored on the devices: at mount the
counts are rebuilt from the replayed journal (`claim` with each extent's
length, which says whether it is a piece and of which size), so space held by
data that was written but never committed (a crash mid-drain) is free again.
A claim that overlaps what is claimed already is refused (ValueError).

Placement: chunk i of inode n goes to device (i + n) mod N, so stripes start
on different devices for different files (many small files still spread), and
falls back to the device with the most free units when that one is full. A
piece goes into a split unit with a free piece of its size, on its device if
it has one, else on any device; only when none has one is a unit split. So a
piece never takes a whole unit while a piece of its size is free somewhere,
and `fits` can tell exactly whether extents of given lengths would all find
room (the store's reservation before it absorbs a new chunk, store.py).

INVARIANT: every unit of a device is free, referenced whole (at address
unit x per_unit), or split; a split unit's pieces are free or referenced.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import NoSpace
from ..format.layout import BLOCK, round_up


@dataclass
class _Split:
    """A unit cut into pieces of `size` addresses; `free`: offsets in the unit of the free ones."""
    size: int
    free: set[int] = field(default_factory=set)


class Allocator:
    """Every device's data units: free, split into pieces, or referenced, and how often. The drain
    allocates, the store releases, and the durable state claims and releases as records apply."""

    def __init__(self, units_per_device: list[int], per_unit: int = 1):
        if per_unit < 1 or per_unit & (per_unit - 1):
            raise ValueError(f"addresses per unit must be a power of two, not {per_unit}")
        self.units = list(units_per_device)
        self.per_unit = per_unit
        # units >= _fresh[d] have never been handed out; _freed[d] holds returned ones below it
        self._fresh = [0] * len(self.units)
        self._freed: list[set[int]] = [set() for _ in self.units]
        self._refs: dict[tuple[int, int], int] = {}  # (dev, address) -> references
        self._split: dict[tuple[int, int], _Split] = {}  # (dev, unit) -> its pieces
        self._partial: dict[tuple[int, int], set[int]] = {}  # (dev, piece size) -> split units with a free piece
        self._free_pieces: dict[int, int] = {}  # piece size -> free pieces of split units, all devices
        self._free_total = sum(self.units)  # free_units() of all devices (the reservation asks per write)
        self.on_free = None  # called with (dev, address) when an extent's last reference goes (dedupe.py)

    @property
    def ndev(self) -> int:
        return len(self.units)

    def free_units(self, dev: int | None = None) -> int:
        """Whole units free (a split unit's free pieces do not count)."""
        if dev is None:
            return self._free_total
        return self.units[dev] - self._fresh[dev] + len(self._freed[dev])

    def used_units(self) -> int:
        return sum(self.units) - self.free_units()

    def free_pieces(self, size: int) -> int:
        """Free pieces of `size` addresses in split units, on all devices."""
        return self._free_pieces.get(size, 0)

    def fits(self, demand: dict) -> bool:
        """Whether extents could be allocated for all of `demand` now: it maps a piece size
        (`piece_size`) or None (a whole unit) to how many extents of it. Pieces of a size first
        take the free pieces of that size, then units split for them (`per_unit / size` each)."""
        units = demand.get(None, 0)
        for size, n in demand.items():
            if size is not None and n > self.free_pieces(size):
                units += -(-(n - self.free_pieces(size)) // (self.per_unit // size))
        return units <= self.free_units()

    def preferred(self, ino: int, idx: int) -> int:
        return (idx + ino) % self.ndev

    def piece_size(self, length: int) -> int | None:
        """Addresses taken by a piece for an extent of `length` bytes, or None when it takes a
        whole unit (more than half a unit, or a pool without pieces)."""
        blocks = max(1, round_up(length) // BLOCK)
        if blocks > self.per_unit // 2:
            return None
        return 1 << (blocks - 1).bit_length()

    def alloc(self, dev: int, length: int | None = None) -> tuple[int, int]:
        """Room for an extent of `length` bytes (None: a whole unit), on `dev` when it has room:
        (dev, address) with one reference."""
        size = None if length is None else self.piece_size(length)
        if size is not None:
            return self._alloc_piece(dev, size)
        dev = self._room(dev)
        unit = self._take(dev)
        self._refs[(dev, unit * self.per_unit)] = 1
        return dev, unit * self.per_unit

    def _room(self, dev: int) -> int:
        """`dev`, or the device with the most free units when it has none."""
        if not self.free_units(dev):
            dev = max(range(self.ndev), key=self.free_units)
            if not self.free_units(dev):
                raise NoSpace("all devices are full")
        return dev

    def _take(self, dev: int) -> int:
        self._free_total -= 1
        if self._freed[dev]:
            return self._freed[dev].pop()
        unit = self._fresh[dev]
        self._fresh[dev] += 1
        return unit

    def _alloc_piece(self, dev: int, size: int) -> tuple[int, int]:
        # a split unit of the preferred device, one elsewhere, a new split there, a new one elsewhere
        if not self._partial.get((dev, size)):
            others = [d for d in range(self.ndev) if self._partial.get((d, size))]
            dev = others[0] if others else self._room(dev)
        partial = self._partial.get((dev, size))
        if partial:
            unit = next(iter(partial))
            sp = self._split[(dev, unit)]
        else:
            unit = self._take(dev)
            sp = self._split_unit(dev, unit, size)
        off = min(sp.free)
        self._take_piece(dev, unit, sp, off)
        addr = unit * self.per_unit + off
        self._refs[(dev, addr)] = 1
        return dev, addr

    def _split_unit(self, dev: int, unit: int, size: int) -> _Split:
        """Cut a unit just taken into pieces of `size` addresses, all free."""
        sp = self._split[(dev, unit)] = _Split(size, set(range(0, self.per_unit, size)))
        self._partial.setdefault((dev, size), set()).add(unit)
        self._free_pieces[size] = self._free_pieces.get(size, 0) + self.per_unit // size
        return sp

    def _take_piece(self, dev: int, unit: int, sp: _Split, off: int) -> None:
        sp.free.remove(off)
        self._free_pieces[sp.size] -= 1
        if not sp.free:
            self._partial[(dev, sp.size)].discard(unit)

    def claim(self, dev: int, addr: int, length: int | None = None) -> None:
        """Add a reference to an extent: one already referenced (pinning), or one a record names
        as mount rebuilds the counts (its `length` then says whether it is a piece)."""
        key = (dev, addr)
        n = self._refs.get(key, 0)
        if n:
            self._refs[key] = n + 1
            return
        if not (0 <= dev < self.ndev and 0 <= addr < self.units[dev] * self.per_unit):
            raise ValueError(f"address {addr} of device {dev} is outside the pool")
        unit, off = divmod(addr, self.per_unit)
        size = None if length is None else self.piece_size(length)
        if size is None:
            if off:
                raise ValueError(f"device {dev} address {addr}: a whole unit must start at a unit")
            self._claim_unit(dev, unit)
        else:
            sp = self._split.get((dev, unit))
            if off % size or (sp is not None and sp.size != size):
                raise ValueError(f"device {dev} address {addr}: a piece of {size} overlaps other pieces")
            if sp is None:
                self._claim_unit(dev, unit)
                sp = self._split_unit(dev, unit, size)
            self._take_piece(dev, unit, sp, off)
        self._refs[key] = 1

    def _claim_unit(self, dev: int, unit: int) -> None:
        self._free_total -= 1  # (undone below if it is taken already)
        if unit >= self._fresh[dev]:
            self._freed[dev].update(range(self._fresh[dev], unit))
            self._fresh[dev] = unit + 1
        elif unit in self._freed[dev]:
            self._freed[dev].remove(unit)
        else:
            self._free_total += 1
            raise ValueError(f"device {dev} unit {unit} is in use already")

    def release(self, dev: int, addr: int) -> None:
        key = (dev, addr)
        n = self._refs[key] - 1
        if n:
            self._refs[key] = n
            return
        del self._refs[key]
        if self.on_free is not None:
            self.on_free(dev, addr)
        unit, off = divmod(addr, self.per_unit)
        sp = self._split.get((dev, unit))
        if sp is None:
            self._freed[dev].add(unit)
            self._free_total += 1
            return
        sp.free.add(off)
        self._free_pieces[sp.size] += 1
        if len(sp.free) * sp.size == self.per_unit:
            self._free_pieces[sp.size] -= len(sp.free)
            del self._split[(dev, unit)]
            self._partial[(dev, sp.size)].discard(unit)
            self._freed[dev].add(unit)
            self._free_total += 1
        else:
            self._partial.setdefault((dev, sp.size), set()).add(unit)

    def refs(self, dev: int, addr: int) -> int:
        return self._refs.get((dev, addr), 0)

    def check_invariants(self) -> None:
        for d, freed in enumerate(self._freed):
            for u in freed:
                assert u < self._fresh[d], f"device {d} unit {u} freed beyond the fresh mark"
                assert (d, u * self.per_unit) not in self._refs, f"device {d} unit {u} free but referenced"
                assert (d, u) not in self._split, f"device {d} unit {u} free but split"
        pieces = 0
        free_pieces: dict[int, int] = {}
        for (d, u), sp in self._split.items():
            free_pieces[sp.size] = free_pieces.get(sp.size, 0) + len(sp.free)
            taken = set(range(0, self.per_unit, sp.size)) - sp.free
            assert taken, f"device {d} unit {u} split with no piece taken"
            assert all((d, u * self.per_unit + off) in self._refs for off in taken), f"device {d} unit {u}"
            assert (u in self._partial.get((d, sp.size), ())) == bool(sp.free), f"device {d} unit {u} partial"
            pieces += len(taken)
        assert self._free_total == sum(self.free_units(d) for d in range(self.ndev)), "free unit total"
        assert self.used_units() == len(self._refs) - pieces + len(self._split)
        assert ({k: v for k, v in free_pieces.items() if v} == {k: v for k, v in self._free_pieces.items() if v}), \
            "free piece counts"
