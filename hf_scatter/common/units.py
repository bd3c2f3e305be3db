"""Byte sizes as people write them ("16GiB", "1.5 GB", 17179869184) and back, and byte alignment."""

from __future__ import annotations

import math
import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?|infinity|inf|nan)\s*([a-z]*)\s*$", re.IGNORECASE)
# No machine has a pebibyte of memory: a larger budget is a typo, or infinity standing in for "no limit"
# (which would only move the failure into the planner's arithmetic).
MAX_BYTES = 2**50
_EXAMPLES = "write bytes or e.g. '16GiB', '24GB', '512MiB'"


def parse_bytes(size: int | float | str, what: str = "size") -> int:
    """``16GiB`` -> 17179869184. GB/MB are powers of ten, GiB/MiB powers of two; a bare number is bytes.
    Infinite, NaN, non-positive and over-1-PiB sizes are refused with ``what`` named."""
    if isinstance(size, bool):
        raise ValueError(f"{what} {size!r} is not a size: {_EXAMPLES}")
    if isinstance(size, int):
        value = size  # exact: a huge int would overflow a float
    elif isinstance(size, float):
        value = size
    else:
        match = _SIZE.match(str(size))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise ValueError(f"{what} {size!r} is not a size: {_EXAMPLES}")
        value = float(match.group(1)) * _UNITS[unit]
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what} {size!r} is not finite: give the real budget ({_EXAMPLES})")
    if not value > 0:
        raise ValueError(f"{what} must be positive, got {size!r}")
    if value > MAX_BYTES:
        raise ValueError(f"{what} {size!r} is more than 1 PiB, more memory than any machine has: give the real "
                         f"budget ({_EXAMPLES})")
    return int(value)


def format_bytes(nbytes: float) -> str:
    """Binary units, three significant digits: 1.5 GiB, 640 MiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def align_up(nbytes: int, alignment: int) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``."""
    return -(-nbytes // alignment) * alignment


__all__ = ["MAX_BYTES", "align_up", "format_bytes", "parse_bytes"]
