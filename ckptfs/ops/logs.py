"""Structured log lines: ``TIME LEVEL EVENT key=value ...`` (or one JSON object per line).

An event is logged as its name, with its fields in ``extra``::

    log.info("mounted", extra={"fields": {"mountpoint": mp, "memory": n}})
    -> 2025-01-31T12:00:00.123Z info mounted mountpoint=/ckpt memory=536870912

Ordinary log calls keep working: their event is the component (the logger's
name without ``ckptfs.``) and their text goes in ``msg=``::

    log.error("drain failed: %s", e)
    -> 2025-01-31T12:00:00.456Z error drain msg="drain failed: ..."

Values with spaces, quotes or ``=`` are quoted (JSON string escapes), so a
line always splits into fields the same way; a traceback goes in ``exc=`` on
the same line. The daemon logs to stderr in the foreground and to its log
file when detached (``ckptfs mount`` points the daemon's stderr there).

No secret reaches a log: the object-store client's loggers (botocore logs
request headers, credentials included, at debug level) stay at WARNING
whatever the level, unless CKPTFS_LOG_LIBRARIES names them.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
import time

_BARE = re.compile(r"^[A-Za-z0-9_.:/@+,-]+$")


def _value(v) -> str:
    if isinstance(v, float):
        v = round(v, 6)
    s = v if isinstance(v, str) else json.dumps(v) if isinstance(v, (list, dict, bool)) or v is None else str(v)
    return s if s and _BARE.match(s) else json.dumps(s)


def _timestamp(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


class StructuredFormatter(logging.Formatter):
    """Log records as ``TIME LEVEL EVENT key=value ...`` lines, or JSON objects with
    `json_lines` (see the module docstring)."""

    def __init__(self, json_lines: bool = False):
        super().__init__()
        self.json_lines = json_lines

    def fields(self, record: logging.LogRecord) -> tuple[str, dict]:
        fields = dict(getattr(record, "fields", None) or {})
        event = getattr(record, "event", None)
        if event is None and fields:
            event = record.getMessage()
        if event is None:
            name = record.name
            event = name[len("ckptfs."):] if name.startswith("ckptfs.") else name
            fields = {"msg": record.getMessage(), **fields}
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        return event, fields

    def format(self, record: logging.LogRecord) -> str:
        event, fields = self.fields(record)
        level = record.levelname.lower()
        if self.json_lines:
            return json.dumps({"ts": _timestamp(record.created), "level": level, "event": event, **fields},
                              default=str)
        parts = [_timestamp(record.created), level, event]
        parts += [f"{k}={_value(v)}" for k, v in fields.items()]
        return " ".join(parts)


def setup(level: str = "info", *, filename: str | None = None, stream=None, json_lines: bool = False) -> None:
    """Send the ckptfs loggers' structured lines to `filename` (appended) or `stream` (stderr)."""
    handler: logging.Handler
    if filename:
        handler = logging.FileHandler(filename)
    else:
        handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(StructuredFormatter(json_lines))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    quiet_libraries()


# The object-store client's own loggers: at debug level botocore logs every request with its
# headers (the access key id, the session token, the signature). They stay at WARNING whatever
# --log-level says, unless CKPTFS_LOG_LIBRARIES names them (comma-separated; their lines may
# then carry credentials).
LIBRARY_LOGGERS = ("boto3", "botocore", "s3transfer", "urllib3")


def quiet_libraries() -> None:
    asked = {n.strip() for n in os.environ.get("CKPTFS_LOG_LIBRARIES", "").split(",") if n.strip()}
    for name in LIBRARY_LOGGERS:
        if name not in asked:
            logging.getLogger(name).setLevel(logging.WARNING)
