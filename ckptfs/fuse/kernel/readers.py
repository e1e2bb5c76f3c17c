"""Which workers wait in a read of /dev/fuse: one while requests come one at a time, all under load.

The kernel hands each request to the reader that has waited longest. With N
workers all waiting in `os.readv`, a client that sends one request at a time
(a chmod, then a utime; a Lightning or Hugging Face save: open, write,
close, chmod, one after another) is served by the coldest thread every time:
on the 2-core VM a chmod of an idle file took 48 us with two workers and 35
us with one (`--threads 1`). One worker reading (the one that just replied,
still hot) serves such a client as a single-threaded server would, and no
worker needs waking per request; a lone writer's WRITEs then all go to the
worker that saw the last one, whose lent slots are laid out for its shift
(docs/ENGINE.md "One reader").

So by default a worker that finds another already reading parks here
instead of reading (`enter`), and the one reader serves each request itself,
then reads again. More read when there is concurrency to serve:
  - a poll right after a read finds another request already queued: one
    parked worker reads once more (`wake_one`; the kernel's RELEASE of a file
    just closed, queued beside the closer's next request), or, after a read
    of BULK bytes or more (a WRITE of several writers at once), every worker
    reads for ACTIVE_S (`activate`);
  - a handler is about to wait (`Session.waiting`: memory, a fetch, an fsync,
    an INTERRUPT), so that other requests, and the kernel's INTERRUPT of that
    one, are read: every worker reads for ACTIVE_S.
While every worker is active, nothing polls and nothing parks; when the
window has passed, workers returning from a request park again one by one,
while the last one reading stays. One writer alone sends its WRITEs one at a
time (a direct write() waits for each), so it is served by one hot reader.
A handler that blocks without `Session.waiting()` holds up the requests
behind it, as in a single-threaded server. No worker is left parked with
nobody reading: a spare worker that leaves wakes one (`gone`), and a worker
that exits (unmount, a failed read) stops all parking (`stop`).
"""
from __future__ import annotations

import select
import threading
import time

ACTIVE_S = 0.02  # every worker reads this long after a sign of concurrency
BULK = 1 << 20  # a read this large with more queued behind it: several writers at once


class Readers:
    """Which of a session's workers read /dev/fuse now: the reading and parked counts and the
    active window, under `_lock`, changed by the workers around each read and before a wait."""

    def __init__(self, active_s: float = ACTIVE_S):
        self.active_s = active_s
        # held as `_lock` (a C-level enter; the Condition's own is Python), waited on as `_cond`
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.reading = 0  # workers in a read, or about to start one   GUARDED_BY: _lock
        self.parked = 0  # workers parked in `enter`                    GUARDED_BY: _lock
        self._until = 0.0  # every worker reads until then (monotonic)  GUARDED_BY: _lock
        self._stopped = False  # no more parking                         GUARDED_BY: _lock
        self._passes = 0  # parked workers let through once (`wake_one`)  GUARDED_BY: _lock
        self.parks = 0  # statistics: times a worker parked
        self.activations = 0  # times every worker was asked to read
        self.wakes = 0  # times one parked worker was asked to read once

    def enter(self, may_park: bool = True) -> None:
        """Before a read: park while another worker reads and none is wanted (`may_park` False:
        a spare worker, which reads at once)."""
        with self._lock:
            while may_park and self.reading and not self._stopped and time.monotonic() >= self._until:
                if self._passes:
                    self._passes -= 1
                    break
                self.parked += 1
                self.parks += 1
                self._cond.wait()
                self.parked -= 1
            self.reading += 1

    def leave(self) -> bool:
        """A read returned. True when the caller should look for a backlog (`backlog`), because
        workers are parked and every worker is not already reading."""
        with self._lock:
            self.reading -= 1
            return bool(self.parked) and not self._stopped and time.monotonic() >= self._until

    def wake_one(self) -> None:
        """One parked worker reads once (then parks again if another still reads)."""
        with self._lock:
            if self.parked > self._passes:
                self._passes += 1
                self.wakes += 1
                self._cond.notify()

    def activate(self) -> None:
        """Every worker reads for `active_s` from now (parked ones wake)."""
        with self._lock:
            self._until = time.monotonic() + self.active_s
            if self.parked:
                self.activations += 1
                self._cond.notify_all()

    def gone(self) -> None:
        """A spare worker leaves: if nobody reads now, a parked worker must."""
        with self._lock:
            if not self.reading and self.parked:
                self._cond.notify()  # it finds nobody reading: it reads

    def stop(self) -> None:
        """No parking from now on: every parked worker reads (and sees the unmount)."""
        with self._lock:
            self._stopped = True
            self._cond.notify_all()


def backlog(poller: select.poll) -> bool:
    """Whether the device registered in `poller` has a request queued (a poll that does not wait)."""
    try:
        return bool(poller.poll(0))
    except OSError:
        return False
