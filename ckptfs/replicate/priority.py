"""CPU priorities of the uploader process (uploader.py): --replicate-priority.

    idle     SCHED_IDLE: the kernel runs it only on CPU time no normal task wants
             (a weight of 3 against 1024 for a nice-0 task), so a busy trainer
             keeps its cores and replication lags instead
    low      SCHED_OTHER at nice 19 (weight 15): it still gets a little over 1% of
             a core that a nice-0 task wants
    normal   what the daemon has: uploads compete with the trainer as equals

`lower(priority)` sets it for the calling thread, and so for every thread it
starts later (Linux keeps policy and nice per thread; new threads inherit
them): call it before any other thread exists. No privilege is needed to
lower a priority.
"""
from __future__ import annotations

import os

PRIORITIES = ("idle", "low", "normal")
DEFAULT_PRIORITY = "idle"


def lower(priority: str) -> None:
    """This thread's (and every later thread's) CPU priority: one of PRIORITIES."""
    if priority == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    elif priority == "low":
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    elif priority != "normal":
        raise ValueError(f"unknown priority {priority!r} (one of {', '.join(PRIORITIES)})")
