"""The retention policy (replicate/retention.py), pure: which generations a policy keeps."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfs.replicate.retention import DAY, DEFAULT, HOUR, Policy, forget, keep, parse_span

T0 = 1_800_000_000.0  # a fixed "now" (no sleeps, no real clock)


def test_a_day_of_saves_every_minute_keeps_the_newest_three_and_one_per_hour():
    times = {g: T0 - DAY + g * 60 for g in range(1, 24 * 60 + 1)}  # generation g written g minutes into the day
    now = max(times.values())
    kept = keep(times, Policy(last=3, hourly=24, daily=0), now)
    newest = sorted(times)[-3:]
    by_hour: dict[int, int] = {}
    for g in sorted(times):  # the newest generation of each hour
        by_hour[int(times[g] // HOUR)] = g
    expected = set(newest) | {by_hour[h] for h in sorted(by_hour)[-24:]}
    assert kept == expected and len({int(times[g] // HOUR) for g in kept}) == 24
    # one replicated an hour ago is still there: the newest generation of that hour
    hour_ago = [g for g in times if now - HOUR - 60 < times[g] <= now - HOUR]
    assert any(int(times[g] // HOUR) == int(times[hour_ago[0]] // HOUR) for g in kept)


def test_daily_keeps_one_per_day_for_a_week_not_more():
    times = {g: T0 - g * DAY / 2 for g in range(1, 40)}  # two generations a day, going back 20 days
    times = {len(times) + 1 - g: t for g, t in times.items()}  # generation numbers grow with time
    kept = keep(times, Policy(last=1, hourly=0, daily=7), max(times.values()))
    days = {int(times[g] // DAY) for g in kept}
    assert len(days) == 7 and len(kept) == 7


def test_within_keeps_every_generation_younger_than_it():
    times = {g: T0 - (10 - g) * 60 for g in range(1, 11)}
    kept = keep(times, Policy(last=1, hourly=0, daily=0, within=300), T0)
    assert kept == {g for g in times if T0 - times[g] < 300}


def test_unknown_times_are_kept_and_the_newest_always():
    times = {1: None, 2: T0 - 10 * DAY, 3: T0}
    assert keep(times, Policy(last=1, hourly=0, daily=0), T0) == {1, 3}
    assert forget(times, Policy(last=1, hourly=0, daily=0), T0) == [2]
    assert keep({}, DEFAULT, T0) == set()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 30 * DAY, allow_nan=False), min_size=1, max_size=60),
       st.integers(1, 5), st.integers(0, 30), st.integers(0, 10), st.floats(0, 2 * DAY, allow_nan=False))
def test_a_policy_keeps_the_newest_and_a_larger_one_keeps_more(ages, last, hourly, daily, within):
    times = {g: T0 - age for g, age in enumerate(sorted(ages, reverse=True), 1)}  # newer generation, newer time
    p = Policy(last, hourly, daily, within)
    kept = keep(times, p, T0)
    assert max(times) in kept and len(kept) >= min(last, len(times))
    assert set(forget(times, p, T0)) == set(times) - kept
    bigger = Policy(last + 1, hourly + 1, daily + 1, within + 60)
    assert kept <= keep(times, bigger, T0)


def test_bad_policies_and_spans_are_refused():
    with pytest.raises(ValueError):
        Policy(last=0)
    with pytest.raises(ValueError):
        Policy(hourly=-1)
    assert parse_span("90s") == 90 and parse_span("2h") == 7200 and parse_span("7d") == 7 * DAY
    assert parse_span("30") == 30 and parse_span("0") == 0
    for bad in ("", "h", "-1h", "two days"):
        with pytest.raises(ValueError):
            parse_span(bad)
    assert "24 hour" in DEFAULT.describe() and "7 day" in DEFAULT.describe()
