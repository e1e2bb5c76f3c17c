"""Drain benchmark: how soon is a checkpoint durable, next to the raw devices?

For 1, 2 and 4 devices (files on this machine's disk, or loop devices
throttled with cgroup blkio to emulate an array of slower NVMe drives), in
one run, interleaved:

  raw     benchmarks/rawwrite.py writes the same number of bytes straight to
          the same device files with O_DIRECT (1 MiB blocks, the same queue
          depth per device), then flushes: the best the devices can do;
  ckptfs  benchmarks/durable_save.py saves into a fresh ckptfs mount over
          those devices and fsyncs: time to durable.

Durable bandwidth = bytes / time-to-durable; the figure of merit is
ckptfs / raw (target >= 0.85). Payload `bytes` (64 MiB write() calls)
measures the drain itself; `torch` (torch.save of a state dict) adds
torch.save's own serialisation, which bounds it on fast disks.

usage: python benchmarks/drain.py [--devices 1,2,4] [--size 1G] [--throttle 200M] [--payload bytes,torch]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import (ROOT, file_devices, human_rate, machine, mounted, pairwise, parse_size, proc_cpu_seconds,
                    write_results)

QUEUE_DEPTH = 8
DATA_OFFSET = 128 << 20  # where rawwrite starts: past ckptfs's superblock and journal
BLKIO = Path("/sys/fs/cgroup/blkio")


class Devices:
    """N device files; as loop devices when asked (loop=True), throttled in a blkio cgroup when
    throttle > 0 (which implies loop devices). close() detaches the loop devices, removes the
    cgroup and the files: call it in a finally block."""

    def __init__(self, scratch: Path, n: int, size: int, throttle: int = 0, loop: bool = False):
        self.files = file_devices(scratch, n, size)
        self.loops: list[str] = []
        self.cgroup: Path | None = None
        self.throttle = throttle
        try:
            if throttle or loop:
                for p in self.files:
                    self.loops.append(subprocess.run(["losetup", "-f", "--show", "--direct-io=on", str(p)],
                                                     check=True, capture_output=True, text=True).stdout.strip())
            if throttle:
                self.cgroup = BLKIO / f"ckptfs-bench-{os.getpid()}"
                self.cgroup.mkdir(exist_ok=True)
                self.limit(throttle)
        except BaseException:
            self.close()
            raise

    @property
    def paths(self) -> list[str]:
        return self.loops or [str(p) for p in self.files]

    def limit(self, bps: int) -> None:
        """Set every device's write limit to `bps` (0: none); only with a throttle at creation."""
        for loop_dev in self.loops:
            rdev = os.stat(loop_dev).st_rdev
            (self.cgroup / "blkio.throttle.write_bps_device").write_text(f"{os.major(rdev)}:{os.minor(rdev)} {bps}")

    def confine(self, pid: int) -> None:
        if self.cgroup is not None:
            (self.cgroup / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        for loop_dev in self.loops:
            subprocess.run(["losetup", "-d", loop_dev], capture_output=True)
        self.loops = []
        if self.cgroup is not None:
            self._remove_cgroup()
            self.cgroup = None
        for p in self.files:
            p.unlink(missing_ok=True)

    def _remove_cgroup(self) -> None:
        """Move whatever is still inside to the root group and remove the group; a process that
        just exited stays listed until it is reaped, so retry for a few seconds."""
        for _ in range(50):
            if not self.cgroup.exists():
                return
            for pid in (self.cgroup / "cgroup.procs").read_text().split():
                try:
                    (BLKIO / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            try:
                self.cgroup.rmdir()
                return
            except OSError as e:
                err = e
            time.sleep(0.1)
        print(f"could not remove {self.cgroup}: {err}", file=sys.stderr)


def run_raw(devs: Devices, total: int) -> float:
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "rawwrite.py"), str(total),
                             str(1 << 20), str(QUEUE_DEPTH), str(DATA_OFFSET), *devs.paths],
                            stdout=subprocess.PIPE, text=True)
    devs.confine(proc.pid)
    out, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit("raw writer failed")
    return float(out)


def run_ckptfs(devs: Devices, scratch: Path, total: int, payload: str, memory: str, policy: str) -> dict:
    """durable_save.py into a fresh mount over `devs`: its JSON (blocked, durable, bytes) plus the
    daemon's CPU seconds over the save."""
    with mounted(scratch / "mnt", devs.paths, memory, log_file=scratch / "daemon.log",
                 extra=("--queue-depth", str(QUEUE_DEPTH), "--drain", policy)) as pid:
        devs.confine(pid)
        cpu0 = proc_cpu_seconds(pid)
        res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "durable_save.py"),
                              str(scratch / "mnt" / "ckpt.bin"), payload, str(total)],
                             capture_output=True, text=True, check=True)
        return json.loads(res.stdout) | {"daemon_cpu_s": proc_cpu_seconds(pid) - cpu0}


def measure(scratch: Path, n: int, total: int, throttle: int, payload: str, repeats: int, memory: str,
            policy: str) -> dict:
    """Raw O_DIRECT and ckptfs time-to-durable over n fresh devices, alternating, `repeats` times
    each; one row of the drain table."""
    devs = Devices(scratch, n, DATA_OFFSET + total // n + (256 << 20), throttle)
    try:
        raw, ck, blocked, cpu = [], [], [], []
        for _ in range(repeats):
            raw.append(run_raw(devs, total))
            r = run_ckptfs(devs, scratch, total, payload, memory, policy)
            ck.append(r["durable"])
            blocked.append(r["blocked"])
            cpu.append(r["daemon_cpu_s"])
            size = r["bytes"]
    finally:
        devs.close()
    raw_bw = total / statistics.median(raw)
    ck_bw = size / statistics.median(ck)
    print(f"{n} device(s) {payload:5s}: raw {human_rate(raw_bw)}, ckptfs durable "
          f"{human_rate(ck_bw)} (blocked {statistics.median(blocked):.2f}s) -> ratio "
          f"{ck_bw / raw_bw:.2f}", flush=True)
    return {"devices": n, "payload": payload, "bytes": size, "throttle_bps": throttle,
            "raw_s": raw, "ckptfs_durable_s": ck, "ckptfs_blocked_s": blocked,
            "raw_bw": raw_bw, "ckptfs_bw": ck_bw, "ratio": ck_bw / raw_bw,
            # run by run: ckptfs bandwidth over the raw bandwidth of the round before it
            "ratio_pairwise": pairwise([size / c for c in ck], [total / r for r in raw]),
            "daemon_cpu_s_per_gib": statistics.median(cpu) / (size / (1 << 30))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", default="1,2,4")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--throttle", default="0", help="per-device write limit, e.g. 200M (loop devices + blkio)")
    ap.add_argument("--payload", default="bytes,torch")
    ap.add_argument("--memory", default="3G")
    ap.add_argument("--drain", default="absorb-first", choices=["absorb-first", "eager"], help="ckptfs drain policy")
    ap.add_argument("--scratch", default=str(ROOT / "scratch" / "drain"))
    ap.add_argument("--name", default=None, help="results file name (default drain or drain-throttled)")
    args = ap.parse_args()
    total = parse_size(args.size)
    throttle = parse_size(args.throttle) if args.throttle not in ("0", "") else 0
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in [int(x) for x in args.devices.split(",")]:
        for payload in args.payload.split(","):
            rows.append(measure(scratch, n, total, throttle, payload, args.repeats, args.memory, args.drain))
    table = ["| devices | payload | raw O_DIRECT | ckptfs durable | ckptfs / raw | save blocked (s) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['devices']} | {r['payload']} | {human_rate(r['raw_bw'])} | "
                     f"{human_rate(r['ckptfs_bw'])} | {r['ratio']:.2f} | "
                     f"{statistics.median(r['ckptfs_blocked_s']):.2f} |")
    print("\n".join(table))
    name = args.name or ("drain-throttled" if throttle else "drain")
    write_results(name, {"machine": machine(), "throttle_bps": throttle, "size": total, "drain": args.drain,
                         "queue_depth": QUEUE_DEPTH, "rows": rows, "table": "\n".join(table)})


if __name__ == "__main__":
    main()
