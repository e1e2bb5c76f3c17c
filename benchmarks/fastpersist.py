"""DeepSpeed's FastPersist writer (deepspeed.io.FastFileWriter), the tool ckptfs is measured against.

FastPersist is torch.save into a file-like writer that copies the stream into
a pinned (page-locked) double buffer and writes it with libaio, O_DIRECT,
1 MiB blocks, queue depth 8 (DeepSpeed's checkpoint defaults); close()
writes the unaligned tail with a buffered write and fsyncs. So a save is
durable when it returns: blocked time = time to durable.

On a CPU-only torch two things need help, both done here:
  * deepspeed.io.fast_file_writer imports UtilsBuilder through the
    accelerator's op table, which on CPU has no such op; the writer is
    pointed at deepspeed.ops.op_builder.utils.UtilsBuilder instead;
  * the pinned buffer comes from the aio handle's new_cpu_locked_tensor.
Both ops (async_io, utils) are C++ extensions that DeepSpeed compiles on
first use (~10 minutes for async_io on 2 cores; cached under
~/.cache/torch_extensions). `python benchmarks/fastpersist.py --build`
(run by `make bench-setup`) compiles them ahead, so the benchmark never
pays for it: open() refuses with a reason when they are not built yet.

usage: python benchmarks/fastpersist.py --build    # compile the ops once
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

OPS = ("async_io", "utils")
BLOCK_SIZE = 1 << 20      # DeepSpeed's AIO_BLOCK_SIZE_DEFAULT
QUEUE_DEPTH = 8           # AIO_QUEUE_DEPTH_DEFAULT
BUFFER_BYTES = 64 << 20   # CHECKPOINT_IO_BUFFER_SIZE_DEFAULT (double-buffered)


def _built(name: str) -> bool:
    from torch.utils.cpp_extension import _get_build_directory
    return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists()


class FastPersist:
    """One aio handle and one pinned buffer, reused by every save (as DeepSpeed's engine does)."""

    def __init__(self) -> None:
        import torch
        import deepspeed.io.fast_file_writer as ffw
        from deepspeed.ops.op_builder import AsyncIOBuilder
        from deepspeed.ops.op_builder.utils import UtilsBuilder

        ffw.UtilsBuilder = UtilsBuilder
        self._ffw = ffw
        self._handle = AsyncIOBuilder().load(verbose=False).aio_handle(BLOCK_SIZE, QUEUE_DEPTH, False, True, 1)
        self._buffer = self._handle.new_cpu_locked_tensor(BUFFER_BYTES, torch.empty(0, dtype=torch.uint8))

    def save(self, obj, path: Path) -> None:
        """torch.save(obj) to `path` through FastFileWriter; durable on return (close fsyncs)."""
        import torch
        path.unlink(missing_ok=True)  # the writer opens without O_TRUNC
        writer = self._ffw.FastFileWriter(str(path), self._ffw.FastFileWriterConfig(
            dnvme_handle=self._handle, pinned_tensor=self._buffer, double_buffer=True))
        torch.save(obj, writer)
        writer.close()

    def close(self) -> None:
        self._handle.free_cpu_locked_tensor(self._buffer)


def open_writer() -> tuple[FastPersist | None, str]:
    """(writer, "") or (None, why it cannot run here)."""
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: skip, with the reason
        return None, f"deepspeed is not importable ({type(e).__name__}: {e}); `make bench-setup` installs it"
    try:
        missing = [op for op in OPS if not _built(op)]
    except Exception as e:  # noqa: BLE001
        return None, f"cannot locate DeepSpeed's op builds: {e}"
    if missing:
        return None, (f"DeepSpeed op(s) {', '.join(missing)} not compiled yet: run `make bench-setup` "
                      "(python benchmarks/fastpersist.py --build, ~10 min once)")
    try:
        return FastPersist(), ""
    except Exception as e:  # noqa: BLE001
        return None, f"FastFileWriter setup failed: {type(e).__name__}: {e}"


def version() -> str | None:
    try:
        import deepspeed
        return deepspeed.__version__
    except Exception:  # noqa: BLE001
        return None


def build() -> int:
    """Compile (or load) DeepSpeed's async_io and utils ops; 0 when both load."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        from deepspeed.ops.op_builder.utils import UtilsBuilder
    except Exception as e:  # noqa: BLE001
        print(f"fastpersist: deepspeed not importable, FastPersist will be skipped: {e}", file=sys.stderr)
        return 1
    if not AsyncIOBuilder().is_compatible(verbose=False):
        print("fastpersist: DeepSpeed's async_io op is not compatible here (libaio-dev missing?)", file=sys.stderr)
        return 1
    for builder in (AsyncIOBuilder(), UtilsBuilder()):
        builder.load(verbose=False)
    print("fastpersist: DeepSpeed async_io and utils ops are built")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", action="store_true", help="compile DeepSpeed's ops ahead of the benchmark")
    a = ap.parse_args()
    if a.build:
        sys.exit(build())
    w, why = open_writer()
    print("FastPersist ready" if w else f"FastPersist unavailable: {why}")
