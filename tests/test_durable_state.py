"""The durable state: journal records applied to a namespace plus allocator (pure).

Reference counts must follow the records (a deleted file's extents are freed,
a superseding content record frees what it replaced), and `snapshot()` must
rebuild an identical state in a fresh DurableState: that is what compaction
writes at the start of a journal half and what the next mount replays.
"""
import stat

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfs.store.allocator import Allocator
from ckptfs.store.durable import DurableState
from ckptfs.format.journal import Extent, JournalCorrupt, decode_records, encode_record
from ckptfs.fs.namespace import RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INO

UNITS = [24, 24, 16]
CHUNK = 4096
REG, DIR, LNK, FIFO = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755, stat.S_IFLNK | 0o777, stat.S_IFIFO | 0o600


def fresh() -> DurableState:
    s = DurableState(Allocator(UNITS))
    s.apply(("begin", 1, ROOT_INO + 1))
    s.apply(("attrs", ROOT_INO, DIR, 0, 0, 0, 0, 0))
    s.apply(("snapend",))
    return s


def referenced(s: DurableState) -> dict[tuple[int, int], int]:
    """(dev, unit) -> how many chunks of live inodes name it."""
    out: dict[tuple[int, int], int] = {}
    for ino, data in s.files.items():
        assert ino in s.ns.inodes, "extents kept for an inode that is gone"
        for ext in data.values():
            out[(ext.dev, ext.unit)] = out.get((ext.dev, ext.unit), 0) + 1
    return out


def check(s: DurableState) -> None:
    s.alloc.check_invariants()
    s.ns.check_invariants()
    refs = referenced(s)
    assert s.alloc._refs == refs, "allocator references differ from the extents the namespace names"
    assert s.alloc.used_units() == len(refs)


def dump(s: DurableState) -> dict:
    """Everything about a namespace that must survive a snapshot (inode numbers included)."""
    out = {"next_ino": s.ns.next_ino}
    for ino, i in sorted(s.ns.inodes.items()):
        out[ino] = dict(
            mode=i.mode, uid=i.uid, gid=i.gid, nlink=i.nlink, size=i.size, rdev=i.rdev,
            atime=i.atime_ns, mtime=i.mtime_ns, ctime=i.ctime_ns, target=i.target,
            xattrs=dict(i.xattrs), data=dict(s.files[ino]) if ino in s.files else None,
            parent=i.parent if i.is_dir else None,
            entries=[(n, c) for n, c, _ in i.dir.list_from(0)] if i.is_dir else None)
    return out


def rebuild(s: DurableState) -> DurableState:
    """Replay s.snapshot() (through the record codec) into a fresh state, as compaction does."""
    recs = [("begin", s.epoch + 1, s.ns.next_ino)] + s.snapshot() + [("snapend",)]
    raw = b"".join(encode_record(r) for r in recs)
    t = DurableState(Allocator(UNITS))
    for r in decode_records(raw, len(recs)):
        t.apply(r)
    return t


class Writer:
    """Produces content records as the store does: new chunks get a unit (the live chunk's
    reference), the record claims it, then the live chunk lets go; unchanged chunks keep
    their extent."""

    def __init__(self, s: DurableState):
        self.s = s

    def content(self, ino: int, nchunks: int, rewrite: set[int], now: int, tail: int = CHUNK) -> list:
        s = self.s
        old = s.files.get(ino) or {}
        extents, fresh_units = [], []
        for idx in range(nchunks):
            if idx in old and idx not in rewrite:
                extents.append((idx, old[idx]))
                continue
            dev, unit = s.alloc.alloc(s.alloc.preferred(ino, idx))
            fresh_units.append((dev, unit))
            extents.append((idx, Extent(dev, unit, CHUNK, (ino * 1000 + idx + now) & 0xFFFFFFFF)))
        size = (nchunks - 1) * CHUNK + tail if nchunks else 0
        s.apply(("content", ino, size, now, now, extents))
        for dev, unit in fresh_units:
            s.alloc.release(dev, unit)
        return extents


# ---- targeted cases ---------------------------------------------------------------


def test_unlink_frees_the_extents_of_the_last_name():
    s = fresh()
    w = Writer(s)
    s.apply(("make", ROOT_INO, b"f", REG, 0, 0, 0, b"", 2, 1))
    ext = w.content(2, 3, set(), 2)
    assert s.alloc.used_units() == 3 and all(s.alloc.refs(e.dev, e.unit) == 1 for _, e in ext)
    s.apply(("link", 2, ROOT_INO, b"g", 3))
    s.apply(("unlink", ROOT_INO, b"f", 4))
    assert s.alloc.used_units() == 3  # still named by g
    check(s)
    s.apply(("unlink", ROOT_INO, b"g", 5))
    assert s.alloc.used_units() == 0 and 2 not in s.ns.inodes
    check(s)


def test_superseding_content_frees_replaced_extents_only():
    s = fresh()
    w = Writer(s)
    s.apply(("make", ROOT_INO, b"f", REG, 0, 0, 0, b"", 2, 1))
    first = dict(w.content(2, 4, set(), 2))
    second = dict(w.content(2, 4, {1, 3}, 3))
    assert second[0] == first[0] and second[2] == first[2]
    for idx in (1, 3):
        assert s.alloc.refs(first[idx].dev, first[idx].unit) == 0
        assert s.alloc.refs(second[idx].dev, second[idx].unit) == 1
    assert s.alloc.used_units() == 4
    check(s)
    w.content(2, 1, set(), 4, tail=10)  # truncated to one chunk
    assert s.alloc.used_units() == 1 and s.ns.get(2).size == 10
    check(s)


def test_rename_over_a_file_frees_the_replaced_file():
    s = fresh()
    w = Writer(s)
    s.apply(("make", ROOT_INO, b"ckpt", REG, 0, 0, 0, b"", 2, 1))
    w.content(2, 2, set(), 1)
    s.apply(("make", ROOT_INO, b"ckpt.tmp", REG, 0, 0, 0, b"", 3, 2))
    new = dict(w.content(3, 2, set(), 2))
    s.apply(("rename", ROOT_INO, b"ckpt.tmp", ROOT_INO, b"ckpt", 0, 3))
    assert 2 not in s.ns.inodes
    assert s.alloc.used_units() == 2 and s.files[3] == new
    check(s)


def test_bad_records_raise_journal_corrupt_and_change_nothing():
    s = fresh()
    s.apply(("make", ROOT_INO, b"f", REG, 0, 0, 0, b"", 2, 1))
    before = dump(s)
    for bad in (("make", ROOT_INO, b"f", REG, 0, 0, 0, b"", 3, 1),  # name exists
                ("unlink", ROOT_INO, b"nope", 1),
                ("rmdir", ROOT_INO, b"f", 1),
                ("link", 99, ROOT_INO, b"x", 1),
                ("content", 99, 0, 0, 0, []),
                ("content", 2, 1, 0, 0, [(0, Extent(7, 0, 1, 0))]),  # no such device
                ("frobnicate", 1)):
        with pytest.raises(JournalCorrupt):
            s.apply(bad)
        assert dump(s) == before
        check(s)


def test_snapshot_of_hard_links_xattrs_and_special_files():
    s = fresh()
    w = Writer(s)
    s.apply(("make", ROOT_INO, b"d", DIR, 1, 2, 0, b"", 2, 10))
    s.apply(("make", 2, b"f", REG, 3, 4, 0, b"", 3, 11))
    w.content(3, 2, set(), 12, tail=5)
    s.apply(("link", 3, ROOT_INO, b"f2", 13))
    s.apply(("make", ROOT_INO, b"l", LNK, 0, 0, 0, b"d/f", 4, 14))
    s.apply(("make", 2, b"p", FIFO, 0, 0, 1234, b"", 5, 15))
    s.apply(("setxattr", 3, b"user.a", b"1"))
    s.apply(("setxattr", 2, b"user.b", b""))
    s.apply(("setattr", 3, 0o600, 7, 8, 100, 200, 16))
    s.apply(("make", ROOT_INO, b"sparse", REG, 0, 0, 0, b"", 6, 17))
    s.apply(("content", 6, 1 << 20, 18, 18, []))
    t = rebuild(s)
    assert dump(t) == dump(s)
    check(t)


# ---- random namespaces ------------------------------------------------------------


def _names(s: DurableState):
    """(parent, name, inode) of every name in the namespace."""
    out = []
    for d in s.ns.inodes.values():
        if d.is_dir:
            out.extend((d.ino, n, s.ns.inodes[c]) for n, c, _ in d.dir.list_from(0))
    return out


def random_ops(data, s: DurableState, nops: int) -> None:
    w = Writer(s)
    now = 100
    names = [b"a", b"b", b"c", b"ckpt", b"x" * 255]
    for _ in range(nops):
        now += 1
        dirs = sorted(i for i, n in s.ns.inodes.items() if n.is_dir)
        entries = _names(s)
        files = sorted({i.ino for _, _, i in entries if i.is_reg})
        op = data.draw(st.sampled_from(["make", "make", "mkdir", "link", "unlink", "rmdir", "rename",
                                        "setattr", "setxattr", "removexattr", "content", "content"]))
        rec = None
        if op in ("make", "mkdir"):
            mode = DIR if op == "mkdir" else data.draw(st.sampled_from([REG, REG, LNK, FIFO]))
            target = data.draw(st.binary(min_size=1, max_size=20)) if mode == LNK else b""
            rec = ("make", data.draw(st.sampled_from(dirs)), data.draw(st.sampled_from(names)), mode,
                   data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3)),
                   7 if mode == FIFO else 0, target, s.ns.next_ino, now)
        elif op == "link" and files:
            rec = ("link", data.draw(st.sampled_from(files)), data.draw(st.sampled_from(dirs)),
                   data.draw(st.sampled_from(names)), now)
        elif op in ("unlink", "rmdir") and entries:
            p, n, _ = data.draw(st.sampled_from(entries))
            rec = (op, p, n, now)
        elif op == "rename" and entries:
            p, n, _ = data.draw(st.sampled_from(entries))
            flags = data.draw(st.sampled_from([0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE]))
            rec = ("rename", p, n, data.draw(st.sampled_from(dirs)), data.draw(st.sampled_from(names)),
                   flags, now)
        elif op == "setattr":
            ino = data.draw(st.sampled_from(sorted(s.ns.inodes)))
            opt = st.none() | st.integers(0, 5)
            rec = ("setattr", ino, data.draw(st.none() | st.integers(0, 0o7777)), data.draw(opt),
                   data.draw(opt), data.draw(st.none() | st.integers(-5, 10**18)),
                   data.draw(st.none() | st.integers(-5, 10**18)), now)
        elif op == "setxattr":
            rec = ("setxattr", data.draw(st.sampled_from(sorted(s.ns.inodes))),
                   data.draw(st.sampled_from([b"user.a", b"user.b", b"trusted.c"])),
                   data.draw(st.binary(max_size=16)))
        elif op == "removexattr":
            with_x = sorted(i for i, n in s.ns.inodes.items() if n.xattrs)
            if with_x:
                ino = data.draw(st.sampled_from(with_x))
                rec = ("removexattr", ino, data.draw(st.sampled_from(sorted(s.ns.inodes[ino].xattrs))))
        elif op == "content" and files:
            ino = data.draw(st.sampled_from(files))
            n = data.draw(st.integers(0, 5))
            rewrite = set(data.draw(st.lists(st.integers(0, 4), max_size=3)))
            if s.alloc.free_units() >= n:
                w.content(ino, n, rewrite, now, tail=data.draw(st.integers(1, CHUNK)))
                check(s)
            continue
        if rec is None:
            continue
        before = dump(s)
        try:
            s.apply(rec)
        except JournalCorrupt:
            assert dump(s) == before, f"a refused {rec[0]} changed the state"
        check(s)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_namespaces_keep_counts_and_snapshot_identically(data):
    s = fresh()
    random_ops(data, s, data.draw(st.integers(1, 60)))
    check(s)
    t = rebuild(s)
    assert dump(t) == dump(s)
    assert t.alloc._refs == s.alloc._refs
    check(t)
    # a snapshot of the rebuilt state is the same list of records: compaction is idempotent
    assert t.snapshot() == s.snapshot()
    # and deleting everything frees every unit
    _delete_all(t)
    assert t.alloc.used_units() == 0 and list(t.ns.inodes) == [ROOT_INO]
    check(t)


def _delete_all(s: DurableState) -> None:
    def rm(d: int) -> None:
        for name, c, _ in list(s.ns.inodes[d].dir.list_from(0)):
            if s.ns.inodes[c].is_dir:
                rm(c)
                s.apply(("rmdir", d, name, 0))
            else:
                s.apply(("unlink", d, name, 0))
    rm(ROOT_INO)


def test_xattr_records_do_not_reset_ctime():
    """setxattr/removexattr records carry no time: replay must not stamp ctime with 0 (1970)."""
    s = fresh()
    s.apply(("make", ROOT_INO, b"f", REG, 0, 0, 0, b"", 2, 1_700_000_000_000_000_000))
    s.apply(("setxattr", 2, b"user.a", b"1"))
    assert s.ns.get(2).ctime_ns == 1_700_000_000_000_000_000
    s.apply(("removexattr", 2, b"user.a"))
    assert s.ns.get(2).ctime_ns == 1_700_000_000_000_000_000
    assert dump(rebuild(s)) == dump(s)
