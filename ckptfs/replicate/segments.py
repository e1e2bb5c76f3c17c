"""Segments: a file version in the object store as objects named by their content. Pure.

A file version is cut at every `segment_size` bytes (a whole number of
chunks, SEGMENT_BYTES by default: 4 MiB). Segment `i` holds the file's bytes
[i * segment_size, (i + 1) * segment_size), holes and the zeros after a
short chunk included, and is stored once, at ``segments/<key>``, whichever
files, generations and pools name it.

The key says what the bytes are without reading them twice: per chunk-sized
piece of the segment, its length, how many of its bytes its extent holds
(the rest are zeros) and the BLAKE3 digest of those bytes (the device
dedupe's digest, store/dedupe.py), hashed again with BLAKE3; 160 bits of
that name the segment. Two segments with one key hold the same bytes; two
with the same bytes get one key unless their pieces say it differently (a
chunk of written zeros beside a hole of the same length): such a pair is
only stored twice. A checkpoint saved again with most tensors unchanged
(`torch.save`, safetensors and DCP keep each tensor at its offset) has most
of its segments already in the store, and only the rest are uploaded.

`keys(...)` names a version's segments from the digests the journal keeps
(`durable.digests`); where one is missing (dedupe off, or an extent older
than the digests kept) it returns None, and the replicator reads the
segment and has the uploader process, at its low priority, take the
digests from the bytes (`key_from_bytes`).
"""
from __future__ import annotations

from blake3 import blake3

SEGMENTS = "segments/"
SEGMENT_BYTES = 4 << 20
KEY_HEX = 40  # hex digits of a key: 160 bits
EMPTY = blake3(b"").digest()  # the digest of a hole's bytes (none)
_DOMAIN = b"ckptfs segment 1\0"


def segment_size(chunk_size: int, base: int = SEGMENT_BYTES) -> int:
    """`base` rounded down to whole chunks, at least one chunk."""
    return max(chunk_size, base // chunk_size * chunk_size)


def count(size: int, unit: int) -> int:
    """Pieces of a file of `size` bytes cut every `unit` bytes (segments, or chunks)."""
    return -(-size // unit)


def length(i: int, size: int, unit: int) -> int:
    """Bytes of piece `i` of a file of `size` bytes cut every `unit` bytes (segments, or chunks)."""
    return max(0, min(unit, size - i * unit))


def key(pieces) -> str:
    """The object key of a segment whose pieces are `(length, held, digest)`: `held` of its
    `length` bytes are the extent's, whose digest is `digest`; the rest are zeros."""
    h = blake3(_DOMAIN)
    for plen, held, d in pieces:
        h.update(plen.to_bytes(4, "little") + held.to_bytes(4, "little") + d)
    return SEGMENTS + h.hexdigest()[:KEY_HEX]


def pieces(size: int, chunk_size: int, extents: dict, i: int, seg: int):
    """(chunk index, piece length, extent or None) of each piece of segment `i`."""
    first = i * seg // chunk_size
    end = count(i * seg + length(i, size, seg), chunk_size)
    return [(idx, length(idx, size, chunk_size), extents.get(idx)) for idx in range(first, end)]


def held(plen: int, ext) -> int:
    """Bytes of a piece its extent holds (the rest read as zeros)."""
    return 0 if ext is None else min(plen, ext.length)


def keys(size: int, chunk_size: int, seg: int, extents: dict, digest_of) -> list[str] | None:
    """The keys of a version's segments, `digest_of(extent)` giving each extent's digest (None:
    unknown); None when a digest is missing or an extent is longer than its piece."""
    out = []
    for i in range(count(size, seg)):
        items = []
        for _idx, plen, ext in pieces(size, chunk_size, extents, i, seg):
            if ext is None:
                items.append((plen, 0, EMPTY))
                continue
            d = digest_of(ext)
            if d is None or ext.length > plen:
                return None
            items.append((plen, ext.length, d))
        out.append(key(items))
    return out


def layout(size: int, chunk_size: int, extents: dict, i: int, seg: int) -> list[tuple[int, int]]:
    """(piece length, bytes held) of each piece of segment `i`: what `key_from_bytes` needs."""
    return [(plen, held(plen, ext)) for _idx, plen, ext in pieces(size, chunk_size, extents, i, seg)]


def key_from_bytes(view, layout) -> str:
    """The key of a segment from its bytes (`view`, as read) and its `layout`; BLAKE3 of every
    held byte (the uploader process does it: uploader.py)."""
    items = []
    pos = 0
    for plen, n in layout:
        items.append((plen, n, blake3(view[pos:pos + n]).digest() if n else EMPTY))
        pos += plen
    return key(items)
