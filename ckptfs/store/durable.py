"""The durable state: what the journal on the devices says, replayed. Pure.

`DurableState.apply(record)` applies one journal record to a `Namespace` of
its own (and each regular file's `FileExtents`, chunk index -> Extent, in
`files`) and keeps the
allocator's reference counts in step: the extents a record names are
claimed, those it supersedes or whose inode disappears are released. The
same code serves three purposes:

- recovery: replay the journal into a fresh state at mount;
- the running daemon: apply each record once it is on the devices, so the
  daemon always knows which device space a crash would still need;
- compaction: `snapshot()` is the list of records that rebuilds this state,
  written at the start of the other journal half when one fills up.

With `--dedupe on` the journal also says which content digest an extent
holds (`digests` records, after the `content` that names it); the state keeps
the newest `DIGESTS_KEPT` of the extents still named (`digests`), which seed
the dedupe index at mount and go into each snapshot. An extent forgets its
digest when its last naming goes.
"""
from __future__ import annotations

import stat
from collections import OrderedDict, deque

from ..format.journal import DIGEST_ITEM, JournalCorrupt
from ..format.records import Attrs, Content, Digests, Extent, Link, Make, Setxattr, typed
from ..fs.namespace import ROOT_INO, Inode, Namespace
from .allocator import Allocator
from .dedupe import CAPACITY as DIGESTS_KEPT  # extents whose digest the state keeps

FileExtents = dict[int, Extent]  # a file's durable contents: chunk index -> where it is stored
_COUNT = (1 << 32) - 1  # the count bits of a `names` value
DIGESTS_PER_RECORD = 1024  # items per `digests` record of a snapshot (DIGEST_ITEM bytes each)


def address_key(ext: Extent) -> int:
    """An extent's place as one int, the key of `names` and `digests`: 74 bytes a naming counted
    against 130 with a (device, unit) tuple (1 M entries, tracemalloc), on every pool."""
    return ext.unit << 16 | ext.dev


class DurableState:
    """What the journal on the devices says: a namespace of its own, each file's durable extents
    (`files`) and the epoch. Changed by `apply` (replay, then each commit); compaction sets `epoch`."""

    def __init__(self, allocator: Allocator):
        self.alloc = allocator
        self.ns = Namespace(clock=lambda: 0, on_drop=self._dropped)
        self.files: dict[int, FileExtents] = {}  # regular file ino -> its durable extents
        self.epoch = 0
        # address_key(extent) -> how many chunks name it (more than one: shared), and the length
        # its first naming gave it: `length << 32 | count`, one int
        self.names: dict[int, int] = {}
        # each named extent's first length once per naming after the first: what the devices would
        # hold more without dedupe (a chunk shortened in place names its extent with a shorter
        # length a while: the first length stands for all, so the sum never drifts)
        self.shared_bytes = 0
        # address_key(extent) -> (extent, its content digest), newest last: named extents only
        self.digests: OrderedDict[int, tuple[Extent, bytes]] = OrderedDict()

    def namings(self, ext: Extent) -> int:
        """How many chunks name the extent at `ext`'s place."""
        return self.names.get(address_key(ext), 0) & _COUNT

    def _named(self, ext: Extent) -> None:
        key = address_key(ext)
        v = self.names.get(key)
        if v is None:
            self.names[key] = ext.length << 32 | 1
        else:
            self.names[key] = v + 1
            self.shared_bytes += v >> 32

    def _unnamed(self, ext: Extent) -> None:
        key = address_key(ext)
        v = self.names.pop(key)
        if v & _COUNT > 1:
            self.names[key] = v - 1
            self.shared_bytes -= v >> 32
        else:
            self.digests.pop(key, None)
        self.alloc.release(ext.dev, ext.unit)

    def shared(self, ino: int) -> int:
        """Bytes of file `ino`'s durable contents that another chunk also names (--dedupe)."""
        return sum(e.length for e in self.files.get(ino, {}).values() if self.namings(e) > 1)

    def _dropped(self, inode: Inode) -> None:
        for ext in self.files.pop(inode.ino, {}).values():
            self._unnamed(ext)

    def apply(self, rec: tuple) -> None:
        """Apply one record (typed, or a plain ``(op, *fields)`` tuple)."""
        try:
            rec = typed(rec)
        except ValueError as e:
            raise JournalCorrupt(str(e)) from None
        op = rec.op
        ns = self.ns
        try:
            if op == "make":
                ns.make(rec.parent, rec.name, rec.mode, rec.uid, rec.gid, rdev=rec.rdev, target=rec.target,
                        ino=rec.ino, now=rec.time, count_lookup=False)
                if stat.S_ISREG(rec.mode):
                    self.files[rec.ino] = {}
            elif op == "link":
                ns.link(rec.ino, rec.parent, rec.name, now=rec.time, count_lookup=False)
            elif op == "unlink":
                ns.unlink(rec.parent, rec.name, now=rec.time)
            elif op == "rmdir":
                ns.rmdir(rec.parent, rec.name, now=rec.time)
            elif op == "rename":
                ns.rename(rec.old_parent, rec.old_name, rec.new_parent, rec.new_name, rec.flags, now=rec.time)
            elif op == "setattr":
                ns.setattr(rec.ino, mode=rec.mode, uid=rec.uid, gid=rec.gid, atime_ns=rec.atime,
                           mtime_ns=rec.mtime, now=rec.ctime)
            elif op in ("setxattr", "removexattr"):
                # these records carry no time: keep the inode's last journaled ctime
                # (the namespace would stamp it with this state's clock, which reads 0)
                inode = ns.get(rec.ino)
                ctime = inode.ctime_ns
                if op == "setxattr":
                    ns.setxattr(rec.ino, rec.name, rec.value)
                else:
                    ns.removexattr(rec.ino, rec.name)
                inode.ctime_ns = ctime
            elif op == "content":
                self.set_content(ns.get(rec.ino), rec.size, rec.mtime, rec.ctime, dict(rec.extents))
            elif op == "attrs":
                inode = ns.get(rec.ino)
                inode.mode, inode.uid, inode.gid = rec.mode, rec.uid, rec.gid
                inode.atime_ns, inode.mtime_ns, inode.ctime_ns = rec.atime, rec.mtime, rec.ctime
            elif op == "begin":
                self.epoch = rec.epoch
                ns.next_ino = max(ns.next_ino, rec.next_ino)
            elif op == "digests":
                self._digested(rec.items)
            elif op in ("snapend", "stamp"):
                pass
            else:
                raise JournalCorrupt(f"unknown record {op}")
        except JournalCorrupt:
            raise
        except Exception as e:
            raise JournalCorrupt(f"record {tuple(rec)[:3]}... does not apply: {e}") from e

    def _digested(self, items) -> None:
        for ext, d in items:
            key = address_key(ext)
            if key not in self.names:
                continue  # a later record of the same frame freed it
            self.digests[key] = (ext, d)
            self.digests.move_to_end(key)
        while len(self.digests) > DIGESTS_KEPT:
            self.digests.popitem(last=False)

    def set_content(self, inode: Inode, size: int, mtime: int, ctime: int, extents: FileExtents) -> None:
        for ext in extents.values():
            self.alloc.claim(ext.dev, ext.unit, ext.length)
            self._named(ext)
        for ext in self.files.get(inode.ino, {}).values():
            self._unnamed(ext)
        self.files[inode.ino] = extents
        inode.size = size
        inode.mtime_ns, inode.ctime_ns = mtime, ctime

    def snapshot(self, digest_room: int | None = None) -> list[tuple]:
        """Records that rebuild this state in a fresh namespace (after a `begin`): the newest
        digests among them as long as they fit in `digest_room` bytes (all of them when None)."""
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
                    makes.append(Link(ino, d.ino, name, inode.ctime_ns))
                    continue
                seen.add(ino)
                makes.append(Make(d.ino, name, inode.mode, inode.uid, inode.gid, inode.rdev,
                                  inode.target, ino, inode.ctime_ns))
                if inode.is_dir:
                    todo.append(ino)
                data = self.files.get(ino)
                if inode.is_reg and (inode.size or data):
                    tail.append(Content(ino, inode.size, inode.mtime_ns, inode.ctime_ns, sorted((data or {}).items())))
        for ino in sorted(seen):
            inode = ns.inodes[ino]
            for k, v in inode.xattrs.items():
                tail.append(Setxattr(ino, k, v))
            tail.append(Attrs(ino, inode.mode, inode.uid, inode.gid, inode.atime_ns, inode.mtime_ns, inode.ctime_ns))
        kept = list(self.digests.values())
        if digest_room is not None:
            kept = kept[len(kept) - min(len(kept), digest_room // DIGEST_ITEM):]
        tail += [Digests(kept[i:i + DIGESTS_PER_RECORD]) for i in range(0, len(kept), DIGESTS_PER_RECORD)]
        return makes + tail

    def extents(self) -> list[tuple[int, int, Extent]]:
        """(ino, chunk index, extent) of every durable chunk, for fsck."""
        return [(ino, idx, ext) for ino, data in self.files.items() for idx, ext in sorted(data.items())]
