"""What the local S3 server and a boto3 client cost in CPU per GiB stored, by client setting.

The replication benchmarks run SeaweedFS (tests/s3server.py) on the machine they
measure, standing in for a remote object store. This measures its price apart:
`--size` bytes uploaded as one multipart upload (8 MiB parts, `--threads`
`upload_part` calls at once, random payload) per client configuration, rotated
for `--repeats` rounds, printing the CPU seconds per GiB of this process (the
client: SigV4 hashing, checksums, http) and of the server.

Configurations: `ckptfs` (what ckptfs's uploader uses: checksums only when
required, the payload signed, as botocore always does over http), `default`
(boto3's defaults: a CRC32 of each part as well), `unsigned+crc32` and
`unsigned` (`payload_signing_enabled` off: no SHA-256 of the payload).

    python benchmarks/probes/s3cost.py [--size 512M] [--repeats 2]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py and the cases
from common import ROOT, proc_cpu_seconds  # noqa: E402

from ckptfs.sizes import parse_size

PART = 8 << 20
WHEN_REQUIRED = {"request_checksum_calculation": "when_required", "response_checksum_validation": "when_required"}
CONFIGS = {"ckptfs": WHEN_REQUIRED, "default": {},
           "unsigned+crc32": {"s3": {"payload_signing_enabled": False}},
           "unsigned": {"s3": {"payload_signing_enabled": False}, **WHEN_REQUIRED}}


def upload(client, bucket: str, parts: int, payload: bytes, threads: int) -> None:
    up = client.create_multipart_upload(Bucket=bucket, Key="k")["UploadId"]
    with ThreadPoolExecutor(threads) as ex:
        etags = list(ex.map(lambda i: client.upload_part(Bucket=bucket, Key="k", UploadId=up, PartNumber=i + 1,
                                                         Body=payload)["ETag"], range(parts)))
    client.complete_multipart_upload(Bucket=bucket, Key="k", UploadId=up, MultipartUpload={
        "Parts": [{"ETag": e, "PartNumber": i + 1} for i, e in enumerate(etags)]})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="512M")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=10)
    args = ap.parse_args(argv)
    import boto3
    from botocore.config import Config
    sys.path.insert(0, str(ROOT / "tests"))
    from s3server import S3Server
    parts = max(1, parse_size(args.size, what="--size") // PART)
    gib = parts * PART / 2**30
    payload = os.urandom(PART)
    root = Path(tempfile.mkdtemp(prefix="s3cost-"))
    srv = S3Server(root)
    srv.start()
    try:
        for rnd in range(args.repeats):
            names = list(CONFIGS)
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                client = boto3.client("s3", endpoint_url=srv.endpoint, **srv_credentials(srv),
                                      config=Config(max_pool_connections=args.threads, **CONFIGS[name]))
                bucket = f"cost-{rnd}-{name.replace('+', '-')}"
                client.create_bucket(Bucket=bucket)
                s0, c0, t0 = proc_cpu_seconds(srv.proc.pid), time.process_time(), time.perf_counter()
                upload(client, bucket, parts, payload, args.threads)
                s1, c1, t1 = proc_cpu_seconds(srv.proc.pid), time.process_time(), time.perf_counter()
                print(f"round {rnd + 1} {name:15s} {gib * 1024:.0f} MiB in {t1 - t0:.2f} s: client "
                      f"{(c1 - c0) / gib:.2f} CPU s/GiB, S3 server {(s1 - s0) / gib:.2f} CPU s/GiB", flush=True)
    finally:
        srv.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


def srv_credentials(srv) -> dict:
    env = srv.env()
    return {"aws_access_key_id": env["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
            "region_name": env["AWS_DEFAULT_REGION"]}


if __name__ == "__main__":
    sys.exit(main())
