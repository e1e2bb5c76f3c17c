"""INIT negotiation: what to ask of the kernel, given what it offers (pure).

The kernel's first request is INIT: its protocol version, the largest
readahead it will ask for, and the flags it supports (`offered`). We answer
with the minor version both sides speak, the subset of `want` the kernel
offered (never a flag it did not), and the request size: `max_write` bytes
per WRITE, and with FUSE_MAX_PAGES `max_pages` pages per request, which the
kernel caps at the sysctl fs.fuse.max_pages_limit (read by the session and
passed in here as `max_pages_limit`).

What `DEFAULT_WANT` asks for and why:

    ASYNC_READ          reads of one file may be in flight together (readahead, several readers)
    BIG_WRITES          WRITEs larger than a page (implied by modern kernels; harmless)
    MAX_PAGES           WRITEs up to max_pages_limit pages (1 MiB by default, more if root raises it):
                        a direct_io write() of 64 MiB becomes 64 requests of 1 MiB, not 512 of 128 KiB;
                        max_pages is one page more than max_write when the limit allows (see below)
    PARALLEL_DIROPS     lookups and readdirs of one directory run in parallel (the server is threaded)
    ATOMIC_O_TRUNC      open(O_TRUNC) arrives as OPEN with O_TRUNC, not OPEN + SETATTR(size=0)
    ASYNC_DIO           the kernel may split an async O_DIRECT request into parallel FUSE requests
    AUTO_INVAL_DATA     cached pages of keep_cache readers are dropped when mtime/size change
    DO_READDIRPLUS      READDIR returns attributes too (no LOOKUP per entry of `ls -l`)
    HANDLE_KILLPRIV_V2  the kernel tells us when a write/truncate/open must clear suid/sgid
                        (FUSE_WRITE_KILL_SUIDGID, FATTR_KILL_SUIDGID, FUSE_OPEN_KILL_SUIDGID) instead
                        of sending a SETATTR and xattr probes of its own
    INIT_EXT            lets flags above bit 31 travel (flags2)

Not asked for: WRITEBACK_CACHE (the page cache in front halves absorb throughput, see
the field notes), SPLICE_* (the readv/writev path needs no splice), POSIX_LOCKS/FLOCK
(the kernel handles locks locally), PASSTHROUGH (needs backing files; ckptfs does not use it:
see docs/ENGINE.md; a server that asks for it gets max_stack_depth 1, without which the
kernel ignores the flag, and benchmarks/probes/passthrough.py measures it),
DIRECT_IO_ALLOW_MMAP (a filesystem's choice: ckptfs's native_ops.WANT adds it), SETXATTR_EXT,
SECURITY_CTX, CREATE_SUPP_GROUP (request extensions nobody here uses), HAS_RESEND.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import abi
from .replies import InitOut
from .requests import Init, ProtocolError

DEFAULT_WANT = (abi.FUSE_ASYNC_READ | abi.FUSE_BIG_WRITES | abi.FUSE_MAX_PAGES | abi.FUSE_PARALLEL_DIROPS
                | abi.FUSE_ATOMIC_O_TRUNC | abi.FUSE_ASYNC_DIO | abi.FUSE_AUTO_INVAL_DATA
                | abi.FUSE_DO_READDIRPLUS | abi.FUSE_HANDLE_KILLPRIV_V2 | abi.FUSE_INIT_EXT)
# The oldest protocol whose request layouts this codec parses (fuse_setattr_in with ctime).
MIN_MINOR = 23


@dataclass(frozen=True, slots=True)
class Negotiated:
    """What both sides agreed on at INIT; handed to the handler's `init()`."""

    major: int
    minor: int
    offered: int   # every flag the kernel supports (64 bits)
    flags: int     # the flags in force (64 bits)
    max_write: int
    max_pages: int
    max_readahead: int

    def has(self, flag: int) -> bool:
        return bool(self.flags & flag)

    @property
    def setxattr_ext(self) -> bool:
        return self.has(abi.FUSE_SETXATTR_EXT)


def negotiate(req: Init, *, want: int = DEFAULT_WANT, max_write: int | None = None, grain: int | None = None,
              max_pages_limit: int = 256, page_size: int = abi.PAGE_SIZE,
              max_background: int = 64, max_readahead: int | None = None,
              max_read: int | None = None) -> tuple[InitOut, Negotiated]:
    """The INIT reply and the agreement, or ProtocolError for a kernel we cannot speak to.

    `max_write`: the largest WRITE wanted (default: the largest power of two the kernel allows;
    pass the chunk size, or a multiple of it, to keep requests on the chunk grid).
    `grain`: with a `max_write` of several grains (chunks), the limit may cut it: it is then the
    most whole grains that fit with the spare page (below), and one grain where none does (e.g.
    4 chunks wanted, limit 257: 1 chunk and 257 pages; limit 1024: 3 chunks and 769 pages).
    `max_read`: the largest direct_io READ wanted, where larger than max_write. A WRITE is cut
    at max_write, a direct READ only at max_pages, so max_pages may exceed what writes need
    (again with a spare page: a reader's buffer need not be page-aligned), within the limit.
    """
    if req.major != abi.KERNEL_VERSION:
        raise ProtocolError(f"kernel speaks FUSE {req.major}.{req.minor}, this server {abi.KERNEL_VERSION}.x")
    if req.minor < MIN_MINOR:
        raise ProtocolError(f"kernel speaks FUSE 7.{req.minor}, this server needs 7.{MIN_MINOR} or later")
    minor = min(req.minor, abi.KERNEL_MINOR)
    offered = req.flags
    flags = want & offered
    if not offered & abi.FUSE_INIT_EXT:
        flags &= 0xFFFF_FFFF
    limit = max(1, max_pages_limit)
    if flags & abi.FUSE_MAX_PAGES:
        cap = limit * page_size
    else:
        cap = abi.DEFAULT_MAX_PAGES * page_size
    if max_write is None:  # the largest power of two that fits: a whole number of chunks
        size = 1 << (cap.bit_length() - 1)
    else:
        size = max(page_size, min(max_write, cap))
        if grain and size > grain:  # whole grains, with the spare page where the limit allows
            room = (limit - 1) * page_size if flags & abi.FUSE_MAX_PAGES else cap
            size = max(1, min(max_write, room) // grain) * grain
    # One page more than max_write needs, where the limit allows: a writer's buffer that is
    # not page-aligned spans one page more, and the kernel cuts requests at max_pages, so
    # without the spare page a 1 MiB write() from malloc'd memory arrives as 1 MiB - 16 bytes
    # + 16 bytes and every later request is off the chunk grid.
    pages = min(limit, (max(size, max_read or 0) + page_size - 1) // page_size + 1) \
        if flags & abi.FUSE_MAX_PAGES else 0
    readahead = req.max_readahead if max_readahead is None else min(max_readahead, req.max_readahead)
    background = max(1, min(max_background, 0xFFFF))
    out = InitOut(major=abi.KERNEL_VERSION, minor=minor, max_readahead=readahead, flags=flags,
                  max_background=background, congestion_threshold=max(1, background * 3 // 4),
                  max_write=size, time_gran=1, max_pages=pages,
                  max_stack_depth=1 if flags & abi.FUSE_PASSTHROUGH else 0)
    return out, Negotiated(abi.KERNEL_VERSION, minor, offered, flags, size, pages, readahead)
