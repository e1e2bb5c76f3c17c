"""docker/entrypoint.py, the sidecar's entrypoint, run on the host (no container needed).

It must clear a dead mount left by a killed daemon, format only blank devices when
CKPTFS_FORMAT=if-needed, pass SIGTERM on so the daemon drains and unmounts before it
exits 0, report health, and refuse bad settings with one line.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from importlib.machinery import SourceFileLoader
from pathlib import Path

import pytest

from mounting import ckptfs, is_mounted, make_devices
from waiting import poll

REPO = Path(__file__).resolve().parent.parent
ENTRYPOINT = REPO / "docker" / "entrypoint.py"
GiB = 1 << 30


def load():
    loader = SourceFileLoader("ckptfs_entrypoint", str(ENTRYPOINT))
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("ckptfs_entrypoint", loader))
    loader.exec_module(mod)
    return mod


E = load()


def env_for(**kw) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"  # ckptfs, as in the image
    for k in list(env):
        if k.startswith("CKPTFS_"):
            del env[k]
    env.update({k: str(v) for k, v in kw.items()})
    return env


def start(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ENTRYPOINT), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_live(mp: Path, proc: subprocess.Popen, timeout: float = 60, owner=None) -> None:
    """Until the entrypoint's mount is live (E.health); fails with its output if it exits first, or
    kills it and fails with its output after `timeout` seconds."""
    def state():
        if E.health(str(mp), owner)[0]:
            return "live"
        return "exited" if proc.poll() is not None else None

    def killed_output():
        proc.kill()
        return proc.stdout.read()

    if poll(state, f"the entrypoint's mount at {mp} to be live", timeout, every=0.1,
            on_timeout=killed_output) == "exited":
        raise AssertionError(f"the entrypoint exited ({proc.returncode}):\n{proc.stdout.read()}")


def stop(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


# ---- pure parts --------------------------------------------------------------------

def test_mount_command_from_env_and_from_args():
    cmd, mp, devs = E.mount_command([], {"CKPTFS_DEVICES": "/d/a,/d/b", "CKPTFS_MEMORY": "2G",
                                         "CKPTFS_ARGS": "--queue-depth 16 --fsync absorb"})
    assert cmd == ["ckptfs", "mount", "/shared/ckpt", "--devices", "/d/a,/d/b", "--memory", "2G",
                   "--queue-depth", "16", "--fsync", "absorb", "--foreground"]
    assert mp == "/shared/ckpt" and devs == ["/d/a", "/d/b"]
    cmd, mp, devs = E.mount_command(["mount", "/x/ckpt", "--devices", "/d/a", "--memory", "1G", "-f"], {})
    assert cmd == ["ckptfs", "mount", "/x/ckpt", "--devices", "/d/a", "--memory", "1G", "-f"]
    assert mp == "/x/ckpt" and devs == ["/d/a"]
    with pytest.raises(E.Fatal, match="CKPTFS_DEVICES"):
        E.mount_command([], {})
    with pytest.raises(E.Fatal, match="usage"):
        E.mount_command(["mount", "/x"], {})
    with pytest.raises(E.Fatal, match="CKPTFS_ARGS"):
        E.mount_command([], {"CKPTFS_DEVICES": "/d/a", "CKPTFS_ARGS": "'unclosed"})
    cmd, _, _ = E.mount_command([], {"CKPTFS_DEVICES": "/d/a", "CKPTFS_REPLICATE": "s3://ckpt/run/node-3",
                                     "CKPTFS_S3_ENDPOINT": "http://s3.local:8333"})
    assert cmd[5:] == ["--replicate", "s3://ckpt/run/node-3", "--s3-endpoint", "http://s3.local:8333", "--foreground"]
    with pytest.raises(E.Fatal, match="CKPTFS_REPLICATE"):
        E.mount_command([], {"CKPTFS_DEVICES": "/d/a", "CKPTFS_S3_ENDPOINT": "http://s3.local:8333"})


def test_restore_from_env_restores_blank_devices_only(tmp_path, monkeypatch):
    devs = make_devices(tmp_path, 2, 4 << 20)
    env = {"CKPTFS_DEVICES": ",".join(str(d) for d in devs), "CKPTFS_MOUNTPOINT": str(tmp_path / "m"),
           "CKPTFS_FORMAT": "if-needed", "CKPTFS_REPLICATE": "s3://ckpt/run/node-3",
           "CKPTFS_RESTORE_FROM": "s3://ckpt/run/node-3", "CKPTFS_S3_ENDPOINT": "http://s3.local:8333"}
    ran = []
    monkeypatch.setattr(E.signal, "signal", lambda *a: None)  # the Supervisor's handlers: not in pytest
    monkeypatch.setattr(E, "prepare_mountpoint", lambda mp: None)
    monkeypatch.setattr(E.Supervisor, "run", lambda self: ran.append(self.cmd) or 0)
    monkeypatch.setattr(E.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    assert E.run_mount([], env) == 0
    assert ran == [["ckptfs", "mount", str(tmp_path / "m"), "--devices", env["CKPTFS_DEVICES"],
                    "--replicate", "s3://ckpt/run/node-3", "--s3-endpoint", "http://s3.local:8333", "--foreground",
                    "--format", "--restore-from", "s3://ckpt/run/node-3", "--restore-if-any"]]
    with open(devs[0], "r+b") as f:  # a pool on the devices: mounted as it is, nothing formatted or restored
        f.write(b"pool")
    ran.clear()
    assert E.run_mount([], env) == 0
    assert len(ran) == 1 and "--restore-from" not in ran[0] and "--format" not in ran[0]
    cmd, _, _ = E.mount_command([], {"CKPTFS_DEVICES": "/d/a", "CKPTFS_RESTORE_FROM": "s3://ckpt/run/node-3",
                                     "CKPTFS_S3_ENDPOINT": "http://s3.local:8333"})
    assert cmd[5:] == ["--s3-endpoint", "http://s3.local:8333", "--foreground"]  # restore_source adds the rest
    for bad_env, argv, word in (({"CKPTFS_FORMAT": "never"}, [], "CKPTFS_FORMAT=if-needed"),
                                ({"CKPTFS_RESTORE_FROM": "ckpt/run"}, [], "s3://"),
                                ({}, ["mount", "/x", "--devices", "/d/a"], "--restore-from")):
        with pytest.raises(E.Fatal, match=word):
            E.run_mount(argv, {**env, **bad_env})


def test_owner_and_mountinfo_parsing(tmp_path):
    assert E.parse_owner("") is None
    assert E.parse_owner("1000") == (1000, 1000)
    assert E.parse_owner("1000:2000") == (1000, 2000)
    with pytest.raises(E.Fatal, match="CKPTFS_OWNER"):
        E.parse_owner("trainer")
    info = tmp_path / "mountinfo"
    info.write_text("36 35 98:0 / /mnt/with\\040space rw - ext4 /dev/x rw\n"
                    "37 36 0:50 / /mnt/with\\040space rw,nosuid - fuse.ckptfs ckptfs rw\n")
    assert E.mounts_at("/mnt/with space", str(info)) == ["ext4", "fuse.ckptfs"]
    assert E.mounts_at("/mnt/other", str(info)) == []


def test_blank_devices(tmp_path):
    a, b = make_devices(tmp_path, 2, 4 << 20)
    assert E.blank_devices([str(a), str(b)])
    with open(b, "r+b") as f:
        f.seek((1 << 20) - 1)
        f.write(b"\1")
    assert not E.blank_devices([str(a), str(b)])
    with open(b, "r+b") as f:  # beyond the first MiB does not count
        f.seek((1 << 20) - 1)
        f.write(b"\0")
        f.seek(2 << 20)
        f.write(b"\1")
    assert E.blank_devices([str(b)])
    assert not E.blank_devices([str(tmp_path / "missing")])


@pytest.mark.parametrize("env, word", [({"CKPTFS_FORMAT": "always", "CKPTFS_DEVICES": "/x"}, "CKPTFS_FORMAT"),
                                       ({}, "CKPTFS_DEVICES"),
                                       ({"CKPTFS_DEVICES": "/x", "CKPTFS_OWNER": "bob"}, "CKPTFS_OWNER")])
def test_bad_settings_one_line_exit_2(tmp_path, env, word):
    res = subprocess.run([sys.executable, str(ENTRYPOINT)], env=env_for(CKPTFS_MOUNTPOINT=tmp_path / "m", **env),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptfs-entrypoint: ") and word in lines[0], res.stderr


def test_health_of_something_else(tmp_path):
    res = subprocess.run([sys.executable, str(ENTRYPOINT), "health", str(tmp_path)], capture_output=True,
                         text=True, env=env_for())
    assert res.returncode == 1 and "not a ckptfs mount" in res.stdout


def test_other_commands_run_ckptfs():
    res = subprocess.run([sys.executable, str(ENTRYPOINT), "--help"], capture_output=True, text=True,
                         env=env_for())
    assert res.returncode == 0 and "checkpoint filesystem" in res.stdout


# ---- real mounts -------------------------------------------------------------------

@pytest.fixture
def setting(tmp_path):
    devs = make_devices(tmp_path / "devices", 2, GiB)
    mp = tmp_path / "shared" / "ckpt"
    env = env_for(CKPTFS_DEVICES=",".join(str(d) for d in devs), CKPTFS_MOUNTPOINT=mp, CKPTFS_MEMORY="256M",
                  CKPTFS_FORMAT="if-needed")
    procs: list[subprocess.Popen] = []
    yield devs, mp, env, procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    if is_mounted(mp):
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)


@pytest.mark.mount
def test_formats_blank_devices_serves_and_drains_on_sigterm(setting):
    devs, mp, env, procs = setting
    env["CKPTFS_OWNER"] = "1234:1234"
    p = start(env)
    procs.append(p)
    wait_live(mp, p, owner=(1234, 1234))
    res = subprocess.run([sys.executable, str(ENTRYPOINT), "health"], env=env, capture_output=True, text=True)
    assert res.returncode == 0 and "is live" in res.stdout
    assert os.stat(mp).st_uid == 1234  # CKPTFS_OWNER
    data = os.urandom(20 << 20)
    (mp / "ckpt.pt").write_bytes(data)  # still in memory when SIGTERM comes
    rc, out = stop(p)
    assert rc == 0, out
    assert "the devices are blank: formatting" in out
    assert "stopped: everything is on the devices" in out
    assert not is_mounted(mp)
    assert os.stat(mp).st_mode & 0o777 == 0o555  # the bare mountpoint: nobody writes there by mistake

    mnt = mp.parent.parent / "check"
    mnt.mkdir()
    ckptfs("mount", str(mnt), "--devices", env["CKPTFS_DEVICES"], "--memory", "256M",
           "--log-file", str(mnt.parent / "c.log"), check=True)
    try:
        assert (mnt / "ckpt.pt").read_bytes() == data
    finally:
        ckptfs("umount", str(mnt), check=True)


@pytest.mark.mount
def test_restore_from_restores_blank_devices_then_mounts_the_pool_as_it_is(setting, s3, tmp_path):
    from s3seed import publish
    devs, mp, env, procs = setting
    bucket = f"entrypoint-restore-{os.getpid()}"
    client = s3.client()
    client.create_bucket(Bucket=bucket)
    tree = tmp_path / "tree"
    tree.mkdir()
    data = os.urandom((5 << 20) + 77)
    (tree / "ckpt.pt").write_bytes(data)
    publish(client, bucket, "pod-0", tree)
    env.update(s3.env(), CKPTFS_RESTORE_FROM=f"s3://{bucket}/pod-0", CKPTFS_S3_ENDPOINT=s3.endpoint)
    p = start(env)
    procs.append(p)
    wait_live(mp, p)
    assert (mp / "ckpt.pt").read_bytes() == data  # fetched on first read
    rc, out = stop(p)
    assert rc == 0 and "the devices are blank: restoring" in out and "stopped: everything is on the devices" in out
    p = start(env)  # a restart: the pool is mounted as it is
    procs.append(p)
    wait_live(mp, p)
    assert (mp / "ckpt.pt").read_bytes() == data
    rc, out = stop(p)
    assert rc == 0 and "mounting what they hold" in out and "--restore-from" not in out, out


@pytest.mark.mount
def test_clears_a_killed_daemons_stale_mount_and_keeps_the_pool(setting):
    devs, mp, env, procs = setting
    p = start(env)
    procs.append(p)
    wait_live(mp, p)
    (mp / "keep.bin").write_bytes(b"k" * 300000)
    ckptfs("sync", str(mp), check=True)
    pid = int(os.getxattr(mp, "user.ckptfs.pid"))
    os.kill(pid, signal.SIGKILL)  # the daemon dies; the mount stays, dead
    assert p.wait(timeout=30) == 128 + signal.SIGKILL  # the daemon's death, as a shell reports it
    assert E.is_stale(str(mp))

    p2 = start(env)
    procs.append(p2)
    wait_live(mp, p2)
    assert (mp / "keep.bin").read_bytes() == b"k" * 300000
    rc, out = stop(p2)
    assert rc == 0, out
    assert "clearing a stale mount" in out
    assert "mounting what they hold" in out and "blank: formatting" not in out


@pytest.mark.mount
def test_if_needed_never_formats_over_foreign_data(setting):
    devs, mp, env, procs = setting
    with open(devs[1], "r+b") as f:
        f.write(b"\x7fELF not yours")
    res = subprocess.run([sys.executable, str(ENTRYPOINT)], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "not blank" in res.stderr and "ckptfs mount:" in res.stderr, res.stderr
    assert not is_mounted(mp)
    assert devs[1].read_bytes()[:14] == b"\x7fELF not yours"
    assert devs[0].read_bytes().count(0) == GiB  # the blank one was not formatted either


@pytest.mark.mount
def test_refuses_to_mount_over_a_live_mount(setting, tmp_path):
    devs, mp, env, procs = setting
    p = start(env)
    procs.append(p)
    wait_live(mp, p)
    other = make_devices(tmp_path / "other", 1, GiB)
    res = subprocess.run([sys.executable, str(ENTRYPOINT)],
                         env={**env, "CKPTFS_DEVICES": str(other[0])}, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "already a live ckptfs mount" in res.stderr, res.stderr
    assert E.health(str(mp))[0]  # the first one is untouched
    rc, out = stop(p)
    assert rc == 0, out
