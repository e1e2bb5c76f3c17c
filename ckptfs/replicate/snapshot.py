"""A replication snapshot: the durable state at one journal sequence number, as a manifest. Pure.

`take(durable, ...)` walks the namespace the journal describes (the store's
`DurableState`: what a crash would keep, never data still in memory) from
the root, parents before children, and returns the `Manifest` a restore
would read, plus one `Version` per distinct file version it names: its
version key, its size, the extents that hold its bytes on the devices and
the keys of its segments (segments.py): from `known` (the replicator's
versions already in the store), else from the digests the journal keeps,
else None (the replicator reads the bytes to name them).

A file a restore brought back and nobody changed since is named by the version
it came from (`version_key`), so a restored pool names the segments already
in the store and uploads none of them again.

Nothing here reads data. A version's content key and the CRC-32C of each
`chunk_size` piece of its object (holes and the zeros after a short chunk
included) come from the journal's own per-chunk lengths and CRCs: a piece
whose extent holds all of it has the extent's CRC; a hole or the zero tail
of a short extent extends that CRC over zeros. (An extent longer than its
piece cannot happen, as truncation lowers the chunk's high-water mark; such a
piece would get `None`, and the uploader fills it from the bytes it reads.)
"""
from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

import crc32c

from ..format.records import Extent
from ..fs.namespace import HIDDEN_XATTR, ROOT_INO
from ..store.durable import address_key
from . import segments
from .manifest import Entry, Manifest, content_key
from .plan import FILE_XATTR as RESTORE_MARK, ORIGIN_XATTR


def visible_xattrs(inode) -> dict[bytes, bytes]:
    """The attributes users set (ckptfs's own hidden ones, e.g. a restore's markers, stay home)."""
    return {k: v for k, v in inode.xattrs.items() if not k.startswith(HIDDEN_XATTR)}


def restoring(ns) -> bool:
    """Whether some file of namespace `ns` still waits for contents from an object store
    (replicate/restore.py marks each with a hidden attribute until it is whole): a manifest
    taken now would name torn files, so replication waits."""
    return any(any(k.startswith(RESTORE_MARK) for k in i.xattrs) for i in ns.inodes.values() if i.is_reg)


@dataclass
class Version:
    """One file version to have in the object store."""
    key: str  # its version key (manifest.content_key, or the version a restore brought back)
    ino: int
    size: int
    extents: dict[int, Extent]  # chunk index -> extent (a missing index is a hole)
    crcs: list  # CRC-32C of each chunk_size piece of the object (None: computed at upload)
    segments: list | None = None  # its segments' keys (None: not known without reading the bytes)

    def units(self) -> list[tuple[int, int]]:
        """The device units holding its bytes (to pin while they are read)."""
        return [(e.dev, e.unit) for e in self.extents.values()]


def version_key(inode, extents: dict[int, Extent]) -> str:
    """The version key of regular file `inode`'s durable contents (`extents`): the one a
    restore fetched them from while they are unchanged (plan.ORIGIN_XATTR, in the durable
    namespace only until a write's removal of it is), else their content key."""
    origin = inode.xattrs.get(ORIGIN_XATTR)
    return origin.decode() if origin else content_key(inode.ino, inode.size, extents)


def piece_crcs(size: int, chunk_size: int, extents: dict[int, Extent]) -> list:
    """The CRC-32C of each chunk_size piece of a file whose chunks are `extents`."""
    out: list = []
    zeros = b""
    for idx in range((size + chunk_size - 1) // chunk_size):
        plen = min(chunk_size, size - idx * chunk_size)
        ext = extents.get(idx)
        have, crc = (ext.length, ext.crc) if ext is not None else (0, 0)
        if have > plen:
            out.append(None)
            continue
        if have < plen:
            if len(zeros) < plen - have:
                zeros = bytes(chunk_size)
            crc = crc32c.crc32c(memoryview(zeros)[:plen - have], crc)
        out.append(crc)
    return out


def journaled_digest(durable):
    """`digest_of(extent)` over the digests the journal keeps (None: not kept for this extent)."""
    def digest_of(ext: Extent) -> bytes | None:
        got = durable.digests.get(address_key(ext))
        return got[1] if got is not None and got[0] == ext else None
    return digest_of


def take(durable, *, pool: str, seq: int, chunk_size: int, time_ns: int, generation: int = 0,
         segment_size: int | None = None, known: dict | None = None) -> tuple[Manifest, dict[str, Version]]:
    """The manifest of `durable` (a store.durable.DurableState) and its versions by version key.
    Its entries' segments are left empty: `name_segments` fills them once every version's are known."""
    seg = segment_size or segments.segment_size(chunk_size)
    known = known or {}
    digest_of = journaled_digest(durable)
    ns = durable.ns
    entries: list[Entry] = []
    versions: dict[str, Version] = {}
    by_ino: dict[int, Version] = {}
    todo = deque([(ROOT_INO, "")])
    while todo:
        dino, prefix = todo.popleft()
        for name, ino, _ in ns.inodes[dino].dir.list_from(0):
            inode = ns.inodes[ino]
            path = prefix + os.fsdecode(name)
            e = Entry(path=path, mode=inode.mode, uid=inode.uid, gid=inode.gid, mtime_ns=inode.mtime_ns,
                      ino=ino, target=inode.target, rdev=inode.rdev, xattrs=visible_xattrs(inode))
            if inode.is_reg:
                v = by_ino.get(ino)
                if v is None:
                    extents = dict(durable.files.get(ino, {}))
                    key = version_key(inode, extents)
                    v = versions.get(key)
                    if v is None:
                        v = Version(key, ino, inode.size, extents, piece_crcs(inode.size, chunk_size, extents))
                        v.segments = known.get(key) or segments.keys(inode.size, chunk_size, seg, extents,
                                                                      digest_of)
                    versions[key] = by_ino[ino] = v
                e.size, e.object, e.crcs = v.size, v.key, v.crcs
            elif inode.is_dir:
                todo.append((ino, path + "/"))
            entries.append(e)
    return Manifest(generation=generation, pool=pool, journal_seq=seq, time_ns=time_ns, chunk_size=chunk_size,
                    entries=entries, segment_size=seg), versions


def name_segments(manifest: Manifest, versions: dict[str, Version]) -> None:
    """Give each file entry its version's segment keys (all known by now)."""
    for e in manifest.entries:
        if e.size:
            e.segments = list(versions[e.object].segments)


def same_tree(a: Manifest, b: Manifest) -> bool:
    """Do two manifests describe the same tree (whatever their generation, sequence and time)?"""
    return a.pool == b.pool and a.chunk_size == b.chunk_size and a.segment_size == b.segment_size and \
        [e.to_json() for e in a.entries] == [e.to_json() for e in b.entries]
