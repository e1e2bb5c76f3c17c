"""The durable store in-process on fault-injecting devices: recovery, crashes, errors."""
import random

import pytest

from faulty import crash_all, image_all
from inproc import Driver, PathOps, make_devices


def fresh(n=2, dev_size=8 << 20, **kw):
    devs = make_devices(n, dev_size)
    d = Driver(devs, fmt=True, **kw)
    return devs, d, PathOps(d)


def test_unmount_then_remount_keeps_everything():
    devs, d, p = fresh()
    data = random.randbytes(300_000)
    p.mkdir("/a")
    p.write_file("/a/x", data)
    p.write_file("/y", b"hello")
    d.unmount()
    d2 = Driver(image_all(devs))
    assert PathOps(d2).tree() == {"/a": None, "/a/x": data, "/y": b"hello"}
    d2.kill()


def test_fsynced_file_survives_a_power_cut():
    devs, d, p = fresh()
    data = random.randbytes(200_000)
    p.write_file("/f", data, fsync=True)
    d.kill()
    rng = random.Random(1)
    d2 = Driver(crash_all(devs, rng))
    assert PathOps(d2).read_file("/f") == data
    d2.kill()


def test_data_larger_than_memory_round_trips_through_eviction():
    devs, d, p = fresh(memory=256 << 10)  # 4 chunks of 64 KiB
    data = random.randbytes(2_000_000)
    p.write_file("/big", data)
    assert p.read_file("/big") == data
    d.unmount()
    d2 = Driver(image_all(devs), memory=256 << 10)
    assert PathOps(d2).read_file("/big") == data
    d2.kill()


def test_write_error_makes_fsync_fail_and_keeps_serving():
    devs, d, p = fresh()
    p.write_file("/ok", b"durable", fsync=True)
    for x in devs:
        x.fail_writes_at(0, x.size)
    import pyfuse3
    with pytest.raises(pyfuse3.FUSEError) as e:
        p.write_file("/bad", random.randbytes(100_000), fsync=True)
    assert e.value.errno == 5
    assert p.read_file("/ok") == b"durable"
    d.kill()


def test_stale_data_is_not_drained():
    """Saving every step to the same path must not queue stale copies (promise 7)."""
    devs, d, p = fresh(memory=8 << 20, queue_depth=2, dev_size=32 << 20)
    for x in devs:
        x.write_delay = 0.05  # devices far slower than the saves
    size = 40 * 65536 - 1000  # 40 chunks of 64 KiB
    versions = [random.randbytes(size) for _ in range(12)]
    for i, v in enumerate(versions):
        if i % 2:
            p.write_file("/ckpt", v, piece=1 << 16)  # overwrite in place (O_TRUNC)
        else:
            p.write_file("/ckpt.tmp", v, piece=1 << 16)
            p.rename("/ckpt.tmp", "/ckpt")
    d.unmount()
    store = d.store
    saved = size * len(versions)
    # what may be drained: the last version, plus what was in flight (queue depth x devices
    # chunks at a time) while each earlier version was being written
    assert store.bytes_drained < saved / 3, (store.bytes_drained, saved)
    assert store.bytes_skipped > 0 and store.records_voided > 0
    d2 = Driver(image_all(devs), memory=4 << 20)
    assert PathOps(d2).read_file("/ckpt") == versions[-1]
    d2.kill()
