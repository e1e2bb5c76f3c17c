"""The daemon's side of the uploader process: start it, call it, watch it, restart it, stop it.

`Uploader` offers the Target calls replication makes (client.py), as async
methods of the trio loop; each is one frame (wire.py) to the uploader
process (uploader.py), which makes the boto3 call at its own low priority
and answers. A payload is named by where it lies in the shared part memory
(partmem.py: `Part.body(n)`), never copied into the socket; a region is
mapped by the process (its memfd sent with SCM_RIGHTS) before the first call
that names it. No daemon thread is involved: the socket is read and written
by the trio loop, and the answers wake the calls that wait for them.

The process is started on the first call, from the trio thread (the kernel
kills it when the thread that started it exits: PR_SET_PDEATHSIG), and it
is watched:

    it exits or is killed   every call in flight fails as S3Error(UPLOADER)
                            saying how it ended (the replicator retries them
                            with backoff, logs the failure once and shows it
                            in status), and the next call starts a new one
    it hangs                while calls wait, a ping goes out every PING_EVERY
                            seconds; nothing heard for `hang_timeout` seconds
                            and no CPU time used meanwhile (a process starved
                            at idle priority is slow, not hung): SIGKILL, then
                            as above
    it cannot start         the call fails as S3Error(UPLOADER) with the
                            process's own line (or the exec error); the
                            filesystem is not affected

Starts back off from BACKOFF_MIN to BACKOFF_MAX seconds, doubling, until a
call succeeds again. `run` is the service that holds the process's tasks;
when it ends (unmount) the socket is closed, which ends the process, and
after STOP_WAIT seconds it is killed: an unmount never waits on it.
"""
from __future__ import annotations

import array
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from itertools import count

import trio

from . import wire
from .client import UPLOADER, S3Error
from .manifest import Manifest, S3Url, manifest_name
from .partmem import PartMemory
from .priority import DEFAULT_PRIORITY

log = logging.getLogger("ckptfs.replicate")

PING_EVERY = 2.0
HANG_TIMEOUT = 30.0  # seconds a process with calls waiting may stay silent (it answers pings at any priority)
STOP_WAIT = 2.0
REAP_WAIT = 5.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")
BACKOFF_MIN, BACKOFF_MAX = 0.5, 10.0


class _Call:
    def __init__(self):
        self.done = trio.Event()
        self.result = None
        self.error: Exception | None = None


class _Process:
    """One uploader process and what is in flight with it."""

    def __init__(self, proc: subprocess.Popen, sock: trio.socket.SocketType):
        self.proc = proc
        self.sock = sock
        self.pidfd = os.pidfd_open(proc.pid)
        self.calls: dict[int, _Call] = {}
        self.mapped: set[int] = set()
        self.send_lock = trio.Lock()
        self.ready = trio.Event()  # set once it said ready, or once it is gone
        self.info: dict | None = None  # its "ready" message
        self.fatal: str | None = None  # its line when it could not start
        self.hung = False
        self.gone: str | None = None  # why it is gone (each call it fails gets its own S3Error)
        self.heard = trio.current_time()  # last time it said anything (or a wait began)
        self.cpu = 0.0  # its CPU seconds when last looked at


class Uploader:
    """Target calls (client.py) made by an uploader process at `priority`, `connections` at once."""

    def __init__(self, url: S3Url, endpoint: str | None, parts: PartMemory, *, connections: int,
                 priority: str = DEFAULT_PRIORITY, hang_timeout: float = HANG_TIMEOUT):
        self.url = url
        self.endpoint = endpoint
        self.parts = parts
        self.connections = connections
        self.priority = priority
        self.hang_timeout = hang_timeout
        self.process: _Process | None = None
        self._ids = count(1)
        self._start_lock = trio.Lock()
        self._next_start = 0.0
        self._backoff = BACKOFF_MIN
        self._nursery: trio.Nursery | None = None
        self.stopping = False
        self.starts = 0
        self.last_exit: str | None = None
        self.cpu_exited = 0.0  # CPU seconds of the processes that are gone

    def __str__(self) -> str:
        return str(self.url) + (f" at {self.endpoint}" if self.endpoint else "")

    def key(self, rel: str) -> str:
        return self.url.key(rel)

    # ---- the calls ---------------------------------------------------------------------
    async def list(self, rel: str) -> dict[str, int]:
        return await self.call("list", rel)

    async def put(self, rel: str, body) -> None:
        """`body`: bytes, or a part's `body(n)`."""
        await self.call("put", rel, body=body)

    async def put_new(self, rel: str, body: bytes) -> bool:
        """Target.put_new: False when another object holds `rel`."""
        return await self.call("put_new", rel, body=body)

    async def delete(self, rels: list[str]) -> None:
        await self.call("delete", rels)

    async def segment_key(self, body, layout: list) -> str:
        """segments.key_from_bytes of a part's `body(n)`, in the process (BLAKE3 there, not here)."""
        return await self.call("segment_key", layout, body=body)

    async def manifest(self, generation: int) -> Manifest:
        return Manifest.decode(await self.call("manifest", generation), manifest_name(generation))

    async def call(self, name: str, *args, body=None):
        """Target.`name`(*args[, body]) in the uploader process; its result, or the exception it raised
        (S3Error, BadManifest), or S3Error(UPLOADER) when the process failed."""
        proc = await self._running()
        await proc.ready.wait()
        if proc.gone is not None:
            raise S3Error(UPLOADER, proc.gone)
        id = next(self._ids)
        msg = {"op": "call", "name": name, "args": list(args)}
        blob = b""
        if isinstance(body, (bytes, bytearray)):
            msg["body"], blob = wire.BLOB, body
        elif body is not None:
            msg["body"] = body
        call = _Call()
        if not proc.calls:
            proc.heard = trio.current_time()  # the silence that counts starts now
        proc.calls[id] = call
        try:
            try:
                await self._send(proc, msg, id, blob, region=None if body is None or blob else body[0])
            except OSError as e:
                raise S3Error(UPLOADER, f"the uploader process (pid {proc.proc.pid}) is gone ({e})") from None
            await call.done.wait()
        finally:
            proc.calls.pop(id, None)
        if call.error is not None:
            raise call.error
        self._backoff = BACKOFF_MIN  # it works (again)
        return call.result

    async def _send(self, proc: _Process, msg: dict, id: int = 0, blob: bytes = b"", region: int | None = None):
        async with proc.send_lock:
            for r in proc.mapped - self.parts.regions.keys():
                await _send_all(proc.sock, wire.frame({"op": "unmap", "region": r}))
                proc.mapped.discard(r)
            if region is not None and region not in proc.mapped:
                reg = self.parts.regions[region]
                data = wire.frame({"op": "map", "region": region, "size": reg.size})
                fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [reg.fd]))]
                sent = await proc.sock.sendmsg([data], fds)  # the fd goes with the frame's first bytes
                await _send_all(proc.sock, data[sent:])
                proc.mapped.add(region)
            await _send_all(proc.sock, wire.frame(msg, id, blob))

    # ---- the process -------------------------------------------------------------------
    async def _running(self) -> _Process:
        """The live process, started now if there is none (after the backoff of the last start)."""
        async with self._start_lock:
            proc = self.process
            if proc is not None and proc.gone is None:
                return proc
            await trio.sleep_until(self._next_start)
            if self._nursery is None or self.stopping:
                raise S3Error(UPLOADER, "the uploader process is stopped (unmounting)")
            self._next_start = trio.current_time() + self._backoff
            self._backoff = min(2 * self._backoff, BACKOFF_MAX)
            self.process = proc = self._spawn()
            self.starts += 1
            self._nursery.start_soon(self._serve, proc)
            return proc

    def _spawn(self) -> _Process:
        """Start a process. In the trio thread on purpose: PR_SET_PDEATHSIG follows the thread that
        forked, and a worker thread of trio's exits when idle."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [sys.executable, "-m", "ckptfs.replicate.uploader", "--socket", str(theirs.fileno()),
               "--parent", str(os.getpid()), "--url", str(self.url), "--connections", str(self.connections),
               "--priority", self.priority]
        if self.endpoint:
            cmd += ["--endpoint", self.endpoint]
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        except OSError as e:
            ours.close()
            raise S3Error(UPLOADER, f"cannot start the uploader process: {e}") from None
        finally:
            theirs.close()
        return _Process(proc, trio.socket.from_stdlib_socket(ours))

    async def _serve(self, proc: _Process) -> None:
        """Read its answers and watch it until it is gone; then fail what waits, and reap it."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch, proc)
                await self._read(proc)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._bury(proc)

    async def _read(self, proc: _Process) -> None:
        decoder = wire.Decoder()
        while True:
            try:
                data = await proc.sock.recv(1 << 16)
                frames = decoder.feed(data)
            except OSError:  # ECONNRESET: it died with our frames unread
                return
            except wire.WireError as e:
                log.warning("replicate.uploader_garbled", extra={"fields": {"pid": proc.proc.pid, "error": str(e)}})
                _kill(proc.proc)
                return
            if not data:
                return
            proc.heard = trio.current_time()
            for id, msg, blob in frames:
                if "ok" in msg or "error" in msg:
                    call = proc.calls.get(id)
                    if call is not None:
                        if "error" in msg:
                            call.error = wire.exception(msg["error"])
                        else:
                            call.result = blob if msg["ok"] == wire.BLOB else msg["ok"]
                        call.done.set()
                elif "ready" in msg:
                    proc.info = msg["ready"]
                    proc.ready.set()
                    log.info("replicate.uploader_started", extra={"fields": {
                        "pid": proc.proc.pid, "priority": self.priority, "starts": self.starts}})
                elif "fatal" in msg:
                    proc.fatal = str(msg["fatal"])

    async def _watch(self, proc: _Process) -> None:
        """Ping while calls wait (or it starts); SIGKILL when it stays silent for `hang_timeout` s."""
        while True:
            await trio.sleep(PING_EVERY)
            if not proc.calls and proc.ready.is_set():
                continue
            if trio.current_time() - proc.heard > self.hang_timeout:
                cpu = cpu_seconds(proc.proc.pid)
                if cpu is not None and cpu > proc.cpu:  # starved, not hung: another period
                    proc.cpu, proc.heard = cpu, trio.current_time()
                    continue
                proc.hung = True
                _kill(proc.proc)
                return
            if proc.ready.is_set():
                try:
                    await self._send(proc, {"op": "ping"})
                except OSError:
                    return

    async def _bury(self, proc: _Process) -> None:
        """It is gone (or must go): say why to every call in flight, close, reap within STOP_WAIT s."""
        pid = proc.proc.pid
        proc.sock.close()  # end of file for it: it exits
        status, cpu = await _reap(proc)
        self.cpu_exited += cpu
        if proc.fatal is not None:
            why = f"the uploader process could not start: {proc.fatal}"
        elif proc.hung:
            why = f"the uploader process (pid {pid}) did not answer for {self.hang_timeout:.0f} s: killed"
        elif status is None:
            why = f"the uploader process (pid {pid}) closed its socket: killed"
        elif status < 0:
            why = f"the uploader process (pid {pid}) was killed by {signal.Signals(-status).name}"
        else:
            why = f"the uploader process (pid {pid}) exited with status {status}"
        if proc.info is None and proc.fatal is None and not proc.hung:
            why += " before it was ready"
        proc.gone = why
        self.last_exit = why
        if not proc.calls and proc.info is not None and not self.stopping:
            # nobody waits to report it (a failing call is reported by the replicator)
            log.warning("replicate.uploader_gone", extra={"fields": {"reason": why, "restart": "on the next call"}})
        for call in proc.calls.values():
            call.error = S3Error(UPLOADER, why)
            call.done.set()
        proc.ready.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The service the process's tasks run in; when it ends, the process ends (within STOP_WAIT s)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                try:
                    await trio.sleep_forever()
                finally:
                    self.stopping = True  # the processes' tasks are cancelled now: they end theirs
        finally:
            self._nursery = None

    def statistics(self) -> "UploaderStats":
        proc = self.process
        live = proc is not None and proc.gone is None
        return UploaderStats(proc.proc.pid if live else None, self.priority, bool(live and proc.info is not None),
                             len(proc.calls) if live else 0, self.starts, max(0, self.starts - 1), self.last_exit,
                             round(self.cpu_exited + ((cpu_seconds(proc.proc.pid) or 0.0) if live else 0.0), 3))


@dataclass(frozen=True)
class UploaderStats:
    """One reading of the uploader process (`Uploader.statistics()`)."""
    pid: int | None  # None: not running
    priority: str
    running: bool
    calls: int  # calls in flight
    starts: int
    restarts: int
    last_exit: str | None
    cpu_s: float  # CPU seconds of every uploader process so far


async def _send_all(sock, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[await sock.send(view):]


def _kill(proc: subprocess.Popen) -> None:
    try:
        proc.kill()
    except ProcessLookupError:
        pass


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (a zombie's too); None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


async def _reap(proc: _Process) -> tuple[int | None, float]:
    """Its exit status (None: it had not exited within STOP_WAIT s and was killed) and CPU seconds.
    Waits at most STOP_WAIT + REAP_WAIT s (a process stuck in the kernel is left a zombie)."""
    status = None
    with trio.move_on_after(STOP_WAIT):
        await trio.lowlevel.wait_readable(proc.pidfd)
        status = proc.proc.returncode if proc.proc.returncode is not None else _status(proc)
    if status is None:
        _kill(proc.proc)
    cpu = 0.0
    with trio.move_on_after(REAP_WAIT):
        await trio.lowlevel.wait_readable(proc.pidfd)
        cpu = cpu_seconds(proc.proc.pid) or 0.0  # a zombie keeps its times until reaped
        proc.proc.wait()
    os.close(proc.pidfd)
    return status, cpu


def _status(proc: _Process) -> int | None:
    """The exit status of an exited process, read without reaping it (waitid WNOWAIT)."""
    res = os.waitid(os.P_PIDFD, proc.pidfd, os.WEXITED | os.WNOWAIT | os.WNOHANG)
    if res is None:
        return None
    return -res.si_status if res.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else res.si_status
