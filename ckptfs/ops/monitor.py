"""What the store's counters cannot say on their own: rates, latencies, waits.

The store keeps running totals (bytes drained, per-device bytes written and
errors...). Operators want rates ("how fast is each device writing right
now"), an ETA, how long a close takes to become durable, and how often
writers waited for memory. `Monitor` derives those:

- `tick()` samples the counters; `run()` does so every `period` seconds in
  the daemon's trio loop. `rates(window)` compares the counters now with the
  oldest sample inside the window: bytes per second over the last interval.
- `on_commit(batch)` is a store hook called after each journal commit: for
  every `content` record (a close or fsync) it observes the time from the
  record's creation to its commit in `latency`, a fixed-bucket histogram
  (the drain latency: close -> durable).
- `room()` wraps the store's `wait_for_room`: each call is a write that
  found the memory budget full (backpressure); it counts them and the time
  spent waiting.

Everything here runs in the trio thread; readers in other threads (the
metrics server) ask through `trio.from_thread`.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import trio

# drain latency buckets, seconds: a 1 MiB file on NVMe to a 100 GB checkpoint on a throttled disk
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                   float("inf"))


@dataclass
class Histogram:
    """Fixed-bucket counts of observed seconds, with their sum, count and last value; grown by
    `observe` only (the drain latency, `Monitor.latency`)."""
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    sum: float = 0.0
    count: int = 0
    last: float | None = None

    def observe(self, value: float) -> None:
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
                break
        self.sum += value
        self.count += 1
        self.last = value

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it), as Prometheus wants them."""
        out, total = [], 0
        for upper, n in zip(self.buckets, self.counts):
            total += n
            out.append((upper, total))
        return out


@dataclass(frozen=True)
class Sample:
    """The store's counters at time `t`: per-device bytes written and read and errors, and the
    bytes drained and absorbed."""
    t: float
    written: tuple[int, ...]  # per device
    read: tuple[int, ...]
    errors: tuple[int, ...]
    drained: int
    absorbed: int


@dataclass(frozen=True)
class Rates:
    """Per-second rates over the last `interval` seconds (`Monitor.rates`): per-device writes, reads
    and new errors, and the drain and absorb rates."""
    interval: float  # seconds the rates cover (0 when there is no earlier sample yet)
    write_bps: tuple[float, ...]
    read_bps: tuple[float, ...]
    new_errors: tuple[int, ...]
    drain_bps: float
    absorb_bps: float


class Monitor:
    """Rates, the drain latency and backpressure counts, derived from `store`'s counters; its
    samples and counters change on the trio thread only (`tick`, `on_commit`, `room`)."""

    def __init__(self, store, *, clock=time.monotonic, period: float = 0.5, keep: float = 60.0):
        self.store = store
        self.clock = clock
        self.period = period
        self.samples: deque[Sample] = deque(maxlen=max(2, int(keep / period) + 1))
        self.started = clock()
        self.latency = Histogram()
        self.backpressure_waits = 0
        self.backpressure_seconds = 0.0
        self.samples.append(self.sample())

    def sample(self) -> Sample:
        s = self.store
        return Sample(self.clock(), tuple(d.bytes_written for d in s.stats), tuple(d.bytes_read for d in s.stats),
                      tuple(d.errors for d in s.stats), s.bytes_drained, s.bytes_absorbed)

    def tick(self) -> None:
        self.samples.append(self.sample())

    def rates(self, window: float = 2.0) -> Rates:
        """Rates between now and the oldest sample at most `window` seconds old (or the newest older one)."""
        now = self.sample()
        base = None
        for smp in self.samples:  # oldest first
            if now.t - smp.t <= window:
                base = smp
                break
        if base is None or now.t - base.t < self.period / 2:
            # too close to measure: use the newest sample older than the window instead
            older = [smp for smp in self.samples if now.t - smp.t >= self.period / 2]
            base = older[-1] if older else None
        if base is None or len(base.written) != len(now.written):
            n = len(now.written)
            return Rates(0.0, (0.0,) * n, (0.0,) * n, (0,) * n, 0.0, 0.0)
        dt = now.t - base.t
        return Rates(dt,
                     tuple((a - b) / dt for a, b in zip(now.written, base.written)),
                     tuple((a - b) / dt for a, b in zip(now.read, base.read)),
                     tuple(a - b for a, b in zip(now.errors, base.errors)),
                     (now.drained - base.drained) / dt,
                     (now.absorbed - base.absorbed) / dt)

    def on_commit(self, batch) -> None:
        now = self.clock()
        for p in batch:
            born = getattr(p, "born", None)
            if p.rec is None and not p.void and born is not None:
                self.latency.observe(max(0.0, now - born))

    async def room(self, devices_full: bool = False) -> bool:
        """The store's wait_for_room, counted as one backpressure wait."""
        t0 = self.clock()
        self.backpressure_waits += 1
        try:
            return await self.store.wait_for_room(devices_full)
        finally:
            self.backpressure_seconds += self.clock() - t0

    def uptime(self) -> float:
        return self.clock() - self.started

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(self.period)
            self.tick()
