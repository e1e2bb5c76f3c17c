"""What FUSE passthrough would buy ckptfs's readers: a probe, READ replies vs passthrough.

ckptfs serves every READ itself (the native engine writes views of arena
slots or device buffers with os.writev; the kernel copies them into the
reader in the daemon's thread). With FUSE passthrough (kernel >= 6.9, root)
the kernel reads a backing file itself and no READ reaches the daemon. But
passthrough maps a file's offsets onto one backing file's same offsets, and
ckptfs keeps no such file (chunks in arena slots, striped over devices:
docs/ENGINE.md), so using it means staging a file into one first, e.g. a
memfd filled before the OPEN is answered. This probe measures both halves
with ckptfs's own protocol session (`kernel.Session`) and a handler that
serves one read-only file of `--size` bytes held in a memfd:

  read         each READ answered with a view of the memfd's mapping, written by
               os.writev (the native engine's path for data in memory: no copy in
               user space; direct_io, READs of up to 4 MiB);
  passthrough  the OPEN answered FOPEN_PASSTHROUGH with the memfd as backing file;

for 1 and `--readers` processes reading the whole file at once with 64 MiB
reads (an untimed pass first), `--repeats` rounds alternating: aggregate
GB/s, the daemon's CPU s per GiB served and the readers'. Then the price of
staging, a file of `--size` on the scratch disk read with O_DIRECT (page
cache dropped first) into a fresh memfd (its pages allocated by the reads),
into a memfd fallocated first, and into a pre-faulted anonymous buffer (what
ckptfs's arena is). Not a `make bench` case: no targets. Needs root; on a kernel that does not offer
FUSE_PASSTHROUGH it says so and measures `read` alone.

    .venv/bin/python benchmarks/probes/passthrough.py [--size 1G] [--readers 4] [--threads 2] [--repeats 3]
"""
from __future__ import annotations

import argparse
import errno
import fcntl
import mmap
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py and the cases
from common import ROOT, SCRATCH, GiB, MiB, drop_caches, parse_size  # noqa: E402

sys.path.insert(0, str(ROOT))

from ckptfs.fuse.kernel import abi  # noqa: E402
from ckptfs.fuse.kernel.negotiate import DEFAULT_WANT  # noqa: E402
from ckptfs.fuse.kernel.replies import Attr, AttrOut, EntryOut, OpenOut  # noqa: E402
from ckptfs.fuse.kernel.session import Session, SessionConfig  # noqa: E402

BLOCK = 64 * MiB
READER = r"""
import os, sys, time
path, start = sys.argv[1], float(sys.argv[2])
buf = bytearray(64 << 20)
while time.perf_counter() < start:
    time.sleep(0.0005)
c0, t0 = os.times(), time.perf_counter()
fd = os.open(path, os.O_RDONLY)
n = 0
while (k := os.readv(fd, [buf])) > 0:
    n += k
os.close(fd)
t1, c1 = time.perf_counter(), os.times()
print(t0, t1, n, (c1.user - c0.user) + (c1.system - c0.system))
"""


class OneFile:
    """A root folder with one read-only file `f`, its bytes in a memfd; READs answered with views
    of its mapping, or no READs at all (`passthrough`: the OPEN names the memfd as backing file)."""

    def __init__(self, memfd: int, size: int):
        self.size = size
        self.view = memoryview(mmap.mmap(memfd, size, mmap.MAP_SHARED, mmap.PROT_READ))
        self.memfd = memfd
        self.session: Session | None = None
        self.passthrough = False
        self.backing = 0

    def attach_backing(self) -> None:
        """Register the memfd as a backing file (FUSE_DEV_IOC_BACKING_OPEN: struct fuse_backing_map)."""
        arg = bytearray(struct.pack("=iIQ", self.memfd, 0, 0))
        self.backing = fcntl.ioctl(self.session.fd, abi.FUSE_DEV_IOC_BACKING_OPEN, arg, True)

    def _attr(self, ino: int) -> Attr:
        if ino == 1:
            return Attr(ino=1, mode=0o40755, nlink=2)
        return Attr(ino=2, mode=0o100444, size=self.size, blocks=(self.size + 511) // 512)

    def lookup(self, req):
        if req.nodeid != 1 or req.name != b"f":
            raise OSError(errno.ENOENT, "no such file")
        return EntryOut(2, self._attr(2), entry_timeout=3600, attr_timeout=3600)

    def getattr(self, req):
        return AttrOut(self._attr(req.nodeid), attr_timeout=3600)

    def open(self, req):
        if self.passthrough:
            return OpenOut(1, abi.FOPEN_PASSTHROUGH, self.backing)
        return OpenOut(1, abi.FOPEN_DIRECT_IO)

    def read(self, req):
        end = min(self.size, req.offset + req.size)
        return [self.view[req.offset:end]] if end > req.offset else []

    def flush(self, req):
        return None

    def release(self, req):
        return None


def reading(path: str, n: int) -> tuple[float, float]:
    """n processes read `path` whole at once: (aggregate bytes/s, their CPU seconds in all)."""
    start = time.perf_counter() + 0.3 + 0.05 * n
    procs = [subprocess.Popen([sys.executable, "-c", READER, path, str(start)], stdout=subprocess.PIPE, text=True)
             for _ in range(n)]
    rows = [tuple(map(float, p.communicate()[0].split())) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("passthrough: a reader failed")
    span = max(r[1] for r in rows) - min(r[0] for r in rows)
    return sum(r[2] for r in rows) / span, sum(r[3] for r in rows)


def staging(size: int, scratch) -> dict[str, tuple[float, float]]:
    """O_DIRECT reads of a `size`-byte file into a fresh memfd (its pages allocated by the reads),
    into a memfd fallocated first (the allocation timed too) and into a pre-faulted anonymous
    buffer: {where: (bytes/s, CPU s per GiB)}."""
    path = scratch / "staged.bin"
    chunk = os.urandom(BLOCK)
    with open(path, "wb") as f:
        for off in range(0, size, BLOCK):
            f.write(chunk[:min(BLOCK, size - off)])
        os.fsync(f.fileno())
    out = {}
    try:
        for where in ("a fresh memfd", "a memfd fallocated first", "a pre-faulted buffer"):
            if where == "a pre-faulted buffer":
                buf = mmap.mmap(-1, size)
                for off in range(0, size, BLOCK):  # every page faulted in before the clock starts
                    buf[off:min(size, off + BLOCK)] = chunk[:min(BLOCK, size - off)]
            drop_caches()
            c0, t0 = os.times(), time.perf_counter()
            if where != "a pre-faulted buffer":
                fd_m = os.memfd_create("ckptfs-stage")
                os.ftruncate(fd_m, size)
                if where == "a memfd fallocated first":
                    os.posix_fallocate(fd_m, 0, size)
                buf = mmap.mmap(fd_m, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                os.close(fd_m)
            view = memoryview(buf)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            for off in range(0, size, 8 * MiB):
                os.preadv(fd, [view[off:min(size, off + 8 * MiB)]], off)
            t1, c1 = time.perf_counter(), os.times()
            os.close(fd)
            view.release()
            buf.close()
            cpu = (c1.user - c0.user) + (c1.system - c0.system)
            out[where] = (size / (t1 - t0), cpu / (size / GiB))
    finally:
        path.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="the session's worker threads")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scratch", default=str(SCRATCH / "passthrough"))
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("passthrough: run as root (mount(2), FUSE_DEV_IOC_BACKING_OPEN)", file=sys.stderr)
        return 2
    size = parse_size(args.size)
    scratch = Path(args.scratch)
    mp = scratch / "mnt"
    mp.mkdir(parents=True, exist_ok=True)
    memfd = os.memfd_create("ckptfs-probe")
    os.ftruncate(memfd, size)
    chunk = os.urandom(BLOCK)
    for off in range(0, size, BLOCK):
        os.pwrite(memfd, chunk[:min(BLOCK, size - off)], off)
    fs = OneFile(memfd, size)
    session = Session(fs, str(mp), SessionConfig(threads=args.threads, want=DEFAULT_WANT | abi.FUSE_PASSTHROUGH,
                                                 max_write=4 * MiB, max_read=4 * MiB, raise_max_pages=True))
    fs.session = session
    session.mount()
    modes = ["read"]
    res: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    try:
        neg = session.start()
        if neg.has(abi.FUSE_PASSTHROUGH):
            try:
                fs.attach_backing()
                modes.append("passthrough")
            except OSError as e:
                print(f"passthrough: FUSE_DEV_IOC_BACKING_OPEN failed ({e}); measuring `read` alone")
        else:
            print("passthrough: this kernel does not offer FUSE_PASSTHROUGH; measuring `read` alone")
        path = str(mp / "f")
        print(f"{size / GiB:.2f} GiB in a memfd, {args.threads} session threads, READs of up to "
              f"{neg.max_pages * 4} KiB; GB/s aggregate, CPU s per GiB served")
        for rnd in range(args.repeats):
            for mode in (modes if rnd % 2 == 0 else modes[::-1]):
                fs.passthrough = mode == "passthrough"
                for n in sorted({1, args.readers}):
                    reading(path, 1)  # untimed: every page of the memfd exists
                    d0 = os.times()
                    bps, reader_cpu = reading(path, n)
                    d1 = os.times()
                    daemon = (d1.user - d0.user) + (d1.system - d0.system)
                    res.setdefault((mode, n), []).append((bps, daemon / (n * size / GiB),
                                                          reader_cpu / (n * size / GiB)))
    finally:
        session.close(timeout=10)
    print(f"{'mode':12s} {'readers':>7s} {'GB/s':>14s} {'daemon CPU':>16s} {'reader CPU':>16s}")
    for (mode, n), rows in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cols = []
        for i in range(3):
            xs = [r[i] / (1e9 if i == 0 else 1) for r in rows]
            cols.append(f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})")
        print(f"{mode:12s} {n:7d} {cols[0]:>14s} {cols[1]:>16s} {cols[2]:>16s}")
    print("staging the file from the disk (O_DIRECT, 8 MiB reads, page cache dropped):")
    for where, (bps, cpu) in staging(size, scratch).items():
        print(f"  into {where:26s} {bps / 1e9:.2f} GB/s, {cpu:.2f} CPU s per GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
