"""The messages between the daemon and its uploader process: framing and errors, no I/O.

The daemon's replicator asks the uploader process (uploader.py) to make the
object-store calls; the two talk over a Unix socket pair (uploader_proc.py
does the I/O). Every message is one frame:

    u32  length of what follows (id, json length, json, blob)
    u64  id: a call's number; its answer carries the same id (0: not a call)
    u32  json length
    ...  json: one object (the message)
    ...  blob: the rest of the frame, raw bytes (a manifest to put, an object got)

The daemon sends

    {"op": "call", "name": N, "args": [...], "body": [region, offset, length]}
        a Target call (client.py); `body`, where the call uploads (put),
        names its payload in a shared memory region
        (partmem.py); "body": "blob" means the blob is the payload instead
    {"op": "map", "region": R, "size": S}   with one file descriptor (SCM_RIGHTS):
        the memfd of region R; {"op": "unmap", "region": R} when it is gone
    {"op": "ping"}

and the uploader answers

    {"ready": {"pid", "policy", "nice"}}    once, when it can take calls
    {"fatal": LINE}                          instead, when it cannot start
    {"ok": RESULT}  or  {"ok": "blob"}       a call's result (bytes: the blob)
    {"error": {"type", "cause", "message"}}  a call's failure (`error`/`exception`)
    {"pong": true}

`Decoder.feed(data)` takes whatever bytes arrived (one at a time, or many
frames at once) and returns the complete frames; a frame longer than
MAX_FRAME, or a header that does not add up, is a `WireError` (the stream
cannot be trusted after it).
"""
from __future__ import annotations

import json
import struct

from .manifest import BadManifest

HEADER = struct.Struct("<IQI")  # length (after this field), id, json length
_AFTER_LENGTH = HEADER.size - 4
MAX_FRAME = 1 << 30
BLOB = "blob"  # a body or result that travels as the frame's blob


class WireError(Exception):
    """The byte stream is not a sequence of frames."""


def frame(msg: dict, id: int = 0, blob: bytes | memoryview = b"") -> bytes:
    """One frame carrying `msg` and `blob`."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    length = _AFTER_LENGTH + len(body) + len(blob)
    if length > MAX_FRAME:
        raise WireError(f"a frame of {length} bytes is over the limit of {MAX_FRAME}")
    return b"".join((HEADER.pack(length, id, len(body)), body, blob))


class Decoder:
    """Bytes in, (id, message, blob) frames out."""

    def __init__(self):
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, dict, bytes]]:
        self.buf += data
        out = []
        while len(self.buf) >= HEADER.size:
            length, id, jlen = HEADER.unpack_from(self.buf)
            if length > MAX_FRAME or length < _AFTER_LENGTH + jlen:
                raise WireError(f"bad frame header: length {length}, json length {jlen}")
            end = 4 + length
            if len(self.buf) < end:
                break
            try:
                msg = json.loads(bytes(self.buf[HEADER.size:HEADER.size + jlen]))
            except ValueError as e:
                raise WireError(f"bad frame body: {e}") from None
            if not isinstance(msg, dict):
                raise WireError(f"bad frame body: {type(msg).__name__}, not an object")
            out.append((id, msg, bytes(self.buf[HEADER.size + jlen:end])))
            del self.buf[:end]
        return out


def error(e: BaseException) -> dict:
    """The "error" message of a call that raised `e` (an S3Error or BadManifest keeps its type)."""
    from .client import OTHER, S3Error  # here: the uploader lowers its priority before boto3 loads

    if isinstance(e, BadManifest):
        return {"type": "BadManifest", "cause": None, "message": str(e)}
    if not isinstance(e, S3Error):
        e = S3Error(OTHER, f"{type(e).__name__}: {e}")
    return {"type": "S3Error", "cause": e.cause, "message": str(e)}


def exception(err: dict) -> Exception:
    """The exception an "error" message stands for, of the type it had in the uploader."""
    from .client import OTHER, S3Error

    if err.get("type") == "BadManifest":
        return BadManifest(err.get("message", ""))
    return S3Error(err.get("cause") or OTHER, err.get("message", ""))
