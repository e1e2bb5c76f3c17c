"""A checkpoint loop for the crash tests, run as its own process.

usage: crash_writer.py MOUNTPOINT LOGFILE

Each step N writes stepN.bin.tmp (fsync on even steps), renames it to
stepN.bin, deletes step N-2, and overwrites latest.bin in place. After an
fsync returns it appends "fsynced N" to LOGFILE (on another filesystem,
itself fsynced). It resumes after the highest step it finds, and runs until
it is killed. On resume it deletes what a crash left behind (tmp files,
saves older than the last two), as checkpoint managers do.
"""
import os
import random
import re
import sys


def payload(step: int) -> bytes:
    rng = random.Random(step)
    return rng.randbytes(rng.randint(1, 6) * (1 << 20) + rng.randint(0, 99999))


def main(mp: str, logfile: str) -> None:
    steps = [int(m.group(1)) for n in os.listdir(mp) if (m := re.match(r"step(\d+)\.bin", n))]
    step = max(steps, default=-1) + 1
    for n in os.listdir(mp):  # like a checkpoint manager on resume: drop leftovers of the crash
        m = re.fullmatch(r"step(\d+)\.bin(\.tmp)?", n)
        if m and (m.group(2) or int(m.group(1)) < step - 2):
            os.unlink(f"{mp}/{n}")
    with open(logfile, "a") as log:
        while True:
            data = payload(step)
            tmp = f"{mp}/step{step:05d}.bin.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                if step % 2 == 0:
                    f.flush()
                    os.fsync(f.fileno())
                    log.write(f"fsynced {step}\n")
                    log.flush()
                    os.fsync(log.fileno())
            os.replace(tmp, f"{mp}/step{step:05d}.bin")
            old = f"{mp}/step{step - 2:05d}.bin"
            if os.path.exists(old):
                os.unlink(old)
            with open(f"{mp}/latest.bin", "wb") as f:
                f.write(data)
            step += 1


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
