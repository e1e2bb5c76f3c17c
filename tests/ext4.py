"""A reference directory on ext4, for tests that compare ckptfs with it.

/tmp may be a tmpfs (whose errnos, st_blocks and times differ from ext4's), so
this picks the first of /tmp and /var/tmp that is ext4 (statfs type 0xEF53),
and skips the test where neither is.
"""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

EXT4_MAGIC = "ef53"


def is_ext4(path: str | Path) -> bool:
    res = subprocess.run(["stat", "-f", "-c", "%t", str(path)], capture_output=True, text=True)
    return res.returncode == 0 and res.stdout.strip() == EXT4_MAGIC


def ext4_base() -> Path:
    """/tmp or /var/tmp, whichever is ext4 (skips the test when neither is)."""
    for base in ("/tmp", "/var/tmp"):
        if is_ext4(base):
            return Path(base)
    pytest.skip("neither /tmp nor /var/tmp is ext4")


def ext4_tmpdir(prefix: str = "ckptfs-ext4-") -> Path:
    """A fresh directory on ext4 (mode 0755, so other users can reach what is inside); the caller
    removes it."""
    p = Path(tempfile.mkdtemp(prefix=prefix, dir=ext4_base()))
    p.chmod(0o755)
    return p
