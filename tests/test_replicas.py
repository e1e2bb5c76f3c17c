"""The object store as a backup users live with (SeaweedFS, the `s3` fixture; real mounts).

Each test is a scenario: a mount started while the store is down (it comes up, serves,
and catches up once the store answers); history a local delete or overwrite cannot
erase (`ckptfs replicas ls/files/restore`, `--restore-from --generation`); the retention
policy over a simulated day (the daemon's clock read from a file: no sleeps); an
identity that may read but not write (one clear permanent error, the mount unaffected);
and no credential in any log line at `--log-level debug`. `ckptfs replicas verify`
checks the store after each.
"""
from __future__ import annotations

import io
import json
import os
import shutil

import pytest

from ckptfs.replicate.retention import HOUR, Policy, keep
from mounting import CkptMount, ckptfs, is_mounted
from test_replicate import bucket, check_complete, manifests, replicating, replication  # noqa: F401 - fixture
from waiting import poll

pytestmark = pytest.mark.mount
MiB = 1 << 20


def replicas(*args: str, check: bool = True, **kw):
    return ckptfs("replicas", *args, check=check, **kw)


def verify(s3, url: str, *more: str) -> None:
    res = replicas("verify", url, "--s3-endpoint", s3.endpoint, "--read-data", *more)
    assert "no problems" in res.stdout, res.stdout


def test_a_mount_started_while_the_store_is_down_comes_up_and_catches_up(tmp_path, s3, bucket):
    url = f"s3://{bucket}/node0"
    s3.kill()
    try:
        m = CkptMount(tmp_path / "m", memory="256M", extra=("--replicate", url, "--s3-endpoint", s3.endpoint))
        res = m.mount()
        assert is_mounted(m.path) and "cannot be reached now" in res.stderr, res.stderr
        data = os.urandom(5 * MiB + 3)
        (m.path / "a.bin").write_bytes(data)
        assert ckptfs("wait", str(m.path / "a.bin"), timeout=60).returncode == 0  # durable locally
        poll(lambda: (replication(m)["failing"] or {}).get("cause") == "network", "the outage in status", timeout=60)
        rep = replication(m)
        assert rep["failing"]["since"] > 0 and rep["waiting_commits"] >= 1 and not rep["started"]
        shown = ckptfs("status", str(m.path)).stdout
        assert "Replication failing (network), retrying" in shown and "since" in shown, shown
        res = ckptfs("wait", "--replicated", "--timeout", "1", str(m.path / "a.bin"))
        assert res.returncode == 124 and "network" in res.stderr, res.stderr
    finally:
        s3.start()
    try:
        m.replicated(timeout=120)
        rep = replication(m)
        assert rep["failing"] is None and rep["waiting_bytes"] == 0
        gens = json.loads(replicas("ls", url, "--s3-endpoint", s3.endpoint, "--json").stdout)
        assert len(gens) == 1 and gens[0]["files"] == 1 and gens[0]["bytes"] == len(data)
        assert check_complete(s3.client(), bucket, manifests(s3.client(), bucket)[gens[0]["generation"]])["a.bin"] == data
    finally:
        m.close()
    verify(s3, url)


def test_history_brings_back_a_file_deleted_or_overwritten_on_the_node(tmp_path, s3, bucket):
    torch = pytest.importorskip("torch")
    url = f"s3://{bucket}/node0"
    ep = ("--s3-endpoint", s3.endpoint)
    m = replicating(tmp_path, s3, bucket, "--replicate-keep-within", "1h")  # every generation of the last hour
    try:
        good = {"w": torch.arange(300_000, dtype=torch.float32)}
        torch.save(good, m.path / "good.pt")
        (m.path / "notes.txt").write_bytes(b"run 1\n")
        m.replicated(timeout=120)
        first = replication(m)["generation"]
        torch.save({"w": torch.full((300_000,), float("nan"))}, m.path / "good.pt")  # the good one overwritten
        m.replicated(timeout=120)
        os.unlink(m.path / "good.pt")  # then deleted
        m.replicated(timeout=120)
        newest = replication(m)["generation"]
    finally:
        m.close()
    assert newest >= first + 2
    listing = replicas("ls", url, *ep).stdout
    gens = {g["generation"]: g for g in json.loads(replicas("ls", url, *ep, "--json").stdout)}
    assert f"{len(gens)} generation(s)" in listing and f"\n{first:>10}  " in listing, listing
    assert set(range(first, newest + 1)) <= set(gens)  # every generation of the last hour is kept
    files = json.loads(replicas("files", url, *ep, "--json").stdout)
    assert files["generation"] == newest and [f["path"] for f in files["files"]] == ["notes.txt"]
    old = json.loads(replicas("files", url, *ep, "--generation", str(first), "--json").stdout)
    assert sorted(f["path"] for f in old["files"]) == ["good.pt", "notes.txt"]

    out = tmp_path / "back"
    res = replicas("restore", url, str(out), *ep, "--generation", str(first), "good.pt")
    assert "restored 1 file(s)" in res.stdout and sorted(os.listdir(out)) == ["good.pt"]
    assert torch.equal(torch.load(out / "good.pt")["w"], good["w"])
    at = gens[first]["time"] + 0.001  # --at: the newest generation written by then
    res = replicas("restore", url, str(tmp_path / "at"), *ep, "--at", _iso(at))
    assert torch.equal(torch.load(tmp_path / "at" / "good.pt")["w"], good["w"])
    assert (tmp_path / "at" / "notes.txt").read_bytes() == b"run 1\n"
    res = replicas("restore", url, str(tmp_path / "x"), *ep, "--generation", "999999", check=False)
    assert res.returncode == 2 and "has no generation 999999" in res.stderr, res.stderr

    # --restore-from takes the same choice: a new pool holding the state before the mistakes
    r = CkptMount(tmp_path / "r", memory="256M")
    r.mount("--restore-from", url, *ep, "--generation", str(first))
    try:
        assert torch.equal(torch.load(r.path / "good.pt")["w"], good["w"])
    finally:
        r.close()
    verify(s3, url)

    # prune by hand: a dry run deletes nothing; then only the newest stays, and what it names
    policy = ("--keep-last", "1", "--keep-hourly", "0", "--keep-daily", "0", "--grace", "0")
    before = manifests(s3.client(), bucket)
    res = json.loads(replicas("prune", url, *ep, *policy, "--dry-run", "--json").stdout)
    assert res["kept_generations"] == [max(before)] and res["deleted_generations"] == sorted(before)[:-1]
    assert manifests(s3.client(), bucket).keys() == before.keys()
    res = replicas("prune", url, *ep, *policy)
    assert "deleted" in res.stdout
    after = manifests(s3.client(), bucket)
    assert list(after) == [max(before)]
    listed = {o["Key"][len("node0/"):] for o in
              s3.client().list_objects_v2(Bucket=bucket, Prefix="node0/segments/").get("Contents", [])}
    assert listed == after[max(before)].objects()
    verify(s3, url)


def _iso(t: float) -> str:
    from datetime import datetime, timezone
    return datetime.fromtimestamp(t, timezone.utc).isoformat()


def test_retention_over_a_simulated_day_keeps_what_the_policy_says(tmp_path, s3, bucket, monkeypatch):
    """A save every 50 simulated minutes for a day and a half, under keep-last 2, hourly 5, daily 2: the
    generations left are exactly those the policy keeps, and a file deleted at the end comes back
    from the generation the daily rule kept of the day before."""
    clock = tmp_path / "clock"
    day = 1_800_000_000.0 - 1_800_000_000.0 % 86400  # 00:00 UTC of a (future) day
    t = day + 3600
    clock.write_text(repr(t))
    monkeypatch.setenv("CKPTFS_CLOCK_FILE", str(clock))
    policy = Policy(last=2, hourly=5, daily=2)
    m = replicating(tmp_path, s3, bucket, "--replicate-keep-last", "2", "--replicate-keep-hourly", "5",
                    "--replicate-keep-daily", "2")
    written: dict[int, float] = {}  # generation -> the simulated time it was written at
    url = f"s3://{bucket}/node0"

    def step(t: float) -> None:
        clock.write_text(repr(t))
        before = max(written, default=0)
        m.replicated(timeout=60)
        for g in range(before + 1, replication(m)["generation"] + 1):  # the daemon idles between steps
            written[g] = t

    try:
        (m.path / "early.bin").write_bytes(b"from the first hour\n")
        step(t)
        for i in range(44):
            t += 50 * 60
            clock.write_text(repr(t))
            (m.path / "step.txt").write_bytes(b"step %d\n" % i)
            if i == 43:
                os.unlink(m.path / "early.bin")
            step(t)
        want = keep(written, policy, t)
        poll(lambda: set(manifests(s3.client(), bucket)) == want, "the collection of the last cycle", timeout=30)
    finally:
        m.close()
    kept = manifests(s3.client(), bucket)
    assert set(kept) == want and {g: kept[g].time_ns / 1e9 for g in kept} == {g: written[g] for g in kept}
    assert len(written) > 40 and len(kept) <= 2 + 5 + 2
    assert len({int(written[g] // HOUR) for g in kept}) >= 5
    verify(s3, url)
    # early.bin, deleted at the last save, comes back from the newest generation of the first day
    first_day_end = _iso(day + 86400 - 1)
    old = json.loads(replicas("files", url, "--s3-endpoint", s3.endpoint, "--at", first_day_end, "--json").stdout)
    assert old["time"] < day + 86400 and "early.bin" in [f["path"] for f in old["files"]]
    replicas("restore", url, str(tmp_path / "back"), "--s3-endpoint", s3.endpoint, "--at", first_day_end, "early.bin")
    assert (tmp_path / "back" / "early.bin").read_bytes() == b"from the first hour\n"


def test_an_identity_that_may_only_read_gets_one_clear_permanent_error(tmp_path, s3, bucket, monkeypatch):
    for k, v in s3.env(reader=True).items():
        monkeypatch.setenv(k, v)
    m = replicating(tmp_path, s3, bucket)  # the mount-time check reads and lists: allowed
    try:
        data = os.urandom(2 * MiB)
        (m.path / "a.bin").write_bytes(data)
        assert ckptfs("wait", str(m.path / "a.bin"), timeout=60).returncode == 0  # the local mount is unaffected
        poll(lambda: (replication(m)["failing"] or {}).get("cause") == "auth", "the refusal in status", timeout=60)
        failing = replication(m)["failing"]
        assert "put s3://" in failing["message"] and "check the credentials" in failing["message"], failing
        res = ckptfs("wait", "--replicated", "--timeout", "2", str(m.path / "a.bin"))
        assert res.returncode == 124 and "auth" in res.stderr
        assert (m.path / "a.bin").read_bytes() == data
        failed = [line for line in m.log_text().splitlines() if "replicate.failed" in line]
        assert len(failed) == 1 and "kind=permanent" in failed[0] and "cause=auth" in failed[0], failed
    finally:
        m.close()
    assert not manifests(s3.client(), bucket)


@pytest.mark.parametrize("libraries", ["", "botocore"])
def test_no_credential_reaches_any_log_at_debug_level(tmp_path, s3, bucket, monkeypatch, libraries):
    """The daemon (and the uploader process it starts) at --log-level debug, with a session token the
    store refuses (every call is made and fails): neither the key id, the secret nor the token is in
    any line written. With CKPTFS_LOG_LIBRARIES=botocore (a user asking for botocore's lines by name)
    they are: the check can fail."""
    token = "FQoGZXIvYXdzEXAMPLETOKEN0123456789"
    monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    monkeypatch.setenv("CKPTFS_LOG_LIBRARIES", libraries)
    m = replicating(tmp_path, s3, bucket, "--log-level", "debug", "--no-replicate-check")
    try:
        (m.path / "a.bin").write_bytes(os.urandom(MiB))
        poll(lambda: (replication(m)["failing"] or {}).get("cause") == "auth", "the refused token", timeout=60)
    finally:
        m.close()
    text = m.log_text()
    assert " debug " in text  # the daemon did log at debug level
    secrets = [s3.env()["AWS_ACCESS_KEY_ID"], s3.env()["AWS_SECRET_ACCESS_KEY"], token]
    if libraries:
        assert token in text  # botocore's request lines, asked for by name
    else:
        leaked = [s for s in secrets if s in text]
        assert not leaked, leaked


def test_a_training_loop_saving_every_step_through_a_store_outage_loses_nothing(tmp_path, s3, bucket):
    """A real model trained with Adam, a checkpoint saved every step (tmp + rename, the newest two
    kept, as Trainer and Lightning do), the store down for a stretch of steps: every save and `wait`
    (durable) works on as before, replication catches up once the store is back, every generation
    in the store is whole, and the newest holds exactly what the node holds."""
    torch = pytest.importorskip("torch")
    url = f"s3://{bucket}/node0"
    m = replicating(tmp_path, s3, bucket, "--replicate-keep-within", "1h")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    opt = torch.optim.Adam(model.parameters())
    down = range(8, 20)  # the steps saved while the store is down
    try:
        for step in range(28):
            if step == down.start:
                s3.kill()
            elif step == down.stop:
                s3.start()
            loss = model(torch.randn(64, 256)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            tmp = m.path / f"step-{step}.pt.tmp"
            torch.save({"step": step, "model": model.state_dict(), "optim": opt.state_dict()}, tmp)
            os.rename(tmp, m.path / f"step-{step}.pt")
            if step >= 2:
                os.unlink(m.path / f"step-{step - 2}.pt")
            assert ckptfs("wait", str(m.path / f"step-{step}.pt"), timeout=60).returncode == 0
            if step == down.stop - 1:  # the outage shows while it lasts
                poll(lambda: (replication(m)["failing"] or {}).get("cause") == "network", "the outage in status",
                     timeout=60)
        m.replicated(timeout=180)
        assert replication(m)["failing"] is None
        local = {p.name: p.read_bytes() for p in m.path.iterdir()}
    finally:
        if s3.proc is None:
            s3.start()
        m.close()
    assert sorted(local) == ["step-26.pt", "step-27.pt"]
    client, cache = s3.client(), {}
    gens = manifests(client, bucket)
    for g in sorted(gens):  # every generation whole (its objects there, bytes matching its CRCs)
        check_complete(client, bucket, gens[g], cache=cache)
    newest = check_complete(client, bucket, gens[max(gens)], cache=cache)
    assert newest == local and torch.load(io.BytesIO(newest["step-27.pt"]))["step"] == 27
    verify(s3, url)


@pytest.mark.parametrize("dedupe", ["on", "off"])
def test_a_copy_is_uploaded_once_and_a_restore_fetches_it_once(tmp_path, s3, bucket, dedupe):
    """`shutil.copy` of a checkpoint inside the mount, and a second save of it with one region
    changed: the copy uploads nothing (its segments are the original's), the changed save only
    the segment it touched; a fresh pool restoring all three GETs each segment once, and every
    file comes back bit-exact, through the mount and through `replicas restore`. With dedupe
    off the journal has no digests: the uploader process names each segment from its bytes."""
    url = f"s3://{bucket}/node0"
    m = replicating(tmp_path, s3, bucket, "--dedupe", dedupe)
    data = os.urandom(12 * MiB + 5)
    changed = bytearray(data)
    changed[5 * MiB:5 * MiB + 100] = os.urandom(100)
    try:
        (m.path / "a.pt").write_bytes(data)
        m.replicated(timeout=120)
        first = replication(m)["bytes_uploaded"]
        shutil.copy(m.path / "a.pt", m.path / "copy.pt")
        (m.path / "b.pt").write_bytes(bytes(changed))
        m.replicated(timeout=120)
        rep = replication(m)
        shared = {n: int(os.getxattr(m.path / n, "user.ckptfs.store_shared")) for n in ("a.pt", "copy.pt", "b.pt")}
        assert shared == {"a.pt": len(data), "copy.pt": len(data), "b.pt": len(data) - 4 * MiB}, shared
        assert (rep["kept_bytes"], rep["stored_bytes"]) == (3 * len(data), len(data) + 4 * MiB), rep
        assert "the store holds 16.0 MiB for 36.0 MiB of kept file versions" in ckptfs("status", str(m.path)).stdout
    finally:
        m.close()
    assert first == len(data), first
    assert rep["bytes_uploaded"] - first == 4 * MiB, rep  # the one 4 MiB segment that changed
    assert rep["bytes_shared"] == 2 * len(data) - 4 * MiB, rep
    client = s3.client()
    gens = manifests(client, bucket)
    newest = gens[max(gens)]
    assert len(newest.objects()) == 5, newest.objects()  # 4 segments of a.pt, and b.pt's changed one
    r = CkptMount(tmp_path / "restored")
    r.mount("--restore-from", url, "--s3-endpoint", s3.endpoint)
    try:
        want = {"a.pt": data, "copy.pt": data, "b.pt": bytes(changed)}
        assert {n: (r.path / n).read_bytes() for n in want} == want
        assert ckptfs("wait", str(r.path), timeout=120).returncode == 0
        fetched = r.status()["restore"]["bytes_fetched"]
        assert fetched == len(data) + 4 * MiB, fetched  # each segment once
    finally:
        r.close()
    out = tmp_path / "back"
    replicas("restore", url, str(out), "--s3-endpoint", s3.endpoint)
    assert {n: (out / n).read_bytes() for n in want} == want
    listed = json.loads(replicas("ls", url, "--s3-endpoint", s3.endpoint, "--json").stdout)
    # what each generation added: the empty tree and the copy may each have a generation that adds nothing
    assert [g["new_bytes"] for g in listed if g["new_bytes"]] == [len(data), 4 * MiB], listed
    verify(s3, url)


def test_a_file_of_2_gib_replicates_and_restores_bit_exact(tmp_path, s3, bucket):
    """2 GiB and a few bytes (513 segments, more than the daemon's memory): replicated
    with the default part memory, verified by reading every chunk, and restored by
    `ckptfs replicas restore` to the same SHA-256."""
    import hashlib
    import numpy as np
    url = f"s3://{bucket}/node0"
    m = CkptMount(tmp_path / "m", dev_size=3 << 30, memory="256M",
                  extra=("--replicate", url, "--s3-endpoint", s3.endpoint))
    m.mount()
    digest = hashlib.sha256()
    rng = np.random.default_rng(7)
    try:
        with open(m.path / "huge.bin", "wb") as f:
            for _ in range(32):
                block = rng.integers(0, 256, 64 * MiB, dtype=np.uint8).tobytes()
                digest.update(block)
                f.write(block)
            f.write(b"tail")
            digest.update(b"tail")
        m.replicated(timeout=300)
    finally:
        m.close()
    verify(s3, url)
    out = tmp_path / "back"
    res = replicas("restore", url, str(out), "--s3-endpoint", s3.endpoint, timeout=200)
    assert "restored 1 file(s)" in res.stdout, res.stdout
    back = hashlib.sha256()
    with open(out / "huge.bin", "rb") as f:
        while block := f.read(64 * MiB):
            back.update(block)
    assert back.hexdigest() == digest.hexdigest() and (out / "huge.bin").stat().st_size == (2 << 30) + 4


def test_server_side_encryption_and_storage_class_reach_every_object(tmp_path, s3, bucket):
    """--s3-sse AES256 and --s3-storage-class STANDARD_IA: every object written (each segment, the
    manifest) carries both, and the history restores as usual. (aws:kms needs
    a KMS the test server does not have: the argument checks are in test_replicate_unit.py.)"""
    url = f"s3://{bucket}/node0"
    m = replicating(tmp_path, s3, bucket, "--s3-sse", "AES256", "--s3-storage-class", "STANDARD_IA")
    small, big = os.urandom(MiB + 1), os.urandom(20 * MiB + 3)
    try:
        (m.path / "small.bin").write_bytes(small)
        (m.path / "big.bin").write_bytes(big)
        m.replicated(timeout=120)
    finally:
        m.close()
    client = s3.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="node0/").get("Contents", [])]
    assert any("/manifests/" in k for k in keys) and sum("/segments/" in k for k in keys) == 1 + 6, keys
    for key in keys:
        head = client.head_object(Bucket=bucket, Key=key)
        assert (head.get("ServerSideEncryption"), head.get("StorageClass")) == ("AES256", "STANDARD_IA"), key
    out = tmp_path / "back"
    replicas("restore", url, str(out), "--s3-endpoint", s3.endpoint)
    assert (out / "small.bin").read_bytes() == small and (out / "big.bin").read_bytes() == big
    verify(s3, url)


def test_verify_finds_a_missing_object_a_short_one_and_damaged_bytes(tmp_path, s3, bucket):
    """`replicas verify` can fail: an object deleted behind ckptfs's back, one cut short, and one
    whose bytes changed but not its size (found only with --read-data) each give a line naming the
    generation, the path and the object, and exit status 1; bad input is one line and exit 2."""
    url, ep = f"s3://{bucket}/node0", ("--s3-endpoint", s3.endpoint)
    m = replicating(tmp_path, s3, bucket)
    try:
        for name in ("a.bin", "b.bin", "c.bin"):
            (m.path / name).write_bytes(os.urandom(3 * MiB + 7))
        m.replicated(timeout=120)
    finally:
        m.close()
    verify(s3, url)
    client = s3.client()
    newest = manifests(client, bucket)
    entries = {e.path: e.segments[0] for e in newest[max(newest)].entries if e.segments}  # one segment each
    key = {p: f"node0/{o}" for p, o in entries.items()}
    body = client.get_object(Bucket=bucket, Key=key["c.bin"])["Body"].read()
    client.put_object(Bucket=bucket, Key=key["c.bin"], Body=body[:MiB] + bytes(len(body) - MiB))  # same size
    res = replicas("verify", url, *ep)
    assert res.returncode == 0 and "no problems" in res.stdout, res.stdout  # sizes alone cannot see it
    res = replicas("verify", url, *ep, "--read-data", check=False)
    assert res.returncode == 1 and "c.bin" in res.stdout and "CRC-32C" in res.stdout, res.stdout
    client.delete_object(Bucket=bucket, Key=key["a.bin"])
    client.put_object(Bucket=bucket, Key=key["b.bin"], Body=b"short")
    res = replicas("verify", url, *ep, "--json", check=False)
    problems = json.loads(res.stdout)["problems"]
    assert res.returncode == 1 and len(problems) == 2, problems
    assert any("a.bin" in p and "missing" in p for p in problems)
    assert any("b.bin" in p and "holds 5 bytes" in p for p in problems)
    for args, words in ((("ls", "http://x/y"), "bad URL"), (("files", url, *ep, "--generation", "1", "--at", "2h"),
                                                             "give one"),
                        (("prune", url, *ep, "--grace", "soon"), "bad --grace"),
                        (("files", url, *ep, "--at", "yesterday"), "bad time"),
                        (("ls", f"s3://{bucket}-none/x", *ep), "bucket")):
        res = replicas(*args, check=False)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and words in lines[0], (args, res.stderr)
    res = replicas("ls", f"s3://{bucket}/nothing-here", *ep)
    assert "no generation under" in res.stdout


def test_a_pool_restored_from_the_store_uploads_only_what_changed_since(tmp_path, s3, bucket):
    """The replacement of a lost node restores from its prefix and replicates back to it: the files
    it brought back unchanged are named by the versions they came from, so nothing is uploaded
    again, after a kill -9 and a remount too; a file rewritten in place after the restore and a
    new file are uploaded, and the newest manifest holds every file bit-exact."""
    url = f"s3://{bucket}/node0"
    client = s3.client()
    lost = CkptMount(tmp_path / "lost", extra=("--replicate", url, "--s3-endpoint", s3.endpoint))
    lost.mount()
    try:
        files = {f"step{i}.pt": os.urandom(3 * MiB + i) for i in range(3)} | {"empty": b""}
        for name, data in files.items():
            (lost.path / name).write_bytes(data)
        lost.replicated()
    finally:
        lost.close()
    fresh = CkptMount(tmp_path / "fresh")
    fresh.mount("--restore-from", url, "--s3-endpoint", s3.endpoint, "--replicate", url)
    try:
        fresh.replicated()
        assert replication(fresh)["bytes_uploaded"] == 0 and replication(fresh)["objects_uploaded"] == 0
        assert {n: (fresh.path / n).read_bytes() for n in files} == files
        with open(fresh.path / "step0.pt", "r+b") as f:
            f.seek(MiB)
            f.write(b"changed")
        files["step0.pt"] = (fresh.path / "step0.pt").read_bytes()
        files["new.pt"] = os.urandom(MiB + 1)
        (fresh.path / "new.pt").write_bytes(files["new.pt"])
        fresh.replicated()
        assert replication(fresh)["bytes_uploaded"] == len(files["step0.pt"]) + len(files["new.pt"])
        fresh.kill()
        fresh.mount("--replicate", url, "--s3-endpoint", s3.endpoint)
        fresh.replicated()
        assert replication(fresh)["bytes_uploaded"] == 0
    finally:
        fresh.close()
    gens = manifests(client, bucket)
    assert check_complete(client, bucket, gens[max(gens)]) == files
    verify(s3, url)
