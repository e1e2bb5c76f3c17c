"""System calls that Python's os module lacks (through libc, x86_64 Linux), and loops around those it has."""
from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]

# fallocate(2) modes (linux/falloc.h)
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_COLLAPSE_RANGE = 0x08
FALLOC_FL_ZERO_RANGE = 0x10

# renameat2(2) flags (linux/fs.h) and what the call needs
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
SYS_renameat2 = 316  # x86_64
AT_FDCWD = -100


def fallocate(fd: int, mode: int, off: int, length: int) -> None:
    """fallocate(2) itself, any mode (os.posix_fallocate is mode 0, and glibc writes zeros where
    the filesystem says EOPNOTSUPP)."""
    if _libc.fallocate(fd, mode, off, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def renameat2(old, new, flags: int) -> None:
    """renameat2(2) with `flags` (os.rename takes none), paths relative to the working directory."""
    if _libc.syscall(ctypes.c_long(SYS_renameat2), ctypes.c_int(AT_FDCWD), os.fsencode(old), ctypes.c_int(AT_FDCWD),
                     os.fsencode(new), ctypes.c_uint(flags)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), os.fspath(old), None, os.fspath(new))


def copy_range(fin: int, fout: int, n: int, off_in: int, off_out: int) -> int:
    """copy_file_range(2) until `n` bytes are copied or the source ends (one call may copy less)."""
    done = 0
    while done < n:
        got = os.copy_file_range(fin, fout, n - done, off_in + done, off_out + done)
        if not got:
            break
        done += got
    return done
