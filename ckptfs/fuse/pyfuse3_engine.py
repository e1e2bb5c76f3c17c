"""The pyfuse3 front end's lifecycle: libfuse through pyfuse3, every request on the trio thread.

The fallback engine (the native engine of native.py is the default) and the
reference the test suites run against too. pyfuse3 is an optional extra
(`pip install 'ckptfs[pyfuse3]'`: it compiles against libfuse3's headers), so
nothing imports it until this engine is chosen: `available()` says whether
it can be, `Pyfuse3Engine(...)` imports it.

    engine = Pyfuse3Engine(afs, "/ckpt")
    engine.start()          # pyfuse3.init: mounted (on the trio thread)
    await engine.serve()    # pyfuse3.main: until unmounted
    engine.close(unmount=False)
"""
from __future__ import annotations

import importlib.util
import os

from ..fs.facade import AsyncFilesystem

THREADS = 1  # pyfuse3 serves every request on the trio thread


def available() -> bool:
    """Whether pyfuse3 is installed (it may still fail to load: start() then raises)."""
    return importlib.util.find_spec("pyfuse3") is not None


def mount_options() -> set[str]:
    import pyfuse3
    opts = set(pyfuse3.default_options)
    opts |= {"fsname=ckptfs", "subtype=ckptfs"}
    if os.getuid() == 0:
        opts.add("allow_other")
    return opts


def operations(afs: AsyncFilesystem):
    """pyfuse3's Operations over the facade (the in-process test driver calls them directly)."""
    from .pyfuse3_ops import Operations
    return Operations(afs)


class Pyfuse3Engine:
    """Mount `afs` at `mountpoint` through pyfuse3 (libfuse), every request served on the trio
    thread; it holds pyfuse3's `ops` over the facade and nothing else."""

    def __init__(self, afs: AsyncFilesystem, mountpoint: str):
        import pyfuse3
        self._pyfuse3 = pyfuse3
        self.ops = operations(afs)
        self.mountpoint = mountpoint

    def start(self) -> None:
        """Mount (pyfuse3.init; call it on the trio thread)."""
        self._pyfuse3.init(self.ops, self.mountpoint, mount_options())

    async def serve(self) -> None:
        """Serve until unmounted (or terminate())."""
        await self._pyfuse3.main()

    def terminate(self) -> None:
        """End serve() (after a signal, when fusermount3 -u -z failed)."""
        self._pyfuse3.terminate()

    def close(self, unmount: bool) -> None:
        self._pyfuse3.close(unmount=unmount)
