"""The FUSE round trip over /dev/fuse against FUSE over io_uring, both served by a bare Python loop.

A probe, not a server for ckptfs: it tells whether moving the native
engine from `readv`/`writev` on /dev/fuse to FUSE over io_uring (kernel >=
6.14, `CONFIG_FUSE_IO_URING`, module parameter `enable_uring`) would lower
the cost of a request. Each transport gets its own mount of a filesystem
that does nothing (a root folder and a file `f`, attributes never cached, no
extended attributes), served by a loop with no ckptfs logic in it:

  dev     one thread per CPU, each `readv`s a request from its clone of
          /dev/fuse and `writev`s the reply (what ckptfs's session does,
          without the rest of it);
  uring   one thread per queue (the kernel makes one per possible CPU and
          gives a request to the queue of the CPU its caller runs on), each
          with its own io_uring: `--depth` entries registered
          (FUSE_IO_URING_CMD_REGISTER), then each reply is committed and the
          entry armed again (COMMIT_AND_FETCH) in the same `io_uring_enter`
          that waits for the next request. `--pin`: each queue's thread runs
          on its own CPU, where its callers run.

A client process times `--n` os.stat (one GETATTR each) and getxattr (one
GETXATTR, ENODATA) on each mount in turn, `--rounds` times, and prints the
median latency and the server's CPU per request (user, system) round by
round. The mounts go through ckptfs's protocol session (mount(2) and INIT;
the io_uring one also asks for FUSE_OVER_IO_URING), so run as root. The
module parameter is switched on for the run and restored after.

    .venv/bin/python benchmarks/probes/uringfloor.py [--n 5000] [--rounds 3]
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import mmap
import os
import struct
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py and the cases
from common import ROOT, SCRATCH  # noqa: E402
from fusefloor import CLIENT

ENABLE = "/sys/module/fuse/parameters/enable_uring"
FUSE_OVER_IO_URING = 1 << 41
MAX_WRITE = 128 << 10

# io_uring (include/uapi/linux/io_uring.h)
SYS_SETUP, SYS_ENTER = 425, 426
SETUP_CQSIZE, SETUP_SQE128 = 1 << 3, 1 << 10
ENTER_GETEVENTS = 1
OP_URING_CMD = 46
OFF_SQ_RING, OFF_CQ_RING, OFF_SQES = 0, 0x8000000, 0x10000000
FEAT_SINGLE_MMAP = 1
SQE_SIZE, CQE_SIZE = 128, 16
# FUSE over io_uring (include/uapi/linux/fuse.h, 7.42)
CMD_REGISTER, CMD_COMMIT_AND_FETCH = 1, 2
IN_OUT, OP_IN = 0, 128                         # offsets in struct fuse_uring_req_header
ENT = 256                                      # struct fuse_uring_ent_in_out: flags, commit_id, payload_sz
HEADER_SIZE = 256 + 32

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _u32s(*names: str) -> list:
    return [(n, ctypes.c_uint32) for n in names]


class _SqOffsets(ctypes.Structure):  # struct io_sqring_offsets
    _fields_ = _u32s("head", "tail", "ring_mask", "ring_entries", "flags", "dropped", "array", "resv1") + \
        [("user_addr", ctypes.c_uint64)]


class _CqOffsets(ctypes.Structure):  # struct io_cqring_offsets
    _fields_ = _u32s("head", "tail", "ring_mask", "ring_entries", "overflow", "cqes", "flags", "resv1") + \
        [("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):  # struct io_uring_params
    _fields_ = _u32s("sq_entries", "cq_entries", "flags", "sq_thread_cpu", "sq_thread_idle", "features", "wq_fd") + \
        [("resv", ctypes.c_uint32 * 3), ("sq_off", _SqOffsets), ("cq_off", _CqOffsets)]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _check(res: int, what: str) -> int:
    if res < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return res


class Ring:
    """One io_uring with 128-byte SQEs: `sqe()` hands out the next submission slot, `enter()`
    submits what was prepared and waits, `completions()` drains the completion queue."""

    def __init__(self, entries: int):
        p = _Params(flags=SETUP_SQE128 | SETUP_CQSIZE, cq_entries=2 * entries)
        self.fd = _check(_libc.syscall(SYS_SETUP, entries, ctypes.byref(p)), "io_uring_setup")
        sq, cq = p.sq_off, p.cq_off
        sq_size = sq.array + p.sq_entries * 4
        cq_size = cq.cqes + p.cq_entries * CQE_SIZE
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | mmap.MAP_POPULATE
        self.sq = mmap.mmap(self.fd, max(sq_size, cq_size), flags, prot, offset=OFF_SQ_RING)
        self.cq = self.sq if p.features & FEAT_SINGLE_MMAP else mmap.mmap(self.fd, cq_size, flags, prot,
                                                                          offset=OFF_CQ_RING)
        self.sqes = mmap.mmap(self.fd, p.sq_entries * SQE_SIZE, flags, prot, offset=OFF_SQES)
        self.sq_tail, self.sq_mask, self.sq_array = sq.tail, p.sq_entries - 1, sq.array
        self.cq_head, self.cq_tail, self.cq_mask, self.cqes = cq.head, cq.tail, p.cq_entries - 1, cq.cqes
        self.pending = 0
        self.u32 = struct.Struct("<I")
        self.cqe = struct.Struct("<Qi")

    def sqe(self) -> int:
        """The byte offset of the next SQE in `self.sqes` (zeroed), queued for the next `enter`."""
        tail = self.u32.unpack_from(self.sq, self.sq_tail)[0] + self.pending
        idx = tail & self.sq_mask
        off = idx * SQE_SIZE
        self.sqes[off:off + SQE_SIZE] = bytes(SQE_SIZE)
        self.u32.pack_into(self.sq, self.sq_array + 4 * idx, idx)
        self.pending += 1
        return off

    def enter(self, wait: int) -> None:
        n, self.pending = self.pending, 0
        if n:
            tail = self.u32.unpack_from(self.sq, self.sq_tail)[0]
            self.u32.pack_into(self.sq, self.sq_tail, (tail + n) & 0xFFFF_FFFF)
        while True:
            res = _libc.syscall(SYS_ENTER, self.fd, n, wait, ENTER_GETEVENTS if wait else 0, None, 0)
            if res >= 0 or ctypes.get_errno() != errno.EINTR:
                _check(res, "io_uring_enter")
                return
            n = 0

    def completions(self) -> list[tuple[int, int]]:
        head = self.u32.unpack_from(self.cq, self.cq_head)[0]
        tail = self.u32.unpack_from(self.cq, self.cq_tail)[0]
        out = []
        while head != tail:
            out.append(self.cqe.unpack_from(self.cq, self.cqes + (head & self.cq_mask) * CQE_SIZE))
            head = (head + 1) & 0xFFFF_FFFF
        self.u32.pack_into(self.cq, self.cq_head, head)
        return out


def serve(mountpoint: str, transport: str, depth: int, pin: bool) -> None:
    """In the server process: mount, answer INIT, serve until unmounted."""
    sys.path.insert(0, str(ROOT))
    from ckptfs.fuse.kernel import abi
    from ckptfs.fuse.kernel.negotiate import DEFAULT_WANT
    from ckptfs.fuse.kernel.replies import Attr, AttrOut, EntryOut
    from ckptfs.fuse.kernel.session import Session, SessionConfig

    bodies = {"dir": AttrOut(Attr(ino=1, mode=0o40755, nlink=2), attr_timeout=0).pack(),
              "file": AttrOut(Attr(ino=2, mode=0o100644), attr_timeout=0).pack(),
              "entry": EntryOut(2, Attr(ino=2, mode=0o100644), entry_timeout=3600, attr_timeout=0).pack()}
    unpack_in, pack_out = abi.IN_HEADER.unpack_from, abi.OUT_HEADER.pack

    def answer(opcode: int, nodeid: int) -> tuple[int, bytes]:
        """(errno, reply body) of the filesystem that does nothing."""
        if opcode == abi.Op.GETATTR:
            return 0, bodies["dir" if nodeid == 1 else "file"]
        if opcode == abi.Op.LOOKUP:
            return 0, bodies["entry"]
        if opcode == abi.Op.GETXATTR:
            return errno.ENODATA, b""
        return errno.ENOSYS, b""
    queues = len(os.sched_getaffinity(0)) if transport == "dev" else _possible_cpus()

    class Loop(Session):
        def _worker(self, index: int, fd: int) -> None:
            (self._dev if transport == "dev" else self._uring)(index, fd)

        def _dev(self, index: int, fd: int) -> None:
            hdr, payload = bytearray(80), bytearray(self.payload_size)
            while True:
                try:
                    os.readv(fd, [hdr, payload])
                except OSError as e:
                    if e.errno in (errno.ENODEV, errno.ECONNABORTED):
                        return
                    continue
                _, opcode, unique, nodeid, *_ = unpack_in(hdr)
                if opcode in (abi.Op.FORGET, abi.Op.BATCH_FORGET):
                    continue
                err, body = answer(opcode, nodeid)
                os.writev(fd, [pack_out(16 + len(body), -err, unique), body])

        def _uring(self, qid: int, fd: int) -> None:
            if pin:
                os.sched_setaffinity(0, {qid})  # this thread only: the CPU whose callers this queue serves
            ring = Ring(depth + 1)
            size = max(8192, self.negotiated.max_write, self.negotiated.max_pages * abi.PAGE_SIZE)
            heads = [ctypes.create_string_buffer(HEADER_SIZE) for _ in range(depth)]
            loads = [ctypes.create_string_buffer(size) for _ in range(depth)]
            iovs = [(_Iovec * 2)((ctypes.addressof(h), HEADER_SIZE), (ctypes.addressof(p), size))
                    for h, p in zip(heads, loads)]
            views = [memoryview(h).cast("B") for h in heads]
            pviews = [memoryview(p).cast("B") for p in loads]

            def command(op: int, i: int, commit: int) -> None:
                off = ring.sqe()
                # opcode, flags, ioprio, fd, cmd_op, pad, addr, len, rw, user_data; then the 80-byte
                # command area at 48: struct fuse_uring_cmd_req (flags, commit_id, qid)
                struct.pack_into("<BBHiIIQIIQ", ring.sqes, off, OP_URING_CMD, 0, 0, self.fd, op, 0,
                                 ctypes.addressof(iovs[i]) if op == CMD_REGISTER else 0,
                                 2 if op == CMD_REGISTER else 0, 0, i)
                struct.pack_into("<QQH", ring.sqes, off + 48, 0, commit, qid)

            for i in range(depth):
                command(CMD_REGISTER, i, 0)
            ring.enter(0)
            while True:
                ring.enter(1)
                for i, res in ring.completions():
                    if res < 0:
                        if res in (-errno.ENOTCONN, -errno.ECONNABORTED, -errno.ENODEV):
                            return
                        raise OSError(-res, f"queue {qid}: {os.strerror(-res)}")
                    v = views[i]
                    _, opcode, unique, nodeid, *_ = unpack_in(v, IN_OUT)
                    commit = struct.unpack_from("<Q", v, ENT + 8)[0]
                    err, body = answer(opcode, nodeid)
                    pviews[i][:len(body)] = body
                    v[IN_OUT:IN_OUT + 16] = pack_out(16 + len(body), -err, unique)
                    struct.pack_into("<I", v, ENT + 16, len(body))
                    command(CMD_COMMIT_AND_FETCH, i, commit)

    want = DEFAULT_WANT | (FUSE_OVER_IO_URING if transport == "uring" else 0)
    s = Loop(None, mountpoint, SessionConfig(threads=queues, want=want, max_write=MAX_WRITE, fsname="uringfloor"))
    s.mount()
    neg = s.start()
    if transport == "uring" and not neg.has(FUSE_OVER_IO_URING):
        print("no FUSE_OVER_IO_URING from this kernel", flush=True)
    print("ready", flush=True)
    s.wait()
    s.close()


def _possible_cpus() -> int:
    """The kernel makes one queue per possible CPU and waits for all of them."""
    with open("/sys/devices/system/cpu/possible") as f:
        spec = f.read().strip()
    n = 0
    for part in spec.split(","):
        first, _, last = part.partition("-")
        n += int(last or first) - int(first) + 1
    return n




def cpu_seconds(pid: int) -> tuple[float, float]:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=5000, help="requests of each kind per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--depth", type=int, default=2, help="io_uring entries per queue")
    ap.add_argument("--pin", action="store_true", help="pin each io_uring queue's thread to its CPU")
    ap.add_argument("--client-cpu", type=int, default=-1, help="pin the client to this CPU")
    ap.add_argument("--serve", nargs=2, metavar=("MOUNTPOINT", "TRANSPORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve[0], args.serve[1], args.depth, args.pin)
        return 0
    if not os.path.exists(ENABLE):
        print("this kernel has no FUSE over io_uring (CONFIG_FUSE_IO_URING, kernel >= 6.14)")
        return 0
    with open(ENABLE) as f:
        was = f.read().strip()
    with open(ENABLE, "w") as f:
        f.write("Y")
    servers = {}
    try:
        for t in ("dev", "uring"):
            mp = SCRATCH / f"uringfloor-{t}"
            mp.mkdir(parents=True, exist_ok=True)
            p = subprocess.Popen([sys.executable, __file__, "--serve", str(mp), t, "--depth", str(args.depth),
                                  *(["--pin"] if args.pin else [])],
                                 stdout=subprocess.PIPE, text=True)
            line = p.stdout.readline().strip()
            if line != "ready":  # (the server is mounted and waits: the finally unmounts it)
                print(f"{t}: {line or 'the server did not start'}")
                servers[t] = (p, mp)
                return 0 if line.startswith("no FUSE_OVER_IO_URING") else 1
            servers[t] = (p, mp)
        for rnd in range(args.rounds):
            for t in (("dev", "uring") if rnd % 2 == 0 else ("uring", "dev")):
                p, mp = servers[t]
                u0, s0 = cpu_seconds(p.pid)
                res = subprocess.run([sys.executable, "-c", CLIENT, str(mp / "f"), str(args.n), str(args.client_cpu)],
                                     capture_output=True, text=True, check=True).stdout
                res = "; ".join(" ".join(line.split()) for line in res.splitlines())
                u1, s1 = cpu_seconds(p.pid)
                per = 2 * args.n + 1
                print(f"round {rnd + 1} {t:5s} {res}; server CPU per request: "
                      f"user {(u1 - u0) / per * 1e6:.1f} us, system {(s1 - s0) / per * 1e6:.1f} us", flush=True)
    finally:
        for p, mp in servers.values():
            subprocess.run(["umount", str(mp)], check=False)
            p.wait(timeout=30)
        with open(ENABLE, "w") as f:
            f.write(was)
    return 0


if __name__ == "__main__":
    sys.exit(main())
