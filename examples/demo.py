"""The ckptfs demo (`make demo`): unchanged training code checkpointing into a mount.

1. Makes two file-backed devices (sparse files) and a mountpoint under --scratch.
2. Formats them as one pool and mounts ckptfs over them:
   `python -m ckptfs format --devices D0,D1`,
   `python -m ckptfs mount MNT --devices D0,D1 --memory 1G`.
3. Runs examples/train.py, unchanged, four times: saving into /dev/shm (memory:
   the floor, never durable), into a plain directory next to the mount (ext4
   on most machines), into that directory with --fsync (durable when the
   save returns), and into the mount. While it saves into the mount, the demo
   watches each checkpoint's `user.ckptfs.state` until it reads "durable".
4. Prints one table: how long a save blocked training and when the checkpoint
   was durable, for each, with a one-line reading computed from those numbers
   (and, where ckptfs blocked longer than the others, what it cost the
   machine); lists the mount and checks that the last checkpoint loads.
5. Unmounts (which waits until everything is on the devices), mounts again
   and checks the last checkpoint is still there, bit for bit.
6. Unmounts with `ckptfs umount`, always, also after an error.

Exits non-zero on any failure. Everything lives under --scratch (default
./scratch/demo, ignored by git); each run starts from fresh devices.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"
SAVE_RE = re.compile(r"^step (\d+): saved (\S+) \(([\d.]+) MiB\) in ([\d.]+) s .*started at ([\d.]+)")
STEP_RE = re.compile(r"^step (\d+): loss \S+, ([\d.]+) s$")


class DemoError(Exception):
    pass


def sh(*cmd: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a command, echoing it; raises DemoError (with its stderr) when it fails."""
    print("$ " + " ".join(cmd), flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    out = (res.stdout + res.stderr).strip()
    if out:
        print("  " + out.replace("\n", "\n  "), flush=True)
    if res.returncode != 0:
        raise DemoError(f"{' '.join(cmd[:4])} ... failed with status {res.returncode}")
    return res


def ckptfs(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return sh(sys.executable, "-m", "ckptfs", *args, timeout=timeout)


def is_mounted(path: Path) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == real for line in f)


def fs_type(path: Path) -> str:
    """The type of the filesystem holding `path` (the longest matching mount point)."""
    real, best, kind = os.path.realpath(path), "", "?"
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            mnt = fields[1].encode().decode("unicode_escape")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, fields[2]
    return kind


def make_devices(folder: Path, count: int, size: int) -> list[Path]:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    devices = []
    for i in range(count):
        path = folder / f"dev{i}.img"
        with open(path, "wb") as f:
            f.truncate(size)  # sparse: takes no disk space until written
        devices.append(path)
    return devices


class Run:
    """One train.py run: the time each save blocked training and, on a ckptfs mount, how long after
    its start each checkpoint was durable (None: replaced or deleted before it was)."""

    def __init__(self, label: str):
        self.label = label
        self.blocked: dict[int, float] = {}
        self.durable: dict[int, float | None] = {}
        self.steps: list[float] = []
        self.mib = 0.0
        self.daemon_cpu: float | None = None  # ckptfs: the daemon's CPU seconds over the run


def watch_durable(path: Path, started: float, out: dict, step: int, timeout: float = 60) -> None:
    """In a thread: poll the checkpoint's state xattr until it says durable; store the seconds
    from the save's start (None if the file went away first)."""
    from ckptfs.ops.api import state
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if state(path) == "durable":
                out[step] = time.time() - started
                return
        except FileNotFoundError:
            break
        time.sleep(0.005)
    out[step] = None


def train(save_dir: Path, label: str, args, *, fsync: bool = False, watch: bool = False) -> Run:
    """Run examples/train.py into `save_dir` (with --fsync); `watch`: time each checkpoint to durable."""
    cmd = [sys.executable, str(TRAIN), "--save-dir", str(save_dir), "--steps", str(args.steps),
           "--save-every", str(args.save_every), "--params-mb", str(args.params_mb)] + (["--fsync"] if fsync else [])
    print(f"\n$ {' '.join(cmd[1:])}", flush=True)
    run = Run(label)
    watchers = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            print(f"  [{label}] {line}", end="", flush=True)
            if m := SAVE_RE.match(line):
                step = int(m.group(1))
                run.blocked[step], run.mib = float(m.group(4)), float(m.group(3))
                if watch:
                    t = threading.Thread(target=watch_durable,
                                         args=(save_dir / m.group(2), float(m.group(5)), run.durable, step))
                    t.start()
                    watchers.append(t)
            elif m := STEP_RE.match(line):
                run.steps.append(float(m.group(2)))
    for t in watchers:
        t.join()
    if proc.returncode != 0:
        raise DemoError(f"train.py with --save-dir {save_dir} failed with status {proc.returncode}")
    if not run.blocked:
        raise DemoError(f"train.py with --save-dir {save_dir} reported no saves")
    return run


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summary(shm: Run, plain: Run, fsynced: Run, ckpt: Run, plain_fs: str) -> None:
    """The table a user decides with, and a reading of it that holds whatever machine ran it."""
    expire = int(Path("/proc/sys/vm/dirty_expire_centisecs").read_text()) / 100
    blocked = {r.label: statistics.median(r.blocked.values()) for r in (shm, plain, fsynced, ckpt)}
    durable = _median(ckpt.durable.values())
    never = sum(v is None for v in ckpt.durable.values())
    rows = [
        (shm.label, blocked[shm.label], "never (memory)", "nothing"),
        (plain.label, blocked[plain.label], f"later: when the kernel writes it back (within ~{expire:.0f} s)",
         "an older checkpoint, or a torn or empty file"),
        (fsynced.label, blocked[fsynced.label], "when the save returns", "the checkpoint just saved"),
        (ckpt.label, blocked[ckpt.label],
         "–" if durable is None else f"{durable:.3f} s after the save began (median)",
         "the newest checkpoint durable by then (a prefix), never a torn one"),
    ]
    print(f"\n{len(ckpt.blocked)} saves of {ckpt.mib:.0f} MiB each (model + Adam state); medians:\n")
    print("| saved into | save blocked training (s) | on disk | a crash right after a save keeps |")
    print("|---|---:|---|---|")
    for label, b, d, keeps in rows:
        print(f"| {label} | {b:.3f} | {d} | {keeps} |")
    if never:
        print(f"\n({never} of {len(ckpt.durable)} ckptfs checkpoints were replaced before they were durable: "
              f"their data was never written, as promised; the one that replaced them was.)")
    b = blocked[ckpt.label]
    reading = (f"\nReading: a save into ckptfs blocked training {b / blocked[shm.label]:.2f}x as long as into "
               f"memory (/dev/shm) and {b / blocked[fsynced.label]:.2f}x as long as {fsynced.label}")
    if durable is not None:
        reading += (f", and its checkpoint was durable {durable:.2f} s after the save began "
                    f"({'sooner' if durable < blocked[fsynced.label] else 'later'} than with "
                    f"{fsynced.label}, whose save blocked until then).")
    print(reading)
    if b > 1.1 * min(blocked[shm.label], blocked[plain.label]):
        faster = shm.label if blocked[shm.label] <= blocked[plain.label] else plain.label
        cpu = "" if ckpt.daemon_cpu is None else (
            f"; its daemon used {ckpt.daemon_cpu / len(ckpt.blocked) * 1e3:.0f} ms of CPU per save, on cores "
            f"training shares ({os.cpu_count()} here)")
        print(f"On this machine ckptfs blocked longer than {faster}: each write() into the mount is a round "
              f"trip to the ckptfs daemon, which copies the data into its memory{cpu}.")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def list_mount(mnt: Path) -> None:
    print(f"\nContents of {mnt}:")
    for entry in sorted(os.scandir(mnt), key=lambda e: e.name):
        print(f"  {entry.name:24s} {entry.stat().st_size / 2**20:10.1f} MiB")
    st = os.statvfs(mnt)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    print(f"  (filesystem: {used / 2**20:.0f} MiB used of {st.f_blocks * st.f_frsize / 2**30:.1f} GiB)")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    return h.hexdigest()


def verify(mnt: Path, step: int) -> str:
    """torch.load the checkpoint of `step` and check it; returns the file's sha256."""
    path = mnt / f"step{step:06d}.pt"
    print(f"\nVerifying {path} with torch.load ...", flush=True)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("step") != step:
        raise DemoError(f"{path} holds step {state.get('step')}, expected {step}")
    tensors = list(state["model"].values())
    if not tensors or not all(torch.isfinite(t).all() for t in tensors):
        raise DemoError(f"{path}: the model state is empty or not finite")
    if not state["optim"]["state"]:
        raise DemoError(f"{path}: the optimizer state is empty")
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    digest = sha256(path)
    print(f"  OK: step {step}, {len(tensors)} model tensors ({nbytes / 2**20:.0f} MiB), optimizer state "
          f"present; sha256 {digest[:16]}...")
    return digest


def main() -> int:
    p = argparse.ArgumentParser(description="ckptfs demo: train.py checkpointing into a ckptfs mount, /dev/shm, "
                                            "a plain directory and the same with fsync.")
    p.add_argument("--scratch", type=Path, default=ROOT / "scratch" / "demo")
    p.add_argument("--memory", default="1G", help="ckptfs memory budget (default %(default)s)")
    p.add_argument("--device-size", type=int, default=2 << 30, help="bytes per file-backed device (default 2 GiB)")
    p.add_argument("--params-mb", type=float, default=80, help="model size; the checkpoint is ~3x this (Adam)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--save-every", type=int, default=2)
    args = p.parse_args()

    scratch = args.scratch.resolve()
    mnt, plain, log = scratch / "mnt", scratch / "plain", scratch / "daemon.log"
    shm = Path("/dev/shm") / f"ckptfs-demo-{os.getpid()}"
    scratch.mkdir(parents=True, exist_ok=True)
    if is_mounted(mnt):  # left over from an interrupted run
        ckptfs("umount", str(mnt))
    mnt.mkdir(exist_ok=True)
    log.unlink(missing_ok=True)
    devices = make_devices(scratch / "devices", 2, args.device_size)
    plain_fs = fs_type(scratch)

    mounted = False
    status = 0
    try:
        device_list = ",".join(map(str, devices))
        mount = ("mount", str(mnt), "--devices", device_list, "--memory", args.memory, "--log-file", str(log))
        ckptfs("format", "--devices", device_list)
        ckptfs(*mount)
        mounted = True
        runs = []
        for label, where, fsync in (("/dev/shm", shm, False), (plain_fs, plain, False),
                                    (f"{plain_fs} + fsync", plain, True)):
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir()
            runs.append(train(where, label, args, fsync=fsync))
            shutil.rmtree(where, ignore_errors=True)
        pid = int(os.getxattr(mnt, "user.ckptfs.pid"))
        cpu0 = cpu_seconds(pid)
        ckpt = train(mnt, "ckptfs", args, watch=True)
        ckpt.daemon_cpu = cpu_seconds(pid) - cpu0
        summary(*runs, ckpt, plain_fs)
        list_mount(mnt)
        last = max(ckpt.blocked)
        before = verify(mnt, last)

        print("\nUnmounting (waits until everything is on the devices) and mounting again:")
        ckptfs("umount", str(mnt))
        mounted = False
        ckptfs(*mount)
        mounted = True
        list_mount(mnt)
        if verify(mnt, last) != before:
            raise DemoError(f"step{last:06d}.pt changed across the remount")
        print("  identical to what was written before the remount")
    except (DemoError, subprocess.SubprocessError, OSError) as e:
        print(f"\ndemo FAILED: {e}", file=sys.stderr)
        if log.exists():
            print(f"last lines of the daemon log {log}:\n" + "".join(log.read_text().splitlines(True)[-20:]),
                  file=sys.stderr)
        status = 1
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if mounted or is_mounted(mnt):
            print()
            try:
                ckptfs("umount", str(mnt))
            except (DemoError, subprocess.SubprocessError) as e:
                print(f"demo FAILED to unmount: {e}; clearing the mount lazily", file=sys.stderr)
                subprocess.run(["fusermount3", "-u", "-z", str(mnt)])
                status = 1
    if status == 0:
        print("\ndemo OK")
    return status


if __name__ == "__main__":
    sys.exit(main())
