"""Cost-aware recomputation (SuperNeurons 3.4): which segments of the forward to recompute.

A segment is a stretch of the forward (a block of the model) that can run again in backward
from its input. Recomputing it drops what autograd saved inside it at the end of its forward
and rebuilds it, once, when backward reaches the segment: `freed` bytes leave the device for
that stretch of the step, and the step computes `recompute_ns` more.

SuperNeurons frees the results of cheap-to-compute layers and keeps the expensive ones'. Here
each segment's cost and bytes are measured, so the choice is by cost per byte: `order` ranks
the segments that free anything by `recompute_ns / freed`, cheapest first, and of equal ones
(a transformer's identical layers) the latest in the forward first: what an early segment saves
waits longest for backward, the easiest to hide a copy behind. Whatever the chosen
segments do not free must be swapped; copies hidden behind compute cost nothing and
recomputation always costs its compute, so the best number of segments lies between none and
enough to bring the peak under the limit by themselves. `prefixes` lists those candidates; the
caller records each one's real trace (the recomputation's allocations in backward included),
simulates the swap schedule for what remains, and keeps the shortest step (`best`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True, slots=True)
class Segment:
    """A part of the forward that can be recomputed in backward."""

    name: str
    recompute_ns: int  # its forward's compute, run again in backward
    freed: int  # bytes autograd saves inside it (its input and outputs not counted)
    start_ns: int = 0  # the forward's compute before the segment first runs: its place in it

    def __post_init__(self) -> None:
        if self.recompute_ns < 0 or self.freed < 0 or self.start_ns < 0:
            raise ValueError(
                f"segment {self.name!r}: recompute_ns, freed and start_ns must not be negative,"
                f" got {self.recompute_ns}, {self.freed} and {self.start_ns}"
            )


def order(segments: Sequence[Segment]) -> list[int]:
    """Indices of the segments that free bytes, by recompute ns per freed byte, cheapest first
    (ties, exact: the latest `start_ns` first, then in the order given)."""
    useful = [i for i, s in enumerate(segments) if s.freed > 0]
    return sorted(
        useful,
        key=lambda i: (
            Fraction(segments[i].recompute_ns, segments[i].freed),
            -segments[i].start_ns,
            i,
        ),
    )


def prefixes(segments: Sequence[Segment], ranked: Sequence[int], excess: int) -> list[int]:
    """How many of `ranked` to try recomputing when the peak is `excess` bytes over the limit:
    0, 1, ... up to the first count whose freed bytes cover the excess, and one more (the
    estimate ignores the bytes a segment's recomputation holds while backward runs it), at
    most every ranked segment. [0] when nothing is over."""
    if excess <= 0:
        return [0]
    freed = 0
    for k, i in enumerate(ranked, start=1):
        freed += segments[i].freed
        if freed >= excess:
            return list(range(min(k + 1, len(ranked)) + 1))
    return list(range(len(ranked) + 1))


@dataclass(frozen=True, slots=True)
class Candidate:
    """One evaluated choice: recompute `chosen` (segment indices) and swap the rest."""

    chosen: tuple[int, ...]
    compute_ns: int  # the step's compute with these segments recomputed
    peak_bytes: int  # the step's peak with these segments recomputed, before any swap
    step_ns: int | None  # the simulated step under the limit; None: infeasible
    footprint: int | None = None  # bytes its placement needs, where it was placed


def best(candidates: Sequence[Candidate]) -> Candidate | None:
    """The feasible candidate with the shortest step (ties: the one recomputing fewer
    segments); None when none is feasible."""
    feasible = [c for c in candidates if c.step_ns is not None]
    if not feasible:
        return None
    return min(feasible, key=lambda c: (c.step_ns, len(c.chosen)))
