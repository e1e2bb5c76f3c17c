"""A fault-injecting in-memory device, with the BlockDevice interface.

Writes go to a volatile cache until `flush()` makes them durable, as on a
real drive with a write cache. Faults:

- `cut_after(n)`: a power cut after n more writes; later writes (and
  flushes) are silently lost. Devices made together share one `Power`,
  so a cut hits all of them at the same moment, as a real one does.
- `crash(rng)`: what survives a power cut: the durable image plus a random
  subset of the unflushed writes, applied in random order (reordering);
  returns a fresh device holding that image.
- `fail_writes_at(lo, hi)` / `fail_reads_at(lo, hi)`: EIO for I/O touching
  that byte range.
- `write_delay`: seconds to sleep in each write (a slow device).
"""
from __future__ import annotations

import random
import threading
import time

from ckptfs.errors import DeviceError

BLOCK = 4096


def flip_byte(path, offset: int) -> None:
    """Damage the byte at `offset` of a file or device for sure (a constant written there may
    already be its value: a test that tears a random field with one would pass 1 time in 256)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([old ^ 0xFF]))


class Power:
    """The power supply shared by a set of devices: counts their writes, cuts them all at once."""

    def __init__(self) -> None:
        self.writes = 0
        self.cut_at: int | None = None
        self.lock = threading.Lock()

    def cut_after(self, n: int) -> None:
        self.cut_at = self.writes + n

    @property
    def is_cut(self) -> bool:
        return self.cut_at is not None and self.writes >= self.cut_at

    def count_write(self) -> bool:
        """Count one write; False when it happens after the cut (lost)."""
        with self.lock:
            self.writes += 1
            return self.cut_at is None or self.writes <= self.cut_at


def make_faulty(n: int, size: int) -> list["FaultyDevice"]:
    power = Power()
    return [FaultyDevice(size, f"mem{i}", power=power) for i in range(n)]


class FaultyDevice:
    def __init__(self, size: int, path: str = "mem", durable: dict | None = None, power: Power | None = None):
        self.power = power or Power()
        self.size = size
        self.path = path
        self.durable: dict[int, bytes] = dict(durable or {})  # block number -> 4 KiB
        self.volatile: list[tuple[int, bytes]] = []
        self.writes = 0
        self.flushes = 0
        self.fail_write_ranges: list[tuple[int, int]] = []
        self.fail_read_ranges: list[tuple[int, int]] = []
        self.write_delay = 0.0
        self.lock = threading.Lock()

    # ---- faults ----------------------------------------------------------
    def cut_after(self, n: int) -> None:
        self.power.cut_after(n)

    @property
    def is_cut(self) -> bool:
        return self.power.is_cut

    def fail_writes_at(self, lo: int, hi: int) -> None:
        self.fail_write_ranges.append((lo, hi))

    def fail_reads_at(self, lo: int, hi: int) -> None:
        self.fail_read_ranges.append((lo, hi))

    def crash(self, rng: random.Random, keep=None, new_power: Power | None = None) -> "FaultyDevice":
        """The device after a power cut: unflushed writes survive at random (or where `keep(offset)`)."""
        with self.lock:
            image = dict(self.durable)
            if keep is None:
                survivors = [w for w in self.volatile if rng.random() < 0.5]
            else:
                survivors = [w for w in self.volatile if keep(w[0])]
            rng.shuffle(survivors)
            for off, data in survivors:
                _apply(image, off, data)
            return FaultyDevice(self.size, self.path, image, power=new_power)

    def image(self, new_power: Power | None = None) -> "FaultyDevice":
        """A clean copy as after an orderly shutdown (everything flushed)."""
        with self.lock:
            image = dict(self.durable)
            for off, data in self.volatile:
                _apply(image, off, data)
            return FaultyDevice(self.size, self.path, image, power=new_power)

    # ---- BlockDevice interface ---------------------------------------------
    def pwrite(self, buf, offset: int) -> None:
        if self.write_delay:
            time.sleep(self.write_delay)
        data = bytes(buf)
        assert offset % BLOCK == 0 and len(data) % BLOCK == 0, "unaligned O_DIRECT write"
        for lo, hi in self.fail_write_ranges:
            if offset < hi and offset + len(data) > lo:
                raise DeviceError(f"injected write error on {self.path} at offset {offset}")
        with self.lock:
            self.writes += 1
            if not self.power.count_write():
                return
            self.volatile.append((offset, data))

    def pwritev(self, bufs: list, offset: int) -> None:
        self.pwrite(b"".join(bytes(b) for b in bufs), offset)

    def pread_into(self, buf, offset: int) -> None:
        n = len(buf)
        for lo, hi in self.fail_read_ranges:
            if offset < hi and offset + n > lo:
                raise DeviceError(f"injected read error on {self.path} at offset {offset}")
        with self.lock:
            image = self.durable
            out = bytearray(n)
            first, last = offset // BLOCK, (offset + n - 1) // BLOCK
            for b in range(first, last + 1):
                blk = image.get(b)
                if blk is not None:
                    s = max(offset, b * BLOCK)
                    e = min(offset + n, (b + 1) * BLOCK)
                    out[s - offset:e - offset] = blk[s - b * BLOCK:e - b * BLOCK]
            for off, data in self.volatile:
                s, e = max(offset, off), min(offset + n, off + len(data))
                if s < e:
                    out[s - offset:e - offset] = data[s - off:e - off]
        buf[:] = out

    def preadv_into(self, bufs: list, offset: int) -> None:
        for b in bufs:
            self.pread_into(b, offset)
            offset += len(b)

    def pread(self, n: int, offset: int) -> memoryview:
        buf = bytearray(-(-n // BLOCK) * BLOCK)
        self.pread_into(memoryview(buf), offset)
        return memoryview(buf)[:n]

    def flush(self) -> None:
        with self.lock:
            if self.is_cut:
                return
            for off, data in self.volatile:
                _apply(self.durable, off, data)
            self.volatile.clear()
            self.flushes += 1

    def close(self) -> None:
        pass


def _apply(image: dict[int, bytes], off: int, data: bytes) -> None:
    for i in range(0, len(data), BLOCK):
        blk = data[i:i + BLOCK]
        b = (off + i) // BLOCK
        if blk.count(0) == BLOCK:
            image.pop(b, None)
        else:
            image[b] = blk


def crash_all(devices: list[FaultyDevice], rng: random.Random, keep=None) -> list[FaultyDevice]:
    power = Power()
    return [d.crash(rng, keep, power) for d in devices]


def image_all(devices: list[FaultyDevice]) -> list[FaultyDevice]:
    power = Power()
    return [d.image(power) for d in devices]
