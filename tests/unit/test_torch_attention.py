"""`tidaloffline.torch.attention`: recording runs scaled dot-product attention with the fused
kernel a GPU would pick, so a transformer's trace holds no score matrices the GPU never makes."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tidalcore.events import ALLOC, OP, Events  # noqa: E402
from tidaloffline.torch.attention import Gpu, fused_attention, kernel  # noqa: E402
from tidaloffline.torch.capture import round_size  # noqa: E402
from tidaloffline.torch.recompute_plan import measure  # noqa: E402
from tidalplan import learn  # noqa: E402
from tidalplan.autoswap import load  # noqa: E402
from tidalpool.torch import record  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

nn = torch.nn
B, H, S, D = 2, 4, 256, 16  # a score matrix (B·H·S·S floats) is 16x a q/k/v (B·H·S·D)
SDPA_BUILTIN = torch._C._nn.scaled_dot_product_attention


def meta(*shape: int, dtype: Any = torch.float32) -> Any:
    return torch.empty(*shape, device="meta", dtype=dtype)


# -- the choice ----------------------------------------------------------------------------------


H100 = Gpu((9, 0), 91900, 13)  # cuDNN 9.19: PyTorch tries cuDNN first
A100 = Gpu((8, 0), 91900, 13)  # flash first


@pytest.mark.parametrize(
    ("dtype", "q_shape", "kv_shape", "mask", "gqa", "on_h100", "on_a100"),
    [
        (torch.float32, (B, H, S, 64), (B, H, S, 64), False, False, "efficient", "efficient"),
        (torch.float32, (B, H, S, 64), (B, H, S, 64), True, False, "efficient", "efficient"),
        (torch.bfloat16, (B, H, S, 64), (B, H, S, 64), False, False, "cudnn", "flash"),
        (torch.float16, (B, H, S, 12), (B, H, S, 12), False, False, "flash", "flash"),  # 12 % 8
        (torch.bfloat16, (B, H, S, 64), (B, H, S, 64), True, False, "cudnn", "efficient"),  # mask
        (torch.float16, (B, H, S, 64), (B, H, S, 64), True, False, "cudnn", "efficient"),
        (torch.bfloat16, (B, H, S, 192), (B, H, S, 192), False, False, "flash", "flash"),  # > 128
        (torch.bfloat16, (B, H, S, 192), (B, H, S, 192), True, False, "efficient", "efficient"),
        (torch.float32, (B, H, S, 6), (B, H, S, 6), False, False, "math", "math"),  # 6 % 4
        (torch.bfloat16, (B, H, S, 300), (B, H, S, 300), False, False, "math", "math"),  # > 256
        (torch.bfloat16, (B, 8, S, 64), (B, 2, S, 64), False, True, "cudnn", "flash"),  # grouped
        (torch.bfloat16, (B, 8, S, 64), (B, 2, S, 64), False, False, "math", "math"),  # no gqa
        (torch.float32, (B, 8, S, 64), (B, 2, S, 64), False, True, "math", "math"),
        (torch.float64, (B, H, S, 64), (B, H, S, 64), False, False, "math", "math"),
        (torch.float32, (H, S, 64), (H, S, 64), False, False, "math", "math"),  # 3-D
    ],
)
def test_kernel_follows_pytorchs_cuda_rules(
    dtype: Any, q_shape: Any, kv_shape: Any, mask: bool, gqa: bool, on_h100: str, on_a100: str
) -> None:
    q, k = meta(*q_shape, dtype=dtype), meta(*kv_shape, dtype=dtype)
    attn_mask = meta(q_shape[-2], kv_shape[-2], dtype=torch.bool) if mask else None
    assert kernel(q, k, k, attn_mask, gqa, gpu=H100) == on_h100
    assert kernel(q, k, k, attn_mask, gqa, gpu=A100) == on_a100


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        (Gpu((9, 0), 91501, 13), "cudnn"),  # cuDNN 9.15.1
        (Gpu((9, 0), 91500, 13), "flash"),  # cuDNN 9.15.0: not newer than 9.15.0
        (Gpu((9, 0), None, 13), "cudnn"),  # a cuDNN not known: taken as newer
        (Gpu((10, 0), 92000, 12), "cudnn"),
        (Gpu((10, 3), 92000, 12), "cudnn"),
        (Gpu((10, 1), 92000, 12), "flash"),  # built for CUDA 12: x.0 and x.3 only
        (Gpu((10, 1), 92000, 13), "cudnn"),
        (Gpu((8, 9), 92000, 13), "flash"),
        (Gpu((12, 0), 92000, 13), "flash"),
    ],
)
def test_cudnn_comes_first_where_pytorch_prefers_it(gpu: Gpu, expected: str) -> None:
    half = meta(B, H, S, 64, dtype=torch.bfloat16)
    assert kernel(half, half, half, gpu=gpu) == expected


def test_cudnn_refuses_what_pytorch_refuses() -> None:
    half = meta(B, H, S, 64, dtype=torch.bfloat16)
    mask = meta(S, S, dtype=torch.bool)
    assert kernel(half, half, half, mask, gpu=H100) == "cudnn"
    assert kernel(half, half, half, mask.t(), gpu=H100) == "math"  # last stride not 1
    assert kernel(half, half, half, meta(B, S, S, dtype=torch.bool), gpu=H100) == "efficient"
    assert kernel(half, half, half, meta(B, 1, S, S, dtype=torch.bool), gpu=H100) == "cudnn"
    grad = meta(S, S, dtype=torch.bfloat16).requires_grad_()
    assert kernel(half, half, half, grad, gpu=H100) == "efficient"
    assert kernel(half, half, half, dropout_p=0.25, gpu=H100) == "cudnn"  # 4/16
    assert kernel(half, half, half, dropout_p=0.1, gpu=H100) == "flash"  # not a 16th
    assert kernel(half, half, half, dropout_p=0.25, gpu=Gpu((9, 0), 91200, 13)) == "flash"
    one = meta(B, H, 1, 64, dtype=torch.bfloat16)
    assert kernel(half, one, one, gpu=H100) == "flash"  # a key sequence of 1
    torch.use_deterministic_algorithms(True)
    try:
        assert kernel(half, half, half, gpu=H100) == "flash"
    finally:
        torch.use_deterministic_algorithms(False)


def test_kernel_obeys_the_backend_switches() -> None:
    half, single = meta(B, H, S, 64, dtype=torch.bfloat16), meta(B, H, S, 64)
    with sdpa_kernel(SDPBackend.MATH):
        assert kernel(half, half, half, gpu=H100) == kernel(single, single, single) == "math"
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        assert kernel(half, half, half, gpu=H100) == "efficient"
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        assert kernel(single, single, single, gpu=H100) == "math"
        assert kernel(half, half, half, gpu=H100) == "flash"
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # last in the order, math switched off
        assert kernel(half, half, half, gpu=A100) == "cudnn"
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION], set_priority=True):
        assert kernel(half, half, half, gpu=H100) == "flash"  # the order given
    assert kernel(half, half, half, gpu=H100) == "cudnn"
    assert kernel(half, half, half, gpu=A100) == "flash"


@pytest.fixture
def h100(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recordings in this test choose as on an H100, whatever GPU this machine has."""
    monkeypatch.setattr(Gpu, "here", classmethod(lambda cls: H100))


# -- what a recorded step holds --------------------------------------------------------------


class Attention(nn.Module):
    """Self-attention over (B, H, S, D) inputs, its q, k and v one projection each."""

    def __init__(
        self, d: int = D, how: str = "functional", mask: Any = None, dtype: Any = None
    ) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False, dtype=dtype) for _ in range(3))
        self.how, self.mask = how, mask

    def forward(self, x: Any) -> Any:
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.how == "builtin":  # the builtin by another name: the function mode's path
            return SDPA_BUILTIN(q, k, v, is_causal=True)
        if self.mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask.to(x.device))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def step(model: nn.Module, tmp_path: Path, x: Any, **kwargs: Any) -> Events:
    target = torch.zeros((*x.shape[:-1], model(x).shape[-1]), dtype=x.dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return record(model, (x, target), F.mse_loss, optimizer, path=tmp_path / "t.csv", **kwargs)


def op_names(events: Events) -> list[str]:
    pairs = zip(events.kinds, events.name_ids, strict=True)
    return [events.names[int(n)] for k, n in pairs if k == OP]


def sizes(events: Events) -> set[int]:
    return {int(s) for k, s in zip(events.kinds, events.sizes, strict=True) if k == ALLOC}


def peak(events: Events) -> int:
    return int(load(learn.extract(events, events.marks())).max())


SCORES = round_size(B * H * S * S * 4)  # one fp32 score matrix (or softmax)
LOGSUMEXP = round_size(B * H * math.ceil(S / 32) * 32 * 4)  # efficient attention's, fp32


@pytest.mark.parametrize("how", ["functional", "builtin"])
def test_recorded_attention_is_the_efficient_kernel_without_score_matrices(
    tmp_path: Path, how: str
) -> None:
    x = torch.randn(B, H, S, D)
    fused = step(Attention(how=how), tmp_path, x)
    names = op_names(fused)
    per_step = 3  # iterations
    assert names.count("aten._scaled_dot_product_efficient_attention.default") == per_step
    assert names.count("aten._scaled_dot_product_efficient_attention_backward.default") == per_step
    assert "aten._safe_softmax.default" not in names and "aten.bmm.default" not in names
    assert SCORES not in sizes(fused)
    assert LOGSUMEXP in sizes(fused)  # saved for backward: one float per query row, padded
    with sdpa_kernel(SDPBackend.MATH):  # what the meta device runs by itself
        math_path = step(Attention(how=how), tmp_path, x)
    assert "aten._safe_softmax.default" in op_names(math_path)
    assert SCORES in sizes(math_path)
    assert peak(math_path) - peak(fused) >= SCORES


def test_multihead_attention_calls_through_torch_nn_functional(tmp_path: Path) -> None:
    """nn.MultiheadAttention's own Python function calls the builtin with function modes off:
    only the patched torch.nn.functional name reaches it."""

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(
                64, 4, 128, dropout=0.0, batch_first=True, norm_first=True
            )

        def forward(self, x: Any) -> Any:
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
            return self.layer(x, src_mask=mask, is_causal=True)

    names = op_names(step(Layer(), tmp_path, torch.randn(2, S, 64)))
    assert names.count("aten._scaled_dot_product_efficient_attention.default") == 3
    assert "aten._safe_softmax.default" not in names


def test_a_boolean_mask_is_made_additive_and_padded_as_pytorch_does(tmp_path: Path) -> None:
    s = 100  # not a multiple of 8: the additive mask is padded to 104 columns, sliced back
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    events = step(Attention(mask=mask), tmp_path, torch.randn(B, H, s, D))
    names = op_names(events)
    assert "aten._scaled_dot_product_efficient_attention.default" in names
    assert "aten.where.self" in names
    assert round_size(s * 104 * 4) in sizes(events)  # the padded fp32 mask


@pytest.mark.usefixtures("h100")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_masked_call_runs_cudnn_with_the_mask_pytorch_makes(
    tmp_path: Path, dtype: Any
) -> None:
    """As the H200 ran it: a boolean mask made additive in q's type (-65504 where masked),
    saved for backward by cuDNN's attention; no padded or expanded copy of it."""
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    x = torch.randn(B, H, S, D, dtype=dtype)
    events = step(Attention(mask=mask, dtype=dtype), tmp_path, x)
    names = op_names(events)
    assert names.count("aten._scaled_dot_product_cudnn_attention.default") == 3
    assert names.count("aten._scaled_dot_product_cudnn_attention_backward.default") == 3
    assert "aten._scaled_dot_product_efficient_attention.default" not in names
    assert "aten.logical_not.default" in names and "aten.where.self" in names
    assert round_size(S * S * 2) in sizes(events)  # the additive mask, 2 bytes a score
    assert round_size(B * H * S * S * 2) not in sizes(events)  # never expanded to every head
    assert round_size(B * H * S * 4) in sizes(events)  # the log-sum-exp, one float per row


@pytest.mark.usefixtures("h100")
def test_cudnn_saves_what_flash_saves_without_a_mask(tmp_path: Path) -> None:
    x = torch.randn(B, H, S, D, dtype=torch.bfloat16)
    cudnn = step(Attention(dtype=torch.bfloat16), tmp_path, x)
    assert op_names(cudnn).count("aten._scaled_dot_product_cudnn_attention.default") == 3
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash = step(Attention(dtype=torch.bfloat16), tmp_path, x)
    assert op_names(flash).count("aten._scaled_dot_product_flash_attention.default") == 3
    assert peak(cudnn) == peak(flash)


def test_flash_pads_a_head_size_to_a_multiple_of_8(tmp_path: Path) -> None:
    x = torch.randn(B, H, S, 12, dtype=torch.bfloat16)
    events = step(Attention(d=12, dtype=torch.bfloat16), tmp_path, x)
    names = op_names(events)
    assert names.count("aten._scaled_dot_product_flash_attention.default") == 3
    assert names.count("aten._scaled_dot_product_flash_attention_backward.default") == 3
    assert round_size(B * H * S * 16 * 2) in sizes(events)  # q, k, v padded to 16


def test_values_on_other_devices_are_untouched() -> None:
    q, k, v = (torch.randn(B, H, 32, D) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with fused_attention():
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True), expected)
        assert torch.equal(SDPA_BUILTIN(q, k, v, is_causal=True), expected)


def test_the_patch_is_undone_on_the_last_exit_and_on_errors() -> None:
    original = F.scaled_dot_product_attention
    entered, leave = threading.Event(), threading.Event()

    def other() -> None:
        with fused_attention():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    assert entered.wait(10)
    with pytest.raises(RuntimeError, match="inside"), fused_attention():
        assert F.scaled_dot_product_attention is not original
        raise RuntimeError("inside")
    assert F.scaled_dot_product_attention is not original  # the other thread's is still open
    leave.set()
    thread.join(10)
    assert F.scaled_dot_product_attention is original


def test_measure_and_recomputation_use_the_fused_kernel(tmp_path: Path) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Attention(), Attention()])

        def forward(self, x: Any) -> Any:
            for block in self.blocks:
                x = block(x)
            return x

    model, x = Model(), torch.randn(B, H, S, D)
    segments = measure(model, (x, torch.zeros_like(x)), F.mse_loss, list(model.blocks))
    assert all(s.freed < SCORES for s in segments)  # q, k, v, output, log-sum-exp
    events = step(model, tmp_path, x, recompute=[model.blocks[0]])
    forward = "aten._scaled_dot_product_efficient_attention.default"
    assert op_names(events).count(forward) == 3 * 3  # two blocks, one run again in backward
    assert SCORES not in sizes(events)
