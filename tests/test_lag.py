"""Bounded durability lag (--max-lag) under continuous saves, on a real mount.

A trainer that saves a 16 MiB checkpoint with no pause (tests/lag_writer.py),
either as tmp + rename + delete the previous or by overwriting one path in
place, keeps writes flowing and memory free: the two ways the absorb-first
drain used to starve the journal. The bound: a save closed more than
max_lag + drain time ago is in the journal (or superseded by a later save
that is). Checked two ways:

- the daemon's own account, sampled throughout the run: `lag.seconds` (how
  long the oldest record not yet in the journal has waited) stays under the
  bound;
- from outside: the daemon is SIGKILLed at random moments; after the remount
  the newest checkpoint visible is bit-exact and no save logged as visible
  more than the bound before the kill is newer than it.
"""
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptfs.ops.control import Client, control_path
from lag_writer import body, step_of
from mounting import CkptMount
from waiting import poll

pytestmark = pytest.mark.mount
WRITER = Path(__file__).with_name("lag_writer.py")
MAX_LAG = float(os.environ.get("CKPTFS_TEST_MAX_LAG", "1.0"))
# Draining and committing what was pending once the oldest record became overdue (at that moment
# everything pending becomes unvoidable: store/ordering.py), while the writer keeps saving 16 MiB
# back to back on the same 2 cores. 2.0 s was too little on an AMD EPYC VM (2026-12-02): the
# daemon's own lag peaked at 2.87-3.40 s over six 8 s runs, and the SIGKILL test failed 1 run in
# 3-4 at 3.0-3.1 s, with and without that day's changes. An unbounded lag (the bug this file
# guards) still fails both.
DRAIN_ALLOWANCE = 3.5
BOUND = MAX_LAG + DRAIN_ALLOWANCE


def saves(log: Path) -> list[tuple[int, float]]:
    """(step, time visible) of each save the writer logged."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "saved":
            out.append((int(parts[1]), float(parts[2])))
    return out


def start_writer(m: CkptMount, log: Path, mode: str) -> subprocess.Popen:
    before = len(saves(log))
    w = subprocess.Popen([sys.executable, str(WRITER), str(m.path), str(log), mode],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    poll(lambda: len(saves(log)) > before or w.poll() is not None, "the writer's first save", timeout=60)
    assert w.poll() is None, w.stderr.read().decode()
    return w


def newest_visible(mp: Path) -> int:
    """The step of the newest checkpoint in the mount (checked bit-exact); -1 if none."""
    found = -1
    rest = body()
    for n in os.listdir(mp):
        if n.endswith(".tmp"):
            continue
        data = (mp / n).read_bytes()
        step = step_of(data)
        assert data[8:] == rest and step >= 0, f"{n} is torn or wrong ({len(data)} bytes)"
        found = max(found, step)
    return found


@pytest.mark.parametrize("mode", ["rename", "inplace"])
def test_lag_stays_bounded_under_continuous_saves(tmp_path, mode):
    m = CkptMount(tmp_path, memory="512M", extra=("--max-lag", str(MAX_LAG)))
    m.mount()
    log = tmp_path / "writer.log"
    writer = None
    try:
        writer = start_writer(m, log, mode)
        worst = 0.0
        samples = 0
        t_end = time.monotonic() + 8
        with Client(control_path(str(m.path))) as c:
            while time.monotonic() < t_end:
                lag = c.request({"op": "status", "window": 1})["status"]["lag"]
                assert lag["max_lag"] == MAX_LAG
                worst = max(worst, lag["seconds"])
                samples += 1
                assert lag["seconds"] <= BOUND, f"a save has waited {lag['seconds']}s to reach the journal"
                time.sleep(0.05)
        done = saves(log)
        assert len(done) >= 10, f"the writer saved only {len(done)} times"
        assert samples >= 20
        print(f"{mode}: {len(done)} saves, worst lag {worst:.2f}s over {samples} samples")
    finally:
        if writer is not None:
            writer.kill()
            writer.wait()
        m.close()


def test_sigkill_at_random_times_loses_no_more_than_the_bound(tmp_path):
    rng = random.Random(int(os.environ.get("CKPTFS_CRASH_SEED", "11")))
    m = CkptMount(tmp_path, memory="512M", extra=("--max-lag", str(MAX_LAG)))
    try:
        for i in range(12):
            mode = ("rename", "inplace")[i % 2]
            log = tmp_path / f"writer-{i}.log"
            m.mount()
            for n in os.listdir(m.path):  # the other pattern's files from the round before
                if (mode == "rename") == (n == "last.pt"):
                    os.unlink(m.path / n)
            writer = start_writer(m, log, mode)
            time.sleep(rng.uniform(2.0, 6.0))
            killed_at = time.time()
            m.kill(clear=False)
            writer.kill()
            writer.wait()
            m.clear_stale()
            m.mount()
            newest = newest_visible(m.path)
            due = [step for step, t in saves(log) if t < killed_at - BOUND]
            assert not due or newest >= max(due), (
                f"round {i} ({mode}): save {max(due)} was visible {killed_at - dict(saves(log))[max(due)]:.1f}s "
                f"before the kill, but the newest checkpoint after the remount is {newest}")
            assert m.umount().returncode == 0
        assert newest > 0
    finally:
        m.close()
