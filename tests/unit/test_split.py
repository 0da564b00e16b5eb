"""Ops too big for their step (`tidalplan.split`): which are found, how many parts each needs,
and the op-wise bound after the split, on hand-built iterations with known answers."""

from __future__ import annotations

import pytest
from tidalplan.autoswap import op_bound
from tidalplan.split import big_ops, keeping_persistent, kind_of, parts_by_kind, split_bound

from .iterations import build

# A convolution reading its input X (600) and weight W (100, persistent), writing Y (600);
# a loss: log-softmax of Y into P (600), nll of P into L (10); backward: nll into GP (600),
# log-softmax's backward into GY (600); an optimizer op reading W and a big state S (900,
# persistent) that no division helps.
STEPS = [
    "a X 600",  # 0
    "a Y 600",  # 1
    "o aten.convolution.default 10 X W >Y",  # 2  touches 1300, 100 fixed
    "a P 600",  # 3
    "o aten._log_softmax.default 10 Y >P",  # 4  1200
    "a L 10",  # 5
    "o aten.nll_loss_forward.default 10 P >L",  # 6  610
    "a GP 600",  # 7
    "o aten.nll_loss_backward.default 10 L P >GP",  # 8  1210
    "a GY 600",  # 9
    "o aten._log_softmax_backward_data.default 10 GP P >GY",  # 10  1800
    "f P",  # 11
    "f GP",  # 12
    "o aten.relu.default 10 GY X",  # 13  1200, not separable here
    "o aten._foreach_add_.List 10 W S",  # 14  1000 = 100 + 900, all fixed
    "f L",  # 15
    "f GY",  # 16
    "f Y",  # 17
    "f X",  # 18
]
IT = build(STEPS, persistent={"W": 100, "S": 900})


def test_kinds_by_aten_name() -> None:
    assert kind_of("aten.convolution_backward.default") == "convolution"
    assert kind_of("aten.nll_loss_backward.default") == "cross_entropy"
    assert kind_of("aten._scaled_dot_product_efficient_attention.default") == "attention"
    assert kind_of("_log_softmax") == "cross_entropy"
    # Batch normalisation's statistics span the batch; elementwise ops are not claimed.
    assert kind_of("aten.native_batch_norm.default") is None
    assert kind_of("aten.relu.default") is None
    assert kind_of("") is None


def test_ops_over_the_limit_and_their_parts() -> None:
    assert op_bound(IT) == 1800
    found = {op.tick: op for op in big_ops(IT, 700)}
    assert sorted(found) == [2, 4, 8, 10, 13, 14]
    assert found[4].parts == 2  # 1200 / 2 = 600
    assert found[8].parts == 2  # 1210 / 2 = 605
    assert found[10].parts == 3  # 1800 / 3 = 600
    assert found[10].split_touched == 600
    # A convolution in parts keeps its whole input and output blocks: reported, not split.
    conv = found[2]
    assert (conv.kind, conv.touched, conv.fixed, conv.budget) == ("convolution", 1300, 100, 700)
    assert conv.parts is None and "workspace" in conv.why
    assert conv.split_touched == 1300
    # Not separable by name, and all fixed: reported, never split.
    assert found[13].kind is None and found[13].parts is None
    assert found[13].why == "not known to be independent per sample"
    assert found[14].fixed == 1000 and found[14].parts is None
    assert parts_by_kind(tuple(found.values())) == {"cross_entropy": 3}


def test_persistent_bytes_over_the_budget_leave_a_separable_op_unsplit() -> None:
    it = build(["a Q 50", "o aten._flash_attention_forward.default 10 Q S >Q", "f Q"], {"S": 400})
    (op,) = big_ops(it, 300)
    assert op.kind == "attention" and op.fixed == 400 and op.parts is None
    assert op.why == "its persistent blocks alone (400 bytes) are over the budget (300)"
    (op,) = big_ops(it, 425)
    assert op.parts == 2  # 400 + 50/2


def test_free_bytes_per_step_tighten_the_budget() -> None:
    # With 1300 free everywhere only the log-softmax backward is over; with 500 free at the
    # nll backward (1210 bytes) it needs 3 parts.
    assert [op.tick for op in big_ops(IT, 1300)] == [10]
    nll = next(op for op in big_ops(IT, 1300, free={8: 500}) if op.tick == 8)
    assert nll.budget == 500 and nll.parts == 3


def test_the_bound_after_the_split() -> None:
    parts = parts_by_kind(big_ops(IT, 1300))
    assert parts == {"cross_entropy": 2}
    # The log-softmax backward goes to 900; the convolution (1300) and relu (1200) stay.
    assert split_bound(IT, parts) == 1300
    # Convolutions are never counted as split.
    assert split_bound(IT, {"cross_entropy": 3, "convolution": 4}) == 1300
    assert split_bound(IT, {}) == op_bound(IT)


def test_a_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="limit must be positive"):
        big_ops(IT, 0)


def test_keeping_the_persistent_blocks_leaves_the_rest_of_the_limit() -> None:
    free = keeping_persistent(IT, 1300)
    # W (100) and S (900) are persistent: an op that touches neither has 300 bytes.
    assert free[4] == 300 and free[2] == 400 and free[14] == 1300
    found = {op.tick: op for op in big_ops(IT, 1300, free)}
    assert found[4].parts == 4  # 1200 / 300
    assert 14 not in found  # the optimizer touches only persistent blocks: 1000 of 1300


def test_a_split_cross_entropy_takes_its_head_with_it() -> None:
    # H (persistent weight 50) times X (100) makes the logits Z (1000); the loss reads Z; in
    # backward the logits' gradient GZ (1000) goes through a product with H again.
    it = build(
        [
            "a X 100",
            "a Z 1000",
            "o aten.mm.default 10 X H >Z",  # 1150
            "a P 1000",
            "o aten._log_softmax.default 10 Z >P",  # 2000
            "a GZ 1000",
            "o aten._log_softmax_backward_data.default 10 P >GZ",  # 2000
            "f P",
            "a GX 100",
            "o aten.mm.default 10 GZ H >GX",  # 1150
            "o aten.relu.default 10 X",  # 100, not next to the loss
            "f GZ",
            "f GX",
            "f Z",
            "f X",
        ],
        {"H": 50},
    )
    assert split_bound(it, {}) == 2000
    # In 4 parts: the loss's ops 500; the products 50 + ⌈1100/4⌉ = 325 and 50 + 275 = 325.
    assert split_bound(it, {"cross_entropy": 4}) == 500
    assert split_bound(it, {"cross_entropy": 40}) == 100  # the relu, never split, is left
