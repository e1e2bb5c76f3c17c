"""A first real mount: write, read back, list, unmount."""
import os

import pytest

pytestmark = pytest.mark.mount


def test_write_read_back(ckpt):
    data = os.urandom(3 * (1 << 20) + 17)
    p = ckpt.path / "x.bin"
    p.write_bytes(data)
    assert p.read_bytes() == data
    assert os.listdir(ckpt.path) == ["x.bin"]
    assert os.stat(p).st_size == len(data)
