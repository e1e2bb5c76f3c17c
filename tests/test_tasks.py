"""tasks.in_threads: blocking calls at once, one wake-up of the trio thread for all of them."""
from __future__ import annotations

import threading
import time

import outcome
import trio

from ckptfs.tasks import gather, in_threads


class Passes(trio.abc.Instrument):
    """Counts the scheduler's passes (each return from its I/O wait)."""

    def __init__(self):
        self.n = 0

    def after_io_wait(self, timeout: float) -> None:
        self.n += 1


def _fail():
    raise ValueError("no")


def test_outcomes_come_in_order_and_failures_are_outcomes_not_raised():
    async def main():
        return await in_threads([(lambda: 1,), (_fail,), (lambda x: x * 2, 21)])

    res = trio.run(main)
    assert res[0] == outcome.Value(1) and res[2] == outcome.Value(42)
    assert isinstance(res[1], outcome.Error) and isinstance(res[1].error, ValueError)
    assert trio.run(in_threads, []) == []


def test_the_calls_run_at_once():
    barrier = threading.Barrier(3, timeout=10)  # broken (an error) unless all three wait together

    async def main():
        return await in_threads([(barrier.wait,)] * 3)

    assert all(isinstance(r, outcome.Value) for r in trio.run(main))


def test_the_trio_thread_wakes_once_for_all_the_calls():
    delays = [0.0, 0.03, 0.06, 0.09]  # each call returns at its own moment
    ways = {"in_threads": lambda: in_threads([(time.sleep, d) for d in delays]),
            "to_thread": lambda: gather([(trio.to_thread.run_sync, time.sleep, d) for d in delays])}

    async def main(p: Passes) -> dict:
        counted = {}
        for name, way in ways.items():
            await trio.sleep(0.01)
            before = p.n
            await way()
            counted[name] = p.n - before
        return counted

    p = Passes()
    counted = trio.run(main, p, instruments=[p])
    assert counted["in_threads"] <= 2 < len(delays) <= counted["to_thread"], counted


def test_a_cancel_waits_for_the_calls_then_takes_effect():
    done = []

    def slow():
        time.sleep(0.2)
        done.append(1)

    async def main():
        t0 = time.monotonic()
        with trio.move_on_after(0.01) as scope:
            await in_threads([(slow,)])
            await trio.sleep(0)  # the next checkpoint sees the cancel
        return time.monotonic() - t0, scope.cancelled_caught

    took, cancelled = trio.run(main)
    assert done == [1] and took >= 0.2 and cancelled
