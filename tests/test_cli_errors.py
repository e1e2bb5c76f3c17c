"""Bad input to the CLI: one clear line on stderr, a non-zero exit, nothing mounted.

And bad requests to a live mount: the right errno, and the daemon lives on.
"""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mounting import ckptfs, is_mounted, make_devices

pytestmark = pytest.mark.mount

GiB = 1 << 30


def assert_one_clear_line(res: subprocess.CompletedProcess, *words: str, command: str = "mount") -> str:
    assert res.returncode != 0, res.stdout
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{res.stderr}"
    line = lines[0]
    assert line.startswith(f"ckptfs {command}: "), line
    assert "Traceback" not in res.stderr
    for w in words:
        assert w in line, f"{w!r} not in {line!r}"
    return line


@pytest.fixture
def setup(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    devs = make_devices(tmp_path / "devices", 2, GiB)
    return mnt, devs


def mount(mnt, devs, *more, memory="64M", fmt=True):
    args = ["mount", str(mnt), "--devices", ",".join(map(str, devs)), "--memory", memory,
            "--log-file", str(Path(mnt).parent / "daemon.log")]
    return ckptfs(*args, *(("--format",) if fmt else ()), *more)


# ---- mountpoint ------------------------------------------------------------------

def test_missing_mountpoint(setup, tmp_path):
    _, devs = setup
    res = mount(tmp_path / "nope", devs)
    assert_one_clear_line(res, "does not exist", str(tmp_path / "nope"))
    assert not is_mounted(tmp_path / "nope")


def test_mountpoint_is_a_file(setup, tmp_path):
    _, devs = setup
    f = tmp_path / "file"
    f.write_bytes(b"")
    assert_one_clear_line(mount(f, devs), "not a directory")
    assert not is_mounted(f)


def test_mount_twice(setup, tmp_path):
    mnt, devs = setup
    assert mount(mnt, devs).returncode == 0
    try:
        other = make_devices(tmp_path / "other", 1, GiB)
        assert_one_clear_line(mount(mnt, other), "already mounted")
        # the first mount is untouched
        (mnt / "f").write_bytes(b"still here")
        assert (mnt / "f").read_bytes() == b"still here"
    finally:
        assert ckptfs("umount", str(mnt)).returncode == 0
    assert not is_mounted(mnt)


def test_devices_in_use_by_another_mount(setup, tmp_path):
    mnt, devs = setup
    assert mount(mnt, devs).returncode == 0
    mnt2 = tmp_path / "mnt2"
    mnt2.mkdir()
    try:
        (mnt / "f").write_bytes(b"data")
        for fmt in (False, True):
            assert_one_clear_line(mount(mnt2, devs, fmt=fmt), "in use", str(devs[0]))
            assert not is_mounted(mnt2)
        line = assert_one_clear_line(ckptfs("format", "--devices", str(devs[1]), "--force"), "in use",
                                     command="format")
        assert str(devs[1]) in line
        assert (mnt / "f").read_bytes() == b"data"
    finally:
        assert ckptfs("umount", str(mnt)).returncode == 0
    # once unmounted, the devices are free again
    assert mount(mnt2, devs, fmt=False).returncode == 0
    try:
        assert (mnt2 / "f").read_bytes() == b"data"
    finally:
        assert ckptfs("umount", str(mnt2)).returncode == 0


# ---- /dev/fuse -----------------------------------------------------------------

def run_in_mount_ns(script: str, *cli: str, user: str | None = None) -> subprocess.CompletedProcess:
    """Run `script` (sh) then the ckptfs CLI in a private mount namespace, maybe as `user`."""
    runner = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if user else []
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-ec",
           script + '\nexec "$@"', "sh", *runner, sys.executable, "-m", "ckptfs", *cli]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd="/")


def test_dev_fuse_missing(setup):
    mnt, devs = setup
    res = run_in_mount_ns("mount -t tmpfs tmpfs /dev", "mount", str(mnt), "--devices", str(devs[0]),
                          "--memory", "64M", "--format")
    assert_one_clear_line(res, "/dev/fuse is missing")
    assert not is_mounted(mnt)


def test_dev_fuse_not_a_char_device(setup, tmp_path):
    mnt, devs = setup
    fake = tmp_path / "fake-fuse"
    fake.write_bytes(b"")
    res = run_in_mount_ns(f"mount --bind {fake} /dev/fuse", "mount", str(mnt), "--devices", str(devs[0]),
                          "--memory", "64M", "--format")
    assert_one_clear_line(res, "/dev/fuse is not a character device")
    assert not is_mounted(mnt)


# ---- memory ----------------------------------------------------------------------

@pytest.mark.parametrize("memory,words", [
    ("12Q", ("bad --memory", "12Q")),
    ("0", ("bad --memory", "greater than zero")),
    ("150%", ("bad --memory", "150%")),
    ("lots", ("bad --memory", "lots")),
    ("1M", ("too small",)),
])
def test_bad_memory(setup, memory, words):
    mnt, devs = setup
    assert_one_clear_line(mount(mnt, devs, memory=memory), *words)
    assert not is_mounted(mnt)


def test_memory_smaller_than_two_chunks_formats_nothing(setup):
    mnt, devs = setup
    res = mount(mnt, devs, "--chunk-size", "64M", memory="64M")
    assert_one_clear_line(res, "too small", "--chunk-size")
    assert devs[0].read_bytes()[:4096] == bytes(4096)  # refused before formatting
    assert not is_mounted(mnt)


@pytest.mark.parametrize("option,value,words", [
    ("--chunk-size", "3000", ("bad --chunk-size", "power of two")),
    ("--chunk-size", "1K", ("bad --chunk-size",)),
    ("--chunk-size", "0", ("bad --chunk-size",)),
    ("--queue-depth", "0", ("bad --queue-depth",)),
    ("--max-lag", "0", ("bad --max-lag", "above 0", "--drain eager")),
    ("--max-lag", "-1", ("bad --max-lag",)),
    ("--max-lag", "soon", ("bad --max-lag", "soon")),
    ("--max-lag", "inf", ("bad --max-lag",)),
])
def test_bad_tunables(setup, option, value, words):
    mnt, devs = setup
    res = mount(mnt, devs, option, value)
    assert_one_clear_line(res, *words)
    assert res.returncode == 2
    assert not is_mounted(mnt)


def test_log_file_that_cannot_be_written(setup, tmp_path):
    mnt, devs = setup
    log = tmp_path / "no" / "such" / "dir" / "daemon.log"
    res = ckptfs("mount", str(mnt), "--devices", ",".join(map(str, devs)), "--memory", "64M",
                 "--format", "--log-file", str(log))
    assert_one_clear_line(res, "log file", str(log), "directory does not exist")
    assert devs[0].read_bytes()[:4096] == bytes(4096)  # refused before formatting
    assert not is_mounted(mnt)


def test_memory_larger_than_ram(setup):
    mnt, devs = setup
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    res = mount(mnt, devs, memory=f"{ram * 2 >> 20}M")
    assert_one_clear_line(res, "more than this machine can spare")
    assert not is_mounted(mnt)


# ---- devices -------------------------------------------------------------------

def test_missing_device(setup, tmp_path):
    mnt, devs = setup
    res = mount(mnt, [devs[0], tmp_path / "ghost.img"])
    assert_one_clear_line(res, "ghost.img", "does not exist")
    assert not is_mounted(mnt)


def test_no_devices(setup):
    mnt, _ = setup
    for spec in ("", ",", f"{setup[1][0]},"):
        res = ckptfs("mount", str(mnt), "--devices", spec, "--memory", "64M")
        assert_one_clear_line(res, "--devices")
    assert not is_mounted(mnt)


def test_duplicated_device(setup, tmp_path):
    mnt, devs = setup
    assert_one_clear_line(mount(mnt, [devs[0], devs[1], devs[0]]), "listed twice")
    link = tmp_path / "alias.img"
    link.symlink_to(devs[1])
    line = assert_one_clear_line(mount(mnt, [devs[0], devs[1], link]), "listed twice")
    assert str(link) in line
    assert not is_mounted(mnt)


def test_device_is_a_directory(setup, tmp_path):
    mnt, devs = setup
    (tmp_path / "adir").mkdir()
    assert_one_clear_line(mount(mnt, [devs[0], tmp_path / "adir"]), "is a directory")
    assert not is_mounted(mnt)


def test_device_too_small(setup, tmp_path):
    mnt, _ = setup
    small = make_devices(tmp_path / "small", 1, 8 << 20)
    assert_one_clear_line(mount(mnt, small), "too small")
    assert not is_mounted(mnt)


def test_unformatted_device_without_format(setup):
    mnt, devs = setup
    assert_one_clear_line(mount(mnt, devs, fmt=False), "not formatted")
    assert not is_mounted(mnt)


# ---- permissions: the CLI run as user nobody -------------------------------------

@pytest.fixture
def nobody_env():
    """A directory nobody can reach, and a mount-namespace script that lets nobody run the venv
    (the interpreter lives under /root, which is mode 0700): /root is covered by a 0755
    tmpfs holding only the interpreter's .pyenv, bound from its real place."""
    base = Path(tempfile.mkdtemp(prefix="ckptfs-nobody-", dir="/tmp"))
    base.chmod(0o755)
    real_py = Path(os.path.realpath(sys.executable))
    script = ""
    if str(real_py).startswith("/root/"):
        top = Path("/root") / real_py.relative_to("/root").parts[0]  # e.g. /root/.pyenv
        keep = base / "keep"
        keep.mkdir()
        script = (f"mount --bind {top} {keep}\n"
                  f"mount -t tmpfs -o mode=0755 tmpfs /root\n"
                  f"mkdir -p {top}\n"
                  f"mount --bind {keep} {top}\n")
    try:
        yield base, script
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_no_permission_for_dev_fuse(nobody_env):
    base, script = nobody_env
    if os.stat("/dev/fuse").st_mode & 0o006 == 0o006:
        pytest.skip("/dev/fuse is open to everyone here")
    mnt = base / "mnt"
    mnt.mkdir()
    dev = make_devices(base / "devs", 1, GiB)[0]
    res = run_in_mount_ns(script, "mount", str(mnt), "--devices", str(dev), "--memory", "64M",
                          user="nobody")
    assert_one_clear_line(res, "no permission", "/dev/fuse")
    assert not is_mounted(mnt)


def test_no_permission_for_device(nobody_env):
    base, script = nobody_env
    mnt = base / "mnt"
    mnt.mkdir()
    dev = make_devices(base / "devs", 1, GiB)[0]
    (base / "devs").chmod(0o755)
    dev.chmod(0o600)  # root's
    # a /dev/fuse nobody may use, only inside the namespace, so the device check is reached
    node = base / "fuse-node"
    rdev = os.stat("/dev/fuse").st_rdev
    os.mknod(node, 0o666 | 0o020000, rdev)
    node.chmod(0o666)
    res = run_in_mount_ns(script + f"mount --bind {node} /dev/fuse\n", "mount", str(mnt),
                          "--devices", str(dev), "--memory", "64M", user="nobody")
    assert_one_clear_line(res, "no permission", str(dev))
    assert not is_mounted(mnt)


# ---- umount --------------------------------------------------------------------

def test_umount_not_mounted(tmp_path):
    res = ckptfs("umount", str(tmp_path))
    assert_one_clear_line(res, "not mounted", command="umount")
    res = ckptfs("umount", str(tmp_path / "missing"))
    assert_one_clear_line(res, "does not exist", command="umount")


def test_umount_of_another_filesystem(tmp_path):
    mp = tmp_path / "tmpfs"
    mp.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mp)], check=True)
    try:
        res = ckptfs("umount", str(mp))
        assert_one_clear_line(res, "not a ckptfs mount", command="umount")
        assert is_mounted(mp)  # left alone
    finally:
        subprocess.run(["umount", str(mp)], check=True)


# ---- the daemon survives bad requests ----------------------------------------------

def test_daemon_survives_bad_requests(ckpt):
    p = ckpt.path
    (p / "file").write_bytes(b"content")
    (p / "dir").mkdir()
    (p / "dir" / "inner").write_bytes(b"")

    def fails(code, fn, *args):
        with pytest.raises(OSError) as info:
            fn(*args)
        assert info.value.errno == code, (fn, args, info.value)

    fails(errno.ENOENT, os.open, p / "nonexistent", os.O_RDONLY)
    fails(errno.ENOENT, os.stat, p / "no" / "such" / "path")
    fails(errno.ENOTDIR, os.rmdir, p / "file")
    fails(errno.ENOTEMPTY, os.rmdir, p / "dir")
    fails(errno.EINVAL, os.readlink, p / "file")
    fails(errno.ENOTDIR, os.listdir, p / "file")
    fails(errno.ENOTDIR, os.open, p / "file" / "child", os.O_CREAT | os.O_WRONLY)
    fails(errno.EEXIST, os.mkdir, p / "dir")
    fails(errno.EISDIR, os.open, p / "dir", os.O_WRONLY)
    fails(errno.EINVAL, os.rename, p / "dir", p / "dir" / "sub")
    fails(errno.ENODATA, os.getxattr, p / "file", "user.none")
    fails(errno.E2BIG, os.setxattr, p / "file", "user.big", b"x" * 70_000)
    fails(errno.ERANGE, os.setxattr, p / "file", "user." + "n" * 300, b"x")
    fails(errno.EPERM, os.setxattr, p, "user.ckptfs.pid", b"1")
    fails(errno.ENAMETOOLONG, os.open, p / ("n" * 256), os.O_CREAT | os.O_WRONLY)
    fails(errno.EPERM, os.link, p / "dir", p / "dirlink")
    os.setxattr(p / "file", "trusted.root-only", b"t")  # another namespace, stored as is
    assert os.getxattr(p / "file", "trusted.root-only") == b"t"
    os.mkfifo(p / "fifo")
    assert os.path.exists(p / "fifo") and not os.path.isfile(p / "fifo")
    fd = os.open(p / "file", os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, 1 << 20)  # not implemented by ckptfs: glibc's fallback or an error
    except OSError as e:
        assert e.errno in (errno.EOPNOTSUPP, errno.ENOSYS), e
    os.close(fd)
    fd = os.open(p / "huge", os.O_CREAT | os.O_RDWR)  # far-out offsets: sparse, nothing allocated
    os.pwrite(fd, b"x", 1 << 45)
    os.ftruncate(fd, 1 << 50)
    assert os.fstat(fd).st_size == 1 << 50 and os.pread(fd, 2, 1 << 45) == b"x\0"
    for whence in (os.SEEK_DATA, os.SEEK_HOLE):
        os.lseek(fd, 0, whence)  # not implemented by ckptfs: the kernel's generic answer
    os.close(fd)
    os.unlink(p / "huge")
    # the daemon is alive and the mount still works
    os.kill(ckpt.pid, 0)
    (p / "after").write_bytes(b"ok")
    assert (p / "after").read_bytes() == b"ok"
    assert (p / "file").read_bytes()[:7] == b"content"
    assert sorted(os.listdir(p)) == ["after", "dir", "fifo", "file"]
    assert "Traceback" not in ckpt.log_text() and "unexpected error" not in ckpt.log_text()


def test_stale_mount_after_a_killed_daemon(ckpt, tmp_path):
    """A SIGKILLed daemon leaves a dead mount: mount refuses it clearly, umount clears it."""
    ckpt.kill(clear=False)
    assert is_mounted(ckpt.path)
    res = ckptfs("mount", str(ckpt.path), "--devices", ckpt.device_arg, "--memory", "64M",
                 "--log-file", str(tmp_path / "again.log"))
    assert_one_clear_line(res, "stale", "ckptfs umount")
    res = ckptfs("umount", str(ckpt.path))
    assert res.returncode == 0 and "stale mount cleared" in res.stdout, res.stderr
    assert not is_mounted(ckpt.path)
    ckpt.mount()  # and the devices mount again
    assert os.listdir(ckpt.path) == []
