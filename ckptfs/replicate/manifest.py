"""The object-store layout of a replicated pool: URLs, keys, manifests. Pure (no I/O, no boto3).

A pool replicated to ``s3://BUCKET/PREFIX`` keeps these objects under PREFIX
(docs/FORMAT.md, "Object store layout"):

    PREFIX/segments/<key>                 `segment_size` bytes of a file, named by their
                                          content (segments.py), shared by every file and
                                          generation that holds them
    PREFIX/manifests/<generation>.json    the tree as of one journal sequence number
    PREFIX/objects/<content key>          a whole file version (format 1 manifests only:
                                          read and collected, no longer written)

A version key names one version of one file's contents; it is derived from
what the journal already knows (inode, size, and each chunk's extent: where
it lives, its length and CRC-32C), so a file whose contents did not change
keeps its key, and a remounted daemon can tell which versions a manifest
already holds, and their segments, without reading any data. Metadata is not in the key (the
manifest carries it per entry): a chmod or utime names the same version, and
the next manifest only records the new attributes. A rewritten chunk changes
the key twice over: its CRC-32C, and its unit (the version it replaces holds
its own units until the new one is durable). A manifest lists every directory, file and symlink with its
attributes, and for files the version key, its segments' keys in file order
and the per-chunk CRC-32Cs (a restore checks every chunk it fetches): one CRC
per `chunk_size` piece of the file, ceil(size / chunk_size) of them, computed
over the piece's bytes as read() returns them (holes and the zeros after a
short chunk included; the last piece is shorter). The root directory is not an entry. Manifests are numbered by
`generation`, zero-padded so that the lexically greatest key is the newest;
a manifest is written only after every object it names is uploaded (the
prefix rule, docs/SEMANTICS.md), so the newest manifest is always whole.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import stat
from dataclasses import dataclass, field

from ..errors import FsError
from . import segments

FORMAT = 2
READS = (1, 2)  # the formats this ckptfs restores from
MANIFESTS = "manifests/"
OBJECTS = "objects/"  # format 1: one object per file version
_GEN_DIGITS = 16
_MANIFEST_NAME = re.compile(r"^(\d{%d})\.json$" % _GEN_DIGITS)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


class BadManifest(FsError):
    """A manifest that cannot be decoded (truncated, another format, wrong fields)."""


@dataclass(frozen=True)
class S3Url:
    """A bucket and key prefix, as `parse_url` reads ``s3://BUCKET/PREFIX``."""
    bucket: str
    prefix: str  # "" or "a/b/" (always ends with "/" when not empty)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def key(self, rel: str) -> str:
        return self.prefix + rel


def parse_url(url: str) -> S3Url:
    """``s3://bucket[/prefix]`` -> S3Url; anything else raises ValueError with one clear line."""
    if not url.startswith("s3://"):
        raise ValueError(f"{url!r} is not an s3:// URL (expected s3://BUCKET/PREFIX)")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise ValueError(f"{url!r}: {bucket!r} is not a valid bucket name (3-63 characters: a-z 0-9 . -)")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise ValueError(f"{url!r}: the prefix may not contain empty, '.' or '..' parts")
    return S3Url(bucket, prefix + "/" if prefix else "")


def manifest_name(generation: int) -> str:
    return f"{MANIFESTS}{generation:0{_GEN_DIGITS}d}.json"


def manifest_generation(name: str) -> int | None:
    """The generation of a key relative to the prefix (``manifests/…json``), None for other keys."""
    if not name.startswith(MANIFESTS):
        return None
    m = _MANIFEST_NAME.match(name[len(MANIFESTS):])
    return int(m.group(1)) if m else None


def content_key(ino: int, size: int, extents: dict) -> str:
    """The version key of one file version: `extents` is its durable chunks, index -> Extent
    (format/records.py: dev, unit, length, crc)."""
    h = hashlib.sha256(f"{ino}:{size}:".encode())
    for idx, ext in sorted(extents.items()):
        h.update(idx.to_bytes(8, "little") + ext.dev.to_bytes(4, "little") + ext.unit.to_bytes(8, "little")
                 + ext.length.to_bytes(8, "little") + ext.crc.to_bytes(4, "little"))
    return h.hexdigest()[:40]


@dataclass
class Entry:
    """One name in the tree. `path` is relative to the mount root, '/'-separated, no leading '/'."""
    path: str
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    ino: int = 0  # the inode number in the pool it came from: equal inos are hard links
    size: int = 0
    object: str = ""  # regular files: the version key (format 1: the object holding it whole)
    crcs: list[int] = field(default_factory=list)  # regular files: CRC-32C of each chunk
    segments: list[str] = field(default_factory=list)  # regular files (format 2): the keys of its segments
    target: bytes = b""  # symlinks
    rdev: int = 0  # character and block devices: the device number
    xattrs: dict[bytes, bytes] = field(default_factory=dict)

    def to_json(self) -> dict:
        d = {"path": self.path, "mode": self.mode, "uid": self.uid, "gid": self.gid,
             "mtime_ns": self.mtime_ns, "ino": self.ino}
        if stat.S_ISREG(self.mode):
            d.update(size=self.size, object=self.object, crcs=self.crcs)
            if self.segments:
                d["segments"] = self.segments
        if stat.S_ISLNK(self.mode):
            d["target"] = _b64(self.target)
        if self.rdev:
            d["rdev"] = self.rdev
        if self.xattrs:
            d["xattrs"] = {_b64(k): _b64(v) for k, v in self.xattrs.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> Entry:
        return cls(path=d["path"], mode=d["mode"], uid=d["uid"], gid=d["gid"], mtime_ns=d["mtime_ns"],
                   ino=d.get("ino", 0), size=d.get("size", 0), object=d.get("object", ""),
                   crcs=list(d.get("crcs", [])), segments=list(d.get("segments", [])),
                   target=_unb64(d.get("target", "")), rdev=d.get("rdev", 0),
                   xattrs={_unb64(k): _unb64(v) for k, v in d.get("xattrs", {}).items()})


@dataclass
class Manifest:
    """The tree of one durable state, as stored at ``manifests/<generation>.json``: the pool and
    journal seq it was taken at, and every entry. Made by `snapshot.take`; never changed after."""
    generation: int
    pool: str  # the pool id (hex) that wrote it
    journal_seq: int  # the journal sequence number whose durable state this is
    time_ns: int  # wall-clock time the state was taken
    chunk_size: int  # the chunk size the crcs are computed over
    entries: list[Entry]  # parents before children (the order a restore creates them in)
    segment_size: int = 0  # the bytes of each segment but a file's last (0: format 1, whole objects)

    def objects(self) -> set[str]:
        """The keys of the objects its files' bytes are in."""
        return {k for e in self.entries if e.size for k, _, _ in self.pieces(e)}

    def pieces(self, e: Entry) -> list[tuple[str, int, int]]:
        """(object key, offset in the file, length) of each object holding file `e`'s bytes, in order."""
        if not self.segment_size:
            return [(e.object, 0, e.size)] if e.size else []
        seg = self.segment_size
        return [(k, i * seg, segments.length(i, e.size, seg)) for i, k in enumerate(e.segments)]

    def encode(self) -> bytes:
        return json.dumps({"format": FORMAT, "generation": self.generation, "pool": self.pool,
                           "journal_seq": self.journal_seq, "time_ns": self.time_ns,
                           "chunk_size": self.chunk_size, "segment_size": self.segment_size,
                           "entries": [e.to_json() for e in self.entries]},
                          separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes, name: str = "manifest") -> Manifest:
        try:
            d = json.loads(raw)
            if d.get("format") not in READS:
                raise BadManifest(f"{name}: format {d.get('format')!r}, this ckptfs reads "
                                  f"{' and '.join(map(str, READS))}")
            m = cls(generation=d["generation"], pool=d["pool"], journal_seq=d["journal_seq"],
                    time_ns=d["time_ns"], chunk_size=d["chunk_size"],
                    entries=[Entry.from_json(e) for e in d["entries"]],
                    segment_size=d["segment_size"] if d["format"] >= 2 else 0)
            m.check()
            return m
        except BadManifest:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BadManifest(f"{name}: not a ckptfs manifest ({type(e).__name__}: {e})") from None


    def check(self) -> None:
        """ValueError unless every file lists a whole number of segments (format 2)."""
        seg = self.segment_size
        if seg and seg % self.chunk_size:
            raise ValueError(f"segment size {seg} is not a whole number of {self.chunk_size}-byte chunks")
        for e in self.entries:
            if seg and e.size and len(e.segments) != segments.count(e.size, seg):
                raise ValueError(f"entry {e.path!r}: {len(e.segments)} segments for {e.size} bytes")


def unreferenced(objects: set[str], kept: list[Manifest]) -> set[str]:
    """Objects (content keys) that no kept manifest names: safe to delete."""
    named = set().union(*(m.objects() for m in kept)) if kept else set()
    return objects - named


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s)
