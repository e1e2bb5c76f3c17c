"""A tiny in-memory filesystem served by ckptfs.fuse.kernel.session (tests of the native engine only).

File contents are 1 MiB chunks, like ckptfs's arena. `write_buffer` gives each
worker a run of spare chunk-sized buffers to read the next request into (as
many as a request holds: the read scatters the payload over them); each piece
of a WRITE that covers one whole aligned chunk keeps its buffer as the chunk
(no copy: the kernel wrote the data into its final place) and the worker gets
a new spare for that position. Other pieces are copied. Reads return views of the chunks (no copy before
writev). Everything else sits behind one lock.

Run as a script it serves a mountpoint until unmounted:
``python tests/kernel_memfs.py MOUNTPOINT [THREADS]`` prints ``ready`` once
mounted and ``exited`` once every worker has.
"""
from __future__ import annotations

import errno
import os
import stat
import sys
import threading
import time

from ckptfs.fuse.kernel import abi
from ckptfs.fuse.kernel.replies import AttrOut, CreateOut, DirentBuffer, EntryOut, OpenOut, StatfsOut, WriteOut, Attr
from waiting import poll

CHUNK = 1 << 20
ZERO = memoryview(bytes(CHUNK))
SLOW_XATTR = b"user.slow"  # getxattr of it waits until interrupted (10 s at most)
WAIT_XATTR = b"user.wait"  # getxattr of it waits, saying so to the session, until `released` is set
HOLD_XATTR = b"user.hold"  # getxattr of it waits until `released` is set, saying nothing (a slow handler)


def _err(code: int, what: str = "") -> OSError:
    return OSError(code, what or os.strerror(code))


class Node:
    def __init__(self, ino: int, mode: int, uid: int, gid: int, parent: int, rdev: int = 0, target: bytes = b""):
        now = time.time_ns()
        self.ino, self.mode, self.uid, self.gid, self.rdev, self.target = ino, mode, uid, gid, rdev, target
        self.parent = parent
        self.nlink = 2 if stat.S_ISDIR(mode) else 1
        self.size = len(target)
        self.atime = self.mtime = self.ctime = now
        self.xattrs: dict[bytes, bytes] = {}
        self.children: dict[bytes, int] = {}
        self.chunks: dict[int, bytearray] = {}
        self.lookups = 0
        self.opens = 0


class MemFS:
    def __init__(self, uid: int = 0, gid: int = 0):
        self.lock = threading.RLock()
        self.nodes = {abi.ROOT_ID: Node(abi.ROOT_ID, stat.S_IFDIR | 0o777, uid, gid, abi.ROOT_ID)}
        self.handles: dict[int, int] = {}
        self._next_ino, self._next_fh = abi.ROOT_ID + 1, 1
        self.session = None
        self.negotiated = None
        self.tls = threading.local()
        self.adopted = self.copied = 0
        self.fsyncs = 0
        self.slow_entered = threading.Event()
        self.released = threading.Event()
        self.holding = threading.Event()  # a HOLD_XATTR getxattr is in its handler
        self.exits = 0  # spare workers that left (worker_exit)
        self.getxattr_by: list[str] = []  # the worker thread that served each GETXATTR, in order

    # ---- helpers (call with the lock held) ----------------------------------------------
    def _node(self, ino: int) -> Node:
        node = self.nodes.get(ino)
        if node is None:
            raise _err(errno.ENOENT, f"no inode {ino}")
        return node

    def _dir(self, ino: int) -> Node:
        node = self._node(ino)
        if not stat.S_ISDIR(node.mode):
            raise _err(errno.ENOTDIR)
        return node

    def _attr(self, n: Node) -> Attr:
        return Attr(ino=n.ino, mode=n.mode, size=n.size, blocks=len(n.chunks) * (CHUNK // 512),
                    atime_ns=n.atime, mtime_ns=n.mtime, ctime_ns=n.ctime, nlink=n.nlink, uid=n.uid,
                    gid=n.gid, rdev=n.rdev, blksize=CHUNK)

    def _entry(self, n: Node) -> EntryOut:
        return EntryOut(n.ino, self._attr(n))

    def _maybe_free(self, n: Node) -> None:
        if n.nlink == 0 and n.lookups <= 0 and n.opens == 0 and n.ino != abi.ROOT_ID:
            self.nodes.pop(n.ino, None)

    def _make(self, parent: int, name: bytes, mode: int, uid: int, gid: int, **kw) -> Node:
        d = self._dir(parent)
        if name in d.children:
            raise _err(errno.EEXIST)
        n = Node(self._next_ino, mode, uid, gid, parent, **kw)
        self._next_ino += 1
        self.nodes[n.ino] = n
        d.children[name] = n.ino
        if stat.S_ISDIR(mode):
            d.nlink += 1
        d.mtime = d.ctime = time.time_ns()
        n.lookups += 1
        return n

    def _drop_name(self, d: Node, name: bytes) -> Node:
        n = self._node(d.children.pop(name))
        if stat.S_ISDIR(n.mode):
            d.nlink -= 1
            n.nlink = 0
        else:
            n.nlink -= 1
        n.ctime = d.mtime = d.ctime = time.time_ns()
        self._maybe_free(n)
        return n

    def _truncate(self, n: Node, size: int) -> None:
        for i in [i for i in n.chunks if i * CHUNK >= size]:
            del n.chunks[i]
        last = n.chunks.get(size // CHUNK)
        if last is not None and size % CHUNK:
            last[size % CHUNK:CHUNK] = bytes(CHUNK - size % CHUNK)
        n.size = size
        n.mtime = n.ctime = time.time_ns()

    @staticmethod
    def _kill_suid(n: Node) -> None:
        n.mode &= ~(stat.S_ISUID | stat.S_ISGID)

    # ---- session hooks ------------------------------------------------------------------
    def init(self, negotiated) -> None:
        self.negotiated = negotiated

    def write_buffer(self, worker: int):
        spares = getattr(self.tls, "spares", None)
        if spares is None:
            spares = self.tls.spares = [None] * -(-self.session.payload_size // CHUNK)
        for i, buf in enumerate(spares):
            if buf is None:
                spares[i] = bytearray(CHUNK)
        return spares

    # ---- names ----------------------------------------------------------------------------
    def lookup(self, req):
        with self.lock:
            d = self._dir(req.nodeid)
            ino = d.children.get(req.name)
            if ino is None:
                raise _err(errno.ENOENT)
            n = self._node(ino)
            n.lookups += 1
            return self._entry(n)

    def forget(self, req):
        with self.lock:
            for ino, count in req.items:
                n = self.nodes.get(ino)
                if n is not None:
                    n.lookups -= count
                    self._maybe_free(n)

    batch_forget = forget

    def getattr(self, req):
        with self.lock:
            return AttrOut(self._attr(self._node(req.nodeid)))

    def setattr(self, req):
        with self.lock:
            n = self._node(req.nodeid)
            v = req.valid
            now = time.time_ns()
            if v & abi.FATTR_MODE:
                n.mode = stat.S_IFMT(n.mode) | (req.mode & 0o7777)
            if v & abi.FATTR_UID:
                n.uid = req.uid
            if v & abi.FATTR_GID:
                n.gid = req.gid
            if v & abi.FATTR_SIZE:
                if stat.S_ISDIR(n.mode):
                    raise _err(errno.EISDIR)
                self._truncate(n, req.size)
            if v & abi.FATTR_KILL_SUIDGID:
                self._kill_suid(n)
            if v & abi.FATTR_ATIME:
                n.atime = now if v & abi.FATTR_ATIME_NOW else req.atime_ns
            if v & abi.FATTR_MTIME:
                n.mtime = now if v & abi.FATTR_MTIME_NOW else req.mtime_ns
            n.ctime = req.ctime_ns if v & abi.FATTR_CTIME else now
            return AttrOut(self._attr(n))

    def mknod(self, req):
        with self.lock:
            h = req.header
            return self._entry(self._make(req.nodeid, req.name, req.mode, h.uid, h.gid, rdev=req.rdev))

    def mkdir(self, req):
        with self.lock:
            h = req.header
            return self._entry(self._make(req.nodeid, req.name, stat.S_IFDIR | (req.mode & 0o7777), h.uid, h.gid))

    def symlink(self, req):
        with self.lock:
            h = req.header
            return self._entry(self._make(req.nodeid, req.name, stat.S_IFLNK | 0o777, h.uid, h.gid,
                                          target=req.target))

    def readlink(self, req):
        with self.lock:
            n = self._node(req.nodeid)
            if not stat.S_ISLNK(n.mode):
                raise _err(errno.EINVAL)
            return n.target

    def link(self, req):
        with self.lock:
            n = self._node(req.oldnodeid)
            d = self._dir(req.nodeid)
            if req.name in d.children:
                raise _err(errno.EEXIST)
            d.children[req.name] = n.ino
            n.nlink += 1
            n.lookups += 1
            n.ctime = time.time_ns()
            return self._entry(n)

    def unlink(self, req):
        with self.lock:
            d = self._dir(req.nodeid)
            ino = d.children.get(req.name)
            if ino is None:
                raise _err(errno.ENOENT)
            if stat.S_ISDIR(self._node(ino).mode):
                raise _err(errno.EISDIR)
            self._drop_name(d, req.name)

    def rmdir(self, req):
        with self.lock:
            d = self._dir(req.nodeid)
            ino = d.children.get(req.name)
            if ino is None:
                raise _err(errno.ENOENT)
            n = self._dir(ino)
            if n.children:
                raise _err(errno.ENOTEMPTY)
            self._drop_name(d, req.name)

    def rename(self, req):
        with self.lock:
            src, dst = self._dir(req.nodeid), self._dir(req.newdir)
            ino = src.children.get(req.name)
            if ino is None:
                raise _err(errno.ENOENT)
            if req.flags & ~1:  # only RENAME_NOREPLACE
                raise _err(errno.EINVAL)
            n = self._node(ino)
            old = dst.children.get(req.newname)
            if old == ino:
                return None
            if old is not None:
                if req.flags & 1:
                    raise _err(errno.EEXIST)
                o = self._node(old)
                if stat.S_ISDIR(o.mode) != stat.S_ISDIR(n.mode):
                    raise _err(errno.EISDIR if stat.S_ISDIR(o.mode) else errno.ENOTDIR)
                if o.children:
                    raise _err(errno.ENOTEMPTY)
                self._drop_name(dst, req.newname)
            del src.children[req.name]
            dst.children[req.newname] = ino
            if stat.S_ISDIR(n.mode) and src is not dst:
                src.nlink -= 1
                dst.nlink += 1
                n.parent = dst.ino
            n.ctime = src.mtime = dst.mtime = time.time_ns()

    # ---- files ------------------------------------------------------------------------------
    def _open(self, n: Node, flags: int, open_flags: int) -> OpenOut:
        if flags & os.O_TRUNC:
            self._truncate(n, 0)
        if open_flags & abi.FUSE_OPEN_KILL_SUIDGID:
            self._kill_suid(n)
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = n.ino
        n.opens += 1
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        return OpenOut(fh, abi.FOPEN_DIRECT_IO | abi.FOPEN_PARALLEL_DIRECT_WRITES if writing else 0)

    def open(self, req):
        with self.lock:
            n = self._node(req.nodeid)
            if stat.S_ISDIR(n.mode):
                raise _err(errno.EISDIR)
            return self._open(n, req.flags, req.open_flags)

    def create(self, req):
        with self.lock:
            h = req.header
            n = self._make(req.nodeid, req.name, stat.S_IFREG | (req.mode & 0o7777), h.uid, h.gid)
            return CreateOut(self._entry(n), self._open(n, req.flags & ~os.O_TRUNC, req.open_flags))

    def _file(self, fh: int) -> Node:
        ino = self.handles.get(fh)
        if ino is None:
            raise _err(errno.EBADF)
        return self._node(ino)

    def read(self, req):
        with self.lock:
            n = self._file(req.fh)
            end = min(n.size, req.offset + req.size)
            parts, pos = [], req.offset
            while pos < end:
                i, off = divmod(pos, CHUNK)
                take = min(CHUNK - off, end - pos)
                chunk = n.chunks.get(i)
                parts.append(ZERO[:take] if chunk is None else memoryview(chunk)[off:off + take])
                pos += take
            n.atime = time.time_ns()
            return parts

    def write(self, req):
        with self.lock:
            n = self._file(req.fh)
            spares = getattr(self.tls, "spares", None) or []
            pos = req.offset
            for k, data in enumerate(req.pieces):
                size = data.nbytes
                if pos % CHUNK == 0 and size == CHUNK and k < len(spares) and data.obj is spares[k]:
                    n.chunks[pos // CHUNK] = spares[k]  # the kernel put the data in place: keep it
                    spares[k] = None
                    self.adopted += 1
                else:
                    done = 0
                    while done < size:
                        i, off = divmod(pos + done, CHUNK)
                        take = min(CHUNK - off, size - done)
                        chunk = n.chunks.get(i)
                        if chunk is None:
                            chunk = n.chunks[i] = bytearray(CHUNK)
                        chunk[off:off + take] = data[done:done + take]
                        done += take
                    self.copied += 1
                pos += size
            n.size = max(n.size, req.offset + req.size)
            if req.write_flags & abi.FUSE_WRITE_KILL_SUIDGID:
                self._kill_suid(n)
            n.mtime = n.ctime = time.time_ns()
            return WriteOut(req.size)

    def flush(self, req):
        with self.lock:
            self._file(req.fh)

    def release(self, req):
        with self.lock:
            ino = self.handles.pop(req.fh, None)
            n = self.nodes.get(ino) if ino is not None else None
            if n is not None:
                n.opens -= 1
                self._maybe_free(n)

    def fsync(self, req):
        with self.lock:
            self._file(req.fh)
            self.fsyncs += 1

    def fsyncdir(self, req):
        with self.lock:
            self.fsyncs += 1

    def syncfs(self, req):
        return None  # nothing to write: the data lives in memory

    def statfs(self, req):
        with self.lock:
            used = sum(len(n.chunks) for n in self.nodes.values()) * (CHUNK // 4096)
            return StatfsOut(blocks=1 << 22, bfree=(1 << 22) - used, bavail=(1 << 22) - used, files=1 << 20,
                             ffree=(1 << 20) - len(self.nodes), bsize=4096, frsize=4096)

    # ---- directories --------------------------------------------------------------------------
    def opendir(self, req):
        with self.lock:
            n = self._dir(req.nodeid)
            fh = self._next_fh
            self._next_fh += 1
            self.handles[fh] = n.ino
            n.opens += 1
            return OpenOut(fh)

    def readdir(self, req):
        with self.lock:
            d = self._file(req.fh)
            names = [(b".", d.ino), (b"..", d.parent), *d.children.items()]
            buf = DirentBuffer(req.size, plus=req.plus)
            for cookie in range(req.offset, len(names)):
                name, ino = names[cookie]
                n = self._node(ino)
                if req.plus:
                    if not buf.add(name, cookie + 1, entry=self._entry(n)):
                        break
                    if cookie >= 2:
                        n.lookups += 1
                elif not buf.add(name, cookie + 1, ino=ino, mode=n.mode):
                    break
            return buf

    releasedir = release

    # ---- extended attributes ---------------------------------------------------------------
    def setxattr(self, req):
        with self.lock:
            n = self._node(req.nodeid)
            if req.flags & os.XATTR_CREATE and req.name in n.xattrs:
                raise _err(errno.EEXIST)
            if req.flags & os.XATTR_REPLACE and req.name not in n.xattrs:
                raise _err(errno.ENODATA)
            n.xattrs[req.name] = req.value
            n.ctime = time.time_ns()

    def worker_exit(self):
        self.exits += 1

    def getxattr(self, req):
        self.getxattr_by.append(threading.current_thread().name)
        if req.name == HOLD_XATTR:
            self.holding.set()
            return b"released" if self.released.wait(30) else b"timed out"
        if req.name == WAIT_XATTR:
            with self.session.waiting():
                return b"released" if self.released.wait(30) else b"timed out"
        if req.name == SLOW_XATTR:
            self.slow_entered.set()
            with self.session.waiting():  # the INTERRUPT must be read by another worker
                interrupted = poll(lambda: self.session.interrupted(req.unique), None, timeout=10, every=0.01)
            raise _err(errno.EINTR if interrupted else errno.ETIMEDOUT)
        with self.lock:
            value = self._node(req.nodeid).xattrs.get(req.name)
            if value is None:
                raise _err(errno.ENODATA)
            return value

    def listxattr(self, req):
        with self.lock:
            return list(self._node(req.nodeid).xattrs)

    def removexattr(self, req):
        with self.lock:
            n = self._node(req.nodeid)
            if n.xattrs.pop(req.name, None) is None:
                raise _err(errno.ENODATA)


def serve(mountpoint: str, threads: int = 4, *, settle=None, after_reply=None, **config):
    """MemFS mounted at `mountpoint` by a Session of `threads` workers (`config`: more SessionConfig
    fields; `settle`, `after_reply`: its hooks), started."""
    from ckptfs.fuse.kernel.session import Session, SessionConfig, SessionHooks
    fs = MemFS()
    s = Session(fs, mountpoint, SessionConfig(threads=threads, **config),
                SessionHooks(write_buffer=fs.write_buffer, settle=settle, after_reply=after_reply))
    fs.session = s
    s.mount()
    s.start()
    return fs, s


if __name__ == "__main__":
    fs, s = serve(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4)
    print("ready", flush=True)
    s.wait()
    s.close()
    print("exited", flush=True)
