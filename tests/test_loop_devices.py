"""ckptfs over real block devices: two loop devices (O_DIRECT backing), format, mount,
write and read back ~100 MB, remount, verify. Loop devices are always detached."""
import hashlib
import os
import random
import subprocess

import pytest

from mounting import CkptMount, ckptfs

pytestmark = pytest.mark.mount
MiB = 1 << 20


def losetup(path) -> str:
    res = subprocess.run(["losetup", "-f", "--show", "--direct-io=on", str(path)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"losetup failed: {res.stderr.strip()}")
    return res.stdout.strip()


def detach(dev: str) -> None:
    subprocess.run(["losetup", "-d", dev], capture_output=True)


def write_pattern(path, size: int, seed: int) -> str:
    h = hashlib.sha256()
    block = random.Random(seed).randbytes(MiB)
    with open(path, "wb") as f:
        left = size
        i = 0
        while left:
            r = (i * 4099) % MiB  # every MiB differs, so a misplaced chunk cannot go unnoticed
            piece = (block[r:] + block[:r])[:min(left, MiB)]
            f.write(piece)
            h.update(piece)
            left -= len(piece)
            i += 1
    return h.hexdigest()


def digest(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


def test_loop_devices_round_trip(tmp_path):
    m = CkptMount(tmp_path, ndev=2, dev_size=192 * MiB, memory="128M")
    loops: list[str] = []
    try:
        for backing in list(m.devices):
            loops.append(losetup(backing))
        m.devices = loops
    except BaseException:
        for dev in loops:
            detach(dev)
        raise
    try:
        m.mount()  # formats the loop devices on first mount
        size = 100 * MiB + 12345
        want = write_pattern(m.path / "ckpt.bin", size, seed=7)
        os.makedirs(m.path / "d")
        (m.path / "d" / "small").write_bytes(b"x" * 5000)
        assert digest(m.path / "ckpt.bin") == want
        assert m.umount().returncode == 0
        res = ckptfs("fsck", "--devices", m.device_arg, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        m.mount()
        assert os.stat(m.path / "ckpt.bin").st_size == size
        assert digest(m.path / "ckpt.bin") == want
        assert (m.path / "d" / "small").read_bytes() == b"x" * 5000
        assert m.umount().returncode == 0
    finally:
        try:
            m.close()
        finally:
            for dev in loops:
                detach(dev)
