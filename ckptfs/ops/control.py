"""The control channel: a Unix socket through which `ckptfs status` and `ckptfs wait` talk to the daemon.

Where: ``/run/ckptfs/<hash>.sock`` for a daemon run by root, else
``$XDG_RUNTIME_DIR/ckptfs/<hash>.sock`` (or ``/tmp/ckptfs-<uid>/``), where
<hash> is derived from the mountpoint; ``$CKPTFS_RUN_DIR`` overrides the
folder. The daemon tells clients the path through the virtual xattr
``user.ckptfs.control`` on the mount's root.

Who: only the user who mounted (the daemon's uid) and root. Two locks:
the folder is 0700 and the socket 0600, both owned by the daemon's user, so
anyone else's connect() fails with EACCES; and each accepted connection's
peer credentials (SO_PEERCRED, from the kernel, not from the client) are
checked again, so a socket made reachable by mistake (a chmod, a bind mount
into a container) still refuses strangers: one error line, then close.

Why a socket rather than a hidden control folder inside the mount: it works
when the mount is busy or wedged (no FUSE round trip, and clients time out),
it streams progress naturally, its access check comes from the kernel, and
it adds nothing to the mount that `ls -a`, backup tools or training code
could trip over.

Protocol: newline-delimited JSON. Each request is one object with an
"op"; replies are objects with "ok" (and "error" when false):

    {"op": "ping"}                      -> {"ok": true, "pid": ...}
    {"op": "lag"}                       -> {"ok": true, "lag": seconds, "max_lag": ...}: how long
        the oldest record not yet in the journal has waited (cheap: for benchmarks and probes)
    {"op": "status", "window": 2, "limit": null}
                                        -> {"ok": true, "status": {...}} (see status.py)
    {"op": "wait", "inos": [5, 9] | null, "interval": 0.25}
        makes those files (null: everything) durable, as fsync would, and
        streams {"event": "progress", ...} lines until one final
        {"event": "done", "ok": true|false, "error": ..., "failed": [...]}.
        Closing the connection abandons the wait (that is how a client's
        --timeout ends it). An ino that is a directory stands for every file
        below it. With "replicated": true, once durable it goes on waiting
        until they are named in a standing manifest of the object store
        (--replicate), streaming {"event": "progress", "phase": "replicating",
        ...} with the replication's current failure, if any.

A connection may carry several requests, one after another.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import socket
import stat
import struct
import time

import trio

from . import status as status_mod
from ..errors import FsError

log = logging.getLogger("ckptfs.control")


def plain(stats):
    """A `statistics()` reading (a frozen dataclass) as the JSON status shows it; other values as they are."""
    return dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else stats

MAX_LINE = 1 << 20
XATTR = "user.ckptfs.control"


# ---- where the socket lives -------------------------------------------------------
def run_dir(uid: int | None = None) -> str:
    uid = os.getuid() if uid is None else uid
    override = os.environ.get("CKPTFS_RUN_DIR")
    if override:
        return override
    if uid == 0:
        return "/run/ckptfs"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "ckptfs")
    return f"/tmp/ckptfs-{uid}"


def socket_path(mountpoint: str, directory: str | None = None) -> str:
    key = hashlib.sha256(os.path.realpath(mountpoint).encode()).hexdigest()[:16]
    return os.path.join(directory or run_dir(), key + ".sock")


def _private_dir(path: str) -> None:
    """Create `path` (0700, ours) or check that an existing one is ours and private."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"cannot create the control folder {path}: {e.strerror}") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, f"the control folder {path} is not a folder")
    if st.st_uid != os.getuid():
        raise OSError(errno.EPERM, f"the control folder {path} belongs to uid {st.st_uid}, not to us")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)


def peer_uid(sock) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def allowed(uid: int, owner: int) -> bool:
    return uid == owner or uid == 0


# ---- the server (in the daemon's trio loop) ---------------------------------------
class ControlServer:
    """The daemon's end of the control channel: its socket at `path`, answering from the store,
    the monitor and the replicator; the daemon fills `info` and `sections` as it mounts."""

    def __init__(self, path: str, store, monitor, *, info: dict | None = None, sections: dict | None = None,
                 replicator=None):
        self.path = path
        self.store = store
        self.monitor = monitor
        self.replicator = replicator  # replicate.replicator.Replicator, or None
        self.info = dict(info or {})
        self.sections = dict(sections or {})  # name -> callable() giving that part of the status (e.g. restore)
        self.owner = os.getuid()
        self._sock = None
        self._ino = None

    async def bind(self) -> None:
        """Create the socket file (0600) now, so a bad folder fails the mount with one clear line."""
        _private_dir(os.path.dirname(self.path))
        try:
            os.unlink(self.path)  # left by a daemon that was killed; the folder is ours
        except FileNotFoundError:
            pass
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            await sock.bind(self.path)
        except OSError as e:
            sock.close()
            raise OSError(e.errno, f"cannot create the control socket {self.path}: {e.strerror}") from None
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self._ino = os.stat(self.path).st_ino
        sock.listen(64)
        self._sock = sock
        log.info("control.listening", extra={"fields": {"socket": self.path}})

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        if self._sock is None:
            await self.bind()
        listener = trio.SocketListener(self._sock)
        try:
            await trio.serve_listeners(self._handle, [listener], task_status=task_status)
        finally:
            self.close()

    def close(self) -> None:
        try:
            if self._ino is not None and os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except OSError:
            pass
        self._ino = None

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            uid = peer_uid(stream.socket)
        except OSError:
            uid = -1
        try:
            reader = _LineReader(stream)
            if not allowed(uid, self.owner):
                log.warning("control.refused", extra={"fields": {"uid": uid, "owner": self.owner}})
                with trio.move_on_after(2):  # take the request first, so the client can read the answer
                    await reader.readline()
                await _send(stream, {"ok": False, "error": f"permission denied: the control channel is only "
                                                          f"for uid {self.owner} (who mounted) and root"})
                return
            while True:
                line = await reader.readline()
                if line is None:
                    return
                try:
                    req = json.loads(line)
                    if not isinstance(req, dict):
                        raise ValueError("a request is a JSON object")
                except ValueError as e:
                    await _send(stream, {"ok": False, "error": f"bad request: {e}"})
                    return
                await self._dispatch(stream, req)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            return  # the client went away
        except Exception:  # noqa: BLE001 - one bad request must not take the daemon down
            log.exception("control request failed")
        finally:
            await stream.aclose()

    async def _dispatch(self, stream, req: dict) -> None:
        op = req.get("op")
        if op == "ping":
            await _send(stream, {"ok": True, "pid": os.getpid()})
        elif op == "lag":
            await _send(stream, {"ok": True, "lag": self.store.lag(), "max_lag": self.store.max_lag})
        elif op == "status":
            limit = req.get("limit")
            limit = limit if isinstance(limit, int) and limit >= 0 else None
            await _send(stream, {"ok": True, "status": self.status(window=float(req.get("window", 2.0)),
                                                                   limit=limit)})
        elif op == "wait":
            inos = req.get("inos")
            if inos is not None and not (isinstance(inos, list) and all(isinstance(i, int) for i in inos)):
                await _send(stream, {"ok": False, "error": "bad request: inos must be a list of integers or null"})
                return
            replicated = bool(req.get("replicated"))
            if replicated and self.replicator is None:
                await _send(stream, {"ok": False, "error": "this mount does not replicate (mount it with --replicate)"})
                return
            await self._wait(stream, inos, float(req.get("interval", 0.25)), replicated)
        else:
            await _send(stream, {"ok": False, "error": f"unknown op {op!r}"})

    def status(self, *, window: float = 2.0, limit: int | None = None) -> dict:
        info = dict(self.info, pid=os.getpid(), control=self.path, time=time.time())
        info.update({name: plain(fn()) for name, fn in self.sections.items()})
        replication = plain(self.replicator.statistics()) if self.replicator is not None else None
        return status_mod.snapshot(self.store, self.monitor, window=window, limit=limit, info=info,
                                   replication=replication)

    # ---- wait ---------------------------------------------------------------
    def _expand(self, inos: list[int]) -> list[int]:
        ns = self.store.ns
        out: list[int] = []
        for ino in inos:
            inode = ns.inodes.get(ino)
            if inode is not None and inode.dir is not None:
                states = status_mod.file_states(self.store)
                out.extend(i for i in status_mod.files_under(ns, ino) if i in states and i != ino)
            else:
                out.append(ino)
        return list(dict.fromkeys(out))

    async def _wait(self, stream, inos: list[int] | None, interval: float, replicated: bool = False) -> None:
        store = self.store
        targets = None if inos is None else self._expand(inos)
        if replicated and inos is not None:  # files below a folder: also those durable already
            targets = self._expand_all(inos)
        tracker = WaitProgress(store, targets, self.monitor)
        failures: list[dict] = []
        done = trio.Event()

        async def sync_one(ino: int | None) -> None:
            try:
                await store.sync(ino)
            except FsError as e:
                failures.append(self._failure(ino, e))

        async def sync_all() -> None:
            try:
                async with trio.open_nursery() as n:
                    if targets is None:
                        n.start_soon(sync_one, None)
                    else:
                        for ino in targets:
                            n.start_soon(sync_one, ino)
            finally:
                done.set()

        gone = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync_all)
            try:
                while not done.is_set():
                    await _send(stream, tracker.progress())
                    with trio.move_on_after(interval):
                        await done.wait()
            except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
                gone = True  # the client gave up (its --timeout): abandon the wait
            nursery.cancel_scope.cancel()
        if gone:
            return
        if replicated and not failures:
            if not await self._wait_replicated(stream, targets, interval):
                return
            if self.replicator.conflict is not None:
                failures.append({"ino": None, "path": None, "errno": "EIO",
                                 "error": f"not replicated: {self.replicator.conflict}"})
        final = tracker.progress()
        final.update(event="done", ok=not failures, failed=failures)
        if failures:
            final["error"] = "; ".join(f["error"] for f in failures)
            log.warning("wait.failed", extra={"fields": {"error": final["error"]}})
        await _send(stream, final)

    def _expand_all(self, inos: list[int]) -> list[int]:
        """`inos` with each folder replaced by every file and folder below it."""
        out: list[int] = []
        for ino in inos:
            inode = self.store.ns.inodes.get(ino)
            out.extend(status_mod.files_under(self.store.ns, ino) if inode is not None and inode.dir is not None
                       else [ino])
        return list(dict.fromkeys(out))

    async def _wait_replicated(self, stream, targets: list[int] | None, interval: float) -> bool:
        """After the durable phase: stream progress until the targets (None: everything durable now)
        stand in a manifest; False when the client went away."""
        rep = self.replicator
        seq = self.store.committer.seq
        done = trio.Event()

        async def wait() -> None:
            if targets is None:
                await rep.wait_covered(seq)
            else:
                await rep.wait_files(targets)
            done.set()

        def progress() -> dict:
            n = len(targets) if targets is not None else 1
            k = (sum(1 for i in targets if rep.replicated(i)) if targets is not None
                 else int(rep.covered_seq >= seq))
            st = rep.statistics()
            failing = st.failing
            return {"event": "progress", "phase": "replicating", "files": n, "durable": k, "bytes": 0, "done": 0,
                    "replicated": k, "lag": st.lag, "bytes_uploaded": st.bytes_uploaded,
                    "failing": [],
                    "last_error": f"replication failing ({failing['cause']}): {failing['message']}" if failing else None}

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            try:
                while not done.is_set():
                    await _send(stream, progress())
                    with trio.move_on_after(interval):
                        await done.wait()
            except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
                nursery.cancel_scope.cancel()
                return False
        return True

    def _failure(self, ino: int | None, e: FsError) -> dict:
        path = None
        if ino is not None:
            path = status_mod.paths_of(self.store.ns, [ino]).get(ino)
        name = errno.errorcode.get(e.errno, str(e.errno))
        detail = self.store.last_error or str(e)
        what = path or ("inode %d" % ino if ino is not None else "the mount")
        return {"ino": ino, "path": path, "errno": name,
                "error": f"{what}: drain failed with {name} ({os.strerror(e.errno)}): {detail}"}


class WaitProgress:
    """Progress of a wait, by bytes, over the files that were not durable when it began."""

    def __init__(self, store, targets: list[int] | None, monitor):
        self.store = store
        self.monitor = monitor
        states = status_mod.file_states(store)
        if targets is None:
            targets = list(states)
        self.targets = targets
        self.total: dict[int, int] = {}
        self.started = time.monotonic()
        self._update(states)

    def _update(self, states) -> tuple[int, int, int]:
        done_bytes = durable = 0
        for ino in self.targets:
            st = states.get(ino)
            if st is None:  # durable now
                durable += 1
                done_bytes += self.total.get(ino, 0)
            else:
                self.total[ino] = max(self.total.get(ino, 0), st.bytes)
                done_bytes += min(st.drained, self.total[ino])
        return done_bytes, durable, sum(self.total.values())

    def progress(self) -> dict:
        states = status_mod.file_states(self.store)
        done_bytes, durable, total = self._update(states)
        rates = self.monitor.rates()
        left = total - done_bytes
        eta = 0.0 if left <= 0 else (left / rates.drain_bps if rates.drain_bps > 0 else None)
        failing = [{"ino": i, "errno": errno.errorcode.get(states[i].errno, str(states[i].errno))}
                   for i in self.targets
                   if i in states and states[i].state == status_mod.FAILED]
        return {"event": "progress", "files": len(self.targets), "durable": durable, "bytes": total,
                "done": done_bytes, "drain_bps": rates.drain_bps, "eta_seconds": eta,
                "elapsed": round(time.monotonic() - self.started, 3), "failing": failing,
                "last_error": self.store.last_error}


class _LineReader:
    def __init__(self, stream):
        self.stream = stream
        self.buf = bytearray()

    async def readline(self) -> bytes | None:
        while b"\n" not in self.buf:
            if len(self.buf) > MAX_LINE:
                raise ValueError("request too long")
            data = await self.stream.receive_some(65536)
            if not data:
                return None
            self.buf += data
        i = self.buf.index(b"\n")
        line = bytes(self.buf[:i])
        del self.buf[:i + 1]
        return line


async def _send(stream, obj: dict) -> None:
    await stream.send_all(json.dumps(obj, separators=(",", ":")).encode() + b"\n")


# ---- the client (blocking; the CLI and ckptfs.api) -----------------------------------
class ControlError(Exception):
    """The control channel could not be used; the message says why, in one line."""


class ControlPermissionError(ControlError):
    """This user may not use the control channel (only the user who mounted and root may)."""


def refusal(reply: dict) -> ControlError:
    """The error for a reply with "ok": false."""
    msg = reply.get("error", "the daemon refused the request")
    return (ControlPermissionError if msg.startswith("permission denied") else ControlError)(msg)


class Client:
    """One blocking connection to a daemon's control socket at `path`: requests out, reply lines in
    (`ckptfs status`, `ckptfs wait`)."""

    def __init__(self, path: str, timeout: float | None = 30.0):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except PermissionError:
            self.sock.close()
            raise ControlPermissionError(f"permission denied: the control socket {path} is only for the user who "
                               f"mounted and root") from None
        except (FileNotFoundError, ConnectionRefusedError):
            self.sock.close()
            raise ControlError(f"the daemon does not answer at {path} (not running?)") from None
        except OSError as e:
            self.sock.close()
            raise ControlError(f"cannot connect to {path}: {e.strerror or e}") from None
        self._buf = bytearray()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send(self, obj: dict) -> None:
        try:
            self.sock.sendall(json.dumps(obj).encode() + b"\n")
        except OSError as e:
            try:  # the daemon may have answered (a refusal) before closing
                reply = self.receive(timeout=1)
            except (OSError, ControlError, ValueError):
                reply = None
            if reply is not None and not reply.get("ok", True):
                raise refusal(reply) from None
            raise ControlError(f"lost the daemon at {self.path}: {e.strerror or e}") from None

    def receive(self, timeout: float | None = None) -> dict:
        """The next reply line; socket.timeout (TimeoutError) when `timeout` passes first."""
        if timeout is not None:
            self.sock.settimeout(max(0.001, timeout))
        while b"\n" not in self._buf:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                raise
            except OSError as e:
                raise ControlError(f"lost the daemon at {self.path}: {e.strerror or e}") from None
            if not data:
                raise ControlError(f"the daemon closed the control channel at {self.path}")
            self._buf += data
        i = self._buf.index(b"\n")
        line = bytes(self._buf[:i])
        del self._buf[:i + 1]
        return json.loads(line)

    def request(self, obj: dict) -> dict:
        self.send(obj)
        reply = self.receive()
        if not reply.get("ok", False):
            raise refusal(reply)
        return reply


def control_path(mountpoint: str) -> str:
    """The daemon's socket, as its mount root tells it."""
    try:
        return os.fsdecode(os.getxattr(mountpoint, XATTR))
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise ControlError(f"{mountpoint}: the daemon is gone (stale mount; run ckptfs umount)") from None
        raise ControlError(f"{mountpoint} is not a ckptfs mount (no {XATTR}: {e.strerror})") from None


def mountpoint_of(path: str) -> str:
    """The mountpoint holding `path` (the nearest mount at or above it)."""
    p = os.path.realpath(path)
    while not os.path.ismount(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p
