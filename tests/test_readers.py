"""Readers (fuse/kernel/readers.py): who waits in a read of /dev/fuse, driven by threads, no kernel.

Each test plays workers as threads calling enter/leave as the session's loop does, and checks
who reads: one while nothing is queued, a parked one when asked (`wake_one`, `gone`), all of
them while active, none left parked after `stop`.
"""
import threading
import time

from ckptfs.fuse.kernel.readers import Readers
from waiting import poll


def settle(pred, timeout=5.0):
    poll(pred, "the readers to settle", timeout, every=0.001)


class Worker:
    """A thread that enters (maybe parks), then holds a 'read' until told to return."""

    def __init__(self, readers: Readers, may_park: bool = True):
        self.readers = readers
        self.reading = threading.Event()
        self.go = threading.Event()
        self.t = threading.Thread(target=self._run, args=(may_park,), daemon=True)
        self.t.start()

    def _run(self, may_park):
        self.readers.enter(may_park)
        self.reading.set()
        self.go.wait(10)
        self.readers.leave()

    def finish(self):
        self.go.set()
        self.t.join(5)
        assert not self.t.is_alive()


def one_reading(r: Readers, parked: int) -> tuple[Worker, list[Worker]]:
    """A worker that reads, then `parked` more, parked behind it."""
    first = Worker(r)
    assert first.reading.wait(5)
    others = [Worker(r) for _ in range(parked)]
    settle(lambda: r.parked == parked)
    return first, others


def test_one_reads_and_the_others_park_until_woken_one_at_a_time():
    r = Readers()
    first, others = one_reading(r, 3)
    assert not any(w.reading.is_set() for w in others) and r.reading == 1
    r.wake_one()
    settle(lambda: sum(w.reading.is_set() for w in others) == 1)
    time.sleep(0.05)
    assert sum(w.reading.is_set() for w in others) == 1 and r.parked == 2  # exactly one went
    assert r.wakes == 1
    r.wake_one()
    r.wake_one()
    r.wake_one()  # one more than are parked: not kept for later
    settle(lambda: all(w.reading.is_set() for w in others))
    assert r.parked == 0 and r.wakes == 3
    for w in [first, *others]:
        w.finish()
    assert r.reading == 0
    late = Worker(r)  # nobody reads now: no parking
    assert late.reading.wait(5)
    late.finish()


def test_activate_lets_every_worker_read_for_the_window_then_they_park_again():
    r = Readers(active_s=0.2)
    first, parked = one_reading(r, 2)
    r.activate()
    for w in parked:
        assert w.reading.wait(5)
    assert r.activations == 1 and r.reading == 3
    during = Worker(r)  # within the window: reads at once though others read
    assert during.reading.wait(5)
    time.sleep(0.25)
    after = Worker(r)  # the window has passed: parks
    settle(lambda: r.parked == 1)
    assert not after.reading.is_set()
    for w in [first, *parked, during]:
        w.finish()
    r.gone()  # nobody reads now: the parked one goes
    assert after.reading.wait(5)
    after.finish()


def test_leave_asks_for_a_backlog_poll_only_while_someone_is_parked_and_not_active():
    r = Readers(active_s=0.2)
    r.enter()
    assert r.leave() is False  # nobody parked: nothing to wake, no poll
    first = Worker(r)
    assert first.reading.wait(5)
    parked = Worker(r)
    settle(lambda: r.parked == 1)
    r.enter(may_park=False)  # a spare reads at once
    assert r.leave() is True
    r.activate()
    assert parked.reading.wait(5)
    r.enter(may_park=False)
    assert r.leave() is False  # all active already
    first.finish()
    parked.finish()


def test_stop_releases_every_parked_worker_and_ends_parking():
    r = Readers()
    first, parked = one_reading(r, 3)
    r.stop()
    for w in parked:
        assert w.reading.wait(5)
    assert Worker(r).reading.wait(5)  # and nobody parks any more
    first.go.set()
    for w in parked:
        w.finish()
