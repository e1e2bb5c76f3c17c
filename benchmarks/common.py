"""Shared pieces of the benchmarks: running the CLI, machine facts, results files."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ckptfs.sizes import parse_size  # noqa: E402,F401 - re-exported for the benchmarks


def ckptfs(*args: str) -> None:
    res = subprocess.run([sys.executable, "-m", "ckptfs", *args], capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"ckptfs {args[0]} failed ({res.returncode}): {res.stderr.strip()}")


def machine() -> dict:
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
    return info


def human_rate(bps: float) -> str:
    return f"{bps / 1e9:.2f} GB/s" if bps >= 1e9 else f"{bps / 1e6:.0f} MB/s"


def write_results(name: str, data: dict) -> Path:
    out = ROOT / "benchmarks" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    return out
