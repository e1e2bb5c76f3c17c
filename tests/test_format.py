"""`ckptfs format`, `fsck` and the device checks of `mount`, through the CLI over real files.

Format must refuse anything that looks like someone's data (a filesystem, a
partition table, swap, another pool, any non-zero byte in the first MiB)
unless --force, and a device too small; mount must refuse unformatted devices
and device sets that are not exactly one pool in order, before mounting;
fsck and reads must catch a corrupted data extent (checksum mismatch, EIO).
"""
import errno
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from ckptfs.format.layout import SB_SIZE, Superblock
from faulty import flip_byte
from mounting import CkptMount, ckptfs, is_mounted, make_devices

MiB = 1 << 20
SIZE = 128 * MiB  # sparse: costs nothing on disk


def make_files(root: Path, n: int, size: int = SIZE, prefix: str = "dev") -> list[Path]:
    return make_devices(root, n, size, prefix)


def arg(paths) -> str:
    return ",".join(str(p) for p in paths)


def superblock(path: Path) -> Superblock:
    with open(path, "rb") as f:
        return Superblock.decode(f.read(SB_SIZE), str(path))


def head(path: Path, n: int = MiB) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def poke(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


# ---- format -------------------------------------------------------------------------


def test_format_fresh_files(tmp_path):
    devs = make_files(tmp_path, 3)
    res = ckptfs("format", "--devices", arg(devs))
    assert res.returncode == 0, res.stderr
    for d in devs:
        assert str(d) in res.stdout
    assert "formatted ckptfs pool" in res.stdout and "3 device(s)" in res.stdout
    sbs = [superblock(d) for d in devs]
    assert [sb.index for sb in sbs] == [0, 1, 2]
    assert {sb.count for sb in sbs} == {3} and len({sb.pool_id for sb in sbs}) == 1
    assert sbs[0].pool_id.hex() in res.stdout
    for sb in sbs:
        assert sb.data_off % sb.chunk_size == 0 and sb.data_units >= 1
        assert sb.unit_offset(sb.data_units) <= SIZE
    res = ckptfs("fsck", "--devices", arg(devs))
    assert res.returncode == 0 and "clean" in res.stdout, res.stdout + res.stderr


def test_format_options(tmp_path):
    devs = make_files(tmp_path, 1, 16 * MiB)
    res = ckptfs("format", "--devices", arg(devs), "--chunk-size", "64K", "--journal-size", "2M")
    assert res.returncode == 0, res.stderr
    sb = superblock(devs[0])
    assert (sb.chunk_size, sb.journal_half) == (64 << 10, 1 << 20)
    assert ckptfs("fsck", "--devices", arg(devs)).returncode == 0
    res = ckptfs("format", "--devices", arg(devs), "--chunk-size", "3000", "--force")
    assert res.returncode != 0 and "chunk-size" in res.stderr


def _ext4(p: Path) -> None:
    subprocess.run(["mkfs.ext4", "-F", "-q", str(p)], check=True, capture_output=True)


def _swap(p: Path) -> None:
    subprocess.run(["mkswap", str(p)], check=True, capture_output=True)


def _gpt(p: Path) -> None:
    if shutil.which("sgdisk"):
        subprocess.run(["sgdisk", "-o", "-n", "1:0:0", str(p)], check=True, capture_output=True)
    else:  # a protective MBR and a GPT header, by hand
        poke(p, 446 + 4, b"\xee")
        poke(p, 510, b"\x55\xaa")
        poke(p, 512, b"EFI PART" + b"\x00\x00\x01\x00" + b"\x5c\x00\x00\x00")


def _mbr(p: Path) -> None:
    poke(p, 446, bytes([0x80, 0, 2, 0, 0x83, 0, 0, 0]) + (2048).to_bytes(4, "little") + (4096).to_bytes(4, "little"))
    poke(p, 510, b"\x55\xaa")


def _xfs(p: Path) -> None:
    if shutil.which("mkfs.xfs"):
        with open(p, "r+b") as f:
            f.truncate(512 * MiB)  # mkfs.xfs wants at least 300 MiB
        subprocess.run(["mkfs.xfs", "-f", "-q", str(p)], check=True, capture_output=True)
    else:
        poke(p, 0, b"XFSB" + (4096).to_bytes(4, "big"))


def _btrfs(p: Path) -> None:
    if shutil.which("mkfs.btrfs"):
        subprocess.run(["mkfs.btrfs", "-f", "-q", str(p)], check=True, capture_output=True)
    else:
        poke(p, 65536 + 64, b"_BHRfS_M")


def _ckptfs(p: Path) -> None:
    res = ckptfs("format", "--devices", str(p))
    assert res.returncode == 0, res.stderr


def _random(p: Path) -> None:
    poke(p, 700_000, random.Random(1).randbytes(100))  # no known signature, just data


def _one_byte(p: Path) -> None:
    poke(p, MiB - 1, b"\x01")


FOREIGN = {
    "ext4": (_ext4, "ext2/3/4", "mkfs.ext4"),
    "swap": (_swap, "swap", "mkswap"),
    "gpt": (_gpt, "GPT", None),
    "mbr": (_mbr, "MBR", None),
    "xfs": (_xfs, "XFS", None),
    "btrfs": (_btrfs, "btrfs", None),
    "ckptfs": (_ckptfs, "ckptfs pool", None),
    "random": (_random, "non-zero data", None),
    "last-byte": (_one_byte, "non-zero data", None),
}


@pytest.mark.parametrize("kind", list(FOREIGN))
def test_format_refuses_foreign_content_unless_forced(tmp_path, kind):
    make, what, tool = FOREIGN[kind]
    if tool and not shutil.which(tool):
        pytest.skip(f"{tool} is not installed")
    good, victim = make_files(tmp_path, 2)
    make(victim)
    before_victim, before_good = head(victim), head(good)
    res = ckptfs("format", "--devices", arg([good, victim]))
    assert res.returncode == 1, res.stdout
    msg = res.stderr.strip()
    assert len(msg.splitlines()) == 1, msg
    assert str(victim) in msg and what in msg and "--force" in msg, msg
    assert str(good) not in msg
    # nothing was written to either device
    assert head(victim) == before_victim and head(good) == before_good
    res = ckptfs("format", "--devices", arg([good, victim]), "--force")
    assert res.returncode == 0, res.stderr
    assert superblock(victim).index == 1
    assert ckptfs("fsck", "--devices", arg([good, victim])).returncode == 0


def test_signature_beyond_the_first_mib_is_not_looked_at(tmp_path):
    (dev,) = make_files(tmp_path, 1)
    poke(dev, MiB, b"\xff" * 16)
    assert ckptfs("format", "--devices", str(dev)).returncode == 0


def test_format_refuses_a_device_too_small(tmp_path):
    good = make_files(tmp_path, 1)[0]
    small = make_files(tmp_path, 1, 10 * MiB, prefix="small")[0]
    res = ckptfs("format", "--devices", arg([good, small]))
    assert res.returncode == 1
    assert str(small) in res.stderr and "too small" in res.stderr, res.stderr
    assert not any(head(good)), "a refused format wrote to another device"
    res = ckptfs("format", "--devices", arg([small]), "--force")
    assert res.returncode == 1 and "too small" in res.stderr  # --force does not help


def test_format_refuses_bad_device_arguments(tmp_path):
    (dev,) = make_files(tmp_path, 1)
    for devices, words in ((f"{dev},{dev}", "listed twice"),
                           (str(tmp_path / "nope.img"), "does not exist"),
                           (str(tmp_path), "directory"),
                           ("", "comma-separated")):
        res = ckptfs("format", "--devices", devices)
        assert res.returncode != 0 and words in res.stderr, (devices, res.stderr)


# ---- mount refuses a bad device set (checked before mounting) ------------------------


def _mount(tmp_path: Path, devs, *more) -> subprocess.CompletedProcess:
    mp = tmp_path / "mnt"
    mp.mkdir(parents=True, exist_ok=True)
    res = ckptfs("mount", str(mp), "--devices", arg(devs), "--memory", "64M",
                 "--log-file", str(tmp_path / "daemon.log"), *more)
    if res.returncode == 0:  # should not happen: clean up before failing
        ckptfs("umount", str(mp))
    assert not is_mounted(mp)
    return res


@pytest.mark.mount
def test_mount_refuses_unformatted_devices(tmp_path):
    devs = make_files(tmp_path, 2)
    res = _mount(tmp_path, devs)
    assert res.returncode == 1
    assert "ckptfs format" in res.stderr and str(devs[0]) in res.stderr, res.stderr
    assert not any(head(devs[0])) and not any(head(devs[1])), "a refused mount wrote to the devices"


@pytest.mark.mount
def test_mount_refuses_a_missing_device(tmp_path):
    devs = make_files(tmp_path, 3)
    assert ckptfs("format", "--devices", arg(devs)).returncode == 0
    res = _mount(tmp_path, devs[:2])
    assert res.returncode == 1
    assert "pool of 3 devices" in res.stderr and "2 were given" in res.stderr, res.stderr
    assert str(devs[0]) in res.stderr


@pytest.mark.mount
def test_mount_refuses_a_device_of_another_pool(tmp_path):
    a = make_files(tmp_path / "a", 2)
    b = make_files(tmp_path / "b", 2)
    assert ckptfs("format", "--devices", arg(a)).returncode == 0
    assert ckptfs("format", "--devices", arg(b)).returncode == 0
    res = _mount(tmp_path, [a[0], b[1]])
    assert res.returncode == 1
    assert str(b[1]) in res.stderr and "another pool" in res.stderr, res.stderr


@pytest.mark.mount
def test_mount_refuses_devices_in_the_wrong_order(tmp_path):
    devs = make_files(tmp_path, 2)
    assert ckptfs("format", "--devices", arg(devs)).returncode == 0
    res = _mount(tmp_path, devs[::-1])
    assert res.returncode == 1
    assert str(devs[1]) in res.stderr and "order" in res.stderr, res.stderr


@pytest.mark.mount
def test_mount_refuses_a_device_with_a_corrupt_superblock(tmp_path):
    devs = make_files(tmp_path, 2)
    assert ckptfs("format", "--devices", arg(devs)).returncode == 0
    flip_byte(devs[1], 40)
    res = _mount(tmp_path, devs)
    assert res.returncode == 1
    assert str(devs[1]) in res.stderr and "checksum" in res.stderr, res.stderr


# ---- fsck and reads catch a corrupted data extent ------------------------------------


def _extents(devs):
    """(ino, chunk index, Extent) of every durable chunk, read from the devices."""
    from ckptfs.store.pool import open_pool, recover
    pool = open_pool([str(d) for d in devs])
    try:
        return recover(pool).durable.extents()
    finally:
        pool.close()


@pytest.mark.mount
def test_fsck_and_read_catch_a_corrupted_extent(tmp_path):
    m = CkptMount(tmp_path, ndev=2, dev_size=256 * MiB, memory="128M")
    good = os.urandom(2 * MiB + 5)
    bad = os.urandom(3 * MiB + 7)
    try:
        m.mount()
        (m.path / "good.bin").write_bytes(good)
        (m.path / "bad.bin").write_bytes(bad)
        bad_ino = os.stat(m.path / "bad.bin").st_ino
        assert m.umount().returncode == 0
        res = ckptfs("fsck", "--devices", m.device_arg)
        assert res.returncode == 0, res.stdout + res.stderr

        exts = [e for e in _extents(m.devices) if e[0] == bad_ino]
        assert len(exts) == 4
        _, idx, ext = exts[1]
        dev = m.devices[ext.dev]
        sb = superblock(dev)
        where = sb.unit_offset(ext.unit) + 1000
        assert where >= sb.data_off
        flip_byte(dev, where)

        res = ckptfs("fsck", "--devices", m.device_arg)
        assert res.returncode == 1, res.stdout
        assert "checksum mismatch" in res.stdout and f"inode {bad_ino} chunk {idx}" in res.stdout
        assert "1 problem" in res.stdout

        m.mount()
        assert (m.path / "good.bin").read_bytes() == good
        with pytest.raises(OSError) as e:
            (m.path / "bad.bin").read_bytes()
        assert e.value.errno == errno.EIO
        assert m.umount().returncode == 0
    finally:
        m.close()


@pytest.mark.mount
def test_mount_format_refuses_foreign_content_unless_forced(tmp_path):
    devs = make_files(tmp_path, 2)
    _ext4(devs[1])
    res = _mount(tmp_path, devs, "--format")
    assert res.returncode == 1
    assert str(devs[1]) in res.stderr and "ext2/3/4" in res.stderr and "--force" in res.stderr, res.stderr
    assert not any(head(devs[0])), "a refused format wrote to another device"
    mp = tmp_path / "mnt"
    res = ckptfs("mount", str(mp), "--devices", arg(devs), "--memory", "64M", "--format", "--force",
                 "--log-file", str(tmp_path / "daemon.log"))
    try:
        assert res.returncode == 0, res.stderr
        (mp / "f").write_bytes(b"hello")
    finally:
        ckptfs("umount", str(mp))
    assert not is_mounted(mp)
    # a second `mount --format` would destroy the pool: refused too, unless forced
    res = _mount(tmp_path, devs, "--format")
    assert res.returncode == 1 and "ckptfs pool" in res.stderr and "--force" in res.stderr
    res = _mount(tmp_path, make_files(tmp_path / "small", 1, 10 * MiB), "--format", "--force")
    assert res.returncode == 1 and "too small" in res.stderr


@pytest.mark.mount
def test_a_mounted_pool_cannot_be_mounted_again_formatted_or_checked(tmp_path):
    m = CkptMount(tmp_path, ndev=2, dev_size=SIZE, memory="64M")
    try:
        m.mount()
        (m.path / "f").write_bytes(b"precious")
        res = _mount(tmp_path / "second", m.devices)
        assert res.returncode == 1 and "in use" in res.stderr and str(m.devices[0]) in res.stderr, res.stderr
        res = ckptfs("format", "--devices", m.device_arg, "--force")
        assert res.returncode == 1 and "in use" in res.stderr, res.stderr
        res = ckptfs("fsck", "--devices", m.device_arg)
        assert res.returncode == 1 and "in use" in res.stderr, res.stderr
        assert (m.path / "f").read_bytes() == b"precious"
        assert m.umount().returncode == 0
        assert ckptfs("fsck", "--devices", m.device_arg).returncode == 0  # free again once unmounted
        m.mount()
        assert (m.path / "f").read_bytes() == b"precious"
    finally:
        m.close()
