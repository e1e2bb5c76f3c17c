"""Parsing of human sizes: ``512M``, ``32G``, ``1.5T``, ``4096``, ``25%`` (of RAM).

Suffixes are binary (K = 1024). A percentage is taken of the machine's
physical memory. Errors raise `UsageError` with the offending text.
"""
from __future__ import annotations

import os
import re

from .errors import UsageError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_size(text: str, *, what: str = "size") -> int:
    """Bytes meant by `text`; raises UsageError naming `what` when it is not a size."""
    raw = str(text).strip()
    if raw.endswith("%"):
        try:
            pct = float(raw[:-1])
        except ValueError:
            raise UsageError(f"bad {what} {text!r}: expected e.g. 512M, 32G or 25%") from None
        if not 0 < pct <= 100:
            raise UsageError(f"bad {what} {text!r}: a percentage must be in (0, 100]")
        return int(physical_memory() * pct / 100)
    m = _RE.match(raw)
    if not m:
        raise UsageError(f"bad {what} {text!r}: expected e.g. 512M, 32G or 25%")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise UsageError(f"bad {what} {text!r}: must be greater than zero")
    return value


def human(n: float) -> str:
    """`n` bytes as a short binary-unit string (``1.5G``)."""
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")
