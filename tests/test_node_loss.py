"""Losing a node, end to end: the uploader (--replicate) and the restore (--restore-from) together.

An unchanged training script saves into a replicating mount; once `ckptfs wait
--replicated` says the newest checkpoint is in the object store, the node is
"lost" (unmounted, its device files deleted). A replacement node formats fresh
devices with --restore-from: every file the lost node had is there bit-exact,
`torch.load` works, the script resumes from the newest checkpoint, and the new
node's checkpoints replicate back to the same prefix.
"""
import hashlib
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from mounting import CkptMount, ckptfs

pytestmark = pytest.mark.mount
TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train.py"


def tree(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under root."""
    out = {}
    for d, _, files in os.walk(root):
        for n in files:
            p = Path(d) / n
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def train(save_dir: Path, steps: int, *more: str) -> str:
    res = subprocess.run([sys.executable, str(TRAIN), "--save-dir", str(save_dir), "--params-mb", "4",
                          "--width", "256", "--save-every", "2", "--steps", str(steps), *more],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_a_lost_node_comes_back_from_the_object_store_and_training_resumes(tmp_path, s3, monkeypatch):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3.client().create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/node-0"
    lost = CkptMount(tmp_path / "lost", memory="256M", extra=("--replicate", url, "--s3-endpoint", s3.endpoint))
    lost.mount()
    try:
        train(lost.path, 6)
        (lost.path / "notes").mkdir()
        (lost.path / "notes" / "run.txt").write_text("lr 1e-4\n")
        os.symlink("notes/run.txt", lost.path / "latest-notes")
        files = sorted(p for p in os.listdir(lost.path) if p.endswith(".pt"))
        res = ckptfs("wait", "--replicated", "--timeout", "120", *(str(lost.path / f) for f in files),
                     str(lost.path / "notes" / "run.txt"))
        assert res.returncode == 0, res.stderr
        before = tree(lost.path)
        newest = max(files)
    finally:
        lost.close()
    for d in lost.devices:  # the node is gone, with its devices
        d.unlink()

    fresh = CkptMount(tmp_path / "replacement", memory="256M")
    # the replacement restores from the prefix and replicates back to it once the restore is whole
    fresh.mount("--restore-from", url, "--s3-endpoint", s3.endpoint, "--replicate", url)
    try:
        sd = torch.load(fresh.path / newest, weights_only=True)  # at once, before the background is done
        assert sd["step"] == int(newest[len("step"):-len(".pt")])
        assert tree(fresh.path) == before
        assert os.readlink(fresh.path / "latest-notes") == "notes/run.txt"
        out = train(fresh.path, 10, "--resume")
        assert f"resumed from {fresh.path / newest}" in out, out
        latest = max(p for p in os.listdir(fresh.path) if p.endswith(".pt"))
        assert latest > newest
        res = ckptfs("wait", "--replicated", "--timeout", "180", str(fresh.path / latest))
        assert res.returncode == 0, res.stderr
    finally:
        fresh.close()
