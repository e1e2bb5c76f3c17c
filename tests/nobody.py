"""Run Python as the unprivileged user `nobody` (tests of who may use the control channel).

The test interpreter may live where nobody cannot reach it (a pyenv build
under /root), so this looks for one nobody can run: the system python3 of
the same minor version first. `cli_env()` points its imports at this
checkout and the venv's pure-Python packages, when nobody can read them.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

NOBODY = 65534
REPO = Path(__file__).resolve().parent.parent


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, user=NOBODY, group=NOBODY, extra_groups=[],
                          timeout=kw.pop("timeout", 120), **kw)


@functools.lru_cache(maxsize=None)
def python() -> str | None:
    """An interpreter nobody can run (stdlib included), or None."""
    if os.geteuid() != 0:
        return None
    want = f"{sys.version_info.major}.{sys.version_info.minor}"
    for exe in (f"/usr/bin/python{want}", "/usr/bin/python3", sys.executable):
        if not os.path.exists(exe):
            continue
        try:
            res = _run([exe, "-I", "-c", "import json, socket, sys; print('%d.%d' % sys.version_info[:2])"],
                       timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        if res.returncode == 0 and res.stdout.strip() == want:
            return exe
    return None


def cli_env() -> dict | None:
    """Environment under which python() imports this checkout's ckptfs, or None if nobody cannot."""
    exe = python()
    if exe is None:
        return None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), sysconfig.get_paths()["purelib"]]),
               HOME="/")
    try:
        res = _run([exe, "-c", "import ckptfs.cli, trio, rich"], env=env, timeout=60, cwd="/")
    except (OSError, subprocess.SubprocessError):
        return None
    return env if res.returncode == 0 else None


def run(args: list[str], env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return _run([python(), *args], env=env, cwd="/", **kw)
