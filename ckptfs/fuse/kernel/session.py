"""The FUSE server: owns /dev/fuse, reads requests in N threads, replies with writev.

Lifecycle::

    s = Session(handler, "/mnt", SessionConfig(threads=4), SessionHooks(...))
    s.mount()      # open /dev/fuse; mount(2) as root, else fusermount3
    s.start()      # answer INIT (negotiate.py), then start the worker threads
    ...            # serve until unmounted (`umount`, s.unmount()) or aborted
    s.wait()       # every worker has seen ENODEV and exited
    s.close()

Threads: worker 0 reads the session descriptor, workers 1..N-1 each read a
clone (FUSE_DEV_IOC_CLONE); the kernel hands each request to one reader.
While requests come one at a time, one worker reads and the others park
(readers.py); all read once requests queue up or a handler waits.
A handler about to wait for long (memory, a fetch, durability, another
request such as an INTERRUPT) must say so with ``with session.waiting():``
(else the requests behind it wait for it, as in a single-threaded server):
every worker then reads, and when that leaves no worker reading, a spare
worker starts on a new clone (at most SPARE_WORKERS), so that other requests
and INTERRUPTs are still read meanwhile; a spare leaves after a request once
other workers are free again (the handler's optional `worker_exit()` then
runs in it).
Each worker reads with ``os.readv(fd, [header, *payload])``: an 80-byte header
buffer (fuse_in_header + fuse_write_in) and the payload buffers, so a WRITE's
data lands in the payload buffers on its own. By default the payload is one
buffer of the worker's; a `write_buffer(worker)` hook may supply it instead,
before every read: one buffer, or a list of buffers the read scatters the
payload over in order (e.g. a run of free arena slots, one chunk each, for
requests of several chunks: `Write.pieces` are then views of each). The write
handler finds its data already in place and may keep buffers (the hook
returns fresh ones next time; None: the worker's own). Together they must
hold `payload_size` bytes (max_write, or the room a non-WRITE request needs).
A worker lays its buffers out before it knows the request; an `on_read(req)`
hook sees each request as soon as it is parsed (before it is served), so
the next layouts can follow from it.
Replies go out with ``os.writev(fd, [out_header, *data])``: READ data may be
views of the arena or of device buffers, never copied here; a result with a
`release()` method is released once its reply is written (or dropped), so a
handler can pin what its views show until then. An `after_reply()` hook runs
in the worker once a request is over (reply written, results released), e.g.
to wake other threads only then; a `settle` object (`due_in()`, `wake_due()`)
lets those wake-ups wait for a pause: after each request, before it parks
or reads again, a worker polls for up to `due_in()` seconds and calls
`wake_due()` if no request came (tasks.LoopLock, "Settling"). os.readv/os.writev release the GIL.

The handler is any object with one method per operation, named by
`Request.method` (``lookup``, ``getattr``, ``write``, ``readdir``, ...), each
taking the typed request (requests.py) and returning the typed reply
(replies.py), in the worker thread, so it must be thread-safe:

    lookup mknod mkdir symlink link -> EntryOut      getattr setattr -> AttrOut
    open opendir -> OpenOut      create -> CreateOut      write -> WriteOut
    read -> bytes-like or list of them (at most req.size bytes)     readlink -> bytes
    readdir -> DirentBuffer (req.plus: READDIRPLUS)   statfs -> StatfsOut   lseek -> LseekOut
    getxattr -> the value; listxattr -> the names (the size-0 query and ERANGE are done here)
    unlink rmdir rename release releasedir flush fsync fsyncdir setxattr removexattr
    access fallocate syncfs destroy -> None
    forget batch_forget -> None, and no reply goes to the kernel
    init(negotiated) and interrupt(unique): optional notifications

A missing method answers ENOSYS (the kernel then stops asking for flush,
access, fsyncdir, syncfs, ...). To fail, raise any exception with an int
`errno` (OSError, ckptfs.errors.FsError); anything else is logged and
becomes EIO. Nothing a handler does ends a worker.

Order: the kernel numbers requests in the order it queues them; workers
read them in that order but may reach the handler in another. A handler
that needs the kernel's order calls ``session.order.turn(req.unique)``
before acting (order.py: it waits until every earlier request is done) and
``session.order.done(req.unique)`` once it may be overtaken (the session
says done itself after the reply, for every request).

INTERRUPT marks the target in-flight request; a long handler polls
`session.interrupted(req.unique)` and may give up with EINTR. An interrupt
for a request not yet registered gets EAGAIN, so the kernel repeats it.
Replies the kernel no longer wants (ENOENT: the request was interrupted or
aborted) are dropped quietly. ENODEV (or ECONNABORTED) on read means the
filesystem was unmounted or the connection aborted: every worker exits.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import operator
import os
import select
import threading
import time
from dataclasses import dataclass
from typing import Callable

from . import abi, mount as _mount
from .negotiate import DEFAULT_WANT, Negotiated, negotiate
from .order import KernelOrder
from .parse import parse_header, parse_request
from .readers import BULK, Readers, backlog
from .replies import (AttrOut, CopiedOut, CreateOut, DirentBuffer, EntryOut, LseekOut, OpenOut, StatfsOut, WriteOut,
                      XattrSize, error_reply, frame)
from .requests import Init, ProtocolError

log = logging.getLogger("ckptfs.fuse.kernel")

IOV_MAX = 1024
SPARE_WORKERS = 64  # workers beyond `threads`, started while every other one waits in a handler
# A non-WRITE request's body beyond the header buffer: the largest is SETXATTR (name + 64 KiB value).
NON_WRITE_ROOM = abi.XATTR_SIZE_MAX + 2 * abi.PAGE_SIZE
_DATA = (bytes, bytearray, memoryview, list, tuple)
# The reply type each method must return (None: an empty reply).
_REPLY_TYPES = {
    "lookup": EntryOut, "mknod": EntryOut, "mkdir": EntryOut, "symlink": EntryOut, "link": EntryOut,
    "getattr": AttrOut, "setattr": AttrOut, "open": OpenOut, "opendir": OpenOut, "create": CreateOut,
    "write": WriteOut, "statfs": StatfsOut, "lseek": LseekOut, "readdir": DirentBuffer,
    "copy_file_range": (WriteOut, CopiedOut),
    "read": _DATA, "readlink": (bytes, bytearray, memoryview),
}
_NO_REPLY = frozenset({"forget", "batch_forget"})
_IN_SIZE = abi.IN_HEADER.size  # fuse_in_header
_HEAD_SIZE = abi.WRITE_HEADER_SIZE  # the header buffer of every read: fuse_in_header + fuse_write_in


@functools.lru_cache(maxsize=256)  # Python's open() of any file asks an IOCTL (isatty): every time
def _unsupported(opcode: int) -> str:
    """The statistics key of an opcode answered ENOSYS: 'unsupported_ioctl', or the number."""
    try:
        return f"unsupported_{abi.Op(opcode).name.lower()}"
    except ValueError:
        return f"unsupported_{opcode}"


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def _filled(buffers: list[memoryview], size: int) -> list[memoryview]:
    """Views of the first `size` bytes a readv put into `buffers` (filled in order)."""
    out = []
    for buf in buffers:
        if size <= 0:
            break
        out.append(buf[:size])
        size -= buf.nbytes
    return out


def _reply_length(parts: list) -> int:
    """The length a reply's fuse_out_header (its first buffer) gives: frame() counted its parts."""
    return abi.OUT_HEADER.unpack_from(parts[0])[0]


def _errno_of(exc: BaseException, what: str) -> int:
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and 0 < code < 512:
        return code
    log.error("unexpected error in %s; replying EIO", what, exc_info=exc)
    return errno.EIO


@dataclass(frozen=True)
class SessionConfig:
    """How a Session mounts and what it asks the kernel for at INIT."""
    threads: int | None = None  # workers reading /dev/fuse (None: the CPU count)
    fsname: str = "ckptfs"
    subtype: str = "ckptfs"
    allow_other: bool = True
    default_permissions: bool = True
    want: int = DEFAULT_WANT  # INIT flags asked for (negotiate.py)
    max_write: int | None = None  # None: as large as the kernel's max_pages limit allows
    grain: int | None = None  # max_write stays a whole number of these (chunks) when the limit cuts it
    raise_max_pages: bool = False  # as root, raise the max_pages sysctl to fit max_write / max_read
    max_read: int | None = None  # direct_io READs up to this (max_pages beyond max_write's), see negotiate
    use_fusermount: bool | None = None  # None: when not root


@dataclass(frozen=True)
class SessionHooks:
    """The calls a Session makes around each request, in the worker thread (module docstring):
    `write_buffer(worker)` the buffers the next read scatters the payload over; `on_read(req)` as
    soon as a request is parsed; `after_reply()` once a request is over; `settle` (`due_in()`,
    `wake_due()`) lets those wake-ups wait for a pause in requests."""
    write_buffer: Callable | None = None
    on_read: Callable | None = None
    after_reply: Callable | None = None
    settle: object | None = None


@dataclass(frozen=True)
class SessionStats:
    """One reading of a Session's counters (`Session.statistics()`)."""
    requests: dict  # method name -> requests served
    errors: int
    dropped: int
    spares_started: int
    readers_parked: int
    readers_activated: int
    readers_woken: int


class Session:
    """The FUSE server of one mount: its /dev/fuse descriptors, worker threads, the kernel's order
    of requests (`order`), the readers' turns (`readers`) and the per-method request counts."""

    def __init__(self, handler, mountpoint: str, config: SessionConfig = SessionConfig(),
                 hooks: SessionHooks = SessionHooks()):
        self.handler = handler
        self.mountpoint = os.path.abspath(mountpoint)
        self.config = config
        self.threads = config.threads or default_threads()
        self.fsname = config.fsname
        self.write_buffer, self.on_read = hooks.write_buffer, hooks.on_read
        self.after_reply, self.settle = hooks.after_reply, hooks.settle
        self.use_fusermount = os.geteuid() != 0 if config.use_fusermount is None else config.use_fusermount
        self._worker_exit = None  # the handler's optional worker_exit(), found at start()
        self.fd: int | None = None
        self.negotiated: Negotiated | None = None
        self._setxattr_ext = False  # negotiated.setxattr_ext, read by every parse
        self.payload_size = 0
        self._workers: list[threading.Thread] = []
        self._methods: dict[str, object] = {}
        self._inflight: set[int] = set()
        self._interrupted: set[int] = set()
        self._counts: list[dict[str, int]] = []
        self._last_payload: dict[int, tuple] = {}  # worker -> (write_buffer's last answer, its views)
        self._spare_lock = threading.Lock()
        self._running = 0  # GUARDED_BY _spare_lock: workers in their loop
        self._waiting = 0  # GUARDED_BY _spare_lock: ... of which waiting in a handler (`waiting`)
        self._spares = 0  # GUARDED_BY _spare_lock: running workers beyond `threads`
        self.spares_started = 0
        self._pages_limit: int | None = None
        self.mounted = False
        self.order = KernelOrder()  # handlers that want the kernel's order take turns (order.py)
        self.readers = Readers()  # one worker reads while requests come one at a time (readers.py)

    # ---- lifecycle -----------------------------------------------------------------
    def mount(self) -> None:
        limit = _mount.max_pages_limit()
        if self.config.raise_max_pages and self.config.max_write and os.geteuid() == 0:
            limit = _mount.raise_max_pages_limit(-(-max(self.config.max_write, self.config.max_read or 0) // abi.PAGE_SIZE) + 1)
        self._pages_limit = limit
        options = dict(uid=os.getuid(), gid=os.getgid(), allow_other=self.config.allow_other,
                       default_permissions=self.config.default_permissions)
        if self.use_fusermount:
            names = [f"fsname={self.fsname}", f"subtype={self.config.subtype}", "nosuid", "nodev"]
            names += [o for o, on in (("allow_other", self.config.allow_other),
                                      ("default_permissions", self.config.default_permissions)) if on]
            self.fd = _mount.fusermount(self.mountpoint, ",".join(names))
        else:
            self.fd = _mount.open_device()
            try:
                _mount.kernel_mount(self.fd, self.mountpoint, _mount.mount_data(self.fd, **options),
                                    fsname=self.fsname, subtype=self.config.subtype)
            except OSError:
                os.close(self.fd)
                self.fd = None
                raise
        self.mounted = True

    def start(self) -> Negotiated:
        """Answer INIT on the session descriptor, then start the workers."""
        if self.fd is None:
            raise RuntimeError("start() before mount()")
        if self._pages_limit is None:
            self._pages_limit = _mount.max_pages_limit()
        want_size = self.config.max_write or self._pages_limit * abi.PAGE_SIZE
        hdr = bytearray(abi.WRITE_HEADER_SIZE)
        payload = bytearray(max(want_size, NON_WRITE_ROOM))
        while True:
            try:
                n = os.readv(self.fd, [hdr, payload])
                break
            except InterruptedError:
                continue
        head = memoryview(hdr)[:min(n, abi.WRITE_HEADER_SIZE)]
        h = parse_header(head)
        req = parse_request(h, head[abi.IN_HEADER.size:], memoryview(payload)[:max(0, n - len(hdr))])
        if not isinstance(req, Init):
            raise ProtocolError(f"the first request is opcode {h.opcode}, not INIT")
        try:
            out, neg = negotiate(req, want=self.config.want, max_write=self.config.max_write, grain=self.config.grain,
                                 max_pages_limit=self._pages_limit, max_read=self.config.max_read)
            init = getattr(self.handler, "init", None)
            if init is not None:
                init(neg)
        except BaseException as exc:
            self._send(self.fd, [error_reply(h.unique, errno.EPROTO if isinstance(exc, ProtocolError)
                                             else _errno_of(exc, "init"))], h.unique)
            raise
        self.negotiated = neg
        self._setxattr_ext = neg.setxattr_ext
        self.order.start(h.unique)
        self.payload_size = max(neg.max_write, NON_WRITE_ROOM)
        for name in ("lookup forget batch_forget getattr setattr readlink symlink mknod mkdir unlink rmdir "
                     "rename link open read write statfs release fsync setxattr getxattr listxattr "
                     "removexattr flush opendir readdir releasedir fsyncdir access create destroy syncfs "
                     "lseek fallocate copy_file_range interrupt").split():
            self._methods[name] = getattr(self.handler, name, None)
        self._worker_exit = getattr(self.handler, "worker_exit", None)
        if not self._send(self.fd, frame(h.unique, out), h.unique):
            raise OSError(errno.EIO, f"the kernel refused the INIT reply for {self.mountpoint}")
        fds = [self.fd]
        try:
            for _ in range(self.threads - 1):
                fds.append(_mount.clone_device(self.fd))
        except OSError:
            for fd in fds[1:]:
                os.close(fd)
            raise
        for fd in fds:
            self._add_worker(fd)
        for t in self._workers:
            t.start()
        return neg

    def _add_worker(self, fd: int) -> threading.Thread:
        i = len(self._workers)
        self._counts.append({})
        t = threading.Thread(target=self._worker, args=(i, fd), name=f"fuse-{i}", daemon=True)
        with self._spare_lock:
            self._running += 1
        self._workers.append(t)
        return t

    def serve(self) -> None:
        """mount(), start(), and wait until unmounted."""
        self.mount()
        self.start()
        self.wait()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every worker to exit (the filesystem was unmounted); True if they all did."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._workers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self.alive()

    def alive(self) -> int:
        """How many workers still run."""
        return sum(t.is_alive() for t in self._workers)

    def unmount(self, lazy: bool = False) -> None:
        _mount.unmount(self.mountpoint, lazy=lazy, use_fusermount=self.use_fusermount)
        self.mounted = False

    def close(self, timeout: float = 10.0) -> None:
        """Unmount (lazily) if the workers still run, wait for them, close the session descriptor."""
        if self.alive():
            try:
                self.unmount(lazy=True)
            except OSError as e:
                log.warning("lazy unmount of %s failed: %s", self.mountpoint, e)
            self.wait(timeout)
        if self.fd is not None and not self.alive():
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- what handlers may ask -----------------------------------------------------------
    def interrupted(self, unique: int) -> bool:
        """Whether the kernel asked to interrupt the request `unique` (still in flight)."""
        return unique in self._interrupted

    @contextlib.contextmanager
    def waiting(self):
        """Around a handler's long wait: every worker reads meanwhile (readers.py), and if no other
        worker is left to read, a spare one starts."""
        self.readers.activate()
        spare = False
        with self._spare_lock:
            self._waiting += 1
            if self._running - self._waiting <= 0 and self._spares < SPARE_WORKERS and self.fd is not None:
                self._spares += 1
                spare = True
        if spare:
            self._start_spare()
        try:
            yield
        finally:
            with self._spare_lock:
                self._waiting -= 1

    def _start_spare(self) -> None:
        try:
            fd = _mount.clone_device(self.fd)
        except OSError as e:
            with self._spare_lock:
                self._spares -= 1
            log.warning("no spare FUSE worker (clone of /dev/fuse failed: %s): requests wait for a worker", e)
            return
        self.spares_started += 1
        self._add_worker(fd).start()

    def _spare_leaves(self, index: int) -> bool:
        """After a request: a spare worker leaves when another worker is free to read."""
        if index < self.threads:
            return False
        with self._spare_lock:
            if self._running - self._waiting < 2:
                return False
            self._running -= 1
            self._spares -= 1
        return True

    def statistics(self) -> "SessionStats":
        """Requests served per method (`unsupported_<opcode>`: answered ENOSYS, e.g. Python's open()
        sends an IOCTL), replies that failed (`errors`) or that the kernel no longer wanted
        (`dropped`), spare workers started and the readers' turns."""
        total: dict[str, int] = {}
        for counts in list(self._counts):
            for k, v in list(counts.items()):
                total[k] = total.get(k, 0) + v
        errors, dropped = total.pop("errors", 0), total.pop("dropped", 0)
        return SessionStats(total, errors, dropped, self.spares_started, self.readers.parks,
                            self.readers.activations, self.readers.wakes)

    # ---- the workers ---------------------------------------------------------------------
    def _payload(self, index: int, own: memoryview) -> list[memoryview]:
        """The buffers the next request's payload is read into: the hook's (cut at
        `payload_size`), or the worker's own."""
        given = None if self.write_buffer is None else self.write_buffer(index)
        if given is None:
            return [own]
        if not isinstance(given, (list, tuple)):
            given = (given,)
        last = self._last_payload.get(index)
        if last is not None and len(last[0]) == len(given) and all(map(operator.is_, last[0], given)):
            return last[1]  # the hook gave the same buffers again (maybe the same list, changed): the same views
        out = self._views(given, own)
        self._last_payload[index] = (tuple(given), out)
        return out

    def _views(self, given, own: memoryview) -> list[memoryview]:
        """`given` (the write_buffer hook's answer) as byte views cut at `payload_size`."""
        out, room = [], self.payload_size
        for buf in given:
            if type(buf) is not memoryview or buf.format != "B" or buf.ndim != 1:  # (a byte view as it is)
                buf = memoryview(buf).cast("B")
            if buf.readonly:
                log.error("write_buffer gave a read-only buffer: using the worker's own")
                return [own]
            if buf.nbytes > room:
                buf = buf[:room]
            out.append(buf)
            room -= buf.nbytes
            if not room:
                return out
        log.error("write_buffer gave %d bytes; need %d: using the worker's own buffer",
                  self.payload_size - room, self.payload_size)
        return [own]

    def _worker(self, index: int, fd: int) -> None:
        _mount.name_thread(f"{self.fsname}-fuse {index}")
        hdr = bytearray(abi.WRITE_HEADER_SIZE)
        head = memoryview(hdr)
        own = memoryview(bytearray(self.payload_size))
        counts = self._counts[index]
        left = False
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        try:
            while True:
                if self.settle is not None:  # before parking too: the wake-up is this worker's to give
                    self._settle(poller)
                self.readers.enter(may_park=index < self.threads)
                try:
                    payload = self._payload(index, own)
                    n = os.readv(fd, [hdr, *payload])
                except OSError as e:
                    if e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                        continue  # ENOENT: the request was interrupted before we got it
                    if e.errno in (errno.ENODEV, errno.ECONNABORTED):
                        break  # unmounted or aborted
                    log.error("worker %d: read of /dev/fuse failed: %s; stopping", index, e)
                    break
                finally:
                    look = self.readers.leave()  # whatever the read gave: it is over
                if look and backlog(poller):  # requests are queued behind this one
                    if n >= BULK:
                        self.readers.activate()  # several writers at once: every worker reads
                    else:
                        self.readers.wake_one()
                if n == 0:
                    break  # end of file: not /dev/fuse (a socket in tests) and its peer is gone
                try:
                    req = self._parse(fd, head, payload, n, counts)
                    if req is not None:
                        self._serve_one(fd, req, counts)
                    elif self.after_reply is not None:
                        self.after_reply()  # a short read or a bad request (answered): over too
                except Exception:  # noqa: BLE001 - a worker never dies of one request
                    log.exception("worker %d: request not served", index)
                if self._spare_leaves(index):
                    left = True
                    self.readers.gone()
                    break
        finally:
            if not left:
                self.readers.stop()  # unmounted (or a failed read): no worker may stay parked
                with self._spare_lock:
                    self._running -= 1
                    if index >= self.threads:
                        self._spares -= 1
            self._last_payload.pop(index, None)
            if self.settle is not None:
                self.settle.wake_due()  # a spare leaving (or the end): no wake-up goes with it
            if left and self._worker_exit is not None:
                try:
                    self._worker_exit()
                except Exception:  # noqa: BLE001
                    log.exception("worker_exit failed")
            if fd != self.fd:
                os.close(fd)
            log.debug("worker %d exits", index)

    def _settle(self, poller) -> None:
        """Before a read, or parking: when `settle` has a wake-up due, wait up to its time for a
        request, and wake it if none came. Every worker does this after its reply, so the
        wake-up its request made due is never left with a worker that parks while another
        already waits in its read (which would not look until the next request)."""
        left = self.settle.due_in()
        if left is not None and not poller.poll(math.ceil(left * 1000)):
            self.settle.wake_due()

    def _parse(self, fd: int, head: memoryview, payload: list[memoryview], n: int, counts: dict):
        """The request a read of `n` bytes holds (seen by `on_read`), or None when there is
        nothing to serve (a short read; a bad request, answered EIO and done)."""
        if n < _IN_SIZE:
            log.error("short read of /dev/fuse: %d bytes, less than a request header", n)
            return None
        h = parse_header(head)
        try:
            if n <= _HEAD_SIZE:
                req = parse_request(h, head[_IN_SIZE:n], setxattr_ext=self._setxattr_ext)
            elif h.opcode == abi.Op.WRITE:  # the payload stays where the read put it
                req = parse_request(h, head[_IN_SIZE:], _filled(payload, n - _HEAD_SIZE),
                                    setxattr_ext=self._setxattr_ext)
            else:  # a name or a value past the header buffer: small, joined
                spill, first = n - _HEAD_SIZE, payload[0]
                rest = first[:spill] if first.nbytes >= spill else b"".join(_filled(payload, spill))
                req = parse_request(h, b"".join((head[_IN_SIZE:], rest)), setxattr_ext=self._setxattr_ext)
        except ProtocolError as e:
            log.error("bad request: %s", e)
            counts["errors"] = counts.get("errors", 0) + 1
            if h.opcode not in (abi.Op.FORGET, abi.Op.BATCH_FORGET):
                self._send(fd, [error_reply(h.unique, errno.EIO)], h.unique)
            self.order.done(h.unique)
            return None
        if self.on_read is not None:
            try:
                self.on_read(req)
            except Exception:  # noqa: BLE001 - a hint for the next layout only
                log.exception("on_read failed")
        return req

    def _serve_one(self, fd: int, req, counts: dict) -> None:
        try:
            self._serve_request(fd, req, counts)
        finally:
            self.order.done(req.header.unique)  # whatever happened to it (a handler may have said so sooner)
            if self.after_reply is not None:
                self.after_reply()

    def _serve_request(self, fd: int, req, counts: dict) -> None:
        h = req.header
        method = req.method
        key = method or _unsupported(h.opcode)
        counts[key] = counts.get(key, 0) + 1
        if method in _NO_REPLY:
            fn = self._methods.get(method)
            if fn is not None:
                try:
                    fn(req)
                except Exception:  # noqa: BLE001 - forget has no reply: log and go on
                    log.exception("%s failed", method)
            return
        if method == "interrupt":
            self._interrupt(fd, req)
            return
        fn = self._methods.get(method) if method else None
        if fn is None:
            self._send(fd, [error_reply(h.unique, errno.ENOSYS)], h.unique)
            return
        unique = h.unique
        self._inflight.add(unique)
        held = None  # the handler's result, when it holds something until the reply is out
        try:
            try:
                result = fn(req)
            except Exception as exc:  # noqa: BLE001 - becomes an errno, never ends the worker
                parts, err = None, _errno_of(exc, method)
            else:
                if callable(getattr(result, "release", None)):
                    held = result
                try:
                    parts, err = self._reply(req, method, result)
                except Exception:  # noqa: BLE001 - a bad reply value: still answer the kernel
                    log.exception("%s: could not encode the reply", method)
                    parts, err = None, errno.EIO
        finally:
            self._inflight.discard(unique)
            self._interrupted.discard(unique)
        try:
            if parts is None:
                counts["errors"] = counts.get("errors", 0) + 1
                parts = [error_reply(unique, err)]
            if not self._send(fd, parts, unique):
                counts["dropped"] = counts.get("dropped", 0) + 1
        finally:
            if held is not None:
                held.release()

    def _reply(self, req, method: str, result) -> tuple:
        """(the reply buffers for `req`, 0), or (None, errno) for a result that does not fit the
        request."""
        if method in ("getxattr", "listxattr"):
            if method == "listxattr" and not isinstance(result, (bytes, bytearray, memoryview)):
                result = b"".join(bytes(name) + b"\0" for name in result)
            size = memoryview(result).nbytes
            if req.size == 0:
                result = XattrSize(size)
            elif size > req.size:
                return None, errno.ERANGE
        else:
            want = _REPLY_TYPES.get(method)
            if not (result is None if want is None else isinstance(result, want)):
                log.error("%s returned %s, not %s; replying EIO", method, type(result).__name__,
                          "None" if want is None else want)
                return None, errno.EIO
        parts = frame(req.header.unique, result)
        if method == "read":
            size = _reply_length(parts) - abi.OUT_HEADER.size
            if size > req.size:
                log.error("read returned %d bytes for a request of %d; replying EIO", size, req.size)
                return None, errno.EIO
        if len(parts) > IOV_MAX:
            parts = [parts[0], b"".join(bytes(p) for p in parts[1:])]
        return parts, 0

    def _interrupt(self, fd: int, req) -> None:
        target = req.target
        if target in self._inflight:
            self._interrupted.add(target)
            fn = self._methods.get("interrupt")
            if fn is not None:
                try:
                    fn(target)
                except Exception:  # noqa: BLE001
                    log.exception("interrupt(%d) failed", target)
        else:
            # Not registered yet (or done already): EAGAIN makes the kernel queue it again;
            # for a finished request the kernel refuses the reply (ENOENT), which is fine.
            self._send(fd, [error_reply(req.unique, errno.EAGAIN)], req.unique)

    def _send(self, fd: int, parts: list, unique: int) -> bool:
        """Write one reply (`frame` or `error_reply`: its header says its length); False if the
        kernel no longer wanted it or is gone."""
        total = _reply_length(parts)
        try:
            n = os.writev(fd, parts)
        except OSError as e:
            if e.errno == errno.ENOENT:
                log.debug("reply to %d dropped: the request was interrupted or aborted", unique)
                return False
            if e.errno in (errno.ENODEV, errno.ECONNABORTED):
                return False
            log.error("reply to %d (%d bytes) refused by the kernel: %s", unique, total, e)
            return False
        if n != total:
            log.error("short reply write to %d: %d of %d bytes", unique, n, total)
            return False
        return True
