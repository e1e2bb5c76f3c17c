"""A small Python API for training code that wants to know (unchanged code never needs it).

    import ckptfs
    torch.save(state, "/ckpt/step-100.pt")
    ckptfs.state("/ckpt/step-100.pt")          # 'memory', 'draining', 'durable' or 'failed:EIO'
    ckptfs.wait_durable("/ckpt/step-100.pt", timeout=600)   # None, or raises
    ckptfs.wait_replicated("/ckpt/step-100.pt")             # ... and in the object store (--replicate)

`state` reads the ``user.ckptfs.state`` xattr, which anyone who can see the
file may read. `wait_durable` asks the daemon over its control channel (the
user who mounted, or root) to make the file durable, as fsync would, and
waits; a directory stands for every file below it, the mountpoint for
everything. Another user falls back to fsync in a helper thread. It raises
`DrainFailed` (an OSError with the errno) when the data could not be
written, and `WaitTimeout` (a TimeoutError) when `timeout` seconds pass
first; the files stay queued either way (the daemon keeps retrying).

`wait_paths` is what ``ckptfs wait`` runs; it reports progress through a
callback.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from typing import Callable

from .control import Client, ControlPermissionError, control_path, mountpoint_of, refusal

STATE_XATTR = "user.ckptfs.state"


class NotOnCkptfs(OSError):
    """The path is not inside a ckptfs mount."""


class DrainFailed(OSError):
    """The data could not be written to the devices; `failed` lists the files and reasons."""

    def __init__(self, code: int, message: str, failed: list | None = None):
        super().__init__(code, message)
        self.failed = failed or []

    def __str__(self) -> str:
        return self.strerror


class WaitTimeout(TimeoutError):
    """The timeout passed before the files were durable; `progress` is the last report."""

    def __init__(self, message: str, progress: dict | None = None):
        super().__init__(errno.ETIMEDOUT, message)
        self.progress = progress or {}

    def __str__(self) -> str:
        return self.strerror


def state(path: str | os.PathLike) -> str:
    """'memory', 'draining', 'durable', 'replicated' (--replicate) or 'failed:ERRNO' for a file in a
    ckptfs mount."""
    try:
        return os.getxattr(path, STATE_XATTR).decode()
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP):
            raise NotOnCkptfs(e.errno, f"{os.fspath(path)} is not on a ckptfs mount") from None
        raise


def status(path: str | os.PathLike, window: float = 2.0) -> dict:
    """The daemon's status snapshot for the mount holding `path` (see ``ckptfs status --json``)."""
    mp = mountpoint_of(os.fspath(path))
    with Client(control_path(mp)) as c:
        return c.request({"op": "status", "window": window})["status"]


def _targets(paths) -> dict[str, list[int] | None]:
    """mountpoint -> inode numbers to wait for (None: the whole mount)."""
    groups: dict[str, list[int] | None] = {}
    for p in paths:
        real = os.path.realpath(os.fspath(p))
        st = os.stat(real)
        mp = mountpoint_of(real)
        if real == mp:
            groups[mp] = None
        elif mp not in groups:
            groups[mp] = [st.st_ino]
        elif groups[mp] is not None:
            groups[mp].append(st.st_ino)
    return groups


def _reason(msg: dict) -> str:
    left = msg.get("files", 0) - msg.get("durable", 0)
    state = "replicated" if msg.get("phase") == "replicating" else "durable"
    text = f"{left} of {msg.get('files', 0)} file(s) not {state} yet"
    if msg.get("bytes"):
        text += f", {100 * msg.get('done', 0) / msg['bytes']:.0f}% of {msg['bytes']} bytes drained"
    if msg.get("last_error"):
        text += f"; last error: {msg['last_error']}"
    return text


def wait_paths(paths, timeout: float | None = None,
               on_progress: Callable[[str, dict], None] | None = None, *, replicated: bool = False
               ) -> dict[str, dict]:
    """Make the files durable (and with `replicated`, named in a standing manifest of the mount's
    object store) and wait; mountpoint -> final report. Raises DrainFailed, WaitTimeout,
    ControlError (the daemon cannot be asked, or the mount does not replicate), or OSError (a path
    does not exist)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    results: dict[str, dict] = {}
    for mp, inos in _targets(paths).items():
        report = None if on_progress is None else (lambda msg, mp=mp: on_progress(mp, msg))
        results[mp] = wait_on(control_path(mp), inos, deadline, report, timeout, replicated=replicated)
    return results


def wait_on(sock: str, inos: list[int] | None, deadline: float | None = None,
            on_progress: Callable[[dict], None] | None = None, timeout: float | None = None, *,
            replicated: bool = False) -> dict:
    """One daemon's wait (see control.py), until time.monotonic() passes `deadline`; the final report."""
    last: dict = {}
    with Client(sock, timeout=10) as c:
        c.send({"op": "wait", "inos": inos, **({"replicated": True} if replicated else {})})
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise WaitTimeout(f"timed out after {timeout or 0:g}s: {_reason(last)}", last)
            try:
                msg = c.receive(timeout=30 if left is None else min(left, 30))
            except TimeoutError:
                continue
            if "event" not in msg:
                raise refusal(msg)
            last = msg
            if on_progress is not None:
                on_progress(msg)
            if msg["event"] == "done":
                if not msg.get("ok"):
                    failed = msg.get("failed") or []
                    code = getattr(errno, failed[0].get("errno") or "EIO", errno.EIO) if failed else errno.EIO
                    raise DrainFailed(code, msg.get("error") or "drain failed", failed)
                return msg


def wait_durable(path: str | os.PathLike, timeout: float | None = None) -> None:
    """Return once `path` (a file; a directory: all below it; the mountpoint: everything) is durable."""
    try:
        wait_paths([path], timeout)
    except ControlPermissionError:
        _fsync_wait(os.fspath(path), timeout)


def wait_replicated(path: str | os.PathLike, timeout: float | None = None) -> None:
    """Return once `path` (as for wait_durable) is durable and named in a standing manifest of the
    mount's object store (`ckptfs mount --replicate`)."""
    wait_paths([path], timeout, replicated=True)


def _fsync_wait(path: str, timeout: float | None) -> None:
    """For users who may not use the control channel: fsync (which waits for durability) in a thread."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            outcome.append(None)
        except OSError as e:
            outcome.append(e)

    t = threading.Thread(target=run, name="ckptfs-wait", daemon=True)
    t.start()
    t.join(timeout)
    if not outcome:
        raise WaitTimeout(f"timed out after {timeout:g}s waiting for {path} to be durable")
    if outcome[0] is not None:
        e = outcome[0]
        raise DrainFailed(e.errno or errno.EIO, f"{path}: {e.strerror or e}")
