"""Device space: fixed-size data units per device, with reference counts. Pure.

Every extent is one data unit (chunk_size bytes) on one device. A unit is
referenced by the live chunk that drained into it and by the durable state
once a journal record names it; it returns to the free list only when no one
refers to it. Nothing of this is stored on the devices: at mount the counts
are rebuilt from the replayed journal, so space held by data that was
written but never committed (a crash mid-drain) is free again.

Placement: chunk i of inode n goes to device (i + n) mod N, so stripes start
on different devices for different files (many small files still spread), and
falls back to the device with the most free units when that one is full.
"""
from __future__ import annotations

from ..errors import NoSpace


class Allocator:
    def __init__(self, units_per_device: list[int]):
        self.units = list(units_per_device)
        # units >= _fresh[d] have never been handed out; _freed[d] holds returned ones below it
        self._fresh = [0] * len(self.units)
        self._freed: list[set[int]] = [set() for _ in self.units]
        self._refs: dict[tuple[int, int], int] = {}

    @property
    def ndev(self) -> int:
        return len(self.units)

    def free_units(self, dev: int | None = None) -> int:
        if dev is None:
            return sum(self.free_units(d) for d in range(self.ndev))
        return self.units[dev] - self._fresh[dev] + len(self._freed[dev])

    def used_units(self) -> int:
        return sum(self.units) - self.free_units()

    def preferred(self, ino: int, idx: int) -> int:
        return (idx + ino) % self.ndev

    def alloc(self, dev: int) -> tuple[int, int]:
        """A fresh unit, on `dev` when it has room; (dev, unit) with one reference."""
        if not self.free_units(dev):
            dev = max(range(self.ndev), key=self.free_units)
            if not self.free_units(dev):
                raise NoSpace("all devices are full")
        if self._freed[dev]:
            unit = self._freed[dev].pop()
        else:
            unit = self._fresh[dev]
            self._fresh[dev] += 1
        self._refs[(dev, unit)] = 1
        return dev, unit

    def claim(self, dev: int, unit: int) -> None:
        """Add a reference to a unit (rebuilding at mount, or a record naming it)."""
        if not (0 <= dev < self.ndev and 0 <= unit < self.units[dev]):
            raise ValueError(f"unit {unit} of device {dev} is outside the pool")
        key = (dev, unit)
        n = self._refs.get(key, 0)
        if n == 0:
            if unit >= self._fresh[dev]:
                self._freed[dev].update(range(self._fresh[dev], unit))
                self._fresh[dev] = unit + 1
            else:
                self._freed[dev].remove(unit)
        self._refs[key] = n + 1

    def release(self, dev: int, unit: int) -> None:
        key = (dev, unit)
        n = self._refs[key] - 1
        if n:
            self._refs[key] = n
        else:
            del self._refs[key]
            self._freed[dev].add(unit)

    def refs(self, dev: int, unit: int) -> int:
        return self._refs.get((dev, unit), 0)

    def check_invariants(self) -> None:
        for d, freed in enumerate(self._freed):
            for u in freed:
                assert u < self._fresh[d], f"device {d} unit {u} freed beyond the fresh mark"
                assert (d, u) not in self._refs, f"device {d} unit {u} free but referenced"
        assert self.used_units() == len(self._refs)
