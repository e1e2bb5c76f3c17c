"""The trainer side of the drain benchmark: save into a directory, then fsync.

usage: durable_save.py PATH {torch,bytes} TOTAL_BYTES

torch: torch.save of a state dict of random fp32 tensors (4096 x 4096 each)
totalling TOTAL_BYTES; bytes: TOTAL_BYTES of random data in 64 MiB write()
calls, one random block with every 4 KiB of it stamped anew before each call,
so that no chunk repeats another (a mount dedupes by default). Prints JSON: blocked (seconds until the save call returned) and
durable (seconds until fsync on the file returned), both from the start.
"""
import json
import os
import sys
import time


def main() -> None:
    path, kind, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if kind == "torch":
        import torch
        from common import random_state_dict
        payload = random_state_dict(total)
    else:
        import numpy as np
        block = np.frombuffer(bytearray(os.urandom(64 << 20)), dtype=np.uint64)
        stamps = block[::4096 // 8]
        view = memoryview(block).cast("B")
    t0 = time.perf_counter()
    if kind == "torch":
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:
            left = total
            while left:
                stamps += np.uint64(len(stamps))
                left -= f.write(view[:min(left, len(view))])
    blocked = time.perf_counter() - t0
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    durable = time.perf_counter() - t0
    print(json.dumps({"blocked": blocked, "durable": durable, "bytes": os.path.getsize(path)}))


if __name__ == "__main__":
    main()
