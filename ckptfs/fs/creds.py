"""Who is asking: the credentials behind a request, for the set-user-ID rules.

A FUSE request carries the caller's fsuid, fsgid and thread id, but not what
Linux's rules for set-user-ID and set-group-ID bits also need: whether the
caller holds CAP_FSETID (then a write keeps the bits) and its supplementary
groups (a member of the file's group keeps a set-group-ID bit without
group-execute). `caller()` reads both from /proc/PID/status at open time,
while the caller is blocked in open(2) and so still there.

Capabilities count only in the daemon's own user namespace: a process that is
root in a namespace of its own is not privileged over this mount. Where
/proc tells nothing (the process is gone, or lives in another pid namespace
and FUSE reports pid 0), uid 0 counts as privileged and only the request's
gid as a group.

Any front end passes a `Caller` to the core (`core.Filesystem.open`,
`create`, `setattr`); the core applies the rules (`core.setid_bits_to_drop`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

CAP_FSETID = 4


@dataclass(frozen=True)
class Caller:
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()
    fsetid: bool = False  # holds CAP_FSETID in the daemon's user namespace

    def in_group(self, gid: int) -> bool:
        return gid == self.gid or gid in self.groups


def _same_user_ns(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/user") == os.readlink("/proc/self/ns/user")
    except OSError:
        return False


def caller(uid: int, gid: int, pid: int) -> Caller:
    """The credentials of request sender `pid` (fsuid `uid`, fsgid `gid`)."""
    fallback = Caller(uid, gid, frozenset(), uid == 0)
    if pid <= 0:
        return fallback
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        groups = frozenset(int(g) for g in fields.get("Groups", "").split())
        caps = int(fields["CapEff"].strip(), 16)
    except (OSError, KeyError, ValueError):
        return fallback
    fsetid = bool(caps >> CAP_FSETID & 1) and _same_user_ns(pid)
    return Caller(uid, gid, groups, fsetid)
