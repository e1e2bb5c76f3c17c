"""A restore before it serves: the manifest loaded, the tree built, what is still remote found.

`load_manifest` fetches a manifest (the newest, or a given generation) and
turns every failure into `SourceError` (one line, for the CLI and the
daemon). A fresh restore checks the pool (`check_fresh`) and then `build`s
the manifest's whole tree through the core before the mount goes live
(directories, files at their final sizes, symlinks, hard links, modes,
owners, times, xattrs; every step an ordinary journal record), handing each
file with contents to the Restorer (restore.py) as a gated job. The root's
hidden source marker is set first and marked complete last, so a crash
midway is seen at the next mount (`interrupted_build`) and the restore starts
over on a fresh pool; after a complete build, `still_remote` finds the files
whose markers say their contents are not all local yet.
"""
from __future__ import annotations

import logging
import stat

from ..fs.namespace import HIDDEN_XATTR, ROOT_INO
from . import lineage, plan
from .client import S3Error, Target
from .manifest import MANIFESTS, BadManifest, Entry, Manifest

log = logging.getLogger("ckptfs.restore")


class SourceError(Exception):
    """The object store cannot give what a restore needs; the message says why, in one line."""


class NothingReplicated(SourceError):
    """The prefix holds no manifest: nothing was ever replicated there (or all of it was deleted)."""


def load_manifest(target: Target, generation: int | None = None) -> Manifest:
    """In a worker thread: the manifest of `generation` (None: the newest) under `target`'s prefix."""
    try:
        if generation is None:
            gens = target.generations()
            if not gens:
                raise NothingReplicated(f"no manifest under {target.url}: nothing was replicated there "
                                        f"(expected {target.url}{MANIFESTS}<generation>.json)")
            generation = gens[-1]
        return target.manifest(generation)
    except (S3Error, BadManifest) as e:
        raise SourceError(str(e)) from None


def check_fresh(fs, store, manifest: Manifest) -> None:
    """SourceError unless `manifest` can be restored into this pool: freshly formatted, with the
    manifest's chunk size, every file's chunk checksums present."""
    root = fs.ns.get(ROOT_INO)
    if root.dir.entries or plan.SOURCE_XATTR in root.xattrs:
        raise SourceError("the pool is not empty: a restore needs a freshly formatted pool (--format)")
    if manifest.chunk_size != store.chunk_size:
        raise SourceError(f"the manifest's chunk size {manifest.chunk_size} differs from the pool's "
                          f"{store.chunk_size}")
    for step in plan.tree(manifest):
        if stat.S_ISREG(step.entry.mode) and step.link_to is None:
            plan.check_crcs(step.entry, manifest.chunk_size)


def build(r, manifest: Manifest) -> None:
    """Create the manifest's tree through the core, each file gated until restored by `r` (a
    restore.Restorer: its `add_job`, then `use_manifest`). Runs in the trio thread before the mount
    is live; every step is an ordinary journal record."""
    fs, store, source = r.fs, r.store, r.source
    ns = fs.ns
    steps = plan.tree(manifest)
    ns.setxattr(ROOT_INO, plan.SOURCE_XATTR, source.encode())  # first: a crash before the tree is whole restarts
    # this pool continues the manifest's: it may replicate to that prefix from now on (lineage.py)
    ns.setxattr(ROOT_INO, lineage.LINEAGE_XATTR, lineage.encode(lineage.of(ns) | {manifest.pool}))
    ino_of = {"": ROOT_INO}
    for step in steps:
        e = step.entry
        parent, name = ino_of[step.parent], step.name.encode("utf-8", "surrogateescape")
        path = e.path.strip("/")
        if step.link_to is not None:
            inode = fs.link(ino_of[step.link_to], parent, name)
            fs.forget(inode.ino, 1)
            ino_of[path] = inode.ino
            continue
        if stat.S_ISDIR(e.mode):
            inode = fs.mkdir(parent, name, e.mode, e.uid, e.gid)
        elif stat.S_ISLNK(e.mode):
            inode = fs.symlink(parent, name, e.target, e.uid, e.gid)
        else:
            inode = fs.mknod(parent, name, e.mode, e.rdev, e.uid, e.gid)
        fs.forget(inode.ino, 1)  # no kernel lookup stands behind this one
        ino_of[path] = inode.ino
        _set_attrs(ns, inode, e)
        if stat.S_ISREG(e.mode):
            if e.size:
                ns.setxattr(inode.ino, plan.FILE_XATTR, plan.FileMarker(e.object, e.size).encode())
                r.add_job(inode, e.object, e.size)
            elif e.object:  # whole already: named by its object from the start (plan.ORIGIN_XATTR)
                ns.setxattr(inode.ino, plan.ORIGIN_XATTR, e.object.encode())
            inode.size = e.size
            store.dirtied(inode)
            store.closed(inode)  # the file, at its size, with nothing fetched yet
    for step in reversed(steps):  # directory times last: creating entries moved them
        if stat.S_ISDIR(step.entry.mode):
            ns.setattr(ino_of[step.entry.path.strip("/")], atime_ns=step.entry.mtime_ns,
                       mtime_ns=step.entry.mtime_ns)
    top = plan.root_entry(manifest)
    if top is not None:
        _set_attrs(ns, ns.get(ROOT_INO), top)
    ns.setxattr(ROOT_INO, plan.SOURCE_XATTR, plan.Source(source.url, source.endpoint, source.generation,
                                                         complete_tree=True).encode())
    r.use_manifest(manifest)
    log.info("restore.started", extra={"fields": {
        "source": source.url, "generation": source.generation, "entries": len(steps),
        "files": r.files_total, "bytes": r.bytes_total}})


def _set_attrs(ns, inode, e: Entry) -> None:
    for k, v in e.xattrs.items():
        if not k.startswith(HIDDEN_XATTR):
            ns.setxattr(inode.ino, k, v)
    mode = None if stat.S_ISLNK(e.mode) else e.mode & 0o7777
    ns.setattr(inode.ino, mode=mode, uid=e.uid, gid=e.gid, atime_ns=e.mtime_ns, mtime_ns=e.mtime_ns)


def interrupted_build(ns) -> plan.Source | None:
    """The source of a restore whose tree was never completely built (a crash during `build`)."""
    raw = ns.get(ROOT_INO).xattrs.get(plan.SOURCE_XATTR)
    if raw is None:
        return None
    source = plan.Source.decode(raw)
    return None if source.complete_tree else source


def still_remote(ns, endpoint: str | None = None):
    """After a remount: (the recorded source, or None where files are marked but no source is
    recorded; [(inode, its FileMarker)] of the files still remote), or None when nothing is.
    `endpoint` overrides the recorded one."""
    raw = ns.get(ROOT_INO).xattrs.get(plan.SOURCE_XATTR)
    marked = [i for i in ns.inodes.values() if i.is_reg and plan.FILE_XATTR in i.xattrs]
    if raw is None and not marked:
        return None
    source = plan.Source.decode(raw) if raw is not None else None
    if source is not None and endpoint:
        source = plan.Source(source.url, endpoint, source.generation, source.complete_tree)
    return source, [(inode, plan.FileMarker.decode(inode.xattrs[plan.FILE_XATTR])) for inode in marked]
