#!/usr/bin/env python3
"""Entrypoint of the ckptfs sidecar image (installed as /usr/local/bin/ckptfs-entrypoint).

    ckptfs-entrypoint                      mount as the environment says (below), in the foreground
    ckptfs-entrypoint mount MP --devices D1,D2 [ckptfs mount options]
                                           the same, with ckptfs's own command line
    ckptfs-entrypoint health [MP]          exit 0 when MP is a live ckptfs mount (HEALTHCHECK)
    ckptfs-entrypoint format|fsck|sync|umount|--help ...
                                           run that ckptfs command

Mounting, it
1. clears a stale mount that a killed predecessor left at the mountpoint ("Transport
   endpoint is not connected"), so a restarted sidecar comes up over it;
2. formats the devices first when CKPTFS_FORMAT=if-needed and every device is blank
   (its first MiB all zeros): a pool, or anything else, is never overwritten; with
   CKPTFS_RESTORE_FROM the mount formats them itself and restores into them the newest
   state replicated under that prefix (nothing there yet: an empty pool);
3. runs `ckptfs mount MP --foreground` as its child and, once the mount is live, gives
   its root directory to CKPTFS_OWNER;
4. on SIGTERM or SIGINT passes SIGTERM to the daemon, which unmounts (lazily: the
   trainer's view goes too), drains everything still in memory to the devices and
   exits 0; then it exits with the daemon's status. The container runtime must allow
   that time before its SIGKILL: stop_grace_period (compose), terminationGracePeriodSeconds
   (Kubernetes), `docker stop -t` / `podman stop -t`; see README.

Environment (used when no arguments are given; CKPTFS_FORMAT and CKPTFS_OWNER always):
  CKPTFS_DEVICES     the pool's devices, comma-separated (required)
  CKPTFS_MOUNTPOINT  default /shared/ckpt: a directory under the rshared bind mount
  CKPTFS_MEMORY      memory budget (ckptfs's default: 25% of RAM)
  CKPTFS_MAX_LAG     seconds a closed checkpoint may wait before it is made durable (default 2)
  CKPTFS_REPLICATE   s3://BUCKET/PREFIX: replicate the durable checkpoints to an object store;
                     give each node or pod its own prefix (e.g. .../node-$NODE_RANK); the
                     credentials come from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_DEFAULT_REGION
                     (or AWS_* web identity / instance role) in the environment
  CKPTFS_RESTORE_FROM  s3://BUCKET/PREFIX, with CKPTFS_FORMAT=if-needed: blank devices (a
                     replacement node or pod) are restored from the newest state replicated
                     there, usually this pod's own CKPTFS_REPLICATE prefix: the tree at once,
                     contents on first read and in the background. A prefix that holds nothing
                     yet (the job's first start) gives an empty pool; devices that hold a pool
                     are mounted as they are (an interrupted restore goes on by itself)
  CKPTFS_S3_ENDPOINT the object store's URL, for stores other than AWS S3 (MinIO, Ceph, SeaweedFS)
  CKPTFS_FORMAT      never (default) or if-needed
  CKPTFS_OWNER       UID[:GID] to own the mount's root directory (non-root trainers)
  CKPTFS_ARGS        more `ckptfs mount` options, e.g. "--queue-depth 16 --fsync durable", or the
                     object store's retention and upload options ("--replicate-keep-daily 14
                     --s3-sse AES256 --s3-region eu-west-1")

Stdlib only; runs `ckptfs` from $PATH.
"""
from __future__ import annotations

import argparse
import errno
import os
import shlex
import signal
import subprocess
import sys
import time

PROG = "ckptfs-entrypoint"
DEFAULT_MOUNTPOINT = "/shared/ckpt"
FORMAT_MODES = ("never", "if-needed")


class Fatal(Exception):
    """A configuration problem: one line, exit 2."""


def say(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


# ---- mount table -------------------------------------------------------------------

def _unescape(field: str) -> str:
    """Undo /proc/self/mountinfo's octal escapes (space is \\040)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1:i + 4]) == 3 and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts_at(path: str, mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """The filesystem types mounted at `path`, bottom first."""
    path = os.path.normpath(path)
    found = []
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) >= 5 and _unescape(fields[4]) == path:
                found.append(right.split()[0] if right else "?")
    return found


def is_stale(path: str) -> bool:
    try:  # statfs always asks the daemon; stat may be answered from the kernel's cache
        os.statvfs(path)
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ENOTCONN
    return False


def clear_stale(path: str) -> bool:
    """Unmount what a killed ckptfs left at `path`: a dead FUSE mount (ENOTCONN), or a
    ckptfs mount whose daemon is gone. Returns True when something was cleared."""
    cleared = False
    for _ in range(8):  # a stale mount may sit on top of another
        types = mounts_at(path)
        if not types:
            break
        if not (is_stale(path) or (types[-1] == "fuse.ckptfs" and not _live(path))):
            break
        say(f"clearing a stale mount at {path} (left by a killed daemon)")
        res = subprocess.run(["fusermount3", "-u", "-z", path], capture_output=True, text=True)
        if res.returncode != 0:
            res = subprocess.run(["umount", "-l", path], capture_output=True, text=True)
        if res.returncode != 0:
            raise Fatal(f"cannot clear the stale mount at {path}: {res.stderr.strip()}")
        cleared = True
    return cleared


def _live(path: str) -> bool:
    try:
        os.getxattr(path, "user.ckptfs.pid")
        return True
    except OSError:
        return False


def health(path: str, owner: tuple[int, int] | None = None) -> tuple[bool, str]:
    """(live?, a line saying why) for the ckptfs mount at `path`; with `owner`, live only
    once its root belongs to that uid:gid (so a trainer started on health can write)."""
    try:
        types = mounts_at(path)
    except OSError as e:
        return False, f"cannot read the mount table: {e.strerror}"
    if not types or types[-1] != "fuse.ckptfs":
        return False, f"{path} is not a ckptfs mount"
    if is_stale(path):
        return False, f"{path} is a dead mount (transport endpoint is not connected)"
    try:
        pid = int(os.getxattr(path, "user.ckptfs.pid"))
    except (OSError, ValueError) as e:
        return False, f"{path} does not answer as ckptfs: {e}"
    if owner:
        st = os.stat(path)
        if (st.st_uid, st.st_gid) != owner:
            return False, f"{path} is mounted, not yet given to {owner[0]}:{owner[1]}"
    return True, f"{path} is live (daemon pid {pid})"


# ---- devices -----------------------------------------------------------------------

def blank(path: str, nbytes: int = 1 << 20) -> bool:
    """True when the first MiB of `path` (or all of it, if smaller) is all zeros."""
    with open(path, "rb", buffering=0) as f:
        head = f.read(nbytes)
    return head.count(0) == len(head)


def blank_devices(devices: list[str]) -> bool:
    try:
        return all(blank(d) for d in devices)
    except OSError:
        return False  # `ckptfs mount` names the device with its own clear message


# ---- the mount command -------------------------------------------------------------

def mount_command(argv: list[str], env: dict) -> tuple[list[str], str, list[str]]:
    """(`ckptfs mount ... --foreground`, mountpoint, devices) from the arguments or the env."""
    if argv:
        p = argparse.ArgumentParser(prog=f"{PROG} mount", add_help=False)
        p.add_argument("mountpoint")
        p.add_argument("--devices", required=True)
        try:
            known, _ = p.parse_known_args(argv[1:])
        except SystemExit:
            raise Fatal("usage: mount MOUNTPOINT --devices DEV[,DEV...] [ckptfs mount options]") from None
        cmd = ["ckptfs", *argv]
        mp, devices = known.mountpoint, known.devices
    else:
        devices = env.get("CKPTFS_DEVICES", "").strip()
        if not devices:
            raise Fatal("set CKPTFS_DEVICES to the pool's devices, e.g. /dev/nvme0n1,/dev/nvme1n1 "
                        "(or give the arguments: mount MOUNTPOINT --devices ...)")
        mp = env.get("CKPTFS_MOUNTPOINT") or DEFAULT_MOUNTPOINT
        cmd = ["ckptfs", "mount", mp, "--devices", devices]
        if env.get("CKPTFS_MEMORY"):
            cmd += ["--memory", env["CKPTFS_MEMORY"]]
        if env.get("CKPTFS_MAX_LAG"):
            cmd += ["--max-lag", env["CKPTFS_MAX_LAG"]]
        if env.get("CKPTFS_REPLICATE"):
            cmd += ["--replicate", env["CKPTFS_REPLICATE"]]
        if env.get("CKPTFS_S3_ENDPOINT"):
            if not env.get("CKPTFS_REPLICATE") and not env.get("CKPTFS_RESTORE_FROM"):
                raise Fatal("CKPTFS_S3_ENDPOINT is set but neither CKPTFS_REPLICATE nor CKPTFS_RESTORE_FROM is "
                            "(s3://BUCKET/PREFIX)")
            cmd += ["--s3-endpoint", env["CKPTFS_S3_ENDPOINT"]]
        try:
            cmd += shlex.split(env.get("CKPTFS_ARGS", ""))
        except ValueError as e:
            raise Fatal(f"bad CKPTFS_ARGS: {e}") from None
    if "--foreground" not in cmd and "-f" not in cmd:
        cmd.append("--foreground")
    return cmd, os.path.abspath(mp), [d.strip() for d in devices.split(",")]


def restore_source(argv: list[str], env: dict, fmt: str) -> str | None:
    """CKPTFS_RESTORE_FROM, checked: an s3:// URL, with CKPTFS_FORMAT=if-needed, in the env form."""
    url = env.get("CKPTFS_RESTORE_FROM", "").strip()
    if not url:
        return None
    if argv:
        raise Fatal("CKPTFS_RESTORE_FROM is for the environment form; with arguments give "
                    "--format --restore-from yourself")
    if not url.startswith("s3://"):
        raise Fatal(f"bad CKPTFS_RESTORE_FROM={url}: expected s3://BUCKET/PREFIX")
    if fmt != "if-needed":
        raise Fatal("CKPTFS_RESTORE_FROM needs CKPTFS_FORMAT=if-needed: it restores into blank devices only "
                    "(a pool on the devices is mounted as it is)")
    return url


def parse_owner(text: str) -> tuple[int, int] | None:
    if not text:
        return None
    uid, _, gid = text.partition(":")
    if not uid.isdigit() or (gid and not gid.isdigit()):
        raise Fatal(f"bad CKPTFS_OWNER={text}: expected UID or UID:GID (numbers)")
    return int(uid), int(gid) if gid else int(uid)


def prepare_mountpoint(mp: str) -> None:
    """Clear a stale mount; create the directory; make the bare directory read-only, so a
    non-root trainer that runs without the mount fails (EACCES) instead of quietly filling
    the host's disk."""
    clear_stale(mp)
    if mounts_at(mp):
        if health(mp)[0]:
            raise Fatal(f"{mp} is already a live ckptfs mount (another sidecar?)")
        raise Fatal(f"{mp} is already a mountpoint ({mounts_at(mp)[-1]}): choose another CKPTFS_MOUNTPOINT")
    os.makedirs(mp, exist_ok=True)
    try:
        os.chmod(mp, 0o555)
    except OSError:
        pass


class Supervisor:
    """Runs the daemon as a child; SIGTERM/SIGINT are passed on as SIGTERM."""

    def __init__(self, cmd: list[str], mp: str, owner: tuple[int, int] | None):
        self.cmd, self.mp, self.owner = cmd, mp, owner
        self.child: subprocess.Popen | None = None
        self.stop_at: float | None = None
        # from the start: as PID 1 a signal without a handler would be ignored
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        if self.stop_at is None:
            self.stop_at = time.monotonic()
            say(f"{signal.Signals(signum).name}: the daemon unmounts {self.mp}, drains everything "
                f"to the devices, then exits")
        if self.child and self.child.poll() is None:
            try:
                self.child.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def run(self) -> int:
        if self.stop_at is not None:
            say("stopped before mounting")
            return 0
        say("running: " + " ".join(shlex.quote(c) for c in self.cmd))
        self.child = subprocess.Popen(self.cmd)
        if self.stop_at is not None:  # a signal came while starting the child
            self.child.send_signal(signal.SIGTERM)
        self._await_live()
        rc = self._wait()
        if self.stop_at is not None:
            took = time.monotonic() - self.stop_at
            if rc == 0:
                say(f"stopped: everything is on the devices, {self.mp} unmounted ({took:.1f} s)")
            else:
                say(f"the daemon exited with status {rc} while stopping ({took:.1f} s)")
        elif rc != 0:
            say(f"the daemon exited with status {rc}")
        return rc

    def _await_live(self) -> None:
        while self.child.poll() is None and self.stop_at is None:
            ok, _ = health(self.mp)
            if ok:
                say(f"{self.mp} is live")
                if self.owner:
                    try:
                        os.chown(self.mp, *self.owner)
                    except OSError as e:
                        say(f"cannot give {self.mp} to {self.owner[0]}:{self.owner[1]}: {e.strerror} "
                            f"(the container needs CAP_CHOWN)")
                return
            time.sleep(0.1)

    def _wait(self) -> int:
        """Wait for the daemon, reaping any other child that was re-parented to us (PID 1)."""
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:  # already reaped by poll()
                rc = self.child.returncode if self.child.returncode is not None else 1
                return rc if rc >= 0 else 128 - rc
            if pid == self.child.pid:
                self.child.returncode = os.waitstatus_to_exitcode(status)
                rc = self.child.returncode
                return rc if rc >= 0 else 128 - rc


def run_mount(argv: list[str], env: dict) -> int:
    cmd, mp, devices = mount_command(argv, env)
    fmt = env.get("CKPTFS_FORMAT") or "never"
    if fmt not in FORMAT_MODES:
        raise Fatal(f"bad CKPTFS_FORMAT={fmt}: expected never or if-needed")
    restore = restore_source(argv, env, fmt)
    owner = parse_owner(env.get("CKPTFS_OWNER", ""))
    supervisor = Supervisor(cmd, mp, owner)
    prepare_mountpoint(mp)
    if fmt == "if-needed" and "--format" not in cmd:
        if blank_devices(devices) and restore:
            say(f"CKPTFS_FORMAT=if-needed: the devices are blank: restoring {','.join(devices)} from {restore} "
                f"(an empty pool if nothing was replicated there yet)")
            supervisor.cmd = [*cmd, "--format", "--restore-from", restore, "--restore-if-any"]
        elif blank_devices(devices):
            say(f"CKPTFS_FORMAT=if-needed: the devices are blank: formatting {','.join(devices)}")
            res = subprocess.run(["ckptfs", "format", "--devices", ",".join(devices)])
            if res.returncode != 0:
                return res.returncode
        else:
            held = [d for d in devices if not blank_devices([d])]
            say(f"CKPTFS_FORMAT=if-needed: the devices are not blank ({', '.join(held)} hold(s) data): "
                f"mounting what they hold; nothing is formatted")
    return supervisor.run()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    env = dict(os.environ)
    try:
        if argv and argv[0] == "health":
            mp = argv[1] if len(argv) > 1 else env.get("CKPTFS_MOUNTPOINT") or DEFAULT_MOUNTPOINT
            ok, why = health(os.path.abspath(mp), parse_owner(env.get("CKPTFS_OWNER", "")))
            print(why, flush=True)
            return 0 if ok else 1
        if argv and argv[0] != "mount":
            os.execvp("ckptfs", ["ckptfs", *argv])  # format, fsck, sync, umount, --help, ...
        return run_mount(argv, env)
    except Fatal as e:
        say(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
