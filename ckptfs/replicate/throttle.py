"""A byte-rate cap for trio tasks: `await Throttle(rate).take(n)` returns once n more bytes fit.

A token bucket with no burst: each take moves the next allowed start on by
n / rate seconds, so bytes leave at `rate` per second on average whoever
takes them. Rate None (or 0): no cap, take returns at once. Shared by the
replication's uploads (--replicate-rate) and the restore's background
fetches (--restore-rate).
"""
from __future__ import annotations

import trio


class Throttle:
    """The cap and the trio time the next take may start at."""

    def __init__(self, rate: float | None):
        self.rate = rate
        self.next = 0.0

    async def take(self, n: int) -> None:
        if not self.rate:
            return
        start = max(trio.current_time(), self.next)
        self.next = start + n / self.rate
        await trio.sleep_until(start)
