"""Publish a local directory tree to an S3 prefix as a replicator would: objects plus a manifest.

    manifest = publish(client, "bucket", "node0/", Path("tree"), chunk_size=1 << 20)
    manifest = publish(..., segment_size=4 << 20)   # format 2, as ckptfs replicates now

Each regular file becomes one object under PREFIX/objects/ named by its
content key (manifest format 1, which restores still read), or with
`segment_size` segments under PREFIX/segments/ named by their content
(format 2), with a CRC-32C per chunk in the manifest; directories, symlinks,
hard links (equal inode numbers), modes, owners, mtimes and user xattrs go in
the manifest, parents first, the root as the entry "". The manifest goes to
PREFIX/manifests/<generation>.json last, as the prefix rule wants. The
restore tests use it in place of the uploader (ckptfs mount --replicate).
"""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import crc32c

from ckptfs.format.records import Extent
from ckptfs.replicate import segments
from ckptfs.replicate.manifest import OBJECTS, Entry, Manifest, content_key, manifest_name, parse_url


def chunk_crcs(data: bytes, chunk_size: int) -> list[int]:
    view = memoryview(data)
    return [crc32c.crc32c(view[i:i + chunk_size]) for i in range(0, len(data), chunk_size)]


def _xattrs(path: Path) -> dict[bytes, bytes]:
    out = {}
    for name in os.listxattr(path, follow_symlinks=False):
        if name.startswith("user."):
            out[name.encode()] = os.getxattr(path, name, follow_symlinks=False)
    return out


def _entry(root: Path, path: Path, chunk_size: int) -> tuple[Entry, bytes | None]:
    st = os.lstat(path)
    rel = "" if path == root else path.relative_to(root).as_posix()
    e = Entry(path=rel, mode=st.st_mode, uid=st.st_uid, gid=st.st_gid, mtime_ns=st.st_mtime_ns, ino=st.st_ino,
              xattrs=_xattrs(path), rdev=st.st_rdev if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else 0)
    data = None
    if stat.S_ISREG(st.st_mode):
        data = path.read_bytes()
        e.size = len(data)
        e.crcs = chunk_crcs(data, chunk_size)
        lengths = [min(chunk_size, len(data) - i) for i in range(0, len(data), chunk_size)]
        e.object = OBJECTS + content_key(st.st_ino, len(data), {i: Extent(0, st.st_mtime_ns + i, n, crc)  # made-up units
                                                      for i, (n, crc) in enumerate(zip(lengths, e.crcs))})
    elif stat.S_ISLNK(st.st_mode):
        e.target = os.fsencode(os.readlink(path))
    return e, data


def _segments(e: Entry, data: bytes, chunk_size: int, seg: int) -> list[tuple[str, bytes]]:
    """Format 2: the file's segments, (key, bytes) each; their keys go into the entry."""
    out = []
    for i in range(segments.count(len(data), seg)):
        body = data[i * seg:(i + 1) * seg]
        layout = [(min(chunk_size, len(body) - p),) * 2 for p in range(0, len(body), chunk_size)]
        out.append((segments.key_from_bytes(memoryview(body), layout), body))
    e.object = e.object[len(OBJECTS):]  # a version key, no object of its own
    e.segments = [k for k, _ in out]
    return out


def publish(client, bucket: str, prefix: str, root: Path, *, chunk_size: int = 1 << 20, generation: int = 1,
            create_bucket: bool = True, segment_size: int = 0) -> Manifest:
    """Upload `root`'s tree under s3://bucket/prefix; the manifest (already uploaded)."""
    url = parse_url(f"s3://{bucket}/{prefix}")
    if create_bucket:
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except client.exceptions.BucketAlreadyExists:
            pass
    entries = []
    uploaded = set()
    todo = [Path(root)]
    while todo:  # parents first: each directory before what it holds
        path = todo.pop(0)
        e, data = _entry(Path(root), path, chunk_size)
        entries.append(e)
        pieces = _segments(e, data, chunk_size, segment_size) if segment_size and data else [(e.object, data)]
        for key, body in pieces:
            if body is not None and key not in uploaded:
                client.put_object(Bucket=bucket, Key=url.key(key), Body=body)
                uploaded.add(key)
        if stat.S_ISDIR(e.mode):
            todo.extend(sorted(path.iterdir()))
    manifest = Manifest(generation=generation, pool="seed", journal_seq=generation, time_ns=time.time_ns(),
                        chunk_size=chunk_size, entries=entries, segment_size=segment_size)
    client.put_object(Bucket=bucket, Key=url.key(manifest_name(generation)), Body=manifest.encode())
    return manifest
