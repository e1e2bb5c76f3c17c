"""The raw baseline: write N bytes striped across device files with O_DIRECT.

usage: rawwrite.py TOTAL_BYTES BLOCK QUEUE_DEPTH OFFSET DEV [DEV...]

1 MiB-aligned blocks go round-robin to the devices starting at OFFSET, with
QUEUE_DEPTH writer threads per device (the same I/O shape ckptfs uses), then
every device is fdatasync'ed. Prints the seconds from first write to the
last flush. Run as its own process so a benchmark can put it in a cgroup.
"""
import mmap
import os
import random
import sys
import threading
import time


def main() -> None:
    total, block, qd, base = (int(x) for x in sys.argv[1:5])
    devs = sys.argv[5:]
    fds = [os.open(d, os.O_RDWR | os.O_DIRECT) for d in devs]
    buf = mmap.mmap(-1, block)
    buf.write(random.randbytes(block))
    view = memoryview(buf)
    nblocks = -(-total // block)
    per_dev = [[i for i in range(nblocks) if i % len(devs) == d] for d in range(len(devs))]
    errors = []

    def worker(d: int, mine: list[int]) -> None:
        try:
            for i in mine:
                off = base + (i // len(devs)) * block
                if os.pwritev(fds[d], [view], off) != block:
                    raise OSError("short write")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(d, per_dev[d][k::qd]))
               for d in range(len(devs)) for k in range(qd)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for fd in fds:
        os.fdatasync(fd)
    dt = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"raw write failed: {errors[0]}")
    print(f"{dt:.6f}")


if __name__ == "__main__":
    main()
