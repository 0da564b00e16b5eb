"""`tidalclient.torch.microbatch` on CUDA: micro-batched convolution (cuDNN), the fused head and
cross-entropy, and a split encoder layer give the unsplit op's results and gradients."""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tidalclient.torch.microbatch import (  # noqa: E402
    BatchSplit,
    LinearCrossEntropy,
    MicroBatchConv2d,
)
from torch.nn import functional as F  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="this PyTorch build cannot use the GPU"
)

nn = torch.nn
f64 = torch.float64
TIGHT64 = {"rtol": 1e-10, "atol": 1e-10}  # fp64: cuDNN may pick another algorithm per part
TIGHT32 = {"rtol": 1e-5, "atol": 2e-6}  # fp32 matmuls (TF32 off by default for matmul)


def all_grads(output: Any, *tensors: Any) -> list[Any]:
    weights = torch.linspace(-1, 1, output.numel(), dtype=output.dtype, device=output.device)
    return list(torch.autograd.grad((output * weights.reshape(output.shape)).sum(), tensors))


@pytest.mark.parametrize("sizes", [1, 3, (5, 2, 1)])
def test_micro_batched_conv_equals_the_conv_on_cuda(sizes: Any) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 16, 3, padding=1, device="cuda", dtype=f64)
    micro = MicroBatchConv2d.from_conv(conv, sizes)
    x = torch.randn(8, 8, 20, 20, device="cuda", dtype=f64, requires_grad=True)
    want, got = conv(x), micro(x)
    torch.testing.assert_close(got, want, **TIGHT64)
    for g, w in zip(
        all_grads(got, x, conv.weight, conv.bias),
        all_grads(want, x, conv.weight, conv.bias),
        strict=True,
    ):
        torch.testing.assert_close(g, w, **TIGHT64)


@pytest.mark.parametrize("parts", [1, 4, 7])
def test_linear_cross_entropy_equals_head_then_cross_entropy_on_cuda(parts: int) -> None:
    torch.manual_seed(1)
    head = nn.Linear(64, 1000, device="cuda")
    hidden = torch.randn(4, 32, 64, device="cuda", requires_grad=True)
    target = torch.randint(0, 1000, (4, 32), device="cuda")
    target[:, ::7] = -100
    params = [hidden, head.weight, head.bias]
    want = F.cross_entropy(head(hidden).reshape(128, 1000), target.reshape(128))
    got = LinearCrossEntropy(head, parts)(hidden, target)
    torch.testing.assert_close(got, want, **TIGHT32)
    for g, w in zip(
        torch.autograd.grad(got, params), torch.autograd.grad(want, params), strict=True
    ):
        torch.testing.assert_close(g, w, **TIGHT32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        cast_want = F.cross_entropy(head(hidden).reshape(128, 1000), target.reshape(128))
        cast_got = LinearCrossEntropy(head, parts)(hidden, target)
    assert cast_got.dtype == cast_want.dtype == torch.float32
    torch.testing.assert_close(cast_got, cast_want, rtol=1e-3, atol=1e-3)


def test_batch_split_of_an_encoder_layer_equals_the_layer_on_cuda() -> None:
    torch.manual_seed(2)
    layer = nn.TransformerEncoderLayer(
        32, 4, 64, dropout=0.0, batch_first=True, device="cuda", dtype=f64
    )
    split = BatchSplit(copy.deepcopy(layer), 3)
    x = torch.randn(6, 10, 32, device="cuda", dtype=f64, requires_grad=True)
    mask = nn.Transformer.generate_square_subsequent_mask(10, device="cuda", dtype=f64)
    want, got = layer(x, src_mask=mask), split(x, src_mask=mask)
    torch.testing.assert_close(got, want, **TIGHT64)
    mine, theirs = list(split.parameters()), list(layer.parameters())
    for g, w in zip(all_grads(got, x, *mine), all_grads(want, x, *theirs), strict=True):
        torch.testing.assert_close(g, w, **TIGHT64)
