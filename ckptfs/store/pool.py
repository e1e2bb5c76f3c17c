"""Opening, formatting, recovering and checking a pool of devices.

`format_pool` writes a superblock and an empty journal (a snapshot of the
root directory) on every device, after refusing devices that hold something
else. `open_pool` reads the superblocks and refuses a device set that is not
exactly one pool in the right order. `recover` replays the journal: each
device carries a mirror of it in two halves; the newest complete half
(highest epoch whose snapshot was fully written) with the longest valid run
of frames on any device wins. The journal anchors (layout.Anchor) say which
half and epoch should win and whether the last unmount was clean: when replay
finds less than they promise (the newest half, or a cleanly closed tail, lost
on every mirror), recovery refuses to roll back unless forced. `fsck` replays
and reads every extent back.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import time
from dataclasses import dataclass, field, replace

import crc32c

from .allocator import Allocator
from .dedupe import digest
from .device import ALIGN, BlockDevice, aligned_buffer, round_up
from .durable import DurableState, address_key
from ..errors import UsageError
from ..fs.filemap import Chunk, FileData
from ..format.records import Extent
from ..format.journal import HalfReplay, JournalCorrupt, encode_frame, replay_half
from ..format.layout import (ANCHOR_SLOTS, ANCHORED_VERSION, DEFAULT_JOURNAL_HALF, SB_SIZE, Anchor, FormatError,
                     Superblock, foreign_signature, make_superblocks, min_device_size)
from ..fs.namespace import ROOT_INO, Namespace

log = logging.getLogger("ckptfs.pool")


@dataclass
class Pool:
    """An opened pool: its devices (each locked while open) and their superblocks, in pool order;
    `close()` lets the devices go."""
    devices: list[BlockDevice]
    sbs: list[Superblock]

    def close(self) -> None:
        for d in self.devices:
            d.close()


@dataclass
class Recovered:
    """What `recover` found: the durable state and records of the winning journal half, where the
    next frame goes (`half`, `tail`, `seq`), and what to report of it (warnings, clean, losses)."""
    durable: DurableState
    records: list
    half: int
    tail: int
    seq: int
    warnings: list[str] = field(default_factory=list)
    clean: bool = False  # the last unmount was clean (the anchor says so and replay agrees)
    time_ns: int | None = None  # wall-clock time of the last commit recovered
    discarded: list[str] = field(default_factory=list)  # torn or damaged frames replay dropped
    rollback: str | None = None  # set (with force) when the anchors promise more than replay found
    anchor_gen: int = 0  # the newest anchor's generation (0: none)

    def report(self) -> dict:
        """What `ckptfs status` shows of it."""
        return {"clean": self.clean, "seq": self.seq, "time_ns": self.time_ns, "half": self.half,
                "epoch": self.durable.epoch, "discarded": list(self.discarded),
                "warnings": list(self.warnings) + ([self.rollback] if self.rollback else [])}


def _open_devices(paths: list) -> list[BlockDevice]:
    """BlockDevices for paths; objects that already are devices (tests' fakes) pass through.

    Each device is locked while open (an exclusive POSIX record lock, owned by
    this process), so a pool in use by a daemon cannot be mounted a second
    time, formatted, or checked under it by another process.
    """
    devs = []
    try:
        for p in paths:
            devs.append(p if hasattr(p, "pread_into") else BlockDevice(p))
            _lock(devs[-1])
    except Exception:
        for d in devs:
            d.close()
        raise
    return devs


LOCK_WAIT = 3.0  # seconds: a killed daemon lets go once its last I/O thread has exited


def _lock(dev) -> None:
    if not isinstance(dev, BlockDevice):
        return  # tests' in-memory devices
    deadline = time.monotonic() + LOCK_WAIT
    while True:
        try:
            fcntl.lockf(dev.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                log.warning("cannot lock %s (%s): not guarding against concurrent use", dev.path, e.strerror)
                return
            if time.monotonic() > deadline:
                raise UsageError(f"device {dev.path} is in use by another ckptfs process (a mounted "
                                 f"pool, or a format or fsck running): unmount it first", 1) from None
            time.sleep(0.05)


def format_pool(paths: list, *, chunk_size: int, journal_half: int = DEFAULT_JOURNAL_HALF,
                force: bool = False) -> list[Superblock]:
    devs = _open_devices(paths)
    try:
        need = min_device_size(chunk_size, journal_half)
        for d in devs:
            if d.size < need:
                raise UsageError(f"device {d.path} is too small: {d.size} bytes, need at least {need} "
                                 f"(journal {2 * journal_half} bytes plus one {chunk_size}-byte chunk)", 1)
            head = bytes(d.pread(1 << 20, 0)) if d.size >= 1 << 20 else bytes(d.pread(round_up(d.size) , 0))
            found = foreign_signature(head)
            if found and not force:
                raise UsageError(f"device {d.path} holds {found}: refusing to overwrite it "
                                 f"(use --force to format anyway)", 1)
        sbs = make_superblocks([d.size for d in devs], chunk_size, journal_half, time.time_ns())
        root = Namespace().get(ROOT_INO)
        recs = [("begin", 1, ROOT_INO + 1),
                ("attrs", ROOT_INO, root.mode, 0, 0, root.atime_ns, root.mtime_ns, root.ctime_ns),
                ("snapend",)]
        frame = encode_frame(sbs[0].pool_id, 1, 1, recs)
        zero = aligned_buffer(1 << 20)
        for d, sb in zip(devs, sbs):
            d.pwrite(zero, 0)  # clear old signatures in the first MiB
            d.pwrite(zero[:ALIGN], sb.half_offset(1))  # an older half must not outrank the new one
            buf = aligned_buffer(len(frame))
            buf[:len(frame)] = frame
            d.pwrite(buf, sb.half_offset(0))
            anchor = Anchor(generation=1, epoch=1, half=0, clean=True, seq=1, time_ns=time.time_ns())
            _write_block(d, anchor.offset, anchor.encode(sb.pool_id))
            sbuf = aligned_buffer(SB_SIZE)
            sbuf[:SB_SIZE] = sb.encode()
            d.pwrite(sbuf, 0)
            d.flush()
        return sbs
    finally:
        for d in devs:
            d.close()


def open_pool(paths: list) -> Pool:
    devs = _open_devices(paths)
    try:
        sbs = []
        for d in devs:
            try:
                sbs.append(Superblock.decode(bytes(d.pread(SB_SIZE, 0)), d.path))
            except FormatError as e:
                raise UsageError(str(e), 1) from None
        first = sbs[0]
        for d, sb, pos in zip(devs, sbs, range(len(devs))):
            if sb.pool_id != first.pool_id:
                raise UsageError(f"device {d.path} belongs to another pool than {devs[0].path}", 1)
            if sb.count != len(devs):
                raise UsageError(f"device {d.path} is one of a pool of {sb.count} devices, "
                                 f"but {len(devs)} were given", 1)
            if sb.index != pos:
                raise UsageError(f"device {d.path} is device {sb.index} of its pool but was given in "
                                 f"position {pos}: list the devices in their original order", 1)
            if (sb.chunk_size, sb.journal_half, sb.grain) != (first.chunk_size, first.journal_half, first.grain):
                raise UsageError(f"device {d.path} disagrees with {devs[0].path} on the pool layout", 1)
            if d.size < sb.device_size:
                raise UsageError(f"device {d.path} is smaller ({d.size} bytes) than when it was "
                                 f"formatted ({sb.device_size} bytes)", 1)
        return Pool(devs, sbs)
    except Exception:
        for d in devs:
            d.close()
        raise


def _write_block(d, offset: int, block: bytes) -> None:
    buf = aligned_buffer(len(block))
    buf[:len(block)] = block
    d.pwrite(buf, offset)


def read_anchor(pool: Pool) -> Anchor | None:
    """The newest valid anchor on any device and slot (None on a version-1 pool, or if all are lost)."""
    best = None
    for d, sb in zip(pool.devices, pool.sbs):
        for off in ANCHOR_SLOTS:
            a = Anchor.decode(bytes(d.pread(SB_SIZE, off)), sb.pool_id)
            if a is not None and (best is None or a.generation > best.generation):
                best = a
    return best


def upgrade_superblocks(devices: list, sbs: list[Superblock]) -> bool:
    """Rewrite version-1 superblocks as version 2 (call once anchors are written: a crash before
    this leaves a version-1 pool whose anchors version 1 ignores). Not to version 3: its extent
    addresses count 4 KiB blocks, not units, so an older pool keeps whole units per chunk."""
    if all(sb.version >= ANCHORED_VERSION for sb in sbs):
        return False
    for d, sb in zip(devices, sbs):
        _write_block(d, 0, replace(sb, version=ANCHORED_VERSION).encode())
        d.flush()
    return True


def read_halves(pool: Pool) -> list[list[HalfReplay]]:
    """replays[device][half]."""
    out = []
    for d, sb in zip(pool.devices, pool.sbs):
        out.append([replay_half(sb.pool_id, bytes(d.pread(sb.journal_half, sb.half_offset(h))))
                    for h in (0, 1)])
    return out


def recover(pool: Pool, *, force: bool = False) -> Recovered:
    """Replay the newest journal. Refuses (UsageError) to roll back past what the anchors
    promise unless `force`, which recovers what is there and says what was lost in `rollback`."""
    replays = read_halves(pool)
    best, best_half, best_dev, warnings = None, 0, 0, []
    for d, halves in enumerate(replays):
        if not any(r.complete for r in halves):
            # never the result of a crash: format and compaction always leave one complete half
            warnings.append(f"{pool.devices[d].path}: no valid journal in either half; "
                            f"this device's mirror of the journal is lost")
        for h, r in enumerate(halves):
            if r.corrupt_at is not None:
                warnings.append(f"{pool.devices[d].path}: journal half {h} damaged at offset {r.corrupt_at}; "
                                f"commits after it are lost on this device")
            if not r.complete:
                continue
            if best is None or (r.epoch, r.last_seq) > (best.epoch, best.last_seq):
                best, best_half, best_dev = r, h, d
    if best is None:
        raise UsageError(f"no valid journal on {', '.join(d.path for d in pool.devices)}: "
                         f"the pool is damaged (run 'ckptfs fsck')", 1)
    anchor = read_anchor(pool)
    rollback = _rollback(pool, anchor, best)
    if rollback and not force:
        raise UsageError(f"{rollback}; refusing to mount an older state silently: run 'ckptfs fsck', "
                         f"then mount with --force-recover to accept it", 1)
    if anchor is None and any(sb.version >= ANCHORED_VERSION for sb in pool.sbs):
        warnings.append("no valid journal anchor on any device: cannot check that the newest journal "
                        "half survived, nor whether the last unmount was clean")
    discarded = []
    if best.corrupt_at is not None:  # the longest replay stops at damage: what follows is lost everywhere
        discarded.append(f"valid commits after damage at offset {best.corrupt_at} of journal half {best_half} "
                         f"on {pool.devices[best_dev].path}")
    if best.torn_at is not None:
        discarded.append(f"an incomplete commit (torn by the crash) at offset {best.torn_at} of journal "
                         f"half {best_half} on {pool.devices[best_dev].path}")
    alloc = Allocator([sb.data_units for sb in pool.sbs], pool.sbs[0].chunk_size // pool.sbs[0].grain)
    durable = DurableState(alloc)
    try:
        for rec in best.records:
            durable.apply(rec)
    except JournalCorrupt as e:
        raise UsageError(f"journal replay failed: {e}", 1) from None
    clean = (anchor is not None and anchor.clean and anchor.epoch == best.epoch
             and anchor.seq == best.last_seq and not discarded)
    return Recovered(durable, best.records, best_half, best.tail, best.last_seq, warnings, clean=clean,
                     time_ns=best.time_ns, discarded=discarded, rollback=rollback,
                     anchor_gen=anchor.generation if anchor is not None else 0)


def _rollback(pool: Pool, anchor: Anchor | None, best: HalfReplay) -> str | None:
    """What recovering `best` would lose that the anchor says was durable, or None."""
    if anchor is None:
        return None
    names = ", ".join(d.path for d in pool.devices)
    if anchor.epoch > best.epoch:
        return (f"the current journal half {anchor.half} (epoch {anchor.epoch}) is damaged on every device "
                f"({names}): only epoch {best.epoch} replays, so every commit since the journal was last "
                f"compacted would be lost")
    if anchor.clean and anchor.epoch == best.epoch and anchor.seq > best.last_seq:
        return (f"the journal was closed cleanly at frame {anchor.seq}, but only frames up to {best.last_seq} "
                f"replay on any device ({names}): the commits after it would be lost")
    return None


def live_namespace(records: list, alloc: Allocator, owner) -> Namespace:
    """A namespace for serving, replayed from `records`; file data becomes evicted chunks.

    The replay runs on an allocator of its own (the records' earlier extents may overlap
    what `alloc` holds now: space freed and used again); then each extent of the result
    is claimed on `alloc` a second time: that reference belongs to the live chunk.
    """
    live = DurableState(Allocator(alloc.units, alloc.per_unit))
    for rec in records:
        live.apply(rec)
    ns = live.ns
    ns.clock = time.time_ns
    for ino, extents in live.files.items():
        fd = FileData(owner, ino)
        for idx, ext in extents.items():
            alloc.claim(ext.dev, ext.unit, ext.length)
            c = Chunk(None, ino, idx)
            c.hwm = ext.length
            c.extent = ext
            c.extent_gen = 0
            c.live = True
            fd.put(idx, c)
        ns.inodes[ino].data = fd
    return ns


def fsck(paths: list) -> list[str]:
    """Problems found (empty when the pool is sound): journal damage, bad or overlapping extents,
    bytes that do not match their CRC-32C or their journaled content digest (--dedupe)."""
    problems: list[str] = []
    pool = open_pool(paths)
    try:
        rec = recover(pool, force=True)
        problems.extend(rec.warnings)
        if rec.rollback:
            problems.append(rec.rollback)
        seen: dict[tuple[int, int], tuple[int, int, Extent]] = {}
        for ino, idx, ext in rec.durable.extents():
            where = f"inode {ino} chunk {idx} on {pool.devices[ext.dev].path} address {ext.unit}"
            key = (ext.dev, ext.unit)
            if key in seen:  # shared (--dedupe): fine when both name the same bytes, checked once
                other_ino, other_idx, other = seen[key]
                if (other.length, other.crc) != (ext.length, ext.crc):
                    problems.append(f"{where}: unit also used by inode {other_ino} chunk {other_idx} "
                                    f"with other contents")
                continue
            seen[key] = (ino, idx, ext)
            try:
                data = pool.devices[ext.dev].pread(round_up(ext.length), pool.sbs[ext.dev].unit_offset(ext.unit))
            except Exception as e:  # noqa: BLE001 - every problem is reported
                problems.append(f"{where}: read failed: {e}")
                continue
            known = rec.durable.digests.get(address_key(ext))
            if crc32c.crc32c(data[:ext.length]) != ext.crc:
                problems.append(f"{where}: checksum mismatch")
            elif known is not None and (known[0] != ext or digest(data[:ext.length]) != known[1]):
                problems.append(f"{where}: content digest mismatch (journaled for {known[0]})")
        rec.durable.ns.check_invariants()
    finally:
        pool.close()
    return problems
