"""What a restore does, decided without I/O: the tree to build, the chunks to fetch, the markers. Pure.

A restore (replicate/restore.py) turns the newest manifest into a live tree
at mount and then fetches file contents. Everything it decides lives here so
that it can be tested without S3 or a mount:

- `tree(manifest)`: the entries to create, parents first, each regular file
  once (later entries of the same source inode become hard links);
- the markers, hidden journaled xattrs (core.py: ``ckptfs.*`` names are never
  shown to users) that make a restore survive a crash:
  ``ckptfs.restore.source`` on the root (`Source`: URL, endpoint, manifest
  generation, and whether the tree is complete) and ``ckptfs.restore.object``
  on each file still to fetch (`FileMarker`: its object and size), and
  once the file is whole ``ckptfs.content.object`` (the object's key; any
  change to the file's bytes drops it, core.py): replication names that
  object instead of uploading the same bytes again (snapshot.py);
- `missing_chunks`: after a remount, which chunks of a file are not on the
  devices yet: a chunk is done when its durable extent has exactly the
  manifest's length and CRC-32C (the pool uses the manifest's chunk size, so
  a pool chunk is a manifest chunk and its extent's checksum is the
  manifest's);
- `runs`: missing chunks grouped into ranged GETs of consecutive chunks
  of one object;
- `fetch_order`: the background order, newest file first (the checkpoint a
  job resumes from is usually the newest), then by path.
"""
from __future__ import annotations

import json
import stat
from dataclasses import asdict, dataclass

from ..fs.namespace import CONTENT_XATTR
from . import segments
from .manifest import Entry, Manifest

SOURCE_XATTR = b"ckptfs.restore.source"
FILE_XATTR = b"ckptfs.restore.object"
ORIGIN_XATTR = CONTENT_XATTR + b"object"  # a restored file, unchanged since: the object it came from


@dataclass(frozen=True)
class Source:
    """Where a restore comes from (the root's marker)."""
    url: str
    endpoint: str | None
    generation: int
    complete_tree: bool = False  # False while the tree is being built: a crash then restarts it

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Source:
        d = json.loads(raw)
        return cls(d["url"], d.get("endpoint"), int(d["generation"]), bool(d.get("complete_tree")))


@dataclass(frozen=True)
class FileMarker:
    """Which object a file still comes from."""
    object: str
    size: int

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> FileMarker:
        d = json.loads(raw)
        return cls(d["object"], int(d["size"]))


@dataclass(frozen=True)
class Step:
    """One entry to create: `link_to` is the path of an earlier entry of the same inode (a hard link)."""
    entry: Entry
    parent: str  # "" for the root
    name: str
    link_to: str | None = None


def is_root(entry: Entry) -> bool:
    return entry.path in ("", ".", "/")


def tree(manifest: Manifest) -> list[Step]:
    """Steps to build the manifest's tree, parents first; raises ValueError on an entry whose
    parent is not a directory listed before it."""
    dirs = {""}
    first_of: dict[int, str] = {}
    steps = []
    for e in manifest.entries:
        if is_root(e):
            continue
        path = e.path.strip("/")
        parent, _, name = path.rpartition("/")
        if parent not in dirs:
            raise ValueError(f"manifest entry {path!r} comes before its directory {parent!r}")
        if stat.S_ISDIR(e.mode):
            dirs.add(path)
            steps.append(Step(e, parent, name))
            continue
        if e.ino and e.ino in first_of and not stat.S_ISDIR(e.mode):
            steps.append(Step(e, parent, name, link_to=first_of[e.ino]))
            continue
        if e.ino:
            first_of[e.ino] = path
        steps.append(Step(e, parent, name))
    return steps


def root_entry(manifest: Manifest) -> Entry | None:
    return next((e for e in manifest.entries if is_root(e)), None)


def missing_chunks(size: int, chunk_size: int, crcs: list[int], extents: dict) -> list[int]:
    """Chunks of a file of `size` bytes not yet on the devices as the manifest has them.

    `extents`: chunk index -> an object with `length` and `crc` (the file's durable extents)."""
    out = []
    for i in range(segments.count(size, chunk_size)):
        ext = extents.get(i)
        want = segments.length(i, size, chunk_size)
        if ext is None or ext.length != want or i >= len(crcs) or ext.crc != crcs[i]:
            out.append(i)
    return out


def runs(indexes: list[int], max_chunks: int, span: int = 0) -> list[tuple[int, int]]:
    """Sorted chunk indexes as (first, last) runs of consecutive chunks, at most `max_chunks` each,
    none across a multiple of `span` chunks (0: no such bound; a run then lies in one segment)."""
    out: list[tuple[int, int]] = []
    for i in sorted(indexes):
        if out and out[-1][1] == i - 1 and i - out[-1][0] < max_chunks and not (span and i % span == 0):
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def byte_range(first: int, last: int, size: int, chunk_size: int) -> tuple[int, int]:
    """The object's bytes [start, end) of chunks first..last."""
    return first * chunk_size, min(size, (last + 1) * chunk_size)


def fetch_order(entries: list[Entry]) -> list[Entry]:
    """Background order: newest modification first, then path."""
    return sorted(entries, key=lambda e: (-e.mtime_ns, e.path))


def check_crcs(entry: Entry, chunk_size: int) -> None:
    """A file entry must list one CRC per chunk; ValueError otherwise."""
    n = -(-entry.size // chunk_size)
    if len(entry.crcs) != n:
        raise ValueError(f"manifest entry {entry.path!r}: {len(entry.crcs)} chunk checksums for "
                         f"{entry.size} bytes ({n} chunks of {chunk_size})")
