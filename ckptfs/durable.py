"""The durable state: what the journal on the devices says, replayed. Pure.

`DurableState.apply(record)` applies one journal record to a `Namespace` of
its own (inodes carry, as `data`, a dict chunk index -> Extent) and keeps the
allocator's reference counts in step: the extents a record names are
claimed, those it supersedes or whose inode disappears are released. The
same code serves three purposes:

- recovery: replay the journal into a fresh state at mount;
- the running daemon: apply each record once it is on the devices, so the
  daemon always knows which device space a crash would still need;
- compaction: `snapshot()` is the list of records that rebuilds this state,
  written at the start of the other journal half when one fills up.
"""
from __future__ import annotations

import stat
from collections import deque

from .allocator import Allocator
from .journal import Extent, JournalCorrupt
from .namespace import ROOT_INO, Inode, Namespace

Extents = dict[int, Extent]


class DurableState:
    def __init__(self, allocator: Allocator):
        self.alloc = allocator
        self.ns = Namespace(clock=lambda: 0, on_drop=self._dropped)
        self.epoch = 0

    def _dropped(self, inode: Inode) -> None:
        for ext in (inode.data or {}).values():
            self.alloc.release(ext.dev, ext.unit)
        inode.data = None

    def apply(self, rec: tuple) -> None:
        op, args = rec[0], rec[1:]
        ns = self.ns
        try:
            if op == "make":
                parent, name, mode, uid, gid, rdev, target, ino, now = args
                inode = ns.make(parent, name, mode, uid, gid, rdev=rdev, target=target, ino=ino,
                                now=now, count_lookup=False)
                if stat.S_ISREG(mode):
                    inode.data = {}
            elif op == "link":
                ino, parent, name, now = args
                ns.link(ino, parent, name, now=now, count_lookup=False)
            elif op == "unlink":
                ns.unlink(args[0], args[1], now=args[2])
            elif op == "rmdir":
                ns.rmdir(args[0], args[1], now=args[2])
            elif op == "rename":
                p_old, n_old, p_new, n_new, flags, now = args
                ns.rename(p_old, n_old, p_new, n_new, flags, now=now)
            elif op == "setattr":
                ino, mode, uid, gid, atime, mtime, now = args
                ns.setattr(ino, mode=mode, uid=uid, gid=gid, atime_ns=atime, mtime_ns=mtime, now=now)
            elif op in ("setxattr", "removexattr"):
                # these records carry no time: keep the inode's last journaled ctime
                # (the namespace would stamp it with this state's clock, which reads 0)
                inode = ns.get(args[0])
                ctime = inode.ctime_ns
                getattr(ns, op)(*args)
                inode.ctime_ns = ctime
            elif op == "content":
                ino, size, mtime, ctime, extents = args
                self.set_content(ns.get(ino), size, mtime, ctime, dict(extents))
            elif op == "attrs":
                ino, mode, uid, gid, atime, mtime, ctime = args
                inode = ns.get(ino)
                inode.mode, inode.uid, inode.gid = mode, uid, gid
                inode.atime_ns, inode.mtime_ns, inode.ctime_ns = atime, mtime, ctime
            elif op == "begin":
                self.epoch = args[0]
                ns.next_ino = max(ns.next_ino, args[1])
            elif op == "snapend":
                pass
            else:
                raise JournalCorrupt(f"unknown record {op}")
        except JournalCorrupt:
            raise
        except Exception as e:
            raise JournalCorrupt(f"record {rec[:3]}... does not apply: {e}") from e

    def set_content(self, inode: Inode, size: int, mtime: int, ctime: int, extents: Extents) -> None:
        for ext in extents.values():
            self.alloc.claim(ext.dev, ext.unit)
        for ext in (inode.data or {}).values():
            self.alloc.release(ext.dev, ext.unit)
        inode.data = extents
        inode.size = size
        inode.mtime_ns, inode.ctime_ns = mtime, ctime

    def snapshot(self) -> list[tuple]:
        """Records that rebuild this state in a fresh namespace (after a `begin`)."""
        ns = self.ns
        makes: list[tuple] = []
        tail: list[tuple] = []
        seen = {ROOT_INO}
        todo = deque([ROOT_INO])
        while todo:
            d = ns.inodes[todo.popleft()]
            for name, ino, _ in d.dir.list_from(0):
                inode = ns.inodes[ino]
                if ino in seen:
                    makes.append(("link", ino, d.ino, name, inode.ctime_ns))
                    continue
                seen.add(ino)
                makes.append(("make", d.ino, name, inode.mode, inode.uid, inode.gid, inode.rdev,
                              inode.target, ino, inode.ctime_ns))
                if inode.is_dir:
                    todo.append(ino)
                if inode.is_reg and (inode.size or inode.data):
                    tail.append(("content", ino, inode.size, inode.mtime_ns, inode.ctime_ns,
                                 sorted((inode.data or {}).items())))
        for ino in sorted(seen):
            inode = ns.inodes[ino]
            for k, v in inode.xattrs.items():
                tail.append(("setxattr", ino, k, v))
            tail.append(("attrs", ino, inode.mode, inode.uid, inode.gid, inode.atime_ns,
                         inode.mtime_ns, inode.ctime_ns))
        return makes + tail

    def extents(self) -> list[tuple[int, int, Extent]]:
        """(ino, chunk index, extent) of every durable chunk, for fsck."""
        return [(i.ino, idx, ext) for i in self.ns.inodes.values() if isinstance(i.data, dict)
                for idx, ext in sorted(i.data.items())]
