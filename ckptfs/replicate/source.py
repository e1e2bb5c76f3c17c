"""Reading one durable file version's bytes for an upload: from the arena when cached, else the devices.

`read_part(store, version, offset, buf)` fills `buf` (page-aligned, a multiple
of the chunk size long) with the bytes of `version` from `offset` (a
multiple of the chunk size) up to `len(buf)` or the end of the file, and
returns how many bytes it filled. Chunk by chunk:

- a hole reads as zeros, and so do the bytes after a short chunk;
- a chunk whose live copy in the arena is this very version (the same
  extent, drained, still holding its slot) is copied from memory, in the trio
  thread, where nothing can change it meanwhile;
- any other chunk is read from its device with O_DIRECT in a worker thread,
  through the device's CapacityLimiter (shared with the drain, so the queue
  depth holds), and its CRC-32C checked as every device read is: a
  mismatch raises `ChecksumMismatch`, never wrong bytes uploaded.

The caller pins the extents (allocator references) for as long as it reads,
so the units cannot be reused by a newer version meanwhile.
"""
from __future__ import annotations

import crc32c
import trio

from ..errors import ChecksumMismatch, DeviceError
from ..format.layout import round_up
from ..tasks import gather
from .snapshot import Version


def _read_extent(device, view: memoryview, length: int, offset: int) -> int:
    """In a worker thread: O_DIRECT read of `view` at `offset`; the CRC-32C of its first `length` bytes."""
    device.pread_into(view, offset)
    return crc32c.crc32c(view[:length])


def _cached_view(store, version: Version, idx: int, ext) -> memoryview | None:
    """The arena slot holding chunk `idx` of this version, when the live file still caches it."""
    inode = store.ns.inodes.get(version.ino) if store.ns is not None else None
    data = inode.data if inode is not None else None
    chunk = data.chunks.get(idx) if data is not None else None
    if chunk is None or chunk.slot is None or not chunk.drained or chunk.extent != ext:
        return None
    return store.arena.view(chunk.slot)


async def _read_chunk(store, version: Version, idx: int, buf: memoryview, pos: int, plen: int,
                      stats: dict) -> None:
    """Chunk `idx` into buf[pos:pos + plen] (an O_DIRECT read may fill up to the next 4 KiB past it:
    `buf` is a whole number of chunks long)."""
    ext = version.extents.get(idx)
    view = buf[pos:]
    if ext is None:
        view[:plen] = bytes(plen)
        return
    cached = _cached_view(store, version, idx, ext)
    if cached is not None:
        view[:ext.length] = cached[:ext.length]
        stats["arena"] += ext.length
    else:
        length = round_up(ext.length)
        try:
            crc = await trio.to_thread.run_sync(_read_extent, store.devices[ext.dev], view[:length], ext.length,
                                                store.sbs[ext.dev].unit_offset(ext.unit),
                                                limiter=store.limiters[ext.dev])
        except DeviceError:
            store.stats[ext.dev].failed()
            raise
        store.stats[ext.dev].read(length)
        stats["device"] += ext.length
        if crc != ext.crc:
            store.stats[ext.dev].failed()
            raise ChecksumMismatch(f"checksum mismatch reading inode {version.ino} chunk {idx} from "
                                   f"{store.devices[ext.dev].path} unit {ext.unit} for replication")
    if plen > ext.length:
        view[ext.length:plen] = bytes(plen - ext.length)


async def read_part(store, version: Version, offset: int, buf: memoryview, stats: dict) -> int:
    """Fill `buf` with the version's bytes from `offset`; the number of bytes filled. `stats` counts
    bytes by source ("arena", "device")."""
    cs = store.chunk_size
    n = max(0, min(len(buf), version.size - offset))
    calls = []
    for pos in range(0, n, cs):
        idx = (offset + pos) // cs
        calls.append((_read_chunk, store, version, idx, buf, pos, min(cs, n - pos), stats))
    await gather(calls)
    for pos in range(0, n, cs):
        idx = (offset + pos) // cs
        if version.crcs[idx] is None:
            version.crcs[idx] = crc32c.crc32c(buf[pos:pos + min(cs, n - pos)])
    return n
