"""Device dedupe: a chunk whose bytes are on the devices already is not written again.

With `--dedupe on`, the drain's worker thread takes each chunk's BLAKE3 digest beside its
CRC-32C (both release the interpreter lock) and looks it up in the `ContentIndex` (a dict read,
safe beside the trio thread's changes). A chunk found there is not written; back on the trio
thread, `adopt` checks that the extent still holds those bytes (it is still indexed under that
digest: an extent leaves the index the moment its last reference goes, allocator.py's `on_free`)
and takes a reference to it for the chunk, which then drains into that extent instead of its own
unit. Otherwise the chunk is written as any other, and the extent it got is indexed. Two
identical chunks drained at the same time (a second save of the same bytes while the first is in
memory) are written once: the first to miss the index takes off a `Flight` under its digest, and
a twin that meets it is not written but waits for it to land, then shares its extent (or, if
that write came to nothing, is written after all).

A `content` record names extents, two files may name one, and replay counts the references
(durable.py), so deleting or overwriting one file leaves an extent another still names where it
is; fsck accepts an extent named more than once with one length and CRC. The index holds the
newest `capacity` extents written or shared. A written extent's digest goes into the journal with
the first commit that names it (a `digests` record after the `content` records of that frame:
`to_journal`, then `journaled` once the frame is on the devices), so the index of the next mount
starts from the durable state's digests (`load`) and a save after a remount shares what the
saves before it wrote; fsck checks each journaled digest against the extent's bytes.
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


class Flight:
    """A chunk being written whose digest no extent holds yet: an identical chunk that meets it
    (a copy drained while its original is) waits for it and shares its extent instead of being
    written too. The drain (trio thread) lands it: `extent` the write's, None if it came to
    nothing; `event` is made there by the first waiter."""
    __slots__ = ("length", "extent", "done", "event")

    def __init__(self, length: int):
        self.length = length
        self.extent: Extent | None = None
        self.done = False
        self.event = None


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
        self.unjournaled: set[tuple[int, int]] = set()  # written extents whose digest no frame holds yet
        self.flying: dict[bytes, Flight] = {}  # digest -> the chunk being written with it
        self.chunks_shared = 0
        self.bytes_shared = 0
        alloc.on_free = self.forget

    def find(self, d: bytes, length: int) -> Extent | None:
        """In a worker thread: an extent that may hold these bytes (`adopt` decides)."""
        ext = self.by_digest.get(d)
        return ext if ext is not None and ext.length == length else None

    def take_off(self, d: bytes, length: int) -> tuple[Flight | None, bool]:
        """In a worker thread, for a chunk `find` missed: (its own new flight, True) when it is to
        be written, or (the flight of an identical chunk being written, False) when it is to wait
        for that one instead. dict.setdefault is one atomic step between threads."""
        mine = Flight(length)
        flight = self.flying.setdefault(d, mine)
        if flight is mine:
            return mine, True
        if flight.length != length:
            return None, True  # (not the same bytes after all: written, no flight)
        return flight, False

    def land(self, d: bytes, flight: Flight, extent: Extent | None) -> None:
        """On the trio thread: the chunk of `flight` is written at `extent` (indexed already), or
        came to nothing (None: stale, failed); its waiters go on."""
        if self.flying.get(d) is flight:
            del self.flying[d]
        flight.extent, flight.done = extent, True
        if flight.event is not None:
            flight.event.set()

    def land_rest(self, led) -> None:
        """Land with None each flight of `led` ((digest, Flight) pairs) not landed yet: its write
        did not happen or was not kept."""
        for d, flight in led:
            if not flight.done:
                self.land(d, flight, None)

    def add(self, d: bytes, ext: Extent, journaled: bool = False) -> None:
        """A chunk with digest `d` was written to `ext` (`journaled`: the journal says so already)."""
        if d in self.by_digest:
            return  # the older copy stays the one found
        self.by_digest[d] = ext
        key = (ext.dev, ext.unit)
        self.by_addr[key] = d
        if not journaled:
            self.unjournaled.add(key)
        if len(self.by_digest) > self.capacity:
            _, old = self.by_digest.popitem(last=False)
            self.by_addr.pop((old.dev, old.unit), None)
            self.unjournaled.discard((old.dev, old.unit))

    def load(self, items) -> None:
        """Index the durable state's (extent, digest) pairs, oldest first (at mount)."""
        for ext, d in items:
            self.add(d, ext, journaled=True)

    def to_journal(self, records) -> list[tuple[Extent, bytes]]:
        """The (extent, digest) pairs a frame of `records` should carry: the extents its `content`
        records name whose digest is in no frame yet."""
        out = []
        if not self.unjournaled:
            return out
        for rec in records:
            if rec.op == "content":
                for _, ext in rec.extents:
                    key = (ext.dev, ext.unit)
                    if key in self.unjournaled:
                        d = self.by_addr.get(key)
                        if d is not None and self.by_digest.get(d) == ext:
                            out.append((ext, d))
        return out

    def journaled(self, items) -> None:
        """The frame holding these pairs is on the devices."""
        for ext, _ in items:
            self.unjournaled.discard((ext.dev, ext.unit))

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
        self.unjournaled.discard((dev, addr))
        if d is not None:
            self.by_digest.pop(d, None)

    def statistics(self) -> DedupeStats:
        return DedupeStats(len(self.by_digest), self.chunks_shared, self.bytes_shared)
