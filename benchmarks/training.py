"""Case 2, training overhead: step time of an unchanged training loop that checkpoints every step
and every 10 steps, against the same loop without checkpoints.

The model is examples/train.py's MLP (a few hundred ms per step on 2 cores;
its checkpoint, model + Adam state, is ~160 MiB of random-looking fp32).
Each configuration runs `--warmup` unmeasured steps (with its saves, so
background work from earlier saves is in flight when measurement starts, as
in a steady state) and then `--steps` measured ones; the figure is the mean
step time. Configurations, rotated every round:

  none         no checkpoint: the baseline of the round;
  shm          torch.save to /dev/shm/ckpt.pt (the floor; nothing durable);
  ckptfs       torch.save to MOUNT/ckpt.pt, the loop unchanged (durable in the background);
  ext4_fsync   torch.save to ext4 + fsync (durable before training continues);
  dcp_async    dcp.async_save (DefaultStager, FileSystemWriter thread_count=4) as the DCP
               docs use it: wait for the previous upload before a new save, and for
               staging before the next optimizer.step() touches the weights;
  ckptfs_s3    (with --replicate) torch.save to a second mount that also replicates to a
               real S3 server on this machine (SeaweedFS, tests/s3server.py): what
               replication costs the trainer, next to `ckptfs` (issue 13: within noise);
  boto3_s3     (with --replicate) the same replication by hand: torch.save to the plain
               mount, then a background process (handmade_upload.py, at the same CPU
               priority as ckptfs's uploader) uploads the newest saved file with boto3
               to the same server: what moving the same bytes costs without ckptfs.

Overhead = mean step time - the same round's baseline; ratios to the /dev/shm
floor are taken round by round. Target: with a checkpoint every step, the
ckptfs overhead is within 1.15 x the /dev/shm overhead.

Durability lag: before each save, the age of the newest checkpoint that a
crash at that moment would keep (max and median per system): ext4 + fsync,
the last save; dcp_async, the last whose upload completed; ckptfs, the last
save closed before the oldest journal record still pending (the daemon's
`lag` control request; prefix rule), or the last save when nothing is
pending; /dev/shm keeps nothing (not reported).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from common import (ROOT, SCRATCH, GiB, children_cpu_seconds, clear_dir, file_devices, finish, fsync_path, machine,
                    mounted, now, pairwise, proc_cpu_seconds, rotated, shm_dir, stats, sync_mount, target)

from ckptfs.replicate.priority import DEFAULT_PRIORITY, PRIORITIES

sys.path.insert(0, str(ROOT / "examples"))
from train import batch, build_model  # noqa: E402 - the example's own model and data

SYSTEMS = ["shm", "ckptfs", "ext4_fsync", "dcp_async"]
LABELS = {"none": "no checkpoint", "shm": "torch.save → /dev/shm", "ckptfs": "torch.save → ckptfs",
          "ext4_fsync": "torch.save → ext4 + fsync", "dcp_async": "dcp.async_save → ext4",
          "ckptfs_s3": "torch.save → ckptfs --replicate s3://",
          "boto3_s3": "torch.save → ckptfs, boto3 upload by hand"}
CKPTFS = ("ckptfs", "ckptfs_s3", "boto3_s3")  # the systems that save into a ckptfs mount
REPLICATING = ("ckptfs_s3", "boto3_s3")  # added by --replicate


class Saver:
    """How one system saves from inside the loop. `before_update` runs just before
    optimizer.step(); `finish` after the measured steps (not timed)."""

    def __init__(self, kind: str, dirs: dict[str, Path], handmade=None):
        self.kind = kind
        self.handmade = handmade  # boto3_s3: the Popen of handmade_upload.py
        self.handmade_bytes = 0  # what it had uploaded at the last finish()
        self.dir = dirs.get(kind)
        self.stager = None
        self.pending = None  # DCP: the last AsyncSaveResponse
        self.saved_at: list[float] = []  # when each save returned (time.monotonic)
        self.ages: list[float] = []  # sampled before each save: age of the newest durable checkpoint
        self.control = None
        if kind in CKPTFS:
            from ckptfs.ops.control import Client, control_path
            self.control = Client(control_path(str(self.dir)))

    def sample_durable_age(self) -> None:
        now = time.monotonic()
        if self.kind == "ext4_fsync":
            newest = self.saved_at[-1] if self.saved_at else None
        elif self.kind == "dcp_async":
            done = self.pending is None or self.pending.upload_completion.done()
            newest = self.saved_at[-1 if done else -2] if len(self.saved_at) >= (1 if done else 2) else None
        elif self.kind in CKPTFS:
            lag = self.control.request({"op": "lag"})["lag"]
            committed = [t for t in self.saved_at if t <= now - lag] if lag > 0 else self.saved_at
            newest = committed[-1] if committed else None
        else:
            return  # /dev/shm: nothing survives a crash
        if newest is not None:
            self.ages.append(now - newest)

    def save(self, state: dict) -> None:
        self.sample_durable_age()
        self._save(state)
        self.saved_at.append(time.monotonic())

    def _save(self, state: dict) -> None:
        if self.kind in ("shm", *CKPTFS):
            torch.save(state, self.dir / "ckpt.pt")
            if self.handmade is not None:
                self.handmade.stdin.write(f"{self.dir / 'ckpt.pt'}\n")
                self.handmade.stdin.flush()
        elif self.kind == "ext4_fsync":
            torch.save(state, self.dir / "ckpt.pt")
            fsync_path(self.dir / "ckpt.pt")
        elif self.kind == "dcp_async":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            if self.stager is None:
                self.stager = DefaultStager(StagingOptions(False, False, True, False))
            if self.pending is not None:
                self.pending.upload_completion.result()
            self.pending = dcp.async_save(
                state, storage_writer=dcp.FileSystemWriter(self.dir / "dcp", thread_count=4, sync_files=True),
                async_stager=self.stager, no_dist=True)

    def before_update(self) -> None:
        if self.pending is not None:
            self.pending.staging_completion.result()

    def finish(self) -> None:
        if self.handmade is not None:  # its uploads must not run into the next configuration
            self.handmade.stdin.write("sync\n")
            self.handmade.stdin.flush()
            reply = self.handmade.stdout.readline().split()
            if not reply or reply[0] != "done":
                raise SystemExit(f"training: handmade_upload.py failed (exit {self.handmade.wait()})")
            self.handmade_bytes = int(reply[1])
        if self.control is not None:
            self.control.close()
            self.control = None
        if self.pending is not None:
            self.pending.upload_completion.result()
            self.pending = None
        if self.stager is not None:
            self.stager.close()
            self.stager = None


@contextlib.contextmanager
def handmade_uploader(endpoint: str, priority: str | None):
    """handmade_upload.py running against `endpoint` (bucket `training`, prefix `handmade`)."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("handmade_upload.py")), endpoint,
                             "training", "handmade", priority or DEFAULT_PRIORITY],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def s3_target(scratch: Path, idle: bool, server: dict, rate: str | None = None, priority: str | None = None):
    """A fresh local S3 server with a bucket; yields the mount options that replicate to it.
    `idle`: the server's threads get SCHED_IDLE, so it runs only on CPU the trainer and the
    daemon leave (it stands in for an object store on other machines; its CPU is reported
    apart, in `server`, never counted in the trainer's overhead)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from s3server import S3Server
    shutil.rmtree(scratch / "s3", ignore_errors=True)
    srv = S3Server(scratch / "s3")
    srv.start()
    server["pid"] = srv.proc.pid
    if idle:
        for tid in os.listdir(f"/proc/{srv.proc.pid}/task"):  # threads made later inherit it
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
    os.environ.update(srv.env())
    try:
        srv.client().create_bucket(Bucket="training")
        yield ("--replicate", "s3://training/node-0", "--s3-endpoint", srv.endpoint,
               *(("--replicate-rate", rate) if rate else ()), *(("--replicate-priority", priority) if priority else ()))
    finally:
        server["cpu_s"] = proc_cpu_seconds(srv.proc.pid)
        srv.stop()


CKPTFS_CMD = (sys.executable, "-m", "ckptfs")


def replication_totals(mp: Path) -> dict:
    """The replication block of `ckptfs status --json` (uploaded, skipped, lag...)."""
    res = subprocess.run([*CKPTFS_CMD, "status", str(mp), "--json"], capture_output=True, text=True, check=True)
    return json.loads(res.stdout).get("replication", {})


def run(model: nn.Module, optim, saver: Saver | None, every: int, warmup: int, steps: int,
        batch_size: int, width: int, step0: int, daemon_pid: int,
        server_pid: int | None) -> tuple[float, float, float, float, float]:
    """Per measured step (saves included): wall seconds, this process's CPU seconds, the ckptfs
    daemon's CPU seconds, its uploader process's (--replicate; the object-store calls; for
    boto3_s3, handmade_upload.py's), the local S3 server's. The saver keeps the durability ages
    it sampled."""
    def uploader_cpu() -> float:
        if saver is not None and saver.handmade is not None:
            return proc_cpu_seconds(saver.handmade.pid)
        return children_cpu_seconds(daemon_pid)

    def one(i: int) -> None:
        x, y = batch(step0 + i, batch_size, width)
        loss = nn.functional.mse_loss(model(x), y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        if saver is not None:
            saver.before_update()
        optim.step()
        if saver is not None and i % every == 0:
            saver.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step0 + i})

    for i in range(warmup):
        one(i - warmup)
    t0, c0, d0 = time.perf_counter(), os.times(), proc_cpu_seconds(daemon_pid)
    u0, s0 = uploader_cpu(), proc_cpu_seconds(server_pid) if server_pid else 0.0
    for i in range(steps):
        one(i)
    dt = (time.perf_counter() - t0) / steps
    c1, d1, u1 = os.times(), proc_cpu_seconds(daemon_pid), uploader_cpu()
    s1 = proc_cpu_seconds(server_pid) if server_pid else 0.0
    if saver is not None:
        saver.finish()
    return (dt, (c1.user + c1.system - c0.user - c0.system) / steps, (d1 - d0) / steps, (u1 - u0) / steps,
            (s1 - s0) / steps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="rounds (default %(default)s)")
    ap.add_argument("--every", default="1,10", help="checkpoint intervals in steps (default %(default)s)")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per run, x every/2 for every > 2")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps before each run")
    ap.add_argument("--params-mb", type=float, default=54, help="model size, MiB of fp32 parameters")
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--memory", default="3G")
    ap.add_argument("--max-lag", default=None, help="ckptfs --max-lag (default: ckptfs's own)")
    ap.add_argument("--replicate", action="store_true",
                    help="add ckptfs_s3 (a second mount replicating to a local S3 server, SeaweedFS) "
                         "and boto3_s3 (the plain mount, uploads by hand to the same server)")
    ap.add_argument("--replicate-rate", default=None, metavar="BYTES/S",
                    help="ckptfs --replicate-rate for ckptfs_s3 (default: no cap)")
    ap.add_argument("--replicate-priority", choices=PRIORITIES, default=None,
                    help="ckptfs --replicate-priority for ckptfs_s3: its uploader process, and "
                         "the priority of boto3_s3's (default: ckptfs's own)")
    ap.add_argument("--s3-priority", choices=("idle", "normal"), default="idle",
                    help="CPU priority of the local S3 server (default idle: it stands in for a remote store "
                         "and must not take the trainer's CPU on a small machine; its CPU is reported apart)")
    ap.add_argument("--scratch", type=Path, default=SCRATCH / "training")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    everies = [int(x) for x in args.every.split(",")]
    systems = [s for s in args.systems.split(",") if s] + (list(REPLICATING) if args.replicate else [])

    def steps_for(every: int) -> int:  # every-10 runs 20 steps: two saves, each followed by 9 steps
        return max(args.steps, 2 * every)

    torch.manual_seed(0)
    model = build_model(args.params_mb, args.width)
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    probe = {"model": model.state_dict()}
    scratch = args.scratch.resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    ext4 = scratch / "ext4"
    shutil.rmtree(ext4, ignore_errors=True)
    ext4.mkdir()
    devices = file_devices(scratch / "devices", 2, 8 * GiB)
    if "boto3_s3" in systems and "ckptfs_s3" not in systems:
        ap.error("boto3_s3 comes with --replicate (it uploads to the S3 server ckptfs_s3 starts)")
    devices_s3 = file_devices(scratch / "devices-s3", 2, 8 * GiB) if "ckptfs_s3" in systems else []
    configs = [("none", 0)] + [(s, e) for s in systems for e in everies]
    times: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    cpus: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {c: [] for c in configs}
    ages: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    step = 0
    ckpt_bytes = 0
    server: dict = {}  # the S3 server's pid, then its CPU seconds over the run
    uploaded: dict[tuple[str, int], list[int]] = {c: [] for c in configs}  # bytes per run (REPLICATING)
    uploaded_before: dict[str, int] = {}  # each system's total after its previous run
    replication: dict = {}
    t_start = time.perf_counter()
    try:
        extra = ("--max-lag", args.max_lag) if args.max_lag else ()
        with contextlib.ExitStack() as stack:
            shm = stack.enter_context(shm_dir("training"))
            pid = stack.enter_context(mounted(scratch / "mnt", devices, args.memory, extra=extra,
                                              log_file=scratch / "daemon.log"))
            pids = {"ckptfs": pid}
            dirs = {"shm": shm, "ckptfs": scratch / "mnt", "ext4_fsync": ext4, "dcp_async": ext4,
                    "ckptfs_s3": scratch / "mnt-s3", "boto3_s3": scratch / "mnt"}
            handmade = None
            if "ckptfs_s3" in systems:
                target_opts = stack.enter_context(s3_target(scratch, args.s3_priority == "idle", server,
                                                            args.replicate_rate, args.replicate_priority))
                pids["ckptfs_s3"] = stack.enter_context(mounted(
                    dirs["ckptfs_s3"], devices_s3, args.memory, log_file=scratch / "daemon-s3.log",
                    extra=(*extra, *target_opts)))
                handmade = stack.enter_context(handmade_uploader(
                    target_opts[target_opts.index("--s3-endpoint") + 1], args.replicate_priority))
            # one unmeasured pass: first-touch of every buffer, the checkpoint's size
            run(model, optim, None, 1, 2, 1, args.batch_size, args.width, step, pid, None)
            torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": 0}, shm / "probe.pt")
            ckpt_bytes = (shm / "probe.pt").stat().st_size
            (shm / "probe.pt").unlink()
            for rnd in range(args.repeats):
                for kind, every in rotated(configs, rnd):
                    saver = None if kind == "none" else Saver(kind, dirs, handmade if kind == "boto3_s3" else None)
                    n = steps_for(every) if kind != "none" else args.steps
                    dt, cpu, dcpu, ucpu, scpu = run(model, optim, saver, every or 1, args.warmup, n,
                                                    args.batch_size, args.width, step, pids.get(kind, pid),
                                                    server.get("pid"))
                    step += args.warmup + n
                    times[(kind, every)].append(dt)
                    cpus[(kind, every)].append((cpu, dcpu, ucpu, scpu))
                    if saver is not None:
                        ages[(kind, every)] += saver.ages
                    print(f"round {rnd + 1} {kind:10s} every {every or '-':>2}: {dt * 1e3:.0f} ms/step "
                          f"(CPU per step: trainer {cpu * 1e3:.0f} ms, ckptfs daemon {dcpu * 1e3:.0f} ms, "
                          f"uploader {ucpu * 1e3:.0f} ms" + (f", S3 server {scpu * 1e3:.0f} ms" if server else "")
                          + ")", flush=True)
                    if kind in CKPTFS:
                        sync_mount(dirs[kind])  # let the drain finish before the next run
                    if kind == "ckptfs_s3":  # and the upload: it must not run into the next configuration
                        subprocess.run([*CKPTFS_CMD, "wait", "--replicated", "--timeout", "300",
                                        str(dirs[kind] / "ckpt.pt")], check=False, capture_output=True)
                    if kind in REPLICATING:  # bytes each run sent to the S3 server (both skip superseded saves)
                        total = (replication_totals(dirs[kind]).get("bytes_uploaded", 0) if kind == "ckptfs_s3"
                                 else saver.handmade_bytes)
                        uploaded[(kind, every)].append(total - uploaded_before.get(kind, 0))
                        uploaded_before[kind] = total
                        print(f"  {kind} uploaded {uploaded[(kind, every)][-1] / 2**20:.0f} MiB in that run "
                              f"({n} steps)", flush=True)
                    for d in (shm, ext4, *(dirs[k] for k in pids)):
                        clear_dir(d)
            if "ckptfs_s3" in pids:
                replication = replication_totals(dirs["ckptfs_s3"])
    finally:
        shutil.rmtree(ext4, ignore_errors=True)
        for d in (*devices, *devices_s3):
            d.unlink(missing_ok=True)

    base = times[("none", 0)]
    def cpu_stats(c) -> dict:  # where the time goes: CPU per step of the trainer, the daemon, its uploader
        return {key: stats([t[i] for t in cpus[c]]) for i, key in enumerate(
            ("trainer_cpu_s", "daemon_cpu_s", "uploader_cpu_s", "s3_server_cpu_s"))}
    rows = {"none": {"label": LABELS["none"], "every": None, "step_s": stats(base)} | cpu_stats(("none", 0))}
    ratios = {}
    for kind in systems:
        for every in everies:
            t = times[(kind, every)]
            over = [x - b for x, b in zip(t, base)]
            rows[f"{kind}@{every}"] = {"label": LABELS[kind], "system": kind, "every": every,
                                       "step_s": stats(t), "overhead_s": stats(over),
                                       "overhead_pct": stats([100 * o / b for o, b in zip(over, base)]),
                                       "durable_age_s": stats(ages[(kind, every)]) if ages[(kind, every)] else None,
                                       "uploaded_bytes_per_run": uploaded[(kind, every)] or None,
                                       } | cpu_stats((kind, every))
    tgts = []
    for every in everies:
        if "shm" not in systems:
            break
        shm_t = times[("shm", every)]
        for kind in systems:
            if kind == "shm":
                continue
            t = times[(kind, every)]
            ratios[f"step_{kind}_over_shm@{every}"] = pairwise(t, shm_t)
            # overhead over the floor's overhead, round by round; a round whose /dev/shm overhead is
            # not above zero (noise larger than the save) gives no ratio
            pairs = [(x - b, s - b) for x, s, b in zip(t, shm_t, base) if s - b > 0]
            if pairs:
                ratios[f"overhead_{kind}_over_shm@{every}"] = pairwise(*map(list, zip(*pairs))) | {
                    "rounds_dropped": len(base) - len(pairs)}
    if "ckptfs" in systems and "ckptfs_s3" in systems:  # what replication costs the trainer
        for every in everies:
            if "boto3_s3" in systems:  # against the same uploads made by hand
                ratios[f"step_ckptfs_s3_over_boto3_s3@{every}"] = pairwise(times[("ckptfs_s3", every)],
                                                                           times[("boto3_s3", every)])
                ratios[f"step_boto3_s3_over_ckptfs@{every}"] = pairwise(times[("boto3_s3", every)],
                                                                        times[("ckptfs", every)])
            r = ratios[f"step_ckptfs_s3_over_ckptfs@{every}"] = pairwise(times[("ckptfs_s3", every)],
                                                                         times[("ckptfs", every)])
            tgts.append(target(f"training, checkpoint every {every} step(s): step time with --replicate / without",
                               r["median"], 1.1, note="issue 13: within noise"))
    key = "overhead_ckptfs_over_shm@1"
    if "ckptfs" in systems and "shm" in systems and 1 in everies:
        if key in ratios:
            tgts.append(target("training, checkpoint every step: overhead ckptfs / /dev/shm",
                               ratios[key]["median"], 1.15))
        else:
            tgts.append(target("training, checkpoint every step: overhead ckptfs / /dev/shm", None,
                               1.15, note="no round had a positive /dev/shm overhead: noise"))
    data = {
        "benchmark": "training",
        "when": now(),
        "seconds": time.perf_counter() - t_start,
        "machine": machine(),
        "config": {"repeats": args.repeats, "every": everies, "steps": {e: steps_for(e) for e in everies},
                   "baseline_steps": args.steps, "warmup_steps": args.warmup, "params_mb": args.params_mb,
                   "width": args.width, "batch_size": args.batch_size, "optimizer": "Adam",
                   "checkpoint_bytes": ckpt_bytes, "tensors": len(probe["model"]), "memory": args.memory,
                   "max_lag": args.max_lag or "default",
                   "torch_threads": torch.get_num_threads(),
                   "ckptfs_devices": "2 sparse files on the ext4 root disk"},
        "rows": rows,
        "ratios": ratios,
        "targets": tgts,
    }
    if server:
        data["s3_server"] = {"priority": args.s3_priority, "cpu_s": server.get("cpu_s"), "replicate_rate": args.replicate_rate,
                             "replicate_priority": args.replicate_priority or DEFAULT_PRIORITY,
                             "note": "SeaweedFS on this machine, standing in for a remote store"}
        data["replication"] = replication
        print(f"S3 server ({args.s3_priority} priority) used {server.get('cpu_s', 0):.1f} CPU s over the run "
              f"(not the trainer's, not the daemon's); replication at the end: "
              f"{json.dumps({k: replication.get(k) for k in ('bytes_uploaded', 'objects_uploaded', 'manifests_written', 'lag')})}")
    print(f"\ncheckpoint {ckpt_bytes / 2**20:.0f} MiB; baseline {stats(base)['median'] * 1e3:.0f} ms/step")
    for name, r in rows.items():
        if name == "none":
            continue
        o = r["overhead_s"]
        a = r["durable_age_s"]
        age = (f"; newest durable checkpoint {a['median']:.2f} s old (max {a['max']:.2f})" if a
               else "; nothing durable")
        print(f"  {r['label']:28s} every {r['every']:>2}: {r['step_s']['median'] * 1e3:.0f} ms/step, overhead "
              f"{o['median'] * 1e3:+.0f} ms ({o['min'] * 1e3:+.0f}..{o['max'] * 1e3:+.0f}){age}")
    return finish("training", data, ratios)


if __name__ == "__main__":
    sys.exit(main())
