"""The cost-aware choice of segments to recompute: ranked by cost per freed byte, candidate
counts up to what covers the excess, the shortest feasible step."""

from __future__ import annotations

import pytest
from tidalplan.recompute import Candidate, Segment, best, order, prefixes


def test_segments_are_ranked_by_cost_per_freed_byte_and_useless_ones_left_out() -> None:
    segments = [
        Segment("a", 300, 100),  # 3 ns per byte
        Segment("b", 100, 100),  # 1
        Segment("c", 50, 0),  # frees nothing
        Segment("d", 200, 200),  # 1, after b
        Segment("e", 0, 10),  # free to recompute
    ]
    assert order(segments) == [4, 1, 3, 0]


def test_of_equal_segments_the_latest_in_the_forward_is_recomputed_first() -> None:
    # Identical layers: what the late ones save has the least time to be copied out and back.
    layers = [Segment(f"layer{k}", 300, 100, start_ns=1000 * k) for k in range(4)]
    assert order(layers) == [3, 2, 1, 0]
    # Cost per byte still comes first; ratios are compared exactly (1/3 = 2/6).
    mixed = [Segment("a", 1, 3, 0), Segment("b", 2, 6, 50), Segment("c", 1, 2, 99)]
    assert order(mixed) == [1, 0, 2]
    # Equal places as well: in the order given.
    assert order([Segment("x", 1, 1), Segment("y", 1, 1)]) == [0, 1]


def test_prefixes_go_one_past_the_count_that_covers_the_excess() -> None:
    segments = [Segment(str(i), 1, 100) for i in range(5)]
    ranked = [0, 1, 2, 3, 4]
    assert prefixes(segments, ranked, 0) == [0]
    assert prefixes(segments, ranked, -5) == [0]
    assert prefixes(segments, ranked, 150) == [0, 1, 2, 3]  # 2 cover it, one more
    assert prefixes(segments, ranked, 500) == [0, 1, 2, 3, 4, 5]  # all 5 needed: no more
    assert prefixes(segments, ranked, 10_000) == [0, 1, 2, 3, 4, 5]  # never covered
    assert prefixes(segments, [], 10) == [0]


def test_best_is_the_shortest_feasible_step_and_fewer_segments_on_a_tie() -> None:
    cs = [
        Candidate((), 100, 10, None),
        Candidate((1,), 110, 9, 150),
        Candidate((1, 2), 120, 8, 120),
        Candidate((1, 2, 0), 120, 7, 120),
    ]
    assert best(cs) == cs[2]
    assert best(cs[:1]) is None
    assert best([]) is None


def test_a_segment_with_negative_cost_or_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="segment 'x'"):
        Segment("x", -1, 0)
    with pytest.raises(ValueError, match="segment 'y'"):
        Segment("y", 0, -1)
    with pytest.raises(ValueError, match="segment 'z'"):
        Segment("z", 0, 0, start_ns=-1)
