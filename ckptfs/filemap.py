"""A file's contents: a sparse map from chunk index to arena slot.

Byte `b` of a file lives in chunk `b // chunk_size` at offset
`b % chunk_size`. A missing chunk is a hole and reads as zeros. Each present
chunk records `hwm`, its high-water mark: bytes at or above it have never
been written since the slot was handed out, so they read as zeros and are
zero-filled only when a later write skips over them. That keeps a fresh slot
from being memset on the hot path.

Pure: no I/O, no trio. The arena is passed in; running out of slots raises
NoSpace after whatever part of the write fit (the caller reports a short
write, as POSIX allows).
"""
from __future__ import annotations

from typing import Iterator

from .arena import Arena
from .errors import NoSpace


class Chunk:
    __slots__ = ("slot", "hwm")

    def __init__(self, slot: int):
        self.slot = slot
        self.hwm = 0  # INVARIANT: bytes [hwm, chunk_size) of the slot are unspecified and read as zero


class FileData:
    def __init__(self, arena: Arena):
        self._arena = arena
        self._cs = arena.chunk_size
        self.chunks: dict[int, Chunk] = {}
        self._zeros = memoryview(bytes(self._cs))

    @property
    def allocated_bytes(self) -> int:
        return len(self.chunks) * self._cs

    def _pieces(self, off: int, length: int) -> Iterator[tuple[int, int, int]]:
        """(chunk index, offset in chunk, piece length) covering [off, off+length)."""
        cs = self._cs
        end = off + length
        while off < end:
            idx, inner = divmod(off, cs)
            n = min(cs - inner, end - off)
            yield idx, inner, n
            off += n

    def write(self, off: int, buf) -> int:
        """Copy `buf` to file offset `off`; returns the bytes written (short only on NoSpace)."""
        src = memoryview(buf).cast("B")
        done = 0
        for idx, inner, n in self._pieces(off, len(src)):
            chunk = self.chunks.get(idx)
            if chunk is None:
                try:
                    chunk = self.chunks[idx] = Chunk(self._arena.alloc_nowait())
                except NoSpace:
                    if done:
                        return done
                    raise
            dst = self._arena.view(chunk.slot)
            if inner > chunk.hwm:
                dst[chunk.hwm:inner] = self._zeros[:inner - chunk.hwm]
            dst[inner:inner + n] = src[done:done + n]
            if inner + n > chunk.hwm:
                chunk.hwm = inner + n
            done += n
        return done

    def read(self, off: int, size: int, file_size: int):
        """Up to `size` bytes at `off`, clipped to `file_size`: a memoryview when one piece suffices."""
        size = max(0, min(size, file_size - off))
        parts = []
        for idx, inner, n in self._pieces(off, size):
            chunk = self.chunks.get(idx)
            if chunk is None or inner >= chunk.hwm:
                parts.append(self._zeros[:n])
                continue
            have = min(n, chunk.hwm - inner)
            parts.append(self._arena.view(chunk.slot)[inner:inner + have])
            if have < n:
                parts.append(self._zeros[:n - have])
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)

    def truncate(self, new_size: int) -> None:
        """Drop everything at or beyond `new_size` (extending needs nothing: holes read as zeros)."""
        cs = self._cs
        keep_idx, inner = divmod(new_size, cs)
        for idx in [i for i in self.chunks if i > keep_idx or (i == keep_idx and inner == 0)]:
            self._arena.free(self.chunks.pop(idx).slot)
        chunk = self.chunks.get(keep_idx)
        if chunk is not None and chunk.hwm > inner:
            chunk.hwm = inner

    def clear(self) -> None:
        for chunk in self.chunks.values():
            self._arena.free(chunk.slot)
        self.chunks.clear()
