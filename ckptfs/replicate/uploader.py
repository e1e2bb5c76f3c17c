"""The uploader process: replication's object-store calls, at low CPU priority, beside the daemon.

    python -m ckptfs.replicate.uploader --socket FD --parent PID --url s3://B/P
        [--endpoint URL] [--connections N] [--priority idle|low|normal]

Over http botocore hashes every payload for SigV4 and then sends it: about a
CPU second per GiB. Made in the daemon's threads, that work competed for the
GIL with the threads serving the trainer's FUSE requests, at the trainer's
priority. Here it runs in a process of its own that lowers its priority
first (priority.py: idle is SCHED_IDLE, low is nice 19, normal leaves
it), so on a busy node the kernel gives it only the CPU the trainer leaves;
replication then lags and skips superseded versions, as the design allows.

How it works: the daemon (uploader_proc.py) starts it with one end of a
Unix socket pair. It asks the kernel to SIGKILL it when the daemon's thread
that started it dies (PR_SET_PDEATHSIG), lowers its priority, builds its
boto3 client (client.Target: the same endpoint, credential chain and
settings as in the daemon) and says "ready". Its main thread then reads
frames (wire.py): a "map" brings a memfd (SCM_RIGHTS) of part buffers
(partmem.py), mapped here too; a "call" goes to a pool of `connections`
threads, which run the Target call, the payload a view of the shared
memory (no copy), and write the answer back under a lock. One call is not
the store's: `segment_key` takes the BLAKE3 key of a segment from its bytes
in shared memory (segments.py), the daemon's other hashing work that would
otherwise compete with the trainer. End of file on
the socket (the daemon closed it, or died) ends the process at once:
calls still in flight are abandoned, the daemon retries them.
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import queue
import signal
import socket
import sys
import threading

from . import priority, segments, wire

PR_SET_PDEATHSIG = 1
MAX_FDS = 8  # file descriptors one read of the socket takes


def die_with_parent(parent: int) -> bool:
    """SIGKILL when the parent goes; False if it already went (it died before the prctl)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    return os.getppid() == parent


class Body:
    """A read-only file object over a memoryview, for boto3 (no copy of the part)."""

    def __init__(self, view: memoryview):
        self.view = view
        self.pos = 0

    def __len__(self) -> int:
        return len(self.view)

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n is None or n < 0 else min(len(self.view), self.pos + n)
        out = self.view[self.pos:end]
        self.pos = end
        return out

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: len(self.view)}[whence]
        self.pos = max(0, min(len(self.view), base + pos))
        return self.pos

    def tell(self) -> int:
        return self.pos


# the Target calls (client.py) replication makes
CALLS = frozenset({"list", "put", "put_new", "delete", "manifest", "segment_key"})


class Server:
    """Serves the daemon's calls on `sock` with `target`, `connections` at once (daemon threads: the
    process exits without waiting for the calls in flight)."""

    def __init__(self, sock: socket.socket, target, connections: int):
        self.sock = sock
        self.target = target
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(connections):
            threading.Thread(target=self.work, name=f"upload-{i}", daemon=True).start()
        self.send_lock = threading.Lock()
        self.maps: dict[int, mmap.mmap] = {}
        self.fds: list[int] = []  # received, not yet claimed by a "map"

    def send(self, msg: dict, id: int = 0, blob: bytes = b"") -> None:
        data = wire.frame(msg, id, blob)
        with self.send_lock:
            self.sock.sendall(data)

    def serve(self) -> None:
        decoder = wire.Decoder()
        while True:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 16, MAX_FDS)
            self.fds.extend(fds)
            if not data:
                return
            for id, msg, blob in decoder.feed(data):
                self.handle(id, msg, blob)

    def handle(self, id: int, msg: dict, blob: bytes) -> None:
        op = msg.get("op")
        if op == "call":
            self.calls.put((id, msg, blob))
        elif op == "map":
            fd = self.fds.pop(0)
            self.maps[msg["region"]] = mmap.mmap(fd, msg["size"], mmap.MAP_SHARED, mmap.PROT_READ)
            os.close(fd)
        elif op == "unmap":
            m = self.maps.pop(msg["region"], None)
            if m is not None:
                try:
                    m.close()
                except BufferError:  # a call still reads it: unmapped once that is done
                    pass
        elif op == "ping":
            self.send({"pong": True})

    def work(self) -> None:
        while True:
            self.call(*self.calls.get())

    def call(self, id: int, msg: dict, blob: bytes) -> None:
        try:
            name, args = msg["name"], list(msg.get("args", ()))
            if name not in CALLS:
                raise ValueError(f"no call {name!r}")
            body = msg.get("body")
            if body == wire.BLOB:
                args.append(blob)
            elif body is not None:
                region, offset, length = body
                args.append(Body(memoryview(self.maps[region])[offset:offset + length]))
            if name == "segment_key":  # not the store's: the key of a segment from its bytes
                result = segments.key_from_bytes(args[1].view, args[0])
            else:
                result = getattr(self.target, name)(*args)
            if name == "manifest":
                result = result.encode()
            if isinstance(result, bytes):
                self.send({"ok": wire.BLOB}, id, result)
            else:
                self.send({"ok": result}, id)
        except Exception as e:  # noqa: BLE001 - every failure goes back to the daemon as its call's answer
            try:
                self.send({"error": wire.error(e)}, id)
            except OSError:
                pass  # the daemon is gone: the main thread sees the end of file and exits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ckptfs.replicate.uploader")
    ap.add_argument("--socket", type=int, required=True)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--endpoint", default=None)
    ap.add_argument("--connections", type=int, default=10)
    ap.add_argument("--priority", choices=priority.PRIORITIES, default=priority.DEFAULT_PRIORITY)
    args = ap.parse_args(argv)
    sock = socket.socket(fileno=args.socket)
    try:
        if not die_with_parent(args.parent):
            return 0
        priority.lower(args.priority)  # before any other thread exists: they inherit it
        from .client import Target
        from .manifest import parse_url
        target = Target(parse_url(args.url), args.endpoint, connections=args.connections)
    except Exception as e:  # noqa: BLE001 - one line for the daemon's log and status
        try:
            sock.sendall(wire.frame({"fatal": f"{type(e).__name__}: {e}"}))
        except OSError:
            pass
        return 1
    server = Server(sock, target, args.connections)
    server.send({"ready": {"pid": os.getpid(), "policy": os.sched_getscheduler(0),
                           "nice": os.getpriority(os.PRIO_PROCESS, 0)}})
    try:
        server.serve()
    except (OSError, wire.WireError) as e:
        print(f"ckptfs uploader: {e}", file=sys.stderr)
    return 0  # calls in flight are abandoned: the daemon has gone, or retries them


if __name__ == "__main__":
    sys.exit(main())
