"""Device I/O: O_DIRECT reads and writes on block devices or regular files.

`BlockDevice` is synchronous and checks every byte count (a short transfer
raises `ShortIO`, an OSError becomes `DeviceError` naming device and offset).
The store runs its calls in worker threads through `trio.to_thread.run_sync`
with one `CapacityLimiter` per device, whose size is the queue depth: that is
how several I/Os are in flight per device while the trio thread goes on
serving FUSE requests.

O_DIRECT needs 4 KiB-aligned buffers, offsets and lengths: arena slots are
aligned, and `aligned_buffer` gives aligned scratch memory for the rest. A
filesystem that refuses O_DIRECT (tmpfs) is used buffered, with a warning.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os

from ..errors import DeviceError, ShortIO, device_error
from ..format.layout import BLOCK, round_up

log = logging.getLogger("ckptfs.device")
ALIGN = BLOCK


def aligned_buffer(n: int) -> memoryview:
    """`n` bytes (rounded up to 4 KiB) of page-aligned, zeroed, writable memory."""
    size = max(ALIGN, round_up(n))
    return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


class BlockDevice:
    """One device (or file) of a pool, with O_DIRECT where it allows: synchronous, checked I/O.
    It holds only its open descriptor `fd`, its `size` and whether it is `direct`."""

    def __init__(self, path: str, *, direct: bool = True):
        self.path = path
        flags = os.O_RDWR | os.O_CLOEXEC
        self.direct = False
        if direct:
            try:
                self.fd = os.open(path, flags | os.O_DIRECT)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise DeviceError(f"cannot open {path}: {e.strerror}") from None
                log.warning("%s does not support O_DIRECT; using buffered I/O", path)
        if not self.direct:
            try:
                self.fd = os.open(path, flags)
            except OSError as e:
                raise DeviceError(f"cannot open {path}: {e.strerror}") from None
        self.size = os.lseek(self.fd, 0, os.SEEK_END)

    def pwrite(self, buf, offset: int) -> None:
        self.pwritev([buf], offset)

    def pwritev(self, bufs: list, offset: int) -> None:
        """Write `bufs` back to back at `offset` (one syscall); short writes raise."""
        want = sum(len(b) for b in bufs)
        try:
            n = os.pwritev(self.fd, bufs, offset)
        except OSError as e:
            raise device_error(f"write of {want} bytes at offset {offset} on {self.path} failed: "
                               f"{e.strerror}", e.errno) from None
        if n != want:
            raise ShortIO(self.path, "write", offset, want, n)

    def pread_into(self, buf, offset: int) -> None:
        self.preadv_into([buf], offset)

    def preadv_into(self, bufs: list, offset: int) -> None:
        """Fill `bufs` back to back from `offset` (one syscall); short reads raise."""
        want = sum(len(b) for b in bufs)
        try:
            n = os.preadv(self.fd, bufs, offset)
        except OSError as e:
            raise DeviceError(f"read of {want} bytes at offset {offset} on {self.path} failed: "
                              f"{e.strerror}") from None
        if n != want:
            raise ShortIO(self.path, "read", offset, want, n)

    def pread(self, n: int, offset: int) -> memoryview:
        buf = aligned_buffer(n)[:n]
        self.pread_into(buf, offset)
        return buf

    def flush(self) -> None:
        try:
            os.fdatasync(self.fd)
        except OSError as e:
            raise DeviceError(f"flush of {self.path} failed: {e.strerror}") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
