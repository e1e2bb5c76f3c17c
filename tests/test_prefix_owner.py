"""One writer per prefix (replicate/lineage.py), against a real S3 server from real mounts.

A prefix holds one pool's states: replication collects every object no kept manifest
names, so a second pool writing there would delete the first one's checkpoints. A fresh
pool pointed at another pool's prefix is refused at mount (one line, nothing in the store
touched) unless it says --replicate-takeover; a pool restored from a prefix may replicate
there, across remounts; and a second writer that appears while a pool replicates stops
that pool's replication before it writes or deletes anything.
"""
from __future__ import annotations

import os

import pytest

from mounting import CkptMount, ckptfs, is_mounted
from waiting import poll
from test_replicate import bucket, check_complete, manifests, replicating, replication  # noqa: F401 - fixture

pytestmark = pytest.mark.mount
MiB = 1 << 20


def keys(client, bucket: str) -> dict[str, str]:
    """Every key in the bucket -> its ETag."""
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        out.update({o["Key"]: o["ETag"] for o in page.get("Contents", [])})
    return out


def pool_of(m: CkptMount) -> str:
    return m.status()["pool"]["pool_id"]


def wait_replicated(m: CkptMount, *paths, timeout: int = 120):
    return ckptfs("wait", "--replicated", "--timeout", str(timeout), *(str(p) for p in paths or (m.path,)))


def save(m: CkptMount, name: str, size: int = 3 * MiB + 5) -> bytes:
    data = os.urandom(size)
    (m.path / name).write_bytes(data)
    return data


def test_a_fresh_pool_is_refused_another_pools_prefix_unless_it_takes_it_over(tmp_path, s3, bucket):
    url = f"s3://{bucket}/node0"
    old = replicating(tmp_path, s3, bucket, sub="old")
    try:
        save(old, "step1.pt")
        assert wait_replicated(old).returncode == 0
        old_pool = manifests(s3.client(), bucket)[1].pool
    finally:
        old.close()
    before = keys(s3.client(), bucket)

    new = CkptMount(tmp_path / "new", memory="512M", extra=("--replicate", url, "--s3-endpoint", s3.endpoint,
                                                            "--replicate-keep-last", "2",
                                                            "--replicate-keep-hourly", "0", "--replicate-keep-daily", "0"))
    for fmt in (("--format",), ()):  # refused by the CLI before formatting; by the daemon for a pool it has
        if not fmt:
            new.extra, extra = (), new.extra
            new.mount()  # a pool of its own, never replicated
            new.umount()
            new.extra = extra
        res = ckptfs("mount", str(new.path), "--devices", new.device_arg, "--memory", new.memory, *fmt,
                     "--log-file", str(new.log), *new.extra)
        assert res.returncode != 0 and not is_mounted(new.path)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1, res.stderr
        for part in (f"{url}/", old_pool[:16], "manifest 1", "--replicate-takeover", "--restore-from"):
            assert part in lines[0], (part, lines[0])
        assert keys(s3.client(), bucket) == before  # nothing written, nothing deleted

    new.mount("--replicate-takeover")
    try:
        ours = save(new, "fresh.pt")
        assert wait_replicated(new).returncode == 0
        gens = manifests(s3.client(), bucket)
        newest = gens[max(gens)]
        assert newest.generation == 2 and newest.pool != old_pool  # the generations go on
        assert check_complete(s3.client(), bucket, newest)["fresh.pt"] == ours
        assert "step1.pt" not in {e.path for e in newest.entries}
        for i in range(2):  # two more states: the old pool's manifest is collected (keep 2)
            save(new, f"more{i}.pt", 4096)
            assert wait_replicated(new).returncode == 0
        gens = manifests(s3.client(), bucket)
        assert len(gens) == 2 and {m.pool for m in gens.values()} == {newest.pool}
        for m in gens.values():
            check_complete(s3.client(), bucket, m)
    finally:
        new.umount()
    new.mount()  # the prefix is this pool's now: no flag needed
    try:
        save(new, "after-remount.pt", 4096)
        assert wait_replicated(new).returncode == 0
        assert replication(new)["failing"] is None
    finally:
        new.close()


def test_a_pool_restored_from_a_prefix_replicates_there_across_remounts(tmp_path, s3, bucket):
    url = f"s3://{bucket}/node0"
    lost = replicating(tmp_path, s3, bucket, sub="lost")
    try:
        kept = save(lost, "step1.pt", 5 * MiB + 3)
        assert wait_replicated(lost).returncode == 0
    finally:
        lost.close()
    # the replacement restores without replicating, is unmounted (its restore maybe unfinished),
    # and mounts again with --replicate: its lineage (journaled with the restored tree) says it
    # continues the lost pool, whose manifest is still the newest there
    fresh = CkptMount(tmp_path / "fresh", memory="512M")
    fresh.mount("--restore-from", url, "--s3-endpoint", s3.endpoint)
    fresh.umount()
    fresh.mount("--replicate", url, "--s3-endpoint", s3.endpoint)
    try:
        assert (fresh.path / "step1.pt").read_bytes() == kept
        ours = save(fresh, "step2.pt")
        assert wait_replicated(fresh).returncode == 0
        gens = manifests(s3.client(), bucket)
        newest = gens[max(gens)]
        assert newest.pool == pool_of(fresh)
        got = check_complete(s3.client(), bucket, newest)
        assert got["step1.pt"] == kept and got["step2.pt"] == ours
    finally:
        fresh.close()


def test_a_second_writer_stops_replication_before_it_deletes_anything(tmp_path, s3, bucket):
    a = replicating(tmp_path, s3, bucket, sub="a")
    b = None
    try:
        save(a, "a1.pt")
        assert wait_replicated(a).returncode == 0
        # a second node on the same prefix while the first still runs (same NODE_RANK twice)
        b = replicating(tmp_path, s3, bucket, "--replicate-takeover", sub="b")
        b_data = save(b, "b1.pt")
        assert wait_replicated(b).returncode == 0

        save(a, "a2.pt")
        res = wait_replicated(a, a.path / "a2.pt", timeout=60)
        assert res.returncode != 0 and "another writer" in res.stdout + res.stderr, (res.stdout, res.stderr)
        rep = replication(a)
        assert rep["failing"]["cause"] == "conflict" and "manifest" in rep["failing"]["message"]
        assert rep["objects_deleted"] == 0 and rep["manifests_deleted"] == 0
        assert "replicate.failed" in a.log_text()
        assert "Replication stopped (conflict): another writer" in ckptfs("status", str(a.path)).stdout

        client = s3.client()
        gens = manifests(client, bucket)
        newest = gens[max(gens)]
        assert newest.pool == pool_of(b)  # the first node wrote no manifest after the second one's
        for m in gens.values():  # and every manifest still names complete objects
            check_complete(client, bucket, m)
        assert check_complete(client, bucket, newest)["b1.pt"] == b_data
        assert (a.path / "a2.pt").exists()  # the local filesystem goes on
        assert ckptfs("wait", str(a.path / "a2.pt")).returncode == 0  # durable locally
    finally:
        if b is not None:
            b.close()
        a.close()


def test_two_writers_of_one_generation_the_first_stays_and_the_second_stops(s3, bucket):
    """What the check cannot see: another pool puts a manifest of the very generation this one is
    about to write, after this one's check listed the prefix (in process: the listing is wrapped
    to do it then). The manifest is put only where its name is free (If-None-Match), so the other
    pool's stays as it was, and this one stops (conflict) without writing or deleting anything."""
    import time

    import trio
    from inproc import Driver, PathOps, make_devices

    from ckptfs.replicate.client import CONFLICT
    from ckptfs.replicate.manifest import MANIFESTS, Manifest, manifest_name, parse_url
    from ckptfs.replicate.replicator import Replicator

    client = s3.client()
    other = Manifest(generation=1, pool="ab" * 16, journal_seq=7, time_ns=time.time_ns(), chunk_size=MiB, entries=[])
    driver = Driver(make_devices(2, 64 * MiB), memory=8 * MiB, chunk_size=MiB, fmt=True, journal_half=2 * MiB)
    try:
        PathOps(driver).write_file("/step1.pt", os.urandom(3 * MiB + 5), fsync=True)
        rep = Replicator(driver.store, parse_url(f"s3://{bucket}/race"), s3.endpoint)
        listing = rep.target.list

        async def racing_list(rel: str):
            got = await listing(rel)
            if rel == MANIFESTS:  # the check before the manifest: the other pool's generation 1 goes in now
                await trio.to_thread.run_sync(lambda: client.put_object(
                    Bucket=bucket, Key="race/" + manifest_name(1), Body=other.encode()))
            return got

        rep.target.list = racing_list
        driver.call_sync(driver.nursery.start_soon, rep.run)
        poll(lambda: driver.call_sync(lambda: rep.conflict) is not None, "the conflict", 60, every=0.1,
             on_timeout=lambda: str(driver.call_sync(rep.statistics)))
        stats = driver.call_sync(rep.statistics)
    finally:
        driver.kill()
    assert rep.conflict.cause == CONFLICT and "manifest 1 (pool abababababababab)" in str(rep.conflict)
    assert client.get_object(Bucket=bucket, Key="race/" + manifest_name(1))["Body"].read() == other.encode()
    assert stats.manifests_written == 0 and stats.objects_deleted == 0 and stats.manifests_deleted == 0
    assert stats.objects_uploaded == 1 and any(k.startswith("race/segments/") for k in keys(client, bucket))
