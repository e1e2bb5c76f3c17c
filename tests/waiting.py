"""Waiting in tests: `poll(fn, what)` asks fn() again and again until it says yes, or gives up.

Every wait-until of the tests goes through it: the mount helpers (mounting.py), the container
helpers (containers.py), in-process drivers and threads. It imports nothing, so a test that
needs no mount need not import the mount machinery to wait.
"""
from __future__ import annotations

import time


def poll(fn, what: str | None, timeout: float = 60.0, every: float = 0.05, on_timeout=None):
    """fn()'s first truthy value, asked every `every` seconds. After `timeout` seconds an
    AssertionError says what was awaited (`what`), followed by on_timeout()'s text when given
    (a log, a process's output); where `what` is None, fn()'s last (falsy) value is returned
    instead, for callers that go on either way or whose own checks say what failed."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            break
        time.sleep(every)
    if value or what is None:
        return value
    more = f"\n{on_timeout()}" if on_timeout is not None else ""
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{more}")
