"""`ckptfs replicas ...`: the object store a pool replicates to, without a mount.

    ckptfs replicas ls URL                  the generations: number, time, files, bytes, pool
    ckptfs replicas files URL [--generation N | --at TIME]
                                            the tree of one generation (default the newest)
    ckptfs replicas verify URL [--read-data]
                                            every object a manifest names is there, with its
                                            size (and with --read-data its chunks' CRC-32C)
    ckptfs replicas restore URL DIR [--generation N | --at TIME] [PATH...]
                                            plain files into DIR, no mount, bit-exact
    ckptfs replicas prune URL [--dry-run] [--keep-*]
                                            the retention policy, by hand

Conventions of restic and rclone: a table for people, `--json` for scripts
(ls, files, verify, prune), one line and exit status 2 for bad input or a
store that refuses, exit status 1 when verify finds a problem. The work is
replicate/replicas.py; this module parses, prints and maps errors. The
object-store options (`s3_arguments`, `s3_options`) are shared with
`ckptfs mount`.
"""
from __future__ import annotations

import json
import os
import stat
import sys
import time

from .errors import UsageError
from .replicate import client, retention


def s3_arguments(p) -> None:
    """The object-store options `mount` and `replicas` share."""
    p.add_argument("--s3-endpoint", metavar="URL", default=None,
                   help="the object store's URL, for stores other than AWS S3 (MinIO, Ceph RGW, SeaweedFS)")
    p.add_argument("--s3-region", default=None, metavar="REGION",
                   help="the bucket's region (default: boto3's chain, AWS_DEFAULT_REGION or ~/.aws/config)")
    p.add_argument("--s3-ca-bundle", default=None, metavar="FILE",
                   help="CA certificates (PEM) to verify an https endpoint with (default: boto3's, AWS_CA_BUNDLE)")
    p.add_argument("--s3-sse", default=None, choices=client.SSE_MODES,
                   help="server-side encryption of every object written (default: the bucket's setting)")
    p.add_argument("--s3-sse-kms-key-id", default=None, metavar="KEY",
                   help="with --s3-sse aws:kms: the KMS key (default: the account's aws/s3 key)")
    p.add_argument("--s3-storage-class", default=None, metavar="CLASS",
                   help="storage class of every object written, e.g. STANDARD_IA (default: STANDARD)")


def s3_options(args) -> None:
    """The --s3-* options, checked (UsageError), then put in this process's environment, which a daemon
    and its uploader started from here inherit (replicate/client.py reads them there)."""
    if args.s3_endpoint is not None and not args.s3_endpoint.startswith(("http://", "https://")):
        raise UsageError(f"bad --s3-endpoint {args.s3_endpoint!r}: expected http://HOST[:PORT] or https://...")
    if args.s3_ca_bundle and not os.path.isfile(args.s3_ca_bundle):
        raise UsageError(f"bad --s3-ca-bundle {args.s3_ca_bundle}: no such file")
    env = {"AWS_DEFAULT_REGION": args.s3_region, "AWS_CA_BUNDLE": args.s3_ca_bundle,
           client.SSE_ENV: args.s3_sse, client.KMS_KEY_ENV: args.s3_sse_kms_key_id,
           client.STORAGE_CLASS_ENV: args.s3_storage_class}
    env = {k: v for k, v in env.items() if v}
    try:
        client.upload_args(env)
    except ValueError as e:
        raise UsageError(f"bad --s3-* option: {e}") from None
    os.environ.update(env)


def policy_arguments(p, prefix: str) -> None:
    """--PREFIX-keep-last/-hourly/-daily/-within (retention.py)."""
    d = retention.DEFAULT
    p.add_argument(f"--{prefix}keep-last", type=int, default=d.last, metavar="N",
                   help="retention: keep the newest N generations (default %(default)s); what no rule keeps is "
                        "deleted, with the objects only it names")
    p.add_argument(f"--{prefix}keep-hourly", type=int, default=d.hourly, metavar="N",
                   help="retention: and the newest generation of each of the last N hours that have one "
                        "(default %(default)s)")
    p.add_argument(f"--{prefix}keep-daily", type=int, default=d.daily, metavar="N",
                   help="retention: and the newest generation of each of the last N days that have one "
                        "(default %(default)s)")
    p.add_argument(f"--{prefix}keep-within", default="0", metavar="SPAN",
                   help="retention: and every generation written within SPAN of now, e.g. 30m, 2h "
                        "(default 0: off)")


def policy(args, prefix: str) -> retention.Policy:
    """The policy of policy_arguments(p, prefix) (UsageError: a bad value)."""
    dest = prefix.replace("-", "_")
    try:
        return retention.Policy(getattr(args, f"{dest}keep_last"), getattr(args, f"{dest}keep_hourly"),
                                getattr(args, f"{dest}keep_daily"),
                                retention.parse_span(getattr(args, f"{dest}keep_within")))
    except ValueError as e:
        raise UsageError(f"bad retention (--{prefix}keep-*): {e}") from None


def add_parser(sub) -> None:
    r = sub.add_parser("replicas", help="the object store a pool replicates to: list, verify, restore, prune")
    rs = r.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name: str, text: str, json_out: bool = True):
        a = rs.add_parser(name, help=text, description=text)
        a.add_argument("url", metavar="s3://BUCKET/PREFIX")
        if json_out:
            a.add_argument("--json", action="store_true", help="one JSON document, for scripts")
        s3_arguments(a)
        a.set_defaults(func=run)
        return a

    def choice(a) -> None:
        a.add_argument("--generation", type=int, default=None, metavar="N", help="this generation (default: the newest)")
        a.add_argument("--at", default=None, metavar="TIME",
                       help="the newest generation written at or before TIME (2026-12-06T09:30, or a span ago: "
                            "90m, 2h, 1d)")

    action("ls", "the generations under the prefix: number, time, files, bytes, the pool that wrote it")
    choice(action("files", "the files of one generation (default the newest)"))
    v = action("verify", "check that every object a manifest names is in the store, with its size; exit 1 if not")
    v.add_argument("--read-data", action="store_true", help="also read every object and check its chunks' CRC-32C")
    t = action("restore", "write one generation's files into a directory as plain files (no mount)", json_out=False)
    t.add_argument("directory", metavar="DIR")
    t.add_argument("paths", nargs="*", metavar="PATH", help="only these paths (and what is below them)")
    t.add_argument("--quiet", "-q", action="store_true", help="no progress line")
    choice(t)
    p = action("prune", "delete the generations the retention policy does not keep, and the objects no kept "
                        "one names")
    p.add_argument("--dry-run", "-n", action="store_true", help="say what would be deleted, delete nothing")
    p.add_argument("--grace", default="1h", metavar="SPAN",
                   help="leave objects no manifest names that are younger than SPAN: a replicating daemon may "
                        "name them in its next manifest (default %(default)s)")
    policy_arguments(p, "")


def _when(t: float | None) -> str:
    return "?" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def run(args) -> int:
    from .replicate import replicas
    from .replicate.client import S3Error, Target
    from .replicate.manifest import BadManifest, parse_url

    s3_options(args)
    try:
        url = parse_url(args.url)
    except ValueError as e:
        raise UsageError(f"bad URL: {e}") from None
    if getattr(args, "generation", None) is not None and getattr(args, "at", None) is not None:
        raise UsageError("--generation and --at both choose a generation: give one")
    try:
        target = Target(url, args.s3_endpoint, attempts=3, connect_timeout=5)
        return _ACTIONS[args.action](args, target, replicas)
    except (S3Error, BadManifest, replicas.ReplicaError, ValueError) as e:
        raise UsageError(str(e)) from None


def _chosen(args, target, replicas):
    at = replicas.parse_at(args.at) if args.at else None
    return replicas.choose(target, args.generation, at)


def _ls(args, target, replicas) -> int:
    gens = replicas.generations(target)
    if args.json:
        print(json.dumps([g.__dict__ for g in gens], indent=1))
        return 0
    if not gens:
        print(f"no generation under {target.url}")
        return 0
    print(f"{'generation':>10}  {'time':19}  {'files':>6}  {'size':>10}  {'new':>10}  pool")
    for g in gens:
        pool = (g.pool or "?")[:12] if g.error is None else f"unreadable: {g.error}"
        print(f"{g.generation:>10}  {_when(g.time):19}  {g.files if g.files is not None else '?':>6}  "
              f"{_size(g.bytes):>10}  {_size(g.new_bytes):>10}  {pool}")
    print(f"{len(gens)} generation(s)")
    return 0


def _files(args, target, replicas) -> int:
    m = _chosen(args, target, replicas)
    rows = [{"path": e.path, "type": _kind(e.mode), "mode": oct(stat.S_IMODE(e.mode)), "size": e.size,
             "mtime": e.mtime_ns / 1e9} for e in m.entries if e.path]
    if args.json:
        print(json.dumps({"generation": m.generation, "time": m.time_ns / 1e9, "files": rows}, indent=1))
        return 0
    print(f"generation {m.generation} ({_when(m.time_ns / 1e9)}):")
    for r in rows:
        print(f"{r['type']} {r['mode']:>6} {_size(r['size']) if r['type'] == 'file' else '':>10}  "
              f"{_when(r['mtime'])}  {r['path']}")
    return 0


def _kind(mode: int) -> str:
    return {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "link"}.get(stat.S_IFMT(mode), "other")


def _verify(args, target, replicas) -> int:
    problems = replicas.verify(target, read_data=args.read_data)
    gens = target.generations()
    if args.json:
        print(json.dumps({"generations": len(gens), "read_data": args.read_data, "problems": problems}, indent=1))
    else:
        for p in problems:
            print(p)
        what = "objects and their data" if args.read_data else "objects"
        print(f"{len(gens)} generation(s), {what} checked: "
              + (f"{len(problems)} problem(s)" if problems else "no problems"))
    return 1 if problems else 0


def _restore(args, target, replicas) -> int:
    m = _chosen(args, target, replicas)
    total = sum({e.object: e.size for e in m.entries if e.object}.values())
    show = not args.quiet and sys.stderr.isatty()
    started = time.monotonic()

    def progress(done: int) -> None:
        if show:
            rate = done / max(1e-6, time.monotonic() - started)
            print(f"\r{_size(done)} of {_size(total)}, {_size(int(rate))}/s   ", end="", file=sys.stderr, flush=True)

    files, done = replicas.restore(target, m, args.directory, args.paths or None, progress)
    if show:
        print(file=sys.stderr)
    print(f"restored {files} file(s), {_size(done)}, generation {m.generation} ({_when(m.time_ns / 1e9)}) "
          f"into {args.directory}")
    return 0


def _prune(args, target, replicas) -> int:
    try:
        grace = retention.parse_span(args.grace)
    except ValueError as e:
        raise UsageError(f"bad --grace: {e}") from None
    chosen = policy(args, "")
    res = replicas.prune(target, chosen, dry_run=args.dry_run, grace=grace)
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, "policy": chosen.describe(), "deleted_generations": res.manifests,
                          "deleted_objects": len(res.objects), "kept_generations": res.kept,
                          "young_objects_left": res.young}, indent=1))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    print(f"policy: keep {chosen.describe()}")
    print(f"kept {len(res.kept)} generation(s): {_list(res.kept)}")
    print(f"{verb} {len(res.manifests)} generation(s): {_list(res.manifests)}; {len(res.objects)} object(s) "
          f"no kept generation names" + (f"; {res.young} younger than --grace left" if res.young else ""))
    return 0


def _list(gens: list[int]) -> str:
    if not gens:
        return "none"
    return ", ".join(map(str, gens)) if len(gens) <= 12 else f"{', '.join(map(str, gens[:10]))}, ... {gens[-1]}"


_ACTIONS = {"ls": _ls, "files": _files, "verify": _verify, "restore": _restore, "prune": _prune}
