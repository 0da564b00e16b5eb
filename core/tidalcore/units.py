"""Named units and human-readable sizes.

`Bytes`, `Offset`, `BlockId` and `Tick` are plain ints to the interpreter and
distinct types to mypy, so a size is never passed where an offset is meant.

Sizes follow the convention of memory tools (docker's `-m 4g`, Java's `-Xmx4g`,
Kubernetes' `4Gi`), in any case:

    4GiB, 4Gi, 4g   4 × 1024³ bytes  (KiB/Ki/k, MiB/Mi/m, GiB/Gi/g, TiB/Ti/t: powers of 1024)
    4GB             4 × 1000³ bytes  (kB, MB, GB, TB: powers of 1000, the two-letter units)
    4096, 4096B     bytes
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

_PREFIXES = ("k", "m", "g", "t")
_BINARY = {
    spelling.format(p): 1024 ** (n + 1)
    for n, p in enumerate(_PREFIXES)
    for spelling in ("{}", "{}i", "{}ib")
}
_DECIMAL = {f"{p}b": 1000 ** (n + 1) for n, p in enumerate(_PREFIXES)}
_UNITS = {"": 1, "b": 1, **_BINARY, **_DECIMAL}  # keys in lower case: any case is accepted

UNITS_ACCEPTED = (
    "B; k, m, g, t, Ki, Mi, Gi, Ti, KiB, MiB, GiB, TiB (powers of 1024);"
    " kB, MB, GB, TB (powers of 1000); any case"
)
"""Every unit `parse_size` accepts, as its error message and the commands' help list them."""

SIZE_HELP = "4g = 4GiB = 4×1024³ bytes, 4GB = 4×10⁹ bytes"
"""The rule in a few words, for the help of a command's size option."""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> Bytes:
    """Parse "4GiB", "4g", "512 MB" or "1048576" into bytes (the rule: the module's docstring).

    Binary units (KiB, MiB, GiB, TiB, their short forms Ki ... Ti and the bare
    letters k, m, g, t) are powers of 1024, decimal ones (kB, MB, GB, TB) powers
    of 1000, so that `4g` means what it means to docker and Java.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return Bytes(text)
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 4GiB, 4g, 512MB, 1048576)")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r} (accepted: {UNITS_ACCEPTED})")
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
