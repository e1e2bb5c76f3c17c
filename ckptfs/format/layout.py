"""The on-device format: superblock, regions, foreign-signature detection. Pure.

Every device of a pool starts with the same layout (docs/FORMAT.md has every byte):

    0            4 KiB: superblock (this device's place in the pool)
    4 KiB, 8 KiB two journal anchor slots (which half and epoch are current)
    1 MiB        journal half A  (journal_half bytes)
    1 MiB + h    journal half B  (journal_half bytes)
    data_off     data units of chunk_size bytes, up to the end of the device
                 (from version 3, a unit may be split into pieces for small chunks)

The first MiB apart from the superblock is left zero. `data_off` is aligned to
the chunk size, so every data unit is aligned for O_DIRECT.
"""
from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass

import crc32c

SB_MAGIC = b"CKPTFSSB"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # version 1 (no anchors) is upgraded in place to 2 at mount
ANCHORED_VERSION = 2  # anchors from here on
PIECES_VERSION = 3  # extent addresses in 4 KiB blocks from here on (small chunks take pieces of a unit)
ANCHOR_MAGIC = b"CKPTFSAN"
ANCHOR_SLOTS = (4096, 8192)  # generation g goes to slot g % 2: a torn write spares the other
SB_SIZE = 4096
JOURNAL_OFF = 1 << 20
DEFAULT_JOURNAL_HALF = 32 << 20
BLOCK = 4096  # the unit of alignment on the devices: O_DIRECT, frames, superblocks, anchors


def round_up(n: int) -> int:
    """`n` rounded up to a whole number of BLOCKs."""
    return -(-n // BLOCK) * BLOCK

# magic, version, pool id, index, count, chunk size, journal off, journal half, data off,
# data units, device size, created (ns), crc32c of everything before it
_SB = struct.Struct("<8sI16sIIIQQQQQQ")


class FormatError(Exception):
    """A device does not hold a usable ckptfs superblock (message names the device)."""


@dataclass(frozen=True)
class Superblock:
    """One device's superblock: the pool it belongs to, its place in it, and where its journal
    halves and data units lie. Written at format (rewritten only to upgrade its version)."""
    pool_id: bytes
    index: int
    count: int
    chunk_size: int
    journal_off: int
    journal_half: int
    data_off: int
    data_units: int
    device_size: int
    created_ns: int
    version: int = FORMAT_VERSION

    def encode(self) -> bytes:
        body = _SB.pack(SB_MAGIC, self.version, self.pool_id, self.index, self.count, self.chunk_size,
                        self.journal_off, self.journal_half, self.data_off, self.data_units,
                        self.device_size, self.created_ns)
        raw = body + struct.pack("<I", crc32c.crc32c(body))
        return raw.ljust(SB_SIZE, b"\0")

    @classmethod
    def decode(cls, raw: bytes, device: str = "device") -> "Superblock":
        if raw[:8] != SB_MAGIC:
            raise FormatError(f"{device} is not formatted for ckptfs (no superblock): run 'ckptfs format'")
        body = raw[:_SB.size]
        (crc,) = struct.unpack_from("<I", raw, _SB.size)
        if crc32c.crc32c(body) != crc:
            raise FormatError(f"{device}: ckptfs superblock checksum mismatch (corrupt superblock)")
        f = _SB.unpack(body)
        if f[1] not in READABLE_VERSIONS:
            raise FormatError(f"{device}: unsupported ckptfs format version {f[1]} (this ckptfs reads "
                              f"versions {', '.join(map(str, READABLE_VERSIONS))})")
        return cls(pool_id=f[2], index=f[3], count=f[4], chunk_size=f[5], journal_off=f[6],
                   journal_half=f[7], data_off=f[8], data_units=f[9], device_size=f[10],
                   created_ns=f[11], version=f[1])

    def half_offset(self, half: int) -> int:
        return self.journal_off + half * self.journal_half

    @property
    def grain(self) -> int:
        """Bytes per step of an extent's address (`Extent.unit`): a whole unit before version 3,
        4 KiB from it (a small chunk takes a piece of a unit, store/allocator.py)."""
        return BLOCK if self.version >= PIECES_VERSION else self.chunk_size

    def unit_offset(self, unit: int) -> int:
        """Where on the device the extent at address `unit` starts."""
        return self.data_off + unit * self.grain


# magic, pool id, generation, epoch, half, clean, seq, time (ns), then crc32c of all that
_AN = struct.Struct("<8s16sQQIIQq")


@dataclass(frozen=True)
class Anchor:
    """Where the journal is: the current half and its epoch, rewritten at every compaction and at
    a clean unmount. Recovery compares it with what replay finds, so losing the newest half (or
    the tail of a cleanly closed journal) is detected instead of silently rolled back."""
    generation: int
    epoch: int
    half: int
    clean: bool  # written by a clean unmount: nothing follows frame `seq`
    seq: int  # the last frame written when the anchor was
    time_ns: int

    @property
    def offset(self) -> int:
        return ANCHOR_SLOTS[self.generation % 2]

    def encode(self, pool_id: bytes) -> bytes:
        body = _AN.pack(ANCHOR_MAGIC, pool_id, self.generation, self.epoch, self.half, int(self.clean),
                        self.seq, self.time_ns)
        return (body + struct.pack("<I", crc32c.crc32c(body))).ljust(SB_SIZE, b"\0")

    @classmethod
    def decode(cls, raw: bytes, pool_id: bytes) -> "Anchor | None":
        """The anchor in one slot, or None where the slot holds no valid anchor of this pool."""
        body = raw[:_AN.size]
        if len(raw) < _AN.size + 4 or body[:8] != ANCHOR_MAGIC:
            return None
        (crc,) = struct.unpack_from("<I", raw, _AN.size)
        f = _AN.unpack(body)
        if crc32c.crc32c(body) != crc or f[1] != pool_id:
            return None
        return cls(generation=f[2], epoch=f[3], half=f[4], clean=bool(f[5]), seq=f[6], time_ns=f[7])


def plan(device_size: int, chunk_size: int, journal_half: int = DEFAULT_JOURNAL_HALF) -> tuple[int, int]:
    """(data_off, data_units) for a device; data_units < 1 means the device is too small."""
    end = JOURNAL_OFF + 2 * journal_half
    data_off = -(-end // chunk_size) * chunk_size
    return data_off, max(0, (device_size - data_off) // chunk_size)


def min_device_size(chunk_size: int, journal_half: int = DEFAULT_JOURNAL_HALF) -> int:
    data_off, _ = plan(0, chunk_size, journal_half)
    return data_off + chunk_size


def new_pool_id() -> bytes:
    return uuid.uuid4().bytes


def make_superblocks(sizes: list[int], chunk_size: int, journal_half: int, now_ns: int
                     ) -> list[Superblock]:
    pool = new_pool_id()
    out = []
    for i, size in enumerate(sizes):
        data_off, units = plan(size, chunk_size, journal_half)
        out.append(Superblock(pool, i, len(sizes), chunk_size, JOURNAL_OFF, journal_half, data_off,
                              units, size, now_ns))
    return out


# (name, offset, magic) of signatures that mean "this device holds something else"
_SIGNATURES = [
    ("ext2/3/4 filesystem", 1080, b"\x53\xef"),
    ("XFS filesystem", 0, b"XFSB"),
    ("btrfs filesystem", 65600, b"_BHRfS_M"),
    ("GPT partition table", 512, b"EFI PART"),
    ("LVM physical volume", 512 + 24, b"LVM2 001"),
    ("LVM physical volume", 24, b"LVM2 001"),
    ("swap space", 4086, b"SWAPSPACE2"),
    ("swap space", 4086, b"SWAP-SPACE"),
    ("ISO 9660 filesystem", 32769, b"CD001"),
    ("vfat filesystem", 82, b"FAT32   "),
    ("vfat filesystem", 54, b"FAT16   "),
    ("ckptfs pool", 0, SB_MAGIC),
]


def foreign_signature(head: bytes) -> str | None:
    """What the first MiB of a device holds, or None when it is all zeros.

    Recognised filesystems and partition tables are named; any other non-zero
    byte is reported as unknown data, so nothing is overwritten by accident.
    """
    for name, off, magic in _SIGNATURES:
        if head[off:off + len(magic)] == magic:
            if name.startswith("ext") and head[1024 + 24:1024 + 28] == b"\0\0\0\0" and not any(head[1024:1080]):
                continue
            return name
    if head[510:512] == b"\x55\xaa":
        return "MBR partition table"
    if head.count(0) != len(head):
        return "non-zero data in its first MiB"
    return None
