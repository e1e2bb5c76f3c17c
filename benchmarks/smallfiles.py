"""Case 6, small files and metadata: what frameworks' save paths cost on ckptfs vs ext4.

Small checkpoints pay a FUSE round trip per operation. Each system (ext4 in
the scratch folder on the root disk; one ckptfs mount per engine, two file
devices each) runs the same file operations, reproduced without installing
any framework, in rotated order, `--repeats` rounds; medians per operation:

  meta          chmod, utime and os.stat of a file just written and closed
                (`--files` files, each timed alone, in microseconds);
  new-file      write + close of a new 1.6 MB file;
  copystat      shutil.copystat from one such file to another;
  lightning     Lightning's save path for a 1.63 MB checkpoint: mkstemp in
                /tmp, write, then shutil.move into the directory (a copy
                across filesystems: copyfile + copystat, then unlink);
  hf-trainer    Hugging Face Trainer's _save_checkpoint: mkdir checkpoint-N,
                8 files totalling 6.45 MB (model.safetensors, optimizer.pt,
                scheduler.pt, rng_state.pth, training_args.bin and three JSON
                files), the oldest checkpoint-N removed beyond 2 kept;
  safetensors   safetensors.numpy save_file + load_file of a 6.3 MB dict.

Targets (issue 12): meta medians <= 60 us on ckptfs; lightning and hf-trainer
<= 1.5 x ext4; safetensors <= 2 x ext4 (ratios round by round).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import SCRATCH, GiB, file_devices, finish, machine, mounted, now, pairwise, rotated, stats, target

EXT4 = "ext4"
NEW_FILE = 1_600_000
LIGHTNING = 1_630_000
HF_FILES = {"model.safetensors": 2_150_000, "optimizer.pt": 4_290_000, "scheduler.pt": 1_064,
            "rng_state.pth": 14_244, "training_args.bin": 5_176, "config.json": 700,
            "generation_config.json": 150, "trainer_state.json": 2_000}


def _write(path: Path, payload: bytes) -> None:
    with open(path, "wb") as f:
        f.write(payload)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def meta(d: Path, files: int) -> dict[str, float]:
    """Median seconds of chmod, utime and stat, each of a file just written and closed."""
    out = {"chmod": [], "utime": [], "stat": []}
    payload = os.urandom(4096)
    for i in range(files):
        p = d / f"m{i}"
        _write(p, payload)
        out["chmod"].append(_timed(lambda: os.chmod(p, 0o640)))
        out["utime"].append(_timed(lambda: os.utime(p, (1, 1))))
        out["stat"].append(_timed(lambda: os.stat(p)))
    return {k: statistics.median(v) for k, v in out.items()}


def new_file(d: Path, n: int) -> float:
    payload = os.urandom(NEW_FILE)
    return statistics.median(_timed(lambda: _write(d / f"n{i}", payload)) for i in range(n))


def copystat(d: Path, n: int) -> float:
    payload = os.urandom(NEW_FILE)
    for i in range(n):
        _write(d / f"n{i}", payload)
    return statistics.median(_timed(lambda: shutil.copystat(d / f"n{i}", d / f"n{i + 1}")) for i in range(n - 1))


def lightning(d: Path, n: int) -> float:
    payload = os.urandom(LIGHTNING)

    def save(i: int) -> None:
        fd, tmp = tempfile.mkstemp(dir="/tmp", suffix=".ckpt")
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        shutil.move(tmp, d / f"epoch={i}.ckpt")
    return statistics.median(_timed(lambda: save(i)) for i in range(n))


def hf_trainer(d: Path, n: int) -> float:
    payloads = {name: os.urandom(size) for name, size in HF_FILES.items()}

    def save(step: int) -> None:
        ck = d / f"checkpoint-{step}"
        ck.mkdir()
        for name, payload in payloads.items():
            _write(ck / name, payload)
        if step >= 3:
            shutil.rmtree(d / f"checkpoint-{step - 2}")
    return statistics.median(_timed(lambda: save(i + 1)) for i in range(n))


def safetensors_round_trip(d: Path, n: int) -> float:
    from safetensors.numpy import load_file, save_file
    rng = np.random.default_rng(0)
    tensors = {f"layer{i}.weight": rng.random((256, 768), dtype=np.float32) for i in range(8)}

    def trip(i: int) -> None:
        save_file(tensors, str(d / f"model{i}.safetensors"))
        back = load_file(str(d / f"model{i}.safetensors"))
        if not all(np.array_equal(back[k], v) for k, v in tensors.items()):
            raise SystemExit("smallfiles: safetensors did not load back what was saved")
    return statistics.median(_timed(lambda: trip(i)) for i in range(n))


CASES = {"new-file": new_file, "copystat": copystat, "lightning": lightning, "hf-trainer": hf_trainer,
         "safetensors": safetensors_round_trip}


def one_round(d: Path, files: int, n: int) -> dict[str, float]:
    out = {}
    for name, fn in {"meta": None, **CASES}.items():
        sub = d / name
        sub.mkdir()
        if name == "meta":
            out.update(meta(sub, files))
        else:
            out[name] = fn(sub, n)
        shutil.rmtree(sub)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="pyfuse3,native")
    ap.add_argument("--files", type=int, default=200, help="files for chmod/utime/stat")
    ap.add_argument("--n", type=int, default=20, help="saves per framework case and round")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory", default="1G")
    ap.add_argument("--scratch", type=Path, default=SCRATCH / "smallfiles")
    args = ap.parse_args(argv)
    scratch = args.scratch.resolve()
    shutil.rmtree(scratch, ignore_errors=True)
    engines = args.engines.split(",")
    systems = [EXT4] + [f"ckptfs-{e}" for e in engines]
    res: dict[str, dict[str, list[float]]] = {s: {} for s in systems}
    t_start = time.perf_counter()
    devices = {e: file_devices(scratch / f"devices-{e}", 2, 2 * GiB) for e in engines}
    dirs = {EXT4: scratch / "ext4", **{f"ckptfs-{e}": scratch / f"mnt-{e}" for e in engines}}
    dirs[EXT4].mkdir(parents=True)
    try:
        with contextlib.ExitStack() as stack:
            for e in engines:
                stack.enter_context(mounted(dirs[f"ckptfs-{e}"], devices[e], args.memory, extra=("--engine", e),
                                            log_file=scratch / f"daemon-{e}.log"))
            for rnd in range(args.repeats):
                for s in rotated(systems, rnd):
                    work = dirs[s] / f"round{rnd}"
                    work.mkdir()
                    for k, v in one_round(work, args.files, args.n).items():
                        res[s].setdefault(k, []).append(v)
                    shutil.rmtree(work)
                    print(f"round {rnd + 1} {s:15s} " + ", ".join(
                        f"{k} {v[-1] * 1e6:.0f} us" for k, v in res[s].items()), flush=True)
    finally:
        for devs in devices.values():
            for d in devs:
                d.unlink(missing_ok=True)
    ops = list(res[EXT4])
    rows = {s: {k: stats(v) for k, v in res[s].items()} for s in systems}
    ratios, tgts = {}, []
    for s in systems[1:]:
        for k in ops:
            ratios[f"{k}: {s} / ext4"] = pairwise(res[s][k], res[EXT4][k])
        for k in ("chmod", "utime", "stat"):
            tgts.append(target(f"smallfiles: {s} median {k} (us)", rows[s][k]["median"] * 1e6, 60))
        for k, limit in (("lightning", 1.5), ("hf-trainer", 1.5), ("safetensors", 2.0)):
            tgts.append(target(f"smallfiles: {k}, {s} / ext4", ratios[f"{k}: {s} / ext4"]["median"], limit))
    data = {"benchmark": "smallfiles", "when": now(), "seconds": time.perf_counter() - t_start,
            "machine": machine(),
            "config": {"engines": engines, "files": args.files, "n": args.n, "repeats": args.repeats,
                       "memory": args.memory, "hf_files": HF_FILES, "new_file": NEW_FILE, "lightning": LIGHTNING},
            "ops": ops, "systems": systems, "rows": rows, "ratios": ratios, "targets": tgts}
    print(json.dumps({s: {k: round(v["median"] * 1e6) for k, v in r.items()} for s, r in rows.items()}))
    return finish("smallfiles", data, ratios)


if __name__ == "__main__":
    sys.exit(main())
