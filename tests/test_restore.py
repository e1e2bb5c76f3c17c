"""Restore on a replacement node (issue 13, item 4): `ckptfs mount --format --restore-from s3://...`.

Pure tests of the planning (replicate/plan.py) and of the gate in the core
(fs/remote.py, filemap, core) need no S3; the real-mount tests run the CLI
and the daemon against a real S3 server (SeaweedFS, the `s3` fixture), with
trees published by tests/s3seed.py the way the uploader publishes them.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import time
from pathlib import Path

import pytest

from ckptfs.errors import FsError
from ckptfs.fs.arena import Arena
from ckptfs.fs.core import Filesystem
from ckptfs.fs.filemap import FileData
from ckptfs.fs.remote import NeedsRestore, Remote
from ckptfs.replicate import plan
from ckptfs.replicate.manifest import Entry, Manifest
from mounting import CkptMount, ckptfs, is_mounted
from waiting import poll

CS = 1 << 20


# ---- pure: the plan ------------------------------------------------------------------
def _m(entries, cs=CS):
    return Manifest(1, "p", 1, 0, cs, entries)


def test_tree_is_parents_first_and_equal_inodes_become_links():
    f = Entry("d/a", stat.S_IFREG | 0o644, 0, 0, 5, ino=7, size=3, object="objects/x", crcs=[1])
    steps = plan.tree(_m([Entry("", stat.S_IFDIR | 0o755, 0, 0, 1), Entry("d", stat.S_IFDIR | 0o700, 0, 0, 2), f,
                          Entry("b", stat.S_IFREG | 0o644, 0, 0, 5, ino=7, size=3, object="objects/x", crcs=[1]),
                          Entry("s", stat.S_IFLNK | 0o777, 0, 0, 3, ino=9, target=b"d/a")]))
    assert [(s.parent, s.name, s.link_to) for s in steps] == [("", "d", None), ("d", "a", None), ("", "b", "d/a"),
                                                              ("", "s", None)]
    with pytest.raises(ValueError, match="before its directory"):
        plan.tree(_m([f]))


def test_missing_chunks_are_those_without_a_matching_extent():
    class X:
        def __init__(self, length, crc):
            self.length, self.crc = length, crc

    size = 2 * CS + 10
    crcs = [11, 22, 33]
    assert plan.missing_chunks(size, CS, crcs, {}) == [0, 1, 2]
    assert plan.missing_chunks(size, CS, crcs, {0: X(CS, 11), 1: X(CS, 99), 2: X(10, 33)}) == [1]
    assert plan.missing_chunks(size, CS, crcs, {2: X(CS, 33)}) == [0, 1, 2]  # wrong length
    assert plan.missing_chunks(0, CS, [], {}) == []


def test_runs_group_consecutive_chunks_up_to_a_bound():
    assert plan.runs([5, 1, 2, 3, 7, 8], 2) == [(1, 2), (3, 3), (5, 5), (7, 8)]
    assert plan.runs([], 4) == []
    assert plan.byte_range(1, 2, 2 * CS + 5, CS) == (CS, 2 * CS + 5)


def test_markers_round_trip_and_order_is_newest_first():
    src = plan.Source("s3://b/p/", "http://h:1", 42, complete_tree=True)
    assert plan.Source.decode(src.encode()) == src
    fm = plan.FileMarker("objects/abc", 123)
    assert plan.FileMarker.decode(fm.encode()) == fm
    old, new = Entry("a", 0o100644, 0, 0, 1), Entry("b", 0o100644, 0, 0, 2)
    assert plan.fetch_order([old, new]) == [new, old]
    with pytest.raises(ValueError, match="checksums"):
        plan.check_crcs(Entry("a", 0o100644, 0, 0, 1, size=CS + 1, crcs=[1]), CS)


# ---- pure: the gate in the core -------------------------------------------------------------
def _gated(size=3 * CS, missing=(0, 1, 2)):
    fs = Filesystem(Arena(8 * CS, CS), capacity_bytes=1 << 30)
    inode = fs.mknod(1, b"f", stat.S_IFREG | 0o644, 0, 0, 0)
    inode.size = size
    cancelled = []

    class Gate(Remote):
        def cancelled(self):
            cancelled.append(True)

    gate = Gate(inode.ino, size, CS, missing)
    inode.data.remote = gate
    return fs, inode, gate, cancelled


def test_reads_of_chunks_not_restored_raise_needs_restore_never_zeros():
    fs, inode, gate, _ = _gated()
    fh = fs.open(inode.ino, os.O_RDONLY).fh
    with pytest.raises(NeedsRestore) as e:
        fs.read(fh, CS - 1, 2)
    assert e.value.indexes == [0, 1] and e.value.remote is gate
    inode.data.fill(CS, b"x" * CS)  # the restorer's write passes the gate
    gate.arrived(1)
    assert bytes(fs.read(fh, CS, 4)) == b"xxxx"
    with pytest.raises(NeedsRestore):
        fs.read(fh, 0, 1)
    assert bytes(fs.read(fh, 3 * CS, 10)) == b""  # past the end: nothing to wait for


def test_writes_and_size_changes_wait_for_the_whole_file_and_truncate_to_zero_cancels():
    fs, inode, gate, cancelled = _gated()
    fh = fs.open(inode.ino, os.O_RDWR).fh
    with pytest.raises(NeedsRestore) as e:
        fs.write(fh, 0, b"a")
    assert e.value.indexes == [0, 1, 2]
    slot = fs.arena.lend_nowait()  # a whole chunk read into a lent slot (the native engine) waits too
    with pytest.raises(NeedsRestore):
        fs.write(fh, CS, fs.arena.view(slot), slot=slot)
    with pytest.raises(NeedsRestore):
        fs.writev(fh, 0, [fs.arena.view(slot)] * 2, slots=[slot, None])
    with pytest.raises(NeedsRestore):  # the rest of a chunk, adopted after its head (a shifted run)
        fs.writev(fh, CS + 7, [fs.arena.view(slot)[7:]], slots=[slot], shift=7)
    assert fs.arena.is_lent(slot) and inode.data.chunks == {}
    fs.arena.unlend(slot)
    with pytest.raises(NeedsRestore):
        fs.setattr(inode.ino, size=10)
    with pytest.raises(NeedsRestore):
        fs.setattr(inode.ino, size=4 * CS)
    assert inode.size == 3 * CS
    fs.open(inode.ino, os.O_WRONLY | os.O_TRUNC)
    assert cancelled == [True] and inode.data.remote is None and inode.size == 0
    assert fs.write(fh, 0, b"new") == 3 and bytes(fs.read(fh, 0, 10)) == b"new"


def test_hidden_attributes_are_not_shown_nor_settable():
    fs, inode, _, _ = _gated()
    fs.ns.setxattr(inode.ino, plan.FILE_XATTR, b"{}")
    fs.setxattr(inode.ino, b"user.a", b"1")
    assert fs.listxattr(inode.ino) == [b"user.a"]
    for call in (lambda: fs.getxattr(inode.ino, plan.FILE_XATTR),
                 lambda: fs.setxattr(inode.ino, b"ckptfs.x", b"1"),
                 lambda: fs.removexattr(inode.ino, plan.FILE_XATTR)):
        with pytest.raises(FsError):
            call()


def test_needs_restore_is_a_needs_fetch_so_fallbacks_see_must_wait():
    from ckptfs.fs.filemap import NeedsFetch
    gate = Remote(5, 10, CS, [0])
    assert isinstance(NeedsRestore(gate, [0]), NeedsFetch)
    assert FileData(Arena(2 * CS, CS)).remote is None


# ---- real mounts against a real S3 server ------------------------------------------------------
def _tree(root: Path) -> None:
    (root / "a" / "b").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a" / "empty.bin").write_bytes(b"")
    (root / "a" / "odd.bin").write_bytes(os.urandom(3 * CS + 12345))
    (root / "a" / "b" / "big.bin").write_bytes(os.urandom(24 * CS + 7))
    (root / "small.txt").write_bytes(b"hello restore\n")
    os.symlink("a/odd.bin", root / "link")
    os.link(root / "a" / "odd.bin", root / "a" / "b" / "hard.bin")
    os.setxattr(root / "small.txt", "user.tag", b"v1")
    os.setxattr(root / "a", "user.dir", b"d")
    os.chmod(root / "small.txt", 0o640)
    os.chmod(root / "a" / "b", 0o750)
    os.chown(root / "small.txt", 1234, 567)
    os.utime(root / "small.txt", ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    os.mknod(root / "a" / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))  # a device keeps its number
    os.mkfifo(root / "a" / "pipe", 0o640)


def _walk(root: Path) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            rel = p.relative_to(root).as_posix()
            xattrs = {n: os.getxattr(p, n, follow_symlinks=False) for n in os.listxattr(p, follow_symlinks=False)
                      if n.startswith("user.") and not n.startswith("user.ckptfs.")}
            info = {"mode": st.st_mode, "uid": st.st_uid, "gid": st.st_gid, "size": st.st_size,
                    "nlink": st.st_nlink, "xattrs": xattrs}
            if stat.S_ISREG(st.st_mode):
                info["data"] = p.read_bytes()
                info["mtime_ns"] = st.st_mtime_ns
            elif stat.S_ISLNK(st.st_mode):
                info["target"] = os.readlink(p)
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                info["rdev"] = st.st_rdev
            if stat.S_ISDIR(st.st_mode):
                del info["nlink"], info["size"]  # as each filesystem counts them
                info["mtime_ns"] = st.st_mtime_ns
            out[rel] = info
    return out


def _status(m: CkptMount) -> dict:
    res = ckptfs("status", str(m.path), "--json", check=True)
    return json.loads(res.stdout)


def _restore_status(m: CkptMount) -> dict | None:
    return _status(m).get("restore")


def _done(m: CkptMount) -> bool:
    r = _restore_status(m)
    return r is not None and r["state"] == "done"


class Published:
    """A tree to publish under s3://BUCKET/node0 of the test S3 server, and mounts restoring it."""

    def __init__(self, s3, bucket: str, tmp_path: Path):
        self.s3, self.client, self.bucket = s3, s3.client(), bucket
        self.tree = tmp_path / "tree"
        self.tree.mkdir()
        self.node = tmp_path / "node"
        self.url = f"s3://{bucket}/node0"

    def publish(self, segment_size: int = 0) -> Manifest:
        """Format 1 (a whole object per file) unless `segment_size` asks for format 2."""
        from s3seed import publish
        return publish(self.client, self.bucket, "node0", self.tree, segment_size=segment_size)

    def mount(self, *more: str) -> CkptMount:
        m = CkptMount(self.node, memory="256M")
        m.mount("--restore-from", self.url, "--s3-endpoint", self.s3.endpoint, *more)
        return m


@pytest.fixture
def source(s3, tmp_path, monkeypatch, request):
    """A fresh bucket on the test S3 server; the daemon gets its credentials from the environment."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    bucket = "restore-" + str(abs(hash(request.node.name)) % 10**8) + "-" + str(os.getpid())
    s3.client().create_bucket(Bucket=bucket)
    return Published(s3, bucket, tmp_path)


@pytest.mark.mount
@pytest.mark.parametrize("segment_size", [0, 2 * CS], ids=["format1", "segments"])
def test_restore_shows_the_tree_and_every_file_is_bit_exact_then_local(source, segment_size):
    _tree(source.tree)
    source.publish(segment_size)
    want = _walk(source.tree)
    m = source.mount("--metrics-port", "0")
    try:
        got = _walk(m.path)  # at once: contents come on first read
        assert got == want
        st_a, st_b = os.stat(m.path / "a" / "odd.bin"), os.stat(m.path / "a" / "b" / "hard.bin")
        assert st_a.st_ino == st_b.st_ino and st_a.st_nlink == 2
        for p in ("small.txt", "a/b/big.bin", ""):  # the restore's own markers never show
            assert not [n for n in os.listxattr(m.path / p) if not n.startswith("user.")]
        poll(lambda: _done(m), "the restore to finish", timeout=120, every=0.2)
        r = _restore_status(m)
        assert r["files_restored"] == r["files_total"] == 4 and r["bytes_restored"] == r["bytes_total"]
        assert r["generation"] == 1 and r["errors_total"] == 0
        import urllib.request
        metrics = urllib.request.urlopen(_status(m)["metrics_url"], timeout=10).read().decode()
        values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("ckptfs_restore_")}
        assert values['ckptfs_restore_bytes{kind="restored"}'] == r["bytes_total"]
        assert values["ckptfs_restore_done"] == 1 and values['ckptfs_restore_files{kind="total"}'] == 4
        assert m.umount().returncode == 0
        # the node no longer needs the object store: no source, no credentials
        m.mount("--s3-endpoint", "http://127.0.0.1:1")
        assert _walk(m.path) == want
        assert _restore_status(m) is None
    finally:
        m.close()


@pytest.mark.mount
def test_torch_load_works_at_once_while_the_background_restore_is_slow(source):
    import torch
    tree = source.tree
    (tree / "ckpt").mkdir()
    sd = {f"w{i}": torch.randn(512, 1024) for i in range(10)}  # 20 MiB
    torch.save(sd, tree / "ckpt" / "model.pt")
    (tree / "ckpt" / "other.bin").write_bytes(os.urandom(24 * CS))  # 3 GETs, 8 s apart at 1M/s
    os.utime(tree / "ckpt" / "other.bin", ns=(time.time_ns() + 10**9,) * 2)  # newer: the background goes first
    source.publish()
    m = source.mount("--restore-rate", "1M", "--restore-concurrency", "1")
    try:
        t0 = time.monotonic()
        loaded = torch.load(m.path / "ckpt" / "model.pt")
        took = time.monotonic() - t0
        r = _restore_status(m)
        assert r["state"] == "fetching" and r["files_restored"] < r["files_total"], r
        assert r["demand_fetches"] > 0
        assert took < 15, took  # the background alone would need ~44 s for these 44 MiB
        for k, v in sd.items():
            assert torch.equal(loaded[k], v)
    finally:
        m.close()


@pytest.mark.mount
def test_sigkill_mid_restore_then_a_plain_remount_continues_bit_exact(source):
    tree = source.tree
    big = os.urandom(32 * CS + 99)
    (tree / "big.bin").write_bytes(big)
    (tree / "trunc.bin").write_bytes(os.urandom(2 * CS))
    (tree / "rw.bin").write_bytes(os.urandom(CS + 1))
    source.publish()
    m = source.mount("--restore-rate", "3M", "--restore-concurrency", "2", "--max-lag", "0.2")
    try:
        # a write to a file still being restored waits for it; O_TRUNC drops it and its restore
        with open(m.path / "trunc.bin", "wb") as f:
            f.write(b"replaced")
        with open(m.path / "rw.bin", "r+b") as f:
            f.seek(CS)
            f.write(b"!")
        want_rw = (tree / "rw.bin").read_bytes()[:CS] + b"!"
        poll(lambda: _restore_status(m)["bytes_restored"] >= 12 * CS, "part of the restore", timeout=60)
        time.sleep(1.5)  # a progress commit (every second) reaches the journal
        assert _restore_status(m)["state"] == "fetching"
        m.kill()
        m.mount("--max-lag", "0.2")  # no --restore-from: the pool knows it was restoring, and from where
        with open(m.path / "big.bin", "rb") as f:  # never zeros: reads wait for what is not local
            head = f.read(4 * CS)
        assert head == big[:4 * CS]
        poll(lambda: _done(m), "the restore to finish", timeout=120, every=0.2)
        # it went on from what was durable: this daemon fetched less than the file
        assert _restore_status(m)["bytes_fetched"] <= len(big) - 4 * CS
        assert (m.path / "big.bin").read_bytes() == big
        assert (m.path / "trunc.bin").read_bytes() == b"replaced"
        assert (m.path / "rw.bin").read_bytes() == want_rw
        assert m.umount().returncode == 0
        m.mount()
        assert (m.path / "big.bin").read_bytes() == big and (m.path / "trunc.bin").read_bytes() == b"replaced"
        assert "restore.resumed" in m.log_text()
    finally:
        m.close()


@pytest.mark.mount
def test_a_corrupt_chunk_on_the_server_is_eio_and_status_names_the_cause(source):
    data = os.urandom(4 * CS)
    (source.tree / "f.bin").write_bytes(data)
    manifest = source.publish()
    key = "node0/" + next(e.object for e in manifest.entries if e.path == "f.bin")
    bad = bytearray(data)
    bad[2 * CS + 5] ^= 0xFF
    source.client.put_object(Bucket=source.bucket, Key=key, Body=bytes(bad))
    m = source.mount()
    try:
        with open(m.path / "f.bin", "rb") as f:
            assert f.read(CS) == data[:CS]
            f.seek(2 * CS)
            with pytest.raises(OSError) as e:
                f.read(CS)
            assert e.value.errno == errno.EIO
        r = poll(lambda: (_restore_status(m) or {}).get("errors_total") and _restore_status(m), "the error")
        assert "checksum mismatch" in r["last_error"] and key in r["last_error"] and "f.bin" in r["last_error"]
        assert "checksum mismatch" in ckptfs("status", str(m.path)).stdout
    finally:
        m.close()


@pytest.mark.mount
def test_bad_restore_input_is_one_line_exit_2_and_nothing_changes(s3, source, monkeypatch):
    (source.tree / "x").write_bytes(b"x")
    source.publish()
    bucket = source.bucket
    m = CkptMount(source.node)
    base = ["mount", str(m.path), "--devices", m.device_arg, "--memory", "64M", "--log-file", str(m.log)]
    ok = [f"s3://{bucket}/node0", "--s3-endpoint", s3.endpoint]
    cases = {
        "not an s3:// URL": ["--format", "--restore-from", "http://b/p", "--s3-endpoint", s3.endpoint],
        "not a valid bucket name": ["--format", "--restore-from", "s3://B_ad/p", "--s3-endpoint", s3.endpoint],
        "bucket does not exist": ["--format", "--restore-from", "s3://no-such-bucket-here/p", "--s3-endpoint", s3.endpoint],
        "no manifest under": ["--format", "--restore-from", f"s3://{bucket}/elsewhere", "--s3-endpoint", s3.endpoint],
        "cannot reach the object store": ["--format", "--restore-from", ok[0], "--s3-endpoint", "http://127.0.0.1:1"],
        "add --format": ["--restore-from", *ok],
        "differs from the chunk size of the manifest": ["--format", "--chunk-size", "4M", "--restore-from", *ok],
        "bad --s3-endpoint": ["--format", "--restore-from", ok[0], "--s3-endpoint", "localhost:9000"],
        "needs --restore-from": ["--format", "--restore-if-any"],
        # --restore-if-any forgives an empty prefix only, never a store that fails
        "manifests/: the bucket does not exist": ["--format", "--restore-if-any", "--restore-from",
                                                   "s3://no-such-bucket-here/p", "--s3-endpoint", s3.endpoint],
    }
    for want, args in cases.items():
        res = ckptfs(*base, *args, timeout=60)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and want in lines[0], (want, res.returncode, res.stderr)
        assert lines[0].startswith("ckptfs mount: ")
        assert not is_mounted(m.path)
        assert not any(open(d, "rb").read(1 << 20).strip(b"\0") for d in m.devices), "a device was changed"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    res = ckptfs(*base, "--format", "--restore-from", *ok, timeout=60)
    assert res.returncode == 2 and "access denied" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not is_mounted(m.path)


# ---- in-process: the daemon's wiring over in-memory devices, a real S3 server -----------------------
def _assemble(devices, **kw):
    from ckptfs.daemon import MountConfig, assemble
    cfg = MountConfig(mountpoint="", devices=[d.path for d in devices], memory=4 << 20, chunk_size=64 << 10,
                      journal_half=256 << 10, queue_depth=2, **kw)
    return assemble(cfg, devices)


def _serve(mount, body, fetching: bool = True):
    """Run the store and the restorer (as the daemon does; `fetching` False: its tree only) around
    `body(mount)`, then stop: no clean close."""
    import trio

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(mount.store.run)
            if mount.restorer is not None:
                mount.restorer.prepare()
                if fetching:
                    await nursery.start(mount.restorer.run)
            await body(mount)
            nursery.cancel_scope.cancel()

    trio.run(main)


async def _read_all(mount, path: bytes) -> bytes:
    ino = mount.fs.ns.child(1, path).ino
    fh = (await mount.afs.open(ino, os.O_RDONLY)).fh
    try:
        return bytes(await mount.afs.read(fh, 0, 1 << 30))
    finally:
        await mount.afs.release(fh)


def test_a_read_that_comes_before_the_restorer_runs_waits_for_it(source):
    import trio
    from faulty import make_faulty
    from s3seed import publish
    data = os.urandom(200 << 10)
    (source.tree / "f.bin").write_bytes(data)
    publish(source.client, source.bucket, "node0", source.tree, chunk_size=64 << 10)
    mount = _assemble(make_faulty(2, 16 << 20), format=True, restore_from=source.url, s3_endpoint=source.s3.endpoint)
    got = []

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(mount.store.run)
            mount.restorer.prepare()  # the tree is built: the daemon starts the engine here

            async def read():
                got.append(await _read_all(mount, b"f.bin"))

            nursery.start_soon(read)
            await trio.sleep(0.2)  # the read waits; the restorer starts only now, as in daemon.main
            assert not got
            await nursery.start(mount.restorer.run)
            with trio.fail_after(30):
                while not got:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert got == [data]


def test_a_crash_while_the_tree_is_built_restarts_the_restore_on_a_fresh_pool(source):
    import trio
    from faulty import make_faulty
    from s3seed import publish
    data = os.urandom(200 << 10)
    (source.tree / "f.bin").write_bytes(data)
    (source.tree / "d").mkdir()
    publish(source.client, source.bucket, "node0", source.tree, chunk_size=64 << 10)
    devices = make_faulty(2, 16 << 20)
    first = _assemble(devices, format=True, restore_from=source.url, s3_endpoint=source.s3.endpoint)

    async def half_built(mount):  # what a crash in the middle of tree.build leaves committed
        mount.fs.ns.setxattr(1, plan.SOURCE_XATTR, plan.Source(source.url, source.s3.endpoint, 1).encode())
        mount.fs.mkdir(1, b"junk", 0o755, 0, 0)
        await mount.store.sync(1)

    first.restorer.pending = None  # never built
    # (its restorer not running: with nothing to fetch it would finish and drop the marker that
    # half_built sets, racing it; seen once under load in a full run)
    _serve(first, half_built, fetching=False)
    again = _assemble(devices)  # a plain mount
    assert again.restorer is not None

    async def check(mount):
        assert sorted(mount.fs.ns.get(1).dir.entries) == [b"d", b"f.bin"]
        assert await _read_all(mount, b"f.bin") == data  # waits for what is not local
        with trio.fail_after(30):
            while mount.restorer.state != "done":
                await trio.sleep(0.02)

    _serve(again, check)
    last = _assemble(devices)
    assert last.restorer is None  # done: nothing of the restore is left, the store is not needed

    async def local(mount):
        assert await _read_all(mount, b"f.bin") == data

    _serve(last, local)


def test_a_remount_without_the_object_store_serves_what_is_local_and_fails_the_rest_with_the_cause(source):
    from faulty import make_faulty
    from s3seed import publish
    (source.tree / "f.bin").write_bytes(os.urandom(200 << 10))
    (source.tree / "small").write_bytes(b"")
    publish(source.client, source.bucket, "node0", source.tree, chunk_size=64 << 10)
    devices = make_faulty(2, 16 << 20)
    first = _assemble(devices, format=True, restore_from=source.url, s3_endpoint=source.s3.endpoint)

    async def tree_only(mount):  # the tree is committed, no data was fetched
        await mount.store.sync(1)

    _serve(first, tree_only, fetching=False)
    again = _assemble(devices, s3_endpoint="http://127.0.0.1:1")  # the store is unreachable now

    async def check(mount):
        assert await _read_all(mount, b"small") == b""
        with pytest.raises(FsError) as e:
            await _read_all(mount, b"f.bin")
        assert e.value.errno == errno.EIO and "cannot reach the object store" in str(e.value)
        snap = mount.restorer.statistics()
        assert snap.state == "loading" and "cannot reach the object store" in snap.last_error

    _serve(again, check)


def test_a_corrupt_chunk_fails_alone_its_neighbours_in_the_same_get_are_restored(source):
    """One GET fetches the whole 4-chunk file; chunk 2 is corrupt on the server: chunks 0, 1 and 3
    go into the file (a reader of them gets their bytes, even one waiting on that GET), chunk 2
    stays missing and is EIO with the cause."""
    import trio
    from faulty import make_faulty
    from s3seed import publish
    cs = 64 << 10
    data = os.urandom(4 * cs)
    (source.tree / "f.bin").write_bytes(data)
    manifest = publish(source.client, source.bucket, "node0", source.tree, chunk_size=cs)
    key = "node0/" + next(e.object for e in manifest.entries if e.path == "f.bin")
    bad = bytearray(data)
    bad[2 * cs + 5] ^= 0xFF
    source.client.put_object(Bucket=source.bucket, Key=key, Body=bytes(bad))
    mount = _assemble(make_faulty(2, 16 << 20), format=True, restore_from=source.url, s3_endpoint=source.s3.endpoint)

    async def check(mount):
        r = mount.restorer
        with trio.fail_after(30):
            while not r.errors_total:
                await trio.sleep(0.01)
        (job,) = r.jobs.values()
        assert sorted(job.missing) == [2]
        ino = mount.fs.ns.child(1, b"f.bin").ino
        fh = (await mount.afs.open(ino, os.O_RDONLY)).fh
        try:
            assert bytes(await mount.afs.read(fh, 0, 2 * cs)) == data[:2 * cs]
            assert bytes(await mount.afs.read(fh, 3 * cs, cs)) == data[3 * cs:]
            with pytest.raises(FsError) as e:
                await mount.afs.read(fh, 2 * cs, cs)
            assert e.value.errno == errno.EIO and "checksum mismatch" in str(e.value) and "chunk 2" in str(e.value)
        finally:
            await mount.afs.release(fh)
        assert "chunk 2" in r.statistics().last_error

    _serve(mount, check)
