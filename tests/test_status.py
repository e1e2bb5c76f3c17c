"""Status, states, wait, metrics and logs, in-process over fault-injecting devices.

`GatedDevice` holds every data write (pwritev) until the test lets it pass,
so a file can be caught in each state (memory, draining x%, durable) with no
timing luck; journal writes (pwrite) pass freely.
"""
import errno
import functools
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import trio

from ckptfs.ops import api
from ckptfs.ops.control import ControlServer, peer_uid
from ckptfs.ops.logs import StructuredFormatter
from ckptfs.ops.metrics import StoreCollector, read_metrics
from ckptfs.ops.monitor import Histogram, Monitor
from ckptfs.fs.namespace import ROOT_INO
from ckptfs.ops.status import file_states, snapshot

import nobody
import waiting
from faulty import FaultyDevice, Power
from inproc import CTX, Driver, PathOps, make_devices

CS = 64 << 10  # the Driver's chunk size


class GatedDevice(FaultyDevice):
    """Data writes wait for a permit (`allow(n)`) or for `open()`."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.permits = threading.Semaphore(0)
        self.opened = threading.Event()

    def allow(self, n: int = 1) -> None:
        for _ in range(n):
            self.permits.release()

    def open(self) -> None:
        self.opened.set()

    def pwritev(self, bufs, offset):
        while not self.opened.is_set() and not self.permits.acquire(timeout=0.02):
            pass
        super().pwritev(bufs, offset)


def gated(n=2, size=8 << 20):
    power = Power()
    return [GatedDevice(size, f"mem{i}", power=power) for i in range(n)]


poll = functools.partial(waiting.poll, timeout=20.0, every=0.02)


class Env:
    def __init__(self, devices, **kw):
        self.devs = devices
        self.d = Driver(devices, fmt=True, **kw)
        self.p = PathOps(self.d)

    def snap(self, **kw) -> dict:
        return self.d.call_sync(lambda: snapshot(self.d.store, self.d.monitor, **kw))

    def entry(self, path):
        return next((f for f in self.snap()["files"] if f["path"] == path), None)

    def xattr(self, ino) -> str:
        return self.d.call(self.d.ops.getxattr, ino, b"user.ckptfs.state", CTX).decode()

    def create(self, name: bytes) -> tuple[int, int]:
        fi, attr = self.p._call("create", ROOT_INO, name, 0o644, os.O_WRONLY | os.O_CREAT, CTX)
        return fi.fh, attr.st_ino

    def write(self, fh, data, piece=CS):
        for off in range(0, len(data), piece):
            assert self.p._call("write", fh, off, data[off:off + piece]) == len(data[off:off + piece])

    def close(self):
        for x in self.devs:
            if isinstance(x, GatedDevice):
                x.open()
        self.d.kill()


@pytest.fixture
def env():
    made = []

    def make(devices=None, **kw):
        e = Env(devices if devices is not None else gated(), **kw)
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()


def test_a_file_moves_from_memory_to_draining_to_durable(env):
    e = env()
    data = os.urandom(8 * CS + 1000)
    fh, ino = e.create(b"ckpt.pt")
    e.write(fh, data)
    f = e.entry("/ckpt.pt")
    assert f is not None and f["state"] == "memory" and f["size"] == len(data)
    assert e.xattr(ino) == "memory"

    e.p._call("release", fh)  # close: the file's contents become a commit
    f = e.entry("/ckpt.pt")
    assert f["state"] == "draining" and f["progress"] == 0.0 and f["bytes"] == len(data)
    assert e.xattr(ino) == "draining"
    snap = e.snap()
    assert snap["totals"]["files_draining"] == 1 and snap["totals"]["bytes_to_drain"] == len(data)
    assert not snap["all_durable"]

    e.devs[0].allow(1)  # one write on one device: part of the file, never all of it
    f = poll(lambda: (x := e.entry("/ckpt.pt")) and x["progress"] > 0 and x, "partial progress")
    assert f["state"] == "draining" and 0 < f["progress"] < 1
    assert e.xattr(ino) == "draining"

    for x in e.devs:
        x.open()
    poll(lambda: e.entry("/ckpt.pt") is None, "the file to be durable")
    assert e.xattr(ino) == "durable"
    snap = poll(lambda: (s := e.snap())["all_durable"] and s, "everything durable")
    tot = snap["totals"]
    assert tot["bytes_to_drain"] == 0 and tot["eta_seconds"] == 0
    assert tot["bytes_absorbed"] == len(data) and tot["bytes_drained"] >= len(data)
    assert tot["drain_latency"]["count"] >= 1
    assert sum(dev["bytes_written"] for dev in snap["pool"]["devices"]) >= len(data)
    assert snap["memory"]["arena"] == snap["memory"]["used"] + snap["memory"]["free"]


def test_failed_drain_shows_errno_then_recovers(env):
    devs = make_devices(2)
    e = env(devs)
    for i, x in enumerate(devs):  # data region only: the journal stays writable
        x.fail_writes_at(e.d.store.sbs[i].unit_offset(0), x.size)
    e.p.write_file("/bad", os.urandom(3 * CS))
    ino = e.p.ino("/bad")
    f = poll(lambda: (x := e.entry("/bad")) and x["state"] == "failed" and x, "a failed state")
    assert f["errno"] == "EIO"
    assert e.xattr(ino) == "failed:EIO"
    snap = e.snap()
    assert snap["totals"]["files_failed"] == 1
    assert "injected write error" in snap["last_error"]
    assert any(d["errors"] > 0 and d["health"] in ("failing", "errors") for d in snap["pool"]["devices"])
    for x in devs:
        x.fail_write_ranges.clear()  # the daemon retries: the file becomes durable
    poll(lambda: e.entry("/bad") is None, "recovery")
    assert e.xattr(ino) == "durable"


def test_file_states_agree_with_store_state_and_the_xattr(env):
    e = env()
    e.p.mkdir("/d")
    open_fh, open_ino = e.create(b"open")  # never closed: memory
    e.write(open_fh, os.urandom(2 * CS))
    e.p.write_file("/d/a", os.urandom(3 * CS + 5))  # closed: draining
    e.p.write_file("/d/b", os.urandom(CS))
    e.p.rename("/d/b", "/d/c")
    e.p.write_file("/gone", os.urandom(CS))
    e.p.unlink("/gone")
    e.p.write_file("/d/a", os.urandom(CS))  # supersedes the first commit of /d/a

    def check():
        def compare():
            states = file_states(e.d.store)
            out = []
            for ino, inode in list(e.d.fs.ns.inodes.items()):
                got = states[ino].xattr if ino in states else "durable"
                out.append((ino, inode.is_reg or inode.is_dir, got, e.d.store.state(ino)))
            return out
        rows = e.d.call_sync(compare)
        for ino, has_xattr, got, want in rows:
            assert got == want, (ino, got, want)
            if has_xattr:
                assert e.xattr(ino) == want
        return rows

    rows = check()
    assert {r[2] for r in rows} >= {"memory", "draining"}
    e.devs[1].allow(2)
    check()
    for x in e.devs:
        x.open()
    e.p._call("release", open_fh)
    poll(lambda: e.snap()["all_durable"], "everything durable")
    assert {r[2] for r in check()} == {"durable"}


def test_wait_over_the_control_channel(env, tmp_path):
    sock = str(tmp_path / "run" / "c.sock")
    e = env(control=sock)
    assert oct(os.stat(sock).st_mode & 0o777) == "0o600"
    assert oct(os.stat(tmp_path / "run").st_mode & 0o777) == "0o700"
    e.p.write_file("/f", os.urandom(6 * CS))
    ino = e.p.ino("/f")

    # timeout: nothing can drain yet
    with pytest.raises(api.WaitTimeout) as t:
        api.wait_on(sock, [ino], time.monotonic() + 1.0, timeout=1.0)
    assert "timed out" in str(t.value) and "1 of 1 file(s) not durable" in str(t.value)

    reports = []
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("r", api.wait_on(sock, [ino], None, reports.append)))
    th.start()
    poll(lambda: reports, "a progress report")
    assert reports[0]["event"] == "progress" and reports[0]["files"] == 1 and reports[0]["durable"] == 0
    for x in e.devs:
        x.open()
    th.join(20)
    assert out["r"]["event"] == "done" and out["r"]["ok"] and out["r"]["durable"] == 1
    done = [r["done"] for r in reports]
    assert done == sorted(done) and done[-1] == reports[-1]["bytes"] == 6 * CS

    # the whole mount (inos None), when everything is durable already
    assert api.wait_on(sock, None)["ok"]
    # a directory stands for the files below it
    e.p.mkdir("/dir")
    e.p.write_file("/dir/x", os.urandom(CS))
    assert api.wait_on(sock, [e.p.ino("/dir")])["files"] == 1


def test_wait_fails_with_the_reason_on_a_device_error(env, tmp_path):
    sock = str(tmp_path / "c.sock")
    devs = make_devices(2)
    e = env(devs, control=sock)
    for i, x in enumerate(devs):
        x.fail_writes_at(e.d.store.sbs[i].unit_offset(0), x.size)
    e.p.write_file("/bad", os.urandom(2 * CS))
    with pytest.raises(api.DrainFailed) as err:
        api.wait_on(sock, [e.p.ino("/bad")], time.monotonic() + 20, timeout=20)
    assert err.value.errno == errno.EIO
    assert "/bad" in str(err.value) and "injected write error" in str(err.value)
    assert err.value.failed[0]["path"] == "/bad"
    # the daemon keeps serving: status still answers after the failed wait
    with api.Client(sock) as c:
        st = c.request({"op": "status"})["status"]
    assert st["totals"]["files_failed"] == 1
    for x in devs:
        x.fail_write_ranges.clear()  # the daemon's next retry succeeds
    poll(lambda: e.entry("/bad") is None and e.snap()["last_error"] is None, "recovery")
    assert api.wait_on(sock, None, time.monotonic() + 20, timeout=20)["ok"]


def test_peer_credentials_are_checked_even_when_the_socket_is_reachable(env):
    if nobody.python() is None:
        pytest.skip("needs root and a python3 that the user nobody can run")
    run = tempfile.mkdtemp(prefix="ckptfs-ctl-")
    try:
        os.chmod(run, 0o711)
        sock = os.path.join(run, "priv", "c.sock")
        env(control=sock)
        client = ("import socket, sys\n"
                  "s = socket.socket(socket.AF_UNIX)\n"
                  "try:\n    s.connect(sys.argv[1])\n"
                  "except PermissionError:\n    print('EACCES'); sys.exit(0)\n"
                  "s.sendall(b'{\"op\": \"status\"}\\n')\n"
                  "print(s.makefile().readline())\n")

        def as_nobody():
            return nobody.run(["-I", "-c", client, sock])
        res = as_nobody()  # first lock: the folder (0700) and the socket (0600)
        assert res.stdout.strip() == "EACCES", res.stderr
        os.chmod(os.path.dirname(sock), 0o755)  # a mistake: the socket is reachable
        os.chmod(sock, 0o666)
        res = as_nobody()  # second lock: SO_PEERCRED
        assert res.returncode == 0 and res.stdout.strip(), res
        reply = json.loads(res.stdout)
        assert reply["ok"] is False and reply["error"].startswith("permission denied"), res
        with api.Client(sock) as c:  # root still may
            assert c.request({"op": "ping"})["pid"] == os.getpid()
    finally:
        subprocess.run(["rm", "-rf", run])


def test_metrics_collector_exports_counters_that_move():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    devs = make_devices(2)
    e = Env(devs)
    try:
        reg = CollectorRegistry(auto_describe=False)
        reg.register(StoreCollector(lambda: e.d.call_sync(read_metrics, e.d.store, e.d.monitor)))

        def scrape() -> dict:
            out = {}
            for fam in text_string_to_metric_families(generate_latest(reg).decode()):
                for s in fam.samples:
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
            return out
        before = scrape()
        e.p.write_file("/m", os.urandom(5 * CS), fsync=True)
        after = scrape()
        for name in ("ckptfs_bytes_absorbed_total", "ckptfs_bytes_drained_total", "ckptfs_drain_latency_seconds_count"):
            assert after[(name, ())] > before[(name, ())], name
        assert after[("ckptfs_bytes_absorbed_total", ())] == 5 * CS
        assert ("ckptfs_bytes_skipped_total", ()) in after
        assert ("ckptfs_backpressure_waits_total", ()) in after
        written = [k for k in after if k[0] == "ckptfs_device_written_bytes_total"]
        assert len(written) == 2 and sum(after[k] for k in written) >= 5 * CS
        assert after[("ckptfs_files", (("state", "durable"),))] == 1
        assert ("ckptfs_memory_bytes", (("kind", "undrained"),)) in after
        assert any(k[0] == "ckptfs_device_write_bytes_per_second" for k in after)
        assert any(k[0] == "ckptfs_device_errors_total" for k in after)
    finally:
        e.close()


def test_receive_buffers_lent_to_workers_are_not_reported_as_undrained():
    """The native engine's workers hold free slots as receive buffers: once everything is
    durable, memory shows them as lent, not as data not yet on the devices (status once
    said "10 MiB not yet on the devices" next to "Everything is durable")."""
    e = Env(make_devices(2))
    try:
        e.p.write_file("/m", os.urandom(3 * CS), fsync=True)
        lent = e.d.call_sync(lambda: [e.d.store.arena.lend_nowait() for _ in range(4)])
        mem = e.snap()["memory"]
        assert mem["lent"] == 4 * CS
        assert mem["undrained"] == 0
        assert mem["used"] == mem["cached"] + mem["lent"] + mem["undrained"]
        assert e.d.call_sync(read_metrics, e.d.store, e.d.monitor)["memory"]["lent"] == 4 * CS
        e.d.call_sync(lambda: [e.d.store.arena.unlend(s) for s in lent])
        assert e.snap()["memory"]["lent"] == 0
    finally:
        e.close()


def test_metrics_collector_exports_nothing_when_the_daemon_is_gone():
    def broken():
        raise trio.RunFinishedError("gone")
    assert StoreCollector(broken).collect() == []


# ---- pure parts ----------------------------------------------------------------------
class _Stats:
    def __init__(self):
        self.bytes_written = self.bytes_read = self.errors = 0


class _FakeStore:
    def __init__(self):
        self.stats = [_Stats(), _Stats()]
        self.bytes_drained = self.bytes_absorbed = 0

    async def wait_for_room(self, devices_full=False):
        return True


def test_monitor_rates_over_the_last_interval():
    now = [100.0]
    s = _FakeStore()
    m = Monitor(s, clock=lambda: now[0], period=0.5)
    assert m.rates().interval == 0.0  # nothing to compare yet
    for _ in range(4):  # 2 s at 10 MB/s on device 0, 5 MB/s drained
        now[0] += 0.5
        s.stats[0].bytes_written += 5_000_000
        s.bytes_drained += 2_500_000
        m.tick()
    now[0] += 0.5
    s.stats[0].bytes_written += 5_000_000
    s.stats[1].errors += 1
    r = m.rates(window=1.0)
    assert r.interval == pytest.approx(1.0)
    assert r.write_bps[0] == pytest.approx(10_000_000) and r.write_bps[1] == 0
    assert r.new_errors == (0, 1)
    assert r.drain_bps == pytest.approx(2_500_000)


def test_monitor_counts_backpressure_waits_and_latency():
    s = _FakeStore()
    m = Monitor(s)
    assert trio.run(m.room) is True
    assert m.backpressure_waits == 1 and m.backpressure_seconds >= 0

    class P:
        rec, void, born = None, False, time.monotonic() - 0.2
    m.on_commit([P()])
    assert m.latency.count == 1 and 0.15 < m.latency.last < 5


def test_histogram_buckets_are_cumulative():
    h = Histogram()
    for v in (0.001, 0.3, 0.3, 7, 1000):
        h.observe(v)
    cum = dict(h.cumulative())
    assert cum[0.005] == 1 and cum[0.5] == 3 and cum[10.0] == 4 and cum[float("inf")] == 5
    assert h.count == 5 and h.sum == pytest.approx(1007.601)


def _record(msg, *args, name="ckptfs.daemon", level=logging.INFO, **extra):
    r = logging.LogRecord(name, level, "f.py", 1, msg, args, None)
    r.__dict__.update(extra)
    return r


def test_structured_log_lines():
    f = StructuredFormatter()
    line = f.format(_record("mounted", fields={"mountpoint": "/ckpt x", "memory": 512, "ok": True}))
    ts, level, event, fields = line.split(" ", 3)
    assert ts.endswith("Z") and level == "info" and event == "mounted"
    assert fields == 'mountpoint="/ckpt x" memory=512 ok=true'
    # an ordinary log call: the component is the event, the text goes in msg=
    line = f.format(_record("drain failed: %s", "boom", name="ckptfs.drain", level=logging.ERROR))
    assert line.split(" ", 3)[1:] == ["error", "drain", 'msg="drain failed: boom"']
    try:
        raise ValueError("bad")
    except ValueError:
        rec = _record("oops", name="ckptfs.store")
        rec.exc_info = sys.exc_info()
    line = f.format(rec)
    assert "\n" not in line and 'exc="Traceback' in line
    obj = json.loads(StructuredFormatter(json_lines=True).format(_record("wait.failed", fields={"error": "x"})))
    assert obj["event"] == "wait.failed" and obj["level"] == "info" and obj["error"] == "x"


def test_peer_uid_of_a_socketpair_is_ours():
    import socket
    a, b = socket.socketpair(socket.AF_UNIX)
    try:
        assert peer_uid(a) == os.getuid()
    finally:
        a.close()
        b.close()


def test_control_server_unlinks_only_its_own_socket(tmp_path):
    path = str(tmp_path / "r" / "s.sock")
    srv = ControlServer(path, None, None)

    async def main():
        await srv.bind()
        assert os.path.exists(path)
        os.unlink(path)
        open(path, "w").close()  # someone else's file now
        srv.close()
        srv._sock.close()
    trio.run(main)
    assert os.path.exists(path)
