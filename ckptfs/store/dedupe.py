"""Device dedupe: a chunk whose bytes are on the devices already is not written again.

With `--dedupe on`, the drain's worker thread takes each chunk's BLAKE3 digest beside its
CRC-32C (both release the interpreter lock) and looks it up in the `ContentIndex` (a dict read,
safe beside the trio thread's changes). A chunk found there is not written; back on the trio
thread, `adopt` checks that the extent still holds those bytes (it is still indexed under that
digest: an extent leaves the index the moment its last reference goes, allocator.py's `on_free`)
and takes a reference to it for the chunk, which then drains into that extent instead of its own
unit. Otherwise the chunk is written as any other, and the extent it got is indexed.

Nothing on the devices changes: a `content` record names extents, two files may name one, and
replay counts the references (durable.py), so deleting or overwriting one file leaves an extent
another still names where it is; fsck accepts an extent named more than once with one length and
CRC. The index lives in memory and holds the newest `capacity` extents this daemon wrote (it
starts empty at mount: the first save after a mount is written whole).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from blake3 import blake3

from ..format.records import Extent
from .allocator import Allocator

CAPACITY = 1 << 18  # extents indexed (of 1 MiB chunks: the last 256 GiB written), ~40 MB


def digest(data) -> bytes:
    """The chunk's content digest (BLAKE3, 32 bytes); in a worker thread."""
    return blake3(data).digest()


@dataclass(frozen=True)
class DedupeStats:
    """For status and metrics: chunks and bytes not written because the devices held them."""
    indexed: int
    chunks_shared: int
    bytes_shared: int


class ContentIndex:
    """Digest -> extent of chunks on the devices, and back; the newest `capacity` of them."""

    def __init__(self, alloc: Allocator, capacity: int = CAPACITY):
        self.alloc = alloc
        self.capacity = capacity
        self.by_digest: OrderedDict[bytes, Extent] = OrderedDict()
        self.by_addr: dict[tuple[int, int], bytes] = {}
        self.chunks_shared = 0
        self.bytes_shared = 0
        alloc.on_free = self.forget

    def find(self, d: bytes, length: int) -> Extent | None:
        """In a worker thread: an extent that may hold these bytes (`adopt` decides)."""
        ext = self.by_digest.get(d)
        return ext if ext is not None and ext.length == length else None

    def add(self, d: bytes, ext: Extent) -> None:
        """A chunk with digest `d` was written to `ext`."""
        if d in self.by_digest:
            return  # the older copy stays the one found
        self.by_digest[d] = ext
        self.by_addr[(ext.dev, ext.unit)] = d
        if len(self.by_digest) > self.capacity:
            _, old = self.by_digest.popitem(last=False)
            self.by_addr.pop((old.dev, old.unit), None)

    def adopt(self, ext: Extent, d: bytes, length: int, crc: int) -> bool:
        """Take a reference to `ext` for a chunk of `length` bytes with digest `d` and CRC `crc`, if
        `ext` holds them still; False when it went meanwhile (the chunk is then written)."""
        if self.by_digest.get(d) != ext or ext.length != length or ext.crc != crc:
            return False
        self.alloc.claim(ext.dev, ext.unit)
        self.by_digest.move_to_end(d)
        self.chunks_shared += 1
        self.bytes_shared += length
        return True

    def forget(self, dev: int, addr: int) -> None:
        """The extent at (dev, addr) lost its last reference: its space may hold other bytes soon."""
        d = self.by_addr.pop((dev, addr), None)
        if d is not None:
            self.by_digest.pop(d, None)

    def statistics(self) -> DedupeStats:
        return DedupeStats(len(self.by_digest), self.chunks_shared, self.bytes_shared)
