"""Shared pieces of the benchmarks: running the CLI, mounts, machine facts, statistics, results files.

Every case module (save, training, restore, scale, samepath, smallfiles,
replicate, budget), drain.py and the probes (probes/) build on these:

  * ckptfs(...) runs the CLI; mounted(...) is a context manager that mounts
    over fresh devices and always unmounts;
  * random_state_dict(nbytes) is the checkpoint everyone saves: random fp32
    tensors (never zeros, which compress and dedupe);
  * stats(xs) and pairwise(a, b) are how every figure is reported: the
    median with min and max, and ratios taken run by run (each run of one
    system against the run of the other in the same round);
  * machine() records what a result was measured on; write_results() puts
    it in benchmarks/results/<name>.json;
  * proc_cpu_seconds(pid), proc_io(pid), drop_caches(), fsync_path() are
    the small probes the cases use.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
# CKPTFS_BENCH_RESULTS: somewhere else for trial runs, so they do not replace the suite's results
RESULTS = Path(os.environ.get("CKPTFS_BENCH_RESULTS") or ROOT / "benchmarks" / "results")
SCRATCH = ROOT / "scratch"
sys.path.insert(0, str(ROOT))

from ckptfs.sizes import parse_size  # noqa: E402,F401 - re-exported for the benchmarks

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
TENSOR_SIDE = 4096  # state dicts are made of fp32 4096 x 4096 tensors: 64 MiB each
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- the CLI and mounts ----------------------------------------------------------------------

def case_args(doc: str, argv: list[str] | None, *, size: str, memory: str, scratch: str, extra=None):
    """The options every restore-like case takes (--size, --repeats, --memory, --scratch), parsed;
    `scratch` names its folder under SCRATCH; `extra(parser)` adds a case's own."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--size", default=size)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory", default=memory)
    ap.add_argument("--scratch", type=Path, default=SCRATCH / scratch)
    if extra is not None:
        extra(ap)
    return ap.parse_args(argv)


def run_together(target, argsets: list[tuple], method: str = "fork", timeout: float = 900) -> list:
    """One process per argument tuple, each called as target(*args, barrier, out), all released by
    one barrier; what each put on `out`, once they have all exited (any failure stops the case)."""
    import multiprocessing as mp

    ctx = mp.get_context(method)
    barrier, out = ctx.Barrier(len(argsets)), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, barrier, out)) for args in argsets]
    for p in procs:
        p.start()
    results = [out.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"{target.__name__} process failed ({p.exitcode})")
    return results


def ckptfs(*args: str, timeout: float = 900) -> None:
    res = subprocess.run([sys.executable, "-m", "ckptfs", *args], capture_output=True, text=True,
                         timeout=timeout)
    if res.returncode != 0:
        raise SystemExit(f"ckptfs {args[0]} failed ({res.returncode}): {res.stderr.strip()}")


def is_mounted(path: Path) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == real for line in f)


def file_devices(directory: Path, n: int, size: int) -> list[Path]:
    """n fresh sparse device files of `size` bytes in `directory` (replacing old ones)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = directory / f"dev{i}.img"
        p.unlink(missing_ok=True)
        with open(p, "wb") as f:
            f.truncate(size)
        paths.append(p)
    return paths


@contextlib.contextmanager
def mounted(mp: Path, devices: list, memory: str, *, fmt: bool = True, log_file: Path | None = None,
            extra: tuple[str, ...] = ()) -> Iterator[int]:
    """Mount ckptfs at `mp` over `devices` (formatting them first unless fmt=False); yields the
    daemon's pid; always unmounts (which waits until everything is durable)."""
    mp.mkdir(parents=True, exist_ok=True)
    if is_mounted(mp):
        ckptfs("umount", str(mp))
    args = ["mount", str(mp), "--devices", ",".join(map(str, devices)), "--memory", memory, *extra]
    if fmt:
        args += ["--format", "--force"]
    if log_file is not None:
        args += ["--log-file", str(log_file)]
    ckptfs(*args)
    try:
        yield int(os.getxattr(mp, "user.ckptfs.pid"))
    finally:
        ckptfs("umount", str(mp))


def sync_mount(mp: Path) -> None:
    """What `ckptfs sync MP` does, without starting a process: fsync on the mount's root."""
    fd = os.open(mp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def shm_dir(tag: str) -> Iterator[Path]:
    """A fresh directory in /dev/shm (tmpfs), removed afterwards."""
    d = Path(f"/dev/shm/ckptfs-bench-{tag}-{os.getpid()}")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def clear_dir(d: Path) -> None:
    """Remove everything inside `d` (which stays)."""
    for p in d.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


# --- payloads ---------------------------------------------------------------------------------

def random_state_dict(nbytes: int, seed: int = 0) -> dict:
    """A state dict of random fp32 4096 x 4096 tensors (64 MiB each) totalling about `nbytes`."""
    import torch
    g = torch.Generator().manual_seed(seed)
    n = max(1, nbytes // (TENSOR_SIDE * TENSOR_SIDE * 4))
    return {f"layer{i}.weight": torch.rand(TENSOR_SIDE, TENSOR_SIDE, generator=g) for i in range(n)}


def write_bytes(path: Path, block, total: int) -> None:
    """open, write `total` bytes in len(block) write() calls (checking each count), close."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(block)
        done = 0
        while done < total:
            want = min(len(view), total - done)
            n = os.write(fd, view[:want])
            if n != want:
                raise OSError(f"short write to {path}: {n} of {want} bytes")
            done += n
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- probes -----------------------------------------------------------------------------------

def drop_caches() -> None:
    """Write back and drop the page cache, dentries and inodes (root only)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        return stat_cpu_seconds(f.read())


def stat_user_system(stat: str) -> tuple[float, float]:
    """User and system CPU seconds in the text of a /proc/PID/stat (or .../task/TID/stat)."""
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK  # utime, stime: fields 14, 15 of stat


def stat_cpu_seconds(stat: str) -> float:
    """User + system CPU seconds in the text of a /proc/PID/stat (or .../task/TID/stat)."""
    return sum(stat_user_system(stat))


def children_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the child processes of `pid`: those alive (every thread), plus
    those it has reaped (cutime, cstime). For a ckptfs daemon: its uploader process (--replicate)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    total = (int(fields[13]) + int(fields[14])) / CLK_TCK  # cutime, cstime: fields 16, 17 of stat
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(c) for c in f.read().split()]
        except OSError:
            continue
        for kid in kids:
            try:
                total += proc_cpu_seconds(kid)
            except OSError:
                pass  # gone meanwhile (and counted in cutime once reaped)
    return total


def proc_io(pid: int) -> dict[str, int]:
    """/proc/<pid>/io as a dict (read_bytes, write_bytes, ...)."""
    with open(f"/proc/{pid}/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def block_sectors_written(dev: str) -> int:
    """Sectors (512 B) written to block device `dev` (e.g. /dev/loop3) since boot."""
    return int(Path(f"/sys/block/{Path(dev).name}/stat").read_text().split()[6])


# --- statistics -------------------------------------------------------------------------------

def stats(xs: list[float]) -> dict:
    """median, min, max of a list of runs, with the runs themselves."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": list(xs)}


def pairwise(a: list[float], b: list[float]) -> dict:
    """Ratios a[i] / b[i] of runs measured in the same round, as stats()."""
    if len(a) != len(b) or not a:
        raise ValueError(f"pairwise ratio of {len(a)} and {len(b)} runs")
    return stats([x / y for x, y in zip(a, b)])


def rotated(items: list, k: int) -> list:
    """items rotated by k: round k of an interleaved benchmark starts with a different system."""
    k %= len(items)
    return items[k:] + items[:k]


def target(name: str, value: float | None, limit: float, *, at_most: bool = True, note: str = "") -> dict:
    """A target's verdict: value <= limit (at_most) or value >= limit; met is None when there is
    no value (the note says why)."""
    met = None if value is None else bool(value <= limit if at_most else value >= limit)
    return {"name": name, "value": value, "limit": limit, "op": "<=" if at_most else ">=",
            "met": met, "note": note}


def verdict(t: dict) -> str:
    return "n/a" if t["met"] is None else ("met" if t["met"] else "MISSED")


def print_targets(tgts: list[dict]) -> None:
    for t in tgts:
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        note = f" ({t['note']})" if t["note"] else ""
        print(f"target {t['name']}: {value} {t['op']} {t['limit']} -> {verdict(t)}{note}")


# --- results ----------------------------------------------------------------------------------

def machine() -> dict:
    """The machine a result was measured on: cores, RAM, kernel, CPU, load, disk, versions."""
    info = {"cores": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                info["ram_gib"] = round(int(line.split()[1]) / 2**20, 1)
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    info["disk"] = disk_info(SCRATCH if SCRATCH.exists() else ROOT)
    for mod in ("torch", "numpy"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return info


def disk_info(path: Path) -> dict:
    """The filesystem and block device under `path`: fstype, source, model, scheduler, rotational."""
    real = os.path.realpath(path)
    best = ("", "", "")
    with open("/proc/self/mounts") as f:
        for line in f:
            src, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                best = (src, mnt, fstype)
    info = {"path": str(path), "source": best[0], "fstype": best[2]}
    name = Path(best[0]).name
    q = Path(f"/sys/block/{name}")
    if q.exists():
        for key, rel in (("model", "device/model"), ("scheduler", "queue/scheduler"),
                         ("rotational", "queue/rotational"), ("size_gib", "size")):
            try:
                val = (q / rel).read_text().strip()
            except OSError:
                continue
            if key == "scheduler" and "[" in val:  # "none [mq-deadline] kyber": the one in use
                val = val[val.index("[") + 1:val.index("]")]
            info[key] = round(int(val) * 512 / GiB, 1) if key == "size_gib" else val
    return info


def human_rate(bps: float) -> str:
    return f"{bps / 1e9:.2f} GB/s" if bps >= 1e9 else f"{bps / 1e6:.0f} MB/s"


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def write_results(name: str, data: dict) -> Path:
    out = RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(out)
    return out


def finish(name: str, data: dict, ratios: dict | None = None) -> int:
    """A case's last step: write its results, print its ratios, targets and checks; exit status 0."""
    out = write_results(name, data)
    for k, v in (ratios or {}).items():
        print(f"  {k}: {v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})")
    print_targets(data.get("targets", []) + data.get("checks", []))
    print(f"results: {out}")
    return 0


def read_results(name: str) -> dict | None:
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


# --- revisions side by side (budget.py --revs, probes/revisions.py) ------------------------------

def worktree(rev: str, where: Path) -> Path:
    """The tree to run `rev` from: this checkout for `.`, else a fresh worktree of it."""
    if rev == ".":
        return ROOT
    path = where / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], capture_output=True)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(path), rev],
                   check=True, capture_output=True)
    return path


@contextlib.contextmanager
def revision(tree: Path):
    """The daemon (`python -m ckptfs`) runs the code of `tree` meanwhile."""
    cwd, pythonpath = os.getcwd(), os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tree)
    os.chdir(tree)  # `python -m` puts its working directory first on sys.path
    try:
        yield
    finally:
        os.chdir(cwd)
        if pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = pythonpath


def remove_worktrees(trees: dict) -> None:
    """Remove the worktrees `worktree` made (not this checkout)."""
    for tree in trees.values():
        if tree != ROOT:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
