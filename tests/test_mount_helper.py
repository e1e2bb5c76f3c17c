"""mount/mount.ckptfs, the mount(8) helper, and the systemd unit template.

The option parser on its own; the helper invoked as mount(8) invokes it (SPEC DIR -o
OPTIONS), for real mounts and for bad options (one line, exit 1, nothing mounted); then
real `mount -t ckptfs`, an fstab line (`mount -T FSTAB DIR`) and `umount`, with the helper
installed in /sbin for the length of the test; and the unit's Exec lines run as systemd
would run them.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from importlib.machinery import SourceFileLoader
from pathlib import Path

import pytest

from mounting import exited, is_mounted, make_devices
from waiting import poll

REPO = Path(__file__).resolve().parent.parent
HELPER = REPO / "mount" / "mount.ckptfs"
UNIT = REPO / "mount" / "ckptfs@.service"
CKPTFS_BIN = str(Path(sys.executable).parent / "ckptfs")
GiB = 1 << 30


def load_helper():
    loader = SourceFileLoader("mount_ckptfs", str(HELPER))
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("mount_ckptfs", loader))
    loader.exec_module(mod)
    return mod


H = load_helper()


def helper(*args: str, name: str = "mount.ckptfs", **kw) -> subprocess.CompletedProcess:
    """Run the helper as mount(8) would: exec'd under its installed name (mount.ckptfs, or
    umount.fuse.ckptfs for umount(8)), with SPEC DIR and then the flags and options."""
    d = Path(tempfile.gettempdir()) / f"ckptfs-helpers-{os.getpid()}"
    d.mkdir(exist_ok=True)
    link = d / name
    if not link.is_symlink():
        link.symlink_to(HELPER)
    env = {**os.environ, "CKPTFS_BIN": CKPTFS_BIN}
    return subprocess.run([str(link), *args], capture_output=True, text=True, env=env, timeout=300, **kw)


def one_line(res: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("mount.ckptfs: "), lines[0]
    assert "Traceback" not in res.stderr
    return lines[0]


# ---- the option parser -------------------------------------------------------------

def test_parses_fstab_style_options():
    opts = H.parse_options("rw,defaults,memory=32G,queue-depth=16,max_lag=0.5,fsync=absorb,format=if-needed,"
                           "chunk_size=4M,log_level=debug,log_file=/var/log/x.log,nofail,_netdev,noatime,"
                           "x-systemd.device-timeout=30,comment=hi,uhelper=ckptfs,foreground")
    assert opts == {"memory": "32G", "queue_depth": 16, "max_lag": "0.5", "fsync": "absorb", "format": "if-needed",
                    "chunk_size": "4M", "log_level": "debug", "log_file": "/var/log/x.log", "foreground": True}
    assert H.parse_options("") == {}
    assert H.parse_options("memory=25%")["memory"] == "25%"
    assert H.parse_options("memory=1.5GiB")["memory"] == "1.5GiB"
    assert H.parse_options("engine=native,threads=4") == {"engine": "native", "threads": 4}
    assert H.parse_options("dedupe=off") == {"dedupe": "off"}


@pytest.mark.parametrize("text, words", [
    ("memory=lots", ["memory=lots", "512M"]),
    ("memory=0", ["memory=0"]),
    ("memory=150%", ["memory=150%"]),
    ("memory", ["memory", "needs a value"]),
    ("dedupe=maybe", ["dedupe=maybe", "on or off"]),
    ("fsync=never", ["fsync=never", "durable or absorb"]),
    ("queue_depth=0", ["queue_depth=0", "at least 1"]),
    ("queue_depth=x", ["queue_depth=x"]),
    ("engine=fast", ["engine=fast", "pyfuse3, native"]),
    ("threads=0", ["threads=0", "at least 1"]),
    ("max_lag=0", ["max_lag=0", "above 0"]),
    ("max_lag=-1", ["max_lag=-1"]),
    ("max_lag=soon", ["max_lag=soon"]),
    ("format=yes", ["format=yes", "never or if-needed", "--force"]),
    ("format=always", ["format=always"]),
    ("log_level=loud", ["log_level=loud"]),
    ("chunk_size=big", ["chunk_size=big"]),
    ("ro", ["ro", "read-write"]),
    ("user", ["user", "root"]),
    ("noexec", ["noexec"]),
    ("sync", ["sync", "fsync"]),
    ("loop", ["loop"]),
    ("remount", ["remount"]),
    ("frobnicate", ["unknown option frobnicate", "memory="]),
    ("memory=1G,memory=2G", ["twice"]),
    ("foreground=1", ["foreground", "no value"]),
    ("noatime=1", ["noatime", "no value"]),
])
def test_rejects_bad_options_with_a_clear_message(text, words):
    with pytest.raises(H.UsageError) as e:
        H.parse_options(text)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_sloppy_ignores_unknown_options_but_not_bad_values():
    warned = []
    assert H.parse_options("frobnicate,memory=1G", sloppy=True, warn=warned.append) == {"memory": "1G"}
    assert warned and "frobnicate" in warned[0]
    with pytest.raises(H.UsageError):
        H.parse_options("memory=lots", sloppy=True)


def test_parses_argv_as_mount_passes_it():
    a = H.parse_argv(["/dev/a,/dev/b", "/ckpt", "-v", "-o", "rw,memory=1G", "-n", "-t", "ckptfs"])
    assert a["devices"] == ["/dev/a", "/dev/b"] and a["mountpoint"] == "/ckpt"
    assert a["verbose"] and a["nomtab"] and not a["fake"]
    assert a["options"] == "rw,memory=1G"
    assert H.parse_argv(["d", "/m", "-sfv", "-omemory=2G"])["options"] == "memory=2G"
    assert H.parse_argv(["d", "/m", "-r"])["options"] == "ro"  # and then refused
    for bad in (["d"], ["d", "/m", "extra"], ["d", "/m", "-o"], ["d", "/m", "-t", "ext4"], ["d,,e", "/m"],
                ["d", "/m", "-N", "/proc/1/ns/mnt"], ["d", "/m", "--bogus"], ["d", "/m", "-q"]):
        with pytest.raises(H.UsageError):
            H.parse_argv(bad)


def test_translates_to_the_ckptfs_command_line():
    args = H.parse_argv(["/dev/a,/dev/b", "/ckpt", "-o", "memory=8G,fsync=absorb,queue_depth=4,max_lag=1.5,"
                                                          "engine=native,threads=3,dedupe=off,foreground"])
    fmt, cmd = H.mount_commands("/x/ckptfs", args, H.parse_options(args["options"]))
    assert fmt is None
    assert cmd == ["/x/ckptfs", "mount", "/ckpt", "--devices", "/dev/a,/dev/b", "--memory", "8G",
                   "--fsync", "absorb", "--dedupe", "off", "--queue-depth", "4", "--max-lag", "1.5", "--engine",
                   "native", "--threads", "3", "--foreground"]


def test_replication_options_reach_the_ckptfs_command_line():
    args = H.parse_argv(["/dev/a", "/ckpt", "-o", "replicate=s3://ckpt/run/node-3,s3_endpoint=http://10.0.0.5:8333,"
                                                  "replicate-rate=100M,replicate_keep=5,replicate_memory=1G,"
                                                  "replicate_priority=low,replicate_keep_hourly=0,"
                                                  "replicate_keep_within=2h,s3_sse=aws:kms,s3_sse_kms_key_id=k1,"
                                                  "s3_region=eu-west-1,s3_storage_class=STANDARD_IA"])
    _, cmd = H.mount_commands("/x/ckptfs", args, H.parse_options(args["options"]))
    assert cmd[5:] == ["--replicate", "s3://ckpt/run/node-3", "--s3-endpoint", "http://10.0.0.5:8333",
                       "--replicate-rate", "100M", "--replicate-keep", "5", "--replicate-keep-hourly", "0",
                       "--replicate-keep-within", "2h", "--replicate-memory", "1G",
                       "--replicate-priority", "low", "--s3-region", "eu-west-1", "--s3-sse", "aws:kms",
                       "--s3-sse-kms-key-id", "k1", "--s3-storage-class", "STANDARD_IA"]
    args = H.parse_argv(["/dev/a", "/ckpt", "-o", "replicate=s3://ckpt/run/node-3,replicate_takeover,foreground"])
    _, cmd = H.mount_commands("/x/ckptfs", args, H.parse_options(args["options"]))
    assert cmd[5:] == ["--replicate", "s3://ckpt/run/node-3", "--replicate-takeover", "--foreground"]
    with pytest.raises(H.UsageError) as e:
        H.parse_options("replicate_takeover=yes")
    assert "takes no value" in str(e.value)
    for bad, word in (("replicate=ckpt/run", "s3://"), ("s3_endpoint=10.0.0.5", "http://"),
                      ("replicate_rate=fast", "replicate_rate=fast"), ("replicate_keep=0", "at least 1"),
                      ("replicate_priority=realtime", "idle, low, normal"), ("s3_sse=rot13", "AES256"),
                      ("replicate_keep_within=soon", "30m"), ("replicate_keep_daily=-1", "whole number")):
        with pytest.raises(H.UsageError) as e:
            H.parse_options(bad)
        assert word in str(e.value)


def test_restore_options_restore_blank_devices_only(tmp_path):
    devs = make_devices(tmp_path / "devices", 2, 4 << 20)
    spec = ",".join(str(d) for d in devs)
    args = H.parse_argv([spec, "/ckpt", "-o", "format=if-needed,replicate=s3://ckpt/run/node-3,"
                                              "restore_from=s3://ckpt/run/node-3,s3_endpoint=http://10.0.0.5:8333,"
                                              "restore-rate=200M,restore_concurrency=4"])
    opts = H.parse_options(args["options"])
    fmt, cmd = H.mount_commands("/x/ckptfs", args, opts)
    assert fmt is None  # the mount formats, then restores into the pool
    assert cmd[5:] == ["--format", "--restore-from", "s3://ckpt/run/node-3", "--restore-if-any",
                       "--replicate", "s3://ckpt/run/node-3", "--s3-endpoint", "http://10.0.0.5:8333",
                       "--restore-rate", "200M", "--restore-concurrency", "4"]
    with open(devs[1], "r+b") as f:  # a pool (or anything) on the devices: mounted as it is
        f.write(b"pool")
    fmt, cmd = H.mount_commands("/x/ckptfs", args, opts)
    assert fmt is None and "--format" not in cmd and "--restore-from" not in cmd
    assert cmd[-4:] == ["--restore-rate", "200M", "--restore-concurrency", "4"]  # an interrupted restore's
    for bad, word in (("restore_from=s3://ckpt/p", "format=if-needed"),
                      ("format=if-needed,restore_from=ckpt/p", "s3://"),
                      ("restore_rate=fast", "restore_rate=fast"), ("restore_concurrency=0", "at least 1")):
        with pytest.raises(H.UsageError) as e:
            H.parse_options(bad)
        assert word in str(e.value) and "\n" not in str(e.value)


def test_fake_mount_validates_and_says_what_it_would_run(tmp_path):
    res = helper("/dev/a,/dev/b", str(tmp_path), "-f", "-o", "rw,memory=1G,nofail")
    assert res.returncode == 0, res.stderr
    assert f"would run: {CKPTFS_BIN} mount {tmp_path} --devices /dev/a,/dev/b --memory 1G" in res.stderr


@pytest.mark.parametrize("opts, word", [("memory=lots", "memory=lots"), ("ro", "ro"), ("bogus=1", "bogus"),
                                        ("format=yes", "format=yes")])
def test_bad_options_one_line_exit_1_nothing_mounted(tmp_path, opts, word):
    devs = make_devices(tmp_path / "devices", 1, 64 << 20)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = helper(str(devs[0]), str(mnt), "-o", opts)
    assert res.returncode == 1
    assert word in one_line(res)
    assert not is_mounted(mnt)
    assert devs[0].read_bytes().count(0) == 64 << 20  # nothing written to the device


def test_missing_ckptfs_is_one_clear_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CKPTFS_BIN"}
    env["PATH"] = "/nonexistent"
    copy = tmp_path / "mount.ckptfs"
    shutil.copy(HELPER, copy)  # away from a venv's bin/, where it would find ckptfs beside itself
    res = subprocess.run([sys.executable, str(copy), "a", str(tmp_path), "-o", "memory=1G"], capture_output=True,
                         text=True, env=env)
    if res.returncode == 1 and "cannot find the ckptfs command" in res.stderr:
        return
    assert shutil.which("ckptfs", path="/usr/local/bin:/opt/ckptfs/bin"), res.stderr  # found one installed


# ---- real mounts through the helper ------------------------------------------------

@pytest.fixture
def pool(tmp_path):
    devs = make_devices(tmp_path / "devices", 2, GiB)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    yield ",".join(str(d) for d in devs), mnt
    if is_mounted(mnt):
        subprocess.run([CKPTFS_BIN, "umount", str(mnt)], capture_output=True)
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.mount
def test_helper_mounts_and_umount_helper_drains(pool, tmp_path):
    devices, mnt = pool
    opts = f"rw,memory=256M,format=if-needed,queue_depth=4,log_file={tmp_path}/d.log,nofail"
    res = helper(devices, str(mnt), "-o", opts)
    assert res.returncode == 0, res.stderr
    assert is_mounted(mnt)
    data = os.urandom(5 << 20)
    (mnt / "x.bin").write_bytes(data)
    pid = int(os.getxattr(mnt, "user.ckptfs.pid"))

    res = helper(str(mnt), name="umount.fuse.ckptfs")  # as umount(8) runs it
    assert res.returncode == 0, res.stderr
    assert not is_mounted(mnt)
    assert not os.path.exists(f"/proc/{pid}/cmdline") or not open(f"/proc/{pid}/cmdline").read()

    # again with format=if-needed: the devices hold a pool now, so nothing is formatted
    res = helper(devices, str(mnt), "-o", opts)
    assert res.returncode == 0, res.stderr
    assert (mnt / "x.bin").read_bytes() == data
    assert helper(str(mnt), name="umount.fuse.ckptfs").returncode == 0


@pytest.mark.mount
def test_format_if_needed_never_overwrites_foreign_data(pool, tmp_path):
    devices, mnt = pool
    first = devices.split(",")[0]
    with open(first, "r+b") as f:
        f.seek(4096)
        f.write(b"someone else's data")
    res = helper(devices, str(mnt), "-o", "memory=256M,format=if-needed")
    assert res.returncode == 32, res.stderr
    assert "ckptfs mount:" in res.stderr  # ckptfs's own one-line reason
    assert not is_mounted(mnt)
    with open(first, "rb") as f:
        f.seek(4096)
        assert f.read(19) == b"someone else's data"


@pytest.mark.mount
def test_restore_from_restores_blank_devices_then_mounts_the_pool_as_it_is(pool, tmp_path, s3, monkeypatch):
    from s3seed import publish
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    bucket = f"helper-restore-{os.getpid()}"
    client = s3.client()
    client.create_bucket(Bucket=bucket)
    tree = tmp_path / "tree"
    (tree / "step-1").mkdir(parents=True)
    data = os.urandom((3 << 20) + 123)
    (tree / "step-1" / "model.pt").write_bytes(data)
    publish(client, bucket, "node-3", tree)
    devices, mnt = pool
    opts = (f"memory=256M,format=if-needed,restore_from=s3://{bucket}/node-3,s3_endpoint={s3.endpoint},"
            f"restore_concurrency=2,log_file={tmp_path}/d.log")
    res = helper(devices, str(mnt), "-o", opts)
    assert res.returncode == 0, res.stderr
    assert (mnt / "step-1" / "model.pt").read_bytes() == data  # fetched on first read
    assert helper(str(mnt), name="umount.fuse.ckptfs").returncode == 0
    # the devices hold the restored pool now: mounted as it is, nothing formatted or restored again
    res = helper(devices, str(mnt), "-f", "-o", opts)
    assert res.returncode == 0 and "--restore-from" not in res.stderr and "--format" not in res.stderr, res.stderr
    assert helper(devices, str(mnt), "-o", opts).returncode == 0
    assert (mnt / "step-1" / "model.pt").read_bytes() == data
    assert helper(str(mnt), name="umount.fuse.ckptfs").returncode == 0
    # blank devices and a prefix that holds nothing yet (a job's first start): an empty pool
    fresh = ",".join(str(d) for d in make_devices(tmp_path / "fresh", 2, GiB))
    res = helper(fresh, str(mnt), "-o", opts.replace("/node-3", "/node-4"))
    assert res.returncode == 0, res.stderr
    assert "nothing replicated under" in res.stderr and not os.listdir(mnt)
    assert helper(str(mnt), name="umount.fuse.ckptfs").returncode == 0


@pytest.mark.mount
def test_an_fstab_mount_with_replication_comes_up_while_the_store_is_down(pool, tmp_path, monkeypatch):
    """replicate= toward a store nothing answers for (a reboot during an outage): the helper mounts,
    the node's files are served and made durable, and status names the outage."""
    for k, v in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    devices, mnt = pool
    opts = (f"memory=256M,format=if-needed,log_file={tmp_path}/d.log,replicate=s3://ckpt/node-0,"
            f"s3_endpoint=http://127.0.0.1:9,_netdev,nofail")
    res = helper(devices, str(mnt), "-o", opts)
    assert res.returncode == 0 and is_mounted(mnt), res.stderr
    assert "cannot be reached now" in res.stderr, res.stderr
    (mnt / "x.bin").write_bytes(b"x" * (3 << 20))
    assert subprocess.run([CKPTFS_BIN, "wait", str(mnt / "x.bin")], timeout=60).returncode == 0
    poll(lambda: "Replication failing (network)" in subprocess.run(
        [CKPTFS_BIN, "status", str(mnt)], capture_output=True, text=True).stdout, "the outage in status", timeout=60)
    assert helper(str(mnt), name="umount.fuse.ckptfs").returncode == 0


@pytest.mark.mount
def test_ckptfs_mount_failure_is_exit_32(pool):
    devices, mnt = pool  # blank devices, no format option: not a pool
    res = helper(devices, str(mnt), "-o", "memory=256M")
    assert res.returncode == 32
    assert not is_mounted(mnt)


@pytest.fixture
def sbin_helpers(tmp_path):
    """The helpers in /sbin (where mount(8) looks) for the length of a test, via mount/install.sh."""
    targets = [Path("/sbin/mount.ckptfs"), Path("/sbin/umount.fuse.ckptfs"), Path("/sbin/umount.ckptfs")]
    if any(t.exists() or t.is_symlink() for t in targets):
        pytest.skip("a mount.ckptfs is already installed in /sbin: not replacing it")
    dest = tmp_path / "dest"
    res = subprocess.run(["bash", str(REPO / "mount" / "install.sh"), "--ckptfs", CKPTFS_BIN],
                         env={**os.environ, "DESTDIR": str(dest)}, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    try:
        shutil.copy2(dest / "sbin" / "mount.ckptfs", targets[0])
        for t in targets[1:]:
            os.symlink("mount.ckptfs", t)
        yield dest
    finally:
        for t in targets:
            try:
                t.unlink()
            except FileNotFoundError:
                pass


@pytest.mark.mount
@pytest.mark.skipif(not shutil.which("mount"), reason="needs mount(8)")
def test_real_mount_t_ckptfs_fstab_and_umount(sbin_helpers, pool, tmp_path):
    devices, mnt = pool
    env = {k: v for k, v in os.environ.items() if k != "CKPTFS_BIN"}  # install.sh baked the path in
    log = tmp_path / "d.log"
    res = subprocess.run(["mount", "-t", "ckptfs", devices, str(mnt), "-o",
                          f"memory=256M,format=if-needed,uhelper=ckptfs,log_file={log}"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert is_mounted(mnt)
    (mnt / "a.txt").write_text("through mount -t ckptfs")
    pid = int(os.getxattr(mnt, "user.ckptfs.pid"))
    res = subprocess.run(["umount", str(mnt)], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert not is_mounted(mnt)
    assert not os.path.exists(f"/proc/{pid}/cmdline") or not open(f"/proc/{pid}/cmdline").read(), \
        "umount(8) should wait for the daemon (umount.fuse.ckptfs runs ckptfs umount)"

    fstab = tmp_path / "fstab"
    fstab.write_text(f"# ckptfs\n{devices}  {mnt}  ckptfs  memory=256M,format=if-needed,uhelper=ckptfs,"
                     f"log_file={log},nofail,x-systemd.device-timeout=30  0 0\n")
    res = subprocess.run(["mount", "-T", str(fstab), str(mnt)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert (mnt / "a.txt").read_text() == "through mount -t ckptfs"
    pid = int(os.getxattr(mnt, "user.ckptfs.pid"))
    assert subprocess.run(["umount", str(mnt)], env=env, timeout=300).returncode == 0
    assert not os.path.exists(f"/proc/{pid}/cmdline") or not open(f"/proc/{pid}/cmdline").read()

    fstab.write_text(f"{devices}  {mnt}  ckptfs  memory=256M,wrongopt  0 0\n")
    res = subprocess.run(["mount", "-T", str(fstab), str(mnt)], capture_output=True, text=True, env=env)
    assert res.returncode != 0 and "unknown option wrongopt" in res.stderr, res.stderr
    assert not is_mounted(mnt)

    if shutil.which("systemd-analyze"):  # the unit's commands exist now: it must verify clean
        unit = tmp_path / "ckptfs@test.service"
        shutil.copy(UNIT, unit)
        res = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
        assert res.returncode == 0 and not res.stderr.strip(), res.stderr


# ---- the systemd unit template -----------------------------------------------------

def unit_exec_lines() -> dict:
    """The [Service] section: key -> values, in order (keys such as ExecStartPre repeat)."""
    raw: dict[str, list[str]] = {}
    section = None
    for line in UNIT.read_text().splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "Service" and "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            raw.setdefault(k, []).append(v)
    return raw


def test_unit_template_shape():
    svc = unit_exec_lines()
    assert svc["Type"] == ["forking"]
    assert svc["EnvironmentFile"] == ["/etc/ckptfs/%i.conf"]
    assert svc["ExecStart"][0].startswith("/sbin/mount.ckptfs ${DEVICES} ${MOUNTPOINT} -o ${OPTIONS}")
    assert svc["ExecStop"] == ["/sbin/umount.fuse.ckptfs ${MOUNTPOINT}"]
    assert int(svc["TimeoutStopSec"][0]) >= 120  # the drain
    assert "WantedBy=multi-user.target" in UNIT.read_text()


@pytest.mark.mount
def test_unit_commands_mount_and_drain_as_systemd_runs_them(pool, tmp_path):
    """ExecStartPre/ExecStart/ExecStop with the EnvironmentFile's variables, in order."""
    devices, mnt = pool
    conf = {"MOUNTPOINT": str(mnt / "sub"), "DEVICES": devices,
            "OPTIONS": f"memory=256M,format=if-needed,log_file={tmp_path}/u.log"}
    svc = unit_exec_lines()

    def run(line: str) -> int:
        ignore = line.startswith("-")
        argv = []
        for word in _systemd_split(line.lstrip("-")):
            word = re.sub(r"\$\{(\w+)\}", lambda m: conf[m.group(1)], word)
            argv.append(word)
        if argv[0] in ("/sbin/mount.ckptfs", "/sbin/umount.fuse.ckptfs"):
            name = argv[0].rsplit("/", 1)[1]
            res = helper(*argv[1:], name=name)
        else:
            res = subprocess.run(argv, capture_output=True, text=True)
        assert ignore or res.returncode == 0, f"{line}: {res.stderr}"
        return res.returncode

    for line in svc["ExecStartPre"]:
        if "modprobe" not in line:
            run(line)
    run(svc["ExecStart"][0])
    assert is_mounted(conf["MOUNTPOINT"])
    (Path(conf["MOUNTPOINT"]) / "f").write_bytes(b"x" * 100000)
    run(svc["ExecStop"][0])
    assert not is_mounted(conf["MOUNTPOINT"])

    # a killed daemon's dead mount: the ExecStartPre clears it and the unit starts again
    run(svc["ExecStart"][0])
    pid = int(os.getxattr(conf["MOUNTPOINT"], "user.ckptfs.pid"))
    os.kill(pid, 9)
    poll(lambda: exited(pid), None, timeout=10, every=0.05)
    for line in svc["ExecStartPre"]:
        if "modprobe" not in line:
            run(line)
    run(svc["ExecStart"][0])
    assert (Path(conf["MOUNTPOINT"]) / "f").read_bytes() == b"x" * 100000
    run(svc["ExecStop"][0])


def _systemd_split(line: str) -> list[str]:
    return shlex.split(line)  # enough for this unit: no specifiers but %i, quotes as in sh
