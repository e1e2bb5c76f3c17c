"""The namespace: inodes, directories, names, attributes, link and lookup counts.

Pure bookkeeping, no I/O. Each mutating method checks POSIX preconditions
first and raises `FsError(errno)` before touching anything, so a failed call
changes nothing. Every mutation is also offered to `observer` (a callable
taking the typed record of it, format/records.py) after it succeeded; the durable store
journals those calls and replays them into a fresh Namespace at mount, which
is why `make` accepts an explicit inode number.

Lifetime of an inode: it lives while it has a name (`nlink > 0`), while the
kernel remembers it (`lookups > 0`, raised by every entry reply and lowered by
forget) or while a handle is open (`opens > 0`). When all three reach zero it
is dropped and `on_drop(inode)` frees its data: an unlinked file stays
readable through open handles until the last release.

Names: a name is at most NAME_MAX (255) bytes. A longer one cannot exist, so
looking it up (and so stat, unlink, rmdir, rename or link of it) fails with
ENAMETOOLONG, not ENOENT, as on ext4; creating one fails the same way. An
extended attribute's name is at most XATTR_NAME_MAX bytes (ERANGE beyond, as
the kernel's VFS says) and its value at most XATTR_SIZE_MAX bytes (E2BIG).

Directory listings: each entry gets a cookie from a per-directory counter
that only grows, so an offset handed to readdir stays valid across creations
and removals (no entry is skipped or repeated).
"""
from __future__ import annotations

import bisect
import errno
import stat
import time
from typing import Callable, Iterator

from ..errors import fs_error
from ..format.records import Link, Make, Removexattr, Rename, Rmdir, Setattr, Setxattr, Unlink

ROOT_INO = 1
NAME_MAX = 255  # bytes in one name
XATTR_NAME_MAX = 255  # bytes in an extended attribute's name (as the VFS: ERANGE beyond)
XATTR_SIZE_MAX = 65536  # bytes in an extended attribute's value (E2BIG beyond)
HIDDEN_XATTR = b"ckptfs."  # ckptfs's own journaled attributes: never shown to users (core.py)
# hidden attributes that describe a file's contents as they are: a write, truncate or fallocate
# drops them (core.py), journaled before the new contents' commit
CONTENT_XATTR = HIDDEN_XATTR + b"content."
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


class Directory:
    """A directory's entries (name -> inode number) and their readdir cookies, which only grow;
    changed by the namespace's mutations only."""

    __slots__ = ("entries", "_cookie_of", "_name_of", "_order", "_dead", "_next")

    def __init__(self) -> None:
        self.entries: dict[bytes, int] = {}
        self._cookie_of: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self._order: list[int] = []  # cookies ascending; may hold dead ones (compacted lazily)
        self._dead = 0
        self._next = 3  # cookies 1 and 2 are "." and ".."

    def add(self, name: bytes, ino: int) -> None:
        cookie = self._next
        self._next += 1
        self.entries[name] = ino
        self._cookie_of[name] = cookie
        self._name_of[cookie] = name
        self._order.append(cookie)

    def remove(self, name: bytes) -> int:
        ino = self.entries.pop(name)
        del self._name_of[self._cookie_of.pop(name)]
        self._dead += 1
        if self._dead > 64 and self._dead * 2 > len(self._order):
            self._order = [c for c in self._order if c in self._name_of]
            self._dead = 0
        return ino

    def replace(self, name: bytes, ino: int) -> None:
        """Point an existing name at another inode, keeping its place in listings."""
        self.entries[name] = ino

    def list_from(self, after: int) -> Iterator[tuple[bytes, int, int]]:
        """(name, ino, cookie) of entries whose cookie is greater than `after`."""
        order = self._order
        i = bisect.bisect_right(order, after)
        while i < len(order):
            cookie = order[i]
            i += 1
            name = self._name_of.get(cookie)
            if name is not None:
                yield name, self.entries[name], cookie

    def __len__(self) -> int:
        return len(self.entries)


class Inode:
    """One inode: its attributes, directory or symlink target, xattrs, and the counts that keep it
    alive (`nlink`, `lookups`, `opens`); `data`, a regular file's FileData, belongs to the core."""

    __slots__ = ("ino", "mode", "uid", "gid", "nlink", "size", "rdev", "atime_ns", "mtime_ns",
                 "ctime_ns", "target", "dir", "parent", "xattrs", "lookups", "opens", "data",
                 "version")

    def __init__(self, ino: int, mode: int, uid: int, gid: int, now: int):
        self.ino = ino
        self.mode = mode
        self.uid = uid
        self.gid = gid
        self.nlink = 0
        self.size = 0
        self.rdev = 0
        self.atime_ns = self.mtime_ns = self.ctime_ns = now
        self.target = b""
        self.dir: Directory | None = Directory() if stat.S_ISDIR(mode) else None
        self.parent = 0  # directories only: the inode of ".."
        self.xattrs: dict[bytes, bytes] = {}
        self.lookups = 0
        self.opens = 0
        self.data = None  # owned by the filesystem core (FileData for regular files)
        self.version = 0  # bumped on every data change; lets readers keep the page cache

    @property
    def is_dir(self) -> bool:
        return self.dir is not None

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)


Observer = Callable[[tuple], None]  # hears the typed record (format/records.py) of each mutation


class Namespace:
    """Every inode, by number, and the names between them. The core's calls (or replay,
    durable.py) change it; each mutation that succeeds is reported to `observer`."""

    def __init__(self, *, uid: int = 0, gid: int = 0, root_mode: int = 0o755,
                 clock: Callable[[], int] = time.time_ns,
                 on_drop: Callable[[Inode], None] | None = None,
                 observer: Observer | None = None,
                 on_orphan: Callable[[Inode], None] | None = None):
        self.clock = clock
        self.on_drop = on_drop or (lambda inode: None)
        self.on_orphan = on_orphan  # no name and no open handle: its data can go now
        self.on_unnamed: Callable[[Inode], None] | None = None  # a file lost its last name (before its record)
        self.observer = observer
        self.inodes: dict[int, Inode] = {}
        self.next_ino = ROOT_INO + 1
        root = Inode(ROOT_INO, stat.S_IFDIR | (root_mode & 0o7777), uid, gid, clock())
        root.nlink = 2
        root.parent = ROOT_INO
        self.inodes[ROOT_INO] = root

    # ---- queries -------------------------------------------------------
    def get(self, ino: int) -> Inode:
        try:
            return self.inodes[ino]
        except KeyError:
            raise fs_error(errno.ENOENT, f"no inode {ino}") from None

    def dir_of(self, ino: int) -> Inode:
        inode = self.get(ino)
        if inode.dir is None:
            raise fs_error(errno.ENOTDIR)
        return inode

    def child(self, parent: int, name: bytes) -> Inode:
        d = self.dir_of(parent).dir
        if name == b".":
            return self.get(parent)
        if name == b"..":
            return self.get(self.get(parent).parent)
        ino = d.entries.get(name)
        if ino is None:
            raise fs_error(errno.ENAMETOOLONG if len(name) > NAME_MAX else errno.ENOENT)
        return self.inodes[ino]

    def lookup(self, parent: int, name: bytes) -> Inode:
        """The inode named `name` in `parent`; counts one kernel lookup."""
        inode = self.child(parent, name)
        inode.lookups += 1
        return inode

    # ---- mutations -----------------------------------------------------
    def _notify(self, rec: tuple) -> None:
        if self.observer is not None:
            self.observer(rec)

    @staticmethod
    def check_xattr_name(name: bytes) -> None:
        if not name or len(name) > XATTR_NAME_MAX:
            raise fs_error(errno.ERANGE, "bad extended attribute name")

    @staticmethod
    def _check_name(name: bytes) -> None:
        if len(name) > NAME_MAX:
            raise fs_error(errno.ENAMETOOLONG)
        if not name or b"/" in name or name in (b".", b".."):
            raise fs_error(errno.EINVAL, f"bad name {name!r}")

    def _touch(self, inode: Inode, now: int) -> None:
        inode.mtime_ns = inode.ctime_ns = now

    def make(self, parent: int, name: bytes, mode: int, uid: int, gid: int, *,
             rdev: int = 0, target: bytes = b"", ino: int | None = None, now: int | None = None,
             count_lookup: bool = True) -> Inode:
        """Create a file, directory, symlink or node named `name` in `parent`."""
        self._check_name(name)
        pdir = self.dir_of(parent)
        if name in pdir.dir.entries:
            raise fs_error(errno.EEXIST)
        now = self.clock() if now is None else now
        if ino is None:
            ino = self.next_ino
        if ino in self.inodes:
            raise fs_error(errno.EEXIST, f"inode {ino} exists")
        self.next_ino = max(self.next_ino, ino + 1)
        inode = Inode(ino, mode, uid, gid, now)
        inode.rdev = rdev
        inode.target = target
        if inode.is_dir:
            inode.nlink = 2
            inode.parent = parent
            pdir.nlink += 1
        else:
            inode.nlink = 1
        if stat.S_ISLNK(mode):
            inode.size = len(target)
        self.inodes[ino] = inode
        pdir.dir.add(name, ino)
        self._touch(pdir, now)
        if count_lookup:
            inode.lookups += 1
        self._notify(Make(parent, name, mode, uid, gid, rdev, target, ino, now))
        return inode

    def link(self, ino: int, parent: int, name: bytes, *, now: int | None = None,
             count_lookup: bool = True) -> Inode:
        self._check_name(name)
        inode = self.get(ino)
        if inode.is_dir:
            raise fs_error(errno.EPERM, "hard links to directories are not allowed")
        pdir = self.dir_of(parent)
        if name in pdir.dir.entries:
            raise fs_error(errno.EEXIST)
        if inode.nlink == 0:
            raise fs_error(errno.ENOENT, "cannot link an unlinked file")
        now = self.clock() if now is None else now
        pdir.dir.add(name, ino)
        inode.nlink += 1
        inode.ctime_ns = now
        self._touch(pdir, now)
        if count_lookup:
            inode.lookups += 1
        self._notify(Link(ino, parent, name, now))
        return inode

    def _drop_name(self, pdir: Inode, name: bytes, inode: Inode, now: int) -> None:
        """Remove one name of `inode` (checks done by the caller)."""
        pdir.dir.remove(name)
        if inode.is_dir:
            inode.nlink = 0
            pdir.nlink -= 1
        else:
            inode.nlink -= 1
        inode.ctime_ns = now
        self._touch(pdir, now)
        if not inode.nlink and not inode.is_dir and self.on_unnamed is not None:
            self.on_unnamed(inode)
        self.maybe_drop(inode)

    def unlink(self, parent: int, name: bytes, *, now: int | None = None) -> Inode:
        pdir = self.dir_of(parent)
        inode = self.child(parent, name)
        if inode.is_dir:
            raise fs_error(errno.EISDIR)
        now = self.clock() if now is None else now
        self._drop_name(pdir, name, inode, now)
        self._notify(Unlink(parent, name, now))
        return inode

    def rmdir(self, parent: int, name: bytes, *, now: int | None = None) -> Inode:
        if name == b".":
            raise fs_error(errno.EINVAL)
        if name == b"..":
            raise fs_error(errno.ENOTEMPTY)
        pdir = self.dir_of(parent)
        inode = self.child(parent, name)
        if not inode.is_dir:
            raise fs_error(errno.ENOTDIR)
        if len(inode.dir):
            raise fs_error(errno.ENOTEMPTY)
        now = self.clock() if now is None else now
        self._drop_name(pdir, name, inode, now)
        self._notify(Rmdir(parent, name, now))
        return inode

    def _is_ancestor(self, anc: int, ino: int) -> bool:
        """True when directory `anc` is `ino` or one of its ancestors."""
        while True:
            if ino == anc:
                return True
            if ino == ROOT_INO:
                return False
            ino = self.inodes[ino].parent

    def rename(self, p_old: int, n_old: bytes, p_new: int, n_new: bytes, flags: int = 0, *,
               now: int | None = None) -> Inode | None:
        """Rename; returns the inode that lost its name by being replaced, if any."""
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or flags == RENAME_NOREPLACE | RENAME_EXCHANGE:
            raise fs_error(errno.EINVAL, "bad rename flags")
        old_dir = self.dir_of(p_old)
        new_dir = self.dir_of(p_new)
        src = self.child(p_old, n_old)  # as the kernel: the source is looked up before the new name
        self._check_name(n_new)
        dst_ino = new_dir.dir.entries.get(n_new)
        dst = self.inodes[dst_ino] if dst_ino is not None else None
        if flags & RENAME_NOREPLACE and dst is not None:
            raise fs_error(errno.EEXIST)
        if flags & RENAME_EXCHANGE and dst is None:
            raise fs_error(errno.ENOENT)
        if src.is_dir and self._is_ancestor(src.ino, p_new):
            raise fs_error(errno.EINVAL, "cannot move a directory into itself")
        if flags & RENAME_EXCHANGE and dst.is_dir and self._is_ancestor(dst.ino, p_old):
            raise fs_error(errno.EINVAL, "cannot move a directory into itself")
        if dst is src:
            return None  # two names of one inode: POSIX says do nothing
        now = self.clock() if now is None else now
        if flags & RENAME_EXCHANGE:
            old_dir.dir.replace(n_old, dst.ino)
            new_dir.dir.replace(n_new, src.ino)
            for moved, frm, to in ((src, old_dir, new_dir), (dst, new_dir, old_dir)):
                if moved.is_dir and frm is not to:
                    moved.parent = to.ino
                    frm.nlink -= 1
                    to.nlink += 1
                moved.ctime_ns = now
            self._touch(old_dir, now)
            self._touch(new_dir, now)
            self._notify(Rename(p_old, n_old, p_new, n_new, flags, now))
            return None
        if dst is not None:
            if src.is_dir and not dst.is_dir:
                raise fs_error(errno.ENOTDIR)
            if dst.is_dir and not src.is_dir:
                raise fs_error(errno.EISDIR)
            if dst.is_dir and len(dst.dir):
                raise fs_error(errno.ENOTEMPTY)
            self._drop_name(new_dir, n_new, dst, now)
        old_dir.dir.remove(n_old)
        new_dir.dir.add(n_new, src.ino)
        if src.is_dir and old_dir is not new_dir:
            src.parent = p_new
            old_dir.nlink -= 1
            new_dir.nlink += 1
        src.ctime_ns = now
        self._touch(old_dir, now)
        self._touch(new_dir, now)
        self._notify(Rename(p_old, n_old, p_new, n_new, flags, now))
        return dst

    def setattr(self, ino: int, *, mode: int | None = None, uid: int | None = None,
                gid: int | None = None, atime_ns: int | None = None, mtime_ns: int | None = None,
                now: int | None = None) -> Inode:
        """Change metadata other than size (size belongs to the file's data)."""
        inode = self.get(ino)
        now = self.clock() if now is None else now
        if mode is not None:
            inode.mode = stat.S_IFMT(inode.mode) | (mode & 0o7777)
        if uid is not None:
            inode.uid = uid
        if gid is not None:
            inode.gid = gid
        if atime_ns is not None:
            inode.atime_ns = atime_ns
        if mtime_ns is not None:
            inode.mtime_ns = mtime_ns
        inode.ctime_ns = now
        self._notify(Setattr(ino, mode, uid, gid, atime_ns, mtime_ns, now))
        return inode

    def getxattr(self, ino: int, name: bytes) -> bytes:
        self.check_xattr_name(name)
        value = self.get(ino).xattrs.get(name)
        if value is None:
            raise fs_error(errno.ENODATA)
        return value

    def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        self.check_xattr_name(name)
        if len(value) > XATTR_SIZE_MAX:
            raise fs_error(errno.E2BIG)
        inode = self.get(ino)
        inode.xattrs[name] = bytes(value)
        inode.ctime_ns = self.clock()
        self._notify(Setxattr(ino, name, bytes(value)))

    def removexattr(self, ino: int, name: bytes) -> None:
        self.check_xattr_name(name)
        inode = self.get(ino)
        if inode.xattrs.pop(name, None) is None:
            raise fs_error(errno.ENODATA)
        inode.ctime_ns = self.clock()
        self._notify(Removexattr(ino, name))

    # ---- lifetime ------------------------------------------------------
    def forget(self, ino: int, n: int) -> None:
        inode = self.inodes.get(ino)
        if inode is None or ino == ROOT_INO:
            return
        inode.lookups = max(0, inode.lookups - n)
        self.maybe_drop(inode)

    def maybe_drop(self, inode: Inode) -> None:
        if inode.nlink == 0 and inode.opens == 0 and self.on_orphan is not None:
            self.on_orphan(inode)  # the kernel may remember it a while yet, but none can read it
        if inode.nlink == 0 and inode.lookups == 0 and inode.opens == 0 and inode.ino != ROOT_INO:
            del self.inodes[inode.ino]
            self.on_drop(inode)

    def check_invariants(self) -> None:
        for inode in self.inodes.values():
            if inode.is_dir:
                subdirs = sum(1 for i in inode.dir.entries.values() if self.inodes[i].is_dir)
                if inode.nlink:
                    assert inode.nlink == 2 + subdirs, f"dir {inode.ino} nlink {inode.nlink} != 2+{subdirs}"
                for child in inode.dir.entries.values():
                    assert child in self.inodes, f"dangling entry to {child}"
                    if self.inodes[child].is_dir:
                        assert self.inodes[child].parent == inode.ino
        names: dict[int, int] = {}
        for inode in self.inodes.values():
            if inode.is_dir:
                for child in inode.dir.entries.values():
                    names[child] = names.get(child, 0) + 1
        for ino, inode in self.inodes.items():
            if not inode.is_dir and ino != ROOT_INO:
                assert inode.nlink == names.get(ino, 0), f"inode {ino} nlink {inode.nlink} != names {names.get(ino, 0)}"
