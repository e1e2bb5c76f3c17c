"""Incremental checkpoints: what each save costs the devices and the store, dedupe off and on.

Each round runs the workloads twice, `--dedupe off` and `--dedupe on` (which first alternates
by round), each on a fresh pool that replicates to a real S3 server (SeaweedFS `weed mini`, tests/s3server.py,
one server for the whole run). Workloads, in this order:

  finetune  a model of `--layers` fp32 4096 x 4096 Linear layers (20: 1.25 GiB of
            parameters), all but the last `--trainable` frozen, Adam on the rest; every step
            `torch.save({"model", "optim"})` under a new name (step<N>.pt): with 1 of 20
            layers trained, about 14% of each file changes (the weights and two moments)
  throttled the fine-tuning saves again (one more first, not counted) into a fresh pool of loop
            devices whose writes a blkio cgroup limits to `--throttle` each (as in drain.py): a
            pool whose devices, not the absorb, bound the time to durable
  copy      `shutil.copy` of the newest checkpoint inside the mount (Lightning's save_last in
            copy mode, or a user keeping "best.pt")
  full      one save with every layer trained (Adam on all of them): everything changes
  restore   the pool's devices are dropped; a fresh pool restores from the store
            (`--restore-from`) and replicates back to it

Per save: bytes written to the devices (the daemon's per-device counters, its journal included)
and bytes uploaded (its replication counter), each as a fraction of the file's size; blocked
time (`torch.save` or the copy), time to durable (until `ckptfs.wait_durable`) and the daemon's
CPU seconds until the save is uploaded (per GiB saved: absorb, drain, replicate) and the uploader
process's (signing and sending, and with dedupe off naming the segments). And,
read back from the mount, the fraction of the file's pool-sized chunks whose bytes repeat a chunk
of an earlier save or an earlier chunk of the same file (BLAKE2b-256): what a dedupe of fixed
chunks at the pool's chunk size could skip at most (`repeat`). Ratios on / off, round by round:
blocked and durable time of the fine-tuning (unthrottled and throttled) and the full-training
saves. The targets are the issue's; its time to durable (<= 0.4x) needs devices that bound it,
so it is judged on the throttled saves, while on the unthrottled pool here the absorb takes
longer than the drain either way and dedupe must cost no time (<= 1.05x). The restore runs with
dedupe on only: a restored pool names each file it brought back unchanged by the version it
came from, whose segments the store holds, so it uploads none of them again, either way. Uploads are by 4 MiB segment named by content (replicate/segments.py),
with dedupe on or off: off, the daemon reads each new version and the uploader process hashes
it to name its segments.

usage: python benchmarks/incremental.py [--layers 20] [--trainable 1] [--steps 3] [--repeats 1]
                                         [--throttle 200M] [--throttled-steps 2]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

from common import (GiB, MiB, ROOT, SCRATCH, file_devices, finish, machine, mounted, now, pairwise,
                    parse_size, proc_cpu_seconds, rotated, stats, target)
from drain import Devices

sys.path.insert(0, str(ROOT / "tests"))
from s3server import S3Server  # noqa: E402

from ckptfs.ops.api import status, wait_durable, wait_replicated  # noqa: E402

BUCKET = "bench"
SIDE = 4096


def counters(mp: Path) -> tuple[int, int, float]:
    """(bytes written to all devices, bytes uploaded to the store, the uploader process's CPU
    seconds) so far, by the daemon's count."""
    st = status(mp, window=0.1)
    rep = st["replication"]
    return (sum(d["bytes_written"] for d in st["pool"]["devices"]), rep["bytes_uploaded"],
            rep["uploader"]["cpu_s"])


class Repeats:
    """The digests of every chunk seen so far; `share(path)` is the fraction of the file's chunks
    already seen (in earlier files, or earlier in the same file), then remembers them."""

    def __init__(self, chunk: int):
        self.chunk = chunk
        self.seen: set[bytes] = set()

    def share(self, path: Path) -> float:
        n = hit = 0
        with open(path, "rb") as f:
            while block := f.read(self.chunk):
                d = hashlib.blake2b(block, digest_size=32).digest()
                n += 1
                hit += d in self.seen
                self.seen.add(d)
        return hit / n if n else 0.0


def model(layers: int, trainable: int):
    import torch
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(torch.nn.Linear(SIDE, SIDE, bias=False) for _ in range(layers)))
    for p in list(net.parameters())[: layers - trainable]:
        p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-4)
    return net, opt


def step(net, opt) -> None:
    import torch
    x = torch.randn(8, SIDE)
    loss = net(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def measure(mp: Path, pid: int, name: str, act, repeats: Repeats) -> dict:
    """One save: `act()` writes mp/name; the costs (the daemon's CPU until the file is replicated)
    and the repeat share of the result (read back after)."""
    dev0, up0, ucpu0 = counters(mp)
    cpu0 = proc_cpu_seconds(pid)
    t0 = time.perf_counter()
    act()
    blocked = time.perf_counter() - t0
    wait_durable(mp / name)
    durable = time.perf_counter() - t0
    wait_replicated(mp / name)
    cpu = proc_cpu_seconds(pid) - cpu0
    dev1, up1, ucpu1 = counters(mp)
    size = (mp / name).stat().st_size
    return {"name": name, "size": size, "blocked": blocked, "durable": durable, "daemon_cpu": cpu,
            "uploader_cpu": ucpu1 - ucpu0,
            "device_fraction": (dev1 - dev0) / size, "upload_fraction": (up1 - up0) / size,
            "repeat": repeats.share(mp / name)}


def run(args, srv: S3Server, rnd: int, dedupe: str) -> dict:
    """One round with `--dedupe dedupe`; the restore only with dedupe on (it does not depend on it)."""
    scratch = args.scratch / f"round{rnd}"
    shutil.rmtree(scratch, ignore_errors=True)
    url = f"s3://{BUCKET}/incremental-{rnd}-{dedupe}"
    extra = ("--s3-endpoint", srv.endpoint, "--dedupe", dedupe)
    layer = SIDE * SIDE * 4
    finetune = (args.layers + 2 * args.trainable) * layer
    tree = (args.steps + 1) * finetune + 3 * args.layers * layer  # the saves, the copy, one full save
    devices = file_devices(scratch / "devices", 2, tree // 2 + 2 * GiB)
    mp = scratch / "mnt"
    out: dict = {"finetune": [], "copy": [], "full": []}
    with mounted(mp, devices, args.memory, extra=("--replicate", url, *extra)) as pid:
        tree = saves(args, mp, pid, out)
    for d in devices:
        d.unlink()
    if args.throttled_steps:
        throttled = Devices(scratch / "throttled", 2, (args.throttled_steps + 1) * finetune // 2 + GiB,
                            args.throttle, loop=True)
        try:
            with mounted(mp, throttled.paths, args.memory, extra=("--replicate", url + "-throttled", *extra)) as pid:
                throttled.confine(pid)
                out["throttled"] = finetune_saves(args, mp, pid, args.throttled_steps + 1)[1:]
        finally:
            throttled.close()
    if dedupe == "off":
        shutil.rmtree(scratch, ignore_errors=True)
        return out
    fresh = file_devices(scratch / "fresh", 2, tree // 2 + 2 * GiB)
    with mounted(mp, fresh, args.memory, extra=("--restore-from", url, "--replicate", url, *extra)) as pid:
        t0 = time.perf_counter()
        wait_replicated(mp)
        _, up, _ = counters(mp)
        out["restore"] = [{"name": "tree", "size": tree, "seconds": time.perf_counter() - t0,
                           "upload_fraction": up / tree}]
    shutil.rmtree(scratch, ignore_errors=True)
    return out


def finetune_saves(args, mp: Path, pid: int, n: int, repeats: Repeats | None = None) -> list[dict]:
    """`n` fine-tuning saves of a fresh model into the mount at `mp`, each measured."""
    import torch
    repeats = repeats or Repeats(status(mp)["pool"]["chunk_size"])
    net, opt = model(args.layers, args.trainable)
    out = []
    for i in range(n):
        step(net, opt)
        name = f"step{i:04d}.pt"
        out.append(measure(mp, pid, name, lambda: torch.save(
            {"model": net.state_dict(), "optim": opt.state_dict()}, mp / name), repeats))
    return out


def saves(args, mp: Path, pid: int, out: dict) -> int:
    """The fine-tuning saves, the copy and the full save into the mount at `mp`, each measured into
    `out`; the bytes of the tree they leave."""
    import torch
    repeats = Repeats(status(mp)["pool"]["chunk_size"])
    out["chunk"] = repeats.chunk
    out["finetune"] = finetune_saves(args, mp, pid, args.steps, repeats)
    newest = f"step{args.steps - 1:04d}.pt"
    out["copy"].append(measure(mp, pid, "last.pt", lambda: shutil.copy(mp / newest, mp / "last.pt"), repeats))
    net, opt = model(args.layers, args.layers)
    step(net, opt)
    out["full"].append(measure(mp, pid, "full.pt", lambda: torch.save(
        {"model": net.state_dict(), "optim": opt.state_dict()}, mp / "full.pt"), repeats))
    return sum(p.stat().st_size for p in mp.iterdir() if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--trainable", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="fine-tuning saves (the first has nothing to repeat)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--throttled-steps", type=int, default=2, help="fine-tuning saves on throttled devices")
    ap.add_argument("--throttle", default="200M", help="their per-device write limit (default %(default)s/s)")
    ap.add_argument("--memory", default="3G")
    ap.add_argument("--scratch", type=Path, default=SCRATCH / "incremental")
    args = ap.parse_args(argv)
    args.throttle = parse_size(args.throttle)
    t0 = time.perf_counter()
    srv = S3Server(args.scratch / "s3")
    shutil.rmtree(srv.root, ignore_errors=True)
    srv.start()
    os.environ.update(srv.env())  # the daemons' AWS chain
    try:
        srv.client().create_bucket(Bucket=BUCKET)
        rounds = [{mode: run(args, srv, r, mode) for mode in rotated(["off", "on"], r)} for r in range(args.repeats)]
    finally:
        srv.stop()
    data: dict = {"machine": machine(), "when": now(), "seconds": time.perf_counter() - t0,
                  "args": vars(args) | {"scratch": str(args.scratch)}, "rounds": rounds}
    summary: dict = {}
    for mode in ("off", "on"):
        # a round's first fine-tuning save has no earlier save to repeat: it is reported, not counted
        kinds = {kind: [s for r in rounds for s in r[mode][kind][1 if kind == "finetune" else 0:]]
                 for kind in ("finetune", "throttled", "copy", "full") if rounds[0][mode].get(kind)}
        summary[mode] = {}
        for kind, saves in kinds.items():
            summary[mode][kind] = {k: stats([s[k] for s in saves]) for k in
                                   ("device_fraction", "upload_fraction", "repeat", "blocked", "durable")}
            summary[mode][kind]["size_gib"] = saves[0]["size"] / GiB
            gib = sum(s["size"] for s in saves) / GiB
            summary[mode][kind]["daemon_cpu_per_gib"] = sum(s["daemon_cpu"] for s in saves) / gib
            summary[mode][kind]["uploader_cpu_per_gib"] = sum(s["uploader_cpu"] for s in saves) / gib
            s = summary[mode][kind]
            print(f"dedupe {mode:3s} {kind:9s} {s['size_gib']:.2f} GiB/save: device "
                  f"{s['device_fraction']['median']:.2f}, upload {s['upload_fraction']['median']:.2f}, repeat at "
                  f"{rounds[0][mode]['chunk'] // MiB} MiB chunks {s['repeat']['median']:.2f}; blocked "
                  f"{s['blocked']['median']:.2f} s, durable {s['durable']['median']:.2f} s, daemon CPU "
                  f"{s['daemon_cpu_per_gib']:.2f} s/GiB, uploader CPU {s['uploader_cpu_per_gib']:.2f} s/GiB")
    summary["restore"] = {"upload_fraction": stats([r["on"]["restore"][0]["upload_fraction"] for r in rounds])}
    print(f"restore   upload {summary['restore']['upload_fraction']['median']:.2f} of the restored tree")
    def each(mode: str, kind: str, k: str) -> list[float]:
        return [s[k] for r in rounds for s in r[mode][kind][1 if kind == "finetune" else 0:]]
    ratio = {f"{kind} {k} on/off": pairwise(each("on", kind, k), each("off", kind, k))
             for kind in ("finetune", "throttled", "full") for k in ("blocked", "durable") if rounds[0]["on"].get(kind)}
    data["summary"], data["ratios"] = summary, ratio
    on = summary["on"]
    data["targets"] = [
        target("incremental finetune device bytes / save", on["finetune"]["device_fraction"]["median"], 0.25),
        target("incremental finetune uploaded bytes / save", on["finetune"]["upload_fraction"]["median"], 0.25),
        target(f"incremental finetune time to durable, on / off, devices throttled to {args.throttle // MiB} MiB/s",
               ratio.get("throttled durable on/off", {}).get("median"), 0.4),
        target("incremental finetune time to durable, on / off, devices unthrottled (absorb-bound here)",
               ratio["finetune durable on/off"]["median"], 1.05),
        target("incremental finetune blocked, on / off", ratio["finetune blocked on/off"]["median"], 1.05),
        target("incremental full training blocked, on / off", ratio["full blocked on/off"]["median"], 1.05),
        target("incremental full training durable, on / off", ratio["full durable on/off"]["median"], 1.05),
        target("incremental copy device bytes / copy", on["copy"]["device_fraction"]["median"], 0.05),
        target("incremental copy uploaded bytes / copy", on["copy"]["upload_fraction"]["median"], 0.05),
        target("incremental restored pool uploads / tree", summary["restore"]["upload_fraction"]["median"], 0.01),
    ]
    return finish("incremental", data, ratio)


if __name__ == "__main__":
    sys.exit(main())
