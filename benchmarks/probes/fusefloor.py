"""The FUSE round-trip floor of this machine: ckptfs's protocol session with a handler that does nothing.

Mounts `ckptfs.fuse.kernel.Session` (the native engine's server, `--threads`
workers) at a scratch folder with a handler that answers GETATTR (attributes
never cached, so every os.stat is a round trip) and GETXATTR (ENODATA) at
once, then times `--n` of each from a separate client process (a client
thread in the server's process would share its GIL). Prints the median and
10th percentile latency and the server's CPU per request (user, system).

What it tells: the metadata targets of issue 12 (chmod, utime <= 60 us)
cannot be met below this floor, whatever the store does. On the 2-core
development VM (2026-12-01) the floor was 270-900 us median for stat, with
240-350 us of server CPU per request, 40-70% of it system time in wake-ups
(an idle vCPU woken by an IPI); `--pin` (server and client on CPU 0, no
cross-CPU wake-up) took it to 100-150 us. Run as root (mount(2)).

    .venv/bin/python benchmarks/probes/fusefloor.py [--threads 2] [--n 3000] [--pin]
"""
from __future__ import annotations

import argparse
import errno
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py and the cases
from common import ROOT, SCRATCH  # noqa: E402

CLIENT = r"""
import os, statistics, sys, time
path, n = sys.argv[1], int(sys.argv[2])
if len(sys.argv) > 3 and int(sys.argv[3]) >= 0:
    os.sched_setaffinity(0, {int(sys.argv[3])})  # the client on this CPU
os.stat(path)
for name, fn in (("stat", lambda: os.stat(path)), ("getxattr", lambda: os.getxattr(path, "user.none"))):
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            fn()
        except OSError:
            pass
        xs.append(time.perf_counter() - t0)
    xs.sort()
    print(f"  {name:9s} median {statistics.median(xs) * 1e6:6.0f} us   p10 {xs[len(xs) // 10] * 1e6:6.0f} us")
"""


class Nothing:
    """Answers at once: a file `f` in the root, attributes never cached, no extended attributes."""

    def __init__(self):
        from ckptfs.fuse.kernel.replies import Attr, AttrOut, EntryOut
        self.Attr, self.AttrOut, self.EntryOut = Attr, AttrOut, EntryOut

    def getattr(self, req):
        mode = 0o40755 if req.nodeid == 1 else 0o100644
        return self.AttrOut(self.Attr(ino=req.nodeid, mode=mode), attr_timeout=0)

    def lookup(self, req):
        return self.EntryOut(2, self.Attr(ino=2, mode=0o100644), entry_timeout=3600, attr_timeout=0)

    def getxattr(self, req):
        raise OSError(errno.ENODATA, "no such attribute")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=3000, help="calls of each kind")
    ap.add_argument("--pin", action="store_true", help="server and client on CPU 0")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("fusefloor: run as root (the session mounts with mount(2))", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    from ckptfs.fuse.kernel.session import Session, SessionConfig
    if args.pin:
        os.sched_setaffinity(0, {0})
    mp = SCRATCH / "fusefloor"
    mp.mkdir(parents=True, exist_ok=True)
    session = Session(Nothing(), str(mp), SessionConfig(threads=args.threads))
    session.mount()
    try:
        session.start()
        t0 = os.times()
        print(f"FUSE round trips, {args.threads} server thread(s){', pinned to CPU 0' if args.pin else ''}:")
        subprocess.run([sys.executable, "-c", CLIENT, str(mp / "f"), str(args.n)], check=True)
        t1 = os.times()
        calls = 2 * args.n + 1
        print(f"  server CPU per request: user {(t1.user - t0.user) / calls * 1e6:.0f} us, "
              f"system {(t1.system - t0.system) / calls * 1e6:.0f} us")
    finally:
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
