"""The operator's commands: `ckptfs status`, `ckptfs wait`, and the progress `ckptfs umount` shows.

They talk to the daemon over its control channel (control.py) and render
with rich: tables for `status`, a live view for `status --watch`, a progress
bar for `wait` and `umount` on a terminal (nothing when stderr is not one,
so scripts and logs stay clean). `--json` prints the daemon's snapshot as it
is (see status.py for the fields).

Exit status of `ckptfs wait`: 0 when everything asked for is durable, 1 when
a drain failed (the reason is printed) or the daemon cannot be asked, 2 for a
bad path, 124 when --timeout passed first (as timeout(1)).
"""
from __future__ import annotations

import json
import os
import sys
import time

from .api import DrainFailed, WaitTimeout, wait_paths
from .control import Client, ControlError, control_path, mountpoint_of
from ..errors import UsageError

TIMEOUT_STATUS = 124


# ---- formatting ---------------------------------------------------------------------
def human_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_rate(bps: float) -> str:
    return human_bytes(bps) + "/s"


def human_seconds(s: float | None) -> str:
    if s is None:
        return "unknown"
    if s < 60:
        return f"{s:.1f}s"
    m, s = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


_STATE_STYLE = {"memory": "yellow", "draining": "cyan", "failed": "bold red", "durable": "green"}
_HEALTH_STYLE = {"ok": "green", "errors": "yellow", "failing": "bold red"}


def restore_line(r: dict):
    """The status line of a restore from an object store (and its last error)."""
    from rich.text import Text

    t = Text(f"Restore from {r['source']} (manifest generation {r['generation']}): {r['state']}, "
             f"{r['files_restored']}/{r['files_total']} files, {human_bytes(r['bytes_restored'])} of "
             f"{human_bytes(r['bytes_total'])}", style="green" if r["state"] == "done" else "")
    if r.get("errors_total"):
        t.append(f"\n  {r['errors_total']} failed fetch(es), retried; last: {r['last_error']}", style="red")
    return t


def render(st: dict, limit: int = 20):
    """A rich renderable of a status snapshot."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts = []
    head = Text()
    head.append("ckptfs ", style="bold")
    head.append(f"{st.get('mountpoint', '?')}", style="bold")
    head.append(f"  daemon pid {st.get('pid')}  up {human_seconds(st.get('uptime'))}")
    if st.get("engine"):
        head.append(f"  engine {st['engine']}" + (f" ({st['threads']} threads)" if st.get("engine") == "native" else ""))
        if st.get("reads"):
            head.append(f", reads {st['reads']}")
    es = st.get("engine_stats")
    if es:
        head.append(f"  requests <= {human_bytes(es.get('max_write') or 0)}, "
                    f"{es.get('session', {}).get('requests', {}).get('write', 0)} writes: "
                    f"{es.get('adopted', 0)} chunks adopted, {es.get('copied', 0)} pieces copied, "
                    f"{es.get('realigned', 0)} moved onto the grid")
    if st.get("metrics_url"):
        head.append(f"  metrics {st['metrics_url']}")
    parts.append(head)

    pool = st["pool"]
    parts.append(Text(f"Pool: {len(pool['devices'])} device(s), {human_bytes(pool['used'])} used of "
                      f"{human_bytes(pool['capacity'])}, id {pool.get('pool_id', '?')[:16]} "
                      f"(rates over the last {st.get('interval', 0):.1f}s)"))
    dev = Table(box=None, pad_edge=False, show_edge=False)
    for col, just in (("#", "right"), ("device", "left"), ("capacity", "right"), ("used", "right"),
                      ("health", "left"), ("write", "right"), ("read", "right"), ("errors", "right")):
        dev.add_column(col, justify=just)
    for d in pool["devices"]:
        dev.add_row(str(d["index"]), d["path"], human_bytes(d["capacity"]), human_bytes(d["used"]),
                    Text(d["health"], style=_HEALTH_STYLE.get(d["health"], "")), human_rate(d["write_bps"]),
                    human_rate(d["read_bps"]), str(d["errors"]))
    parts.append(dev)

    mem = st["memory"]
    lent = f", {human_bytes(mem['lent'])} receive buffers" if mem.get("lent") else ""
    parts.append(Text(f"Memory: {human_bytes(mem['arena'])} arena; {human_bytes(mem['undrained'])} not yet on "
                      f"the devices, {human_bytes(mem['cached'])} cached{lent}, {human_bytes(mem['free'])} free"))

    if st.get("dedupe"):
        d = st["dedupe"]
        since = (f"; since the mount {d['chunks_shared']} chunk(s), {human_bytes(d['bytes_shared'])} not written"
                 if d["on"] else "; --dedupe is off")
        parts.append(Text(f"Dedupe: {human_bytes(d['shared_bytes'])} shared on the devices{since}"))
        for f in d.get("newest", []):
            share = f"{100 * f['shared'] / f['size']:.0f}%" if f["size"] else "0%"
            parts.append(Text(f"  {f['path'] or 'inode %d' % f['ino']}: {human_bytes(f['size'])}, {share} shared "
                              f"with other files"))

    if st.get("restore"):
        parts.append(restore_line(st["restore"]))

    tot = st["totals"]
    files = st["files"]
    if tot["files_not_durable"]:
        parts.append(Text(f"Not yet durable: {tot['files_not_durable']} file(s): {tot['files_draining']} draining, "
                          f"{tot['files_memory']} in memory, {tot['files_failed']} failed"))
        ft = Table(box=None, pad_edge=False, show_edge=False)
        for col, just in (("state", "left"), ("progress", "right"), ("size", "right"), ("to drain", "right"),
                          ("path", "left")):
            ft.add_column(col, justify=just)
        for f in files[:limit]:
            state = f["state"] + (f" {f['errno']}" if f.get("errno") else "")
            ft.add_row(Text(state, style=_STATE_STYLE.get(f["state"], "")), f"{100 * f['progress']:.0f}%",
                       human_bytes(f["size"]), human_bytes(f["bytes"] - f["drained"]),
                       f["path"] or f"(no name, inode {f['ino']})")
        parts.append(ft)
        more = tot["files_not_durable"] - min(limit, len(files))
        if more > 0:
            parts.append(Text(f"... and {more} more (ckptfs status --json lists them all)"))
    if st.get("all_durable"):
        parts.append(Text("Everything is durable.", style="green"))
    else:
        line = (f"To drain: {human_bytes(tot['bytes_to_drain'])} at {human_rate(tot['drain_bps'])}; "
                f"ETA to all-durable {human_seconds(tot['eta_seconds'])} "
                f"({tot['records_pending']} journal record(s) pending)")
        if tot["files_memory"]:
            line += (f"; {tot['files_memory']} file(s) in memory become durable once closed or fsynced "
                     f"(or ckptfs wait)")
        parts.append(Text(line))
    lag = st.get("lag")
    if lag and lag["oldest"] is not None:
        old = lag["oldest"]
        line = (f"Oldest closed file not yet durable: {old['path'] or '(no name, inode %d)' % old['ino']}, "
                f"closed {human_seconds(old['age'])} ago (bound --max-lag {lag['max_lag']:g}s + drain time)")
        parts.append(Text(line + ("; the devices are not keeping up" if lag["behind"] else ""),
                          style="bold yellow" if lag["behind"] else ""))
    rec = st.get("recovery")
    if rec and not rec.get("clean", True):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec["time_ns"] / 1e9)) if rec.get("time_ns") \
            else "an unknown time"
        parts.append(Text(f"Recovered from an unclean shutdown at mount: state of journal frame {rec['seq']} "
                          f"({when}); discarded: {'; '.join(rec['discarded']) or 'nothing'}", style="yellow"))
    for w in (rec or {}).get("warnings", ()):
        parts.append(Text(f"Recovery warning: {w}", style="bold red"))
    lat = tot["drain_latency"]
    parts.append(Text(f"Totals: absorbed {human_bytes(tot['bytes_absorbed'])}, drained "
                      f"{human_bytes(tot['bytes_drained'])}, skipped as stale {human_bytes(tot['bytes_skipped'])}; "
                      f"backpressure waits {tot['backpressure_waits']} ({tot['backpressure_seconds']:.1f}s); "
                      f"close-to-durable latency last {human_seconds(lat['last'])}, "
                      f"mean {human_seconds(lat['sum'] / lat['count']) if lat['count'] else 'n/a'}"))
    if st.get("replication"):
        parts.extend(_replication_lines(st["replication"]))
    if st.get("last_error"):
        parts.append(Text(f"Last error: {st['last_error']}", style="bold red"))
    return Group(*parts)


def _replication_lines(rep: dict) -> list:
    from rich.text import Text

    stopped = (rep.get("failing") or {}).get("cause") == "conflict"  # for good: another writer (lineage.py)
    when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rep["manifest_time"]))
            if rep.get("manifest_time") else "none yet")
    lines = [Text(f"Replication to {rep['target']}: lag {human_seconds(rep['lag'])}, manifest generation "
                  f"{rep['generation']} ({when}), {rep['objects']} object(s); uploaded "
                  f"{human_bytes(rep['bytes_uploaded'])} in {rep['objects_uploaded']} segment(s)"
                  + (f", {human_bytes(rep['bytes_shared'])} of new versions already stored"
                     if rep.get("bytes_shared") else "")
                  + (f"; the store holds {human_bytes(rep['stored_bytes'])} for "
                     f"{human_bytes(rep['kept_bytes'])} of kept file versions" if rep.get("kept_bytes") else "")
                  + ("" if rep["started"] or stopped else "; starting"))]
    up = rep.get("uploader")
    if up and up.get("starts"):
        running = f"pid {up['pid']}" if up["pid"] else "not running"
        lines.append(Text(f"Uploader process: {running}, {up['priority']} priority, {up['cpu_s']:.1f} CPU s, "
                          f"restarted {up['restarts']} time(s)"
                          + (f" (last: {up['last_exit']})" if up.get("last_exit") else "")))
    if rep.get("failing"):
        f = rep["failing"]
        how = "stopped" if stopped else "failing"
        since = f"since {time.strftime('%H:%M:%S', time.localtime(f['since']))}; " if f.get("since") else ""
        lines.append(Text(f"Replication {how} ({f['cause']}){'' if stopped else ', retrying'}: {f['message']}; "
                          f"{since}{rep.get('waiting_commits', 0)} change(s) and "
                          f"{human_bytes(rep.get('waiting_bytes', 0))} waiting", style="bold red"))
    elif rep.get("errors_total"):
        last = rep.get("last_error") or {}
        lines.append(Text(f"Replication errors so far: {rep['errors_total']} (last: {last.get('cause')}: "
                          f"{last.get('message')})", style="yellow"))
    return lines


# ---- status ---------------------------------------------------------------------------
def _mount_of(path: str) -> str:
    if not os.path.exists(path):
        raise UsageError(f"{path} does not exist", 2)
    return mountpoint_of(path)


def status(args) -> int:
    mp = _mount_of(args.mountpoint)
    try:
        ctl = control_path(mp)
        with Client(ctl) as client:
            if args.watch:
                return _watch(client, args, mp)
            st = client.request({"op": "status", "window": args.interval,
                                 "limit": None if args.json else args.limit})["status"]
    except ControlError as e:
        raise UsageError(str(e), 1) from None
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        _console().print(render(st, args.limit))
    return 0


def _console():
    from rich.console import Console
    # into a pipe or file: wide lines rather than wrapped at 80 columns
    return Console() if sys.stdout.isatty() else Console(width=200)


def _watch(client: Client, args, mp: str) -> int:
    from rich.live import Live

    def fetch() -> dict:
        return client.request({"op": "status", "window": args.interval,
                               "limit": None if args.json else args.limit})["status"]

    try:
        if args.json:  # JSON lines, one snapshot per interval
            while True:
                print(json.dumps(fetch()), flush=True)
                time.sleep(args.interval)
        console = _console()
        with Live(render(fetch(), args.limit), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(render(fetch(), args.limit), refresh=True)
    except KeyboardInterrupt:
        return 0
    except ControlError:
        print(f"ckptfs status: {mp} was unmounted (the daemon has exited)", file=sys.stderr)
        return 0


# ---- wait / umount progress ---------------------------------------------------------------
class ProgressView:
    """A progress bar per mount on stderr when it is a terminal; nothing otherwise."""

    def __init__(self, enabled: bool, verb: str = "draining"):
        self.enabled = enabled
        self.verb = verb
        self.tasks: dict[str, int] = {}
        self.progress = None
        if enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress, TaskProgressColumn, TextColumn,
                                       TimeRemainingColumn, TransferSpeedColumn)
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                                     DownloadColumn(binary_units=True), TransferSpeedColumn(),
                                     TimeRemainingColumn(), TextColumn("{task.fields[files]}"),
                                     console=Console(stderr=True), transient=False)

    def __enter__(self) -> "ProgressView":
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def update(self, mp: str, msg: dict) -> None:
        if self.progress is None:
            return
        files = f"{msg.get('durable', 0)}/{msg.get('files', 0)} file(s) durable"
        if msg.get("failing"):
            files += f", {len(msg['failing'])} failing"
        if not msg.get("files") and mp not in self.tasks:
            return  # nothing was waiting: no bar
        total = max(1, msg.get("bytes", 0))
        done = total if msg.get("event") == "done" and msg.get("ok") else msg.get("done", 0)
        if mp not in self.tasks:
            self.tasks[mp] = self.progress.add_task(f"{self.verb} {mp}", total=total, files=files)
        self.progress.update(self.tasks[mp], total=total, completed=done, files=files)


def wait(args) -> int:
    show = sys.stderr.isatty() and not args.quiet
    replicated = getattr(args, "replicated", False)
    t0 = time.monotonic()
    try:
        with ProgressView(show) as view:
            results = wait_paths(args.paths, args.timeout, view.update, replicated=replicated)
    except DrainFailed as e:
        print(f"ckptfs wait: {e}", file=sys.stderr)
        return 1
    except WaitTimeout as e:
        print(f"ckptfs wait: {e}", file=sys.stderr)
        return TIMEOUT_STATUS
    except ControlError as e:
        print(f"ckptfs wait: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        print(f"ckptfs wait: {e.filename}: no such file or directory", file=sys.stderr)
        return 2
    if show:
        files = sum(r.get("files", 0) for r in results.values())
        what = "replicated" if replicated else "durable"
        print(f"{what}: {files} file(s) in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return 0


def drain_for_umount(mp: str, timeout: float | None) -> bool:
    """Make everything in `mp` durable with progress; False when the control channel cannot be used
    (the caller falls back to a plain sync). Raises UsageError when the drain fails or times out."""
    try:
        control_path(mp)
    except ControlError:
        return False
    try:
        with ProgressView(sys.stderr.isatty(), verb="draining before unmount:") as view:
            wait_paths([mp], timeout, view.update)
    except (DrainFailed, WaitTimeout) as e:
        raise UsageError(f"not unmounting {mp}: {e}", 1) from None
    except ControlError:
        return False
    return True
