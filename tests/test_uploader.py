"""The uploader process (replicate/uploader.py, uploader_proc.py) against a real S3 server.

First the process alone, driven by `Uploader` in a trio loop: calls with payloads in shared
memory land bit-exact, errors raised in the process arrive as the same types, a hung
(SIGSTOPped) or killed process fails the calls in flight as S3Error(uploader) and the next
call starts a new one, a process that cannot start is one clear error, and stopping ends it.
Then from real mounts: SIGKILL of the uploader mid-upload (replication resumes, every manifest
whole, a restore bit-exact), SIGKILL of the daemon (no uploader left behind), and the
--replicate-priority option as the kernel shows it (/proc/PID/task/*/stat).
"""
from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest
import trio

from ckptfs.replicate import segments
from ckptfs.replicate.client import NO_BUCKET, UPLOADER, S3Error
from ckptfs.replicate.manifest import BadManifest, manifest_name, parse_url
from ckptfs.replicate.partmem import PartMemory
from ckptfs.replicate.uploader_proc import Uploader
from ckptfs.store.dedupe import digest
from mounting import CkptMount, ckptfs
from waiting import poll
from test_replicate import bucket, check_complete, manifests, replicating, replication  # noqa: F401 - fixture

MiB = 1 << 20


def children(pid: int) -> list[int]:
    """The child processes of `pid` (every thread's)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def sched(pid: int) -> set[tuple[int, int]]:
    """(policy, nice) of every thread of `pid`."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        out.add((int(fields[38]), int(fields[16])))  # stat fields 41 (policy) and 19 (nice)
    return out


def run_uploader(s3, bucket: str, body, **kw):
    """trio.run(body(uploader, parts)) with an Uploader for s3://bucket/p serving meanwhile."""
    async def main():
        parts = PartMemory(16 * MiB)
        up = Uploader(parse_url(f"s3://{bucket}/p"), s3.endpoint, parts, connections=4, **kw)
        async with trio.open_nursery() as nursery:
            await nursery.start(up.run)
            try:
                return await body(up, parts)
            finally:
                nursery.cancel_scope.cancel()

    return trio.run(main)


def test_calls_go_through_the_process_bit_exact_and_errors_keep_their_types(s3, bucket):
    small, big = os.urandom(3 * MiB + 5), os.urandom(11 * MiB + 1)

    async def body(up: Uploader, parts: PartMemory):
        buf = await parts.take(4 * MiB)
        buf.view[:len(small)] = small
        await up.put("objects/small", buf.body(len(small)))
        part = await parts.take(12 * MiB)
        part.view[:len(big)] = big
        await up.put("objects/big", part.body(len(big)))
        layout = [(MiB, MiB), (MiB, 1000), (MiB, 0)]  # a whole piece, a short one, a hole
        want = segments.key([(MiB, MiB, digest(big[:MiB])), (MiB, 1000, digest(big[MiB:MiB + 1000])),
                              (MiB, 0, segments.EMPTY)])
        assert await up.segment_key(part.body(3 * MiB), layout) == want
        parts.give_back(part)
        parts.give_back(buf)
        await up.put(manifest_name(1), b"not a manifest")
        listed = await up.list("")
        with pytest.raises(BadManifest):
            await up.manifest(1)
        with pytest.raises(S3Error, match="no such object") as gone:
            await up.manifest(99)
        assert type(gone.value) is S3Error and gone.value.cause == "other"
        pid = up.statistics().pid
        assert pid in children(os.getpid()) and up.statistics().starts == 1
        await up.delete(["objects/small"])
        return listed, await up.list("")

    listed, after = run_uploader(s3, bucket, body)
    assert listed == {"objects/small": len(small), "objects/big": len(big), manifest_name(1): 14}
    assert after.keys() == {"objects/big", manifest_name(1)}
    client = s3.client()
    assert client.get_object(Bucket=bucket, Key="p/objects/big")["Body"].read() == big

    async def missing(up, parts):
        with pytest.raises(S3Error) as e:
            await up.list("")
        return e.value

    err = run_uploader(s3, f"no-such-{uuid.uuid4().hex[:8]}", missing)
    assert type(err) is S3Error and err.cause == NO_BUCKET


def test_put_new_writes_only_where_the_name_is_free_and_knows_its_own_bytes_again(s3, bucket):
    """A manifest's put (If-None-Match): the first writer of a name wins; the same bytes again (a
    retry whose first attempt went through) count as written; other bytes there do not."""
    async def body(up: Uploader, parts: PartMemory):
        return [await up.put_new(manifest_name(3), b"first"), await up.put_new(manifest_name(3), b"first"),
                await up.put_new(manifest_name(3), b"second")]

    assert run_uploader(s3, bucket, body) == [True, True, False]
    assert s3.client().get_object(Bucket=bucket, Key="p/" + manifest_name(3))["Body"].read() == b"first"


def test_a_hung_or_killed_process_fails_the_calls_in_flight_and_the_next_call_restarts_it(s3, bucket):
    async def body(up: Uploader, parts: PartMemory):
        await up.list("")
        first = up.statistics().pid
        os.kill(first, signal.SIGSTOP)  # hung: silent, and no CPU used
        with pytest.raises(S3Error) as hung:
            await up.list("")
        assert hung.value.cause == UPLOADER and "did not answer" in str(hung.value), hung.value
        await up.list("")  # a new process
        second = up.statistics().pid
        assert second != first and not alive(first)
        os.kill(second, signal.SIGSTOP)
        errors = []

        async def waits():
            try:
                await up.list("")
            except S3Error as e:
                errors.append(e)

        async with trio.open_nursery() as n:
            for _ in range(3):
                n.start_soon(waits)
            while up.statistics().calls < 3:
                await trio.sleep(0.01)
            os.kill(second, signal.SIGKILL)
        assert len(errors) == 3 and all(e.cause == UPLOADER and "killed by SIGKILL" in str(e) for e in errors)
        await up.put("objects/after", b"still works")
        st = up.statistics()
        assert st.starts == 3 and st.restarts == 2 and "SIGKILL" in st.last_exit
        return st.pid

    last = run_uploader(s3, bucket, body, hang_timeout=1.0)
    poll(lambda: not alive(last), "the process to end with the service")
    assert s3.client().get_object(Bucket=bucket, Key="p/objects/after")["Body"].read() == b"still works"


def test_a_process_that_cannot_start_is_one_clear_error(s3, bucket):
    async def body(up: Uploader, parts: PartMemory):
        with pytest.raises(S3Error) as e:
            await up.list("")
        return e.value

    err = run_uploader(s3, bucket, body, priority="realtime")  # the process refuses it
    assert err.cause == UPLOADER and "exited with status 2 before it was ready" in str(err), err


def uploader_of(m: CkptMount) -> int:
    return poll(lambda: replication(m)["uploader"]["running"] and replication(m)["uploader"]["pid"],
                "the uploader process to run")


def test_sigkill_of_the_uploader_mid_upload_resumes_and_restores_bit_exact(tmp_path, s3, bucket):
    m = replicating(tmp_path, s3, bucket, "--replicate-rate", "16M", "--replicate-keep", "1000")
    client = s3.client()
    try:
        first = os.urandom(5 * MiB + 3)
        (m.path / "first.bin").write_bytes(first)
        m.replicated(m.path / "first.bin", timeout=120)
        pid = uploader_of(m)
        assert pid in children(m.pid)
        big = os.urandom(64 * MiB + 11)
        (m.path / "big.bin").write_bytes(big)
        poll(lambda: replication(m)["bytes_uploaded"] > len(first), "the upload to start", timeout=60)
        os.kill(pid, signal.SIGSTOP)  # calls pile up, then it dies with them in flight
        poll(lambda: replication(m)["uploader"]["calls"] > 0, "a call in flight", timeout=60)
        os.kill(pid, signal.SIGKILL)
        poll(lambda: replication(m)["errors"].get("uploader", 0) >= 1, "the failure counted", timeout=60)
        m.replicated(timeout=180)
        rep = replication(m)
        assert rep["failing"] is None and rep["uploader"]["restarts"] >= 1 and rep["uploader"]["pid"] != pid
        assert "killed by SIGKILL" in rep["last_error"]["message"] and rep["last_error"]["cause"] == "uploader"
        assert not alive(pid)
        text = ckptfs("status", str(m.path)).stdout
        assert f"Uploader process: pid {rep['uploader']['pid']}, idle priority" in text and "SIGKILL" in text, text
        failed = [line for line in m.log_text().splitlines() if "replicate.failed" in line and "SIGKILL" in line]
        assert len(failed) == 1, failed  # logged once, not once per call
        assert "uploader_garbled" not in m.log_text()
        gens = manifests(client, bucket)
        cache: dict = {}
        for gen in sorted(gens):  # no manifest names a missing or partial object
            check_complete(client, bucket, gens[gen], cache=cache)
        got = check_complete(client, bucket, gens[max(gens)], cache=cache)
        assert got["big.bin"] == big and got["first.bin"] == first
    finally:
        m.close()
    r = CkptMount(tmp_path / "restored", memory="256M")
    r.mount("--restore-from", f"s3://{bucket}/node0", "--s3-endpoint", s3.endpoint)
    try:
        assert (r.path / "big.bin").read_bytes() == big and (r.path / "first.bin").read_bytes() == first
    finally:
        r.close()


def test_sigkill_of_the_daemon_leaves_no_uploader_behind(tmp_path, s3, bucket):
    m = replicating(tmp_path, s3, bucket, "--replicate-rate", "16M")
    try:
        (m.path / "a.bin").write_bytes(os.urandom(40 * MiB))
        poll(lambda: replication(m)["bytes_uploaded"] > 0, "the upload to start", timeout=60)
        pid = uploader_of(m)
        m.kill()  # mid-upload
        poll(lambda: not alive(pid), "the uploader to die with the daemon", timeout=30)
        m.mount()
        m.replicated(timeout=120)
    finally:
        m.close()


@pytest.mark.parametrize("priority,want", [(None, (5, 0)), ("low", (0, 19)), ("normal", (0, 0))])
def test_the_priority_option_is_applied_to_every_thread_of_the_uploader_only(tmp_path, s3, bucket, priority, want):
    more = ("--replicate-priority", priority) if priority else ()
    m = replicating(tmp_path, s3, bucket, *more)
    try:
        (m.path / "a.bin").write_bytes(os.urandom(20 * MiB))  # parts in parallel: its threads exist
        m.replicated(timeout=120)
        pid = uploader_of(m)
        assert len(os.listdir(f"/proc/{pid}/task")) > 1 and sched(pid) == {want}  # SCHED_IDLE is policy 5
        assert sched(m.pid) == {(0, 0)}  # the daemon's own threads are unchanged
        assert m.status()["replication"]["uploader"]["priority"] \
            == (priority or "idle")
    finally:
        m.close()


def test_unmount_ends_the_uploader_even_a_stopped_one(tmp_path, s3, bucket):
    m = replicating(tmp_path, s3, bucket)
    try:
        (m.path / "a.bin").write_bytes(os.urandom(3 * MiB))
        m.replicated(timeout=120)
        pid = uploader_of(m)
        os.kill(pid, signal.SIGSTOP)  # it cannot even see the end of file of its socket
        res = m.umount(timeout=120)
        assert res.returncode == 0, res.stderr
        assert not alive(pid)
        assert "replicate.uploader_gone" not in m.log_text()  # a stop is no failure
    finally:
        m.close()
