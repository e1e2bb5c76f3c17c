"""The `ckptfs` command line: format, mount, umount, sync, fsck, status, wait.

Every check that can fail on bad input runs here, in the calling process,
before anything is mounted, so the user sees one clear line and a non-zero
exit. `mount` then starts the daemon detached (or in the foreground with
--foreground) and returns only once the mount is live: the daemon reports
"OK" or its error through a pipe.
"""
from __future__ import annotations

import argparse
import errno
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from .fs.arena import DEFAULT_CHUNK
from .checks import check_devices, check_fuse_device, check_memory, check_mountpoint
from . import replicas_cli
from .errors import UsageError
from .replicate.priority import PRIORITIES
from .sizes import parse_size
from .store.store import DEFAULT_MAX_LAG

DEFAULT_MEMORY = "25%"


def _log_path(mountpoint: str) -> str:
    base = os.environ.get("CKPTFS_LOG_DIR") or ("/var/log/ckptfs" if os.getuid() == 0 else "/tmp")
    try:
        os.makedirs(base, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create the log directory {base}: {e.strerror} (set --log-file)", 1) from None
    return os.path.join(base, "ckptfs" + mountpoint.replace("/", "-") + ".log")


def _log_file(given: str | None, mp: str) -> str:
    """The daemon's log file (--log-file or the default for the mountpoint), checked writable
    without creating it yet."""
    path = os.path.abspath(given or _log_path(mp))
    where = path if os.path.exists(path) else os.path.dirname(path)
    if not os.path.isdir(os.path.dirname(path)):
        problem = "its directory does not exist"
    elif os.path.isdir(path):
        problem = "it is a directory"
    elif not os.access(where, os.W_OK):
        problem = "permission denied"
    else:
        return path
    raise UsageError(f"cannot write the log file {path}: {problem}", 1)


@dataclass(frozen=True)
class RestorePlan:
    """--restore-from, checked: the manifest chosen (its generation and chunk size) and the pool the
    new one continues (None where the daemon was started by a checked mount and only carries on)."""
    url: str
    generation: int
    chunk_size: int | None
    pool: str | None = None


@dataclass(frozen=True)
class MountPlan:
    """A `ckptfs mount` command, checked: everything the mount acts on, settled before anything
    changes (a bad option is one line and exit 2, with the devices untouched)."""
    mountpoint: str
    devices: list  # checks.Device, checked
    memory: int
    chunk: int  # --chunk-size, the default, or the restored manifest's
    log_file: str | None  # the detached daemon's log (None: --foreground)
    max_lag: float
    restore: RestorePlan | None
    replication: dict  # MountConfig fields (replication.py's options), empty without --replicate


def _plan_mount(args) -> MountPlan:
    """Check every option of `ckptfs mount`, in the order a user fixes them; nothing is changed."""
    memory = parse_size(args.memory, what="--memory")
    given_chunk = None if args.chunk_size is None else _chunk_size(args.chunk_size)
    check_memory(memory)
    mp = check_mountpoint(args.mountpoint)
    log_file = None if args.foreground else _log_file(args.log_file, mp)
    check_fuse_device()
    devices = check_devices(args.devices)
    replicas_cli.s3_options(args)
    restore = _restore_plan(args, given_chunk)
    chunk = (restore.chunk_size if restore is not None and restore.chunk_size else given_chunk) or DEFAULT_CHUNK
    if args.queue_depth < 1:
        raise UsageError(f"bad --queue-depth {args.queue_depth}: must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"bad --threads {args.threads}: must be at least 1")
    if args.engine == "pyfuse3":
        from .fuse.pyfuse3_engine import available
        if not available():
            raise UsageError("--engine pyfuse3: pyfuse3 is not installed (pip install 'ckptfs[pyfuse3]'; "
                             "it needs libfuse3's headers and a C compiler)")
    max_lag = _max_lag(args.max_lag)
    replication = _replication(args, chunk, restore.pool if restore is not None else None)
    if args.format and memory < 2 * chunk:
        what = f"--chunk-size {args.chunk_size}" if chunk == given_chunk else f"chunks of {chunk} bytes"
        raise UsageError(f"--memory {args.memory} is too small for {what}: the memory must hold at least 2 chunks")
    return MountPlan(mp, devices, memory, chunk, log_file, max_lag, restore, replication)


def _mount(args) -> int:
    from .daemon import MountConfig, serve
    from .store.pool import open_pool

    plan = _plan_mount(args)
    paths = [d.path for d in plan.devices]
    if args.format:
        # here, not in the daemon: a refusal (another filesystem, too small) reaches the
        # terminal, and --force can override it as for `ckptfs format`
        from .format.layout import DEFAULT_JOURNAL_HALF
        _format_devices(plan.devices, plan.chunk, DEFAULT_JOURNAL_HALF, args.force)
    open_pool(paths).close()  # refuse a bad pool here, with its message
    if not args.foreground:
        return _spawn_daemon(args, plan)
    restore = plan.restore
    cfg = MountConfig(mountpoint=plan.mountpoint, devices=paths, memory=plan.memory, chunk_size=plan.chunk,
                      ready_fd=args.ready_fd, format=False, queue_depth=args.queue_depth,
                      fsync_absorb=args.fsync == "absorb", drain_policy=args.drain, dedupe=args.dedupe == "on",
                      max_lag=plan.max_lag, force_recover=args.force_recover, metrics_port=args.metrics_port,
                      metrics_addr=args.metrics_addr, engine=args.engine, threads=args.threads,
                      restore_from=restore.url if restore else None,
                      restore_generation=restore.generation if restore else None,
                      s3_endpoint=args.s3_endpoint, restore_concurrency=args.restore_concurrency,
                      restore_rate=parse_size(args.restore_rate, what="--restore-rate") if args.restore_rate else None,
                      **plan.replication)
    from .ops.logs import setup
    # detached (--ready-fd), the daemon's stderr is its log file already
    to_file = args.log_file if args.log_file and args.ready_fd is None else None
    setup(args.log_level, filename=to_file, json_lines=args.log_format == "json")
    return serve(cfg)


def _restore_plan(args, given_chunk: int | None) -> RestorePlan | None:
    """--restore-from: a well-formed URL, a reachable store with a manifest under the prefix, and
    --format (a restore builds a new pool); one line and exit 2 otherwise, before anything changes.
    Pins the manifest (its generation, handed to the daemon) and the chunk size to its. None:
    no restore (none asked, or --restore-if-any and nothing replicated yet)."""
    if args.restore_concurrency < 1:
        raise UsageError(f"bad --restore-concurrency {args.restore_concurrency}: must be at least 1")
    if args.restore_rate is not None and parse_size(args.restore_rate, what="--restore-rate") <= 0:
        raise UsageError(f"bad --restore-rate {args.restore_rate}: must be a positive size per second")
    if args.restore_from is None:
        for given, option in ((args.restore_if_any, "--restore-if-any"), (args.generation, "--generation"),
                              (args.at, "--at")):
            if given:
                raise UsageError(f"{option} needs --restore-from")
        return None
    if args.generation is not None and args.at is not None:
        raise UsageError("--generation and --at both choose the state to restore: give one")
    from .replicate.client import S3Error, Target
    from .replicate.manifest import BadManifest, parse_url
    from .replicate.replicas import ReplicaError, choose, parse_at
    from .replicate.tree import NothingReplicated, SourceError, load_manifest

    try:
        url = parse_url(args.restore_from)
    except ValueError as e:
        raise UsageError(f"bad --restore-from: {e}") from None
    if args.restore_generation is not None:  # the daemon started by a checked mount
        return RestorePlan(args.restore_from, args.restore_generation, None)
    if not args.format:
        raise UsageError("--restore-from builds a new pool from the object store: add --format (it erases the "
                         "devices); to go on with an interrupted restore, mount without --restore-from")
    try:
        target = Target(url, args.s3_endpoint, attempts=2, connect_timeout=3)
        if args.generation is None and args.at is None:
            manifest = load_manifest(target)
        else:
            manifest = choose(target, args.generation, parse_at(args.at) if args.at else None)
    except (ValueError, ReplicaError, S3Error, BadManifest) as e:
        raise UsageError(f"cannot restore from {args.restore_from}: {e}") from None
    except NothingReplicated as e:
        if not args.restore_if_any:
            raise UsageError(f"cannot restore from {args.restore_from}: {e}") from None
        print(f"ckptfs mount: nothing replicated under {url} yet: formatting an empty pool (--restore-if-any)",
              file=sys.stderr)
        return None
    except SourceError as e:
        raise UsageError(f"cannot restore from {args.restore_from}: {e}") from None
    if given_chunk is not None and given_chunk != manifest.chunk_size:
        raise UsageError(f"--chunk-size {args.chunk_size} differs from the chunk size of the manifest "
                         f"({manifest.chunk_size} bytes): a restore uses the manifest's (leave --chunk-size out)")
    # manifest.pool: the pool this one will continue (replicate/lineage.py)
    return RestorePlan(args.restore_from, manifest.generation, manifest.chunk_size, manifest.pool)


def _spawn_daemon(args, plan: MountPlan) -> int:
    """Start the daemon detached, with the options `plan` settled (it is checked already: it skips
    the object store's check and the format), and wait for its "OK" or its error."""
    log_path = plan.log_file
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "ckptfs", "mount", plan.mountpoint, "--devices", args.devices,
           "--memory", args.memory, "--chunk-size", str(plan.chunk), "--foreground",
           "--log-level", args.log_level, "--queue-depth", str(args.queue_depth), "--drain", args.drain,
           "--dedupe", args.dedupe,
           "--max-lag", args.max_lag, "--fsync", args.fsync, "--ready-fd", str(w),  # --format was done by _mount
           "--log-format", args.log_format, "--metrics-addr", args.metrics_addr, "--engine", args.engine]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    if args.metrics_port is not None:
        cmd += ["--metrics-port", str(args.metrics_port)]
    if args.force_recover:
        cmd.append("--force-recover")
    if plan.restore is not None:
        cmd += ["--restore-from", plan.restore.url, "--restore-generation", str(plan.restore.generation)]
    if args.s3_endpoint is not None:
        cmd += ["--s3-endpoint", args.s3_endpoint]
    if args.restore_rate is not None:
        cmd += ["--restore-rate", args.restore_rate]
    cmd += ["--restore-concurrency", str(args.restore_concurrency)]
    if args.replicate:
        cmd += ["--replicate", args.replicate, "--replicate-keep-last", str(args.replicate_keep_last),
                "--replicate-keep-hourly", str(args.replicate_keep_hourly),
                "--replicate-keep-daily", str(args.replicate_keep_daily),
                "--replicate-keep-within", args.replicate_keep_within,
                "--replicate-memory", args.replicate_memory, "--no-replicate-check"]
        if args.replicate_rate:
            cmd += ["--replicate-rate", args.replicate_rate]
        if args.replicate_priority:
            cmd += ["--replicate-priority", args.replicate_priority]
        if args.replicate_takeover:
            cmd.append("--replicate-takeover")
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                                pass_fds=(w,), start_new_session=True)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        reply = pipe.read().decode(errors="replace").strip()
    if reply == "OK":
        print(f"ckptfs mounted at {plan.mountpoint} (daemon pid {proc.pid}, log {log_path})")
        return 0
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    if not reply:
        reply = f"the daemon exited with status {proc.returncode} before mounting; see {log_path}"
    raise UsageError(reply, 1)


def _format(args) -> int:
    from .format.layout import DEFAULT_JOURNAL_HALF

    chunk = _chunk_size(args.chunk_size)
    half = parse_size(args.journal_size, what="--journal-size") // 2 if args.journal_size else DEFAULT_JOURNAL_HALF
    half = max(1 << 20, half // 4096 * 4096)
    devices = check_devices(args.devices)
    sbs = _format_devices(devices, chunk, half, args.force)
    pool = sbs[0].pool_id.hex()
    for d, sb in zip(devices, sbs):
        print(f"{d.path}: device {sb.index} of {sb.count}, {sb.data_units} data units of "
              f"{sb.chunk_size} bytes, journal 2 x {sb.journal_half} bytes")
    total = sum(sb.data_units for sb in sbs) * chunk
    print(f"formatted ckptfs pool {pool}: {len(sbs)} device(s), {total / (1 << 30):.2f} GiB for data")
    return 0


def _chunk_size(text: str) -> int:
    """--chunk-size: a stripe unit is a power of two of at least 4K."""
    chunk = parse_size(text, what="--chunk-size")
    if chunk < 4096 or chunk & (chunk - 1):
        raise UsageError(f"bad --chunk-size {text}: must be a power of two of at least 4K")
    return chunk


def _format_devices(devices, chunk: int, half: int, force: bool):
    """Format checked devices (refusing mounted ones); their superblocks."""
    from .store.pool import format_pool

    for d in devices:
        if os.path.realpath(d.path) in _mounted_sources():
            raise UsageError(f"device {d.path} is mounted: refusing to format it", 1)
    return format_pool([d.path for d in devices], chunk_size=chunk, journal_half=half, force=force)


def _mounted_sources() -> set[str]:
    try:
        with open("/proc/self/mounts") as f:
            return {os.path.realpath(line.split()[0]) for line in f if line.startswith("/")}
    except OSError:
        return set()


def _fsck(args) -> int:
    from .store.pool import fsck

    devices = check_devices(args.devices)
    problems = fsck([d.path for d in devices])
    for p in problems:
        print(f"problem: {p}")
    if problems:
        print(f"fsck: {len(problems)} problem(s) found")
        return 1
    print("fsck: pool is clean: journal replays, every extent checksum matches")
    return 0


def _sync(args) -> int:
    mp = os.path.abspath(args.mountpoint)
    daemon_pid(mp)
    fd = os.open(mp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        raise UsageError(f"sync of {mp} failed: {e.strerror}", 1) from None
    finally:
        os.close(fd)
    return 0


def daemon_pid(mountpoint: str) -> int:
    try:
        return int(os.getxattr(mountpoint, "user.ckptfs.pid"))
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            return -1
        raise UsageError(f"{mountpoint} is not a ckptfs mount", 1) from None


def _umount(args) -> int:
    mp = os.path.abspath(args.mountpoint)
    try:
        os.stat(mp)
    except FileNotFoundError:
        raise UsageError(f"{mp} does not exist", 1) from None
    except OSError as e:
        if e.errno != errno.ENOTCONN:
            raise UsageError(f"cannot use {mp}: {e.strerror}", 1) from None
    stale = False
    if os.path.ismount(mp) or _is_stale(mp):
        pid = daemon_pid(mp)
        stale = pid < 0
    else:
        raise UsageError(f"{mp} is not mounted", 1)
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    if not stale:
        # drain while still mounted (with progress on a terminal), so a device error is reported here
        from .ops.console import drain_for_umount
        if not drain_for_umount(mp, args.timeout):
            _sync(args)
    cmd = ["fusermount3", "-u"] + (["-z"] if stale else []) + [mp]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        msg = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "fusermount3 failed"
        raise UsageError(f"cannot unmount {mp}: {msg}", 1)
    if not stale:
        _wait_exit(pid, None if deadline is None else max(0.0, deadline - time.monotonic()))
    print(f"ckptfs unmounted {mp}" + (" (stale mount cleared)" if stale else ""))
    return 0


def _is_stale(mp: str) -> bool:
    """A mount whose daemon is gone. statfs, unlike stat, is never answered from the kernel's
    caches, so it tells even right after the daemon died."""
    try:
        os.statvfs(mp)
    except OSError as e:
        return e.errno == errno.ENOTCONN
    return False


def _wait_exit(pid: int, timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and _alive(pid):
        if deadline is not None and time.monotonic() > deadline:
            raise UsageError(f"daemon {pid} is still running after {timeout:g}s", 1)
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _status(args) -> int:
    from .ops.console import status
    return status(args)


def _wait(args) -> int:
    from .ops.console import wait
    return wait(args)


def _max_lag(text: str) -> float:
    try:
        lag = float(text)
    except ValueError:
        lag = float("nan")
    if not (0 < lag < float("inf")):
        raise UsageError(f"bad --max-lag {text!r}: must be a number of seconds above 0 "
                         f"(for no deferral at all use --drain eager)")
    return lag


def _replication(args, chunk: int, restored_pool: str | None) -> dict:
    """The --replicate options, checked (one line, exit 2), and the object store tried once: the
    endpoint must answer, the credentials be accepted and the bucket exist. MountConfig fields."""
    from .replicate.manifest import parse_url
    from .replicate.segments import segment_size
    from .replicate.priority import DEFAULT_PRIORITY

    if not args.replicate:
        for given, option in ((args.replicate_rate, "--replicate-rate"),
                              (args.replicate_priority, "--replicate-priority"),
                              (args.replicate_takeover, "--replicate-takeover")):
            if given:
                raise UsageError(f"{option} needs --replicate s3://BUCKET/PREFIX")
        return {}
    try:
        url = parse_url(args.replicate)
    except ValueError as e:
        raise UsageError(f"bad --replicate: {e}") from None
    rate = parse_size(args.replicate_rate, what="--replicate-rate") if args.replicate_rate else None
    memory = parse_size(args.replicate_memory, what="--replicate-memory")
    policy = replicas_cli.policy(args, "replicate-")
    if memory < segment_size(chunk):
        raise UsageError(f"--replicate-memory {args.replicate_memory} is too small: it must hold one segment "
                         f"({segment_size(chunk) >> 20}M)")
    if not args.no_replicate_check:
        from .replicate import lineage
        from .replicate.client import S3Error, Target, transient
        from .replicate.manifest import BadManifest
        target = Target(url, args.s3_endpoint, attempts=1)
        try:
            target.check()
            newest = target.newest() if args.format else None
        except S3Error as e:
            if not transient(e):  # a configuration that cannot be right
                raise UsageError(f"cannot replicate to {target}: {e} ({e.cause})") from None
            # a store that cannot be reached now: the mount comes up, replication starts when it answers
            print(f"ckptfs mount: warning: {target} cannot be reached now ({e.cause}): mounting anyway; "
                  f"replication starts when the store answers (ckptfs status shows it)", file=sys.stderr)
            newest = None  # the replicator checks whose the prefix is before it writes (lineage.py)
        except BadManifest:
            newest = None  # whose it is cannot be told: the replicator stops there (lineage.py)
        # a pool about to be formatted continues nobody but the pool it restores: refused before
        # the devices are touched (an existing pool's lineage is the daemon's to check)
        restored = frozenset({restored_pool}) if restored_pool else frozenset()
        why = lineage.refusal(newest, "", restored, args.replicate_takeover, str(url))
        if why is not None:
            raise UsageError(f"cannot replicate: {why}")
    return {"replicate": str(url), "replicate_rate": rate, "replicate_policy": policy,
            "replicate_memory": memory, "replicate_priority": args.replicate_priority or DEFAULT_PRIORITY,
            "replicate_takeover": args.replicate_takeover}


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"bad port {text!r}: must be 0-65535")
    return port


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1
    if not value > 0:
        raise argparse.ArgumentTypeError(f"bad value {text!r}: must be a positive number of seconds")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptfs", description="A checkpoint filesystem for deep-learning training.")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("mount", help="mount ckptfs at MOUNTPOINT")
    m.add_argument("mountpoint")
    m.add_argument("--devices", required=True, help="comma-separated block devices or files")
    m.add_argument("--memory", default=DEFAULT_MEMORY, help="memory budget: 512M, 32G, 25%% of RAM (default %(default)s)")
    m.add_argument("--chunk-size", default=None, help="chunk (stripe unit) size, power of two (default 1M; "
                                                       "with --restore-from, the manifest's)")
    m.add_argument("--foreground", "-f", action="store_true", help="stay in the foreground (containers, debugging)")
    m.add_argument("--log-file", help="daemon log file (default /var/log/ckptfs/ckptfs-<mountpoint>.log)")
    m.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    m.add_argument("--format", action="store_true", help="format the devices first (destroys their contents)")
    m.add_argument("--force", action="store_true",
                   help="with --format: format even over another filesystem, pool or data")
    m.add_argument("--fsync", choices=["durable", "absorb"], default="durable",
                   help="durable (default): fsync waits for the devices; absorb: fsync returns at once")
    m.add_argument("--queue-depth", type=int, default=8, help="I/Os in flight per device (default 8)")
    m.add_argument("--drain", choices=["absorb-first", "eager"], default="absorb-first",
                   help="absorb-first (default): while writes stream in and memory is plentiful, hold "
                        "the drain so saves return fastest; eager: drain chunks as soon as they fill "
                        "(best when the devices, not the CPU, are the bottleneck)")
    m.add_argument("--dedupe", choices=["on", "off"], default="on",
                   help="on (default): a chunk whose bytes the devices hold already (written since the mount) "
                        "is not written again, its file shares them; off: every chunk is written (saves a "
                        "BLAKE3 digest per chunk, ~0.15 CPU s/GiB in the drain threads)")
    m.add_argument("--max-lag", default=repr(DEFAULT_MAX_LAG), metavar="SECONDS",
                   help="longest a closed file's commit is deferred while saves stream in; it is then "
                        "durable once drained (default %(default)s)")
    m.add_argument("--force-recover", action="store_true",
                   help="mount even when the newest journal state is damaged on every device, rolling "
                        "back to the older state that survives (ckptfs fsck shows what is lost)")
    m.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="text (default): 'TIME LEVEL EVENT key=value ...' lines; json: one object per line")
    m.add_argument("--metrics-port", type=_port, default=None,
                   help="serve Prometheus metrics on this port (off by default; 0: any free port, "
                        "shown by ckptfs status)")
    m.add_argument("--metrics-addr", default="127.0.0.1",
                   help="address the metrics endpoint binds to (default 127.0.0.1, this machine only)")
    m.add_argument("--engine", choices=["native", "pyfuse3"], default="native",
                   help="FUSE front end: native (/dev/fuse spoken directly, several threads; falls back to "
                        "pyfuse3 if it cannot start and pyfuse3 is installed) or pyfuse3 (libfuse, the "
                        "'pyfuse3' extra) (default %(default)s)")
    m.add_argument("--threads", type=int, default=None,
                   help="native engine: threads reading /dev/fuse (default: the CPU count)")
    m.add_argument("--restore-from", metavar="s3://BUCKET/PREFIX",
                   help="with --format: show the newest manifest replicated under this prefix at once and "
                        "fetch its contents on first read and in the background (credentials and region "
                        "from the standard AWS chain); an interrupted restore goes on at the next mount")
    m.add_argument("--restore-rate", metavar="SIZE", default=None,
                   help="cap the background restore at SIZE bytes per second (e.g. 200M; reads that wait "
                        "are never capped)")
    m.add_argument("--restore-concurrency", type=int, default=8,
                   help="ranged GETs in flight for the background restore (default %(default)s)")
    m.add_argument("--restore-if-any", action="store_true",
                   help="with --restore-from: when nothing was replicated under the prefix yet (a job's first "
                        "start), format an empty pool instead of failing; any other failure still fails")
    m.add_argument("--generation", type=int, default=None, metavar="N",
                   help="with --restore-from: restore generation N (ckptfs replicas ls lists them) instead of "
                        "the newest")
    m.add_argument("--at", default=None, metavar="TIME",
                   help="with --restore-from: restore the newest generation written at or before TIME "
                        "(2026-12-06T09:30, 2026-12-06 09:30:00+00:00, or a span ago: 90m, 2h, 1d)")
    m.add_argument("--restore-generation", type=int, default=None, help=argparse.SUPPRESS)
    m.add_argument("--replicate", metavar="s3://BUCKET/PREFIX", default=None,
                   help="copy every durable state to this object store prefix in the background "
                        "(credentials and region from the AWS chain: environment, ~/.aws, instance role)")
    m.add_argument("--replicate-rate", metavar="BYTES/S", default=None,
                   help="cap the upload bandwidth, e.g. 100M (default: no cap)")
    m.add_argument("--replicate-keep", dest="replicate_keep_last", type=int,
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # the former name of --replicate-keep-last
    m.add_argument("--replicate-memory", default="256M", metavar="SIZE",
                   help="memory for uploads in flight (default %(default)s)")
    m.add_argument("--replicate-priority", choices=PRIORITIES, default=None,
                   help="CPU priority of the process that hashes and sends the uploads: idle (SCHED_IDLE: only "
                        "CPU nothing else wants), low (nice 19) or normal (default idle)")
    m.add_argument("--replicate-takeover", action="store_true",
                   help="replicate even where the prefix holds another pool's checkpoints (that pool is gone "
                        "for good: its states are deleted as the retention policy allows); without it "
                        "such a mount is refused")
    m.add_argument("--no-replicate-check", action="store_true", help=argparse.SUPPRESS)
    replicas_cli.s3_arguments(m)
    replicas_cli.policy_arguments(m, "replicate-")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.set_defaults(func=_mount)

    f = sub.add_parser("format", help="format devices as a ckptfs pool")
    f.add_argument("--devices", required=True, help="comma-separated block devices or files")
    f.add_argument("--chunk-size", default=str(DEFAULT_CHUNK), help="stripe unit, power of two (default 1M)")
    f.add_argument("--journal-size", default=None, help="journal size per device (default 64M)")
    f.add_argument("--force", action="store_true", help="format even over another filesystem or data")
    f.set_defaults(func=_format)

    k = sub.add_parser("fsck", help="replay the journal and verify every extent checksum")
    k.add_argument("--devices", required=True)
    k.set_defaults(func=_fsck)

    y = sub.add_parser("sync", help="make everything in the mount durable, then return")
    y.add_argument("mountpoint")
    y.set_defaults(func=_sync)

    u = sub.add_parser("umount", help="unmount, waiting for the daemon to finish")
    u.add_argument("mountpoint")
    u.add_argument("--timeout", type=float, default=None, help="give up waiting after this many seconds")
    u.set_defaults(func=_umount)

    s = sub.add_parser("status", help="pool, memory, files not yet durable, rates and ETA")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true", help="print the snapshot as JSON (with --watch: one per line)")
    s.add_argument("--watch", "-w", action="store_true", help="refresh every --interval seconds until Ctrl-C")
    s.add_argument("--interval", type=_positive, default=1.0,
                   help="seconds between refreshes, and the window of the rates (default 1)")
    s.add_argument("--limit", type=int, default=20, help="files listed in the table (default 20; --json lists all)")
    s.set_defaults(func=_status)

    w = sub.add_parser("wait", help="wait until files (or, given the mountpoint, everything) are durable")
    w.add_argument("paths", nargs="+", metavar="PATH")
    w.add_argument("--timeout", type=_positive, default=None,
                   help="give up after this many seconds (exit status 124)")
    w.add_argument("--quiet", "-q", action="store_true", help="no progress bar even on a terminal")
    w.add_argument("--replicated", action="store_true",
                   help="wait until they are in the object store too (a mount with --replicate)")
    w.set_defaults(func=_wait)
    replicas_cli.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "paths", None) is not None and args.command == "replicas" \
            and not any(e.startswith("-") for e in extra):
        args.paths += extra  # `replicas restore URL DIR --generation N PATH...`: paths after the options
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except UsageError as e:
        print(f"ckptfs {args.command}: {e}", file=sys.stderr)
        if getattr(args, "ready_fd", None) is not None:
            try:
                os.write(args.ready_fd, str(e).encode() + b"\n")
            except OSError:
                pass
        return e.status
    except OSError as e:  # not foreseen by a check: still one line, no traceback
        print(f"ckptfs {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
