"""Power cut after every write: littlefs-style exhaustive crash testing.

A fixed workload (checkpoint-style saves: tmp + rename over, delete of the
previous one, overwrite in place, fsync) runs once to count device writes;
then it runs again for every cut point n: the devices lose every write after
the n-th, and of the unflushed ones before it, an adversary keeps exactly the
journal writes and drops the data writes (the worst reordering a write cache
can do). After remounting, each file must be one of its committed versions,
every fsynced version must be there, and nothing may read back wrong (a
checksum error would surface as EIO).
"""
import random

import pytest

from faulty import crash_all, image_all
from inproc import Driver, PathOps, make_devices

CHUNK = 64 << 10
JOURNAL_END = (1 << 20) + 2 * (128 << 10)


def save(p: PathOps, data: bytes, fsync: bool = False) -> None:
    """How frameworks save a checkpoint: write a temporary file, rename it over the old one."""
    p.write_file("/ckpt.tmp", data, fsync=fsync)
    p.rename("/ckpt.tmp", "/ckpt")


def workload(p: PathOps, log: list):
    """Checkpoint saves in quick succession, an overwrite in place, deletes, fsyncs."""
    common = random.Random(99).randbytes(2 * CHUNK)  # the same first two chunks: --dedupe shares them
    v = [common + random.Random(i).randbytes(150_000 - 2 * CHUNK + 7 * i) for i in range(7)]
    save(p, v[0])
    save(p, v[1])  # renamed over v0 while v0 may still be draining: v0's commit is voided
    save(p, v[2], fsync=True)
    p.write_file("/other", v[3])
    p.write_file("/other", v[4])  # overwrite in place
    p.fsync("/ckpt")
    p.unlink("/other")
    save(p, v[5])
    save(p, v[6])
    return v


def run(cut: int | None, keep_journal_only: bool, dedupe: bool = False):
    devs = make_devices(2, 6 << 20)
    d0 = Driver(devs, fmt=True, journal_half=128 << 10, memory=512 << 10, queue_depth=1)
    d0.unmount()
    devs = image_all(devs)
    if cut is not None:
        devs[0].power.cut_after(cut)
    for x in devs:
        x.write_delay = 0.002  # slow devices: records pile up, so voiding and groups happen
    d = Driver(devs, journal_half=128 << 10, memory=512 << 10, queue_depth=1, dedupe=dedupe)
    p = PathOps(d)
    log = []
    versions = workload(p, log)
    if cut is None:
        shared = d.store.dedupe.statistics().chunks_shared if dedupe else 0
        d.unmount()
        return devs[0].power.writes, shared, versions
    d.kill()
    keep = (lambda off: off < JOURNAL_END) if keep_journal_only else None
    rng = random.Random(cut)
    crashed = crash_all(devs, rng, keep)
    d2 = Driver(crashed, journal_half=128 << 10, memory=512 << 10, dedupe=dedupe)
    tree = PathOps(d2).tree()
    d2.kill()
    return None, tree, versions


def check(tree, versions):
    allowed = {None, *versions}  # never empty: a file appears at its first close
    for path, data in tree.items():
        assert data in allowed, f"{path} holds bytes that were never a committed version"


@pytest.mark.parametrize("keep_journal_only,dedupe", [(True, False), (False, False), (True, True)])
def test_power_cut_after_every_write(keep_journal_only, dedupe):
    """With --dedupe on, later saves share the first two chunks of the first: a cut anywhere keeps
    every file one of its versions while extents are shared, voided, deleted and overwritten."""
    total, shared, versions = run(None, keep_journal_only, dedupe)
    assert total > 10 and (shared > 0) == dedupe
    step = max(1, total // 60)
    for cut in range(0, total, step):
        _, tree, versions = run(cut, keep_journal_only, dedupe)
        check(tree, versions)
        ck = tree.get("/ckpt")
        if "/other" in tree:
            assert tree["/other"] in (versions[3], versions[4])
        if ck is not None:
            assert ck in (versions[0], versions[1], versions[2], versions[5], versions[6]), \
                "checkpoint torn or empty"
        assert "/ckpt.tmp" not in tree or tree["/ckpt.tmp"] in versions
