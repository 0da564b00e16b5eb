"""combined.split: a swapped block's pieces, the one a persistent block keeps across the
iteration's boundary, and which piece each swap-in and each malloc starts."""

from __future__ import annotations

from tidalcore.units import Tick
from tidalplan.combined import combine, split
from tidalplan.learn import to_problem
from tidalplan.model import Swap, SwapPlan
from tidalplan.simulate import simulate
from tidalplan.validate import validate

from .iterations import build

# W (persistent, 2000 B) is read at t1 and t9; Z lives over [6, 8) while W is idle. At 1 GB/s
# W's copy out (2000 ns after f1 ends at 1000) is seen done at t5; W's copy in, issued when f4
# begins, starts then (after t8).
#   t0 a X   t1 f1 W>X   t2 f X   t3 a Y   t4 f2 3000 >Y   t5 op   t6 a Z   t7 f3 >Z   t8 f Z
#   t9 f4 W Y   t10 f Y
NET = build(
    [
        "a X 1000",
        "o f1 1000 W >X",
        "f X",
        "a Y 1000",
        "o f2 3000 >Y",
        "o g 10",
        "a Z 2000",
        "o f3 1000 >Z",
        "f Z",
        "o f4 1000 W Y",
        "f Y",
    ],
    {"W": 2000},
)
OUT_IN = Swap(block=0, out_after=Tick(1), in_before=Tick(9), in_at=Tick(9), persistent=True)
ACROSS = Swap(block=0, out_after=Tick(9), in_before=Tick(1), persistent=True)


def test_a_persistent_block_resident_across_the_boundary_is_one_crossing_piece() -> None:
    schedule = SwapPlan((OUT_IN,))
    r = simulate(NET, schedule, None, 1.0, 1.0)
    assert r.swap_ticks == ((5, 9),)
    parts = split(NET, schedule, r)
    w = [b for b in parts.pieces.blocks if parts.origin[b.id] == ("persistent", 0)]
    # One piece from the tick before its swap-in started to its release in the next iteration:
    # its bytes never move across the boundary.
    assert [(b.id, b.size, b.start, b.end, b.crosses) for b in w] == [(5, 2000, 8, 16, True)]
    assert parts.in_pieces == (5,)
    assert parts.pieces.persistent == ()  # W is placed, not resident
    done = combine(NET, schedule, r, alignment=1)
    problem, index = to_problem(done.pieces, 1)
    validate(problem, done.placement)
    where = {
        done.pieces.blocks[k].id: o for k, o in zip(index, done.placement.offsets, strict=True)
    }
    # Z (trace id 4) lives while W is away: they share bytes. X, Y and W or Z: 4000 bytes.
    assert where[5] == where[4] and done.footprint == 4000
    assert done.in_pieces == (5,) and done.first_pieces == {0: 2, 1: 3, 2: 4}


def test_a_persistent_block_swapped_twice_has_a_piece_per_swap_in_the_last_crossing() -> None:
    # W is read by f1, f3 and f5; each copy out ends while g1 or g2 runs, each copy in starts
    # when f3 or f5 begins. Z and V take W's bytes while it is away.
    it = build(
        [
            "o f1 1000 W",  # t0
            "o g1 3000",  # t1
            "a Z 2000",  # t2
            "o f2 1000 >Z",  # t3
            "f Z",  # t4
            "o f3 1000 W",  # t5
            "o g2 3000",  # t6
            "a V 2000",  # t7
            "o f4 1000 >V",  # t8
            "f V",  # t9
            "o f5 1000 W",  # t10
        ],
        {"W": 2000},
    )
    schedule = SwapPlan(
        (
            Swap(block=0, out_after=Tick(0), in_before=Tick(5), in_at=Tick(5), persistent=True),
            Swap(block=0, out_after=Tick(5), in_before=Tick(10), in_at=Tick(10), persistent=True),
        )
    )
    r = simulate(it, schedule, None, 1.0, 1.0)
    assert r.swap_ticks == ((2, 5), (7, 10))
    done = combine(it, schedule, r, alignment=1)
    w = [b for b in done.pieces.blocks if done.origin[b.id] == ("persistent", 0)]
    assert [(b.id, b.start, b.end, b.crosses) for b in w] == [(4, 4, 7, False), (5, 9, 13, True)]
    assert done.in_pieces == (4, 5) and done.first_pieces == {0: 2, 1: 3}
    assert done.placement.offsets == (0, 0, 0, 0) and done.footprint == 2000


def test_a_persistent_block_away_across_the_boundary_has_one_piece_within_the_iteration() -> None:
    schedule = SwapPlan((ACROSS,))
    r = simulate(NET, schedule, None, 1.0, 1.0)
    assert r.swap_ticks == ((11, 0),)  # seen gone after the last tick; back from t0
    parts = split(NET, schedule, r)
    w = [b for b in parts.pieces.blocks if parts.origin[b.id] == ("persistent", 0)]
    assert [(b.start, b.end, b.crosses) for b in w] == [(0, 11, False)]
    assert parts.in_pieces == (w[0].id,)


def test_each_swap_in_starts_a_piece_and_each_malloc_the_first() -> None:
    # Y (allocation 1) out after f2, back for f4, issued at f3; W as above. Y's copy out
    # ends, and its copy in starts, while f3 runs: seen at t8.
    y = Swap(block=1, out_after=Tick(4), in_before=Tick(9), in_at=Tick(7))
    schedule = SwapPlan((y, OUT_IN))
    r = simulate(NET, schedule, None, 1.0, 1.0)
    assert r.swap_ticks == ((8, 8), (5, 9))
    parts = split(NET, schedule, r)
    pieces = {b.id: (b.size, b.start, b.end, b.crosses) for b in parts.pieces.blocks}
    assert pieces == {
        2: (1000, 0, 2, False),  # X, never away: itself
        5: (1000, 3, 8, False),  # Y's first piece, until its copy out is seen done
        6: (1000, 7, 10, False),  # Y again, from the tick before its swap-in started
        4: (2000, 6, 8, False),  # Z
        7: (2000, 8, 16, True),  # W, across the boundary
    }
    assert parts.in_pieces == (6, 7)
    assert parts.first_pieces == {0: 2, 1: 5, 2: 4}
    assert parts.origin == {
        2: ("block", 0),
        5: ("block", 1),
        6: ("block", 1),
        4: ("block", 2),
        7: ("persistent", 0),
    }
    done = combine(NET, schedule, r)
    assert (done.in_pieces, done.first_pieces) == (parts.in_pieces, parts.first_pieces)
