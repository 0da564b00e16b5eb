"""What both backends' copy-bandwidth probes share: the span, the volume, the arithmetic.

A backend probes host → device and device → host copies at start and reports them as the facts
`h2d_gbps` and `d2h_gbps`; the plan worker plans unthrottled sessions' swaps at the slower one
(`plan_worker.copy_gbps_of`). 0.0 in both means "not measured" (a probe skipped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_MiB = 1024 * 1024
PROBE_BYTES = 64 * _MiB  # the span one probe copy moves
PROBE_TOTAL = 512 * _MiB  # bytes timed in each direction (the span copied repeatedly)


@dataclass(frozen=True, slots=True)
class Bandwidth:
    """Measured copy bandwidths between host memory and the device; 0.0: not measured."""

    h2d_gbps: float
    d2h_gbps: float
    bytes_each_way: int


NOT_MEASURED = Bandwidth(0.0, 0.0, 0)


def gbps(nbytes: int, elapsed_ms: float) -> float:
    """Bandwidth in GB/s (1e9 bytes a second) of `nbytes` moved in `elapsed_ms`."""
    if not elapsed_ms > 0:
        raise ValueError(f"a copy of {nbytes} bytes took {elapsed_ms} ms")
    return nbytes / (elapsed_ms / 1e3) / 1e9


def repeats_for(span: int, total: int, least: int = 1) -> int:
    """How many copies of `span` bytes move at least `total` bytes (and at least `least`)."""
    if span <= 0:
        raise ValueError(f"probe span of {span} bytes")
    return max(least, math.ceil(total / span))


def significant(value: float, digits: int = 2) -> float:
    """`value` rounded to `digits` significant figures (8.537 → 8.5, 12.34 → 12.0)."""
    if not math.isfinite(value) or value == 0:
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))
