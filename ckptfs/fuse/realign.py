"""A WRITE's payload moved onto the chunk grid in the worker, before the lock: the plan (pure).

A worker lays out its receive buffers before it knows its next request: a run of
lent arena slots, the first `g` bytes into its first slot (`g`, the shift guessed
from the last WRITE read: TrioHandler.on_read). The kernel scatters the payload
over them in order, so the payload's byte j lies at *position* g + j of the run,
position p being byte p % cs of the run's slot p // cs. When the request really
starts r != g bytes past a chunk boundary (another writer's WRITE came in
between, or the first request of a write() read before the last one's end was
known), every piece straddles two chunks: it would be copied into them under the
loop lock, with the GIL held (a memoryview slice assignment), one WRITE at a time
for the whole mount. Moved first to position r, in the worker and outside the
lock (`ctypes.memmove` releases the GIL, so workers move in parallel), the payload
lies as if the guess had been right: the pieces between the seams are whole
chunks at their boundaries and adopt their slots, the first piece adopts its slot
once its chunk's r-byte head is copied in (FileData.adopt, `at`), and only the
seams are copied under the lock. The same bytes are moved as would have been
copied; what changes is where: off the lock, off the GIL.

`moves(src, dst, length, cs)` is the plan, as memmove would do it over the run:
(dst, src, n) copies of positions, none crossing a slot boundary on either side,
in an order that overwrites no byte before it was moved (ascending when the
payload moves down, descending when it moves up). `layout(start, length, cs)` is
where the pieces lie once it sits at `start`; `worth(r, length, cs)` says whether
that layout has a piece that adopts its slot, i.e. whether moving pays.
"""
from __future__ import annotations


def slots_spanned(start: int, length: int, cs: int) -> int:
    """How many slots of a run positions [start, start + length) touch (start < cs)."""
    return -(-(start + length) // cs) if length else 0


def layout(start: int, length: int, cs: int) -> list[tuple[int, int]]:
    """The pieces of a payload of `length` bytes at position `start`: (slot index in the run,
    offset in that slot, length) cut at slot boundaries, as (index, begin, end)."""
    out, p, end = [], start, start + length
    while p < end:
        i, inner = divmod(p, cs)
        stop = min(end, (i + 1) * cs)
        out.append((i, inner, stop - i * cs))
        p = stop
    return out


def worth(r: int, length: int, cs: int) -> bool:
    """Whether a payload of `length` bytes at position r (its offset past a chunk boundary) has
    a piece that adopts its slot there: a whole chunk between the seams, or a first piece that
    reaches its chunk's end from r where the head (r bytes, copied in) is not the larger part
    (core.writev's rule)."""
    end = r + length
    if r == 0:
        return end >= cs
    if end >= 2 * cs:
        return True
    return end >= cs and r <= cs - r


def moves(src: int, dst: int, length: int, cs: int) -> list[tuple[int, int, int]]:
    """(to, frm, n) copies of run positions that move [src, src + length) to [dst, dst + length):
    each within one slot on both sides, in a safe order for overlapping ranges (a copy inside
    one slot may itself overlap: the caller uses memmove)."""
    if src == dst or not length:
        return []
    steps = []
    pos = 0
    while pos < length:
        s, d = src + pos, dst + pos
        n = min(length - pos, cs - s % cs, cs - d % cs)
        steps.append((d, s, n))
        pos += n
    if dst > src:
        steps.reverse()  # moving up: the last bytes first
    return steps
