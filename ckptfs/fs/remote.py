"""The gate in front of a file whose contents still live elsewhere (a restore from an object store). Pure.

A restored file exists in the namespace at once, with its final size, but its
chunks arrive later. `Remote` is attached to the file's `FileData` while any
chunk is still missing, and the read path of the core asks it first: a read
that touches a missing chunk raises `NeedsRestore` (a `NeedsFetch`, so any
caller that falls back to the async facade on "must wait" does so) instead of
returning the zeros of a hole. The facade then awaits the restorer, which
fetches those chunks with priority, writes them into the file (`fill`, which
passes the gate) and retries.

Chunk `i` of the gate covers file bytes ``[i * chunk_size, (i + 1) * chunk_size)``,
the same chunks as the file's own (a restore formats the pool with the
source's chunk size). Writes and size changes wait until the whole file is
local (they raise `NeedsRestore` for every missing chunk), so POSIX semantics
hold; a truncate to zero instead cancels the restore of the file (`cancel`),
since nothing of the old contents survives it.

`read_ahead(idx)` and `cancelled()` are hooks for the restorer (no-ops here).
"""
from __future__ import annotations

from .filemap import NeedsFetch


class NeedsRestore(NeedsFetch):
    """Chunks `indexes` of a file being restored are not local yet: fetch them, then retry."""

    def __init__(self, remote: "Remote", indexes: list[int]):
        super().__init__([])
        self.args = (f"{len(indexes)} chunk(s) of inode {remote.ino} not restored yet",)
        self.remote = remote
        self.indexes = indexes


class Remote:
    """Which chunks of one file are still missing. INVARIANT: every index in `missing` is
    below `nchunks`."""

    def __init__(self, ino: int, size: int, chunk_size: int, missing):
        self.ino = ino
        self.size = size
        self.chunk_size = chunk_size
        self.missing: set[int] = set(missing)

    @property
    def nchunks(self) -> int:
        return -(-self.size // self.chunk_size)

    def chunk_length(self, idx: int) -> int:
        """Bytes of chunk `idx` (the last one may be short)."""
        return max(0, min(self.chunk_size, self.size - idx * self.chunk_size))

    def needed(self, off: int, size: int) -> list[int]:
        """Missing chunks that a read of `size` bytes at `off` touches, in order."""
        end = min(off + size, self.size)
        if end <= off or not self.missing:
            return []
        cs = self.chunk_size
        return [i for i in range(off // cs, (end - 1) // cs + 1) if i in self.missing]

    def all_missing(self) -> list[int]:
        return sorted(self.missing)

    def check_read(self, off: int, size: int) -> None:
        need = self.needed(off, size)
        if need:
            raise NeedsRestore(self, need)

    def check_change(self) -> None:
        """A write or size change must wait for the whole file."""
        if self.missing:
            raise NeedsRestore(self, self.all_missing())

    def arrived(self, idx: int) -> None:
        self.missing.discard(idx)

    # ---- hooks for the restorer ------------------------------------------
    def read_ahead(self, idx: int) -> None:
        """A read was served up to chunk `idx`."""

    def cancelled(self) -> None:
        """The file was truncated to zero: its old contents are no longer wanted."""
