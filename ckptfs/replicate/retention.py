"""Which replicated generations to keep: a retention policy users can state. Pure.

In the spirit of restic's `forget --keep-last/--keep-hourly/--keep-daily/
--keep-within`, a generation (one manifest: a whole durable state of the
pool) is kept when any rule keeps it:

    last     the newest N generations
    within   every generation written less than this long before now
    hourly   the newest generation of each of the N most recent hours that
             have one (UTC hours; an hour with no generation does not count)
    daily    the newest generation of each of the N most recent days that have
             one (UTC days)

The newest generation is always kept. A generation whose time is unknown
(its manifest could not be read) is kept: nothing is deleted on a guess.
What a local `rm -rf`, an overwrite of the good checkpoint or a save of NaN
weights does to the store is then bounded by the policy: the state before it
stays restorable for as long as a rule keeps one of its generations.

Defaults (DEFAULT): the newest 3, and the newest of each of the last 24
hours and of the last 7 days that have one, so a checkpoint replicated an
hour ago can still be restored, and one per day for a week. `within` is off
by default: a job saving every step would keep every one of thousands of
generations. Objects are shared by every generation that names them (content
keys), so a kept generation costs only the objects no newer kept one names.
"""
from __future__ import annotations

from dataclasses import dataclass

HOUR, DAY = 3600, 86400


@dataclass(frozen=True)
class Policy:
    """The rules, each 0 (or 0.0) when off; `last` is at least 1."""
    last: int = 3
    hourly: int = 24
    daily: int = 7
    within: float = 0.0  # seconds

    def __post_init__(self) -> None:
        if self.last < 1 or self.hourly < 0 or self.daily < 0 or self.within < 0:
            raise ValueError(f"bad retention policy {self}: last >= 1, the others >= 0")

    def describe(self) -> str:
        parts = [f"the newest {self.last}"]
        if self.within:
            parts.append(f"every one of the last {_span(self.within)}")
        if self.hourly:
            parts.append(f"the newest of each of {self.hourly} hour(s)")
        if self.daily:
            parts.append(f"the newest of each of {self.daily} day(s)")
        return ", ".join(parts)


DEFAULT = Policy()


def _span(seconds: float) -> str:
    for unit, n in (("d", DAY), ("h", HOUR), ("m", 60)):
        if seconds >= n and seconds % n == 0:
            return f"{int(seconds // n)}{unit}"
    return f"{seconds:g}s"


def parse_span(text: str) -> float:
    """'90s', '30m', '2h', '7d' (or a number of seconds) -> seconds; ValueError otherwise."""
    text = text.strip().lower()
    scale = {"s": 1, "m": 60, "h": HOUR, "d": DAY}.get(text[-1:], None)
    number = text[:-1] if scale is not None else text
    try:
        value = float(number) * (scale or 1)
    except ValueError:
        raise ValueError(f"bad duration {text!r}: expected a number with s, m, h or d") from None
    if value < 0 or value != value:
        raise ValueError(f"bad duration {text!r}: must be at least 0")
    return value


def keep(times: dict[int, float | None], policy: Policy, now: float) -> set[int]:
    """The generations to keep among `times` (generation -> wall-clock seconds it was written, None:
    unknown), at time `now`."""
    if not times:
        return set()
    gens = sorted(times, reverse=True)  # newest first
    out = set(gens[:policy.last]) | {g for g in gens if times[g] is None}
    if policy.within:
        out |= {g for g in gens if times[g] is not None and now - times[g] < policy.within}
    for width, count in ((HOUR, policy.hourly), (DAY, policy.daily)):
        buckets: set[int] = set()
        for g in gens:  # newest first: the first of each bucket is its newest
            t = times[g]
            if t is None or len(buckets) >= count:
                continue
            bucket = int(t // width)
            if bucket not in buckets:
                buckets.add(bucket)
                out.add(g)
    return out


def forget(times: dict[int, float | None], policy: Policy, now: float) -> list[int]:
    """The generations the policy no longer keeps, oldest first."""
    kept = keep(times, policy, now)
    return sorted(g for g in times if g not in kept)
