"""The native front end: a kernel session (fuse/kernel/) whose requests run on the trio thread.

Threads. The session's N worker threads read requests from /dev/fuse
(readv into each worker's own header and payload buffers), parse them, and
write the replies (writev): those parts run in parallel. The core, the store
and the facade are not thread-safe and live in the daemon's trio loop, so
`TrioHandler` carries every request there: the worker calls
``trio.from_thread.run(op, req, trio_token=token)`` and blocks until the
operation (native_ops.Operations) has run on the trio thread, then sends its
reply. A WRITE's payload stays in the worker's buffer until then; the core's
write copies it into the arena, as with pyfuse3. So the filesystem itself is
serialized, one request at a time on the trio thread, exactly as with
pyfuse3; what runs in parallel is the kernel's copies, the system calls and
the parsing. Writing payloads straight into arena slots without a lock
(`Session(write_buffer=...)`) is the next step (docs/ENGINE.md).

Interrupts: a request the kernel interrupts while it waits for durability
(FSYNC, FSYNCDIR, SYNCFS) is cancelled on the trio side and answers EINTR;
other requests run to the end (a WRITE waiting for memory keeps waiting, as
with pyfuse3).

`NativeEngine` mounts and starts the session (blocking calls: the daemon runs
them in a thread), waits for it to end (unmounted), and unmounts.
"""
from __future__ import annotations

import errno
import logging
import os

import trio

from ..errors import FsError, errno_of
from ..fs.facade import AsyncFilesystem
from .kernel.session import Session, default_threads
from .native_ops import WANT, Operations

log = logging.getLogger("ckptfs.fuse.native")

# Requests that wait for the devices: an INTERRUPT from the kernel cancels them (EINTR).
INTERRUPTIBLE = frozenset({"fsync", "fsyncdir", "syncfs"})


class TrioHandler:
    """The session's handler: each method runs the same-named coroutine of `ops` on the trio thread."""

    def __init__(self, ops: Operations, token):
        self.ops = ops
        self.token = token
        self.session: Session | None = None
        self._scopes: dict[int, trio.CancelScope] = {}  # unique -> scope, interruptible requests in flight

    def __getattr__(self, name: str):
        op = getattr(type(self.ops), name, None) if not name.startswith("_") else None
        if op is None:
            raise AttributeError(name)
        op = getattr(self.ops, name)
        if name in INTERRUPTIBLE:
            return lambda req: trio.from_thread.run(self._interruptible, op, req, trio_token=self.token)
        return lambda req: trio.from_thread.run(self._run, op, req, trio_token=self.token)

    def syncfs(self, req) -> None:
        log.info("syncfs", extra={"fields": {"pid": req.header.pid}})
        return trio.from_thread.run(self._interruptible, self.ops.syncfs, req, trio_token=self.token)

    def interrupt(self, target: int) -> None:
        trio.from_thread.run_sync(self._cancel, target, trio_token=self.token)

    # ---- on the trio thread ----------------------------------------------------------------
    @staticmethod
    async def _run(op, req):
        try:
            return await op(req)
        except FsError:
            raise
        except Exception as exc:  # noqa: BLE001 - the errno decision is errors.py's, as for pyfuse3
            raise FsError(errno=errno_of(exc, req.method)) from None

    async def _interruptible(self, op, req):
        with trio.CancelScope() as scope:
            self._scopes[req.unique] = scope
            try:
                if self.session is not None and self.session.interrupted(req.unique):
                    scope.cancel()
                return await self._run(op, req)
            finally:
                del self._scopes[req.unique]
        raise FsError("interrupted", errno=errno.EINTR)

    def _cancel(self, target: int) -> None:
        scope = self._scopes.get(target)
        if scope is not None:
            scope.cancel()


class NativeEngine:
    """Mount `afs` at `mountpoint` through the kernel session, served on the trio thread of `token`."""

    def __init__(self, afs: AsyncFilesystem, mountpoint: str, token, *, threads: int | None = None):
        self.handler = TrioHandler(Operations(afs), token)
        root = os.geteuid() == 0
        self.session = Session(self.handler, mountpoint, threads=threads or default_threads(),
                               allow_other=root, default_permissions=True, want=WANT,
                               max_write=afs.fs.arena.chunk_size)
        self.handler.session = self.session

    def start(self) -> None:
        """Mount and answer INIT (blocking: run it in a thread). On failure nothing stays mounted."""
        self.session.mount()
        try:
            neg = self.session.start()
        except BaseException:
            try:
                self.session.unmount(lazy=True)
            except OSError:
                pass
            self.session.close(timeout=5)
            raise
        log.info("engine.native", extra={"fields": {"threads": self.session.threads, "max_write": neg.max_write,
                                                    "max_pages": neg.max_pages, "minor": neg.minor}})

    def wait(self) -> None:
        """Block until every worker has exited: the kernel unmounted or aborted the connection."""
        self.session.wait()

    def unmount(self) -> None:
        """Lazily unmount (after a signal, when fusermount3 -u -z failed)."""
        self.session.unmount(lazy=True)

    def close(self) -> None:
        self.session.close()

    def statistics(self) -> dict[str, int]:
        return self.session.statistics()
