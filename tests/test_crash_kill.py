"""Crash tests with real processes: SIGKILL the daemon while a checkpoint loop runs.

The loop (tests/crash_writer.py) saves with tmp + rename, fsyncs every other
save, deletes the save before the previous one, and overwrites latest.bin in
place. The daemon is killed at random moments, 20 times; after each remount:

- every file is bit-exact one of the versions written (nothing torn, nothing
  empty: a file appears at its first close);
- the last save whose fsync returned is there (or a later one replaced it);
- the saves present are a contiguous run ending at the newest: deleting the
  previous checkpoint after saving the next never loses both (prefix semantics).
"""
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crash_writer import payload
from mounting import CkptMount

pytestmark = pytest.mark.mount
WRITER = Path(__file__).with_name("crash_writer.py")


def last_fsynced(log: Path) -> int:
    if not log.exists():
        return -1
    steps = [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("fsynced")]
    return max(steps, default=-1)


def verify(mp: Path, fsynced: int) -> int:
    names = os.listdir(mp)
    steps = []
    payloads = {}
    for n in names:
        m = re.fullmatch(r"step(\d+)\.bin(\.tmp)?", n)
        if m:
            step = int(m.group(1))
            data = (mp / n).read_bytes()
            assert data == payload(step), f"{n} is torn or wrong ({len(data)} bytes)"
            if not m.group(2):
                steps.append(step)
            payloads[step] = True
        elif n == "latest.bin":
            data = (mp / n).read_bytes()
            top = max([int(re.sub(r"\D", "", x) or -1) for x in names if x.startswith("step")], default=0)
            assert any(data == payload(k) for k in range(max(0, top - 3), top + 2)), "latest.bin is torn"
        else:
            raise AssertionError(f"unexpected file {n}")
    everything = sorted(payloads)
    if fsynced >= 0:
        assert everything and max(everything) >= fsynced, \
            f"save {fsynced} was fsynced but the newest present is {everything}"
    if steps:
        steps.sort()
        assert steps == list(range(steps[0], steps[-1] + 1)), f"saves not contiguous: {steps}"
        assert len(steps) <= 3, f"old saves not deleted: {steps}"
    return max(everything, default=-1)


def test_sigkill_during_checkpoint_loop(tmp_path):
    rng = random.Random(int(os.environ.get("CKPTFS_CRASH_SEED", "7")))
    m = CkptMount(tmp_path, memory="256M", ndev=2)
    log = tmp_path / "writer.log"
    newest = -1
    try:
        for i in range(20):
            m.mount()
            newest = max(newest, verify(m.path, last_fsynced(log)))
            writer = subprocess.Popen([sys.executable, str(WRITER), str(m.path), str(log)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(rng.uniform(0.3, 1.5))
            m.kill(clear=False)  # the writer now gets ENOTCONN, never the directory underneath
            writer.kill()
            writer.wait()
            m.clear_stale()
            assert os.listdir(m.path) == [], "the writer wrote beside the mount"
        m.mount()
        final = verify(m.path, last_fsynced(log))
        assert final > 5, "the writer made no progress"
        assert m.umount().returncode == 0
        m.mount()
        verify(m.path, last_fsynced(log))
    finally:
        m.close()
