"""Replication without an object store: snapshots of the durable state, per-piece CRCs, segment keys, GC (pure).

`snapshot.take` must describe exactly the durable tree (parents before children, hard links
sharing one version, symlinks, xattrs), name each file version by a key that changes
with its contents and only then, and give CRCs that match the bytes a restore would fetch
(holes and short chunks read as zeros). A segment's key from the journal's digests must be the
one its bytes give, and equal bytes at equal places in two versions share it. `unreferenced`
keeps every object a kept manifest names, segments and format 1's whole objects alike.
"""
import stat

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfs.format.records import Extent
from ckptfs.fs.namespace import ROOT_INO
from ckptfs.replicate import segments
from ckptfs.replicate.manifest import BadManifest, Entry, Manifest, parse_url, unreferenced
from ckptfs.replicate.plan import ORIGIN_XATTR, runs
from ckptfs.replicate.snapshot import name_segments, piece_crcs, same_tree, take
from ckptfs.store.allocator import Allocator
from ckptfs.store.dedupe import digest
from ckptfs.store.durable import DurableState

CHUNK = 4096
REG, DIR, LNK = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755, stat.S_IFLNK | 0o777


def fresh() -> DurableState:
    s = DurableState(Allocator([64, 64]))
    s.apply(("begin", 1, ROOT_INO + 1))
    s.apply(("attrs", ROOT_INO, DIR, 0, 0, 0, 0, 0))
    s.apply(("snapend",))
    return s


def content(s: DurableState, ino: int, data: bytes, mtime: int, start_unit: int, holes=(),
            digests: bool = False) -> None:
    """File `ino` holds `data` (chunks in `holes` only up to their last non-zero byte, or not at all);
    with `digests`, the journal also has each extent's digest (as with --dedupe on)."""
    exts = []
    found = []
    for i in range(0, len(data), CHUNK):
        idx = i // CHUNK
        piece = data[i:i + CHUNK].rstrip(b"\0") if idx in holes else data[i:i + CHUNK]
        if idx in holes and not piece:
            continue
        ext = Extent(idx % 2, start_unit + idx, len(piece), crc32c.crc32c(piece))
        exts.append((idx, ext))
        found.append((ext, digest(piece)))
    s.apply(("content", ino, len(data), mtime, mtime, exts))
    if digests:
        s.apply(("digests", found))


def tree() -> DurableState:
    s = fresh()
    s.apply(("make", ROOT_INO, b"d", DIR, 1, 2, 0, b"", 2, 10))
    s.apply(("make", 2, b"f", REG, 3, 4, 0, b"", 3, 11))
    content(s, 3, b"x" * 10000, 12, 0)
    s.apply(("link", 3, ROOT_INO, b"f2", 13))
    s.apply(("make", ROOT_INO, b"l", LNK, 0, 0, 0, b"d/f", 4, 14))
    s.apply(("setxattr", 3, b"user.a", b"1"))
    s.apply(("make", 2, b"e", DIR, 0, 0, 0, b"", 5, 15))
    s.apply(("make", 5, b"empty", REG, 0, 0, 0, b"", 6, 16))
    return s


def test_snapshot_lists_the_durable_tree_parents_first_with_one_object_per_version():
    s = tree()
    m, versions = take(s, pool="p", seq=7, chunk_size=CHUNK, time_ns=1, generation=3)
    paths = [e.path for e in m.entries]
    assert set(paths) == {"d", "f2", "l", "d/f", "d/e", "d/e/empty"}
    for e in m.entries:
        parent = e.path.rpartition("/")[0]
        assert parent == "" or paths.index(parent) < paths.index(e.path)
    by = {e.path: e for e in m.entries}
    assert by["d/f"].object == by["f2"].object and by["d/f"].ino == by["f2"].ino == 3
    assert by["d/f"].xattrs == {b"user.a": b"1"} and by["d/f"].size == 10000
    assert by["l"].target == b"d/f" and not by["l"].object
    assert by["d/e/empty"].size == 0 and by["d/e/empty"].crcs == []
    assert len(versions) == 2 and {e.object for e in m.entries if e.object} == set(versions)
    assert (m.generation, m.journal_seq, m.pool, m.chunk_size) == (3, 7, "p", CHUNK)
    assert all(v.segments is None for v in versions.values() if v.size)  # no digests: named from the bytes
    for v in versions.values():
        v.segments = [f"segments/{v.key}-{i}" for i in range(segments.count(v.size, m.segment_size))]
    name_segments(m, versions)
    assert m.objects() == {k for v in versions.values() for k in v.segments}
    assert Manifest.decode(m.encode()).encode() == m.encode()


def test_content_key_changes_with_the_contents_and_only_then():
    s = tree()
    m1, _ = take(s, pool="p", seq=1, chunk_size=CHUNK, time_ns=1)
    s.apply(("setattr", 3, 0o600, None, None, None, None, 20))  # a chmod: same object
    m2, _ = take(s, pool="p", seq=2, chunk_size=CHUNK, time_ns=2)
    f = lambda m: {e.path: e.object for e in m.entries}["d/f"]  # noqa: E731
    mtime = lambda m: {e.path: e.mtime_ns for e in m.entries}["d/f"]  # noqa: E731
    assert f(m1) == f(m2) and not same_tree(m1, m2)
    s.apply(("setattr", 3, None, None, None, 5, 99, 21))  # a utime: same object, the manifest has the time
    m2b, _ = take(s, pool="p", seq=2, chunk_size=CHUNK, time_ns=2)
    assert f(m2b) == f(m2) and mtime(m2b) == 99 and not same_tree(m2, m2b)
    content(s, 3, b"y" * 10000, 99, 20)  # new contents, even with the same size and mtime
    m3, versions = take(s, pool="p", seq=3, chunk_size=CHUNK, time_ns=3)
    assert f(m3) != f(m2) and f(m3) in versions
    content(s, 3, b"y" * 10000, 99, 40)  # the same bytes rewritten (other units): a new version
    m3b, _ = take(s, pool="p", seq=3, chunk_size=CHUNK, time_ns=3)
    assert f(m3b) != f(m3)
    content(s, 3, b"y" * 10000, 99, 20)
    m4, _ = take(s, pool="p", seq=4, chunk_size=CHUNK, time_ns=4, generation=9)
    assert same_tree(m3, m4)


def test_a_restored_file_is_named_by_the_object_it_came_from_until_its_bytes_change():
    s = tree()
    content(s, 3, b"r" * 10000, 12, 0)
    s.apply(("setxattr", 3, ORIGIN_XATTR, b"a" * 40))  # what a whole restore journals
    m1, versions = take(s, pool="p", seq=1, chunk_size=CHUNK, time_ns=1, known={"a" * 40: ["segments/s"]})
    e = {e.path: e for e in m1.entries}["d/f"]
    assert e.object == "a" * 40 and ORIGIN_XATTR not in e.xattrs
    assert versions[e.object].segments == ["segments/s"]  # the restored version's, known: nothing to read
    assert e.crcs == piece_crcs(10000, CHUNK, dict(s.files[3]))  # the local bytes are the object's
    assert versions[e.object].extents == dict(s.files[3])
    s.apply(("removexattr", 3, ORIGIN_XATTR))  # a write drops it (core.py) before its contents commit
    content(s, 3, b"w" * 10000, 13, 20)
    m2, _ = take(s, pool="p", seq=2, chunk_size=CHUNK, time_ns=2)
    new = {e.path: e for e in m2.entries}["d/f"].object
    assert new != e.object and len(new) == 40


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 5 * CHUNK), st.sets(st.integers(0, 5)), st.integers(0, 255))
def test_piece_crcs_match_the_bytes_a_restore_reads(size, holes, fill):
    data = bytearray(bytes([fill or 1]) * size)
    for idx in holes:  # a hole, or a chunk whose tail is zeros (a short extent)
        start = idx * CHUNK + (CHUNK // 3 if idx % 2 else 0)
        data[start:(idx + 1) * CHUNK] = bytes(max(0, min(size, (idx + 1) * CHUNK) - start))
    s = fresh()
    s.apply(("make", ROOT_INO, b"f", REG, 0, 0, 0, b"", 2, 1))
    content(s, 2, bytes(data), 1, 0, holes=holes)
    crcs = piece_crcs(size, CHUNK, s.files[2])
    want = [crc32c.crc32c(bytes(data[i:i + CHUNK])) for i in range(0, size, CHUNK)]
    assert crcs == want


def test_gc_keeps_what_the_kept_manifests_name():
    def manifest(gen, objs):  # format 1: one object per version
        return Manifest(gen, "p", gen, gen, CHUNK,
                        [Entry(f"f{i}", REG, 0, 0, 0, ino=i, size=1, object=o) for i, o in enumerate(objs)])
    kept = [manifest(4, ["objects/a", "objects/b"]), manifest(5, ["objects/b", "objects/c"])]
    seg = Manifest(6, "p", 6, 6, CHUNK, [Entry("g", REG, 0, 0, 0, ino=9, size=CHUNK + 1, object="v",
                                               segments=["segments/s", "segments/t"])], segment_size=CHUNK)
    stored = {"objects/a", "objects/b", "objects/c", "objects/old", "segments/s", "segments/t", "segments/u"}
    assert unreferenced(stored, kept + [seg]) == {"objects/old", "segments/u"}
    assert unreferenced({"objects/x"}, []) == {"objects/x"}
    assert seg.pieces(seg.entries[0]) == [("segments/s", 0, CHUNK), ("segments/t", CHUNK, 1)]


def test_a_manifest_with_the_wrong_number_of_segments_is_refused():
    m = Manifest(1, "p", 1, 1, CHUNK, [Entry("g", REG, 0, 0, 0, ino=9, size=3 * CHUNK, object="v",
                                             segments=["segments/s"])], segment_size=2 * CHUNK)
    with pytest.raises(BadManifest, match="1 segments for"):
        Manifest.decode(m.encode())


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 7 * CHUNK), st.sets(st.integers(0, 7)), st.integers(1, 255), st.sampled_from([1, 2, 3]))
def test_segment_keys_from_the_journal_are_the_keys_of_the_bytes(size, holes, fill, per):
    """The key `take` names a segment by (from the digests the journal keeps) is the key its bytes
    give (what the replicator computes when a digest is missing), holes and zero tails included."""
    data = bytearray(bytes([fill]) * size)
    for idx in holes:
        start = idx * CHUNK + (CHUNK // 3 if idx % 2 else 0)
        data[start:(idx + 1) * CHUNK] = bytes(max(0, min(size, (idx + 1) * CHUNK) - start))
    s = fresh()
    s.apply(("make", ROOT_INO, b"f", REG, 0, 0, 0, b"", 2, 1))
    content(s, 2, bytes(data), 1, 0, holes=holes, digests=True)
    seg = per * CHUNK
    _, versions = take(s, pool="p", seq=1, chunk_size=CHUNK, time_ns=1, segment_size=seg)
    (v,) = versions.values()
    from_bytes = [segments.key_from_bytes(memoryview(bytes(data[i * seg:(i + 1) * seg])),
                                          segments.layout(size, CHUNK, v.extents, i, seg))
                  for i in range(segments.count(size, seg))]
    assert v.segments == from_bytes


def test_unchanged_segments_of_a_new_version_keep_their_keys():
    """A file saved again with one chunk changed: only the segment holding it gets a new key, though
    every extent is new (dedupe off keeps no digests: the bytes give them, as in the replicator)."""
    s = fresh()
    s.apply(("make", ROOT_INO, b"a", REG, 0, 0, 0, b"", 2, 1))
    s.apply(("make", ROOT_INO, b"b", REG, 0, 0, 0, b"", 3, 1))
    old = bytes(range(256)) * (8 * CHUNK // 256) + b"tail"
    new = bytearray(old)
    new[5 * CHUNK + 7] ^= 0xFF
    content(s, 2, old, 1, 0, digests=True)
    content(s, 3, bytes(new), 1, 20, digests=True)
    _, versions = take(s, pool="p", seq=1, chunk_size=CHUNK, time_ns=1, segment_size=2 * CHUNK)
    a, b = (versions[k].segments for k in sorted(versions, key=lambda k: versions[k].ino))
    assert len(a) == len(b) == 5
    assert [x == y for x, y in zip(a, b)] == [True, True, False, True, True]


def test_restore_runs_stay_inside_one_segment():
    assert runs([0, 1, 2, 3, 4, 5, 7], 8, span=2) == [(0, 1), (2, 3), (4, 5), (7, 7)]
    assert runs([1, 2, 3], 8) == [(1, 3)]
    assert runs([1, 2, 3], 2) == [(1, 2), (3, 3)]


def test_urls():
    assert str(parse_url("s3://bkt/a/b/")) == "s3://bkt/a/b/"
    for bad in ("http://bkt/x", "s3://B/x", "s3://bkt/a//b", "s3://bkt/../x"):
        try:
            parse_url(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} parsed")


def test_every_failure_of_the_store_becomes_one_line_with_its_cause():
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    from ckptfs.replicate.client import classify

    def client_error(code, status, op="ListObjectsV2"):
        return ClientError({"Error": {"Code": code, "Message": f"msg {code}"},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, op)

    cases = [
        (NoCredentialsError(), "list s3://b/p/", "auth", "no usable AWS credentials"),
        (client_error("InvalidAccessKeyId", 403), "list s3://b/p/", "auth", "access denied"),
        (client_error("SignatureDoesNotMatch", 403), "get s3://b/p/x", "auth", "check the credentials"),
        (client_error("NoSuchBucket", 404), "list s3://b/p/", "no-bucket", "the bucket does not exist"),
        (client_error("404", 404, "HeadBucket"), "bucket b", "no-bucket", "the bucket does not exist"),
        (client_error("NoSuchKey", 404, "GetObject"), "get s3://b/p/x", "other", "no such object"),
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), "list s3://b/p/", "network",
         "cannot reach the object store"),
        (ConnectionResetError("reset"), "get s3://b/p/x", "network", "cannot reach the object store"),
        (client_error("SlowDown", 503), "put s3://b/p/x", "throttled", "slow down"),
        (client_error("InternalError", 500), "put s3://b/p/x", "server", "the store failed"),
        (client_error("InvalidRange", 416, "GetObject"), "get s3://b/p/x", "other", "InvalidRange"),
        (RuntimeError("odd"), "get s3://b/p/x", "other", "RuntimeError: odd"),
    ]
    for exc, what, cause, words in cases:
        err = classify(exc, what)
        line = str(err)
        assert err.cause == cause and words in line and line.startswith(what + ": "), (exc, cause, line)
        assert "\n" not in line


def test_a_store_without_conditional_puts_gets_plain_ones_from_then_on(caplog):
    """put_new on a store that answers If-None-Match with 501 NotImplemented: the same put without
    the condition, one warning, and no condition asked again (botocore's Stubber: no server)."""
    import boto3
    from botocore.stub import ANY, Stubber

    from ckptfs.replicate.client import Target

    client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="k", aws_secret_access_key="s")
    target = Target(parse_url("s3://bkt/p"), client=client)
    with Stubber(client) as stub:
        stub.add_client_error("put_object", "NotImplemented", "A header you provided implies functionality "
                              "that is not implemented", 501,
                              expected_params={"Bucket": "bkt", "Key": "p/m1", "Body": ANY, "IfNoneMatch": "*"})
        for key in ("p/m1", "p/m2"):
            stub.add_response("put_object", {}, {"Bucket": "bkt", "Key": key, "Body": ANY})
        assert target.put_new("m1", b"one") and target.put_new("m2", b"two")
        stub.assert_no_pending_responses()
    assert not target.conditional
    assert [r.levelname for r in caplog.records if "conditional puts" in r.getMessage()] == ["WARNING"]


def _manifest(pool: str, gen: int = 7) -> Manifest:
    return Manifest(generation=gen, pool=pool, journal_seq=1, time_ns=1_700_000_000 * 10**9, chunk_size=CHUNK,
                    entries=[])


def test_one_writer_per_prefix_who_may_start_replicating_where():
    from ckptfs.replicate import lineage
    url = "s3://ckpt/node-3/"
    ours, old, other = "aa" * 16, "bb" * 16, "cc" * 16
    assert lineage.refusal(None, ours, frozenset(), False, url) is None  # an empty prefix
    assert lineage.refusal(_manifest(ours), ours, frozenset(), False, url) is None  # a remount
    assert lineage.refusal(_manifest(old), ours, frozenset({old}), False, url) is None  # restored from it
    assert lineage.refusal(_manifest(other), ours, frozenset(), True, url) is None  # --replicate-takeover
    why = lineage.refusal(_manifest(other), ours, frozenset({old}), False, url)
    assert why is not None and "\n" not in why
    for part in (url, other[:16], "manifest 7", "2023-11-14 22:13:20Z", "--replicate-takeover",
                 f"--restore-from {url}"):
        assert part in why, part
    assert lineage.newer([1, 5, 9, 8], 8) == [9] and lineage.newer([3, 8], 8) == []
    line = lineage.conflict(url, 9, _manifest(other, 9))
    assert url in line and "manifest 9" in line and other[:16] in line and "\n" not in line
    assert "unreadable" in lineage.conflict(url, 9, None)


def test_lineage_lives_in_a_hidden_root_attribute_and_bad_values_read_as_none():
    from ckptfs.fs.namespace import Namespace
    from ckptfs.replicate import lineage
    ns = Namespace()
    assert lineage.of(ns) == frozenset() and lineage.of(None) == frozenset()
    ns.setxattr(ROOT_INO, lineage.LINEAGE_XATTR, lineage.encode({"bb", "aa"}))
    assert lineage.of(ns) == {"aa", "bb"}
    assert lineage.LINEAGE_XATTR.startswith(b"ckptfs.")  # hidden: never listed, never in a manifest
    for bad in (b"not json", b"{}", b'[1, "aa"]'):
        ns.setxattr(ROOT_INO, lineage.LINEAGE_XATTR, bad)
        assert lineage.of(ns) <= {"aa"}


def test_backoff_is_full_jitter_under_a_doubling_cap():
    """Each delay is drawn from 0 .. min(BACKOFF_MAX, BACKOFF_MIN * 2^n): spread over the whole range
    (nodes that lost the store together do not retry in lockstep), never above the cap."""
    import random

    from ckptfs.replicate.replicator import BACKOFF_MAX, BACKOFF_MIN, backoff
    rng = random.Random(1)
    for attempt in (0, 1, 3, 5, 40, 1000):
        cap = min(BACKOFF_MAX, BACKOFF_MIN * 2 ** attempt)
        draws = [backoff(attempt, rng) for _ in range(2000)]
        assert all(0 <= d <= cap for d in draws)
        assert min(draws) < cap * 0.05 and max(draws) > cap * 0.95  # the whole range, not a fixed delay


def test_upload_arguments_come_from_the_environment_and_bad_ones_are_refused():
    from ckptfs.replicate.client import KMS_KEY_ENV, SSE_ENV, STORAGE_CLASS_ENV, upload_args
    assert upload_args({}) == {}
    assert upload_args({SSE_ENV: "AES256", STORAGE_CLASS_ENV: "STANDARD_IA"}) == {
        "ServerSideEncryption": "AES256", "StorageClass": "STANDARD_IA"}
    assert upload_args({SSE_ENV: "aws:kms", KMS_KEY_ENV: "alias/ckpt"}) == {
        "ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "alias/ckpt"}
    for env, word in (({SSE_ENV: "rot13"}, "server-side encryption"), ({KMS_KEY_ENV: "k"}, "aws:kms"),
                      ({SSE_ENV: "AES256", KMS_KEY_ENV: "k"}, "aws:kms"), ({STORAGE_CLASS_ENV: "COLD"}, "COLD")):
        with pytest.raises(ValueError, match=word):
            upload_args(env)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3 * CHUNK)),
                                                    max_size=4)), min_size=1, max_size=12))
def test_the_replicators_counts_of_kept_manifests_match_a_recount(steps):
    """Manifests join and leave the kept set in any order (format 2, and format 1 whole objects):
    the replicator's running counts (which segments are named, what the store holds for which
    versions, what is unnamed) equal those counted again from the kept manifests alone."""
    from types import SimpleNamespace

    from ckptfs.replicate.manifest import parse_url
    from ckptfs.replicate.replicator import Replicator

    rep = Replicator(SimpleNamespace(chunk_size=CHUNK), parse_url("s3://bkt/p"), segment=CHUNK)
    try:
        kept: dict[int, Manifest] = {}
        for gen, (old_format, files) in enumerate(steps):
            entries = []
            for n, (version, size) in enumerate(files):
                if old_format:
                    entries.append(Entry(f"f{n}", REG, 0, 0, 0, ino=n, size=size, object=f"objects/{version}-{size}"))
                else:  # version v's segment i is "s{v}-{i}" ("z" for every version's last: shared)
                    segs = [f"segments/s{version}-{i}" if i < -(-size // CHUNK) - 1 else f"segments/z{size % CHUNK}"
                            for i in range(-(-size // CHUNK))]
                    entries.append(Entry(f"f{n}", REG, 0, 0, 0, ino=n, size=size, object=f"{version}-{size}",
                                         segments=segs))
            m = Manifest(gen, "p", gen, gen, CHUNK, entries, segment_size=0 if old_format else CHUNK)
            rep.objects |= m.objects()
            kept[gen] = m
            rep._name(m, 1)
            if len(kept) > 2 and gen % 3 == 0:  # an older one leaves
                rep._name(kept.pop(min(kept)), -1)
            named = set().union(*(k.objects() for k in kept.values()))
            assert set(rep.uses) == named and rep.unnamed == rep.objects - named
            versions = {(e.object, k.segment_size): e for k in kept.values() for e in k.entries if e.size}
            assert rep.kept_bytes == sum(e.size for e in versions.values())
            lengths = {key: length for k in kept.values() for e in k.entries for key, _, length in k.pieces(e)}
            assert rep.stored_bytes == sum(lengths.values())
            assert rep.known == {v: e.segments for (v, seg), e in versions.items() if seg == CHUNK}
    finally:
        rep.parts.close()
