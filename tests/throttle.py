"""Slow devices for real mounts: loop devices whose writes a cgroup v1 blkio throttle limits.

    t = Throttle(files, bps=8 << 20)   # losetup each file (O_DIRECT backing), limit writes
    mount over t.devices, then t.add(daemon_pid)
    ...
    t.set(0)                           # lift the limit
    t.close()                          # move the processes back, remove the cgroup, detach

Skips the test (pytest.skip) where loop devices or the blkio controller are missing.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

BLKIO = Path("/sys/fs/cgroup/blkio")


class Throttle:
    def __init__(self, files, bps: int):
        if not (BLKIO / "blkio.throttle.write_bps_device").exists():
            pytest.skip("no cgroup v1 blkio controller to throttle devices")
        self.loops: list[str] = []
        self.cgroup = BLKIO / f"ckptfs-test-{os.getpid()}-{id(self)}"
        try:
            for f in files:
                res = subprocess.run(["losetup", "-f", "--show", "--direct-io=on", str(f)],
                                     capture_output=True, text=True)
                if res.returncode != 0:
                    pytest.skip(f"losetup failed: {res.stderr.strip()}")
                self.loops.append(res.stdout.strip())
            self.cgroup.mkdir()
            self.set(bps)
        except BaseException:
            self.close()
            raise

    @property
    def devices(self) -> list[str]:
        return list(self.loops)

    def _majmin(self, dev: str) -> str:
        st = os.stat(dev)
        return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"

    def set(self, bps: int) -> None:
        """Limit writes to each loop device to `bps` bytes per second (0: no limit)."""
        for dev in self.loops:
            (self.cgroup / "blkio.throttle.write_bps_device").write_text(f"{self._majmin(dev)} {bps}")

    def add(self, pid: int) -> None:
        """Put a process (all its threads, and those it starts later) under the limit."""
        (self.cgroup / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        if self.cgroup.exists():
            try:
                self.set(0)
            except OSError:
                pass
            for pid in (self.cgroup / "cgroup.procs").read_text().split():
                try:
                    (BLKIO / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            try:
                self.cgroup.rmdir()
            except OSError:
                pass
        for dev in self.loops:
            subprocess.run(["losetup", "-d", dev], capture_output=True)
        self.loops = []
