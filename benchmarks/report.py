"""Tables, plots and docs/PERFORMANCE.md from the suite's results JSON.

run_all.py calls build() after the cases; `python benchmarks/report.py`
rebuilds everything from whatever benchmarks/results/<case>.json exist
(each table says when its case ran). Writes:

  benchmarks/results/summary.md     every table and the targets, met or missed;
  benchmarks/results/summary.json   the targets and the cases' run times;
  benchmarks/results/<case>.png     one figure per case (matplotlib, Agg);
  docs/PERFORMANCE.md               the above, how to reproduce, what bounds each number.

Every figure is a median with (min-max) over the rounds; ratios are medians of
ratios taken round by round.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from common import RESULTS, ROOT, human_rate, read_results, stats, verdict

CASES = ["save", "training", "restore", "scale", "samepath", "smallfiles", "replicate", "budget", "incremental"]
DOC = ROOT / "docs" / "PERFORMANCE.md"


# --- formatting -------------------------------------------------------------------------------

def fs(s: dict | None, scale: float = 1.0, digits: int = 2) -> str:
    """'median (min-max)' of a stats() dict."""
    if not s:
        return "–"
    return f"{s['median'] * scale:.{digits}f} ({s['min'] * scale:.{digits}f}–{s['max'] * scale:.{digits}f})"


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in
                                                            range(len(header))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def mib_rate(bps: float) -> str:
    """A device limit as given (binary units) and in decimal, as the measured rates are."""
    return f"{bps / 2**20:.0f} MiB/s ({human_rate(bps)})"


def _same_machine(a: dict, b: dict) -> bool:
    """Results from one kind of machine (a case run again later on another one says so)."""
    return all(a.get(k) == b.get(k) for k in ("cores", "cpu", "ram_gib", "kernel"))


def machine_line(m: dict) -> str:
    d = m.get("disk", {})
    disk = f"{d.get('fstype', '?')} on {d.get('source', '?')}" + (f" ({d['scheduler']})" if d.get("scheduler") else "")
    return (f"{m.get('cores')} cores ({m.get('cpu', '?')}), {m.get('ram_gib')} GiB RAM, kernel {m.get('kernel')}, "
            f"disk: {disk}; torch {m.get('torch', '?')}; load average at start "
            f"{', '.join(map(str, m.get('loadavg_at_start', [])))}")


# --- one section per case ---------------------------------------------------------------------

def save_md(d: dict) -> str:
    parts = []
    for label, r in d["sizes"].items():
        rows = []
        for name, e in r["systems"].items():
            rows.append([e["label"], fs(e["blocked_s"]), fs(e["durable_s"]) if e["durable_s"] else "not durable",
                         fs(e.get("durable_gbps")) if e["durable_s"] else "–"])
        parts.append(f"**{label}** (median of {d['config']['repeats']} rounds, min–max)\n\n" +
                     table(["system", "blocked (s)", "time to durable (s)", "durable GB/s"], rows))
        parts.append(table(["ratio, round by round", "median (min–max)"],
                           [[k.replace("_", " "), fs(v)] for k, v in r["ratios"].items()]))
    if d.get("skipped"):
        parts.append("Skipped: " + "; ".join(f"{k}: {v}" for k, v in d["skipped"].items()))
    if d.get("ckptfs_daemon_cpu_s_per_gib") is not None:
        w = d.get("writer_cpu_s_per_gib", {})
        parts.append(f"ckptfs daemon CPU per GiB saved (absorb + drain + journal): "
                     f"{d['ckptfs_daemon_cpu_s_per_gib']:.2f} s. CPU of the saving process per GiB while "
                     f"`torch.save` ran: into /dev/shm {fs(w.get('shm'))} s, into ckptfs {fs(w.get('ckptfs'))} s.")
    return "\n\n".join(parts)


def training_md(d: dict) -> str:
    c = d["config"]
    rows = []
    for name, r in d["rows"].items():
        uploading = r.get("system") in ("ckptfs_s3", "boto3_s3")
        sent = r.get("uploaded_bytes_per_run")
        cpu = [fs(r.get("trainer_cpu_s"), 1e3, 0), fs(r.get("daemon_cpu_s"), 1e3, 0),
               fs(r.get("uploader_cpu_s"), 1e3, 0) if uploading else "–",
               fs(r.get("s3_server_cpu_s"), 1e3, 0) if uploading and r.get("s3_server_cpu_s") else "–",
               f"{sorted(sent)[len(sent) // 2] / 2**20:.0f}" if sent else "–"]
        if name == "none":
            rows.append([r["label"], "–", fs(r["step_s"], 1e3, 0), "–", "–", "–", *cpu[:3], "–", "–", "–"])
            continue
        ratio = d["ratios"].get(f"overhead_{r['system']}_over_shm@{r['every']}")
        age = r.get("durable_age_s")
        age = f"{age['median']:.2f} / {age['max']:.2f}" if age else "never durable"
        rows.append([r["label"], str(r["every"]), fs(r["step_s"], 1e3, 0), fs(r["overhead_s"], 1e3, 0),
                     fs(r["overhead_pct"], 1, 0), "1 (floor)" if r["system"] == "shm" else fs(ratio), *cpu, age])
    s3 = d.get("s3_server")
    s3_text = "" if not s3 else (
        f" The replicating mount uploads to SeaweedFS on this machine at {s3['priority']} CPU priority (it "
        f"stands in for a remote store; {s3.get('cpu_s') or 0:.0f} CPU s over the run: the S3 server column), "
        f"--replicate-rate {s3.get('replicate_rate') or 'uncapped'}, its uploader process at "
        f"{s3.get('replicate_priority') or 'normal (in the daemon)'} priority.")
    return (f"Checkpoint {c['checkpoint_bytes'] / 2**20:.0f} MiB (model + Adam state), batch {c['batch_size']}, "
            f"{c['torch_threads']} torch threads; median of {c['repeats']} rounds (min–max). CPU columns: "
            f"CPU time per step of the training process, of the ckptfs daemon and of its uploader process "
            f"(--replicate: the object-store calls; for the by-hand boto3 uploads, that process), and of the "
            f"local S3 server, during the measured steps; MiB uploaded per run (median). "
            f"Durability lag: the age of the newest checkpoint a crash would keep, sampled before each save "
            f"(median / max).{s3_text}\n\n" +
            table(["system", "every (steps)", "step (ms)", "overhead (ms)", "overhead (%)",
                   "overhead / /dev/shm's", "trainer CPU (ms/step)", "ckptfs daemon CPU (ms/step)",
                   "uploader CPU (ms/step)", "S3 server CPU (ms/step)", "uploaded (MiB/run)",
                   "durability lag (s)"], rows))


def restore_md(d: dict) -> str:
    rows = []
    for r in d["rows"].values():
        cpu = (f"{fs(r['load_daemon_cpu_s_per_gib'])} / {fs(r['read_daemon_cpu_s_per_gib'])}"
               if "load_daemon_cpu_s_per_gib" in r else "–")
        if "in_memory_read_daemon_cpu_s_per_gib" in r:
            cpu += f" / {fs(r['in_memory_read_daemon_cpu_s_per_gib'])}"
        rows.append([str(r["readers"]), r["label"], fs(r["load_s"]), fs(r["load_gbps"]), fs(r["read_gbps"]),
                     fs(r.get("mount_s")) if "mount_s" in r else "–", cpu])
    out = (f"{d['config']['bytes'] / 2**30:.2f} GiB state dict per reader, each reader its own; median of "
           f"{d['config']['repeats']} rounds; GB/s aggregate.\n\n" +
           table(["readers", "source", "torch.load (s)", "torch.load GB/s", "plain read GB/s", "remount (s)",
                  "daemon CPU s/GiB (load / read / read in memory)"], rows))
    out += ("\n\nRead in memory: the plain read again on the same mount, page cache dropped, every chunk "
            "still in the arena (one reader): the daemon's reply alone, without device reads or crc32c.")
    out += "\n\n" + table(["ratio, round by round", "median (min–max)"],
                          [[k.replace("_", " "), fs(v)] for k, v in d["ratios"].items()])
    return out


def scale_md(d: dict) -> str:
    parts = []
    if "absorb" in d:
        a = d["absorb"]
        engines = [s for s in a["systems"] if s != "shm"]
        head = ["savers", "/dev/shm GB/s"] + [h for s in engines for h in (f"{s} GB/s", f"{s} / shm",
                                                                            f"{s} daemon CPU s/GiB")]
        rows = [[str(r["writers"]), fs(r["bps"]["shm"], 1e-9)] +
                [c for s in engines for c in (fs(r["bps"][s], 1e-9), fs(r["ratio_over_shm"][s]),
                                              f"{r['daemon_cpu_s_per_gib'][s]:.2f}")] for r in a["rows"]]
        how = ("torch.save of a state dict of random fp32 tensors" if a["saver"] == "torch"
               else "64 MiB write() calls")
        parts.append(f"Absorb: N processes each save {a['per_writer_bytes'] / 2**20:.0f} MiB at once ({how}; GB/s "
                     f"aggregate; daemon CPU seconds per GiB absorbed, measured over the saves).\n\n" +
                     table(head, rows))
    if "durable" in d:
        rows = []
        for r in d["durable"]["rows"]:
            rows.append([str(r["devices"]), mib_rate(r["limit_bps"]), human_rate(r["raw_bw"]),
                         human_rate(r["ckptfs_bw"]), fs(r["ratio_pairwise"]), f"{r['ckptfs_over_limit']:.2f}",
                         f"{r.get('daemon_cpu_s_per_gib', 0):.2f}"])
        parts.append(f"Durable: {d['config']['size'] / 2**30:.2f} GiB in 64 MiB writes then fsync, over loop devices "
                     f"throttled to {mib_rate(d['config']['throttle_bps'])} each (blkio); raw = O_DIRECT, 1 MiB "
                     f"blocks, queue depth {d['config']['queue_depth']} per device.\n\n" +
                     table(["devices", "N x limit", "raw O_DIRECT", "ckptfs durable", "ckptfs / raw",
                            "ckptfs / (N x limit)", "daemon CPU s/GiB"], rows))
    return "\n\n".join(parts)


def samepath_md(d: dict) -> str:
    c = d["config"]
    rows = []
    for p, r in d["rows"].items():
        rows.append([p, f"{r['saved_bytes'] / 2**20:.0f}", fs(r["device_bytes"], 2**-20, 0),
                     fs(r["device_over_saved"]), fs(r["durable_s"], 1, 1), fs(r["blocked_s"])])
    return (f"{c['saves']} saves of {c['size']} each, {c['gap_s']} s apart, into a fresh mount over 2 loop "
            f"devices throttled to {mib_rate(c['throttle_bps'])} each; device bytes from /sys/block/loopN/stat "
            f"(journal included).\n\n" +
            table(["pattern", "saved (MiB)", "written to devices (MiB)", "devices / saved", "time to durable (s)",
                   "save blocked (s)"], rows))


def smallfiles_md(d: dict) -> str:
    systems = d["systems"]
    rows = [[op] + [fs(d["rows"][s][op], 1e6, 0) for s in systems] for op in d["ops"]]
    return (f"Median microseconds per operation, {d['config']['repeats']} rounds (median of the rounds' medians, "
            f"min–max); frameworks' file operations reproduced without the frameworks (benchmarks/smallfiles.py)."
            f"\n\n" + table(["operation"] + systems, rows) + "\n\n" +
            table(["ratio, round by round", "median (min–max)"],
                  [[k, fs(v)] for k, v in d["ratios"].items()]))


def replicate_md(d: dict) -> str:
    c = d["config"]
    rows = [[who, fs(r["bps"], 1e-6, 0), fs(r["seconds"], 1, 1), fs(r["cpu_s_per_gib"]),
             f"{fs(r['daemon_cpu_s_per_gib'])} / {fs(r['uploader_cpu_s_per_gib'])}" if "daemon_cpu_s_per_gib" in r
             else "–"] for who, r in d["rows"].items()]
    lat = [[size, fs(s, 1, 2)] for size, s in d["close_to_replicated_s"].items()]
    return (f"{c['files']} files, {c['size']} in all, to {c['server']}: ckptfs replicating a remounted pool "
            f"({c['ckptfs']}) against {c['boto3']}, same files, same server, rounds interleaved. Throughput ratio "
            f"ckptfs / boto3, round by round: {fs(d['ratio_ckptfs_over_boto3'])}.\n\n" +
            table(["uploader", "MB/s", "seconds", "CPU s/GiB (uploader only)",
                   "of which daemon / uploader process"], rows) + "\n\n" +
            "From a save's close to `wait --replicated` returning (durable, uploaded, in a manifest):\n\n" +
            table(["file size", "close -> replicated (s)"], lat))


def budget_md(d: dict) -> str:
    c = d["config"]
    parts = [f"Engine {c['engine']}, chunk {c['chunk_size']}, dedupe {c.get('dedupe', 'off')} (the saves repeat one "
             f"state dict), median of {c['repeats']} rounds (min–max); "
             f"seconds per GiB. Lock: the time the daemon held the interpreter lock "
             f"({c.get('lock_probe') or 'not measured: py-spy missing'}), which caps one mount at 1 / lock "
             f"GiB/s on any number of cores (the ceiling); split by thread: the trio thread / the FUSE "
             f"workers / the worker threads (device I/O, crc32c). Drain = durable - absorb, same saves. "
             f"Client: the saving or loading process's CPU. Drained: the share of the saves written to the "
             f"devices during the pass."]
    for kind, p in d["payloads"].items():
        rows = []
        for phase in ("absorb", "drain", "durable", "restore"):
            f = p.get(phase)
            if f is None:
                continue
            split = lambda k: " / ".join(f"{f[k][r]['median']:.3f}" for r in ("trio", "fuse", "threads"))  # noqa: E731
            rows.append([phase, fs(f.get("gibps")), fs(f["user"], digits=3), split("user_roles"),
                         fs(f["system"], digits=3), fs(f.get("lock"), digits=3), split("lock_roles"),
                         fs(f.get("ceiling_gibps"), digits=1), fs(f.get("lock_us_per_request"), digits=0),
                         fs(f.get("lock_us_per_chunk"), digits=0), fs(f["client"]), fs(f.get("drained"))])
        parts.append(f"**{kind}**: {p['checkpoint_bytes'] / 2**20:.0f} MiB, {p['saves']} saves a pass\n\n" +
                     table(["phase", "GiB/s", "user CPU", "user: trio / fuse / threads", "system CPU", "lock",
                            "lock: trio / fuse / threads", "ceiling GiB/s", "lock us/request", "lock us/chunk",
                            "client CPU", "drained"], rows))
    return "\n\n".join(parts)


def incremental_md(d: dict) -> str:
    a, s = d["args"], d["summary"]
    rows = [[kind, mode, f"{s[mode][kind]['size_gib']:.2f}", fs(s[mode][kind]["device_fraction"]),
             fs(s[mode][kind]["upload_fraction"]), fs(s[mode][kind]["repeat"]), fs(s[mode][kind]["blocked"]),
             fs(s[mode][kind]["durable"]), f"{s[mode][kind]['daemon_cpu_per_gib']:.2f}",
             f"{s[mode][kind].get('uploader_cpu_per_gib', float('nan')):.2f}"]
            for kind in ("finetune", "throttled", "copy", "full") if kind in s["on"] for mode in ("off", "on")]
    rows.append(["restore", "on", "tree", "–", fs(s["restore"]["upload_fraction"]), "–", "–", "–", "–", "–"])
    return (f"{a['layers']} Linear layers of 4096 x 4096, {a['trainable']} trained with Adam, a `torch.save` of "
            f"model and optimizer every step under a new name (the first save of a round is not counted); "
            f"throttled: {a.get('throttled_steps', 0)} more of them with each device's writes limited to "
            f"{a.get('throttle', 0) / 2**20:.0f} MiB/s (devices, not the absorb, bound their time to durable); then a "
            f"copy of the newest inside the mount, one save with every layer trained, and a fresh pool restored "
            f"from the store; each with `--dedupe off` and `on`. Device and upload: bytes written or uploaded per "
            f"save as a fraction of its size. Repeat: the fraction of its chunks whose bytes an earlier chunk "
            f"already had (the most a dedupe of fixed chunks could skip). Daemon and uploader CPU: seconds per "
            f"GiB saved until the save is uploaded, of the daemon and of its uploader process.\n\n" +
            table(["save", "dedupe", "GiB", "device", "upload", "repeat", "blocked (s)", "durable (s)",
                   "daemon CPU s/GiB", "uploader CPU s/GiB"], rows) + "\n\n" +
            table(["ratio, round by round", "median (min–max)"], [[k, fs(v)] for k, v in d["ratios"].items()]))


SECTIONS = {"save": ("1. Save", save_md), "training": ("2. Training overhead", training_md),
            "restore": ("3. Restore", restore_md), "scale": ("4. Scale", scale_md),
            "samepath": ("5. Every step to the same path", samepath_md),
            "smallfiles": ("6. Small files and metadata", smallfiles_md),
            "replicate": ("7. Replication to an object store", replicate_md),
            "budget": ("8. The lock budget", budget_md),
            "incremental": ("9. Incremental saves", incremental_md)}


# --- plots ------------------------------------------------------------------------------------

def _err(ss: list[dict], scale: float = 1.0):
    return [[(s["median"] - s["min"]) * scale for s in ss], [(s["max"] - s["median"]) * scale for s in ss]]


def plot_save(d: dict, plt) -> Path:
    sizes = list(d["sizes"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.2), squeeze=False)
    for ax, label in zip(axes[0], sizes):
        systems = d["sizes"][label]["systems"]
        names = list(systems)
        y = range(len(names))
        b = [systems[n]["blocked_s"] for n in names]
        ax.barh([i + 0.2 for i in y], [s["median"] for s in b], 0.4, xerr=_err(b), label="blocked", color="#4c72b0")
        dur = [systems[n]["durable_s"] for n in names]
        ax.barh([i - 0.2 for i in y], [s["median"] if s else 0 for s in dur], 0.4,
                xerr=_err([s or {"median": 0, "min": 0, "max": 0} for s in dur]), label="time to durable",
                color="#dd8452")
        for i, s in enumerate(dur):
            if s is None:
                ax.text(0.01, i - 0.2, "not durable", va="center", fontsize=7, transform=ax.get_yaxis_transform())
        ax.set_yticks(list(y), [systems[n]["label"] for n in names], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("seconds (median, min–max)")
        ax.set_title(f"save {label}")
        ax.legend(fontsize=8)
    return _finish(fig, "save", plt)


def plot_training(d: dict, plt) -> Path:
    rows = [r for k, r in d["rows"].items() if k != "none"]
    everies = sorted({r["every"] for r in rows})
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.8 / len(everies)
    for j, every in enumerate(everies):
        ss = [next(r["overhead_s"] for r in rows if r["system"] == s and r["every"] == every) for s in systems]
        ax.bar([i + (j - (len(everies) - 1) / 2) * width for i in range(len(systems))], [s["median"] * 1e3 for s in ss],
               width, yerr=_err(ss, 1e3), label=f"checkpoint every {every} step(s)")
    ax.set_xticks(range(len(systems)), [d["rows"][f"{s}@{everies[0]}"]["label"] for s in systems], fontsize=8)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_ylabel("step-time overhead (ms)")
    base = d["rows"]["none"]["step_s"]["median"] * 1e3
    ax.set_title(f"training overhead (baseline {base:.0f} ms/step, "
                 f"checkpoint {d['config']['checkpoint_bytes'] / 2**20:.0f} MiB)")
    ax.legend(fontsize=8)
    return _finish(fig, "training", plt)


def _paired_bars(ax, labels: list[str], series: list[tuple[str, list[dict]]], scale: float = 1.0) -> None:
    """Side-by-side bars per label, one per series (name, stats per label), with min-max whiskers."""
    width = 0.8 / len(series)
    for j, (name, ss) in enumerate(series):
        ax.bar([i + (j - (len(series) - 1) / 2) * width for i in range(len(labels))],
               [s["median"] * scale for s in ss], width, yerr=_err(ss, scale), label=name)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.legend(fontsize=8)


def plot_restore(d: dict, plt) -> Path:
    rows = d["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    _paired_bars(ax, [f"{r['label']}, {r['readers']} reader(s)" for r in rows.values()],
                 [(lab, [r[key] for r in rows.values()]) for key, lab in (("load_gbps", "torch.load"),
                                                                         ("read_gbps", "plain read"))])
    ax.set_ylabel("GB/s (median, min–max)")
    ax.set_title("restore, cold")
    return _finish(fig, "restore", plt)


def _lines(ax, x: list[int], series: list[tuple[str, list[dict]]], xlabel: str, ylabel: str, title: str) -> None:
    """One line per series (name, stats per x) with min-max whiskers, y from 0."""
    for name, ss in series:
        ax.errorbar(x, [s["median"] for s in ss], yerr=_err(ss), marker="o", capsize=3, label=name)
    ax.set_xticks(x)
    ax.set_xlabel(xlabel)
    ax.set_ylim(bottom=0)
    ax.set_ylabel(ylabel)
    ax.set_title(title)


def plot_scale(d: dict, plt) -> Path:
    parts = [k for k in ("absorb", "durable") if k in d]
    fig, axes = plt.subplots(1, len(parts), figsize=(5.5 * len(parts), 4), squeeze=False)
    axes = dict(zip(parts, axes[0]))
    if "absorb" in d:
        a = d["absorb"]
        _lines(axes["absorb"], [r["writers"] for r in a["rows"]],
               [(s, [stats([v / 1e9 for v in r["bps"][s]["runs"]]) for r in a["rows"]]) for s in a["systems"]],
               "concurrent savers", "aggregate absorb GB/s", "absorb")
        axes["absorb"].legend(fontsize=8)
    if "durable" in d:
        rows = d["durable"]["rows"]
        x = [r["devices"] for r in rows]
        _lines(axes["durable"], x,
               [(lab, [stats([r["bytes"] / t / 1e9 for t in r[key]]) for r in rows])
                for key, lab in (("raw_s", "raw O_DIRECT"), ("ckptfs_durable_s", "ckptfs durable"))],
               "throttled loop devices", "GB/s", "durable bandwidth")
        axes["durable"].plot(x, [r["limit_bps"] / 1e9 for r in rows], "k--", linewidth=0.8, label="N x device limit")
        axes["durable"].legend(fontsize=8)
    return _finish(fig, "scale", plt)


def plot_samepath(d: dict, plt) -> Path:
    rows = d["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    saved = [{"median": r["saved_bytes"], "min": r["saved_bytes"], "max": r["saved_bytes"]} for r in rows.values()]
    _paired_bars(ax, list(rows), [("bytes saved", saved),
                                  ("bytes written to the devices", [r["device_bytes"] for r in rows.values()])],
                 2**-20)
    ax.set_ylabel("MiB")
    ax.set_title("every step to one path: what reaches the devices")
    return _finish(fig, "samepath", plt)


def plot_replicate(d: dict, plt) -> Path:
    rows = d["rows"]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    _paired_bars(ax, ["throughput"], [(who, [r["bps"]]) for who, r in rows.items()], 1e-6)
    ax.set_ylabel("MB/s")
    ax.set_title("upload to the same S3 server")
    return _finish(fig, "replicate", plt)


PLOTS = {"save": plot_save, "training": plot_training, "restore": plot_restore, "scale": plot_scale,
         "samepath": plot_samepath, "replicate": plot_replicate}


def _finish(fig, name: str, plt) -> Path:
    out = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# --- the whole report -------------------------------------------------------------------------

def targets_md(results: dict) -> str:
    rows = []
    for case in CASES:
        d = results.get(case)
        if not d:
            continue
        for t in d.get("targets", []):
            value = "–" if t["value"] is None else f"{t['value']:.2f}"
            rows.append([t["name"], value, f"{t['op']} {t['limit']}", verdict(t) + (f" ({t['note']})" if
                                                                                  t["met"] is None else "")])
    return table(["target", "measured (median)", "target", "verdict"], rows)


def build(status: dict | None = None) -> dict:
    """Write summary.md, summary.json, the PNGs and docs/PERFORMANCE.md from the results on disk.
    `status`: {case: {"rc": int, "seconds": float}} from run_all."""
    results = {case: read_results(case) for case in CASES}
    if status is None:  # rebuilt by hand: keep what run_all recorded of the last run
        status = (read_results("summary") or {}).get("status") or None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
        print("report: matplotlib missing: the plots are not redrawn (make bench-setup installs it)", file=sys.stderr)
    plots = {}
    for case, d in results.items():
        png = RESULTS / f"{case}.png"
        if plt is None:  # no plotting here: the plots already drawn stay, with their links
            if d is not None and png.exists():
                plots[case] = str(png)
            continue
        png.unlink(missing_ok=True)  # (a case without results or with a failing plot shows none)
        if d is not None and case in PLOTS:
            try:
                plots[case] = str(PLOTS[case](d, plt))
            except Exception as e:  # noqa: BLE001 - a broken plot must not lose the tables
                print(f"report: plot {case} failed: {type(e).__name__}: {e}", file=sys.stderr)
    first = next((d for d in results.values() if d), None)
    machine = machine_line(first["machine"]) if first else "–"
    sections = []
    for case in CASES:
        title, fn = SECTIONS[case]
        d = results[case]
        if d is None:
            why = f" (exit status {status[case]['rc']})" if status and case in status else ""
            sections.append(f"### {title}\n\nNo results{why}.")
            continue
        img = f"\n\n![{case}](../benchmarks/results/{case}.png)" if case in plots else ""
        where = "" if _same_machine(d["machine"], first["machine"]) else f"; on another machine: {machine_line(d['machine'])}"
        sections.append(f"### {title}\n\n_{d['when']}, {d.get('seconds', 0):.0f} s{where}_\n\n{fn(d)}{img}")
    targets = targets_md(results)
    checks = results.get("samepath", {}) or {}
    summary_md = (f"# ckptfs benchmark suite\n\nMachine: {machine}\n\n## Targets\n\n{targets}\n\n" +
                  "\n\n".join(s.replace("](../benchmarks/results/", "](") for s in sections) + "\n")
    (RESULTS / "summary.md").write_text(summary_md)
    summary = {"machine": first["machine"] if first else None, "status": status or {},
               "targets": [t for c in CASES if results.get(c) for t in results[c].get("targets", [])],
               "checks": checks.get("checks", []), "plots": plots,
               "when": {c: d["when"] for c, d in results.items() if d}}
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=2))
    DOC.write_text(performance_md(machine, targets, sections, results, status))
    return summary


def performance_md(machine: str, targets: str, sections: list[str], results: dict, status: dict | None) -> str:
    from doc_text import BOUNDS, HEADER, PROFILE, REPRODUCE
    total = sum(s.get("seconds", 0) for s in (status or {}).values())
    done = [c for c in CASES if c in (status or {})]
    ran = (f"The last full run took {total / 60:.1f} minutes. " if done == list(CASES) else
           f"The last run, of {', '.join(done)} alone, took {total / 60:.1f} minutes. " if total else "")
    return (f"{HEADER}\n\n## How to reproduce\n\n{REPRODUCE}\n\n{ran}Machine of the tables below: {machine}.\n\n"
            f"## Targets\n\n{targets}\n\n## Results\n\n" + "\n\n".join(sections) +
            f"\n\n## What bounds each number\n\n{BOUNDS(results)}\n\n"
            f"### Where the daemon's time goes (profile)\n\n{PROFILE}\n")


if __name__ == "__main__":
    s = build()
    print(f"wrote {RESULTS / 'summary.md'}, {DOC}; plots: {', '.join(Path(p).name for p in s['plots'].values())}")
