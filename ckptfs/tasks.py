"""Small trio helpers: `gather` for the store's tasks, `in_threads` for blocking calls made at
once, `LoopLock` for threads that share the trio thread's state."""
from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass

import outcome
import trio


async def gather(calls: list[tuple]) -> None:
    """Run `(afn, *args)` calls concurrently; raise the first failure itself (not a group)."""
    errors: list[BaseException] = []

    async def one(afn, *args) -> None:
        try:
            await afn(*args)
        except Exception as e:  # noqa: BLE001 - collected and re-raised below
            errors.append(e)

    async with trio.open_nursery() as n:
        for call in calls:
            n.start_soon(one, *call)
    if errors:
        raise errors[0]


async def in_threads(calls: list[tuple]) -> list[outcome.Outcome]:
    """Run blocking `(fn, *args)` calls at once, each in a worker thread of trio's cache; the
    outcome of each, in order. The task wakes once, when the last call returns: a
    `trio.to_thread.run_sync` per call (in `gather`) costs the trio thread a task, a thread
    hop and a scheduler pass per call. Like `to_thread.run_sync`, it cannot be cancelled
    while the calls run (they are not abandoned)."""
    if not calls:
        return []
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()
    results: list = [None] * len(calls)
    left = [len(calls)]
    lock = threading.Lock()

    def deliver(i: int, result: outcome.Outcome) -> None:  # in the worker thread
        results[i] = result
        with lock:
            left[0] -= 1
            last = not left[0]
        if last:
            token.run_sync_soon(trio.lowlevel.reschedule, task)

    for i, (fn, *args) in enumerate(calls):
        trio.lowlevel.start_thread_soon(functools.partial(fn, *args), functools.partial(deliver, i))
    await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
    return results


HANDOFF_MAX_S = 0.005  # the longest the trio thread lets queued threads go first, per scheduler pass
QUIET_S = 0.001  # a settling wake-up of the trio thread waits for a pause in requests this long...
SETTLE_MAX_S = 0.005  # ... but no longer than this after the first call it carries


class LoopLock(trio.abc.Instrument):
    """One lock for everything the trio thread owns (core, store, namespace), shared with other threads.

    Once `install()`ed (on the trio thread), the trio thread holds `lock` whenever it runs and
    lets go only while it sleeps in its I/O wait: trio calls `before_io_wait` and
    `after_io_wait` around every wait of its scheduler loop, busy or idle. Another thread
    (a FUSE worker) that takes `lock` may then call the same synchronous code the trio
    tasks call, and sees and leaves every invariant as a trio task would: between two
    checkpoints of the trio thread nothing else runs.

    Such a thread must not wake trio tasks itself (a ParkingLot, an Event, a nursery, the
    trio clock belong to the trio thread): that code goes through `soon(fn, *args)`, which
    calls fn at once on the trio thread (or when nothing is installed) and otherwise queues
    it for the trio thread (`run_sync_soon`, once per batch; argument-less calls queued
    twice run once). Callers of `soon` hold `lock`. A thread holding `lock` must never wait
    for the trio thread (`trio.from_thread.run`): the trio thread waits for the lock first.

    Deferred wake-ups: a FUSE worker calls `defer()` before it serves a request and `kick()`
    once the reply is out (or before it hands the request to the trio thread). Calls it
    queued meanwhile wake the trio thread only at `kick()`: woken sooner, the trio thread
    would take the GIL and run the work they start (a journal commit) while the worker still
    has its reply to write, and the caller would wait for both.

    Settling (`settle = True`, set by a front end whose reading thread calls `due_in()` and
    `wake_due()`): `kick()` then wakes the trio thread not at once but when requests pause for
    QUIET_S, or SETTLE_MAX_S after the first call it carries, whichever comes first. The work
    those calls start (the drain of a closed file, its journal commit) costs the trio thread a
    few scheduler passes under the GIL; run at once, they land between a client's close and its
    next requests (a chmod, the next file's create) and hold up each of them: the one worker
    that reads must get the GIL back from the trio thread before it can read again. Settled,
    they run once the client pauses, one pass for several files. Whoever waits for the trio
    thread (a request that blocks, an fsync) wakes it directly, and it then runs the settling
    calls too (`after_io_wait`).

    Fairness: a busy trio thread lets go and takes the lock back at once on every pass, and
    would win every race against a thread woken to take it. So a thread that has to wait
    says so (`_waiting`), and the trio thread, coming out of its I/O wait, lets every such
    thread have its turn first (at most HANDOFF_MAX_S per pass).

    `statistics()`: how often and how long other threads waited for the lock, and how often the
    trio thread woke (`trio_passes`: each wake-up costs it a scheduler pass under the GIL).
    """

    def __init__(self):
        self.lock = threading.Lock()
        self._thread: int | None = None
        self._token = None
        self._pending: list[tuple] = []
        self._pending_keys: set = set()
        self.waits = 0  # acquisitions by other threads that had to wait
        self.wait_s = 0.0  # their total wait
        self.max_wait_s = 0.0
        self.acquired = 0  # acquisitions by other threads
        self.passes = 0  # times the trio thread came out of its I/O wait (woken, or a timeout)
        self._waiting = 0  # other threads blocked on the lock now (GUARDED_BY: _turn)
        self._turn = threading.Condition(threading.Lock())
        self._tls = threading.local()  # .defer: this thread's wake-ups wait for kick(); .kick: one is due
        self.settle = False  # kick() leaves the wake-up to due_in()/wake_due() (see Settling)
        self._due: float | None = None  # monotonic time of the first settling kick() not yet woken
        self.settled = 0  # wake-ups that waited for a pause (wake_due)

    # ---- the trio thread -------------------------------------------------------------
    def install(self) -> None:
        """On the trio thread: hold the lock from now on while running."""
        self.lock.acquire()
        self._thread = threading.get_ident()
        self._token = trio.lowlevel.current_trio_token()
        trio.lowlevel.add_instrument(self)

    def uninstall(self) -> None:
        """On the trio thread: stop (other threads must be done with the lock)."""
        if self._thread is None:
            return
        trio.lowlevel.remove_instrument(self)
        self._run_pending()
        self._thread = self._token = None
        self.lock.release()

    def before_io_wait(self, timeout: float) -> None:
        self.lock.release()

    def after_io_wait(self, timeout: float) -> None:
        self.passes += 1
        if self._due is not None:  # woken for something else: the settling calls come along
            self._due = None
            self._token.run_sync_soon(self._run_pending)
        if self._waiting:  # threads queued for the lock go first (a busy trio thread would win every race)
            with self._turn:
                self._turn.wait_for(lambda: not self._waiting, HANDOFF_MAX_S)
        self.lock.acquire()

    # ---- any thread --------------------------------------------------------------------
    def __enter__(self):
        if not self.lock.acquire(blocking=False):
            t0 = time.perf_counter()
            with self._turn:
                self._waiting += 1
            self.lock.acquire()
            with self._turn:
                self._waiting -= 1
                if not self._waiting:
                    self._turn.notify_all()
            waited = time.perf_counter() - t0
            self.waits += 1
            self.wait_s += waited
            self.max_wait_s = max(self.max_wait_s, waited)
        self.acquired += 1
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()

    @property
    def installed(self) -> bool:
        return self._thread is not None

    def soon(self, fn, *args) -> None:
        """fn(*args) on the trio thread: now if this is it, else as soon as it runs (hold `lock`)."""
        if self._thread is None or threading.get_ident() == self._thread:
            fn(*args)
            return
        if not args:
            if fn in self._pending_keys:
                return
            self._pending_keys.add(fn)
        first = not self._pending
        self._pending.append((fn, args))
        if first:
            if getattr(self._tls, "defer", False):
                self._tls.kick = True
            else:
                self._token.run_sync_soon(self._run_pending)

    def unpark(self, lot: trio.lowlevel.ParkingLot, *, every: bool = True) -> None:
        """Wake the tasks parked in `lot` (`every`) or the first, through `soon`; nothing when none
        is parked: a task that is not parked looks again before it parks (it checks and parks in
        one step), and a wake-up of the trio thread for nobody costs a scheduler pass."""
        if lot:
            self.soon(lot.unpark_all if every else lot.unpark)

    def defer(self) -> None:
        """From now on this thread's `soon` calls wake the trio thread at its next `kick()`."""
        self._tls.defer = True

    def kick(self, *, now: bool = False) -> None:
        """Wake the trio thread for the calls this thread queued since `defer()` (if any): at
        once, or once requests pause while settling (unless `now`); this thread's later calls
        wake it at once again."""
        self._tls.defer = False
        queued = getattr(self._tls, "kick", False)
        self._tls.kick = False
        if not self.settle:
            if queued:
                self._wake()
            return
        t = time.monotonic()
        if queued and self._due is None:
            self._due = t
        due = self._due  # (also another thread's: its calls may carry this thread's)
        if due is not None and (now or t - due >= SETTLE_MAX_S):
            self._wake()

    def due_in(self) -> float | None:
        """Settling: seconds a pause in requests must last before `wake_due()`; None: none due."""
        due = self._due
        if due is None:
            return None
        return max(0.0, min(QUIET_S, due + SETTLE_MAX_S - time.monotonic()))

    def wake_due(self) -> None:
        """Settling: requests paused (or SETTLE_MAX_S passed): wake the trio thread for the calls."""
        if self._due is not None:
            if not self._pending:  # run meanwhile (the trio thread woke for something else)
                self._due = None
                return
            self.settled += 1
            self._wake()

    def _wake(self) -> None:
        self._due = None
        token = self._token
        if token is not None:
            token.run_sync_soon(self._run_pending)

    def _run_pending(self) -> None:
        self._due = None
        pending, self._pending = self._pending, []
        self._pending_keys = set()
        for fn, args in pending:
            fn(*args)

    def statistics(self) -> "LockStats":
        return LockStats(self.acquired, self.waits, self.wait_s, self.max_wait_s, self.passes, self.settled)


@dataclass(frozen=True)
class LockStats:
    """One reading of a LoopLock's counters (`LoopLock.statistics()`)."""
    acquired: int  # acquisitions by other threads
    waits: int  # ... that had to wait
    wait_s: float  # their total wait
    max_wait_s: float
    trio_passes: int  # times the trio thread came out of its I/O wait
    settled_wakes: int  # wake-ups that waited for a pause in requests
