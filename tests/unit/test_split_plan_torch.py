"""`tidalpool.torch.plan_split`: the ops over a limit found in a recorded step, split in the
model (the head and cross-entropy fused in parts, convolutions in micro-batches), the step
recorded again under the limit, and training of the split model equal to the model's."""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tidalclient.torch.microbatch import BatchSplit, LinearCrossEntropy  # noqa: E402
from tidalpool.torch import SplitError, plan_split  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from .docs_examples import run_example  # noqa: E402

nn = torch.nn
MiB = 1 << 20
LOOP = {"set_to_none": True, "keep_output": False}
VOCAB, WIDTH, SEQ, BATCH = 4096, 32, 64, 8
ROWS = SEQ * BATCH
LOGITS = ROWS * VOCAB * 4  # 8 MiB of fp32 logits


class Tiny(nn.Module):
    """An embedding, one causal encoder layer and a head tied to the embedding: the logits
    (8 MiB) dwarf everything else (the weights are 0.5 MiB)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.block = nn.TransformerEncoderLayer(WIDTH, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx: Any) -> Any:
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        return self.head(self.block(self.tokens(idx), src_mask=mask, is_causal=True)).flatten(0, 1)


def sgd(m: Any) -> Any:
    return torch.optim.SGD(m.parameters(), lr=0.1)


def batch() -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(5)
    return (
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        torch.randint(0, VOCAB, (ROWS,), generator=g),
    )


def test_the_cross_entropy_is_split_until_every_op_fits() -> None:
    torch.manual_seed(0)
    model = Tiny()
    twin = copy.deepcopy(model)
    limit = 12 * MiB
    split = plan_split(model, batch(), F.cross_entropy, sgd, limit=limit, head="head", **LOOP)
    # Log-softmax's backward reads its output and gradient and writes the logits' gradient.
    assert split.bound_before == 3 * LOGITS
    over = {op.name for op in split.big}
    assert "aten._log_softmax_backward_data.default" in over
    # 24 MiB over what the limit leaves beside the weights (0.55 MiB): three parts.
    assert split.parts == {"cross_entropy": 3}
    # Predicted from the first trace: the loss's ops in thirds (the head's products too).
    assert split.bound_predicted == 8 * MiB
    assert isinstance(model.head, nn.Identity)
    assert isinstance(split.loss_fn, LinearCrossEntropy)
    # Recorded again: no op near the limit, and the logits were never whole.
    assert split.bound_after <= LOGITS // 3 + MiB
    assert split.peak_after < split.peak_before - 2 * LOGITS
    assert not split.unsplit

    x, y = batch()
    got = split.loss_fn(model(x), y)
    want = F.cross_entropy(twin(x), y)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    got.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_op_wise_budget_leaves_the_weights_out() -> None:
    split = plan_split(
        Tiny(),
        batch(),
        F.cross_entropy,
        sgd,
        limit=12 * MiB,
        head="head",
        keep_persistent=False,
        **LOOP,
    )
    assert split.parts == {"cross_entropy": 2}  # 24 MiB over 12 MiB, nothing fixed
    assert split.bound_predicted == 12 * MiB


def test_a_limit_above_every_op_changes_nothing() -> None:
    model = Tiny()
    split = plan_split(model, batch(), F.cross_entropy, sgd, limit=64 * MiB, head="head", **LOOP)
    assert split.big == () and split.parts == {}
    assert split.loss_fn is F.cross_entropy
    assert isinstance(model.head, nn.Linear)
    assert split.bound_after == split.bound_before


def test_a_cross_entropy_to_split_needs_its_head_and_a_known_loss() -> None:
    with pytest.raises(SplitError, match="pass head="):
        plan_split(Tiny(), batch(), F.cross_entropy, sgd, limit=12 * MiB, **LOOP)
    with pytest.raises(SplitError, match="no submodule 'lm_head'"):
        plan_split(Tiny(), batch(), F.cross_entropy, sgd, limit=12 * MiB, head="lm_head", **LOOP)
    with pytest.raises(SplitError, match=r"not an nn\.Linear"):
        plan_split(Tiny(), batch(), F.cross_entropy, sgd, limit=12 * MiB, head="block", **LOOP)

    def smoothed(out: Any, target: Any) -> Any:
        return F.cross_entropy(out, target, label_smoothing=0.1)

    with pytest.raises(SplitError, match=r"only torch\.nn\.functional\.cross_entropy"):
        plan_split(Tiny(), batch(), smoothed, sgd, limit=12 * MiB, head="head", **LOOP)
    with pytest.raises(ValueError, match="limit must be positive"):
        plan_split(Tiny(), batch(), F.cross_entropy, sgd, limit=0, head="head", **LOOP)


class Convs(nn.Module):
    """A wide convolution: its output is 16 MiB at batch 32."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Conv2d(3, 32, 3, padding=1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: Any) -> Any:
        return self.fc(self.wide(x).mean((2, 3)))


def test_a_convolution_over_the_limit_is_reported_not_split() -> None:
    model = Convs()
    g = torch.Generator().manual_seed(2)
    example = (torch.randn(32, 3, 64, 64, generator=g), torch.randint(0, 10, (32,), generator=g))
    split = plan_split(model, example, F.cross_entropy, sgd, limit=16 * MiB, **LOOP)
    convolutions = [op for op in split.unsplit if op.kind == "convolution"]
    assert convolutions and all("workspace" in op.why for op in convolutions)
    assert split.parts == {} and split.loss_fn is F.cross_entropy
    assert type(model.wide) is nn.Conv2d
    assert split.bound_after == split.bound_before > 16 * MiB


def test_the_docs_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    namespace = run_example("torch.md", "plan_split(")
    split, model = namespace["split"], namespace["model"]
    # 16 x 128 rows of 4096 fp32 logits are 32 MiB; log-softmax's backward touches three.
    assert split.bound_before == 96 * MiB and split.parts == {"cross_entropy": 2}
    assert split.bound_after < 64 * MiB and isinstance(model.head, nn.Identity)
    assert model.tokens.weight.grad is not None and split.loss_fn.head.weight.grad is not None
    assert capsys.readouterr().out.split() == [
        "{'cross_entropy':",
        "2}",
        "96",
        str(split.bound_after >> 20),
    ]


class Wide(nn.Module):
    """A causal encoder layer whose MLP is wide (8 MiB of hidden at batch 8): its GELU's
    backward touches 24 MiB; the vocabulary is small, so the loss is not the problem."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(64, WIDTH)
        self.block = nn.TransformerEncoderLayer(
            WIDTH, 4, 4096, dropout=0.0, activation="gelu", batch_first=True
        )
        self.head = nn.Linear(WIDTH, 64)

    def forward(self, idx: Any) -> Any:
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        return self.head(self.block(self.tokens(idx), src_mask=mask, is_causal=True)).flatten(0, 1)


def test_blocks_independent_per_sample_run_in_parts_until_their_ops_fit() -> None:
    torch.manual_seed(3)
    model = Wide()
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    example = (
        torch.randint(0, 64, (BATCH, SEQ), generator=g),
        torch.randint(0, 64, (ROWS,), generator=g),
    )
    hidden = ROWS * 4096 * 4  # 8 MiB
    limit = 16 * MiB
    split = plan_split(
        model, example, F.cross_entropy, sgd, limit=limit, blocks=[model.block], **LOOP
    )
    assert split.bound_before >= 3 * hidden and split.parts == {}
    assert split.block_parts >= 2 and isinstance(model.block, BatchSplit)
    assert split.blocks == (model.block,)
    assert split.bound_after <= limit < split.bound_before
    x, y = example
    got, want = F.cross_entropy(model(x), y), F.cross_entropy(twin(x), y)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_blocks_must_be_the_models_own() -> None:
    with pytest.raises(SplitError, match="blocks must be submodules of the model"):
        plan_split(Wide(), batch(), F.cross_entropy, sgd, limit=MiB, blocks=[nn.ReLU()], **LOOP)
