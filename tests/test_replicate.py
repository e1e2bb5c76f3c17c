"""Replication to a real S3 server (SeaweedFS, the `s3` fixture) from real mounts.

Each test mounts with `--replicate s3://BUCKET/PREFIX --s3-endpoint ...` (a fresh bucket),
saves files, and checks the object store from outside with boto3: the newest manifest's
tree is bit-exact with the mount, every manifest ever written names only complete objects
(their bytes match the manifest's per-chunk CRCs) even when the server is killed
mid-upload, a SIGKILLed daemon continues after remount without uploading again a segment
the store holds, and every-step saves of one path upload far less than every version.
"""
from __future__ import annotations

import os
import random
import stat
import time
import uuid

import crc32c
import pytest

from ckptfs.replicate.manifest import Manifest, manifest_generation
from mounting import CkptMount, ckptfs, is_mounted
from waiting import poll

pytestmark = pytest.mark.mount
MiB = 1 << 20


@pytest.fixture
def bucket(s3, monkeypatch):
    """A fresh bucket; the AWS chain of this process (and the daemons it starts) points at `s3`.
    Emptied and deleted after the test: SeaweedFS then drops the bucket's volumes, so the session's
    store holds one test's data at a time, not all of them."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    client = s3.client()
    client.create_bucket(Bucket=name)
    yield name
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        client.delete_bucket(Bucket=name)
    except Exception:  # noqa: BLE001 - a store killed by the test, or a server that keeps the bucket
        pass


def replicating(tmp_path, s3, bucket, *more, prefix="node0", sub="m", memory="512M") -> CkptMount:
    m = CkptMount(tmp_path / sub, memory=memory,
                  extra=("--replicate", f"s3://{bucket}/{prefix}", "--s3-endpoint", s3.endpoint, *more))
    m.mount()
    return m


def replication(m: CkptMount) -> dict:
    return m.status()["replication"]


def manifests(client, bucket: str, prefix: str = "node0") -> dict[int, Manifest]:
    """Every manifest under the prefix, by generation."""
    out = {}
    for obj in client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/manifests/").get("Contents", []):
        gen = manifest_generation(obj["Key"][len(prefix) + 1:])
        if gen is not None:
            body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            out[gen] = Manifest.decode(body, obj["Key"])
    return out


def fetch(client, bucket: str, prefix: str, key: str) -> bytes:
    return client.get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()


def check_complete(client, bucket: str, m: Manifest, prefix: str = "node0", cache: dict | None = None) -> dict:
    """Every object `m` names exists and its file's bytes match the entry's size and per-chunk CRCs;
    path -> bytes."""
    cache = {} if cache is None else cache
    out = {}
    for e in m.entries:
        if not stat.S_ISREG(e.mode):
            continue
        for key, _, length in m.pieces(e):
            if key not in cache:
                cache[key] = fetch(client, bucket, prefix, key)
            assert len(cache[key]) == length, f"gen {m.generation} {e.path}: {key} holds {len(cache[key])} bytes"
        data = b"".join(cache[key] for key, _, _ in m.pieces(e))
        assert len(data) == e.size, f"gen {m.generation} {e.path}: object of {len(data)} bytes, size {e.size}"
        cs = m.chunk_size
        crcs = [crc32c.crc32c(data[i:i + cs]) for i in range(0, len(data), cs)]
        assert crcs == e.crcs, f"gen {m.generation} {e.path}: object bytes do not match the manifest's crcs"
        out[e.path] = data
    return out


def test_a_tree_replicates_bit_exact_and_old_states_are_collected(tmp_path, s3, bucket):
    torch = pytest.importorskip("torch")
    m = replicating(tmp_path, s3, bucket, "--replicate-keep-last", "2", "--replicate-keep-hourly", "0",
                    "--replicate-keep-daily", "0", "--metrics-port", "0")
    try:
        root = m.path
        (root / "run" / "shards").mkdir(parents=True)
        files = {"run/shards/a.bin": os.urandom(20 * MiB + 12345), "run/shards/b.bin": os.urandom(3000),
                 "run/empty": b"", "top.txt": b"hello\n"}
        for rel, data in files.items():
            (root / rel).write_bytes(data)
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        torch.save(model.state_dict(), root / "run" / "model.pt")
        os.symlink("run/model.pt", root / "latest")
        os.setxattr(root / "top.txt", "user.note", b"kept")
        os.link(root / "top.txt", root / "run" / "hardlink.txt")
        os.mknod(root / "run" / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        with open(root / "sparse", "wb") as f:  # a hole, then a short chunk
            f.seek(3 * MiB + 7)
            f.write(b"tail")
        m.replicated(timeout=120)
        assert os.getxattr(root / "run" / "shards" / "a.bin", "user.ckptfs.state") == b"replicated"
        assert os.getxattr(root / "run", "user.ckptfs.state") == b"replicated"

        client = s3.client()
        gens = manifests(client, bucket)
        newest = gens[max(gens)]
        got = check_complete(client, bucket, newest)
        for rel in [*files, "run/model.pt", "sparse", "run/hardlink.txt"]:
            assert got[rel] == (root / rel).read_bytes(), rel
        restored = torch.load(__import__("io").BytesIO(got["run/model.pt"]))
        for k, v in model.state_dict().items():
            assert torch.equal(restored[k], v)
        by = {e.path: e for e in newest.entries}
        assert by["latest"].target == b"run/model.pt" and stat.S_ISLNK(by["latest"].mode)
        assert by["top.txt"].xattrs == {b"user.note": b"kept"} and by["top.txt"].ino == by["run/hardlink.txt"].ino
        assert stat.S_ISDIR(by["run/shards"].mode)
        assert stat.S_ISCHR(by["run/null"].mode) and by["run/null"].rdev == os.makedev(1, 3)

        rep = replication(m)
        assert rep["bytes_uploaded"] >= sum(len(d) for d in files.values()) and rep["errors_total"] == 0
        assert rep["generation"] == max(gens) and rep["lag"] >= 0 and rep["failing"] is None
        url = m.status()["metrics_url"]
        import urllib.request
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "ckptfs_replication_bytes_uploaded_total" in text and "ckptfs_replication_lag_seconds" in text
        assert "Replication to s3://" in ckptfs("status", str(root)).stdout

        # new states: older manifests and the objects only they named are collected (keep 2)
        for step in range(3):
            (root / "top.txt").write_bytes(b"step %d\n" % step)
            m.replicated(root / "top.txt", timeout=60)
        poll(lambda: len(manifests(client, bucket)) <= 2, "old manifests collected", timeout=30)
        kept = manifests(client, bucket)
        listed = {o["Key"][len("node0/"):] for o in
                  client.list_objects_v2(Bucket=bucket, Prefix="node0/segments/").get("Contents", [])}
        assert listed == set().union(*(k.objects() for k in kept.values()))
        assert check_complete(client, bucket, kept[max(kept)])["top.txt"] == b"step 2\n"
    finally:
        m.close()


def test_a_utime_after_replication_uploads_nothing_and_the_next_manifest_has_the_time(tmp_path, s3, bucket):
    client = s3.client()

    def newest(path: str):
        gens = manifests(client, bucket)
        return {e.path: e for e in gens[max(gens)].entries}[path]

    def objects() -> set[str]:
        return {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="node0/segments/").get("Contents", [])}

    m = replicating(tmp_path, s3, bucket)
    try:
        f = m.path / "model.pt"
        f.write_bytes(os.urandom(12 * MiB + 5))  # four segments
        m.replicated(f, timeout=120)
        old, uploaded, listed = newest("model.pt"), replication(m)["bytes_uploaded"], objects()
        when = old.mtime_ns - 3_600 * 10**9
        os.utime(f, ns=(when, when))
        new = poll(lambda: newest("model.pt").mtime_ns == when and newest("model.pt"),
                   "a manifest with the new mtime", timeout=60)
        assert new.object == old.object and new.crcs == old.crcs and new.segments == old.segments  # not uploaded again
        assert replication(m)["bytes_uploaded"] == uploaded and objects() == listed
        m.replicated(f, timeout=60)
        assert os.getxattr(f, "user.ckptfs.state") == b"replicated"
        f.write_bytes(b"new contents")  # new contents: a new object
        m.replicated(f, timeout=60)
        assert newest("model.pt").object != old.object
    finally:
        m.close()


def test_bad_replication_targets_are_one_line_and_exit_2(tmp_path, s3, bucket, monkeypatch):
    mp = tmp_path / "mnt"
    mp.mkdir()
    dev = tmp_path / "dev0.img"
    with open(dev, "wb") as f:
        f.truncate(1 << 30)
    cases = [
        (("--replicate", "http://x/y"), "not an s3:// URL"),
        (("--replicate", f"s3://{bucket}/p", "--s3-endpoint", "127.0.0.1:1"), "bad --s3-endpoint"),
        (("--replicate", "s3://no-such-bucket-here/p", "--s3-endpoint", s3.endpoint), "bucket does not exist"),
        (("--replicate", f"s3://{bucket}/p", "--replicate-keep-within", "soon"), "bad duration"),
        (("--replicate", f"s3://{bucket}/p", "--replicate-keep-last", "0"), "last >= 1"),
        (("--replicate", f"s3://{bucket}/p", "--s3-sse-kms-key-id", "k1"), "needs server-side encryption aws:kms"),
        (("--replicate", f"s3://{bucket}/p", "--s3-storage-class", "COLD"), "bad storage class"),
        (("--restore-from", f"s3://{bucket}/p", "--format", "--generation", "1", "--at", "1h"), "give one"),
        (("--generation", "3",), "needs --restore-from"),
        (("--replicate-rate", "10M"), "needs --replicate"),
        (("--replicate-priority", "low"), "needs --replicate"),
    ]
    for args, words in cases:
        res = ckptfs("mount", str(mp), "--devices", str(dev), "--format", "--memory", "64M", *args)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and words in lines[0], (args, res.stderr)
        assert not is_mounted(mp)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    res = ckptfs("mount", str(mp), "--devices", str(dev), "--format", "--memory", "64M",
                 "--replicate", f"s3://{bucket}/p", "--s3-endpoint", s3.endpoint)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "(auth)" in lines[0], res.stderr
    assert not is_mounted(mp)
    assert open(dev, "rb").read(4096) == bytes(4096)  # not even formatted


def test_server_killed_mid_upload_resumes_and_no_manifest_is_torn(tmp_path, s3, bucket):
    m = replicating(tmp_path, s3, bucket, "--replicate-rate", "8M", "--replicate-keep", "1000")
    client = s3.client()
    killed = False
    try:
        first = os.urandom(MiB + 7)
        (m.path / "first.bin").write_bytes(first)
        m.replicated(m.path / "first.bin", timeout=120)
        big = os.urandom(48 * MiB + 5)
        (m.path / "big.bin").write_bytes(big)
        poll(lambda: replication(m)["bytes_uploaded"] > 1 * MiB + 7, "the upload to start", timeout=60)
        s3.kill()
        killed = True
        poll(lambda: replication(m)["failing"], "the failure to show in status", timeout=60)
        rep = replication(m)
        assert rep["failing"]["cause"] == "network" and rep["errors"]["network"] >= 1
        assert "Replication failing (network)" in ckptfs("status", str(m.path)).stdout
        # the local filesystem keeps working while the store is down
        small = os.urandom(3 * MiB)
        (m.path / "during.bin").write_bytes(small)
        assert ckptfs("wait", str(m.path / "during.bin"), timeout=60).returncode == 0
        assert (m.path / "during.bin").read_bytes() == small
        res = ckptfs("wait", "--replicated", "--timeout", "1", str(m.path / "during.bin"))
        assert res.returncode == 124 and "network" in res.stderr, res.stderr
        s3.start()
        killed = False
        # a restore taken now, while the interrupted upload is not in any manifest, sees a whole state
        # the filesystem passed through: the newest manifest standing when it starts, or a newer one
        standing = max(manifests(client, bucket))
        r = CkptMount(tmp_path / "restored", memory="256M")
        r.mount("--restore-from", f"s3://{bucket}/node0", "--s3-endpoint", s3.endpoint)
        try:
            restored = r.status()["restore"]
            assert restored["generation"] >= standing
            seen = check_complete(client, bucket, manifests(client, bucket)[restored["generation"]])
            assert seen["first.bin"] == first
            assert sorted(os.listdir(r.path)) == sorted(seen)
            for name, data in seen.items():
                assert (r.path / name).read_bytes() == data
        finally:
            r.close()
        m.replicated(timeout=180)
        assert replication(m)["failing"] is None
        gens = manifests(client, bucket)
        cache: dict = {}
        for gen in sorted(gens):  # every manifest ever written (nothing collected: keep 1000)
            check_complete(client, bucket, gens[gen], cache=cache)
        got = check_complete(client, bucket, gens[max(gens)], cache=cache)
        assert got["big.bin"] == big and got["during.bin"] == small and got["first.bin"] == first
        assert (m.path / "big.bin").read_bytes() == big
    finally:
        if killed:
            s3.start()
        m.close()


def test_sigkill_during_replication_continues_without_uploading_again(tmp_path, s3, bucket):
    m = replicating(tmp_path, s3, bucket, "--replicate-rate", "16M")
    client = s3.client()
    try:
        first = os.urandom(12 * MiB + 1)
        (m.path / "first.bin").write_bytes(first)
        m.replicated(m.path / "first.bin", timeout=60)
        before = replication(m)["bytes_uploaded"]
        second = os.urandom(64 * MiB)
        (m.path / "second.bin").write_bytes(second)
        assert ckptfs("wait", str(m.path / "second.bin"), timeout=60).returncode == 0  # durable
        poll(lambda: replication(m)["bytes_uploaded"] > before, "the second upload to start", timeout=60)
        m.kill()
        m.mount()
        m.replicated(timeout=120)
        rep = replication(m)
        # the newest manifest held first.bin: only second.bin is uploaded by the new daemon, and
        # of it only the segments the killed one had not sent (at least one was: bytes_uploaded moved)
        assert rep["bytes_uploaded"] + rep["bytes_shared"] == len(second), rep
        assert rep["bytes_shared"] >= 4 * MiB, rep
        gens = manifests(client, bucket)
        got = check_complete(client, bucket, gens[max(gens)])
        assert got["first.bin"] == first and got["second.bin"] == second
        m.kill()  # again, with everything replicated: the next daemon uploads nothing at all
        m.mount()
        m.replicated(timeout=60)
        assert replication(m)["bytes_uploaded"] == 0
        assert os.getxattr(m.path / "second.bin", "user.ckptfs.state") == b"replicated"
    finally:
        m.close()


@pytest.mark.parametrize("pattern", ["rename", "in-place"])
def test_every_step_saves_upload_only_complete_versions_and_few_of_them(tmp_path, s3, bucket, pattern):
    # uploads (4 MiB/s: a version every ~2 s) are much slower than the saves, whatever the load
    m = replicating(tmp_path, s3, bucket, "--replicate-rate", "4M", "--replicate-keep", "1000")
    client = s3.client()
    size, steps = 9 * MiB + 123, 30

    def version(k: int) -> bytes:
        return k.to_bytes(8, "little") + random.Random(k).randbytes(size - 8)

    try:
        path = m.path / "ckpt.pt"
        for k in range(steps):
            if pattern == "rename":
                tmp = m.path / "ckpt.pt.tmp"
                tmp.write_bytes(version(k))
                os.rename(tmp, path)
            else:
                path.write_bytes(version(k))
            time.sleep(0.02)
        m.replicated(path, timeout=120)
        gens = manifests(client, bucket)
        cache: dict = {}
        seen = set()
        for gen in sorted(gens):
            got = check_complete(client, bucket, gens[gen], cache=cache)
            if "ckpt.pt" in got:
                k = int.from_bytes(got["ckpt.pt"][:8], "little")
                assert got["ckpt.pt"] == version(k), f"gen {gen}: not a whole version"
                seen.add(k)
        assert steps - 1 in seen
        uploaded = replication(m)["bytes_uploaded"]
        assert uploaded < steps * size / 3, f"{uploaded} bytes uploaded for {steps} versions of {size}"
    finally:
        m.close()


def test_the_test_server_takes_more_buckets_than_a_session_uses(s3):
    """Each bucket is a SeaweedFS collection with its own volume: CI once ran out of them after 24
    buckets (the count followed the free disk) and the last replication tests hung (s3server.py)."""
    client = s3.client()
    names = [f"many-{uuid.uuid4().hex[:8]}-{i}" for i in range(64)]
    for name in names:
        client.create_bucket(Bucket=name)
        client.put_object(Bucket=name, Key="k", Body=b"x" * (1 << 20))
    assert all(client.get_object(Bucket=n, Key="k")["Body"].read() == b"x" * (1 << 20) for n in names)
