"""Which content digest per chunk: CPU per GiB, and whether it lets the interpreter lock go.

Incremental checkpoints (dedupe on the devices, objects by content in the
store) need a digest per chunk that two different chunks never share. It is
computed in worker threads, so what matters is (1) CPU seconds per GiB and
(2) how much of that time the interpreter lock stays free: a digest that
holds the lock caps the whole mount like any other Python time.

For each algorithm importable here (hashlib's sha256 and blake2b always, and
crc32c, today's per-chunk check, for scale;
`blake3` and `xxhash`'s xxh3_128 when installed: `pip install blake3 xxhash`),
`--chunks` distinct chunks of `--chunk-size` random bytes (in memory,
pre-faulted) are hashed one chunk per call:

  alone     one thread: GiB/s and CPU s/GiB (process CPU over the pass);
  threads   `--threads` threads sharing the chunks: GiB/s;
  lock free a pure-Python counter runs on the main thread while one worker
            hashes: its rate against the counter alone (1.0: the digest never
            holds the lock; near 0: it holds it the whole time).

    .venv/bin/python benchmarks/probes/digest.py --chunks 512 --repeats 3
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

MiB, GiB = 1 << 20, 1 << 30


def algorithms() -> dict:
    import crc32c
    out = {"crc32c (today's check, not a digest)": lambda b: crc32c.crc32c(b),
           "sha256": lambda b: hashlib.sha256(b).digest(),
           "blake2b-256": lambda b: hashlib.blake2b(b, digest_size=32).digest()}
    try:
        import blake3
        out["blake3"] = lambda b: blake3.blake3(b).digest()
    except ImportError:
        pass
    try:
        import xxhash
        out["xxh3-128"] = lambda b: xxhash.xxh3_128_digest(b)
    except ImportError:
        pass
    return out


def alone(fn, chunks) -> tuple[float, float]:
    """(GiB/s, CPU s per GiB) of one thread hashing every chunk."""
    t0, c0 = time.perf_counter(), time.process_time()
    for c in chunks:
        fn(c)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    gib = sum(len(c) for c in chunks) / GiB
    return gib / wall, cpu / gib


def threaded(fn, chunks, nthreads: int) -> float:
    gib = sum(len(c) for c in chunks) / GiB
    t0 = time.perf_counter()
    with ThreadPoolExecutor(nthreads) as pool:
        list(pool.map(fn, chunks))
    return gib / (time.perf_counter() - t0)


def count_for(seconds: float, stop: threading.Event | None = None) -> float:
    """A pure-Python loop's iterations per second, for `seconds` or until `stop`."""
    n, t0 = 0, time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end and not (stop is not None and stop.is_set()):
        for _ in range(1000):
            n += 1
    return n / (time.perf_counter() - t0)


def lock_free(fn, chunks) -> float:
    """The counter's rate while one worker hashes, over its rate alone."""
    base = count_for(0.3)
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            for c in chunks:
                fn(c)
                if stop.is_set():
                    return

    t = threading.Thread(target=work)
    t.start()
    time.sleep(0.05)
    try:
        busy = count_for(0.5)
    finally:
        stop.set()
        t.join()
    return busy / base


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=512)
    ap.add_argument("--chunk-size", type=int, default=MiB)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    chunks = [os.urandom(args.chunk_size) for _ in range(args.chunks)]
    print(f"{args.chunks} chunks of {args.chunk_size >> 10} KiB, {os.cpu_count()} CPUs, "
          f"{args.threads} threads; medians of {args.repeats}")
    print(f"{'digest':38} {'GiB/s':>7} {'CPU s/GiB':>10} {f'GiB/s x{args.threads}':>11} {'lock free':>10}")
    for name, fn in algorithms().items():
        fn(chunks[0])  # warm: imports, first call
        rates, cpus, multi, free = [], [], [], []
        for _ in range(args.repeats):
            r, c = alone(fn, chunks)
            rates.append(r)
            cpus.append(c)
            multi.append(threaded(fn, chunks, args.threads))
            free.append(lock_free(fn, chunks))
        med = statistics.median
        print(f"{name:38} {med(rates):7.2f} {med(cpus):10.3f} {med(multi):11.2f} {med(free):10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
