"""The ckptfs demo (`make demo`): unchanged training code checkpointing into a mount.

1. Makes two file-backed devices (sparse files) and a mountpoint under --scratch.
2. Formats them as one pool and mounts ckptfs over them:
   `python -m ckptfs format --devices D0,D1`,
   `python -m ckptfs mount MNT --devices D0,D1 --memory 1G`.
3. Runs examples/train.py with --save-dir on the mount, then the same run with
   --save-dir on a plain directory next to it (ext4 on most machines).
4. Prints the time each save blocked training on both, lists the mount and
   checks that the last checkpoint loads with torch.load.
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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"
SAVE_RE = re.compile(r"^step (\d+): saved (\S+) \(([\d.]+) MiB\) in ([\d.]+) s")
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


def train(save_dir: Path, label: str, args) -> tuple[dict[int, float], list[float]]:
    """Run examples/train.py into `save_dir`; returns ({step: blocked seconds}, step times)."""
    cmd = [sys.executable, str(TRAIN), "--save-dir", str(save_dir), "--steps", str(args.steps),
           "--save-every", str(args.save_every), "--params-mb", str(args.params_mb)]
    print(f"\n$ {' '.join(cmd[1:])}", flush=True)
    saves: dict[int, float] = {}
    steps: list[float] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            print(f"  [{label}] {line}", end="", flush=True)
            if m := SAVE_RE.match(line):
                saves[int(m.group(1))] = float(m.group(4))
            elif m := STEP_RE.match(line):
                steps.append(float(m.group(2)))
    if proc.returncode != 0:
        raise DemoError(f"train.py with --save-dir {save_dir} failed with status {proc.returncode}")
    if not saves:
        raise DemoError(f"train.py with --save-dir {save_dir} reported no saves")
    return saves, steps


def summary(results: dict[str, tuple[dict[int, float], list[float]]]) -> None:
    labels = list(results)
    print("\nTime each save blocked training (torch.save + rename + delete the old one), seconds:")
    print("| save at step | " + " | ".join(labels) + " |")
    print("|---:|" + "---:|" * len(labels))
    for step in sorted(results[labels[0]][0]):
        print(f"| {step} | " + " | ".join(f"{results[k][0].get(step, float('nan')):.3f}" for k in labels) + " |")
    med = {k: statistics.median(results[k][0].values()) for k in labels}
    print("| **median** | " + " | ".join(f"**{med[k]:.3f}**" for k in labels) + " |")
    print("| median step (no save) | " + " | ".join(f"{statistics.median(results[k][1]):.3f}" for k in labels) + " |")
    a, b = labels
    print(f"\nMedian time a save blocked training: {med[a]:.3f} s on {a}, {med[b]:.3f} s on {b} "
          f"({b}/{a} = {med[b] / med[a]:.1f}x).")


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
    p = argparse.ArgumentParser(description="ckptfs demo: train.py checkpointing into a ckptfs mount vs a plain directory.")
    p.add_argument("--scratch", type=Path, default=ROOT / "scratch" / "demo")
    p.add_argument("--memory", default="1G", help="ckptfs memory budget (default %(default)s)")
    p.add_argument("--device-size", type=int, default=2 << 30, help="bytes per file-backed device (default 2 GiB)")
    p.add_argument("--params-mb", type=float, default=80, help="model size; the checkpoint is ~3x this (Adam)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--save-every", type=int, default=2)
    args = p.parse_args()

    scratch = args.scratch.resolve()
    mnt, plain, log = scratch / "mnt", scratch / "plain", scratch / "daemon.log"
    scratch.mkdir(parents=True, exist_ok=True)
    if is_mounted(mnt):  # left over from an interrupted run
        ckptfs("umount", str(mnt))
    mnt.mkdir(exist_ok=True)
    shutil.rmtree(plain, ignore_errors=True)
    plain.mkdir()
    log.unlink(missing_ok=True)
    devices = make_devices(scratch / "devices", 2, args.device_size)
    plain_label = fs_type(plain)

    mounted = False
    status = 0
    try:
        device_list = ",".join(map(str, devices))
        mount = ("mount", str(mnt), "--devices", device_list, "--memory", args.memory, "--log-file", str(log))
        ckptfs("format", "--devices", device_list)
        ckptfs(*mount)
        mounted = True
        results = {"ckptfs": train(mnt, "ckptfs", args), plain_label: train(plain, plain_label, args)}
        summary(results)
        list_mount(mnt)
        last = max(results["ckptfs"][0])
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
