"""The errors of ckptfs, and which errno each one reports.

Every failure that reaches a FUSE request is an `FsError` carrying an errno:
the kinds ckptfs itself decides (memory full, devices full, a failing device,
a checksum mismatch, data not in memory, its own read-only attributes) are
the classes below, each with its errno; the POSIX preconditions of the
namespace and core (ENOENT, EEXIST, ENOTEMPTY...) name theirs with `fs_error`
where the check is, as the man pages do. A front end maps an exception to an
errno in one place (`errno_of`). Anything else that escapes is a bug: it is
logged with its traceback and becomes EIO, never a torn-down mount.
`UsageError` is for the CLI: one clear line on stderr and a non-zero exit.
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


def device_error(message: str, os_errno: int | None) -> DeviceError:
    """A failed device I/O: ENOSPC stays ENOSPC (a full file under a file-backed device), anything
    else is EIO."""
    return DeviceError(message, _errno.ENOSPC if os_errno == _errno.ENOSPC else _errno.EIO)


class NotInMemory(FsError):
    """Data that is only on a device, with no device store to fetch it from (memory-only mounts)."""

    errno = _errno.EIO


class NoAttribute(FsError):
    """No such extended attribute."""

    errno = _errno.ENODATA


class ReadOnlyAttribute(FsError):
    """ckptfs's own (virtual) attributes cannot be set or removed."""

    errno = _errno.EPERM


class StoreFailing(DeviceError):
    """The store cannot make progress (a drain or journal write keeps failing); says why."""


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
