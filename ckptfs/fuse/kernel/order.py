"""The kernel's order of requests, kept across worker threads (`KernelOrder`).

The kernel numbers requests as it queues them (`unique`, from one counter per
connection, growing by FUSE_REQ_ID_STEP = 2; INTERRUPTs are numbered after
their target with bit 0 set), and hands them out in that order to whichever
worker reads next. Once several workers read, two requests can reach the
filesystem in the other order: a RELEASE (which the kernel sends after
close() has already returned) read by one worker, the same process's next
OPEN(O_TRUNC) or RENAME of that file read by another, and the second applied
first. ckptfs commits a file's contents at its RELEASE, so that order
matters to crash consistency (the file's next version, half written, would
be committed as the closed one).

`turn(unique)` waits until every request numbered before it has had its turn
(`done`), so the filesystem applies requests in the kernel's order, as a
single reader would. A number that never comes (a request interrupted before
any worker read it) is given up on after `gap_s`. A request that must wait
(memory, devices) calls `done` before it waits, so it holds nobody up,
exactly as a single-threaded server that moves on to the next request.
If numbers go missing more than MAX_GAPS times (a kernel numbering its
requests otherwise), turns stop waiting, with one warning.
"""
from __future__ import annotations

import logging
import threading
import time

from . import abi

log = logging.getLogger("ckptfs.fuse.kernel")

REQ_ID_STEP = 2  # since Linux 4.20 (FUSE_REQ_ID_STEP)
GAP_S = 0.05  # how long a turn waits for a request number that may never come
MAX_GAPS = 64  # more gaps than this: the numbering is not what we expect; stop waiting


class KernelOrder:
    """The request number whose turn it is, and those done ahead of it, shared by a session's
    worker threads under `_lock`: each calls `turn` before a request and `done` after."""

    def __init__(self, gap_s: float = GAP_S):
        self.gap_s = gap_s
        # held as `_lock` (a C-level enter; the Condition's own is Python), waited on as `_cond`
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._next: int | None = None  # the number whose turn it is (None: no order yet)
        self._waiters = 0  # turns waiting in _cond  GUARDED_BY: _lock
        self._ahead: set[int] = set()  # done before their turn  GUARDED_BY: _lock
        self.gaps = 0  # numbers given up on

    def start(self, after: int) -> None:
        """Requests follow `after` (the INIT's number)."""
        with self._lock:
            self._next = after + REQ_ID_STEP

    def turn(self, unique: int) -> None:
        """Return once every request numbered before `unique` is done (or given up on)."""
        if unique & abi.FUSE_INT_REQ_BIT:
            return
        nxt = self._next  # only grows (or stops: None), so a turn seen here is not taken back
        if nxt is None or unique <= nxt:
            return
        with self._lock:
            deadline = None
            while self._next is not None and unique > self._next:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.gap_s
                elif now >= deadline:
                    self.gaps += 1
                    self._next = unique  # the ones before it never came: do not wait for them again
                    self._advance()
                    if self.gaps > MAX_GAPS:
                        log.warning("request numbers keep going missing (%d times): no longer keeping "
                                    "the kernel's order across threads", self.gaps)
                        self._next = None
                    break
                self._waiters += 1
                try:
                    self._cond.wait(deadline - now)
                finally:
                    self._waiters -= 1

    def done(self, unique: int) -> None:
        """`unique` had its turn; idempotent."""
        if unique & abi.FUSE_INT_REQ_BIT:
            return
        nxt = self._next
        if nxt is None or unique < nxt:  # done already (the session says done after every request)
            return
        with self._lock:
            if self._next is None or unique < self._next:
                return
            if unique == self._next:
                self._next += REQ_ID_STEP
                self._advance()
                if self._waiters:
                    self._cond.notify_all()
            else:
                self._ahead.add(unique)

    def _advance(self) -> None:
        while self._next in self._ahead:
            self._ahead.discard(self._next)
            self._next += REQ_ID_STEP
        # numbers below the turn are history
        if self._ahead:
            self._ahead = {u for u in self._ahead if u > self._next}
