"""A trainer that checkpoints continuously, for the durability-lag tests; run as its own process.

usage: lag_writer.py MOUNTPOINT LOGFILE rename|inplace [SIZE]

rename:  each step N writes stepN.pt.tmp, renames it to stepN.pt and deletes step N-1
         (tmp + rename + delete the previous, as checkpoint managers do);
inplace: each step N overwrites last.pt in place (as Lightning's save_last does).
No pause between saves, no fsync. After each save is visible it appends "saved N TIME"
(time.time()) to LOGFILE, on another filesystem. It resumes after the highest step it
finds and runs until it is killed. `payload(N)` starts with N, so a file names its step.
"""
import os
import re
import struct
import sys
import time

import numpy as np


def body(size: int = 16 << 20) -> bytes:
    """The bytes after the step number: the same random block for every step, made once, so the
    writer saves back to back with no pause to compute them."""
    return np.random.default_rng(0).integers(0, 256, size - 8, dtype=np.uint8).tobytes()


def payload(step: int, size: int = 16 << 20) -> bytes:
    return struct.pack("<Q", step) + body(size)


def step_of(data: bytes) -> int:
    return struct.unpack_from("<Q", data)[0] if len(data) >= 8 else -1


def existing_steps(mp: str) -> list[int]:
    steps = [int(m.group(1)) for n in os.listdir(mp) if (m := re.fullmatch(r"step(\d+)\.pt", n))]
    if os.path.exists(f"{mp}/last.pt"):
        with open(f"{mp}/last.pt", "rb") as f:
            steps.append(step_of(f.read(8)))
    return steps


def main(mp: str, logfile: str, mode: str, size: int) -> None:
    step = max(existing_steps(mp), default=-1) + 1
    rest = body(size)
    with open(logfile, "a") as log:
        while True:
            head = struct.pack("<Q", step)
            if mode == "rename":
                with open(f"{mp}/step{step:06d}.pt.tmp", "wb") as f:
                    f.write(head)
                    f.write(rest)
                os.replace(f"{mp}/step{step:06d}.pt.tmp", f"{mp}/step{step:06d}.pt")
                for n in os.listdir(mp):
                    if n != f"step{step:06d}.pt":
                        os.unlink(f"{mp}/{n}")
            else:
                with open(f"{mp}/last.pt", "wb") as f:
                    f.write(head)
                    f.write(rest)
            log.write(f"saved {step} {time.time():.6f}\n")
            log.flush()
            step += 1


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 16 << 20)
