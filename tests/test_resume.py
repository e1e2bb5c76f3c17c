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

pytestmark = pytest.mark.mount
TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train.py"


def test_train_resumes_after_daemon_sigkill(tmp_path):
    m = CkptMount(tmp_path, memory="256M")
    m.mount()
    try:
        args = [sys.executable, str(TRAIN), "--save-dir", str(m.path), "--params-mb", "4",
                "--width", "256", "--save-every", "1"]
        trainer = subprocess.Popen(args + ["--steps", "100000"], stdout=subprocess.PIPE, text=True)
        saved = 0
        deadline = time.monotonic() + 120
        for line in trainer.stdout:  # let it save a few checkpoints first
            if ": saved " in line:
                saved += 1
                if saved >= 4:
                    break
            assert time.monotonic() < deadline, "trainer saved nothing"
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
