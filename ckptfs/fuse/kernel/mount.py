"""Mount and unmount a FUSE filesystem without libfuse; clone /dev/fuse descriptors.

As root: open /dev/fuse, then mount(2) with type ``fuse.SUBTYPE``, source
FSNAME and the data string ``fd=N,rootmode=40000,user_id=U,group_id=G[,...]``:
the kernel takes the session from that descriptor. Unmount with umount2(2),
MNT_DETACH (lazy) for a mount whose server is gone.

Otherwise: run ``fusermount3 -o OPTIONS -- MOUNTPOINT`` with ``_FUSE_COMMFD``
naming one end of a Unix socket pair; the setuid helper opens /dev/fuse,
mounts, and sends the descriptor back as SCM_RIGHTS. Unmount with
``fusermount3 -u [-z]``.

More server threads read the same session from clones: open /dev/fuse again
and ioctl FUSE_DEV_IOC_CLONE with the session descriptor.

Every descriptor is close-on-exec, so child processes (writers in tests, the
daemon's helpers) never hold the session open.

`name_thread` names a server thread for the OS (top -H, perf, /proc/PID/task).
"""
from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import socket
import struct
import subprocess

from . import abi

log = logging.getLogger("ckptfs.fuse.kernel")

DEVICE = "/dev/fuse"
MAX_PAGES_LIMIT_PATH = "/proc/sys/fs/fuse/max_pages_limit"
MAX_MAX_PAGES = 65535  # the sysctl's ceiling: fuse_init_out.max_pages is 16 bits
FUSERMOUNT = "fusermount3"
MS_NOSUID = 0x2
MS_NODEV = 0x4
MNT_DETACH = 0x2
PR_SET_NAME = 15

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def name_thread(name: str) -> None:
    """Name the calling OS thread (its comm, at most 15 bytes): Python names only its Thread
    object, so every worker would show as the thread that started it. Cosmetic: never fails."""
    _libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def open_device(path: str = DEVICE) -> int:
    return os.open(path, os.O_RDWR | os.O_CLOEXEC)


def clone_device(session_fd: int, path: str = DEVICE) -> int:
    """A new /dev/fuse descriptor that reads requests of `session_fd`'s session."""
    fd = open_device(path)
    try:
        fcntl.ioctl(fd, abi.FUSE_DEV_IOC_CLONE, struct.pack("=I", session_fd))
    except OSError:
        os.close(fd)
        raise
    return fd


def mount_data(fd: int, *, uid: int, gid: int, allow_other: bool, default_permissions: bool,
               extra: tuple[str, ...] = ()) -> str:
    """The mount(2) data string of a FUSE mount served through `fd`."""
    opts = [f"fd={fd}", "rootmode=40000", f"user_id={uid}", f"group_id={gid}"]
    if allow_other:
        opts.append("allow_other")
    if default_permissions:
        opts.append("default_permissions")
    opts.extend(extra)
    return ",".join(opts)


def kernel_mount(fd: int, mountpoint: str, data: str, *, fsname: str, subtype: str,
                 flags: int = MS_NOSUID | MS_NODEV) -> None:
    """mount(2) (root only); raises OSError naming the mountpoint."""
    if _libc.mount(fsname.encode(), os.fsencode(mountpoint), f"fuse.{subtype}".encode(), flags,
                   data.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount of {mountpoint} failed: {os.strerror(err)}", mountpoint)


def fusermount(mountpoint: str, options: str, *, program: str = FUSERMOUNT, timeout: float = 30) -> int:
    """Mount through the setuid helper; returns the session descriptor it passes back."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        res = subprocess.run([program, "-o", options, "--", mountpoint], env=env, pass_fds=(theirs.fileno(),),
                             capture_output=True, text=True, timeout=timeout)
        theirs.close()
        if res.returncode != 0:
            raise OSError(0, f"{program} could not mount {mountpoint} (exit {res.returncode}): "
                             f"{res.stderr.strip()}", mountpoint)
        _msg, fds, _flags, _addr = socket.recv_fds(ours, 1, 1)
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise OSError(0, f"{program} mounted {mountpoint} but passed back {len(fds)} descriptors, not 1",
                          mountpoint)
        os.set_inheritable(fds[0], False)
        return fds[0]
    finally:
        ours.close()
        theirs.close()


def unmount(mountpoint: str, *, lazy: bool = False, use_fusermount: bool | None = None,
            program: str = FUSERMOUNT) -> None:
    """umount2(2) as root (MNT_DETACH if lazy), else ``fusermount3 -u [-z]``."""
    if use_fusermount is None:
        use_fusermount = os.geteuid() != 0
    if not use_fusermount:
        if _libc.umount2(os.fsencode(mountpoint), MNT_DETACH if lazy else 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"unmount of {mountpoint} failed: {os.strerror(err)}", mountpoint)
        return
    res = subprocess.run([program, "-u", *(["-z"] if lazy else []), "--", mountpoint],
                         capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise OSError(0, f"{program} -u {mountpoint} failed: {res.stderr.strip()}", mountpoint)


def max_pages_limit(path: str = MAX_PAGES_LIMIT_PATH) -> int:
    """The kernel's cap on pages per request (256 where the sysctl does not exist)."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 256


def raise_max_pages_limit(pages: int, path: str = MAX_PAGES_LIMIT_PATH) -> int:
    """Raise fs.fuse.max_pages_limit to `pages` if it is lower (root only); returns the limit in force.

    The sysctl is machine-wide but only a ceiling: other mounts keep what they negotiated.
    A wish past the kernel's ceiling (large chunks: 16 MiB READs of 16 chunks) gets the ceiling.
    """
    pages = min(pages, MAX_MAX_PAGES)
    current = max_pages_limit(path)
    if pages <= current:
        return current
    try:
        with open(path, "w") as f:
            f.write(str(pages))
    except OSError as e:  # a read-only /proc/sys (a container), or a kernel capping the value
        log.warning("could not raise %s to %d (%s): requests stay at most %d pages", path, pages, e, current)
    return max_pages_limit(path)
