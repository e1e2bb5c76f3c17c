"""The example training script resumes from the last durable checkpoint after a crash."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mounting import CkptMount
from waiting import poll

pytestmark = pytest.mark.mount
TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train.py"


def durable_checkpoint(mp, first: int) -> bool:
    """A checkpoint after the run's first is durable. Its contents reached the journal after the
    rename that put the one before it in place, so (prefix rule) a named checkpoint survives a
    crash from now on. (The state of a file says nothing of its name: a file renamed into place
    may be durable under its temporary name only.)"""
    for n in os.listdir(mp):
        m = re.fullmatch(r"step(\d{6})\.pt", n)
        if m and int(m.group(1)) > first:
            try:
                if os.getxattr(mp / n, "user.ckptfs.state") == b"durable":
                    return True
            except FileNotFoundError:
                pass  # the trainer deleted it meanwhile (it keeps the last two)
    return False


def test_train_resumes_after_daemon_sigkill(tmp_path):
    m = CkptMount(tmp_path, memory="256M")
    m.mount()
    try:
        args = [sys.executable, str(TRAIN), "--save-dir", str(m.path), "--params-mb", "4",
                "--width", "256", "--save-every", "1"]
        trainer = subprocess.Popen(args + ["--steps", "100000"], stdout=subprocess.PIPE, text=True)
        saved = 0
        first = None
        deadline = time.monotonic() + 120
        for line in trainer.stdout:  # let it save a few checkpoints first
            if ": saved " in line:
                saved += 1
                first = first if first is not None else int(re.match(r"step (\d+):", line).group(1))
                if saved >= 4:
                    break
            assert time.monotonic() < deadline, "trainer saved nothing"
        # a checkpoint closed now is durable within --max-lag + drain time even though saves keep
        # coming (before the bound, absorb-first could defer them all until the run paused)
        poll(lambda: durable_checkpoint(m.path, first), "a durable checkpoint while the trainer saves", timeout=60)
        m.kill(clear=False)  # crash: the daemon dies mid-run, with saves in flight
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        m.clear_stale()
        m.mount()
        names = sorted(os.listdir(m.path))
        assert any(re.fullmatch(r"step\d{6}\.pt", n) for n in names), names
        res = subprocess.run(args + ["--steps", "0", "--resume"], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        assert "cannot load" not in res.stdout, res.stdout  # the newest checkpoint is complete
        step = int(re.search(r"resumed from .* \(step (\d+)\)", res.stdout).group(1))
        assert step >= 1
        res = subprocess.run(args + ["--steps", str(step + 2), "--resume"], capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0 and f"step {step + 2}: saved" in res.stdout, res.stdout + res.stderr
    finally:
        m.close()
