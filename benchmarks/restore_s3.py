"""Restore from an object store: time to the first torch.load and to all-local, vs a plain boto3 download.

A real S3 server (SeaweedFS `weed mini` on 127.0.0.1, as in the tests) holds
a published tree (tests/s3seed.py): one random state dict saved with
torch.save (512 MiB by default) and a second file as large, twice: in the
replicator's layout (4 MiB segments, manifest format 2; `--layout whole`:
one object per file, format 1), which ckptfs restores, and as whole files,
which boto3 downloads.
Each round, in rotated order:

  ckptfs  `mount --format --restore-from s3://...` on two fresh file devices,
          then torch.load of the checkpoint at once: the time from the mount
          command to the loaded state dict is "first load"; then the time
          until `ckptfs status` says the restore is done (every byte local
          and durable) is "all local". Unmount.
  boto3   download_file (s3transfer: multipart, threads) of every object to
          the same disk, fsync: "all local"; then torch.load of the
          checkpoint: download + load is "first load".

Each round also times a plain `mount --format` + `umount` of the same
devices ("mount only"): the part of ckptfs's times that any mount pays
(process start, format, pre-faulting the arena), whatever it restores.
Ratios are taken round by round, ckptfs over boto3 (below 1: ckptfs is
faster). What ckptfs gains on "first load" is not waiting for the rest of
the tree; what it must not lose on "all local" is throughput.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import (ROOT, GiB, case_args, file_devices, finish, fsync_path, machine, mounted, now, pairwise,
                    parse_size, random_state_dict, rotated, stats, target)

sys.path.insert(0, str(ROOT / "tests"))
from s3seed import publish  # noqa: E402
from s3server import S3Server  # noqa: E402

from ckptfs.replicate.segments import segment_size  # noqa: E402


def restore_status(mp: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "ckptfs", "status", str(mp), "--json"], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out).get("restore") or {}


def via_ckptfs(mp: Path, devices: list, memory: str, url: str, endpoint: str, expect: dict | None) -> tuple:
    t0 = time.perf_counter()
    with mounted(mp, devices, memory, extra=("--restore-from", url, "--s3-endpoint", endpoint)):
        sd = torch.load(mp / "ckpt.pt", map_location="cpu", weights_only=True)
        first = time.perf_counter() - t0
        check(sd, expect)
        while restore_status(mp).get("state") != "done":
            time.sleep(0.05)
        local = time.perf_counter() - t0
    return first, local


def via_boto3(client, bucket: str, manifest, dest: Path, expect: dict | None) -> tuple:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    t0 = time.perf_counter()
    for e in manifest.entries:
        if e.object:
            path = dest / e.path
            path.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, "whole/" + e.object, str(path))
            fsync_path(path)
    local = time.perf_counter() - t0
    sd = torch.load(dest / "ckpt.pt", map_location="cpu", weights_only=True)
    first = time.perf_counter() - t0
    check(sd, expect)
    return first, local


def check(sd: dict, expect: dict | None) -> None:
    if expect is not None and (set(sd) != set(expect) or any(not torch.equal(sd[k], expect[k]) for k in expect)):
        raise SystemExit("restore_s3: the restored checkpoint differs from what was saved")


def main(argv: list[str] | None = None) -> int:
    args = case_args(__doc__, argv, size="512M", memory="2G", scratch="restore_s3",  # --size: each of 2 files
                     extra=lambda ap: ap.add_argument("--layout", choices=("segments", "whole"), default="segments"))
    seg = segment_size(1 << 20) if args.layout == "segments" else 0
    size = parse_size(args.size)
    scratch = args.scratch.resolve()
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    srv = S3Server(scratch / "s3")
    srv.start()
    os.environ.update(srv.env())
    res: dict[str, list[float]] = {k: [] for k in ("ckptfs_first", "ckptfs_local", "boto3_first", "boto3_local",
                                                   "mount_only")}
    t_start = time.perf_counter()
    try:
        client = srv.client()
        tree = scratch / "tree"
        tree.mkdir()
        sd = random_state_dict(size, seed=5)
        torch.save(sd, tree / "ckpt.pt")
        (tree / "other.bin").write_bytes(os.urandom(size))
        publish(client, "bench", "tree", tree, segment_size=seg)  # what ckptfs restores
        manifest = publish(client, "bench", "whole", tree)  # what boto3 downloads
        nbytes = sum(e.size for e in manifest.entries if e.object)
        shutil.rmtree(tree)
        devices = file_devices(scratch / "devices", 2, nbytes + GiB)
        for rnd in range(args.repeats):
            expect = sd if rnd == 0 else None
            for system in rotated(["ckptfs", "boto3"], rnd):
                if system == "ckptfs":
                    t0 = time.perf_counter()
                    with mounted(scratch / "mnt", devices, args.memory):
                        res["mount_only"].append(time.perf_counter() - t0)
                    first, local = via_ckptfs(scratch / "mnt", devices, args.memory, "s3://bench/tree",
                                              srv.endpoint, expect)
                else:
                    first, local = via_boto3(client, "bench", manifest, scratch / "ext4", expect)
                res[f"{system}_first"].append(first)
                res[f"{system}_local"].append(local)
                print(f"round {rnd + 1} {system:6s} first torch.load {first:.2f} s, all local {local:.2f} s",
                      flush=True)
    finally:
        srv.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    rows = {s: {"first_load_s": stats(res[f"{s}_first"]), "all_local_s": stats(res[f"{s}_local"]),
                "all_local_gbps": stats([nbytes / t / 1e9 for t in res[f"{s}_local"]])} for s in ("ckptfs", "boto3")}
    rows["ckptfs"]["mount_only_s"] = stats(res["mount_only"])
    ratios = {"first_load_ckptfs_over_boto3": pairwise(res["ckptfs_first"], res["boto3_first"]),
              "all_local_ckptfs_over_boto3": pairwise(res["ckptfs_local"], res["boto3_local"])}
    tgts = [target("restore: time to the first torch.load, ckptfs / boto3 download + load",
                   ratios["first_load_ckptfs_over_boto3"]["median"], 1.0),
            target("restore: time to all-local, ckptfs / boto3 download_file",
                   ratios["all_local_ckptfs_over_boto3"]["median"], 1.1)]
    data = {"benchmark": "restore_s3", "when": now(), "seconds": time.perf_counter() - t_start,
            "machine": machine(),
            "config": {"size": args.size, "bytes": nbytes, "files": 2, "repeats": args.repeats,
                       "memory": args.memory, "server": "SeaweedFS weed mini on 127.0.0.1",
                       "layout": args.layout,
                       "ckptfs_devices": "2 sparse files on the root disk", "boto3": "download_file + fsync"},
            "rows": rows, "ratios": ratios, "targets": tgts}
    print(f"  a plain mount --format costs {rows['ckptfs']['mount_only_s']['median']:.2f} s of ckptfs's times")
    return finish("restore_s3", data, ratios)


if __name__ == "__main__":
    sys.exit(main())
