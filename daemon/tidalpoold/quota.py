"""How the device pool is shared among elastic sessions: one pure function, `share`.

An elastic session asks for a floor and a ceiling (`most`). Its floor is guaranteed: the
daemon admits a session only while every floor fits in the pool together, and a newcomer's
floor is met by taking borrowed chunks back. The chunks no floor holds (`spare`) are lent, as
the sessions need them, in proportion to their floors:

    pool 16 chunks      floors a=4  b=2  c=2   spare = 16 - 8 = 8
    needs               a=12 b=3  c=8
    round 1: 8 by floor 4:2:2      a +4 (->8)   b +1 (->3, its need: out)   c +2 (->4)
    round 2: 1 left, a:c = 4:2     a +0         c +0   (shares round down to nothing)
    the rest, a chunk each, larger floor first  a +1 (->9)
    quotas              a=9  b=3  c=4   (sum 16)

No session is starved: each keeps its floor whatever the others need, and a session needing
more than its floor gets a share of the spare in proportion to its floor while any is left.
A session's need is the most its job would map, in chunks (`Registry` takes it from the
session's live bytes at their peak, once it has run a whole iteration, and its ceiling until
then), never under its floor nor over its ceiling. Chunks nobody needs stay free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Claim:
    """One session's claim on the pool, in chunks: `floor` <= `need` <= `most`."""

    key: str
    floor: int
    most: int
    need: int

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.need <= self.most:
            raise ValueError(
                f"claim {self.key}: floor {self.floor}, need {self.need} and ceiling {self.most}"
                " must be positive and in that order"
            )


def share(pool: int, claims: Sequence[Claim]) -> dict[str, int]:
    """Each claim's quota (chunks it may hold) of a pool of `pool` chunks: its floor, plus the
    spare lent in proportion to floors up to its need (see the module's text). ValueError when
    the floors do not fit in the pool. Deterministic: the same claims give the same quotas."""
    floors = sum(c.floor for c in claims)
    if floors > pool:
        raise ValueError(f"floors of {floors} chunks do not fit in a pool of {pool}")
    quota = {c.key: c.floor for c in claims}
    spare = pool - floors
    wanting = [c for c in claims if c.need > c.floor]
    while spare and wanting:
        weight = sum(c.floor for c in wanting)
        given = 0
        for c in wanting:
            more = min(c.need - quota[c.key], spare * c.floor // weight)
            quota[c.key] += more
            given += more
        spare -= given
        wanting = [c for c in wanting if quota[c.key] < c.need]
        if given == 0:  # every share rounds down to nothing: a chunk each, larger floor first
            for c in sorted(wanting, key=lambda c: (-c.floor, c.key))[:spare]:
                quota[c.key] += 1
                spare -= 1
            wanting = [c for c in wanting if quota[c.key] < c.need]
    return quota
