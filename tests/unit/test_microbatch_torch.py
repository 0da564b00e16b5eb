"""`tidalclient.torch.microbatch`: ops run in micro-batches give the results and gradients of
the unsplit op, keep state_dict keys, refuse what cannot be split, and, recorded on the meta
device, lower the most bytes one op touches and the step's peak by what the shapes say."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tidalclient.torch.microbatch import (  # noqa: E402
    BatchSplit,
    LinearCrossEntropy,
    MicroBatchConv2d,
    micro_batch_convs,
    parts_of,
)
from tidalplan import learn  # noqa: E402
from tidalplan.autoswap import load, op_bound  # noqa: E402
from tidalpool.torch import record  # noqa: E402
from torch.nn import functional as F  # noqa: E402

nn = torch.nn
f64 = torch.float64

# fp64: splitting changes only the order of a few sums.
TIGHT64 = {"rtol": 1e-12, "atol": 1e-12}
# fp32 cross-entropy: logsumexp - target logit against log_softmax + nll, sums over 37-128
# rows in another order; observed differences are below 1e-6.
TIGHT32 = {"rtol": 1e-5, "atol": 2e-6}


def grads(output: Any, *tensors: Any) -> list[Any]:
    """d sum(output * fixed weights) / d each tensor (a weighted sum, so every row matters)."""
    weights = torch.linspace(-1, 1, output.numel(), dtype=output.dtype).reshape(output.shape)
    return list(torch.autograd.grad((output * weights).sum(), tensors))


def twin_inputs(shape: tuple[int, ...], dtype: Any = f64, seed: int = 0) -> tuple[Any, Any]:
    """The same random tensor twice, each a leaf that requires grad."""
    torch.manual_seed(seed)
    x = torch.randn(*shape, dtype=dtype)
    return x.clone().requires_grad_(), x.clone().requires_grad_()


# -- parts_of -------------------------------------------------------------------------------------


def test_parts_are_near_equal_and_larger_first() -> None:
    assert parts_of(10, 4) == [3, 3, 2, 2]
    assert parts_of(10, 1) == [10]
    assert parts_of(10, 10) == [1] * 10
    assert parts_of(9, 3) == [3, 3, 3]
    assert parts_of(512, 8) == [64] * 8


def test_parts_refuse_fewer_than_one_or_more_than_the_batch() -> None:
    with pytest.raises(ValueError, match="must be at least 1, got 0"):
        parts_of(10, 0)
    with pytest.raises(ValueError, match="cannot split a batch of 3 into 4 non-empty parts"):
        parts_of(3, 4)


# -- MicroBatchConv2d -----------------------------------------------------------------------------

CONVS = {
    "plain": {"in_channels": 4, "out_channels": 6, "kernel_size": 3, "padding": 1},
    "strided": {
        "in_channels": 4,
        "out_channels": 6,
        "kernel_size": (3, 2),
        "stride": 2,
        "groups": 2,
        "bias": False,
        "padding": 1,
        "padding_mode": "reflect",
    },
}


@pytest.mark.parametrize("config", sorted(CONVS))
@pytest.mark.parametrize("sizes", [1, 2, 3, 7, (5, 1, 1), (1, 6)])
def test_micro_batched_conv_equals_the_conv(config: str, sizes: Any) -> None:
    torch.manual_seed(1)
    conv = nn.Conv2d(**CONVS[config], dtype=f64)
    micro = MicroBatchConv2d(**CONVS[config], dtype=f64, sizes=sizes)
    micro.load_state_dict(conv.state_dict())
    x, x2 = twin_inputs((7, 4, 9, 8))
    want, got = conv(x), micro(x2)
    torch.testing.assert_close(got, want, **TIGHT64)
    params = [p for p in (conv.weight, conv.bias) if p is not None]
    micro_params = [p for p in (micro.weight, micro.bias) if p is not None]
    for g, w in zip(grads(got, x2, *micro_params), grads(want, x, *params), strict=True):
        torch.testing.assert_close(g, w, **TIGHT64)


def test_micro_batched_conv_has_the_convs_keys_and_shares_its_parameters() -> None:
    conv = nn.Conv2d(3, 5, 3, padding="same")
    micro = MicroBatchConv2d.from_conv(conv.eval(), [2, 2])
    assert micro.weight is conv.weight and micro.bias is conv.bias
    assert list(micro.state_dict()) == list(conv.state_dict()) == ["weight", "bias"]
    assert not micro.training
    assert micro.sizes == (2, 2)
    assert isinstance(micro, nn.Conv2d)
    assert repr(micro).endswith("padding=same, sizes=(2, 2))")
    x = torch.randn(4, 3, 6, 6)
    torch.testing.assert_close(micro(x), conv(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(micro(x[0]), conv(x[0]), rtol=0, atol=0)  # unbatched: whole


def test_micro_batch_sizes_must_sum_to_the_batch() -> None:
    micro = MicroBatchConv2d(2, 2, 1, sizes=[3, 2])
    with pytest.raises(ValueError, match=r"sizes \[3, 2\] sum to 5, but the input's batch is 6"):
        micro(torch.zeros(6, 2, 1, 1))
    with pytest.raises(ValueError, match="cannot split a batch of 2 into 3 non-empty"):
        MicroBatchConv2d(2, 2, 1, sizes=3)(torch.zeros(2, 2, 1, 1))


@pytest.mark.parametrize(
    ("sizes", "error", "message"),
    [
        (0, ValueError, "the number of parts must be at least 1, got 0"),
        ([], ValueError, "sizes is empty"),
        ([2, 0], ValueError, r"must be positive ints, got \[2, 0\]"),
        ([2, 1.5], ValueError, r"must be positive ints, got \[2, 1.5\]"),
        (2.0, TypeError, "sizes must be an int or a sequence of ints, got 2.0"),
        (True, TypeError, "sizes must be an int or a sequence of ints, got True"),
    ],
)
def test_bad_sizes_are_refused_when_made(sizes: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        MicroBatchConv2d(2, 2, 1, sizes=sizes)
    with pytest.raises(error, match=message):
        BatchSplit(nn.Linear(2, 2), sizes)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1, dtype=f64)
        self.body = nn.Sequential(nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1, dtype=f64))
        self.shared = nn.Conv2d(4, 2, 1, dtype=f64)
        self.again = self.shared  # one conv reached under two names

    def forward(self, x: Any) -> Any:
        return self.again(self.shared(self.body(self.stem(x))).repeat(1, 2, 1, 1))


def test_micro_batch_convs_replaces_the_chosen_convs_in_place() -> None:
    torch.manual_seed(2)
    model = ConvNet()
    twin = copy.deepcopy(model)
    x, x2 = twin_inputs((5, 3, 6, 6))
    want = twin(x)
    replaced = micro_batch_convs(model, {"stem": 2, model.shared: [4, 1]})
    assert replaced == ["stem", "shared", "again"]
    assert isinstance(model.stem, MicroBatchConv2d) and model.stem.sizes == 2
    assert model.shared is model.again and model.shared.sizes == (4, 1)
    assert type(model.body[1]) is nn.Conv2d
    assert list(model.state_dict()) == list(twin.state_dict())
    got = model(x2)
    torch.testing.assert_close(got, want, **TIGHT64)
    mine = list(model.parameters())
    theirs = list(twin.parameters())
    for g, w in zip(grads(got, x2, *mine), grads(want, x, *theirs), strict=True):
        torch.testing.assert_close(g, w, **TIGHT64)


def test_micro_batch_convs_takes_a_function_and_refuses_unknown_keys() -> None:
    model = ConvNet()
    replaced = micro_batch_convs(model, lambda name, conv: 5 if conv.out_channels == 4 else None)
    assert replaced == ["stem", "body.1"]
    with pytest.raises(ValueError, match=r"'body\.0' is not a nn\.Conv2d of the model"):
        micro_batch_convs(model, {"body.0": 2})
    with pytest.raises(ValueError, match=r"a Conv2d given is not a nn\.Conv2d submodule"):
        micro_batch_convs(model, {nn.Conv2d(1, 1, 1): 2})


# -- LinearCrossEntropy ---------------------------------------------------------------------------


def head_and_batch(
    rows: int, width: int = 16, vocab: int = 50, bias: bool = True, dtype: Any = torch.float32
) -> tuple[Any, Any, Any]:
    """A head, hidden rows (a leaf) and targets, every fifth one ignored (-100)."""
    torch.manual_seed(3)
    head = nn.Linear(width, vocab, bias=bias, dtype=dtype)
    hidden = torch.randn(rows, width, dtype=dtype, requires_grad=True)
    target = torch.randint(0, vocab, (rows,))
    target[::5] = -100
    return head, hidden, target


def head_grads(loss: Any, hidden: Any, head: Any) -> list[Any]:
    return list(torch.autograd.grad(loss, [hidden, *head.parameters()]))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("parts", [1, 3, 8, 37])
def test_linear_cross_entropy_equals_head_then_cross_entropy(
    reduction: str, bias: bool, parts: int
) -> None:
    head, hidden, target = head_and_batch(37, bias=bias)  # 3 parts: 13, 12, 12 rows
    want = F.cross_entropy(head(hidden), target, reduction=reduction)
    want_grads = head_grads(want, hidden, head)
    got = LinearCrossEntropy(head, parts, reduction=reduction)(hidden, target)
    assert got.dtype == torch.float32 and got.shape == ()
    torch.testing.assert_close(got, want, **TIGHT32)
    for g, w in zip(head_grads(got, hidden, head), want_grads, strict=True):
        torch.testing.assert_close(g, w, **TIGHT32)


def test_linear_cross_entropy_in_fp64_over_batch_and_time() -> None:
    head, _, _ = head_and_batch(1, dtype=f64)
    torch.manual_seed(4)
    hidden = torch.randn(3, 7, 16, dtype=f64, requires_grad=True)
    target = torch.randint(0, 50, (3, 7))
    target[1, 2:5] = 7  # a custom ignore_index
    lce = LinearCrossEntropy(head, 4, ignore_index=7)
    got = lce(hidden, target)
    want = F.cross_entropy(head(hidden).reshape(21, 50), target.reshape(21), ignore_index=7)
    torch.testing.assert_close(got, want, **TIGHT64)
    for g, w in zip(head_grads(got, hidden, head), head_grads(want, hidden, head), strict=True):
        torch.testing.assert_close(g, w, **TIGHT64)
    assert list(lce.state_dict()) == ["head.weight", "head.bias"]


def test_a_head_tied_to_an_embedding_gets_both_gradients() -> None:
    torch.manual_seed(5)
    tokens = nn.Embedding(50, 16)
    head = nn.Linear(16, 50, bias=False)
    head.weight = tokens.weight
    ids = torch.randint(0, 50, (4, 9))
    target = torch.randint(0, 50, (36,))
    target[3] = -100

    def step(loss_of: Any) -> Any:
        tokens.weight.grad = None
        loss_of(torch.tanh(tokens(ids)).reshape(36, 16)).backward()
        return tokens.weight.grad

    want = step(lambda h: F.cross_entropy(head(h), target))
    got = step(lambda h: LinearCrossEntropy(head, 5)(h, target))
    torch.testing.assert_close(got, want, **TIGHT32)
    # Both paths really feed the shared Parameter: the head's part alone differs.
    head_only = step(lambda h: LinearCrossEntropy(head, 5)(h.detach(), target))
    assert (got - head_only).abs().max() > 1e-3


def test_linear_cross_entropy_keeps_the_logsumexp_not_the_logits() -> None:
    head, hidden, target = head_and_batch(40, vocab=64)
    saved: list[tuple[int, ...]] = []

    def pack(t: Any) -> Any:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = LinearCrossEntropy(head, 4)(hidden, target)
    # hidden, weight, bias, target, each row's logsumexp, the count of rows not ignored.
    assert saved == [(40, 16), (64, 16), (64,), (40,), (40,), ()]
    loss.backward()
    assert hidden.grad is not None and hidden.grad.shape == (40, 16)


def test_linear_cross_entropy_under_autocast_upcasts_each_part() -> None:
    head, hidden, target = head_and_batch(32, width=32, vocab=96)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(head(hidden).float(), target)
        got = LinearCrossEntropy(head, 4)(hidden, target)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)  # the same bf16 logits
    g = head_grads(got, hidden, head)
    w = head_grads(want, hidden, head)
    assert [t.dtype for t in g] == [torch.float32] * 3
    for a, b in zip(g, w, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)  # bf16 products


def test_linear_cross_entropy_refuses_bad_arguments() -> None:
    head, hidden, target = head_and_batch(10)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'none'"):
        LinearCrossEntropy(head, 2, reduction="none")
    with pytest.raises(ValueError, match="parts must be an int >= 1, got 0"):
        LinearCrossEntropy(head, 0)
    with pytest.raises(TypeError, match=r"head must be a nn\.Linear, got Conv2d"):
        LinearCrossEntropy(nn.Conv2d(1, 1, 1), 2)
    lce = LinearCrossEntropy(head, 2)
    with pytest.raises(ValueError, match=r"10 rows of hidden \(10, 16\) but 9 targets \(9,\)"):
        lce(hidden, target[:9])
    with pytest.raises(
        ValueError, match=r"hidden must be \(N, 16\) or \(B, T, 16\), got \(10, 8\)"
    ):
        lce(hidden[:, :8], target)
    # More parts than rows: one row per part.
    torch.testing.assert_close(
        LinearCrossEntropy(head, 50)(hidden, target), F.cross_entropy(head(hidden), target)
    )


# -- BatchSplit -----------------------------------------------------------------------------------


def encoder_layer() -> Any:
    torch.manual_seed(6)
    return nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, dtype=f64)


def causal(t: int) -> Any:
    return nn.Transformer.generate_square_subsequent_mask(t, dtype=f64)


@pytest.mark.parametrize("parts", [1, 2, 5, (3, 2), (1, 4)])
def test_batch_split_of_an_encoder_layer_equals_the_layer(parts: Any) -> None:
    layer = encoder_layer()
    split = BatchSplit(copy.deepcopy(layer), parts)
    x, x2 = twin_inputs((5, 6, 16))
    padding = torch.zeros(5, 6, dtype=f64)
    padding[1, 4:] = float("-inf")  # (B, T): split with the batch
    want = layer(x, src_mask=causal(6), src_key_padding_mask=padding)
    got = split(x2, src_mask=causal(6), src_key_padding_mask=padding)
    torch.testing.assert_close(got, want, **TIGHT64)
    mine, theirs = list(split.parameters()), list(layer.parameters())
    assert len(mine) == len(theirs) == 12
    for g, w in zip(grads(got, x2, *mine), grads(want, x, *theirs), strict=True):
        torch.testing.assert_close(g, w, **TIGHT64)


def test_batch_split_passes_a_mask_whole_when_named_even_if_its_length_is_the_batch() -> None:
    layer = encoder_layer()
    split = BatchSplit(layer, 3, whole={"src_mask"})
    x = torch.randn(6, 6, 16, dtype=f64)
    want = layer(x, src_mask=causal(6))
    torch.testing.assert_close(split(x, src_mask=causal(6)), want, **TIGHT64)
    # Positional: a (T, T) mask whose T differs from the batch is not split.
    torch.testing.assert_close(split(x[:3], causal(6)), want[:3], **TIGHT64)


def test_batch_split_keeps_the_modules_names_and_loads_its_checkpoints() -> None:
    layer = encoder_layer()
    split = BatchSplit(encoder_layer().train(), 2)
    assert list(split.state_dict()) == list(layer.state_dict())
    assert [n for n, _ in split.named_parameters()] == [n for n, _ in layer.named_parameters()]
    with torch.no_grad():
        layer.linear1.weight.add_(1.0)
    split.load_state_dict(layer.state_dict())
    assert torch.equal(split.module.linear1.weight, layer.linear1.weight)
    assert split.linear1 is split.module.linear1  # submodules reachable as on the module
    split.eval()
    assert not split.training and not split.module.training and not split.module.linear1.training
    # Inside a model, the keys are those the model had with the plain module.
    model = nn.Sequential(nn.Linear(16, 16, dtype=f64), layer)
    keys = list(model.state_dict())
    model[1] = BatchSplit(model[1], 2)
    assert list(model.state_dict()) == keys
    # A deep copy (as `record` makes) keeps the sharing.
    twin = copy.deepcopy(split)
    assert list(twin.state_dict()) == list(layer.state_dict())
    assert twin.module.linear1 is twin.linear1 and twin.module.linear1 is not split.linear1


def test_batch_split_joins_tuples_of_outputs() -> None:
    torch.manual_seed(7)
    attention = nn.MultiheadAttention(8, 2, batch_first=True, dtype=f64)
    split = BatchSplit(attention, 3)
    x = torch.randn(4, 5, 8, dtype=f64)
    want_out, want_weights = attention(x, x, x)
    got_out, got_weights = split(x, x, x)
    torch.testing.assert_close(got_out, want_out, **TIGHT64)
    torch.testing.assert_close(got_weights, want_weights, **TIGHT64)


class Total(nn.Module):
    """A sum over the batch: not separable over dim 0."""

    def forward(self, x: Any) -> Any:
        return x.sum()


def test_batch_split_refuses_batch_normalisation_and_unsplittable_calls() -> None:
    block = nn.Sequential(nn.Conv2d(3, 3, 1), nn.Sequential(nn.BatchNorm2d(3)))
    with pytest.raises(ValueError, match=r"its submodule '1\.0' is a BatchNorm2d, whose stat"):
        BatchSplit(block, 2)
    with pytest.raises(ValueError, match="it is a BatchNorm1d, whose statistics span the batch"):
        BatchSplit(nn.BatchNorm1d(3), 2)
    with pytest.raises(ValueError, match="no tensor argument with a batch dimension"):
        BatchSplit(nn.Identity(), 2)(3)
    with pytest.raises(ValueError, match="returned a 0-dim tensor"):
        BatchSplit(Total(), 2)(torch.zeros(4))
    with pytest.raises(ValueError, match="cannot split a batch of 1 into 2"):
        BatchSplit(nn.Identity(), 2)(torch.zeros(1, 3))


# -- on the meta device ---------------------------------------------------------------------------


def test_the_modules_run_on_the_meta_device() -> None:
    """No value is read: forward and backward run on meta tensors, with the right shapes."""
    conv = MicroBatchConv2d(3, 4, 3, padding=1, sizes=[3, 2], device="meta")
    x = torch.empty(5, 3, 8, 8, device="meta", requires_grad=True)
    out = conv(x)
    out.sum().backward()
    assert out.shape == (5, 4, 8, 8) and x.grad is not None and x.grad.shape == x.shape
    split = BatchSplit(nn.TransformerEncoderLayer(16, 2, 32, 0.0, batch_first=True).to("meta"), 4)
    h = torch.empty(8, 6, 16, device="meta", requires_grad=True)
    split(h, src_mask=torch.empty(6, 6, device="meta")).sum().backward()
    assert h.grad is not None and h.grad.shape == h.shape
    head = nn.Linear(16, 100, device="meta")
    loss = LinearCrossEntropy(head, 4)(h, torch.empty(8, 6, dtype=torch.long, device="meta"))
    loss.backward()
    assert loss.shape == () and head.weight.grad is not None and head.weight.grad.shape == (100, 16)


VOCAB, WIDTH, SEQ, BATCH, PARTS = 4096, 32, 64, 8, 8


class TinyGPT(nn.Module):
    """Embedding, one encoder layer, a head tied to the embedding; `fused`: forward returns the
    rows of hidden states for LinearCrossEntropy instead of the logits."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.layer = nn.TransformerEncoderLayer(
            WIDTH, 2, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True
        )
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, ids: Any) -> Any:
        rows = self.layer(self.tokens(ids), is_causal=True, src_mask=causal32()).reshape(-1, WIDTH)
        return rows if self.fused else self.head(rows)


def causal32() -> Any:
    return nn.Transformer.generate_square_subsequent_mask(SEQ, device="meta")


def steady_bounds(model: Any, loss_fn: Any, path: Path) -> tuple[int, int]:
    """(op-wise bound, peak) of the steady iteration recorded as bench/torch_train.py's loop."""
    torch.manual_seed(8)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    target = torch.randint(0, VOCAB, (BATCH * SEQ,))
    events = record(
        model,
        (ids, target),
        loss_fn,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        path=path,
        set_to_none=True,
        keep_output=False,
    )
    it = learn.extract(events, events.marks())
    return op_bound(it), int(load(it).max())


def test_a_recorded_step_with_the_fused_head_touches_and_holds_less(tmp_path: Path) -> None:
    """The planner's view: the logits (rows N = 512, vocabulary V = 4096, fp32: 8 MiB) dominate
    a plain step; LinearCrossEntropy(parts=8) leaves one part's (N/8, V) block at a time.

    SGD without momentum, so that the optimizer's foreach step (parameters and gradients, about
    1.1 MB) touches fewer bytes than either bound."""
    plain = steady_bounds(TinyGPT(fused=False), F.cross_entropy, tmp_path / "plain.csv")
    model = TinyGPT(fused=True)
    fused = steady_bounds(model, LinearCrossEntropy(model.head, PARTS), tmp_path / "fused.csv")
    f32 = 4
    rows = BATCH * SEQ
    logits = rows * VOCAB * f32  # 8 MiB
    part = logits // PARTS  # 1 MiB
    weight = VOCAB * WIDTH * f32  # the tied embedding / head weight, and its gradient: 512 KiB
    hidden = rows * WIDTH * f32  # the rows of hidden states, and their gradient: 64 KiB
    scalar = 512  # a 0-dim tensor, rounded as the recorder rounds every size
    # Plain: log_softmax's backward reads its saved output and nll_loss's gradient of the
    # logits and writes its own: three (N, V) blocks in one op.
    assert plain[0] == 3 * logits == 25_165_824
    # Fused: a part's forward matmul reads all of hidden (the part is a view of it) and the
    # weight, and writes that part's logits.
    assert fused[0] == hidden + weight + part == 1_638_400
    # Peaks, with what the two have in common left out (persistent parameters, the encoder's
    # saved activations). Plain, at log_softmax's backward: its three (N, V) blocks, the loss
    # and backward's seed. Fused, at a part's d hidden in backward: the part's (N/8, V) block,
    # d weight (allocated later in the plain step, after the peak), d hidden and one part of
    # it, each row's logsumexp (N fp32), and five scalars (the count of rows, the loss,
    # backward's seed, grad / count, the part's mask of rows not ignored: 64 B rounded).
    plain_only = 3 * logits + 2 * scalar
    fused_only = part + weight + hidden + hidden // PARTS + rows * f32 + 5 * scalar
    assert plain[1] - fused[1] == plain_only - fused_only == 23_515_648
    assert (plain, fused) == ((25_165_824, 26_683_392), (1_638_400, 3_167_744))
