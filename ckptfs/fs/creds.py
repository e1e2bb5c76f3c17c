"""Who is asking: the credentials behind a request, for the set-user-ID rules.

A FUSE request carries the caller's fsuid, fsgid and thread id, but not what
Linux's rules for set-user-ID and set-group-ID bits also need: whether the
caller holds CAP_FSETID (then a write keeps the bits) and its supplementary
groups (a member of the file's group keeps a set-group-ID bit without
group-execute). `caller()` reads both from /proc/PID/status when a rule
first needs them: only for a file with a set-user-ID or set-group-ID bit, in
the open(2) (O_TRUNC) or the write(2) that may clear it, while the caller is
blocked in that call and so still there. Most files have no such bit: their
open costs no /proc read (it was a tenth of a small file's create).

Capabilities count only in the daemon's own user namespace: a process that is
root in a namespace of its own is not privileged over this mount. Where
/proc tells nothing (the process is gone, or lives in another pid namespace
and FUSE reports pid 0), uid 0 counts as privileged and only the request's
gid as a group.

Any front end passes a `Caller` to the core (`core.Filesystem.open`,
`create`, `setattr`); the core applies the rules (`core.setid_bits_to_drop`).

`being_killed(pid)` tells a front end whether a request's sender is being
killed (a fatal signal sets SIGKILL pending in each of its threads), so that
a request waiting for memory can let it die (fuse/native.py).
"""
from __future__ import annotations

import os
import signal

CAP_FSETID = 4
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


class Caller:
    """fsuid, fsgid, supplementary `groups` and `fsetid` (holds CAP_FSETID in the daemon's user
    namespace). Made by `caller(uid, gid, pid)`, the last two are read from /proc on first use."""
    __slots__ = ("uid", "gid", "_groups", "_fsetid", "_pid")

    def __init__(self, uid: int, gid: int, groups: frozenset[int] = frozenset(), fsetid: bool = False,
                 *, pid: int = 0):
        self.uid, self.gid = uid, gid
        self._groups, self._fsetid = frozenset(groups), fsetid
        self._pid = pid  # > 0: groups and fsetid still to be read from /proc/PID/status

    def _resolve(self) -> None:
        pid, self._pid = self._pid, 0
        self._groups, self._fsetid = _from_proc(pid, self.uid)

    @property
    def groups(self) -> frozenset[int]:
        if self._pid:
            self._resolve()
        return self._groups

    @property
    def fsetid(self) -> bool:
        if self._pid:
            self._resolve()
        return self._fsetid

    def in_group(self, gid: int) -> bool:
        return gid == self.gid or gid in self.groups

    def with_fsetid(self, fsetid: bool) -> Caller:
        return Caller(self.uid, self.gid, self.groups, fsetid)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Caller):
            return NotImplemented
        return (self.uid, self.gid, self.groups, self.fsetid) == (other.uid, other.gid, other.groups, other.fsetid)

    def __hash__(self) -> int:
        return hash((self.uid, self.gid, self.groups, self.fsetid))

    def __repr__(self) -> str:
        return f"Caller(uid={self.uid}, gid={self.gid}, groups={set(self.groups) or '{}'}, fsetid={self.fsetid})"


def _same_user_ns(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/user") == os.readlink("/proc/self/ns/user")
    except OSError:
        return False


def caller(uid: int, gid: int, pid: int) -> Caller:
    """The credentials of request sender `pid` (fsuid `uid`, fsgid `gid`), read when first needed."""
    if pid <= 0:
        return Caller(uid, gid, frozenset(), uid == 0)
    return Caller(uid, gid, pid=pid)


def _from_proc(pid: int, uid: int) -> tuple[frozenset[int], bool]:
    """(supplementary groups, fsetid) of `pid`; (none, uid 0) when /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        groups = frozenset(int(g) for g in fields.get("Groups", "").split())
        caps = int(fields["CapEff"].strip(), 16)
    except (OSError, KeyError, ValueError):
        return frozenset(), uid == 0
    return groups, bool(caps >> CAP_FSETID & 1) and _same_user_ns(pid)


def being_killed(pid: int) -> bool | None:
    """Whether request sender `pid` (a thread id) is being killed: SIGKILL pending (every fatal
    signal puts it there for each thread), exiting, or gone. None where /proc cannot tell (pid 0:
    a process in another pid namespace)."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        if fields["State"].split()[0] in ("Z", "X"):
            return True
        return bool((int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)) & _SIGKILL_BIT)
    except FileNotFoundError:
        return True
    except (OSError, KeyError, ValueError, IndexError):
        return None
