"""How long a process holds the interpreter lock: py-spy's samples of the thread holding it.

`py-spy record --gil --nonblocking` reads the process's memory `rate` times a
second (without stopping it) and records a stack only when some thread holds
the GIL, so samples / rate is the time the lock was held over the window,
whatever the number of cores: its inverse per GiB is the most one daemon can
move per second, however many threads wait for it. Checked against a known
load (`python benchmarks/lockprobe.py --check`): two threads holding the lock
30% and 20% of the time measured 0.46-0.50 of a second per second against
0.48 CPU seconds (2-core VM). With `--threads` each sample names its thread, so the
time splits by role: the trio thread, the FUSE workers, the worker threads
(device I/O, crc32c, the journal).

Where py-spy is missing (it is in the bench extra), `LockProbe.available` is
False and the benchmarks print "-" for lock time.
"""
from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RATE = 1000  # samples per second


def _py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def role(thread: str) -> str:
    """A thread name as py-spy prints it ('thread (123): MainThread') -> its role in the daemon."""
    name = thread.split(": ", 1)[-1]
    if name == "MainThread":
        return "trio"
    if re.search(r"fuse[- ]\d+$", name):
        return "fuse"
    return "threads"


class LockProbe:
    """A context manager: the GIL-held seconds of process `pid` over its block, by role.

        with LockProbe(pid) as probe:
            ...
        probe.seconds, probe.by_role, probe.top(10)
    """

    available = _py_spy() is not None

    def __init__(self, pid: int, rate: int = RATE):
        self.pid, self.rate = pid, rate
        self.seconds = 0.0
        self.by_role: dict[str, float] = {}
        self.stacks: collections.Counter = collections.Counter()
        self.behind = ""
        self._proc = None
        self._out = None

    def __enter__(self) -> "LockProbe":
        if not self.available:
            return self
        fd, self._out = tempfile.mkstemp(suffix=".txt", prefix="lockprobe-")
        os.close(fd)
        self._proc = subprocess.Popen(
            [_py_spy(), "record", "--gil", "--nonblocking", "--threads", "--rate", str(self.rate), "--format", "raw",
             "--output", self._out, "--pid", str(self.pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(0.3)  # attached and sampling (the process is idle meanwhile: nothing to miss)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.send_signal(signal.SIGINT)
        try:
            _, err = self._proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, err = self._proc.communicate()
        self.behind = "; ".join(line for line in err.splitlines() if "behind" in line)
        roles: dict[str, int] = collections.Counter()
        with open(self._out) as f:
            for line in f:
                stack, _, n = line.rstrip("\n").rpartition(" ")
                if not stack:
                    continue
                frames = stack.split(";")
                roles[role(frames[0])] += int(n)
                self.stacks[";".join(frames[1:])] += int(n)
        os.unlink(self._out)
        self.by_role = {k: v / self.rate for k, v in roles.items()}
        self.seconds = sum(self.by_role.values())

    def top(self, n: int = 15) -> list[tuple[str, float]]:
        """The innermost frames that held the lock longest: (frame, seconds)."""
        leaf: collections.Counter = collections.Counter()
        for stack, k in self.stacks.items():
            leaf[stack.rsplit(";", 1)[-1]] += k
        return [(f, k / self.rate) for f, k in leaf.most_common(n)]


def _check() -> int:
    """Two threads hold the lock a known share of the time; the probe should say about that much."""
    import threading

    def busy(share: float, period: float) -> None:
        while True:
            t = time.perf_counter()
            while time.perf_counter() - t < period * share:
                pass
            time.sleep(period * (1 - share))

    for share, period in ((0.3, 0.002), (0.2, 0.003)):
        threading.Thread(target=busy, args=(share, period), daemon=True).start()
    time.sleep(0.5)
    # the probe cannot look at its own process (it would hold the lock while asking): a child does it
    child = subprocess.Popen([sys.executable, "-c", f"""
import sys, time; sys.path.insert(0, {str(Path(__file__).parent)!r})
from lockprobe import LockProbe
from common import proc_cpu_seconds
c0 = proc_cpu_seconds({os.getpid()}); t0 = time.perf_counter()
with LockProbe({os.getpid()}) as p:
    time.sleep(3)
print(p.seconds / 3, (proc_cpu_seconds({os.getpid()}) - c0) / (time.perf_counter() - t0))
"""], stdout=subprocess.PIPE, text=True)
    held, cpu = map(float, child.communicate()[0].split())
    print(f"lock held {held:.2f} s per s (probe), CPU {cpu:.2f} s per s; expected about 0.5 both")
    return 0 if 0.35 < held < 0.6 else 1


if __name__ == "__main__":
    if "--check" in sys.argv:
        sys.exit(_check())
    print(__doc__)
