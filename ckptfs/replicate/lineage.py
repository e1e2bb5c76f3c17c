"""One writer per prefix: which pool may replicate to a prefix that already holds manifests. Pure.

Replication collects what no kept manifest names (replicator.py, step 5), so
two pools writing manifests under one prefix would delete each other's
objects (two nodes given the same NODE_RANK, a fresh pool pointed at an old
prefix, a cloned node image) and could even write the same generation over
each other. A pool therefore writes to a prefix only when the newest
manifest there was written by

- nobody (an empty prefix),
- this pool (a remount: the pool id is in every manifest),
- a pool this pool continues, its *lineage*: a restore (restore.py) records
  the pool of the manifest it restores in a hidden journaled attribute of the
  root (`LINEAGE_XATTR`, with the restored tree), so a replacement node that
  restores from its predecessor's prefix replicates there afterwards, across
  remounts and crashes, or
- any pool, when the mount says `--replicate-takeover` (the operator knows
  the old pool is gone for good; its states are collected once
  the retention policy drops them).

Otherwise the mount is refused with one line (`refusal`), and a replicator
that finds it so at its start writes and deletes nothing. Once it runs, a
manifest newer than the last one it wrote or found (`newer`) means a second
writer: replication stops before its next manifest or collection (cause
`conflict`, in status and the log) and stays stopped; the local filesystem
keeps working. The check lists the manifests at the end of every cycle,
before its manifest and its collection. Two pools that list within the same
moment and then write the same generation are told apart by the store: a
manifest is put only if its name is free (If-None-Match: *, client.py
`put_new`), so the second finds the first's there and stops the same way.
Two that write different generations in that moment both land, but neither
collects the other's objects before its next cycle's check stops one of
them. (A store that does not implement the condition gets plain puts: there
the same generation would be overwritten.)
"""
from __future__ import annotations

import json
import time

from ..fs.namespace import ROOT_INO
from .manifest import Manifest

LINEAGE_XATTR = b"ckptfs.replicate.lineage"  # on the root: JSON list of the pool ids (hex) this pool continues


def of(ns) -> frozenset[str]:
    """The pools the namespace's pool continues (a `Namespace`, live or durable; None: none)."""
    raw = ns.get(ROOT_INO).xattrs.get(LINEAGE_XATTR) if ns is not None else None
    if not raw:
        return frozenset()
    try:
        pools = json.loads(raw)
    except ValueError:
        return frozenset()
    return frozenset(p for p in pools if isinstance(p, str)) if isinstance(pools, list) else frozenset()


def encode(pools) -> bytes:
    return json.dumps(sorted(pools)).encode()


def refusal(newest: Manifest | None, pool: str, lineage: frozenset[str], takeover: bool, url: str) -> str | None:
    """Why `pool` must not replicate to `url`, whose newest manifest is `newest` (None: it may)."""
    if newest is None or takeover or newest.pool == pool or newest.pool in lineage:
        return None
    when = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(newest.time_ns / 1e9))
    return (f"{url} holds the checkpoints of another pool (pool {newest.pool[:16]}, manifest {newest.generation} "
            f"of {when}): replicating this pool there would delete them. Give this node a prefix of its "
            f"own, restore from that one first (--format --restore-from {url}), or pass "
            f"--replicate-takeover if that pool is gone for good")


def newer(generations, known: int) -> list[int]:
    """The manifest generations above `known` (the newest this pool wrote or found): another writer's."""
    return sorted(g for g in generations if g > known)


def conflict(url: str, gen: int, writer: Manifest | None) -> str:
    """The line for a second writer found while replicating."""
    who = f"pool {writer.pool[:16]}" if writer is not None else "an unreadable manifest"
    return (f"another writer under {url}: manifest {gen} ({who}) was not written by this daemon; "
            f"replication stopped so that neither pool deletes the other's objects. Give each node its "
            f"own prefix and remount")
