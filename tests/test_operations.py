"""Operations on real mounts: status, wait, the state xattr, the control channel, metrics, logs.

Slow drains come from loop devices under a blkio write throttle (throttle.py),
so a file can be watched moving from memory to draining to durable; a device
error comes from device files on a small tmpfs that fills up (ENOSPC from the
device, as from a full or failing disk). Assertions poll with deadlines and
check orders and bounds, not exact timings.
"""
import errno
import json
import os
import pty
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import ckptfs
import nobody
from mounting import CkptMount, ckptfs as run_cli, is_mounted, make_devices
from waiting import poll
from throttle import Throttle

pytestmark = pytest.mark.mount
MiB = 1 << 20




def status_json(m) -> dict:
    res = run_cli("status", str(m.path), "--json", check=True)
    return json.loads(res.stdout)


def xattr_state(path) -> str:
    return os.getxattr(path, "user.ckptfs.state").decode()


@pytest.fixture
def throttled(tmp_path):
    """throttled(bps, memory=...) -> (mount, throttle): a mount over two write-throttled loop devices."""
    made = []

    def make(bps: int, memory: str = "16M", extra=()):
        m = CkptMount(tmp_path / f"t{len(made)}", ndev=2, dev_size=256 * MiB, memory=memory, extra=extra)
        t = Throttle(m.devices, bps)
        made.append((m, t))
        m.devices = t.devices
        m.mount()
        t.add(m.pid)
        return m, t

    yield make
    for m, t in made:
        t.set(0)
        try:
            m.close()
        finally:
            t.close()


class Watch:
    """`ckptfs status MOUNT --watch --json`: one snapshot per interval, collected in a thread."""

    def __init__(self, m, interval=0.1):
        # as at a terminal, Ctrl-C (SIGINT) must reach it: a test run started in the background
        # (`make test &`) would otherwise pass on an ignored SIGINT and stop() would time out
        self.proc = subprocess.Popen([sys.executable, "-m", "ckptfs", "status", str(m.path), "--watch", "--json",
                                      "--interval", str(interval)], stdout=subprocess.PIPE, text=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.snaps: list[dict] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.snaps.append(json.loads(line))

    def entries(self, path: str) -> list[dict | None]:
        """The file's entry in each snapshot so far (None: not listed, i.e. durable)."""
        return [next((f for f in s["files"] if f["path"] == path), None) for s in list(self.snaps)]

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(30)
        self.thread.join(10)
        assert self.proc.returncode == 0


def test_status_follows_a_file_from_memory_through_draining_to_durable(throttled):
    m, _t = throttled(8 * MiB)  # two devices at 8 MB/s each
    path = m.path / "ckpt.pt"
    size = 24 * MiB
    data = os.urandom(size)
    watch = Watch(m)
    try:
        with open(path, "wb") as f:
            f.write(data[:MiB])
            poll(lambda: any(e and e["state"] == "memory" for e in watch.entries("/ckpt.pt")), "memory in status")
            assert xattr_state(path) == "memory"
            f.write(data[MiB:])  # more than --memory 16M: waits for the drain (backpressure)
        assert xattr_state(path) == "draining"
        poll(lambda: watch.entries("/ckpt.pt")[-1:] == [None], "durable in status")
    finally:
        watch.stop()
    assert xattr_state(path) == "durable"

    seen = [e for e in watch.entries("/ckpt.pt")]
    first = next(i for i, e in enumerate(seen) if e is not None)
    states = [e["state"] if e else "durable" for e in seen[first:]]
    order = [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]]
    assert order == ["memory", "draining", "durable"], order
    draining = [e for e in seen if e and e["state"] == "draining"]
    progress = [e["progress"] for e in draining]
    assert progress == sorted(progress)
    assert any(0 < p < 1 for p in progress), progress
    assert all(e["size"] == size and e["bytes"] == size for e in draining)
    # while it drained: device bandwidth and an ETA were reported
    busy = [s for s, e in zip(watch.snaps[first:], seen[first:]) if e and e["state"] == "draining"]
    assert any(sum(d["write_bps"] for d in s["pool"]["devices"]) > 0 for s in busy)
    assert any((s["totals"]["eta_seconds"] or 0) > 0 for s in busy)
    assert all(s["memory"]["undrained"] <= s["memory"]["arena"] for s in watch.snaps)

    st = status_json(m)  # the one-shot command agrees
    assert st["all_durable"] and st["files"] == [] and st["totals"]["files_not_durable"] == 0
    assert st["totals"]["bytes_absorbed"] >= size and st["totals"]["bytes_drained"] >= size
    assert st["totals"]["backpressure_waits"] > 0
    assert [d["health"] for d in st["pool"]["devices"]] == ["ok", "ok"]
    assert sum(d["bytes_written"] for d in st["pool"]["devices"]) >= size
    text = run_cli("status", str(m.path), check=True).stdout  # and the table renders
    assert "Everything is durable" in text and "Pool: 2 device(s)" in text


def test_wait_succeeds_after_the_drain_and_times_out_before(throttled):
    m, t = throttled(2 * MiB, memory="64M")
    path = m.path / "step-1.pt"
    path.write_bytes(os.urandom(16 * MiB))  # about 4 s at 2 x 2 MB/s
    t0 = time.monotonic()
    res = run_cli("wait", "--timeout", "1.5", str(path))
    assert res.returncode == 124, res
    assert "timed out after 1.5s" in res.stderr and "1 of 1 file(s) not durable" in res.stderr
    assert time.monotonic() - t0 < 30
    assert xattr_state(path) == "draining"
    t.set(0)  # lift the throttle: the rest drains at disk speed
    res = run_cli("wait", str(path))
    assert (res.returncode, res.stdout, res.stderr) == (0, "", "")  # quiet when not on a terminal
    assert xattr_state(path) == "durable"
    assert ckptfs.state(path) == "durable"
    (m.path / "d").mkdir()
    (m.path / "d" / "x").write_bytes(b"x" * 5000)
    assert run_cli("wait", str(m.path / "d")).returncode == 0  # a directory: all below it
    assert xattr_state(m.path / "d" / "x") == "durable"
    assert run_cli("wait", str(m.path)).returncode == 0  # the mountpoint: everything
    res = run_cli("wait", str(m.path / "missing"))
    assert res.returncode == 2 and "no such file" in res.stderr


@pytest.fixture
def small_tmpfs(tmp_path):
    where = tmp_path / "small"
    where.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {res.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(path: Path) -> None:
    """Write `path` until its filesystem is full."""
    block = b"\xff" * MiB
    with open(path, "wb") as f:
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    assert os.statvfs(path.parent).f_bavail == 0


def test_wait_fails_with_the_reason_when_a_device_fails(tmp_path, small_tmpfs):
    # sparse device files on a tmpfs that then fills up: every data write fails with ENOSPC,
    # as on a full or failing disk; freeing room lets the daemon's retries succeed
    m = CkptMount(tmp_path / "m", ndev=2, dev_size=256 * MiB, memory="64M")
    m.devices = make_devices(small_tmpfs, 2, 256 * MiB)
    try:
        m.mount()
        fill(small_tmpfs / "filler")
        path = m.path / "big.pt"
        path.write_bytes(os.urandom(8 * MiB))
        res = run_cli("wait", "--timeout", "120", str(path))
        assert res.returncode == 1, res
        assert "/big.pt: drain failed with ENOSPC" in res.stderr and "No space left on device" in res.stderr
        assert xattr_state(path) == "failed:ENOSPC"
        assert ckptfs.state(path) == "failed:ENOSPC"
        st = status_json(m)
        f = next(f for f in st["files"] if f["path"] == "/big.pt")
        assert (f["state"], f["errno"]) == ("failed", "ENOSPC")
        assert st["totals"]["files_failed"] == 1 and "No space left" in st["last_error"]
        assert sum(d["errors"] for d in st["pool"]["devices"]) > 0
        assert {d["health"] for d in st["pool"]["devices"]} & {"failing", "errors"}
        with pytest.raises(ckptfs.DrainFailed) as e:
            ckptfs.wait_durable(path, timeout=120)
        assert e.value.errno == errno.ENOSPC
        res = run_cli("wait", "--timeout", "120", str(m.path))  # the whole mount fails too
        assert res.returncode == 1 and "No space left on device" in res.stderr, res
        os.unlink(small_tmpfs / "filler")  # room again: the retries succeed and wait returns 0
        poll(lambda: run_cli("wait", "--timeout", "120", str(path)).returncode == 0, "recovery", timeout=120,
             every=0.5)
        assert xattr_state(path) == "durable"
    finally:
        try:
            os.unlink(small_tmpfs / "filler")
        except FileNotFoundError:
            pass
        m.close()


def test_control_channel_refuses_another_user():
    if nobody.python() is None:
        pytest.skip("needs root and a python3 that the user nobody can run")
    root = Path(tempfile.mkdtemp(prefix="ckptfs-ops-"))  # under /tmp, so nobody can reach the mount
    m = CkptMount(root, memory="64M")
    try:
        os.chmod(root, 0o755)
        m.mount()
        f = m.path / "f.pt"
        f.write_bytes(os.urandom(3 * MiB))
        sock = os.getxattr(m.path, "user.ckptfs.control").decode()
        assert oct(os.stat(sock).st_mode & 0o777) == "0o600" and os.stat(sock).st_uid == 0
        assert oct(os.stat(os.path.dirname(sock)).st_mode & 0o777) == "0o700"
        env = nobody.cli_env()
        if env is not None:  # the real CLI, as nobody
            res = nobody.run(["-m", "ckptfs", "status", str(m.path)], env=env)
            assert res.returncode == 1 and "permission denied" in res.stderr, res
            res = nobody.run(["-m", "ckptfs", "wait", str(f)], env=env)
            assert res.returncode == 1 and "permission denied" in res.stderr, res
            # the xattr is for everyone, and wait_durable falls back to fsync
            code = "import ckptfs, sys; ckptfs.wait_durable(sys.argv[1], timeout=60); print(ckptfs.state(sys.argv[1]))"
            res = nobody.run(["-c", code, str(f)], env=env)
            assert (res.returncode, res.stdout.strip()) == (0, "durable"), res
        raw = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
               "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    print('EACCES')\n")
        assert nobody.run(["-I", "-c", raw, sock]).stdout.strip() == "EACCES"
        assert status_json(m)["pid"] == m.pid  # root may
    finally:
        m.close()
        shutil.rmtree(root, ignore_errors=True)


def scrape(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(snap: dict, name: str) -> float:
    return sum(v for (n, _), v in snap.items() if n == name)


def test_metrics_endpoint_serves_counters_that_move_during_a_save(throttled):
    m, _t = throttled(8 * MiB, extra=("--metrics-port", "0"))
    url = status_json(m)["metrics_url"]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(OSError):  # bound to 127.0.0.1 only, not to every address
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
    before = scrape(url)
    for name in ("ckptfs_bytes_absorbed_total", "ckptfs_bytes_drained_total", "ckptfs_bytes_skipped_total",
                 "ckptfs_drain_latency_seconds_count", "ckptfs_backpressure_waits_total",
                 "ckptfs_backpressure_wait_seconds_total", "ckptfs_eta_seconds", "ckptfs_records_pending"):
        assert (name, ()) in before, name
    for kind in ("capacity", "undrained", "cached", "free"):
        assert ("ckptfs_memory_bytes", (("kind", kind),)) in before
    for state in ("memory", "draining", "failed", "durable"):
        assert ("ckptfs_files", (("state", state),)) in before
    for name in ("ckptfs_device_written_bytes_total", "ckptfs_device_read_bytes_total", "ckptfs_device_errors_total",
                 "ckptfs_device_write_bytes_per_second", "ckptfs_device_read_bytes_per_second"):
        assert len([k for k in before if k[0] == name]) == 2, name

    size = 24 * MiB
    path = m.path / "model.pt"
    path.write_bytes(os.urandom(size))  # 16M of memory: waits for the drain
    during = []
    while xattr_state(path) != "durable":
        during.append(scrape(url))
        time.sleep(0.1)
    after = scrape(url)
    assert total(after, "ckptfs_bytes_absorbed_total") - total(before, "ckptfs_bytes_absorbed_total") == size
    assert total(after, "ckptfs_bytes_drained_total") - total(before, "ckptfs_bytes_drained_total") >= size
    assert total(after, "ckptfs_device_written_bytes_total") - total(before, "ckptfs_device_written_bytes_total") >= size
    assert total(after, "ckptfs_drain_latency_seconds_count") > total(before, "ckptfs_drain_latency_seconds_count")
    assert total(after, "ckptfs_drain_latency_seconds_sum") > 0
    assert total(after, "ckptfs_backpressure_waits_total") > 0
    assert after[("ckptfs_files", (("state", "durable"),))] == 1
    assert any(s[("ckptfs_files", (("state", "draining"),))] == 1 for s in during)
    assert any(total(s, "ckptfs_device_write_bytes_per_second") > 0 for s in during)
    assert any(s[("ckptfs_memory_bytes", (("kind", "undrained"),))] > 0 for s in during)
    drained = [total(s, "ckptfs_bytes_drained_total") for s in during + [after]]
    assert drained == sorted(drained) and drained[0] < drained[-1]


def test_metrics_port_in_use_is_one_clear_error(ckpt_factory):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        m = ckpt_factory(memory="64M", extra=("--metrics-port", str(busy.getsockname()[1])))
        with pytest.raises(AssertionError, match="cannot serve metrics on 127.0.0.1"):
            m.mount()
        assert not is_mounted(m.path)
    finally:
        busy.close()


def test_state_xattr_is_read_only_and_not_listed(ckpt):
    f = ckpt.path / "w.pt"
    with open(f, "wb") as h:
        h.write(b"x" * 100_000)
        assert ckptfs.state(f) == "memory"
    os.setxattr(f, "user.mine", b"1")
    assert os.listxattr(f) == ["user.mine"]  # ckptfs's own: by name only (copystat, rsync -X skip them)
    assert os.listxattr(ckpt.path) == []
    assert os.getxattr(ckpt.path, "user.ckptfs.pid") and os.getxattr(ckpt.path, "user.ckptfs.control")
    (ckpt.path / "dir").mkdir()
    assert os.getxattr(ckpt.path / "dir", "user.ckptfs.state")
    os.symlink("w.pt", ckpt.path / "link")
    with pytest.raises(OSError):
        os.getxattr(ckpt.path / "link", "user.ckptfs.state", follow_symlinks=False)
    copy = ckpt.path / "copy.pt"
    copy.write_bytes(b"y")
    shutil.copystat(f, copy)  # copies user.mine, nothing of ckptfs's own, and raises nothing
    assert os.listxattr(copy) == ["user.mine"]
    for name in ("user.ckptfs.control", "user.ckptfs.pid"):  # only on the root
        with pytest.raises(OSError) as e:
            os.getxattr(f, name)
        assert e.value.errno == errno.ENODATA
    for op in (lambda: os.setxattr(f, "user.ckptfs.state", b"durable"),
               lambda: os.removexattr(f, "user.ckptfs.state")):
        with pytest.raises(OSError) as e:
            op()
        assert e.value.errno == errno.EPERM
    ckptfs.wait_durable(f, timeout=60)
    assert ckptfs.state(f) == xattr_state(f) == "durable"
    with pytest.raises(ckptfs.NotOnCkptfs):
        ckptfs.state(ckpt.root / "daemon.log")


def _run_in_pty(args: list[str], timeout=120) -> tuple[int, str]:
    pid, fd = pty.fork()
    if pid == 0:
        os.environ["COLUMNS"] = "160"
        os.execv(sys.executable, [sys.executable, "-m", "ckptfs", *args])
    out = bytearray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode(errors="replace"))


def test_umount_shows_drain_progress_on_a_terminal(throttled):
    m, t = throttled(4 * MiB, memory="64M")
    data = os.urandom(16 * MiB)
    (m.path / "last.pt").write_bytes(data)
    code, out = _run_in_pty(["umount", str(m.path)])
    assert code == 0, out
    assert "draining before unmount" in out and "100%" in out and "1/1 file(s) durable" in out, out
    assert "ckptfs unmounted" in out
    m.pid = None
    t.set(0)
    m.mount()
    assert (m.path / "last.pt").read_bytes() == data
    res = m.umount()  # not a terminal: no progress, one line
    assert res.returncode == 0 and res.stderr == "" and res.stdout.startswith("ckptfs unmounted")


def test_wait_shows_progress_on_a_terminal(throttled):
    m, _t = throttled(4 * MiB, memory="64M")
    (m.path / "a.pt").write_bytes(os.urandom(12 * MiB))
    code, out = _run_in_pty(["wait", str(m.path / "a.pt")])
    assert code == 0, out
    assert "draining" in out and "1/1 file(s) durable" in out and "durable: 1 file(s)" in out, out


LINE = re.compile(r'^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (debug|info|warning|error) [\w.-]+'
                  r'( [\w.]+=("([^"\\]|\\.)*"|[^\s"]+))*$')


def test_structured_logs_to_stderr_in_the_foreground_and_to_the_file_detached(tmp_path):
    devs = make_devices(tmp_path / "devices", 2, 256 * MiB)
    mp = tmp_path / "mnt"
    mp.mkdir()
    arg = ",".join(map(str, devs))
    proc = subprocess.Popen([sys.executable, "-m", "ckptfs", "mount", str(mp), "--devices", arg, "--memory", "64M",
                             "--format", "--foreground", "--log-level", "debug"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        poll(lambda: is_mounted(mp) or proc.poll() is not None, "the foreground mount")
        (mp / "f").write_bytes(b"y" * 300_000)
        assert run_cli("umount", str(mp)).returncode == 0
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)
    assert proc.returncode == 0
    lines = err.splitlines()
    bad = [ln for ln in lines if not LINE.match(ln)]
    assert not bad, bad
    events = [ln.split(" ")[2] for ln in lines]
    for ev in ("control.listening", "mounted", "unmounting", "unmounted"):
        assert ev in events, events
    assert any(ln.split(" ")[1] == "debug" for ln in lines)
    assert any(" mountpoint=" in ln for ln in lines)

    m = CkptMount(tmp_path / "j", memory="64M", extra=("--log-format", "json", "--log-level", "warning"))
    try:
        m.mount()
        (m.path / "g").write_bytes(b"z")
    finally:
        m.close()
    m2 = CkptMount(tmp_path / "k", memory="64M", extra=("--log-format", "json"))
    try:
        m2.mount()
    finally:
        m2.close()
    objs = [json.loads(ln) for ln in m2.log_text().splitlines() if ln.strip()]
    assert {"mounted", "unmounted"} <= {o["event"] for o in objs}
    assert all({"ts", "level", "event"} <= set(o) for o in objs)
    assert not [ln for ln in m.log_text().splitlines() if '"level": "info"' in ln]  # --log-level warning


def test_a_missing_name_is_cached_as_missing_and_appears_once_created(ckpt):
    """LOOKUP of a missing name answers a negative entry the kernel caches (Lightning stats its
    destination four times before creating it): repeated stats cost no round trip, and a name
    created through the mount is there at once (the kernel drops its negative entry itself)."""
    d = ckpt.path / "ckpts"
    d.mkdir()
    target = d / "epoch=3.ckpt"
    for _ in range(200):
        assert not target.exists()
    target.write_bytes(b"x" * 1000)
    assert target.stat().st_size == 1000
    os.rename(target, d / "last.ckpt")
    assert not target.exists() and (d / "last.ckpt").exists()
    (d / "last.ckpt").rename(target)
    assert target.read_bytes() == b"x" * 1000
    os.unlink(target)
    assert not target.exists()
    os.mkdir(target)
    assert target.is_dir()
    ckpt.close()
    if ckpt.engine == "native":  # the engine's request counts, logged at unmount
        counts = [line for line in ckpt.log_text().splitlines() if "engine.statistics" in line]
        assert counts, ckpt.log_text()[-2000:]
        lookups = int(re.search(r"\blookup=(\d+)", counts[-1]).group(1))
        assert lookups < 20, f"{lookups} LOOKUPs: missing names were not cached"


def test_a_read_only_close_costs_no_flush_and_a_writers_close_still_commits(ckpt):
    """A read-only handle's close commits nothing, so the native engine opens it FOPEN_NOFLUSH and
    the kernel sends no FLUSH (one round trip less per torch.load, safetensors load_file...); a
    writer's close still sends its FLUSH, which commits the file before close() returns."""
    if ckpt.engine != "native":
        pytest.skip("pyfuse3 has no FOPEN_NOFLUSH")
    f = ckpt.path / "w.bin"
    flushes = lambda: status_json(ckpt)["engine_stats"]["session"]["requests"].get("flush", 0)  # noqa: E731
    before = flushes()
    f.write_bytes(b"x" * 5000)
    assert ckpt.path.joinpath("w.bin").stat().st_size == 5000
    assert flushes() == before + 1  # the writer's close
    assert ckptfs.state(f) in ("draining", "durable")  # ...committed the file
    for _ in range(20):
        assert f.read_bytes() == b"x" * 5000
        with open(f, "rb") as h:
            assert h.read(10) == b"x" * 10
            os.close(os.dup(h.fileno()))  # a close of a copy: no FLUSH either
    assert flushes() == before + 1
    with open(f, "r+b") as h:  # read-write: FLUSH as before
        h.write(b"y")
    assert flushes() == before + 2
    assert f.read_bytes() == b"y" + b"x" * 4999


def test_a_closed_file_is_committed_once_its_writer_pauses_with_no_other_wake_up(ckpt):
    """Native: a close's drain and commit wait until requests pause (tasks.LoopLock "Settling"),
    and then the reading worker wakes the trio thread itself: a writer that closes a file and
    goes idle sends nothing more, and its file must still become durable. The files become
    durable, and the wake-ups counted as settled (`lock_settled_wakes`) show who woke the trio
    thread: without the reader's wake-up (Session(settle=None)) it stays 0, the files then made
    durable only by the next request (here, the next look at their state) or a timer."""
    if ckpt.engine != "native":
        pytest.skip("settling is the native engine's")
    before = status_json(ckpt)["engine_stats"]["lock"]["settled_wakes"]
    states = []
    for i in range(5):
        f = ckpt.path / f"idle{i}.bin"
        f.write_bytes(os.urandom(300_000))
        # a look every 0.2 s: the mount stays idle in between, no request wakes anything
        poll(lambda: ckptfs.state(f) in ("durable", "replicated"), None, timeout=30, every=0.2)
        states.append(ckptfs.state(f))
    assert states == ["durable"] * 5
    assert status_json(ckpt)["engine_stats"]["lock"]["settled_wakes"] > before


def test_a_forked_childs_close_of_an_inherited_descriptor_commits_nothing(ckpt):
    """A writer that forks half way through a file (a subprocess, a DataLoader worker) gives the
    child a copy of its descriptor; the child's close at exec or exit sends a FLUSH too. Only
    the writer's own close commits: a crash before it keeps the previous version, not half of
    the new one."""
    f = ckpt.path / "last.pt"
    f.write_bytes(b"old" * 1000)
    ckptfs.wait_durable(f, timeout=60)
    with open(f, "r+b") as h:
        h.write(b"new" * 500)
        h.flush()
        assert ckptfs.state(f) == "memory"
        subprocess.run([sys.executable, "-c", "pass"], check=True,
                       pass_fds=(h.fileno(),))  # the child holds the descriptor and closes it
        pid = os.fork()
        if pid == 0:
            os._exit(0)  # a plain fork: the child's exit closes its copy
        os.waitpid(pid, 0)
        assert ckptfs.state(f) == "memory"  # nothing committed by the children's closes
    assert ckptfs.state(f) in ("draining", "durable")  # the writer's close commits
    ckptfs.wait_durable(f, timeout=60)
    assert f.read_bytes() == b"new" * 500 + b"old" * 500


STUCK_WRITER = r"""
import os, signal, sys
signal.signal(signal.SIGUSR1, lambda *a: None)  # a handled signal: the kernel interrupts the request
path, total = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
data = bytes(range(256)) * (16 << 10)  # 4 MiB
done = 0
while done < total:
    done += os.write(fd, memoryview(data)[:min(len(data), total - done)])
os.close(fd)
print(done)
"""


def test_a_writer_stuck_behind_a_stalled_drain_dies_at_kill_9_and_a_signal_does_not_cut_a_write(throttled):
    """native engine, 2 FUSE threads: with memory full and the drain all but stopped (4 KiB/s),
    two writers blocked in write() do not freeze the mount (a spare worker serves ls and stat);
    one dies at SIGKILL at once (its interrupted WRITE gives up: the caller is being killed)
    instead of hanging in D state until memory frees; the other handles signals (SIGUSR1, as a
    DataLoader's SIGCHLD), goes on waiting and, once the drain runs, writes everything."""
    m, t = throttled(4096, memory="16M", extra=("--threads", "2"))
    if m.engine != "native":
        pytest.skip("pyfuse3 runs every request to the end")
    total = 40 * MiB
    procs = {n: subprocess.Popen([sys.executable, "-c", STUCK_WRITER, str(m.path / n), str(total)],
                                 stdout=subprocess.PIPE, text=True) for n in ("killed", "signalled")}
    try:
        def waits() -> list[str]:  # where each writer sleeps in the kernel (read from /proc, not the mount)
            return [open(f"/proc/{p.pid}/wchan").read() for p in procs.values()]

        def stuck() -> bool:  # both blocked in a FUSE request for half a second: memory is full
            if waits() != ["request_wait_answer"] * 2:
                return False
            time.sleep(0.5)
            return waits() == ["request_wait_answer"] * 2 and all(p.poll() is None for p in procs.values())

        poll(stuck, "both writers to block on memory", timeout=60)
        res = subprocess.run(["ls", "-l", str(m.path)], capture_output=True, text=True, timeout=20)
        assert res.returncode == 0 and "signalled" in res.stdout
        assert status_json(m)["engine_stats"]["session"]["spares_started"] >= 1
        for _ in range(5):
            procs["signalled"].send_signal(signal.SIGUSR1)
            time.sleep(0.1)
        procs["killed"].kill()
        procs["killed"].wait(timeout=15)  # without the fix: stuck in D state until memory frees
        assert procs["signalled"].poll() is None  # still waiting, not cut short
        assert status_json(m)["engine_stats"]["killed"] >= 1
        t.set(0)
        out, _ = procs["signalled"].communicate(timeout=120)
        assert procs["signalled"].returncode == 0 and int(out) == total
        assert os.stat(m.path / "signalled").st_size == total
        assert (m.path / "signalled").read_bytes() == bytes(range(256)) * (total // 256)
        assert m.umount().returncode == 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


STUCK_FSYNC = r"""
import ctypes, os, signal, sys
signal.signal(signal.SIGUSR1, lambda *a: None)  # a handled signal: the kernel interrupts the request
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(fd, bytes(range(256)) * (4 << 10))  # 1 MiB
rc = libc.fsync(fd)  # libc's, not os.fsync: Python would retry an EINTR and hide it
print(rc, ctypes.get_errno())
"""


def test_an_fsync_waiting_for_a_stalled_drain_is_not_cut_by_a_signal_and_dies_at_kill_9(throttled):
    """native engine: two processes fsync 1 MiB each while the devices take 4 KiB/s. A handled
    signal (SIGUSR1, as a DataLoader's SIGCHLD) does not make fsync fail with EINTR, as it never
    does on ext4 (it did here: Rust's sync_all and most C callers do not retry); the fsync goes
    on and returns 0 once the drain runs. The other dies at SIGKILL at once instead of hanging
    in D state until the devices answer."""
    m, t = throttled(4096, memory="64M", extra=("--threads", "2"))
    if m.engine != "native":
        pytest.skip("pyfuse3 runs every request to the end")
    procs = {n: subprocess.Popen([sys.executable, "-c", STUCK_FSYNC, str(m.path / n)],
                                 stdout=subprocess.PIPE, text=True) for n in ("killed", "signalled")}
    try:
        def stuck() -> bool:  # both in a FUSE request (their FSYNC) for half a second
            for _ in range(2):
                if [open(f"/proc/{p.pid}/wchan").read() for p in procs.values()] != ["request_wait_answer"] * 2:
                    return False
                time.sleep(0.25)
            return all(p.poll() is None for p in procs.values())

        poll(stuck, "both fsyncs to wait for the devices", timeout=60)
        for _ in range(5):
            procs["signalled"].send_signal(signal.SIGUSR1)
            time.sleep(0.1)
        procs["killed"].kill()
        procs["killed"].wait(timeout=15)  # without killable waits: stuck in D state
        time.sleep(0.5)
        assert procs["signalled"].poll() is None  # still in fsync: no EINTR
        assert status_json(m)["engine_stats"]["killed"] >= 1
        t.set(0)
        out, _ = procs["signalled"].communicate(timeout=120)
        assert procs["signalled"].returncode == 0 and out.split() == ["0", "0"]
        ckptfs.wait_durable(m.path / "signalled", timeout=60)
        assert (m.path / "signalled").read_bytes() == bytes(range(256)) * (4 << 10)
        assert m.umount().returncode == 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
