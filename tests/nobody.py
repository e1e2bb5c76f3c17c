"""Run Python as the unprivileged user `nobody` (tests of who may use the control channel,
of what an unprivileged writer may do).

`as_user(fn, *args)` runs fn in a forked child that has become uid/gid 65534
(no capabilities, no supplementary groups) and hands back its result, or
raises the OSError it raised. The other helpers run a fresh interpreter as
nobody. The test interpreter may live where nobody cannot reach it (a pyenv build
under /root), so this looks for one nobody can run: the system python3 of
the same minor version first. `cli_env()` points its imports at this
checkout and the venv's pure-Python packages, when nobody can read them.
"""
from __future__ import annotations

import functools
import os
import pickle
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


def as_user(fn, *args, uid: int = NOBODY, gid: int = NOBODY, groups: tuple[int, ...] = ()):
    """fn(*args) in a forked child running as `uid`/`gid` with `groups` (and so, unless uid is 0,
    without capabilities); returns what fn returned, or raises an OSError with its errno."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            os.close(r)
            try:
                os.setgroups(list(groups))
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
                out = ("ok", fn(*args))
            except OSError as e:
                out = ("err", e.errno)
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                out = ("exc", repr(e))
            data = pickle.dumps(out)
            while data:
                data = data[os.write(w, data):]
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    with os.fdopen(r, "rb") as f:
        chunks.append(f.read())
    os.waitpid(pid, 0)
    kind, value = pickle.loads(b"".join(chunks))
    if kind == "err":
        raise OSError(value, os.strerror(value))
    if kind == "exc":
        raise AssertionError(f"as uid {uid}: {value}")
    return value


def as_nobody(fn, *args):
    return as_user(fn, *args)

