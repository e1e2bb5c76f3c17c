"""The native front end: a kernel session (fuse/kernel/) serving ckptfs from its worker threads.

Threads. The session's N worker threads read requests from /dev/fuse, parse
them, and write the replies (os.readv / os.writev, GIL released): those parts
run in parallel. The core, the store and the namespace are not thread-safe
and belong to the daemon's trio thread; they share one lock with it,
`tasks.LoopLock`: the trio thread holds it whenever it runs and lets go only
while it sleeps in its I/O wait. `TrioHandler` serves a request that needs
no wait right in the worker thread, holding that lock: the synchronous
method of native_ops.Operations (lookup, getattr, setattr, create, open,
release, write into memory, read of data in memory, readdir, xattrs,
statfs...). So the core sees one request at a time, exactly as when every
request ran on the trio thread, and its invariants hold by construction; only
the hop to the trio thread and back is gone. A request that must wait
(memory full, data only on a device) raises `Blocked`; the worker lets go of
the lock and awaits the continuation on the trio thread
(``trio.from_thread.run``, never while holding the lock), as every request
did before. FSYNC, FSYNCDIR and SYNCFS always go there. A worker waits with
its request; when that leaves no worker reading, the session starts a spare
one (`Session.waiting`): writers held back by a full arena, or fsyncs
waiting for a slow drain, never freeze the rest of the mount (a stat, an ls,
a read of cached data, the INTERRUPT of a killed writer). What the fast path
does that would wake trio tasks (the drain's queues, the committer, waiters)
the store routes through `LoopLock.soon` (run_sync_soon).

Order. Workers read requests in the kernel's order but could reach the core
in another; each request takes its turn (`session.order`, kernel/order.py)
before the lock, and says done when it leaves the lock or hops to the trio
thread, so the core applies requests in the kernel's order, as a single
reader would (a RELEASE, which the kernel sends after close() returned, is
never overtaken by the same file's next OPEN or RENAME: ckptfs commits a
file at its RELEASE).

Zero copy. Requests are up to `request_chunks` chunks (max_write, 16 MiB
with 1 MiB chunks, where the kernel's max_pages limit allows; one chunk
otherwise). `write_buffer` (the session's hook, before each read) hands each
worker a run of that many free arena slots, lent (`AsyncFilesystem.lend_slot`,
counted as used memory, and only while more than `keep_free` slots are free,
clean chunks evicted to keep them so (`Store.make_free`);
a position with no slot is a chunk-sized part of the worker's own buffer),
and the read scatters the payload over them, one chunk per slot. Each piece
of a WRITE that is one whole chunk at a chunk boundary adopts its slot as
that chunk's memory: the kernel's copy is the only one, and the worker is
lent a fresh slot for that position next time. A writer off the chunk grid
(requests r bytes past a boundary) is read into shifted runs, the first
buffer slot[r:]: its first piece, the rest of a chunk whose first r bytes
the previous request wrote, adopts its slot too once those r bytes are
copied into it (`FileData.adopt`, `at`); only the last piece (r bytes) is
copied. Other pieces are copied under the lock and their slots stay lent to
the worker. A READ's reply is made of
views of the arena slots, pinned (`Chunk.readers`: not freed, evicted or
written in place) until the reply is written, then released under the lock.

Interrupts: a request that waits on the trio thread (a WRITE for memory, a
READ for a fetch, an FSYNC, FSYNCDIR or SYNCFS for the devices) is not cut
short by a signal, as a write or fsync on an ext4 file is not: torch.save's
writer, fwrite, Rust's `sync_all` and most programs do not expect EINTR from
a regular file, and the kernel interrupts on every signal the caller handles
(a DataLoader's SIGCHLD). But once interrupted it watches its caller: when
the caller is being killed (SIGKILL pending, or gone: `creds.being_killed`)
it gives up with EINTR, so a trainer stuck behind a stalled drain dies at
kill -9 instead of hanging in D state until memory frees or the devices
answer (`_killable`; the bytes it wrote so far stay written, as for any
killed writer). pyfuse3 has no such path: there every request runs to the
end.

`NativeEngine` mounts and starts the session (blocking calls: the daemon runs
them in a thread), waits for it to end (unmounted), and unmounts.
"""
from __future__ import annotations

import dataclasses
import errno
import inspect
import logging
import os
import threading
from dataclasses import dataclass

import trio

from ..errors import FsError, errno_of
from ..fs.creds import being_killed
from ..fs.facade import AsyncFilesystem
from . import realign
from .kernel.session import Session, SessionConfig, SessionHooks, SessionStats, default_threads
from ..tasks import LockStats, LoopLock
from .native_ops import WANT, Blocked, Operations

log = logging.getLogger("ckptfs.fuse.native")

# Requests that wait for the devices, on the trio thread (given up only when the caller is killed).
WAIT_FOR_DEVICES = frozenset({"fsync", "fsyncdir", "syncfs"})
# Bytes per WRITE request (max_write), a whole number of chunks, each read into its own lent slot:
# every request costs the same Python whatever its size, so fewer, larger requests cost less lock
# time per GiB (docs/ENGINE.md). Fewer chunks where the arena is small (`request_chunks`).
REQUEST_BYTES = 16 << 20
READ_BYTES = 16 << 20  # direct READs up to this (max_pages): a sync read() is one request at a time


def chunks_in(nbytes: int, chunk_size: int) -> int:
    """Whole chunks in `nbytes` (at least one)."""
    return max(1, nbytes // chunk_size)
KILL_POLL = 0.1  # s: how often an interrupted request that waits looks whether its caller is being killed


def request_chunks(nslots: int, threads: int, most: int) -> int:
    """Chunks per request for an arena of `nslots`: at most a quarter of the slots lent to the workers."""
    return max(1, min(most, nslots // (4 * threads)))


class TrioHandler:
    """The session's handler: each method runs the same-named operation of `ops`.

    A synchronous operation runs in the worker thread under `loop` (when one is given,
    installed on the trio thread); a coroutine, or the continuation of a `Blocked` one, on
    the trio thread of `token`."""

    def __init__(self, ops, token, loop: LoopLock | None = None, *, keep_free: int = 0):
        self.ops = ops
        self.token = token
        self.loop = loop
        self.keep_free = keep_free  # arena slots never lent as receive buffers
        self.session: Session | None = None
        self._waiting: dict[int, list] = {}  # unique -> [scope, caller pid, watched], requests waiting on trio
        self.killed = 0  # requests given up because their caller was being killed
        # per worker: .run, the arena slot lent for each chunk-sized position of its payload (or None);
        # .bufs, their buffers; .own, its own buffer for positions with no slot; .reading, the run
        # its last read used (None: the session's own buffer)
        self._local = threading.local()
        self._lent: set[int] = set()  # every slot lent to a worker (returned by close())
        self.adopted = 0  # WRITE pieces (chunks) whose lent slot became the chunk's memory (no copy)
        self.copied = 0  # WRITE pieces copied into their chunks (not one whole chunk, or no slot lent)
        # Writers off the chunk grid: the kernel cuts a large write() into requests of max_write from
        # its start, so they all end r bytes past a chunk boundary, and a sequential writer's next
        # write() starts where the last ended. Once a request ended r past a boundary, the next
        # reads shift their run by r (first buffer slot[r:]), so the pieces after the first are whole
        # chunks on the grid again, adopted, and the first, the rest of a chunk from r, is adopted
        # once the chunk's first r bytes are copied into its slot.
        self.shift = 0  # r for the next read (set by on_read, without the lock: a wrong guess only costs copies)
        self.shifted = 0  # WRITEs read into a shifted run
        self.shifted_adopted = 0  # ... whose first piece was adopted (its chunk's head copied in)
        # WRITEs read at another shift than their own, moved onto the grid by their worker before
        # they were served (fuse/realign.py), and their bytes
        self.realigned = 0
        self.realigned_bytes = 0

    def init(self, neg) -> None:
        # once, from Session.start, before any worker runs: no turn, no lock
        self.ops.init(neg)

    def __getattr__(self, name: str):
        op = getattr(type(self.ops), name, None) if not name.startswith("_") else None
        if op is None:
            raise AttributeError(name)
        op = getattr(self.ops, name)
        if name in WAIT_FOR_DEVICES:
            return lambda req: self._ordered(self._killable, op, req, waits=True)
        if inspect.iscoroutinefunction(op) or self.loop is None:
            return lambda req: self._ordered(self._run, op, req)
        return lambda req: self._serve(op, req)

    def syncfs(self, req) -> None:
        log.info("syncfs", extra={"fields": {"pid": req.header.pid}})
        return self._ordered(self._killable, self.ops.syncfs, req, waits=True)

    def interrupt(self, target: int) -> None:
        trio.from_thread.run_sync(self._cancel, target, trio_token=self.token)

    # ---- in the worker thread -------------------------------------------------------------
    def _serve(self, op, req, *args, after=None):
        """op(req, *args) under the loop lock, in the kernel's order (then `after()`, still under
        it); its continuation on the trio thread if it must wait."""
        self.loop.defer()  # wake the trio thread once the reply is out (the session's after_reply)
        try:
            self._turn(req)
            try:
                with self.loop:
                    try:
                        return op(req, *args)
                    finally:
                        if after is not None:
                            after()
            finally:
                self._done(req)  # the next request may go while this one replies, or waits
        except Blocked as b:
            self.loop.kick(now=True)
            return self._on_trio(b.afn, *b.args)
        except FsError:
            raise
        except Exception as exc:  # noqa: BLE001 - the errno decision is errors.py's, as for pyfuse3
            raise FsError(errno=errno_of(exc, req.method)) from None

    def _turn(self, req) -> None:
        if self.session is not None:
            self.session.order.turn(req.unique)

    def _done(self, req) -> None:
        if self.session is not None:
            self.session.order.done(req.unique)

    def _ordered(self, afn, op, req, waits: bool = False):
        """op's coroutine on the trio thread, started after every earlier request had its turn
        (`waits`: it may wait for long, see `_wait_on_trio`)."""
        self._turn(req)
        self._done(req)
        if waits:
            return self._wait_on_trio(afn, op, req)
        return trio.from_thread.run(afn, op, req, trio_token=self.token)

    def _on_trio(self, op, req, *args):
        return self._wait_on_trio(self._killable, op, req, *args)

    def _wait_on_trio(self, afn, *args):
        """afn(*args) on the trio thread, for a request that waits (memory, a fetch, the devices):
        meanwhile the session keeps a worker reading (a spare if need be), so that other requests,
        and the kernel's INTERRUPT of this one, are still served."""
        if self.session is None:
            return trio.from_thread.run(afn, *args, trio_token=self.token)
        with self.session.waiting():
            return trio.from_thread.run(afn, *args, trio_token=self.token)

    def worker_exit(self) -> None:
        """The session's hook, in a spare worker that leaves: give back the slots lent to it."""
        run = getattr(self._local, "run", None)
        if not run or self.loop is None:
            return
        with self.loop:
            for i, slot in enumerate(run):
                if slot is not None and slot in self._lent:
                    self._lent.discard(slot)
                    self.ops.afs.unlend_slot(slot)
                run[i] = None

    def write(self, req):
        if self.loop is None:
            return self._ordered(self._run, self.ops.write, req)
        run = getattr(self._local, "reading", None)
        if run is None:
            return self._serve(self.ops.write, req, after=lambda: self._count(len(req.pieces), 0))
        # piece i lies at the start of position i (the read filled them in order), except a shifted
        # run's first piece, r bytes into its slot; a payload read at the wrong shift is moved to
        # its own first (outside the lock, GIL released)
        shifted = self._local.shift
        moved = self._realign(req, run, shifted)
        if moved is not None:
            req, shifted = moved
        slots = run[:len(req.pieces)]
        arena = self.ops.afs.fs.arena

        def adopted() -> None:  # under the lock: once adopted, a slot may be freed and lent again
            n = 0
            for i, slot in enumerate(slots):
                if slot is not None and not arena.is_lent(slot):
                    run[i] = None
                    self._local.bufs[i] = None
                    self._local.out = None
                    self._lent.discard(slot)
                    n += 1
                    self.shifted_adopted += bool(shifted and not i)
            self._count(len(slots), n)
            self.shifted += bool(shifted)
            if moved is not None:
                self.realigned += 1
                self.realigned_bytes += req.size
        return self._serve(self.ops.write, req, slots, shifted, after=adopted)

    def _realign(self, req, run, guess: int):
        """In the worker, before the lock: `req` with its payload moved from position `guess` of
        the run it was read into to its own offset past a chunk boundary, r, and r (fuse/realign.py:
        then its pieces on the grid adopt their slots instead of being copied under the lock);
        None where the guess was right, moving would not pay, or a position the move needs is no
        lent slot of this worker's (a run short of slots reads into the worker's own memory)."""
        arena = self.ops.afs.fs.arena
        cs = arena.chunk_size
        r, size = req.offset % cs, req.size
        if r == guess or not realign.worth(r, size, cs):
            return None
        span = max(realign.slots_spanned(guess, size, cs), realign.slots_spanned(r, size, cs))
        if span > len(run) or None in run[:span] or not all(map(arena.owns, req.pieces)):
            return None
        arena.move(run, realign.moves(guess, r, size, cs))
        pieces = tuple(arena.view(run[i])[begin:end] for i, begin, end in realign.layout(r, size, cs))
        return dataclasses.replace(req, pieces=pieces), r

    def on_read(self, req) -> None:
        """The session's hook, as soon as a request is read (before it is served): the shift for
        the next reads, from where this WRITE ends. A full request: the next of its
        write() starts r past a boundary as it did; a write()'s last request (or a small
        write): a sequential writer's next write() starts where it ended."""
        if req.method == "write":
            self.shift = (req.offset + req.size) % self.ops.afs.fs.arena.chunk_size

    def _count(self, pieces: int, adopted: int) -> None:
        """Under the lock: how a WRITE's pieces went in."""
        self.adopted += adopted
        self.copied += pieces - adopted

    def read(self, req):
        pinned = self._ordered(self._run, self.ops.read, req) if self.loop is None else self._serve(self.ops.read, req)
        pinned.on_release = self._read_done
        return pinned

    def _read_done(self, pinned) -> None:
        if self.loop is None:
            trio.from_thread.run_sync(self.ops.afs.read_done, pinned, trio_token=self.token)
            return
        with self.loop:
            self.ops.afs.read_done(pinned)

    def write_buffer(self, index: int):
        """The session's hook: the buffers this worker reads its next request into, one per chunk
        of the payload (a lent arena slot where one could be lent, else part of the worker's own
        buffer), the first starting `shift` bytes into its slot (and one more position then);
        None (no slot lent at all): the session's own buffer."""
        local = self._local
        local.reading = None
        if self.loop is None or self.session is None:
            return None
        afs = self.ops.afs
        arena = afs.fs.arena
        cs = arena.chunk_size
        run = getattr(local, "run", None)
        if run is None:
            local.k = -(-self.session.payload_size // cs)
            run = local.run = [None] * (local.k + 1)
            local.bufs = [None] * len(run)
            local.own = None
            local.out = None
        shift = self.shift if local.k > 1 else 0  # one chunk a request: no whole chunk between the seams
        out = local.out
        if out is not None and local.out_shift == shift:
            local.reading = run  # nothing adopted or lent since: the same list (the session keeps its views)
            local.shift = shift
            return out
        n = local.k + (1 if shift else 0)
        # slots lent: K + 1 whenever a request has whole chunks, shifted or not, so that a payload
        # read at the wrong shift has room to be moved onto the grid (`_realign`)
        lend = local.k + (1 if local.k > 1 else 0)
        bufs = local.bufs
        if None in run[:lend] and afs.can_lend(self.keep_free):
            with self.loop:
                for i in range(lend):
                    if run[i] is None:
                        slot = afs.lend_slot(self.keep_free)
                        if slot is None:
                            break
                        run[i] = slot
                        bufs[i] = arena.view(slot)
                        self._lent.add(slot)
        if None in bufs[:n]:
            if all(slot is None for slot in run[:n]):
                return None
            if local.own is None:
                local.own = memoryview(bytearray(cs * len(run)))
            for i in range(n):
                if run[i] is None:
                    bufs[i] = local.own[i * cs:(i + 1) * cs]
        local.reading = run
        local.shift = shift
        out = [bufs[0][shift:], *bufs[1:n]] if shift else bufs[:n]
        if None not in run[:lend]:  # (with a buffer of its own in the run, or one short, lend again next time)
            local.out, local.out_shift = out, shift
        return out

    def close(self) -> None:
        """Every worker has exited: give their lent slots back (on the trio thread, or under the lock)."""
        for slot in list(self._lent):
            self.ops.afs.unlend_slot(slot)
        self._lent.clear()

    # ---- on the trio thread ----------------------------------------------------------------
    @staticmethod
    async def _run(op, req, *args):
        """op(req, *args) on the trio thread: a coroutine, or a synchronous operation (then its
        continuation if it is `Blocked`)."""
        try:
            if inspect.iscoroutinefunction(op):
                return await op(req, *args)
            try:
                return op(req, *args)
            except Blocked as b:
                return await b.afn(*b.args)
        except FsError:
            raise
        except Exception as exc:  # noqa: BLE001 - the errno decision is errors.py's, as for pyfuse3
            raise FsError(errno=errno_of(exc, req.method)) from None

    async def _killable(self, op, req, *args):
        """`_run`, given up with EINTR if, once the kernel interrupted it, its caller turns out to
        be dying (`_watch`); a caller /proc cannot tell about (another pid namespace) is waited
        for as before."""
        with trio.CancelScope() as scope:
            self._waiting[req.unique] = [scope, req.header.pid, False]
            try:
                if self.session is not None and self.session.interrupted(req.unique):
                    self._cancel(req.unique)
                return await self._run(op, req, *args)
            finally:
                del self._waiting[req.unique]
        self.killed += 1
        log.info("request.killed", extra={"fields": {"op": req.method, "pid": req.header.pid}})
        raise FsError("the caller is being killed", errno=errno.EINTR)

    def _cancel(self, target: int) -> None:
        entry = self._waiting.get(target)
        if entry is not None and not entry[2]:
            entry[2] = True  # one watcher per request
            trio.lowlevel.spawn_system_task(self._watch, target)

    async def _watch(self, unique: int) -> None:
        """While interrupted request `unique` still waits: every KILL_POLL seconds, is its caller
        being killed? Then cancel it."""
        while True:
            entry = self._waiting.get(unique)
            if entry is None:
                return
            if being_killed(entry[1]):
                entry[0].cancel()
                return
            await trio.sleep(KILL_POLL)


class NativeEngine:
    """Mount `afs` at `mountpoint` through the kernel session, served by its worker threads under
    `loop` (installed on the trio thread of `token` before `start`), or, without a loop, every
    request on the trio thread."""

    def __init__(self, afs: AsyncFilesystem, mountpoint: str, token, *, threads: int | None = None,
                 loop: LoopLock | None = None, request_bytes: int = REQUEST_BYTES):
        threads = threads or default_threads()
        arena = afs.fs.arena
        self.loop = loop
        self.handler = TrioHandler(Operations(afs), token, loop, keep_free=max(2 * threads, arena.nslots // 8))
        root = os.geteuid() == 0
        # requests of several whole chunks; as root the max_pages sysctl is raised to one page more
        # (max_pages), so unaligned writers' requests stay whole chunks on the chunk grid and are
        # adopted too; where the limit is lower, as many whole chunks as fit (docs/ENGINE.md); and
        # further, for direct READs of up to READ_BYTES (a WRITE is still cut at max_write)
        cs = arena.chunk_size
        self.session = Session(
            self.handler, mountpoint,
            SessionConfig(threads=threads, allow_other=root, default_permissions=True, want=WANT,
                          max_write=cs * request_chunks(arena.nslots, threads, chunks_in(request_bytes, cs)),
                          grain=cs, raise_max_pages=root,
                          max_read=cs * request_chunks(arena.nslots, threads, chunks_in(READ_BYTES, cs))),
            SessionHooks(write_buffer=self.handler.write_buffer, on_read=self.handler.on_read,
                         after_reply=None if loop is None else loop.kick, settle=loop))
        if loop is not None:
            loop.settle = True  # the session's reader wakes the trio thread once requests pause
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
        """Block until every worker has exited: the kernel unmounted or aborted the connection;
        then give back the slots lent to them."""
        self.session.wait()
        if self.loop is not None:
            with self.loop:
                self.handler.close()

    def unmount(self) -> None:
        """Lazily unmount (after a signal, when fusermount3 -u -z failed)."""
        self.session.unmount(lazy=True)

    def close(self) -> None:
        self.session.close()

    def statistics(self) -> "EngineStats":
        neg = self.session.negotiated
        h = self.handler
        return EngineStats(self.session.statistics(), h.adopted, h.copied, h.shifted, h.shifted_adopted,
                           h.realigned, h.realigned_bytes, h.killed, self.session.threads,
                           neg.max_write if neg is not None else None, neg.max_pages if neg is not None else None,
                           self.session.order.gaps, self.loop.statistics() if self.loop is not None else None)


@dataclass(frozen=True)
class EngineStats:
    """One reading of the native engine (`NativeEngine.statistics()`; `engine_stats` in `ckptfs status
    --json`): its session's requests, how WRITE pieces went in, and the loop lock's waits."""
    session: SessionStats
    adopted: int  # WRITE pieces (chunks) whose lent slot became the chunk's memory
    copied: int  # WRITE pieces copied into their chunks
    shifted: int  # WRITEs read into a shifted run
    shifted_adopted: int  # ... whose first piece was adopted
    realigned: int  # WRITEs moved onto the chunk grid before they were served
    realigned_bytes: int
    killed: int  # requests given up because their caller was being killed
    threads: int
    max_write: int | None  # negotiated (None before INIT)
    max_pages: int | None
    order_gaps: int  # request numbers given up on (interrupted before they were read)
    lock: LockStats | None  # the loop lock (None: every request on the trio thread)
