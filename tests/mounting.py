"""Test helpers: mount ckptfs for real through its CLI, over file-backed devices.

`CkptMount` drives the same commands a user types (`python -m ckptfs mount`,
`umount`), so tests exercise the CLI, the daemon and the FUSE layer together.
`close()` always leaves nothing mounted and no daemon running, even after a
failed test or a killed daemon.

The FUSE front end is `engine` (`--engine`), by default the environment
variable CKPTFS_TEST_ENGINE, else pyfuse3; conftest.py runs the real-mount
suites with each engine.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from waiting import poll

HAVE_FUSE = os.path.exists("/dev/fuse") and os.geteuid() == 0
ENGINES = ("pyfuse3", "native")


def default_engine() -> str:
    engine = os.environ.get("CKPTFS_TEST_ENGINE", "native")
    if engine not in ENGINES:
        raise ValueError(f"CKPTFS_TEST_ENGINE={engine!r}: expected one of {', '.join(ENGINES)}")
    return engine


def ckptfs(*args: str, check: bool = False, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """Run the ckptfs CLI as a user would; returns the completed process (text output)."""
    res = subprocess.run([sys.executable, "-m", "ckptfs", *args], capture_output=True, text=True,
                         timeout=timeout, **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"ckptfs {' '.join(args)} failed ({res.returncode}): {res.stderr}")
    return res


def is_mounted(path: str | Path) -> bool:
    path = os.path.realpath(str(path))
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def make_devices(root: Path, n: int, size: int, prefix: str = "dev") -> list[Path]:
    """n sparse files of `size` bytes, root/{prefix}0.img ..."""
    root.mkdir(parents=True, exist_ok=True)
    devs = []
    for i in range(n):
        p = root / f"{prefix}{i}.img"
        with open(p, "wb") as f:
            f.truncate(size)
        devs.append(p)
    return devs


@contextlib.contextmanager
def reachable_mount(prefix: str, engine: str | None = None) -> Iterator["CkptMount"]:
    """A mount under a fresh 0755 folder in /tmp, so that other users (nobody) can reach it; for
    module-scoped fixtures. Always unmounted and removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    root.chmod(0o755)
    m = CkptMount(root, engine=engine)
    m.mount()
    try:
        yield m
    finally:
        m.close()
        shutil.rmtree(root, ignore_errors=True)


class CkptMount:
    def __init__(self, root: Path, *, ndev: int = 2, dev_size: int = 1 << 30, memory: str = "512M",
                 extra: tuple[str, ...] = (), engine: str | None = None):
        self.root = Path(root)
        self.path = self.root / "mnt"
        self.path.mkdir(parents=True, exist_ok=True)
        self.devices = make_devices(self.root / "devices", ndev, dev_size)
        self.memory = memory
        self.extra = tuple(extra)
        self.engine = engine or default_engine()
        self.pid: int | None = None
        self.log = self.root / "daemon.log"
        self.formatted = False

    @property
    def device_arg(self) -> str:
        return ",".join(str(d) for d in self.devices)

    def mount(self, *more: str) -> subprocess.CompletedProcess:
        """Mount; the first mount formats the fresh device files. The CLI's completed process."""
        fmt = () if self.formatted else ("--format",)
        res = ckptfs("mount", str(self.path), "--devices", self.device_arg, "--memory", self.memory,
                     "--log-file", str(self.log), "--engine", self.engine, *fmt, *self.extra, *more)
        self.formatted = self.formatted or res.returncode == 0
        if res.returncode != 0:
            raise AssertionError(f"mount failed ({res.returncode}): {res.stderr}\n{self.log_text()}")
        self.pid = int(os.getxattr(self.path, "user.ckptfs.pid"))
        return res

    def umount(self, timeout: float = 300) -> subprocess.CompletedProcess:
        res = ckptfs("umount", str(self.path), timeout=timeout)
        if res.returncode == 0:
            self.pid = None
        return res

    def kill(self, clear: bool = True) -> None:
        """SIGKILL the daemon (a crash) and clear the dead mount it leaves (unless `clear` is False:
        until it is cleared, every access to the mount fails with ENOTCONN)."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            poll(lambda: exited(self.pid), None, timeout=30, every=0.02)  # then clear the mount, gone or not
            self.pid = None
        if clear:
            self.clear_stale()

    def clear_stale(self) -> None:
        subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)

    def status(self) -> dict:
        """`ckptfs status --json` of this mount."""
        return json.loads(ckptfs("status", "--json", str(self.path), check=True).stdout)

    def replicated(self, *paths, timeout: int = 120) -> None:
        """`ckptfs wait --replicated` on `paths` (default: the whole mount); when it fails, an
        AssertionError that says why: the CLI's words, the replication status, the daemon's last
        log lines and the free disk space (a store short of space retries without end)."""
        targets = [str(p) for p in paths] or [str(self.path)]
        try:
            res = ckptfs("wait", "--replicated", "--timeout", str(timeout), *targets, timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            res = None
        if res is not None and res.returncode == 0:
            return
        try:
            status = ckptfs("status", "--json", str(self.path), timeout=30).stdout[-3000:]
        except subprocess.TimeoutExpired:
            status = "(status did not answer in 30 s)"
        disk = shutil.disk_usage(self.root)
        said = "no answer" if res is None else f"exit {res.returncode}: {res.stdout[-1000:]}{res.stderr[-1000:]}"
        raise AssertionError(f"not replicated within {timeout} s ({said})\nstatus: {status}\n"
                             f"free disk: {disk.free >> 20} MiB of {disk.total >> 20} MiB\n"
                             f"daemon log:\n{self.log_text()[-4000:]}")

    def log_text(self) -> str:
        try:
            return self.log.read_text()
        except OSError:
            return ""

    def close(self) -> None:
        if is_mounted(self.path):
            res = self.umount(timeout=120) if self.pid is not None else None
            if res is None or res.returncode != 0:
                self.kill()
        elif self.pid is not None:
            self.kill()
        assert not is_mounted(self.path)


def exited(pid: int) -> bool:
    """Process `pid` has exited: gone, or a zombie (a daemon is not our child: init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] == "Z"
    except (OSError, IndexError):
        return True
