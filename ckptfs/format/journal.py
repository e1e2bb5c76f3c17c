"""The metadata journal: record codec, commit frames, and replay of a half. Pure.

Records are the typed values of records.py (the namespace's notifications,
``content`` at each close or fsync, the snapshot records ``attrs``, ``begin``
and ``snapend``, and ``stamp``, the wall-clock time of a commit: every frame
the daemon writes carries one, and replay reports the last instead of
returning it). Encoding takes any ``(op, *fields)`` tuple; decoding returns
typed records.

A frame is one atomic commit of one or more records:

    magic u32 | crc32c u32 | seq u64 | epoch u64 | length u32 | nrec u32 | records | zero pad to 4 KiB

The crc covers the pool id, every header field after it and the records, so
a frame from another pool (or a stale frame from an earlier use of the same
space, whose seq is wrong) never replays. Frames start on 4 KiB boundaries,
so a torn frame never damages an earlier one.

A journal half starts with a frame holding ``begin(epoch, next_ino)`` and a
snapshot of the whole namespace ended by ``snapend``; commits follow. Replay
reads frames while each is valid and continues the sequence; the first that
is not ends replay (a torn tail, quietly). If a valid frame of the same epoch
with a later seq turns up after the stop, the stop was corruption in the
middle, and `corrupt_at` says where. A frame header with the right magic at the
stopping point whose checksum fails is a commit torn by the crash: `torn_at`.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import crc32c

from .layout import BLOCK, round_up
from .records import BY_TYPE, SCHEMA, Extent

MAGIC = 0x314A4B43  # "CKJ1"
_HDR = struct.Struct("<IIQQII")


# op -> (type byte, field kinds), from the schema (records.py says what the kinds are)
RECORDS: dict[str, tuple[int, str]] = {op: (t.type, t.kinds) for op, t in SCHEMA.items()}
_EXT = struct.Struct("<QHQII")
_DIGEST = struct.Struct("<HQII32s")  # an extent (device, unit, length, crc) and its content digest
DIGEST_ITEM = _DIGEST.size  # bytes per item of a `digests` record


class JournalCorrupt(Exception):
    """A journal frame or record that cannot be decoded, or a record that does not apply to the
    durable state; the message says why."""


_FIXED = {k: struct.Struct("<" + k).pack for k in "QqIHB"}


def encode_record(rec: tuple) -> bytes:
    op, args = rec[0], rec[1:]
    t, kinds = RECORDS[op]
    if len(args) != len(kinds):
        raise ValueError(f"{op} takes {len(kinds)} fields, got {len(args)}")
    out = [bytes([t])]
    for k, v in zip(kinds, args):
        if k in _FIXED:
            out.append(_FIXED[k](v))
        elif k == "s":
            out.append(struct.pack("<H", len(v)) + bytes(v))
        elif k == "S":
            out.append(struct.pack("<I", len(v)) + bytes(v))
        elif k in "ut":
            out.append(b"\0" + bytes(4 if k == "u" else 8) if v is None
                       else b"\1" + struct.pack("<I" if k == "u" else "<q", v))
        elif k == "X":
            out.append(struct.pack("<I", len(v)))
            out.extend(_EXT.pack(idx, *ext) for idx, ext in v)
        elif k == "D":
            out.append(struct.pack("<I", len(v)))
            out.extend(_DIGEST.pack(*ext, d) for ext, d in v)
        else:
            raise AssertionError(k)
    return b"".join(out)


def decode_records(buf: bytes, nrec: int) -> list[tuple]:
    recs = []
    pos = 0
    mv = memoryview(buf)
    for _ in range(nrec):
        rt = BY_TYPE[buf[pos]]
        pos += 1
        args: list = []
        for k in rt.kinds:
            if k in "QqIHB":
                (v,) = struct.unpack_from("<" + k, buf, pos)
                pos += struct.calcsize(k)
            elif k in "sS":
                (n,) = struct.unpack_from("<H" if k == "s" else "<I", buf, pos)
                pos += 2 if k == "s" else 4
                v = bytes(mv[pos:pos + n])
                pos += n
            elif k in "ut":
                present = buf[pos]
                (v,) = struct.unpack_from("<I" if k == "u" else "<q", buf, pos + 1)
                pos += 5 if k == "u" else 9
                v = v if present else None
            elif k == "X":
                items, pos = _unpack_list(_EXT, mv, pos)
                v = [(idx, Extent(dev, unit, length, crc)) for idx, dev, unit, length, crc in items]
            elif k == "D":
                items, pos = _unpack_list(_DIGEST, mv, pos)
                v = [(Extent(dev, unit, length, crc), d) for dev, unit, length, crc, d in items]
            args.append(v)
        recs.append(rt.cls(*args))
    if pos != len(buf):
        raise JournalCorrupt(f"frame payload has {len(buf) - pos} trailing bytes")
    return recs


def _unpack_list(st: struct.Struct, mv: memoryview, pos: int) -> tuple[list[tuple], int]:
    """A u32 count then that many `st` items at `pos`: the items and the position after them."""
    (n,) = struct.unpack_from("<I", mv, pos)
    end = pos + 4 + n * st.size
    if end > len(mv):
        raise JournalCorrupt(f"a list of {n} items runs past the frame")
    return list(st.iter_unpack(mv[pos + 4:end])), end


def frame_size(payload_len: int) -> int:
    return round_up(_HDR.size + payload_len)


def encode_frame(pool_id: bytes, seq: int, epoch: int, records: list[tuple]) -> bytes:
    payload = b"".join(encode_record(r) for r in records)
    rest = _HDR.pack(MAGIC, 0, seq, epoch, len(payload), len(records))[8:]
    crc = crc32c.crc32c(pool_id + rest + payload)
    raw = struct.pack("<II", MAGIC, crc) + rest + payload
    return raw.ljust(frame_size(len(payload)), b"\0")


def _frame_at(pool_id: bytes, buf, off: int):
    """(seq, epoch, records, next offset) of a valid frame at `off`, or None."""
    if off + _HDR.size > len(buf):
        return None
    magic, crc, seq, epoch, length, nrec = _HDR.unpack_from(buf, off)
    if magic != MAGIC or off + _HDR.size + length > len(buf):
        return None
    body = bytes(buf[off + 8:off + _HDR.size + length])
    if crc32c.crc32c(pool_id + body) != crc:
        return None
    try:
        records = decode_records(body[_HDR.size - 8:], nrec)
    except (JournalCorrupt, KeyError, struct.error, IndexError):
        return None
    return seq, epoch, records, off + frame_size(length)


@dataclass
class HalfReplay:
    """What `replay_half` found in one journal half: its epoch and seq range, the records (stamps
    left out), where the next frame goes, and where replay stopped at damage or a torn commit."""
    epoch: int = -1
    first_seq: int = 0
    last_seq: int = -1
    records: list = field(default_factory=list)
    complete: bool = False  # the snapshot at its start was fully written
    tail: int = 0  # offset where the next frame goes
    corrupt_at: int | None = None
    torn_at: int | None = None  # a frame was being written here (the crash tore it)
    frames: int = 0
    time_ns: int | None = None  # the wall-clock time of the last commit replayed (its stamp)


def replay_half(pool_id: bytes, buf) -> HalfReplay:
    """Replay one journal half: every frame up to the first invalid one."""
    out = HalfReplay()
    first = _frame_at(pool_id, buf, 0)
    if first is None or not first[2] or first[2][0][0] != "begin":
        return out
    seq, epoch, records, nxt = first
    out.epoch, out.first_seq = epoch, seq
    while True:
        for r in records:
            if r[0] == "stamp":
                out.time_ns = r[1]
            else:
                out.records.append(r)
        out.frames += 1
        out.last_seq = seq
        out.tail = nxt
        if not out.complete and any(r[0] == "snapend" for r in records):
            out.complete = True
        f = _frame_at(pool_id, buf, nxt)
        if f is None or f[0] != seq + 1 or f[1] != epoch:
            break
        seq, epoch, records, nxt = f
    if out.tail + _HDR.size <= len(buf) and _HDR.unpack_from(buf, out.tail)[0] == MAGIC \
            and _frame_at(pool_id, buf, out.tail) is None:
        out.torn_at = out.tail
    # a later valid frame of this epoch means the stop was damage, not a torn tail
    off = out.tail + BLOCK
    while off < len(buf):
        f = _frame_at(pool_id, buf, off)
        if f is not None and f[1] == epoch and f[0] > out.last_seq:
            out.corrupt_at = out.tail
            break
        off += BLOCK
    return out
