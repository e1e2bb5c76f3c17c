"""Test helpers for the Docker sidecar: rootful podman, the images, a shared host directory.

`podman_problem()` says why containers cannot run here (or None). `required()`: in CI as
root (or with CKPTFS_REQUIRE_CONTAINERS=1) such a problem fails the tests instead of
skipping them. `build_images()` makes the local base image (debootstrap, once) and builds
the sidecar and trainer images, tagged by a hash of everything that goes into them, so a
machine that keeps podman's storage rebuilds only when docker/, mount/, ckptfs/ or the
example changed. `SharedDir` is the README's host-side step: a directory bind-mounted on
itself and made a shared mount, so that mounts made under it inside a container
propagate to the host.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONTAINERS_CONF = REPO / "docker" / "containers.conf"
BASE_IMAGE = "docker.io/library/debian:bookworm-slim"
SIDECAR_REPO = "localhost/ckptfs"
TRAINER_REPO = "localhost/ckptfs-trainer"
# what goes into the images (the build context is filtered by .dockerignore)
IMAGE_INPUTS = ["docker/Dockerfile", ".dockerignore", "docker/requirements.txt", "docker/entrypoint.py",
                "docker/podman-build.sh", "mount/mount.ckptfs", "examples/train.py", "pyproject.toml",
                "README.md"]


def env() -> dict:
    e = dict(os.environ)
    e.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    return e


def podman(*args: str, check: bool = True, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=env(), **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({res.returncode}):\n{res.stderr}")
    return res


def required() -> bool:
    if os.environ.get("CKPTFS_REQUIRE_CONTAINERS") == "1":
        return True
    return bool(os.environ.get("CI")) and os.geteuid() == 0


def podman_problem() -> str | None:
    """Why containers cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (the sidecar test uses rootful podman)"
    if not os.path.exists("/dev/fuse"):
        return "needs /dev/fuse"
    for tool in ("podman", "debootstrap", "runc"):
        if not shutil.which(tool):
            return f"{tool} is not installed (.ci/setup-containers.sh installs it, as root)"
    try:
        res = podman("info", "--format", "{{.Host.OCIRuntime.Name}}", check=False, timeout=60)
    except subprocess.TimeoutExpired:
        return "podman info timed out"
    if res.returncode != 0:
        return f"podman cannot run here: {res.stderr.strip().splitlines()[-1:] or res.returncode}"
    return None


def base_image() -> None:
    """The local base image (debootstrap; ~1 min, once: podman keeps it)."""
    res = subprocess.run([str(REPO / "docker" / "local-base.sh"), BASE_IMAGE], capture_output=True,
                         text=True, timeout=900, env=env())
    if res.returncode != 0:
        raise AssertionError(f"docker/local-base.sh failed:\n{res.stdout}\n{res.stderr}")


def probe() -> str | None:
    """Run a trivial container; None when that works, else why not."""
    res = podman("run", "--rm", "--pull=never", "--network=none", BASE_IMAGE, "true", check=False, timeout=120)
    if res.returncode != 0:
        return f"podman cannot run a container here: {res.stderr.strip()[-500:]}"
    return None


def inputs_hash() -> str:
    h = hashlib.sha256()
    files = [REPO / f for f in IMAGE_INPUTS] + sorted((REPO / "ckptfs").rglob("*.py"))
    for f in files:
        h.update(str(f.relative_to(REPO)).encode() + b"\0")
        h.update(f.read_bytes() if f.exists() else b"<missing>")
        h.update(b"\0")
    return h.hexdigest()[:12]


def build_images(log=print) -> tuple[str, str]:
    """(sidecar image, trainer image), built unless images for these sources exist."""
    base_image()
    tag = inputs_hash()
    sidecar, trainer = f"{SIDECAR_REPO}:{tag}", f"{TRAINER_REPO}:{tag}"
    have = all(podman("image", "exists", img, check=False).returncode == 0 for img in (sidecar, trainer))
    if not have:
        t0 = time.monotonic()
        res = subprocess.run([str(REPO / "docker" / "podman-build.sh"), tag], capture_output=True, text=True,
                             timeout=1200, env=env(), cwd=REPO)
        if res.returncode != 0:
            raise AssertionError(f"image build failed:\n{res.stdout[-6000:]}\n{res.stderr[-4000:]}")
        log(f"built {sidecar} and {trainer} in {time.monotonic() - t0:.0f} s")
        _drop_old_tags(tag)
    for repo, img in ((SIDECAR_REPO, sidecar), (TRAINER_REPO, trainer)):
        podman("tag", img, f"{repo}:latest")
    return sidecar, trainer


def _drop_old_tags(keep: str) -> None:
    """Untag images built from older sources (their layers stay as build cache for a week)."""
    for repo in (SIDECAR_REPO, TRAINER_REPO):
        res = podman("images", "--format", "{{.Repository}}:{{.Tag}}", repo, check=False)
        for name in res.stdout.split():
            tag = name.rsplit(":", 1)[-1]
            if tag not in (keep, "latest") and len(tag) == 12:
                podman("untag", name, name, check=False)  # only this name: one image may carry several
    podman("image", "prune", "-f", "--filter", "until=168h", check=False, timeout=600)


def mount_types(path: Path | str) -> list[str]:
    """Filesystem types mounted at `path` in this (the host's) mount namespace, bottom first."""
    path = os.path.realpath(str(path))
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if fields[4].replace("\\040", " ") == path:
                out.append(right.split()[0])
    return out


def is_live_ckptfs(path: Path | str) -> bool:
    types = mount_types(path)
    if not types or types[-1] != "fuse.ckptfs":
        return False
    try:
        os.getxattr(str(path), "user.ckptfs.pid")
        return True
    except OSError:
        return False


def is_stale(path: Path | str) -> bool:
    try:  # statfs always asks the daemon; stat may be answered from the kernel's cache
        os.statvfs(path)
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ENOTCONN
    return False


class SharedDir:
    """A host directory made a shared mount (bind-mounted on itself, --make-shared)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "--bind", str(self.path), str(self.path)], check=True)
        subprocess.run(["mount", "--make-shared", str(self.path)], check=True)

    def close(self) -> None:
        """Unmount whatever is left under it (a stale ckptfs mount, say), then the bind."""
        for _ in range(10):
            under = [line.split()[4] for line in open("/proc/self/mountinfo")
                     if line.split()[4].startswith(str(self.path) + "/")]
            if not under:
                break
            for mp in sorted(under, key=len, reverse=True):
                subprocess.run(["umount", "-l", mp], capture_output=True)
        while mount_types(self.path):
            if subprocess.run(["umount", "-l", str(self.path)], capture_output=True).returncode != 0:
                break
