"""Replication to an object store: ckptfs --replicate against boto3 upload_file, same files, same server.

A real S3 server (SeaweedFS `weed mini`, tests/s3server.py) runs on this
machine for the whole run. `--files` files of random bytes (`--size` in all)
are saved once into a ckptfs pool (no replication), and kept as plain files
in the scratch folder too. Then, `--repeats` rounds, each in turn:

  ckptfs   remount the pool with `--replicate s3://bench/ckptfs-N` (a fresh
           prefix; the daemon starts replicating as it mounts, a few ms before
           the mount command returns): from its return until `wait --replicated` of the
           mountpoint (the newest manifest stands) = replication time: reading
           the devices (O_DIRECT, CRC-checked), multipart uploads, the manifest;
  boto3    `upload_file` of the same files (s3transfer's defaults: 8 MiB parts,
           10 threads), one after another, to a fresh prefix (from the page cache).

Throughput = bytes / time; the ratio ckptfs / boto3 is taken round by round
(target >= 0.9). CPU seconds per GiB: ckptfs's (its daemon's plus its uploader
process's, which makes the object-store calls; each also apart) and this
process's (boto3's threads), not counting the server's.

Then latency from a save's close to replicated: with replication on, a file of
`--latency-size` is written and closed, and `ckptfs.wait_replicated` returns
(close -> durable -> in a standing manifest), `--repeats` times, and the same
for a 1 MiB file.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from common import (GiB, MiB, ROOT, SCRATCH, children_cpu_seconds, file_devices, finish, machine, mounted, now,
                    pairwise, parse_size, proc_cpu_seconds, stats, sync_mount, target)

sys.path.insert(0, str(ROOT / "tests"))
from s3server import S3Server  # noqa: E402

BUCKET = "bench"


def write_files(d: Path, nfiles: int, each: int) -> list[Path]:
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    block = os.urandom(64 * MiB)
    for i in range(nfiles):
        p = d / f"shard-{i}.bin"
        with open(p, "wb") as f:
            left = each
            while left:
                n = min(left, len(block))
                f.write(block[:n] if i % 2 == 0 else block[-n:])  # distinct files, random bytes
                left -= n
        paths.append(p)
    return paths


def ckptfs_round(mnt: Path, devices: list, memory: str, srv: S3Server, prefix: str, log: Path) -> dict:
    from ckptfs.ops.api import wait_replicated

    extra = ("--replicate", f"s3://{BUCKET}/{prefix}", "--s3-endpoint", srv.endpoint)
    with mounted(mnt, devices, memory, fmt=False, log_file=log, extra=extra) as pid:
        t0 = time.perf_counter()  # the daemon began replicating a few milliseconds earlier
        c0, u0 = proc_cpu_seconds(pid), children_cpu_seconds(pid)
        wait_replicated(mnt)
        seconds = time.perf_counter() - t0
        cpu, ucpu = proc_cpu_seconds(pid) - c0, children_cpu_seconds(pid) - u0
    return {"seconds": seconds, "cpu_s": cpu + ucpu, "daemon_cpu_s": cpu, "uploader_cpu_s": ucpu}


def boto3_round(paths: list[Path], srv: S3Server, prefix: str) -> dict:
    client = srv.client()
    t0, c0 = time.perf_counter(), time.process_time()
    for p in paths:
        client.upload_file(str(p), BUCKET, f"{prefix}/{p.name}")
    return {"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def latency(mnt: Path, size: int, repeats: int) -> list[float]:
    from ckptfs.ops.api import wait_replicated

    out = []
    for i in range(repeats):
        data = os.urandom(size)
        p = mnt / f"latency-{size}-{i}.bin"
        with open(p, "wb") as f:
            f.write(data)
        t0 = time.perf_counter()  # closed
        wait_replicated(p)
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1G", help="bytes in all")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--latency-size", default="256M")
    ap.add_argument("--memory", default="2G")
    ap.add_argument("--scratch", type=Path, default=SCRATCH / "replicate")
    args = ap.parse_args(argv)
    total = parse_size(args.size)
    each = total // args.files
    scratch = args.scratch.resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(scratch / "s3", ignore_errors=True)  # a fresh server: no objects of earlier runs
    srv = S3Server(scratch / "s3")
    srv.start()
    os.environ.update(srv.env())
    t_start = time.perf_counter()
    try:
        srv.client().create_bucket(Bucket=BUCKET)
        plain = write_files(scratch / "plain", args.files, each)
        boto3_round(plain[:1], srv, "warm-up")  # the server grows its first volumes: not measured
        devices = file_devices(scratch / "devices", 2, total + 2 * GiB)
        mnt = scratch / "mnt"
        with mounted(mnt, devices, args.memory, log_file=scratch / "daemon.log"):
            for p in plain:
                (mnt / p.name).write_bytes(p.read_bytes())
            sync_mount(mnt)
        runs: dict[str, list[dict]] = {"ckptfs": [], "boto3": []}
        for rnd in range(args.repeats):
            order = ["ckptfs", "boto3"] if rnd % 2 == 0 else ["boto3", "ckptfs"]
            for who in order:
                prefix = f"{who}-{rnd}"
                r = (ckptfs_round(mnt, devices, args.memory, srv, prefix, scratch / "daemon.log") if who == "ckptfs"
                     else boto3_round(plain, srv, prefix))
                r["bps"] = each * args.files / r["seconds"]
                runs[who].append(r)
                split = (f" (daemon {r['daemon_cpu_s'] / (each * args.files / GiB):.2f}, uploader "
                         f"{r['uploader_cpu_s'] / (each * args.files / GiB):.2f})" if who == "ckptfs" else "")
                print(f"round {rnd + 1} {who:6s}: {r['bps'] / 1e6:.0f} MB/s ({r['seconds']:.2f} s), "
                      f"{r['cpu_s'] / (each * args.files / GiB):.2f} CPU s/GiB{split}", flush=True)
        lat_size = parse_size(args.latency_size)
        extra = ("--replicate", f"s3://{BUCKET}/latency", "--s3-endpoint", srv.endpoint)
        with mounted(mnt, devices, args.memory, fmt=False, log_file=scratch / "daemon.log", extra=extra):
            from ckptfs.ops.api import wait_replicated
            wait_replicated(mnt)
            lat_big = latency(mnt, lat_size, args.repeats)
            lat_small = latency(mnt, MiB, args.repeats)
        print(f"close -> replicated: {lat_size >> 20} MiB {stats(lat_big)['median']:.2f} s, "
              f"1 MiB {stats(lat_small)['median']:.3f} s")
    finally:
        srv.stop()

    gib = each * args.files / GiB
    ratio = pairwise([r["bps"] for r in runs["ckptfs"]], [r["bps"] for r in runs["boto3"]])
    rows = {who: {"bps": stats([r["bps"] for r in rs]), "seconds": stats([r["seconds"] for r in rs]),
                  "cpu_s_per_gib": stats([r["cpu_s"] / gib for r in rs])} for who, rs in runs.items()}
    for part in ("daemon", "uploader"):  # where ckptfs's CPU goes
        rows["ckptfs"][f"{part}_cpu_s_per_gib"] = stats([r[f"{part}_cpu_s"] / gib for r in runs["ckptfs"]])
    data = {
        "benchmark": "replicate", "when": now(), "seconds": time.perf_counter() - t_start, "machine": machine(),
        "config": {"size": args.size, "files": args.files, "repeats": args.repeats, "memory": args.memory,
                   "server": "SeaweedFS weed mini on 127.0.0.1 (same machine)",
                   "ckptfs": "defaults: 8 MiB parts, 10 connections, --replicate-memory 256M, 2 file devices",
                   "boto3": "upload_file with s3transfer's defaults (8 MiB parts, 10 threads)"},
        "rows": rows, "ratio_ckptfs_over_boto3": ratio,
        "close_to_replicated_s": {f"{lat_size >> 20}MiB": stats(lat_big), "1MiB": stats(lat_small)},
        "targets": [target("replication throughput / boto3 upload_file", ratio["median"], 0.9, at_most=False)],
    }
    for who, r in rows.items():
        print(f"  {who:6s}: {r['bps']['median'] / 1e6:.0f} MB/s, {r['cpu_s_per_gib']['median']:.2f} CPU s/GiB")
    return finish("replicate", data, {"ckptfs / boto3 throughput": ratio})


if __name__ == "__main__":
    sys.exit(main())
