"""Named units and human-readable sizes.

`Bytes`, `Offset`, `BlockId` and `Tick` are plain ints to the interpreter and
distinct types to mypy, so a size is never passed where an offset is meant.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import NewType

Bytes = NewType("Bytes", int)
Offset = NewType("Offset", int)
BlockId = NewType("BlockId", int)
Tick = NewType("Tick", int)

ALIGNMENT = Bytes(256)

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> Bytes:
    """Parse "4GiB", "512 MB", "1.5g" or "1048576" into bytes.

    Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones
    (kB, MB, GB, TB, and the bare letters) powers of 1000.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return Bytes(text)
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 4GiB, 512MB, 1048576)")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(
            f"unknown size unit {unit!r} in {text!r} (use B, kB, MB, GB, KiB, MiB, GiB)"
        )
    value = Fraction(number) * factor  # exact: 4.1MB is 4100000 bytes, not 4099999.99...
    if value.denominator != 1:
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return Bytes(int(value))


def format_size(nbytes: int) -> str:
    """Format bytes with a binary unit: 1536 -> "1.5 KiB", 4294967296 -> "4 GiB"."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(round(value, 1)) < 1024 or unit == "TiB":  # 1048575 B is "1 MiB", not "1024 KiB"
            text = f"{value:.1f}".rstrip("0").rstrip(".") if unit != "B" else str(int(value))
            return f"{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def align_up(n: int, alignment: int) -> int:
    """The smallest multiple of `alignment` that is >= n (alignment a power of two)."""
    return (n + alignment - 1) & ~(alignment - 1)
