"""What a user replicating checkpoints by hand would run: boto3 uploads in a background process.

The training benchmark's `boto3_s3` system saves into a plain (non-replicating)
ckptfs mount and writes each saved path on this process's stdin; this process
uploads the newest path it has not uploaded yet (older ones waiting are skipped,
as ckptfs skips superseded versions) with boto3's managed transfer: the file read
whole into memory first (a later save may replace it; the copy in memory is
what goes up), then `upload_fileobj` (multipart, parts in parallel threads).
A line `sync` is answered with `done N` once everything written before it is up
(N: bytes uploaded so far).

It runs at the CPU priority given (`idle` by default, as ckptfs's uploader
process does), so the comparison with `ckptfs --replicate` is between the same
S3 calls made by hand and made by ckptfs, on the same machine and server.

    python handmade_upload.py ENDPOINT BUCKET PREFIX [PRIORITY]   # AWS_* credentials from the environment
"""
from __future__ import annotations

import io
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ckptfs.replicate.priority import lower  # noqa: E402


def main(endpoint: str, bucket: str, prefix: str, priority: str = "idle") -> None:
    lower(priority)  # before boto3 starts any thread: they inherit it
    import boto3
    client = boto3.client("s3", endpoint_url=endpoint)
    cond = threading.Condition()
    state = {"newest": None, "syncs": 0, "eof": False}
    uploaded = 0

    def read_stdin() -> None:
        for line in sys.stdin:
            with cond:
                if line.strip() == "sync":
                    state["syncs"] += 1
                else:
                    state["newest"] = line.strip()
                cond.notify()
        with cond:
            state["eof"] = True
            cond.notify()

    threading.Thread(target=read_stdin, daemon=True).start()
    while True:
        with cond:
            while state["newest"] is None and not state["syncs"] and not state["eof"]:
                cond.wait()
            path, state["newest"] = state["newest"], None
            syncs = 0 if path is not None else state["syncs"]
            state["syncs"] -= syncs
            if path is None and not syncs:
                return  # end of input, nothing left
        if path is not None:
            body = Path(path).read_bytes()
            client.upload_fileobj(io.BytesIO(body), bucket, f"{prefix}/{Path(path).name}")
            uploaded += len(body)
        for _ in range(syncs):
            print(f"done {uploaded}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
