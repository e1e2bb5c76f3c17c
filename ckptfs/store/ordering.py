"""Commit ordering: the records waiting for the journal, and the prefix rule (promise 5). Pure.

`CommitLog` owns the sequence of pending records and every decision about
it; it does no I/O and knows nothing of trio. The store feeds it events and
acts on what it returns:

    unnamed(ino)         a file just lost its last name (before the record
                         of the unlink, rmdir or rename that did it)
    record(rec)          a namespace mutation (typed record) happened
    close(ino, ...)      a changed file was closed or fsynced: a `content`
                         record capturing its chunks (the store pins them)
    flush_deferred(ino)  journal a file's deferred create now (sync)
    take_batch()         the committer asks for the next frame's records
    committed(batch)     the frame is on the devices: drop those records
    failed(batch)        the frame could not be written (it will be retried)

Events that drop a pending `content` record return the chunks it held, which
the store unpins. Rules, in order of the design:

- **Prefix.** Records leave in order, a frame at a time (`take_batch`): the
  longest ready prefix (every chunk a `content` captured drained), never
  splitting an atomic group.
- **A file appears at its first close.** A regular file's `make` waits in
  `deferred` and joins the journal with its first `content`, in one group; a
  later record that needs it first (link, setattr, xattr, rename of or onto
  it) journals it then. A file created and deleted before that leaves no trace.
- **Superseded commits are voided.** A pending `content` of a file that lost
  its last name (unlink, rename over it, rmdir) or that a newer close of the
  same file supersedes is dropped; the records from it to the one that
  voided it become one atomic group (`group_end`), so no crash can show the
  state in between.
- **Bounded lag.** Once the oldest pending record has waited `max_lag`
  seconds (`overdue`), everything pending at that moment becomes unvoidable
  (`void_floor`): voids can no longer chain groups onto it nor supersede it,
  so that prefix commits as soon as it drains.

Per file, the log also keeps its pending (not voided) `content` records and
how many of its `make` records are pending, so a close, a delete or a state
query looks at that file's records, not at every pending one: with the
drain held back while a checkpoint of many small files streams in, the log
holds thousands of records, and a scan per close made saving N files cost
O(N^2) under the loop lock (16,000 closes: 8.4 s).

INVARIANT: `pending` is in index order, indexes consecutive from
`committed + 1`; `in_flight` and `void_floor` only grow; a void record holds
no chunks; the per-file index holds exactly the pending non-void content
records and make records. `check_invariants()` checks them.
"""
from __future__ import annotations

import stat
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..format.records import Content

FRAME_OVERHEAD = 64  # bytes a record costs in a frame, roughly (for the batch budget)
EXTENT_BYTES = 80  # bytes one extent adds to a frame, roughly: 26 in its content record, 50 more in a
# digests record (--dedupe on) when the frame is the first to name it


@dataclass
class Pending:
    """One record waiting for the journal at `index`: a namespace record (`rec`), or a file's
    contents (`ino`, size, times, the chunks it pins). The commit log sets `void`, `group_end`."""
    index: int
    rec: tuple | None = None  # a namespace record (typed), or None for a content record
    ino: int = 0
    size: int = 0
    mtime: int = 0
    ctime: int = 0
    chunks: dict = field(default_factory=dict)  # chunk index -> Chunk (pinned), content records only
    void: bool = False
    group_end: int = -1  # this record and all up to group_end go in one frame (with those after it)
    born: float = 0.0  # when it was appended (the log's clock)

    @property
    def is_content(self) -> bool:
        return self.rec is None

    def ready(self) -> bool:
        return self.void or all(c.drained for c in self.chunks.values())

    def record(self) -> tuple | None:
        """The record the journal gets: None for a voided one."""
        if self.void:
            return None
        if self.rec is not None:
            return self.rec
        return Content(self.ino, self.size, self.mtime, self.ctime,
                       [(idx, c.extent) for idx, c in sorted(self.chunks.items())])


class CommitLog:
    """The records waiting for the journal, in order, and every decision about them (see the
    module docstring); the store feeds it events, the committer takes its batches."""

    def __init__(self, *, max_lag: float, alive: Callable[[int], bool], clock: Callable[[], float] = time.monotonic):
        self.max_lag = max_lag
        self.alive = alive  # does inode `ino` still have a name? (the live namespace knows)
        self._unnamed: list[int] = []  # files that lost their last name since the last record (`unnamed`)
        self.clock = clock
        self.pending: deque[Pending] = deque()
        self.next_index = 0
        self.committed = -1  # index of the last record on the devices
        self.in_flight = -1  # records up to here are being written; no longer voidable
        self.void_floor = -1  # records up to here were overdue (max_lag): no longer voidable
        self.deferred: dict[int, tuple[int, bytes, tuple]] = {}  # ino -> (parent, name, its make record)
        self.records_voided = 0
        self._content: dict[int, list[Pending]] = {}  # ino -> its pending non-void content records, oldest first
        self._made: dict[int, int] = {}  # ino -> how many of its make records are pending
        # (blocker, records_voided, committed) when take_batch last found nothing: the record it
        # stopped at, not ready. Until that changes nothing can go, and the scan is skipped.
        self._stalled: tuple | None = None

    # ---- events ----------------------------------------------------------------
    def unnamed(self, ino: int) -> None:
        """`ino` lost its last name; the record of the mutation that did it comes next."""
        self._unnamed.append(ino)

    def record(self, rec: tuple) -> list:
        """A namespace mutation; returns the chunks of commits it voided (to unpin)."""
        unnamed, self._unnamed = self._unnamed, []
        if rec.op == "make" and stat.S_ISREG(rec.mode):
            # a new file becomes part of the journal at its first close or fsync (a file
            # never closed is absent after a crash), or as soon as a later record needs it
            self.deferred[rec.ino] = (rec.parent, rec.name, rec)
            return []
        if self.deferred and self._settle_deferred(rec):
            return []
        self._freeze_if_overdue()
        p = self._append(Pending(self.next_index, rec=rec))
        freed: list = []
        if rec.op in ("unlink", "rename", "rmdir"):
            for ino in dict.fromkeys(unnamed):  # (a delete looks at the files it unnamed, no others)
                if ino in self._content and not self.alive(ino):
                    freed += self._void_older(ino, p)
        return freed

    def close(self, ino: int, size: int, mtime: int, ctime: int, chunks: dict) -> list:
        """A changed file's contents become a commit (its chunks, already pinned by the caller);
        returns the chunks of the commits it superseded (to unpin)."""
        self._freeze_if_overdue()
        made = self.flush_deferred(ino)
        p = self._append(Pending(self.next_index, ino=ino, size=size, mtime=mtime, ctime=ctime, chunks=chunks))
        if made is not None:
            made.group_end = p.index  # the file appears with its contents, never empty
        return self._void_older(ino, p)

    def flush_deferred(self, ino: int) -> Pending | None:
        """Journal `ino`'s deferred create now (its first close, or an fsync)."""
        entry = self.deferred.pop(ino, None)
        if entry is None:
            return None
        return self._append(Pending(self.next_index, rec=entry[2]))

    def take_batch(self, budget: int) -> list[Pending]:
        """The longest prefix of pending records that can go in one frame now (about `budget`
        bytes at most, unless one atomic group needs more); marks it in flight."""
        if self._still_stalled():
            return []
        batch: list[Pending] = []
        need = -1  # the last index of every group begun so far
        size = 0
        end = 0  # the batch may end after this many records (no group split)
        blocker = None
        for p in self.pending:
            if not p.ready():
                blocker = p
                break
            batch.append(p)
            need = max(need, p.group_end)
            size += FRAME_OVERHEAD + len(p.chunks) * EXTENT_BYTES
            if p.index >= need:
                end = len(batch)
                if size > budget:
                    break
        del batch[end:]  # an atomic group is not complete yet: leave it for later
        self._stalled = (blocker, self.records_voided, self.committed) if not batch and blocker is not None else None
        if batch:
            self.in_flight = max(self.in_flight, batch[-1].index)
        return batch

    def idle(self) -> bool:
        """`take_batch` would find nothing now: nothing pending, or still stalled (below)."""
        return not self.pending or self._still_stalled()

    def _still_stalled(self) -> bool:
        """The record the last `take_batch` stopped at is still not ready, and nothing was voided
        or committed since: only a void, a commit or that record's drain can let records go."""
        stalled = self._stalled
        return (stalled is not None and stalled[1:] == (self.records_voided, self.committed)
                and not stalled[0].ready())

    def committed_batch(self, batch: list[Pending]) -> list:
        """The batch is on the devices: drop it; returns the chunks its commits held (to unpin)."""
        freed: list = []
        for _ in batch:
            p = self.pending.popleft()
            freed += p.chunks.values()
            self._unindex(p)
        self.committed = batch[-1].index
        return freed

    # ---- queries -----------------------------------------------------------------
    def lag(self) -> float:
        """Seconds the oldest record not yet in the journal has waited (0 when none waits)."""
        return self.clock() - self.pending[0].born if self.pending else 0.0

    def overdue(self) -> bool:
        return bool(self.pending) and self.lag() >= self.max_lag

    def oldest_closed(self) -> tuple[int, float] | None:
        """(inode, seconds waited) of the oldest close or fsync whose commit is still pending."""
        for p in self.pending:
            if p.is_content and not p.void:
                return p.ino, self.clock() - p.born
        return None

    def content_pending(self) -> dict[int, list[Pending]]:
        """ino -> its pending (not voided) content records, oldest first."""
        return {ino: list(ps) for ino, ps in self._content.items()}

    def content_of(self, ino: int) -> list[Pending]:
        """`ino`'s pending (not voided) content records, oldest first."""
        return list(self._content.get(ino, ()))

    def made_pending(self) -> set[int]:
        """Inodes whose create is journaled but not yet on the devices."""
        return set(self._made)

    def is_made_pending(self, ino: int) -> bool:
        return ino in self._made

    def last_index(self) -> int:
        return self.next_index - 1

    def check_invariants(self) -> None:
        idx = [p.index for p in self.pending]
        assert idx == list(range(self.committed + 1, self.next_index)), "pending records out of order"
        assert all(not p.chunks for p in self.pending if p.void), "a voided record still holds chunks"
        assert self.in_flight <= self.next_index - 1 and self.void_floor <= self.next_index - 1
        content: dict[int, list[Pending]] = {}
        made: dict[int, int] = {}
        for p in self.pending:
            if p.is_content and not p.void:
                content.setdefault(p.ino, []).append(p)
            elif not p.is_content and p.rec.op == "make":
                made[p.rec.ino] = made.get(p.rec.ino, 0) + 1
        assert content == self._content and made == self._made, "the per-file index disagrees with pending"

    # ---- internals ---------------------------------------------------------------
    def _append(self, p: Pending) -> Pending:
        p.born = self.clock()
        self.pending.append(p)
        self.next_index += 1
        if p.is_content:
            self._content.setdefault(p.ino, []).append(p)
        elif p.rec.op == "make":
            self._made[p.rec.ino] = self._made.get(p.rec.ino, 0) + 1
        return p

    def _unindex(self, p: Pending) -> None:
        """`p` left pending (committed) or became void: out of the per-file index."""
        if p.is_content:
            ps = self._content.get(p.ino, [])
            for i, q in enumerate(ps):  # (by identity; the oldest first when committed)
                if q is p:
                    del ps[i]
                    if not ps:
                        del self._content[p.ino]
                    break
        elif p.rec.op == "make":
            left = self._made[p.rec.ino] - 1
            if left:
                self._made[p.rec.ino] = left
            else:
                del self._made[p.rec.ino]

    def _void_older(self, ino: int, p: Pending) -> list:
        """Void `ino`'s voidable pending content records other than `p`, grouped up to `p`."""
        freed: list = []
        for q in list(self._content.get(ino, ())):
            if q is not p and self._voidable(q):
                freed += self._void(q, p.index)
        return freed

    def _freeze_if_overdue(self) -> None:
        """Past max_lag, everything pending now must commit as it is: no more voiding of it."""
        if self.overdue():
            self.void_floor = self.next_index - 1

    def _voidable(self, q: Pending) -> bool:
        return not q.void and q.index > self.in_flight and q.index > self.void_floor

    def _void(self, q: Pending, until: int) -> list:
        self.records_voided += 1
        self._unindex(q)
        q.void = True
        freed = list(q.chunks.values())
        q.chunks = {}
        # q .. until form one group. Marking q alone is enough: a voidable q is not in flight, so
        # every batch from now on starts at or before it, and `take_batch` carries the largest
        # group_end it has passed (marking every record in between made N deletes cost O(N^2))
        q.group_end = max(q.group_end, until)
        return freed

    def _deferred_named(self, parent: int, name: bytes) -> int | None:
        for ino, (p, n, _) in self.deferred.items():
            if p == parent and n == name:
                return ino
        return None

    def _settle_deferred(self, rec: tuple) -> bool:
        """Journal deferred creates that `rec` depends on; True when `rec` cancels one out entirely."""
        op = rec.op
        if op in ("link", "setattr", "setxattr", "removexattr"):
            self.flush_deferred(rec.ino)
        elif op == "unlink":
            ino = self._deferred_named(rec.parent, rec.name)
            if ino is not None:
                del self.deferred[ino]  # created and deleted before it was ever closed: no trace
                return True
        elif op == "rename":
            src = self._deferred_named(rec.old_parent, rec.old_name)
            dst = self._deferred_named(rec.new_parent, rec.new_name)
            if dst is not None and not rec.flags:
                del self.deferred[dst]  # replaced before it was ever closed
            elif dst is not None:
                self.flush_deferred(dst)
            if src is not None:
                self.flush_deferred(src)
        return False
