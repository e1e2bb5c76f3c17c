"""Faulting the arena's memory in, in transparent huge pages, before the mount serves.

The arena asks for transparent huge pages (MADV_HUGEPAGE). They make every
kernel pass over it cheaper: pinning its pages for O_DIRECT and for the FUSE
copies into and out of it, and the TLB misses of those copies (a cold 1 GiB
read after a remount took 0.73-0.78 s instead of 0.91-1.14 s on the 2-core VM,
docs/DESIGN.md, "Why direct_io for writers").

The mapping's length is rounded up to whole huge pages (`huge_pages_length`:
less than 2 MiB past the last slot, never handed out), because the kernel
puts only such a mapping on a huge-page boundary.

`fault_in` then faults the slots in, so that no write takes a page
fault: MADV_POPULATE_WRITE over one part of the mapping per thread (up to
`THREADS`; the calls leave the interpreter lock free). The kernel zeroes every
page as it faults in, and where a VM's host backs guest memory only on first
touch that is slow: on this VM 3 GiB took 0.3-4.8 s in huge pages with one
thread, 0.9 s in 4 KiB pages. Threads split that cost on a machine with cores
to spare. The first call doubles as the probe: where the kernel lacks
MADV_POPULATE_WRITE (before 5.14) the mapping is zeroed instead.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading

MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module does not name it
HUGE_PAGE = 2 << 20  # x86-64 and arm64 with 4 KiB pages
PROBE = HUGE_PAGE
THREADS = 8

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_madvise.restype = ctypes.c_int


def huge_pages_length(length: int) -> int:
    """`length` rounded up to whole huge pages: the kernel places only a mapping of such a length
    on a huge-page boundary, and a mapping off it gets no huge pages."""
    return -(-length // HUGE_PAGE) * HUGE_PAGE


def ask_huge_pages(mapping: mmap.mmap) -> bool:
    """Advise transparent huge pages for the whole mapping; False where the kernel has none."""
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        return False
    return True


def _populate(address: int, length: int) -> bool:
    """Fault `length` bytes at `address` in, writable, keeping their contents."""
    return _madvise(address, length, MADV_POPULATE_WRITE) == 0


def fault_in(address: int, length: int, threads: int | None = None) -> None:
    """Fault the `length` bytes at `address` (page-aligned) in, in `threads` parts at once
    (default: one per CPU, at most `THREADS`)."""
    first = min(PROBE, length)
    if not _populate(address, first):
        ctypes.memset(address, 0, length)
        return
    rest = length - first
    if rest <= 0:
        return
    count = max(1, min(threads or os.cpu_count() or 1, THREADS, rest // PROBE))
    part = -(-rest // (count * PROBE)) * PROBE
    parts = [(address + first + start, min(part, rest - start)) for start in range(0, rest, part)]
    workers = [threading.Thread(target=_populate, args=p, name="ckptfs-prefault") for p in parts[1:]]
    for w in workers:
        w.start()
    _populate(*parts[0])
    for w in workers:
        w.join()
