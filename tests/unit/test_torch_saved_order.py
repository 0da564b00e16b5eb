"""`SaveOrder`: saves numbered by their order in the iteration, prefetch guesses from the last."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from tidalpool.torch import SaveOrder


def test_ids_restart_at_each_iteration() -> None:
    order = SaveOrder(lookahead=2)
    assert [order.save() for _ in range(3)] == [0, 1, 2]
    order.step()
    assert [order.save() for _ in range(2)] == [0, 1]


def test_before_an_iteration_is_seen_backward_is_guessed_to_go_in_reverse() -> None:
    order = SaveOrder(lookahead=2)
    for _ in range(4):
        order.save()
    assert order.use(3) == [2, 1]
    assert order.use(1) == [0]  # nothing below 0
    assert order.use(0) == []


def test_the_previous_iterations_use_order_predicts_the_next_uses() -> None:
    order = SaveOrder(lookahead=2)
    for ident in (3, 4, 5, 3, 2, 2, 1, 1, 0):  # a loss's saves first, repeats as backward goes
        order.use(ident)
    order.step()
    assert order.previous == [3, 4, 5, 3, 2, 2, 1, 1, 0]
    assert order.use(3) == [4, 5]  # what followed its first use
    assert order.use(2) == [2, 1]
    assert order.use(0) == []  # the last one
    assert order.use(9) == []  # not used last time: no guess
    order.step()
    assert order.previous == [3, 2, 0, 9]


def test_no_lookahead_prefetches_nothing_and_negative_is_refused() -> None:
    order = SaveOrder(lookahead=0)
    order.save()
    assert order.use(0) == []
    with pytest.raises(ValueError, match="lookahead must not be negative, got -1"):
        SaveOrder(lookahead=-1)
