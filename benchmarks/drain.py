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

from common import ROOT, ckptfs, human_rate, machine, parse_size, write_results

QUEUE_DEPTH = 8
DATA_OFFSET = 128 << 20  # where rawwrite starts: past ckptfs's superblock and journal


class Devices:
    """N device files; as throttled loop devices in a blkio cgroup when asked."""

    def __init__(self, scratch: Path, n: int, size: int, throttle: int):
        self.files = []
        for i in range(n):
            p = scratch / f"dev{i}.img"
            with open(p, "wb") as f:
                f.truncate(size)
            self.files.append(p)
        self.loops: list[str] = []
        self.cgroup = None
        if throttle:
            for p in self.files:
                self.loops.append(subprocess.run(["losetup", "-f", "--show", "--direct-io=on", str(p)],
                                                 check=True, capture_output=True, text=True).stdout.strip())
            self.cgroup = Path("/sys/fs/cgroup/blkio/ckptfs-bench")
            self.cgroup.mkdir(exist_ok=True)
            for loop in self.loops:
                rdev = os.stat(loop).st_rdev
                (self.cgroup / "blkio.throttle.write_bps_device").write_text(
                    f"{os.major(rdev)}:{os.minor(rdev)} {throttle}")

    @property
    def paths(self) -> list[str]:
        return self.loops or [str(p) for p in self.files]

    def confine(self, pid: int) -> None:
        if self.cgroup is not None:
            (self.cgroup / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        for loop in self.loops:
            subprocess.run(["losetup", "-d", loop], capture_output=True)
        for p in self.files:
            p.unlink(missing_ok=True)


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
    mp = scratch / "mnt"
    mp.mkdir(exist_ok=True)
    ckptfs("mount", str(mp), "--devices", ",".join(devs.paths), "--memory", memory, "--format", "--force",
           "--queue-depth", str(QUEUE_DEPTH), "--drain", policy, "--log-file", str(scratch / "daemon.log"))
    try:
        devs.confine(int(os.getxattr(mp, "user.ckptfs.pid")))
        res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "durable_save.py"),
                              str(mp / "ckpt.bin"), payload, str(total)],
                             capture_output=True, text=True, check=True)
        return json.loads(res.stdout)
    finally:
        ckptfs("umount", str(mp))


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
        dev_size = DATA_OFFSET + total // n + (256 << 20)
        devs = Devices(scratch, n, dev_size, throttle)
        try:
            for payload in args.payload.split(","):
                raw, ck, blocked = [], [], []
                for _ in range(args.repeats):
                    raw.append(run_raw(devs, total))
                    r = run_ckptfs(devs, scratch, total, payload, args.memory, args.drain)
                    ck.append(r["durable"])
                    blocked.append(r["blocked"])
                    size = r["bytes"]
                raw_bw = total / statistics.median(raw)
                ck_bw = size / statistics.median(ck)
                rows.append({"devices": n, "payload": payload, "bytes": size,
                             "raw_s": raw, "ckptfs_durable_s": ck, "ckptfs_blocked_s": blocked,
                             "raw_bw": raw_bw, "ckptfs_bw": ck_bw, "ratio": ck_bw / raw_bw})
                print(f"{n} device(s) {payload:5s}: raw {human_rate(raw_bw)}, ckptfs durable "
                      f"{human_rate(ck_bw)} (blocked {statistics.median(blocked):.2f}s) -> ratio "
                      f"{ck_bw / raw_bw:.2f}", flush=True)
        finally:
            devs.close()
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
