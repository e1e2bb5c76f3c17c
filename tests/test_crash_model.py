"""Prefix crash consistency, checked by a model (hypothesis state machine).

Random operations (whole-file writes, renames over existing files, unlinks,
mkdir/rmdir, fsync) run on the in-process filesystem over fault-injecting
devices. The model records the namespace as it stood after every operation
(a file's contents as of its last close). A crash rule cuts power at a
random point (some unflushed writes survive, in random order), remounts,
and checks the recovered tree is one of the recorded states no earlier than
the last fsync: promise 5 in docs/SEMANTICS.md. A clean remount must show exactly
the latest state.
"""
import random
import time

import hypothesis.strategies as st
import trio
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from faulty import crash_all, image_all
from inproc import Driver, PathOps, make_devices

NAMES = ["a", "b", "c"]
DIRS = ["", "/d"]
PATHS = [f"{d}/{n}" for d in DIRS for n in NAMES]


class CrashModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.devices = make_devices(2, 6 << 20)
        for d in self.devices:
            d.write_delay = 0.001  # slow devices: crashes land while the drain is in flight
        self.driver = Driver(self.devices, fmt=True, memory=512 << 10, journal_half=128 << 10)
        self.p = PathOps(self.driver)
        self.state: dict[str, bytes | None] = {}
        self.history = [dict(self.state)]
        self.synced = 0  # index into history: the state can't go back before this
        self.rng = random.Random(0)

    def teardown(self):
        self.driver.kill()

    def _point(self):
        self.history.append(dict(self.state))

    def _dir_exists(self, path):
        head = path.rsplit("/", 1)[0]
        return head == "" or self.state.get(head, b"") is None

    @rule(path=st.sampled_from(PATHS), size=st.integers(0, 300_000), fsync=st.booleans(), seed=st.integers(0, 99))
    def write(self, path, size, fsync, seed):
        if not self._dir_exists(path) or self.state.get(path, b"") is None:
            return
        data = random.Random(seed).randbytes(size)
        self.p.write_file(path, data, fsync=fsync)
        self.state[path] = data  # a new file appears with its contents at its first close
        self._point()
        if fsync:
            self.synced = len(self.history) - 1

    @rule(src=st.sampled_from(PATHS), dst=st.sampled_from(PATHS))
    def rename(self, src, dst):
        if src == dst or self.state.get(src, None) is None or not self._dir_exists(dst):
            return
        if self.state.get(dst, b"") is None:
            return
        self.p.rename(src, dst)
        self.state[dst] = self.state.pop(src)
        self._point()

    @rule(path=st.sampled_from(PATHS))
    def unlink(self, path):
        if self.state.get(path, None) is None:
            return
        self.p.unlink(path)
        del self.state[path]
        self._point()

    @rule()
    def mkdir(self):
        if "/d" in self.state:
            return
        self.p.mkdir("/d")
        self.state["/d"] = None
        self._point()

    @rule()
    def rmdir(self):
        if "/d" not in self.state or any(k.startswith("/d/") for k in self.state):
            return
        self.p.rmdir("/d")
        del self.state["/d"]
        self._point()

    @rule(path=st.sampled_from(PATHS))
    def fsync(self, path):
        if self.state.get(path, None) is None:
            return
        self.p.fsync(path)
        self.synced = len(self.history) - 1

    @rule(cut=st.integers(0, 40), seed=st.integers(0, 1000))
    def crash_and_remount(self, cut, seed):
        self.devices[0].power.cut_after(cut)
        time.sleep(random.Random(seed).random() * 0.02)
        self.driver.kill()
        rng = random.Random(seed)
        self.devices = crash_all(self.devices, rng)
        for d in self.devices:
            d.write_delay = 0.001
        self.driver = Driver(self.devices, memory=512 << 10, journal_half=128 << 10)
        self.p = PathOps(self.driver)
        got = self.p.tree()
        allowed = self.history[self.synced:]
        assert got in allowed, (
            f"recovered state is not a prefix state after the last fsync:\n got {_short(got)}\n"
            f" allowed {[_short(a) for a in allowed]}")
        self.state = dict(got)
        self.history = [dict(got)]
        self.synced = 0

    @rule()
    def clean_remount(self):
        self.driver.unmount()
        self.devices = image_all(self.devices)
        for d in self.devices:
            d.write_delay = 0.001
        self.driver = Driver(self.devices, memory=512 << 10, journal_half=128 << 10)
        self.p = PathOps(self.driver)
        assert self.p.tree() == self.state
        self.history = [dict(self.state)]
        self.synced = 0

    @invariant()
    def store_invariants(self):
        trio.from_thread.run_sync(self.driver.store.alloc.check_invariants, trio_token=self.driver.token)


def _short(tree):
    return {k: (None if v is None else (len(v), hash(v) & 0xFFFF)) for k, v in sorted(tree.items())}


TestCrashModel = CrashModel.TestCase
TestCrashModel.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])
