"""The container files, checked without running containers: hadolint on the Dockerfile,
shellcheck on the scripts, and the compose file and Kubernetes pod hold what the sidecar
needs (propagation, devices, capabilities, grace period, health)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "docker" / "Dockerfile"
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    assert path, f"{name} is missing: it comes with the test extras (pip install -e '.[test]')"
    return str(path)


def test_hadolint_passes_on_the_dockerfile():
    res = subprocess.run([tool("hadolint"), "--failure-threshold", "info", str(DOCKERFILE)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip() == ""


def test_shellcheck_passes_on_the_scripts():
    scripts = [REPO / ".ci" / "setup-containers.sh", REPO / "docker" / "local-base.sh",
               REPO / "docker" / "podman-build.sh", REPO / "mount" / "install.sh"]
    res = subprocess.run([tool("shellcheck"), *map(str, scripts)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_python_entrypoint_and_helper_compile():
    for f in (REPO / "docker" / "entrypoint.py", REPO / "mount" / "mount.ckptfs"):
        compile(f.read_text(), str(f), "exec")
        assert f.stat().st_mode & 0o111, f"{f} must be executable"


def dockerfile_stages() -> dict[str, list[str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if m:
            current = m.group(1)
            stages[current] = []
        if current:
            stages[current].append(line)
    return stages


def test_dockerfile_shape():
    stages = dockerfile_stages()
    assert list(stages)[-1] == "ckptfs", "the sidecar must be the default (last) target"
    assert {"build", "ckptfs", "trainer"} <= set(stages)
    build = " ".join(stages["build"])
    assert "libfuse3-dev" in build and "pip install" in build
    side = stages["ckptfs"]
    assert any(ln.startswith("ENTRYPOINT") and "ckptfs-entrypoint" in ln for ln in side)
    assert any(ln.startswith("HEALTHCHECK") and "health" in ln for ln in side)
    assert "STOPSIGNAL SIGTERM" in side
    assert "libfuse3-dev" not in " ".join(side) and "gcc" not in " ".join(side)  # slim runtime
    assert any("fuse3" in ln for ln in side if ln.startswith("RUN"))
    assert any(re.match(r"USER\s+\d+", ln) for ln in stages["build"])  # compiles as non-root
    assert any(re.match(r"USER\s+1000", ln) for ln in stages["trainer"])


def test_dockerignore_lets_in_everything_the_dockerfile_copies():
    rules = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]

    def matches(path: str, pat: str) -> bool:
        """Docker's rule: `*` and `?` stay within one path component, `**` crosses them, and a
        pattern that matches a folder matches everything in it."""
        rx = re.escape(pat.rstrip("/"))
        rx = rx.replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        return re.fullmatch(rx + "(?:/.*)?", path) is not None

    def included(path: str) -> bool:
        ok = True
        for r in rules:
            neg = r.startswith("!")
            if matches(path, r[1:] if neg else r):
                ok = neg
        return ok

    assert not matches("ckptfs/store/store.py", "ckptfs/*.py") and matches("ckptfs/store/store.py", "ckptfs")

    for line in dockerfile_stages()["build"] + dockerfile_stages()["ckptfs"] + dockerfile_stages()["trainer"]:
        if line.startswith("COPY") and "--from" not in line:
            srcs = [w for w in line.split()[1:-1] if not w.startswith("--")]
            for src in srcs:
                files = [p for p in (REPO / src).rglob("*.py")] if (REPO / src).is_dir() else [REPO / src]
                for f in files:
                    rel = str(f.relative_to(REPO))
                    assert f.exists(), rel
                    assert included(rel), f".dockerignore keeps out {rel}, which the Dockerfile copies"


def test_image_requirements_cover_the_package_dependencies():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ \[]", d)[0].lower().replace("_", "-") for d in deps}
    req = (REPO / "docker" / "requirements.txt").read_text().splitlines()
    pinned = {ln.split("==")[0].strip().lower().replace("_", "-") for ln in req if "==" in ln}
    assert names <= pinned, f"add to docker/requirements.txt: {sorted(names - pinned)}"


def _bind(vol: dict) -> tuple[str, str, str]:
    return vol["source"], vol["target"], vol.get("bind", {}).get("propagation", "")


def test_compose_file():
    doc = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    side, trainer = doc["services"]["ckptfs"], doc["services"]["trainer"]
    assert "/dev/fuse" in side["devices"]
    assert "SYS_ADMIN" in side["cap_add"]
    src, dst, prop = _bind(side["volumes"][0])
    assert (dst, prop) == ("/shared", "rshared")
    tsrc, tdst, tprop = _bind(trainer["volumes"][0])
    assert (tsrc, tdst, tprop) == (src, "/shared", "rslave")  # the same host directory
    assert side["environment"]["CKPTFS_MOUNTPOINT"].startswith("/shared/")
    assert int(side["stop_grace_period"].rstrip("s")) >= 60
    assert side.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert "health" in side["healthcheck"]["test"]
    assert trainer["depends_on"]["ckptfs"]["condition"] == "service_healthy"
    assert "/app/train.py" in " ".join(trainer["command"])
    assert trainer["user"] == side["environment"]["CKPTFS_OWNER"]
    # replication and restore: each node its own prefix, the same one for both by default
    env = side["environment"]
    assert env["CKPTFS_REPLICATE"] == "${CKPTFS_REPLICATE_TO:+${CKPTFS_REPLICATE_TO}/node-${NODE_RANK:-0}}"
    assert env["CKPTFS_RESTORE_FROM"] == \
        "${CKPTFS_RESTORE_FROM_ROOT:+${CKPTFS_RESTORE_FROM_ROOT}/node-${NODE_RANK:-0}}"


def test_compose_file_is_valid_for_podman_compose():
    if not shutil.which("podman"):
        pytest.skip("podman is not installed (podman-compose needs it even to read the file)")
    res = subprocess.run([tool("podman-compose"), "-f", str(REPO / "docker" / "compose.yaml"), "config"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "rshared" in res.stdout and "rslave" in res.stdout


def test_kubernetes_pod():
    pod = yaml.safe_load((REPO / "docker" / "k8s" / "pod.yaml").read_text())
    spec = pod["spec"]
    assert spec["terminationGracePeriodSeconds"] >= 120
    side = next(c for c in spec["initContainers"] if c["name"] == "ckptfs")
    assert side["restartPolicy"] == "Always"  # native sidecar: up before, down after the trainer
    assert side["securityContext"]["privileged"] is True  # required for Bidirectional
    mounts = {m["name"]: m for m in side["volumeMounts"]}
    assert mounts["shared"]["mountPropagation"] == "Bidirectional"
    assert "health" in side["startupProbe"]["exec"]["command"]
    env = {e["name"]: e.get("value") for e in side["env"]}
    names = [e["name"] for e in side["env"]]
    # replication: each pod its own prefix, from a variable defined before it (Kubernetes expands $(VAR))
    assert env["CKPTFS_REPLICATE"].startswith("s3://") and "$(POD_NAME)" in env["CKPTFS_REPLICATE"]
    assert names.index("POD_NAME") < names.index("CKPTFS_REPLICATE")
    # a replacement pod restores its own prefix into blank devices (needs CKPTFS_FORMAT=if-needed)
    assert env["CKPTFS_RESTORE_FROM"] == env["CKPTFS_REPLICATE"]
    assert names.index("POD_NAME") < names.index("CKPTFS_RESTORE_FROM") and env["CKPTFS_FORMAT"] == "if-needed"
    assert env["CKPTFS_MOUNTPOINT"].startswith(mounts["shared"]["mountPath"] + "/")
    volumes = {v["name"]: v for v in spec["volumes"]}
    for dev in env["CKPTFS_DEVICES"].split(","):  # every device is passed in, as a block device
        m = next(m for m in side["volumeMounts"] if m["mountPath"] == dev)
        assert volumes[m["name"]]["hostPath"]["type"] == "BlockDevice"
    trainer = spec["containers"][0]
    tm = next(m for m in trainer["volumeMounts"] if m["name"] == "shared")
    assert tm["mountPropagation"] == "HostToContainer"
    assert not trainer.get("securityContext", {}).get("privileged")
    assert trainer["securityContext"]["runAsUser"] == int(env["CKPTFS_OWNER"].split(":")[0])
