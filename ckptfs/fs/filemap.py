"""A file's contents: a sparse map from chunk index to `Chunk`. Pure.

Byte `b` of a file lives in chunk `b // chunk_size` at offset
`b % chunk_size`. A missing chunk is a hole and reads as zeros. A chunk holds
its bytes in an arena slot, on a device extent, or both:

    slot     arena slot with the bytes, or None once evicted (then `extent` has them)
    hwm      high-water mark: bytes at or above it read as zeros (a fresh slot is
             never memset; gaps are zero-filled only when a later write skips them)
    gen      bumped by every change; `extent` is a copy of generation `extent_gen`
    pins     pending journal records that captured this chunk; a pinned chunk is
             frozen, and a write to it copies it first (copy-on-write in memory)
    readers  READ replies being written from views of its slot (`read_pinned`): the
             chunk is frozen as for pins, and its slot is neither freed nor evicted
             until `read_done`
    absorbed bytes written into it since its last drain (the owner moves them to its
             drained or skipped counters: absorbed = drained + skipped + in memory)

Chunk lifecycle and device space are the owner's business (`ChunkOwner`): it
hands out slots (evicting clean chunks or raising NoSpace), hears when a
chunk changed (to queue it for the drain, to drop a stale extent), and when a
chunk left the map. `MemoryOwner` is the owner of a memory-only mount.

Data that is not in memory cannot be served synchronously: read and write
raise `NeedsFetch(chunks)` and the caller loads them and retries. A file
being restored from an object store carries a gate (`remote`, fs/remote.py)
that raises `NeedsRestore` (a NeedsFetch) for chunks not fetched yet; the
restorer writes them in with `fill`, which passes the gate.

Zero copy: a write of exactly one whole chunk whose bytes already lie in a
slot lent by the arena (the FUSE worker read the request into it) adopts
that slot instead of copying (`adopt`); so does a write of a chunk's tail
[at, chunk size) lying at the same place in its slot, after the chunk's
first `at` bytes are copied into the slot; `read_pinned` returns views of
the slots, pinned by `readers` until the reply is out.
"""
from __future__ import annotations

import functools
from typing import Iterator, Protocol

from .arena import Arena
from ..errors import NoSpace

BLOCK = 4096  # st_blocks counts whole blocks of this size, as ext4 does


class Chunk:
    """One chunk of a file: where its bytes are, and where it stands in the drain.

    Its bytes: `slot` (memory), `extent` (a device), or both; `hwm`, `gen`, `pins`, `readers`,
    `live` as the module says. Its drain state belongs to the drain (store/drain.py) and changes
    only through the transitions below, so "what may happen to a chunk now" has one answer:

        state     meaning                                     enters by        leaves by
        idle      in no queue, no worker holds it             -                enqueue(), take()
        queued    in its device's queue                       enqueue()        dequeue() (stale),
                                                                               take() (a worker)
        busy      a drain worker holds it; its slot stays     take() -> True   release()
                  the worker's until release(), even if the
                  chunk is dropped meanwhile
        writing   busy, its bytes of generation `writing`     start_write()    write_lost(),
                  being written into device space the                          release()
                  worker gave it
        again     busy, and asked to drain meanwhile: queued  enqueue()        release() -> True
                  once released                               while busy

    Derived (read-only): `drained` (its extent holds its current bytes), `wanted` (its bytes still
    matter: in a file, or held by a pending commit), `drainable`, `needs_space`.
    """

    __slots__ = ("slot", "hwm", "gen", "extent", "extent_gen", "pins", "live", "_queued", "_busy", "_again",
                 "_writing", "ino", "idx", "absorbed", "readers")

    def __init__(self, slot: int | None, ino: int, idx: int):
        self.slot = slot
        self.hwm = 0
        self.gen = 0
        self.extent = None  # journal.Extent of the copy on a device
        self.extent_gen = -1
        self.pins = 0
        self.live = True  # still in its file's map
        self._queued = False
        self._busy = False
        self._again = False
        self._writing = -1
        self.ino = ino
        self.idx = idx
        self.absorbed = 0  # bytes written since the last drain (accounting only)
        self.readers = 0  # replies in flight showing its slot

    # ---- derived -------------------------------------------------------------------
    @property
    def drained(self) -> bool:
        return self.extent is not None and self.extent_gen == self.gen

    @property
    def wanted(self) -> bool:
        """Its bytes still matter: it is in its file's map, or a pending commit holds it."""
        return self.live or bool(self.pins)

    @property
    def drainable(self) -> bool:
        """A drain would write something that matters: in memory, wanted, not on a device yet."""
        return self.slot is not None and self.wanted and not self.drained

    @property
    def needs_space(self) -> bool:
        """It will need device space it does not have: wanted, not drained, and not being written
        as it is now (a copy in flight of an older generation does not count: reserve.py)."""
        return self._writing != self.gen and not self.drained and self.wanted

    @property
    def queued(self) -> bool:
        return self._queued

    @property
    def busy(self) -> bool:
        return self._busy

    @property
    def writing(self) -> int:
        """The generation being written into device space a worker gave it, else -1."""
        return self._writing

    # ---- the drain's transitions -----------------------------------------------------
    def enqueue(self) -> bool:
        """Ask for a drain. True: it goes into its queue now (the caller puts it there). False:
        nothing to queue (queued already, drained, or not in memory), or a worker holds it, and
        it is queued when that worker lets go (`release`) rather than now, when a second worker
        would write the same bytes."""
        if self._queued or self.drained or self.slot is None:
            return False
        if self._busy:
            self._again = True
            return False
        self._queued = True
        return True

    def dequeue(self) -> bool:
        """Out of its queue without a drain (its bytes went stale); True if it was queued."""
        was, self._queued = self._queued, False
        return was

    def take(self) -> bool:
        """A drain worker takes it from its queue: True (busy now) when it still needs the drain."""
        self._queued = False
        if not self.drainable:
            return False
        self._busy = True
        return True

    def start_write(self) -> int:
        """Its current bytes go into device space the worker gave it; their generation."""
        self._writing = self.gen
        return self.gen

    def write_lost(self) -> None:
        """That write failed (or its space was given back): it needs device space again."""
        self._writing = -1

    def release(self) -> bool:
        """The worker lets go; True when it was asked to drain meanwhile (queue it again)."""
        again = self._again
        self._busy = self._again = False
        self._writing = -1
        return again

    def __repr__(self) -> str:
        return (f"Chunk(ino={self.ino}, idx={self.idx}, slot={self.slot}, hwm={self.hwm}, gen={self.gen}, "
                f"drained={self.drained}, pins={self.pins}, live={self.live})")


class NeedsFetch(Exception):
    """The chunks' bytes are only on a device: load them, then retry."""

    def __init__(self, chunks: list[Chunk]):
        super().__init__(f"{len(chunks)} chunk(s) not in memory")
        self.chunks = chunks


class ChunkOwner(Protocol):
    """What a file's data needs from whoever manages chunks: slots, device space, and word of
    every chunk change (`MemoryOwner`, or the store of a mount with devices)."""
    chunk_size: int

    def alloc_slot(self) -> int: ...
    # device space for a new chunk of `hwm` bytes (None: whole), or `chunk` grown or cut to `hwm`: DevicesFull
    def reserve(self, chunk: Chunk | None = None, hwm: int | None = None) -> None: ...
    def view(self, slot: int) -> memoryview: ...
    def chunk_changed(self, chunk: Chunk) -> None: ...
    def chunk_dropped(self, chunk: Chunk) -> None: ...
    def shorten(self, chunk: Chunk, hwm: int) -> bool: ...  # a drained chunk to be cut to hwm: kept on its extent?
    def read_ahead(self, data: "FileData", idx: int) -> None: ...
    def adopt_slot(self, slot: int) -> None: ...  # a lent slot becomes a chunk's
    def read_done(self, chunks: list[Chunk]) -> None: ...  # the replies pinning them are out
    def evictable(self) -> int: ...  # slots held by chunks already on a device
    def make_free(self, want: int) -> None: ...  # evict such chunks until `want` slots are free
    def wake(self) -> None: ...  # memory came free outside it (a lent slot back): waiters look again


class Pinned(list):
    """The pieces of a read (views of slots, or zeros), with the chunks they pin; `release()` once
    the reply is written (`on_release` is set by whoever took the read)."""

    def __init__(self, parts=(), chunks=()):
        super().__init__(parts)
        self.chunks = list(chunks)
        self.on_release = None

    def release(self) -> None:
        fn, self.on_release = self.on_release, None
        if fn is not None:
            fn(self)


class MemoryOwner:
    """The owner for a memory-only mount: slots straight from the arena, no drain."""

    def __init__(self, arena: Arena):
        self.arena = arena
        self.chunk_size = arena.chunk_size

    def alloc_slot(self) -> int:
        return self.arena.alloc_nowait()

    def reserve(self, chunk: Chunk | None = None, hwm: int | None = None) -> None:
        pass

    def view(self, slot: int) -> memoryview:
        return self.arena.view(slot)

    def chunk_changed(self, chunk: Chunk) -> None:
        pass

    def shorten(self, chunk: Chunk, hwm: int) -> bool:
        return False

    def read_ahead(self, data: "FileData", idx: int) -> None:
        pass

    def chunk_dropped(self, chunk: Chunk) -> None:
        chunk.live = False
        if chunk.pins == 0 and not chunk.readers and chunk.slot is not None:
            self.arena.free(chunk.slot)
            chunk.slot = None

    def adopt_slot(self, slot: int) -> None:
        self.arena.adopt(slot)

    def read_done(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            chunk.readers -= 1
            if not (chunk.readers or chunk.wanted) and chunk.slot is not None:
                self.arena.free(chunk.slot)
                chunk.slot = None

    def evictable(self) -> int:
        return 0  # nothing is on a device

    def make_free(self, want: int) -> None:
        pass

    def wake(self) -> None:
        pass  # nobody waits for room without devices


def _blocks(hwm: int) -> int:
    """The bytes of whole BLOCKs that `hwm` bytes take."""
    return -(-hwm // BLOCK) * BLOCK


@functools.cache
def _zeros(n: int) -> memoryview:
    """n zero bytes, read-only, shared by every file (holes read as views of them)."""
    return memoryview(bytes(n))


class FileData:
    """One regular file's contents (`inode.data`): its sparse map of chunks, changed by the core
    (and the restorer's `fill`); `owner` gives it slots and device space and hears every change."""

    def __init__(self, owner: ChunkOwner | Arena, ino: int = 0):
        if isinstance(owner, Arena):
            owner = MemoryOwner(owner)
        self.owner = owner
        self.ino = ino
        self._cs = owner.chunk_size
        # change it through put / drop / _set_hwm only: `_held` follows it
        self.chunks: dict[int, Chunk] = {}
        self._held = 0  # allocated_bytes, kept as chunks come, go and grow (a stat of a 10 GiB file
        #                 summed 10,240 chunks under the loop lock: 0.7 ms)
        self._zeros = _zeros(self._cs)
        self.remote = None  # remote.Remote while chunks are still to be restored from elsewhere

    @property
    def allocated_bytes(self) -> int:
        """Bytes the file holds, as ext4 counts them in 4 KiB blocks: each chunk up to its
        high-water mark (the zero-filled gaps below it are held too; holes are not)."""
        return self._held

    def count_held(self) -> int:
        """allocated_bytes counted chunk by chunk (check_invariants compares)."""
        return sum(_blocks(c.hwm) for c in self.chunks.values())

    def put(self, idx: int, chunk: Chunk) -> None:
        """`chunk` becomes chunk `idx` (in place of the one there, which the caller disposes of)."""
        old = self.chunks.get(idx)
        self._held += _blocks(chunk.hwm) - (0 if old is None else _blocks(old.hwm))
        self.chunks[idx] = chunk

    def drop(self, idx: int) -> Chunk | None:
        """Chunk `idx` leaves the map (None: a hole there); the caller disposes of it."""
        chunk = self.chunks.pop(idx, None)
        if chunk is not None:
            self._held -= _blocks(chunk.hwm)
        return chunk

    def _set_hwm(self, chunk: Chunk, hwm: int) -> None:
        self._held += _blocks(hwm) - _blocks(chunk.hwm)
        chunk.hwm = hwm

    def _pieces(self, off: int, length: int) -> Iterator[tuple[int, int, int]]:
        """(chunk index, offset in chunk, piece length) covering [off, off+length)."""
        cs = self._cs
        end = off + length
        while off < end:
            idx, inner = divmod(off, cs)
            n = min(cs - inner, end - off)
            yield idx, inner, n
            off += n

    def _reserve(self, old: Chunk | None, hwm: int | None) -> None:
        """Refuse (DevicesFull) unless the devices could take what chunk `old`'s place (None: a
        new chunk) becomes at `hwm` bytes: a new chunk of that size where one takes its place
        (hwm None: a whole one), else its growth (hwm None: none)."""
        if old is None or old.drained or old.pins:
            # new device space will be needed (a commit holds a pinned chunk: it drains as it is,
            # and a copy takes its place)
            self.owner.reserve(None, None if hwm is None else max(hwm, old.hwm if old else 0))
        elif hwm is not None and hwm > old.hwm:
            self.owner.reserve(old, hwm)  # it grows: its bigger piece must fit too

    def _writable_chunk(self, idx: int, whole: bool, end: int | None = None) -> Chunk:
        """The chunk at `idx`, ready to be written in place up to `end` (allocating or copying as
        needed). Refuses (DevicesFull) when the devices could not take what it becomes."""
        chunk = self.chunks.get(idx)
        self._reserve(chunk, end)
        if chunk is None:
            chunk = Chunk(self.owner.alloc_slot(), self.ino, idx)
            self.put(idx, chunk)
            return chunk
        if chunk.slot is None and not whole:
            raise NeedsFetch([chunk])
        if chunk.pins or chunk.readers or chunk.slot is None:
            fresh = Chunk(self.owner.alloc_slot(), self.ino, idx)
            if chunk.slot is not None and chunk.hwm:
                self.owner.view(fresh.slot)[:chunk.hwm] = self.owner.view(chunk.slot)[:chunk.hwm]
                fresh.hwm = chunk.hwm
            if not chunk.pins:  # only a reply held it: its bytes move on with the copy
                fresh.absorbed, chunk.absorbed = chunk.absorbed, 0
            self.put(idx, fresh)
            self.owner.chunk_dropped(chunk)
            return fresh
        return chunk

    def write(self, off: int, buf) -> int:
        """Copy `buf` to file offset `off`; returns the bytes written (short only on NoSpace/NeedsFetch).
        A file still being restored waits for all of its contents first (NeedsRestore)."""
        if self.remote is not None:
            self.remote.check_change()
        return self.fill(off, buf)

    def fill(self, off: int, buf) -> int:
        """`write` that passes the restore gate: how restored bytes come in."""
        src = memoryview(buf).cast("B")
        done = 0
        for idx, inner, n in self._pieces(off, len(src)):
            try:
                chunk = self._writable_chunk(idx, whole=(inner == 0 and n == self._cs), end=inner + n)
            except (NoSpace, NeedsFetch):
                if done:
                    return done
                raise
            dst = self.owner.view(chunk.slot)
            if inner > chunk.hwm:
                dst[chunk.hwm:inner] = self._zeros[:inner - chunk.hwm]
            dst[inner:inner + n] = src[done:done + n]
            if inner + n > chunk.hwm:
                self._set_hwm(chunk, inner + n)
            chunk.absorbed += n
            chunk.gen += 1
            self.owner.chunk_changed(chunk)
            done += n
        return done

    def adopt(self, idx: int, slot: int, at: int = 0, end: int | None = None) -> int:
        """Chunk `idx` becomes lent `slot`, whose bytes from `at` to `end` (None: the chunk's end)
        are the chunk's new bytes; the bytes written (`end` - `at`). The chunk's first `at` bytes
        are copied into the slot from the chunk as it is (zeros where it has none): a piece that
        ends a chunk whose head an earlier write put there costs `at` bytes copied instead of the
        piece. A piece that ends inside the chunk (`end`) is adopted only where the chunk holds
        nothing past `end` (`adoptable`). Raises NeedsFetch when the kept bytes are only on a
        device. A file still being restored waits for all of its contents first (NeedsRestore),
        as `write`."""
        if self.remote is not None:
            self.remote.check_change()
        cs = self._cs
        end = cs if end is None else end
        old = self.chunks.get(idx)
        keep = 0 if old is None else min(old.hwm, at)  # the old chunk's bytes that stay
        if keep and old.slot is None:
            raise NeedsFetch([old])
        self._reserve(old, end)
        self.owner.adopt_slot(slot)
        chunk = Chunk(slot, self.ino, idx)
        chunk.hwm = end
        chunk.absorbed = end - at
        chunk.gen = 1
        if at:
            dst = self.owner.view(slot)
            if keep:  # (a pinned, read or draining chunk is frozen: reading it is fine)
                dst[:keep] = self.owner.view(old.slot)[:keep]
            if keep < at:
                dst[keep:at] = self._zeros[:at - keep]
            if keep and not old.pins:  # as a copy-on-write: its bytes move on with the copy
                chunk.absorbed, old.absorbed = chunk.absorbed + old.absorbed, 0
        self.put(idx, chunk)
        if old is not None:
            self.owner.chunk_dropped(old)  # its bytes are overwritten or moved: never drained (skipped)
        self.owner.chunk_changed(chunk)
        return end - at

    def adoptable(self, idx: int, end: int) -> bool:
        """A piece from the start of chunk `idx` to `end` may take its slot as the chunk (`adopt`
        with `end`): the chunk holds nothing past `end` that would have to be copied in."""
        old = self.chunks.get(idx)
        return old is None or old.hwm <= end

    def missing(self, off: int, size: int, file_size: int) -> list[Chunk]:
        """Chunks in the range whose bytes are only on a device."""
        size = max(0, min(size, file_size - off))
        out = []
        for idx, _, _ in self._pieces(off, size):
            chunk = self.chunks.get(idx)
            if chunk is not None and chunk.slot is None and chunk.hwm:
                out.append(chunk)
        return out

    def read(self, off: int, size: int, file_size: int):
        """Up to `size` bytes at `off`, clipped to `file_size`: a memoryview when one piece suffices."""
        parts = self._read(off, size, file_size, pin=False)
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)

    def read_pinned(self, off: int, size: int, file_size: int) -> Pinned:
        """As `read`, but the pieces as they are (views of slots, no copy), their chunks pinned
        until the owner's `read_done(pinned.chunks)`."""
        return self._read(off, size, file_size, pin=True)

    def _read(self, off: int, size: int, file_size: int, pin: bool) -> Pinned:
        size = max(0, min(size, file_size - off))
        if self.remote is not None:
            self.remote.check_read(off, size)
        missing = self.missing(off, size, file_size)
        if missing:
            raise NeedsFetch(missing)
        parts = Pinned()
        for idx, inner, n in self._pieces(off, size):
            chunk = self.chunks.get(idx)
            if chunk is None or inner >= chunk.hwm:
                parts.append(self._zeros[:n])
                continue
            have = min(n, chunk.hwm - inner)
            parts.append(self.owner.view(chunk.slot)[inner:inner + have])
            if pin:
                chunk.readers += 1
                parts.chunks.append(chunk)
            if have < n:
                parts.append(self._zeros[:n - have])
        if size:
            self.owner.read_ahead(self, (off + size - 1) // self._cs)
            if self.remote is not None:
                self.remote.read_ahead((off + size - 1) // self._cs)
        return parts

    def truncate(self, new_size: int) -> None:
        """Drop everything at or beyond `new_size` (extending needs nothing: holes read as zeros).
        On a file still being restored: to zero cancels the restore, any other size waits for it."""
        if self.remote is not None:
            if new_size:
                self.remote.check_change()
            else:
                remote, self.remote = self.remote, None
                remote.cancelled()
        cs = self._cs
        keep_idx, inner = divmod(new_size, cs)
        if inner:  # first: it may raise (NeedsFetch, NoSpace, DevicesFull), and then nothing changed
            self._cut(keep_idx, inner)
        for idx in [i for i in self.chunks if i > keep_idx or (i == keep_idx and inner == 0)]:
            self.owner.chunk_dropped(self.drop(idx))

    def _cut(self, idx: int, at: int) -> None:
        """Chunk `idx` reads as zeros from `at` on (its high-water mark lowered; copied first when
        a commit or a reply holds it). NeedsFetch when its bytes are only on a device. A chunk on
        a device whose shorter self still takes the same piece or unit stays on it (`shorten`:
        nothing to write); otherwise it drains again, and needs room while the committed copy
        still holds its own. A smaller piece may need room too (a unit split for its size: a
        free piece of the old size does not serve it). So a cut may raise DevicesFull, before
        anything changed."""
        chunk = self.chunks.get(idx)
        if chunk is not None and chunk.hwm > at:
            if chunk.slot is None:
                raise NeedsFetch([chunk])
            if chunk.pins or chunk.readers:
                chunk = self._writable_chunk(idx, whole=False)
            elif chunk.drained:
                if self.owner.shorten(chunk, at):
                    self._set_hwm(chunk, at)
                    return
                self.owner.reserve(None, at)
            else:
                self.owner.reserve(chunk, at)
            self._set_hwm(chunk, at)
            chunk.gen += 1
            self.owner.chunk_changed(chunk)

    def punch(self, off: int, length: int) -> None:
        """[off, off+length) reads as zeros: chunks wholly inside (or whose bytes all lie inside)
        are dropped, becoming holes, so nothing of them drains; a chunk whose held bytes end
        inside the range has its high-water mark lowered; one whose bytes go on past it has the
        range zeroed in place (the write path: NoSpace when that needs a copy and memory is full).
        NeedsFetch as `write`. Idempotent, so a caller retries the whole call after either."""
        if self.remote is not None:
            self.remote.check_change()
        for idx, inner, n in list(self._pieces(off, length)):
            chunk = self.chunks.get(idx)
            if chunk is None or inner >= chunk.hwm:
                continue  # a hole there already
            if inner == 0 and n >= chunk.hwm:
                self.owner.chunk_dropped(self.drop(idx))
            elif inner + n >= chunk.hwm:
                self._cut(idx, inner)
            else:
                self.fill(idx * self._cs + inner, self._zeros[:n])

    def absent_bytes(self, off: int, length: int) -> int:
        """Bytes of [off, off+length) in chunks the file does not have (what allocating the range
        would take, counted in whole chunks as the devices allocate them)."""
        if length <= 0:
            return 0
        first, last = off // self._cs, (off + length - 1) // self._cs
        have = sum(1 for i in self.chunks if first <= i <= last)
        return (last - first + 1 - have) * self._cs

    def seek(self, off: int, file_size: int, hole: bool) -> int | None:
        """lseek's SEEK_HOLE (`hole`) or SEEK_DATA from `off` (0 <= off < file_size): data is what
        chunks hold below their high-water marks, the rest holes; the end of the file counts as
        a hole. None: no data at or after `off` (ENXIO). A file still being restored is data
        throughout (its map does not say yet where its holes are)."""
        cs = self._cs
        if self.remote is not None:
            return file_size if hole else off
        if hole:
            pos = off
            while pos < file_size:
                idx, inner = divmod(pos, cs)
                chunk = self.chunks.get(idx)
                if chunk is None or inner >= chunk.hwm:
                    return pos
                pos = idx * cs + chunk.hwm
            return file_size
        idx, inner = divmod(off, cs)
        chunk = self.chunks.get(idx)
        if chunk is not None and inner < chunk.hwm:
            return off
        later = [i for i, c in self.chunks.items() if i > idx and c.hwm]
        pos = min(later) * cs if later else file_size
        return pos if pos < file_size else None

    def clear(self) -> None:
        for chunk in self.chunks.values():
            self.owner.chunk_dropped(chunk)
        self.chunks.clear()
        self._held = 0
