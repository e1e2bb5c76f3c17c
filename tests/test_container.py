"""End to end: ckptfs as a Docker sidecar (rootful podman), next to an unchanged trainer.

Builds the images (cached by a hash of their sources), starts the sidecar over
file-backed devices with the host directory as an rshared bind, runs the example
trainer (torch.save, as uid 1000) against its rslave view, checks from the host that the
checkpoint is there and right, stops the sidecar with SIGTERM (it must drain and exit 0),
and remounts the devices outside any container: the checkpoint must be durable and
bit-exact. Then SIGKILLs a sidecar and checks that a new one starts over the dead mount
it left, with everything that was durable, and that the trainer resumes from it.

Skips only when podman cannot run containers here (not root, not installed); in CI as
root that is a failure (see containers.required).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import containers as C
from mounting import ckptfs, make_devices
from waiting import poll

pytestmark = [pytest.mark.container, pytest.mark.mount, pytest.mark.timeout(1500)]

REPO = C.REPO
GiB = 1 << 30
TRAIN_ARGS = ["--steps", "4", "--save-every", "2", "--params-mb", "8", "--width", "256"]
STOP_GRACE = 120  # seconds: the stop_grace_period the README and compose.yaml ask for


@pytest.fixture(scope="module")
def images():
    problem = C.podman_problem()
    if problem is None:
        C.base_image()
        problem = C.probe()
    if problem:
        if C.required():
            pytest.fail(f"containers must run here (CI as root): {problem}")
        pytest.skip(problem)
    return C.build_images(log=lambda msg: print(msg, file=sys.stderr))


class Sidecar:
    """One run of the sidecar container; `close()` removes it, whatever state it is in."""
    count = 0

    def __init__(self, image: str, shared: Path, devices: list[Path], *, memory: str = "256M",
                 env: dict | None = None):
        Sidecar.count += 1
        self.name = f"ckptfs-test-{os.getpid()}-{Sidecar.count}"
        self.shared = shared
        self.mountpoint = shared / "ckpt"
        devdir = devices[0].parent
        cenv = {"CKPTFS_DEVICES": ",".join(f"/devices/{d.name}" for d in devices),
                "CKPTFS_MEMORY": memory, "CKPTFS_FORMAT": "if-needed", "CKPTFS_OWNER": "1000:1000",
                **(env or {})}
        args = ["run", "-d", "--name", self.name, "--pull=never", "--network=none", "--device", "/dev/fuse",
                "--cap-drop", "ALL", "--cap-add", "SYS_ADMIN", "--cap-add", "CHOWN",
                "--stop-timeout", str(STOP_GRACE),
                "--mount", f"type=bind,src={shared},dst=/shared,bind-propagation=rshared",
                "--mount", f"type=bind,src={devdir},dst=/devices"]
        for k, v in cenv.items():
            args += ["-e", f"{k}={v}"]
        C.podman(*args, image)

    def logs(self) -> str:
        res = C.podman("logs", self.name, check=False)
        return res.stdout + res.stderr

    def ready(self) -> bool:
        """Live, and given to the trainer's uid (CKPTFS_OWNER), as the HEALTHCHECK reports it."""
        return C.is_live_ckptfs(self.mountpoint) and os.stat(self.mountpoint).st_uid == 1000

    def wait_live(self, timeout: float = 90) -> None:
        poll(lambda: self.ready() or not self.running(), f"the sidecar's mount at {self.mountpoint}", timeout,
             every=0.1, on_timeout=self.logs)
        assert self.ready(), f"the sidecar exited:\n{self.logs()}"

    def running(self) -> bool:
        res = C.podman("inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return res.stdout.strip() == "true"

    def exit_code(self) -> int:
        return int(C.podman("inspect", "--format", "{{.State.ExitCode}}", self.name).stdout.strip())

    def close(self) -> None:
        C.podman("rm", "-f", "-t", "0", self.name, check=False)


def run_trainer(image: str, shared: Path, *args: str) -> str:
    res = C.podman("run", "--rm", "--pull=never", "--network=none", "--user", "1000:1000",
                   "--mount", f"type=bind,src={shared},dst=/shared,bind-propagation=rslave",
                   image, "python", "/app/train.py", "--save-dir", "/shared/ckpt", *args,
                   check=False, timeout=600)
    assert res.returncode == 0, f"trainer failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res.stdout


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def world(tmp_path):
    """A shared host directory, devices, and cleanup of every sidecar started."""
    shared = C.SharedDir(tmp_path / "shared")
    started: list[Sidecar] = []
    try:
        yield shared.path, make_devices(tmp_path / "devices", 2, GiB), started
    finally:
        for s in started:
            s.close()
        shared.close()


def test_sidecar_trainer_sigterm_then_remount_bit_exact(images, world, tmp_path):
    sidecar_image, trainer_image = images
    shared, devices, started = world
    sc = Sidecar(sidecar_image, shared, devices)
    started.append(sc)
    sc.wait_live()
    hc = C.podman("healthcheck", "run", sc.name, check=False)
    assert hc.returncode == 0, f"HEALTHCHECK says the live mount is not: {hc.stdout}{hc.stderr}"
    assert "formatting" in sc.logs()  # CKPTFS_FORMAT=if-needed on blank devices

    out = run_trainer(trainer_image, shared, *TRAIN_ARGS)
    assert "saved step000004.pt" in out, out
    st = C.podman("exec", sc.name, "ckptfs", "status", "/shared/ckpt", check=False)
    assert st.returncode == 0, f"ckptfs status in the sidecar: {st.stdout}{st.stderr}"
    # the image's mount(8) finds the helper, which finds ckptfs: a bad option is its one line
    mt = C.podman("exec", sc.name, "mount", "-t", "ckptfs", "/devices/x", "/tmp", "-o", "memory=lots",
                  check=False)
    assert mt.returncode != 0 and "mount.ckptfs: bad option memory=lots" in mt.stderr, mt.stderr

    # from the host, through the propagated mount: there, owned by the trainer, right
    ckpt_dir = shared / "ckpt"
    names = sorted(os.listdir(ckpt_dir))
    assert names == ["step000002.pt", "step000004.pt"], names
    assert os.stat(ckpt_dir / "step000004.pt").st_uid == 1000
    digests = {n: sha256(ckpt_dir / n) for n in names}
    ref = tmp_path / "reference"  # the same deterministic run on the host, into ext4
    subprocess.run([sys.executable, str(REPO / "examples" / "train.py"), "--save-dir", str(ref), *TRAIN_ARGS],
                   check=True, capture_output=True, timeout=600)
    import torch
    got = torch.load(ckpt_dir / "step000004.pt", map_location="cpu", weights_only=True)
    want = torch.load(ref / "step000004.pt", map_location="cpu", weights_only=True)
    assert got["step"] == want["step"] == 4
    assert got["model"].keys() == want["model"].keys()
    for k in want["model"]:
        assert torch.allclose(got["model"][k], want["model"][k], rtol=1e-5, atol=1e-6), k

    # one more file, from the host, just before the stop: most likely still in memory
    late = os.urandom(48 << 20)
    (ckpt_dir / "late.bin").write_bytes(late)
    state_at_stop = os.getxattr(ckpt_dir / "late.bin", "user.ckptfs.state").decode()
    print(f"late.bin at SIGTERM: {state_at_stop}", file=sys.stderr)
    names.append("late.bin")
    digests["late.bin"] = hashlib.sha256(late).hexdigest()

    # SIGTERM: drain, unmount (the host's view goes too), exit 0 within the grace period
    stop = C.podman("stop", "-t", str(STOP_GRACE), sc.name, check=False, timeout=STOP_GRACE + 60)
    assert stop.returncode == 0, stop.stderr
    logs = sc.logs()
    assert sc.exit_code() == 0, logs
    assert "everything is on the devices" in logs, logs
    assert not C.mount_types(ckpt_dir), f"{ckpt_dir} is still mounted on the host"

    # remount outside any container: durable and bit-exact
    mnt = tmp_path / "remount"
    mnt.mkdir()
    dev_arg = ",".join(str(d) for d in devices)
    ckptfs("mount", str(mnt), "--devices", dev_arg, "--memory", "256M", "--log-file", str(tmp_path / "r.log"),
           check=True)
    try:
        assert sorted(os.listdir(mnt)) == sorted(names)
        assert {n: sha256(mnt / n) for n in names} == digests, f"late.bin was {state_at_stop} at SIGTERM"
        again = torch.load(mnt / "step000004.pt", map_location="cpu", weights_only=True)
        assert all(torch.equal(again["model"][k], got["model"][k]) for k in got["model"])
    finally:
        ckptfs("umount", str(mnt), check=True)
    res = ckptfs("fsck", "--devices", dev_arg, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


def test_sigkill_leaves_stale_mount_new_sidecar_starts_over_it(images, world):
    sidecar_image, trainer_image = images
    shared, devices, started = world
    first = Sidecar(sidecar_image, shared, devices)
    started.append(first)
    first.wait_live()
    run_trainer(trainer_image, shared, *TRAIN_ARGS)
    ckpt_dir = shared / "ckpt"
    ckptfs("sync", str(ckpt_dir), check=True)  # from the host: everything durable now
    digest = sha256(ckpt_dir / "step000004.pt")

    C.podman("kill", "-s", "KILL", first.name)
    poll(lambda: not first.running(), "the killed sidecar to be gone", 30, every=0.1)
    assert first.exit_code() == 137
    assert C.is_stale(ckpt_dir), "a SIGKILLed sidecar should leave a dead mount behind"

    second = Sidecar(sidecar_image, shared, devices)
    started.append(second)
    second.wait_live()
    logs = second.logs()
    assert "clearing a stale mount" in logs, logs
    assert "mounting what they hold" in logs and "blank: formatting" not in logs, logs  # kept the pool
    assert sha256(ckpt_dir / "step000004.pt") == digest

    out = run_trainer(trainer_image, shared, *TRAIN_ARGS[:1], "6", *TRAIN_ARGS[2:], "--resume")
    assert "resumed from /shared/ckpt/step000004.pt (step 4)" in out, out
    assert sorted(os.listdir(ckpt_dir)) == ["step000004.pt", "step000006.pt"]

    C.podman("stop", "-t", str(STOP_GRACE), second.name, timeout=STOP_GRACE + 60)
    assert second.exit_code() == 0, second.logs()
    assert not C.mount_types(ckpt_dir)


@pytest.fixture
def loop_devices(tmp_path):
    """Two loop devices over sparse files: block devices to pass with `devices:`."""
    files = make_devices(tmp_path / "loopfiles", 2, GiB)
    loops = []
    try:
        for f in files:
            res = subprocess.run(["losetup", "-f", "--show", "--direct-io=on", str(f)], capture_output=True,
                                 text=True)
            if res.returncode != 0:
                pytest.fail(f"losetup failed: {res.stderr}")
            loops.append(res.stdout.strip())
        yield loops
    finally:
        for lo in loops:
            subprocess.run(["losetup", "-d", lo], capture_output=True)


def test_compose_file_sidecar_and_trainer(images, world, loop_devices, tmp_path):
    """docker/compose.yaml as written, on podman-compose, with loop devices as the NVMe."""
    sidecar_image, trainer_image = images
    shared, _, _ = world
    compose = [str(Path(sys.executable).parent / "podman-compose"), "-f", str(REPO / "docker" / "compose.yaml"),
               "-p", f"ckptfs-test-{os.getpid()}"]
    env = {**C.env(), "CKPTFS_HOST_DIR": str(shared), "CKPTFS_DEVICE_0": loop_devices[0],
           "CKPTFS_DEVICE_1": loop_devices[1], "CKPTFS_FORMAT": "if-needed", "CKPTFS_MEMORY": "512M",
           "CKPTFS_IMAGE": sidecar_image, "CKPTFS_TRAINER_IMAGE": trainer_image,
           "TRAIN_STEPS": "4", "TRAIN_SAVE_EVERY": "2"}

    def run(*args, timeout=300):
        return subprocess.run([*compose, *args], capture_output=True, text=True, env=env, timeout=timeout)

    sidecar, trainer = f"ckptfs-test-{os.getpid()}_ckptfs_1", f"ckptfs-test-{os.getpid()}_trainer_1"
    try:
        res = run("up", "-d")
        assert res.returncode == 0, res.stdout + res.stderr
        poll(lambda: C.podman("inspect", "--format", "{{.State.Status}}", trainer,
                              check=False).stdout.strip() == "exited", "the trainer to finish", 300, every=0.1,
             on_timeout=lambda: C.podman("logs", trainer, check=False).stdout + C.podman("logs", sidecar,
                                                                                         check=False).stderr)
        out = C.podman("logs", trainer).stdout
        code = C.podman("inspect", "--format", "{{.State.ExitCode}}", trainer).stdout.strip()
        assert code == "0", out
        assert "saved step000004.pt" in out, out
        ckpt_dir = shared / "ckpt"
        names = sorted(os.listdir(ckpt_dir))
        assert names == ["step000002.pt", "step000004.pt"], names
        digests = {n: sha256(ckpt_dir / n) for n in names}
        assert C.podman("inspect", "--format", "{{.Config.StopSignal}}", sidecar).stdout.strip() in ("15", "SIGTERM")

        res = run("stop", timeout=STOP_GRACE + 120)  # stop_grace_period: the trainer first, then the sidecar
        assert res.returncode == 0, res.stdout + res.stderr
        logs = C.podman("logs", sidecar).stderr
        assert C.podman("inspect", "--format", "{{.State.ExitCode}}", sidecar).stdout.strip() == "0", logs
        assert "everything is on the devices" in logs, logs
        assert not C.mount_types(ckpt_dir)
    finally:
        run("down", "-t", "0", timeout=300)

    mnt = tmp_path / "remount"
    mnt.mkdir()
    ckptfs("mount", str(mnt), "--devices", ",".join(loop_devices), "--memory", "512M",
           "--log-file", str(tmp_path / "r.log"), check=True)
    try:
        assert {n: sha256(mnt / n) for n in os.listdir(mnt)} == digests
    finally:
        ckptfs("umount", str(mnt), check=True)
