"""The object store without a mount: list, inspect, verify, restore and prune a replicated pool.

What `ckptfs replicas ...` runs (cli.py), on a `Target` (client.py), blocking:

    generations(target)      every manifest: number, time, files, bytes, the bytes of the
                             objects it names that no older one names (what it added to
                             the store), the pool that wrote it
    parse_at(text, now)      --at TIME: an ISO 8601 time (local unless it has an offset) or a
                             span ago (90m, 2h, 1d) -> wall-clock seconds
    choose(target, generation=None, at=None)
                             the manifest of a generation, the newest written at or before
                             a time, or the newest
    verify(target, read_data=False)
                             every object (segment, or a format 1 file's whole object) a
                             manifest names is there with the size it should have; with
                             read_data every chunk's CRC-32C too, each object read once
    restore(target, manifest, directory, paths=None, progress=None)
                             plain files into a directory, no mount: directories, files
                             (each chunk checked against its CRC-32C, written to a
                             temporary name and renamed into place), symlinks, hard
                             links, modes, times, user xattrs
    prune(target, policy, now, dry_run=False, grace=GRACE)
                             the retention policy (retention.py) by hand: the manifests
                             it no longer keeps, then the objects no remaining manifest
                             names and that are older than `grace` (a replicating
                             daemon may have uploaded them for a manifest it has not
                             written yet)

Each raises `S3Error` (one line with its cause) for a failed call and
`ReplicaError` for what it finds wrong.
"""
from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import crc32c

from . import plan, retention
from .client import Target
from .manifest import OBJECTS, BadManifest, Manifest, manifest_name, unreferenced
from .segments import SEGMENTS

GRACE = 3600.0  # seconds an unnamed object is left to a daemon that may be about to name it
RANGE_BYTES = 16 << 20  # one GET reads at most this much of an object


class ReplicaError(Exception):
    """What the store holds is not what a manifest says, or a restore cannot go on; one line."""


@dataclass(frozen=True)
class Generation:
    """One manifest, summed up (None fields: it could not be read)."""
    generation: int
    time: float | None  # wall-clock seconds the state was taken
    files: int | None
    bytes: int | None
    pool: str | None
    error: str | None = None
    new_bytes: int | None = None  # its objects no older generation names


def _manifests(target: Target):
    """(generation, its Manifest or the BadManifest it could not be read as), oldest first."""
    for g in target.generations():
        try:
            yield g, target.manifest(g)
        except BadManifest as e:
            yield g, e


def generations(target: Target) -> list[Generation]:
    out = []
    seen: set[str] = set()
    for g, m in _manifests(target):
        if isinstance(m, BadManifest):
            out.append(Generation(g, None, None, None, None, str(m)))
            continue
        files = {e.ino or id(e): e.size for e in m.entries if stat.S_ISREG(e.mode)}
        new = 0
        for e in m.entries:
            for key, _, length in m.pieces(e):
                if key not in seen:
                    seen.add(key)
                    new += length
        out.append(Generation(g, m.time_ns / 1e9, len(files), sum(files.values()), m.pool, new_bytes=new))
    return out


def parse_at(text: str, now: float | None = None) -> float:
    """--at TIME -> wall-clock seconds; ValueError (one line) when it is neither form."""
    now = time.time() if now is None else now
    try:
        return now - retention.parse_span(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise ValueError(f"bad time {text!r}: expected 2026-12-06T09:30[:00][+00:00] or a span ago "
                         f"(90m, 2h, 1d)") from None


def choose(target: Target, generation: int | None = None, at: float | None = None) -> Manifest:
    """The manifest of `generation`, or the newest written at or before wall-clock time `at`, or the
    newest; ReplicaError when there is none such."""
    gens = target.generations()
    if not gens:
        raise ReplicaError(f"no manifest under {target.url}: nothing was replicated there")
    if generation is not None:
        if generation not in gens:
            raise ReplicaError(f"{target.url} has no generation {generation} (it has {_span(gens)})")
        return target.manifest(generation)
    if at is None:
        return target.manifest(gens[-1])
    for g in reversed(gens):
        m = target.manifest(g)
        if m.time_ns / 1e9 <= at:
            return m
    raise ReplicaError(f"no generation under {target.url} is as old as {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(at))}")


def _span(gens: list[int]) -> str:
    return f"{gens[0]}" if len(gens) == 1 else f"{gens[0]}..{gens[-1]}, {len(gens)} in all"


def _stored(target: Target, detailed: bool = False) -> dict:
    """Every object under the prefix that holds file bytes: relative key -> size (or (size, time))."""
    listing = target.list_detailed if detailed else target.list
    return {**listing(OBJECTS), **listing(SEGMENTS)}


def verify(target: Target, read_data: bool = False, progress=None) -> list[str]:
    """Problems found (empty: every manifest decodes, and every object one names is there with its
    size, and with `read_data` its chunks' CRC-32Cs)."""
    problems: list[str] = []
    objects = _stored(target)
    checked: set[str] = set()
    for g, m in _manifests(target):
        if isinstance(m, BadManifest):
            problems.append(f"generation {g}: {m}")
            continue
        for e in m.entries:
            if not stat.S_ISREG(e.mode):
                continue
            for key, off, length in m.pieces(e):
                if key in checked:
                    continue
                checked.add(key)
                got = objects.get(key)
                if got is None:
                    problems.append(f"generation {g}: {e.path}: object {key} is missing")
                elif got != length:
                    problems.append(f"generation {g}: {e.path}: object {key} holds {got} bytes, not {length}")
                elif read_data:
                    problems += [f"generation {g}: {e.path}: {p}"
                                 for p in _check_object(target, e, m.chunk_size, key, off, length)]
                if progress is not None:
                    progress(len(checked))
    return problems


def _object_chunks(target: Target, key: str, off: int, length: int, chunk_size: int):
    """(file chunk index, bytes) of each chunk of object `key`, which holds the file's bytes
    [off, off + length), read in ranged GETs."""
    step = max(chunk_size, RANGE_BYTES // chunk_size * chunk_size)
    for start in range(0, length, step):
        data = memoryview(target.get(key, start, min(length, start + step)))
        for pos in range(0, len(data), chunk_size):
            yield (off + start + pos) // chunk_size, data[pos:pos + chunk_size]


def _chunks(target: Target, manifest: Manifest, entry):
    """(index, bytes) of each chunk of file `entry`, object by object."""
    for key, off, length in manifest.pieces(entry):
        yield from _object_chunks(target, key, off, length, manifest.chunk_size)


def _check_object(target: Target, entry, chunk_size: int, key: str, off: int, length: int) -> list[str]:
    return [f"chunk {i}: CRC-32C {crc32c.crc32c(b):08x}, the manifest says {entry.crcs[i]:08x}"
            for i, b in _object_chunks(target, key, off, length, chunk_size) if crc32c.crc32c(b) != entry.crcs[i]]


def restore(target: Target, manifest: Manifest, directory: str | os.PathLike, paths: list[str] | None = None,
            progress=None) -> tuple[int, int]:
    """Write `manifest`'s tree (or only `paths` and what is below them) into `directory` as plain
    files; (files, bytes) written. A chunk whose CRC-32C does not match stops it (ReplicaError)
    before that file gets its name. `progress(bytes_done)` is called as data arrives."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    wanted = [p.strip("/") for p in paths] if paths else None

    def chosen(path: str) -> bool:
        return wanted is None or any(path == w or path.startswith(w + "/") or w.startswith(path + "/")
                                     for w in wanted)

    made: dict[str, Path] = {}
    files = done = 0
    dirs = []
    for step in plan.tree(manifest):
        e = step.entry
        path = e.path.strip("/")
        if not chosen(path):
            continue
        dest = root / path
        if step.link_to is not None:
            if step.link_to in made:
                dest.unlink(missing_ok=True)
                os.link(made[step.link_to], dest)
            continue
        if stat.S_ISDIR(e.mode):
            dest.mkdir(parents=True, exist_ok=True)
            dirs.append((dest, e))
        elif stat.S_ISLNK(e.mode):
            dest.unlink(missing_ok=True)
            os.symlink(os.fsdecode(e.target), dest)
            os.utime(dest, ns=(e.mtime_ns, e.mtime_ns), follow_symlinks=False)
            made[path] = dest
            continue
        elif stat.S_ISREG(e.mode):
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.ckptfs-restore")
            with open(tmp, "wb") as f:
                if e.size:
                    for i, b in _chunks(target, manifest, e):
                        if crc32c.crc32c(b) != e.crcs[i]:
                            f.close()
                            tmp.unlink()
                            raise ReplicaError(f"{e.path}: chunk {i} of version {e.object} does not match its "
                                               f"CRC-32C: not restored")
                        f.write(b)
                        done += len(b)
                        if progress is not None:
                            progress(done)
            os.replace(tmp, dest)
            files += 1
        else:
            continue  # devices, fifos, sockets: not plain files
        _set_attrs(dest, e)
        made[path] = dest
    for dest, e in reversed(dirs):  # directory times last: creating entries moved them
        _set_attrs(dest, e)
    return files, done


def _set_attrs(dest: Path, e) -> None:
    for k, v in e.xattrs.items():
        if k.startswith(b"user."):
            try:
                os.setxattr(dest, k, v)
            except OSError:
                pass  # a filesystem without user xattrs: the data is what matters
    os.chmod(dest, stat.S_IMODE(e.mode))
    try:
        os.chown(dest, e.uid, e.gid)
    except PermissionError:
        pass  # not root: the files are the restoring user's
    os.utime(dest, ns=(e.mtime_ns, e.mtime_ns))


@dataclass(frozen=True)
class Pruned:
    """What `prune` removed (or would, with dry_run)."""
    manifests: list[int]
    objects: list[str]
    kept: list[int]
    young: int  # unnamed objects left for their grace period


def prune(target: Target, policy: retention.Policy, now: float | None = None, dry_run: bool = False,
          grace: float = GRACE) -> Pruned:
    now = time.time() if now is None else now
    manifests = dict(_manifests(target))
    times = {g: None if isinstance(m, BadManifest) else m.time_ns / 1e9 for g, m in manifests.items()}
    drop = retention.forget(times, policy, now)
    kept = sorted(g for g in times if g not in drop)
    listing = _stored(target, detailed=True)
    unnamed = unreferenced(set(listing), [manifests[g] for g in kept if times[g] is not None])
    old = sorted(k for k in unnamed if now - listing[k][1] >= grace)
    if not dry_run:
        target.delete([manifest_name(g) for g in drop])
        target.delete(old)
    return Pruned(drop, old, kept, len(unnamed) - len(old))

