"""Every errno decision of ckptfs lives here.

The core raises `FsError` subclasses carrying an errno; the FUSE adapter maps
them to `pyfuse3.FUSEError` in one place (`errno_of`). Anything else that
escapes the core is a bug: it is logged with its traceback and becomes EIO,
never a torn-down mount. `UsageError` is for the CLI: one clear line on stderr
and a non-zero exit.
"""
from __future__ import annotations

import errno as _errno
import logging

log = logging.getLogger("ckptfs")


class FsError(Exception):
    """A filesystem operation failed with `errno`."""

    errno: int = _errno.EIO

    def __init__(self, message: str = "", errno: int | None = None):
        super().__init__(message or _errno.errorcode.get(errno or self.errno, "error"))
        if errno is not None:
            self.errno = errno


def fs_error(code: int, message: str = "") -> FsError:
    """An FsError for `code`, e.g. ``raise fs_error(errno.ENOENT, name)``."""
    return FsError(message, code)


class NoSpace(FsError):
    """The memory arena (or, later, the devices) has no room for more data."""

    errno = _errno.ENOSPC


class DevicesFull(NoSpace):
    """The devices have no room left for more data (as opposed to memory being full)."""


class DeviceError(FsError):
    """A device I/O failed; the message names the device and offset."""

    errno = _errno.EIO


class ShortIO(DeviceError):
    """A read or write moved fewer bytes than asked: never ignored."""

    def __init__(self, device: str, op: str, offset: int, wanted: int, got: int):
        super().__init__(f"short {op} on {device} at offset {offset}: wanted {wanted} bytes, got {got}")
        self.device, self.offset, self.wanted, self.got = device, offset, wanted, got


class ChecksumMismatch(DeviceError):
    """Data read back from a device does not match its recorded crc32c."""


class UsageError(Exception):
    """Bad input to the CLI: printed as one line, exit status `status`."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


def errno_of(exc: BaseException, what: str = "") -> int:
    """The errno to report for `exc`; unexpected exceptions are logged and become EIO."""
    if isinstance(exc, FsError):
        return exc.errno
    log.error("unexpected error in %s; reporting EIO", what or "request", exc_info=exc)
    return _errno.EIO
