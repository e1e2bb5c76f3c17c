"""Durability on real mounts: remount, backpressure, ENOSPC, fsync modes, stale data skipped."""
import errno
import json
import os
import random
import signal
import threading
import time

import psutil
import pytest

from faulty import flip_byte
from mounting import CkptMount, exited, is_mounted
from syscalls import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, copy_range, fallocate
from waiting import poll

pytestmark = pytest.mark.mount


def random_file(path, size, seed=0, block=8 << 20):
    rng = random.Random(seed)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(block, left)
            f.write(rng.randbytes(n))
            left -= n


def same_as_seed(path, size, seed=0, block=8 << 20):
    rng = random.Random(seed)
    with open(path, "rb") as f:
        left = size
        while left:
            n = min(block, left)
            if f.read(n) != rng.randbytes(n):
                return False
            left -= n
        return f.read(1) == b""


def test_remount_restores_namespace_and_data(ckpt):
    (ckpt.path / "d" / "e").mkdir(parents=True)
    random_file(ckpt.path / "d" / "e" / "f", 20_000_000, seed=1)
    os.symlink("e/f", ckpt.path / "d" / "link")
    os.link(ckpt.path / "d" / "e" / "f", ckpt.path / "hard")
    os.setxattr(ckpt.path / "hard", "user.k", b"v")
    os.chmod(ckpt.path / "hard", 0o600)
    mtime = os.stat(ckpt.path / "hard").st_mtime_ns
    assert ckpt.umount().returncode == 0
    ckpt.mount()
    assert same_as_seed(ckpt.path / "d" / "link", 20_000_000, seed=1)
    st = os.stat(ckpt.path / "hard")
    assert st.st_nlink == 2 and st.st_mode & 0o777 == 0o600 and st.st_mtime_ns == mtime
    assert os.getxattr(ckpt.path / "hard", "user.k") == b"v"
    assert os.readlink(ckpt.path / "d" / "link") == "e/f"


def test_fallocated_size_and_punched_holes_survive_kill_9(ckpt, engine):
    """native engine (pyfuse3 serves no fallocate): a hole punched after the data was durable and
    a size grown by fallocate are committed at the close, so a SIGKILL after fsync keeps them."""
    if engine != "native":
        pytest.skip("pyfuse3 serves no FALLOCATE")
    p = ckpt.path / "f"
    data = os.urandom(6 << 20)
    p.write_bytes(data)
    fd = os.open(p, os.O_RDWR)
    os.fsync(fd)  # on the devices first: the punch must drop durable extents too
    fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (1 << 20) + 7, 3 << 20)
    os.posix_fallocate(fd, 0, 10 << 20)
    os.fsync(fd)
    os.close(fd)
    ckpt.kill()
    ckpt.mount()
    want = data[:(1 << 20) + 7] + bytes(3 << 20) + data[(4 << 20) + 7:] + bytes(4 << 20)
    assert p.read_bytes() == want
    assert os.stat(p).st_blocks * 512 <= (3 << 20) + (1 << 20)  # the punched chunks are gone


def test_a_copy_of_a_file_only_on_the_devices_survives_kill_9(ckpt):
    """copy_file_range from a file that after a remount is only on the devices (native: the
    daemon fetches the source and copies it; pyfuse3: the kernel's splice), fsync'd, then
    SIGKILL: the copy is whole after the next mount."""
    p, q = ckpt.path / "src", ckpt.path / "dst"
    data = os.urandom((6 << 20) + 77)
    p.write_bytes(data)
    assert ckpt.umount().returncode == 0
    ckpt.mount()
    fin, fout = os.open(p, os.O_RDONLY), os.open(q, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert copy_range(fin, fout, len(data) + 1, 0, 0) == len(data)
        os.fsync(fout)
    finally:
        os.close(fin)
        os.close(fout)
    ckpt.kill()
    ckpt.mount()
    assert q.read_bytes() == data


def test_file_larger_than_memory_saves_with_bounded_rss(ckpt_factory):
    m = ckpt_factory(memory="64M")
    m.mount()
    daemon = psutil.Process(m.pid)
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], daemon.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.05)

    t = threading.Thread(target=watch)
    t.start()
    try:
        random_file(m.path / "big", 512 << 20, seed=2)
        assert same_as_seed(m.path / "big", 512 << 20, seed=2)
    finally:
        stop.set()
        t.join()
    # 64 MiB arena + interpreter, trio, pyfuse3 and buffers; never the 512 MiB file
    assert peak[0] < 64 * 2**20 + 160 * 2**20, f"daemon RSS peaked at {peak[0] >> 20} MiB"
    assert m.umount().returncode == 0
    m.mount()
    assert same_as_seed(m.path / "big", 512 << 20, seed=2)


def test_enospc_when_devices_are_full_then_usable_after_delete(ckpt_factory):
    m = ckpt_factory(memory="64M", ndev=2, dev_size=100 << 20)  # ~2 x 34 data units
    m.mount()
    st = os.statvfs(m.path)
    capacity = st.f_blocks * st.f_frsize
    with pytest.raises(OSError) as e:
        random_file(m.path / "too-big", capacity + (16 << 20), seed=3, block=1 << 20)
    assert e.value.errno == errno.ENOSPC
    os.unlink(m.path / "too-big")
    os.sync()

    def fits() -> bool:
        try:
            random_file(m.path / "fits", 8 << 20, seed=4)
            with open(m.path / "fits", "rb+") as f:
                os.fsync(f.fileno())
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            return False
        return True

    poll(fits, "space to come back once the delete is journaled", timeout=30, every=0.5)
    assert same_as_seed(m.path / "fits", 8 << 20, seed=4)
    assert m.umount().returncode == 0
    m.mount()
    assert same_as_seed(m.path / "fits", 8 << 20, seed=4)
    assert not (m.path / "too-big").exists()


def _small_files(root, seed: int) -> dict:
    """400 files of 1 B to 20 KB, 20 of 100-600 KB, and one of 3 MiB + 5000 B (a tail)."""
    rng = random.Random(seed)
    sizes = [rng.randrange(1, 20_000) for _ in range(400)] + [rng.randrange(100_000, 600_000) for _ in range(20)]
    files = {root / f"s{i}": rng.randbytes(n) for i, n in enumerate(sizes)}
    files[root / "tail"] = rng.randbytes((3 << 20) + 5000)
    for p, data in files.items():
        p.write_bytes(data)
    return files


def test_small_files_share_device_units_and_survive_kill_9(ckpt_factory):
    """A chunk of at most half a unit takes a piece of one (4 KiB blocks, a power of two of
    them), not a whole 1 MiB unit: 421 small files fit two 100 MB devices (70 units), and
    after a SIGKILL the next mount rebuilds which pieces are taken from the journal alone:
    every file is whole, new files do not land on old ones, fsck is clean."""
    from mounting import ckptfs
    m = ckpt_factory(memory="256M", ndev=2, dev_size=100 << 20)
    m.mount()
    (m.path / "a").mkdir()
    files = _small_files(m.path / "a", seed=8)
    assert ckptfs("sync", str(m.path)).returncode == 0
    used = _status(m)["pool"]["used"]  # whole units each: 424 MiB, more than the devices hold
    assert used <= 40 << 20, f"{used >> 20} MiB of the devices for {sum(map(len, files.values())) >> 20} MiB"
    m.kill()
    m.mount()
    assert _status(m)["pool"]["used"] == used  # the same pieces, rebuilt from the journal
    (m.path / "b").mkdir()
    more = _small_files(m.path / "b", seed=9)  # allocated around what the journal holds
    for p in list(files)[::2]:
        os.unlink(p)
        del files[p]
    assert m.umount().returncode == 0
    res = ckptfs("fsck", "--devices", m.device_arg)
    assert res.returncode == 0, res.stdout + res.stderr
    m.mount()
    for p, data in {**files, **more}.items():
        assert p.read_bytes() == data, p


def test_small_files_held_open_near_full_count_as_pieces(ckpt_factory):
    """Before a write adds a chunk the store makes sure the devices could hold every chunk not
    yet drained. It counted each as a whole unit: with 8 units free, the ninth small file held
    open got ENOSPC. Now each counts as the piece it will take: 300 open 4 KB files fit what is
    left; one of them then grows until the devices are full and gets ENOSPC at a write (never
    a drain that finds no room); everything acknowledged is durable and survives a remount."""
    from mounting import ckptfs
    m = ckpt_factory(memory="256M", ndev=2, dev_size=100 << 20)
    m.mount()
    st = os.statvfs(m.path)
    random_file(m.path / "big", st.f_blocks * st.f_frsize - (8 << 20), seed=11, block=1 << 20)
    assert ckptfs("sync", str(m.path)).returncode == 0
    pool = _status(m)["pool"]
    assert pool["capacity"] - pool["used"] == 8 << 20
    data, fds = {}, []
    try:
        for i in range(300):
            data[m.path / f"s{i}"] = os.urandom(4000)
            fds.append(os.open(m.path / f"s{i}", os.O_WRONLY | os.O_CREAT, 0o644))
            assert os.write(fds[-1], data[m.path / f"s{i}"]) == 4000
        grown = bytearray(data[m.path / "s0"])
        rng = random.Random(12)
        with pytest.raises(OSError) as e:
            while True:
                block = rng.randbytes(1 << 20)
                grown += block[:os.write(fds[0], block)]
        assert e.value.errno == errno.ENOSPC
        assert 4 << 20 <= len(grown) <= 8 << 20, len(grown)
        data[m.path / "s0"] = bytes(grown)
    finally:
        for fd in fds:
            os.close(fd)
    res = ckptfs("sync", str(m.path))
    assert res.returncode == 0, res.stderr + m.log_text()
    st = _status(m)
    assert not st["files"] and st["totals"]["files_failed"] == 0
    assert m.umount().returncode == 0
    res = ckptfs("fsck", "--devices", m.device_arg)
    assert res.returncode == 0, res.stdout + res.stderr
    m.mount()
    for p, b in data.items():
        assert p.read_bytes() == b, p
    assert same_as_seed(m.path / "big", st["pool"]["capacity"] - (8 << 20), seed=11, block=1 << 20)


def test_a_version_2_pool_keeps_whole_units_per_chunk(ckpt_factory):
    """A pool formatted before version 3 names whole units in its journal: this version mounts
    it, gives each chunk a whole unit as before, reads back what it wrote, and leaves it at 2."""
    from dataclasses import replace
    from ckptfs.format.layout import SB_SIZE, Superblock
    from mounting import ckptfs
    m = ckpt_factory(memory="128M", ndev=2, dev_size=100 << 20)
    ckptfs("format", "--devices", m.device_arg, check=True)

    def versions(set_to=None):
        out = []
        for d in m.devices:
            with open(d, "r+b") as f:
                sb = Superblock.decode(f.read(SB_SIZE))
                if set_to is not None:
                    f.seek(0)
                    f.write(replace(sb, version=set_to).encode())
                out.append(sb.version)
        return out

    assert versions(set_to=2) == [3, 3]
    m.formatted = True
    m.mount()
    data = {m.path / f"f{i}": os.urandom(1000 * (i + 1)) for i in range(5)}
    for p, b in data.items():
        p.write_bytes(b)
    assert ckptfs("sync", str(m.path)).returncode == 0
    assert _status(m)["pool"]["used"] == 5 << 20  # one 1 MiB unit each
    m.kill()
    m.mount()
    assert all(p.read_bytes() == b for p, b in data.items())
    assert m.umount().returncode == 0
    assert versions() == [2, 2]


def test_fsync_absorb_mode_returns_and_umount_still_drains(ckpt_factory):
    m = ckpt_factory(memory="256M", extra=("--fsync", "absorb"))
    m.mount()
    random_file(m.path / "f", 30 << 20, seed=5)
    with open(m.path / "f", "rb+") as f:
        os.fsync(f.fileno())
    assert m.umount().returncode == 0
    m.mount()
    assert same_as_seed(m.path / "f", 30 << 20, seed=5)


def test_sync_command_and_fsck_clean_after_umount(ckpt):
    random_file(ckpt.path / "a", 5 << 20, seed=6)
    from mounting import ckptfs
    assert ckptfs("sync", str(ckpt.path)).returncode == 0
    assert ckpt.umount().returncode == 0
    res = ckptfs("fsck", "--devices", ckpt.device_arg)
    assert res.returncode == 0, res.stdout + res.stderr


def _status(m: CkptMount) -> dict:
    from mounting import ckptfs
    res = ckptfs("status", str(m.path), "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_unclean_shutdown_is_reported_at_the_next_mount(ckpt):
    (ckpt.path / "a").write_bytes(b"a" * 100_000)
    fd = os.open(ckpt.path / "a", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    ckpt.kill()  # SIGKILL: no clean unmount
    ckpt.mount()
    log = ckpt.log_text()
    assert "recovered.unclean_shutdown" in log and "journal_seq=" in log and "state_time=" in log, log
    rec = _status(ckpt)["recovery"]
    assert rec["clean"] is False and rec["seq"] > 0 and rec["time_ns"] > 0
    assert (ckpt.path / "a").read_bytes() == b"a" * 100_000
    assert ckpt.umount().returncode == 0
    ckpt.mount()
    assert _status(ckpt)["recovery"]["clean"] is True
    assert ckpt.log_text().count("recovered.unclean_shutdown") == 1


def test_mount_refuses_to_roll_back_a_damaged_newest_journal_half(ckpt):
    from ckptfs.format.layout import SB_SIZE, Superblock
    from ckptfs.store.pool import open_pool, read_anchor
    from mounting import ckptfs
    (ckpt.path / "kept").write_bytes(b"k" * 5000)
    assert ckpt.umount().returncode == 0
    pool = open_pool([str(d) for d in ckpt.devices])
    half = read_anchor(pool).half
    pool.close()
    for dev in ckpt.devices:  # bit rot in the current half's first frame, on every device
        with open(dev, "rb") as f:
            sb = Superblock.decode(f.read(SB_SIZE))
        flip_byte(dev, sb.half_offset(half) + 40)
    with pytest.raises(AssertionError, match="is damaged on every device.*--force-recover"):
        ckpt.mount()
    res = ckptfs("fsck", "--devices", ckpt.device_arg)
    assert res.returncode != 0 and "is damaged on every device" in res.stdout + res.stderr
    ckpt.mount("--force-recover")  # the operator accepts the older state
    assert "recovery.rolled_back" in ckpt.log_text()
    assert _status(ckpt)["recovery"]["warnings"]


def test_status_names_the_engine(ckpt, engine):
    st = _status(ckpt)
    assert st["engine"] == engine
    assert st["threads"] >= 1


def test_sigterm_unmounts_drains_and_closes_clean(ckpt):
    random_file(ckpt.path / "a", 12 << 20, seed=7)
    pid = ckpt.pid
    os.kill(pid, signal.SIGTERM)
    poll(lambda: exited(pid), "the daemon to exit after SIGTERM")
    ckpt.pid = None
    assert not is_mounted(ckpt.path)
    log = ckpt.log_text()
    assert "signal signal=SIGTERM" in log and "durable=true" in log, log
    ckpt.mount()
    assert _status(ckpt)["recovery"]["clean"] is True
    assert same_as_seed(ckpt.path / "a", 12 << 20, seed=7)
