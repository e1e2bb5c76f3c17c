"""Validation of what the user asked to mount, before anything is mounted.

Each check raises `UsageError` with one line that names the offending path
and says what to do. The CLI runs them in the parent process so the message
reaches the user's terminal even when the daemon would run detached.
"""
from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

from .errors import UsageError

FUSE_DEVICE = "/dev/fuse"


@dataclass(frozen=True)
class DevicePath:
    """One device the user named, as `check_devices` found it: the path given, its real path,
    whether it is a block device (else a regular file), and its size in bytes."""
    path: str
    real: str
    is_block: bool
    size: int


def check_fuse_device(path: str = FUSE_DEVICE) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UsageError(f"{path} is missing: load the fuse module (modprobe fuse), "
                         f"or give the container --device /dev/fuse", 1) from None
    if not stat.S_ISCHR(st.st_mode):
        raise UsageError(f"{path} is not a character device: FUSE is not available here", 1)
    if not os.access(path, os.R_OK | os.W_OK):
        raise UsageError(f"no permission to open {path}: run as root or join the group that owns it", 1)


def check_mountpoint(path: str) -> str:
    """The absolute mountpoint, after checking it is an existing, unmounted directory."""
    mp = os.path.abspath(path)
    try:
        st = os.stat(mp)
    except FileNotFoundError:
        raise UsageError(f"mountpoint {mp} does not exist: create it first (mkdir -p {mp})") from None
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise UsageError(f"mountpoint {mp} holds a stale FUSE mount (transport endpoint is not "
                             f"connected): run 'ckptfs umount {mp}' first") from None
        raise UsageError(f"cannot use mountpoint {mp}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"mountpoint {mp} is not a directory")
    if os.path.ismount(mp):
        try:
            os.statvfs(mp)  # never answered from the kernel's caches: a dead daemon shows here
        except OSError as e:
            if e.errno == errno.ENOTCONN:
                raise UsageError(f"mountpoint {mp} holds a stale FUSE mount (transport endpoint is not "
                                 f"connected): run 'ckptfs umount {mp}' first") from None
        raise UsageError(f"mountpoint {mp} is already mounted: unmount it or choose another directory")
    return mp


def device_size(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


def check_devices(spec: str | list[str]) -> list[DevicePath]:
    """Each device exists, is a block device or regular file, is read-writable, and is listed once."""
    paths = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else list(spec)
    if not paths or any(not p for p in paths):
        raise UsageError("--devices needs a comma-separated list of block devices or files, e.g. "
                         "--devices /dev/nvme0n1,/dev/nvme1n1")
    seen: dict[tuple, str] = {}
    out = []
    for p in paths:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            raise UsageError(f"device {p} does not exist") from None
        except PermissionError:
            raise UsageError(f"no permission to access device {p}") from None
        if stat.S_ISDIR(st.st_mode):
            raise UsageError(f"device {p} is a directory: expected a block device or a regular file")
        is_block = stat.S_ISBLK(st.st_mode)
        if not (is_block or stat.S_ISREG(st.st_mode)):
            raise UsageError(f"device {p} is neither a block device nor a regular file")
        key = ("blk", st.st_rdev) if is_block else ("reg", st.st_dev, st.st_ino)
        if key in seen:
            raise UsageError(f"device {p} is listed twice (it is the same as {seen[key]})")
        seen[key] = p
        try:
            fd = os.open(p, os.O_RDWR)
        except PermissionError:
            raise UsageError(f"no permission to read and write device {p}") from None
        except OSError as e:
            raise UsageError(f"cannot open device {p} for reading and writing: {e.strerror}") from None
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)
        out.append(DevicePath(p, os.path.realpath(p), is_block, size))
    return out


def check_memory(nbytes: int) -> None:
    """Refuse a budget the machine cannot back without swapping or the OOM killer."""
    avail = _mem_available()
    if avail is not None and nbytes > avail * 0.9:
        raise UsageError(f"--memory {nbytes >> 20}M is more than this machine can spare "
                         f"({avail >> 20}M available): choose a smaller budget")


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
