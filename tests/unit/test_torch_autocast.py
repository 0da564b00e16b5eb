"""`tidaloffline.torch.autocast`: on the meta device, a step under `meta_autocast` is cast as CUDA
autocast casts it, so a bf16 recording holds the 16-bit activations a GPU holds."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tidalcore.events import OP, Events  # noqa: E402
from tidaloffline.torch import autocast as ac  # noqa: E402
from tidaloffline.torch.attention import Gpu  # noqa: E402
from tidaloffline.torch.autocast import POLICY, meta_autocast  # noqa: E402
from tidaloffline.torch.recompute_plan import measure, plan_recompute  # noqa: E402

H100 = Gpu((9, 0), 91900, 13)  # cuDNN 9.19: PyTorch 2.11 tries cuDNN's attention first
from tidalplan import learn  # noqa: E402
from tidalplan.autoswap import load  # noqa: E402
from tidalpool.torch import record  # noqa: E402
from torch.nn import functional as F  # noqa: E402

nn = torch.nn
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


def meta(*shape: int, dtype: Any = fp32, grad: bool = False) -> Any:
    return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=grad)


def op_names(events: Events) -> list[str]:
    pairs = zip(events.kinds, events.name_ids, strict=True)
    return [events.names[int(n)] for k, n in pairs if k == OP]


def peak(events: Events) -> int:
    return int(load(learn.extract(events, events.marks())).max())


# -- the policy table -----------------------------------------------------------------------------

# Registered for CUDA outside autocast_mode.h's lists, with casts of their own: left uncast.
UNCOVERED = {"aten::_cudnn_rnn", "aten::linalg_matrix_sqrth"}
# In CUDA autocast's lists of some PyTorch versions only: rms_norm from after 2.11, the
# named-dimension overloads up to 2.11 (2.13 lists none of them).
BY_VERSION = {
    "aten::rms_norm",
    "aten::prod.dim_Dimname",
    "aten::softmax.Dimname",
    "aten::log_softmax.Dimname",
    "aten::cumprod.dimname",
    "aten::cumsum.dimname",
    "aten::sum.dim_DimnameList",
    "aten::norm.names_ScalarOpt_dim",
}


def test_the_table_is_pytorchs_cuda_autocast_op_list() -> None:
    """Every op CUDA autocast has a kernel for, in this PyTorch, is cast, and nothing else: a
    PyTorch that adds one fails here rather than recording it uncast; an op of the table left
    out must be one this PyTorch lacks, or one that only some versions list."""
    ops = set(torch._C._dispatch_get_all_op_names())
    cuda = {n for n in ops if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCUDA")}
    cast = {"aten::" + name for name in ac.covered()}
    assert cast == cuda - UNCOVERED, cast ^ (cuda - UNCOVERED)
    left_out = {"aten::" + name for name in POLICY} - cast
    assert not left_out & ops - BY_VERSION, left_out & ops - BY_VERSION
    assert {"aten::" + name for name in POLICY} >= BY_VERSION
    assert len(cast) > 100


@pytest.mark.parametrize("low", [bf16, fp16])
def test_each_policy_casts_as_cuda_autocast(low: Any) -> None:
    x, w, n = meta(8, 16), meta(32, 16, grad=True), meta(8, 16, dtype=low)
    with meta_autocast(low):
        assert F.linear(x, w).dtype == low  # lower
        assert (x @ w.T).dtype == low and torch.bmm(x[None], w.T[None]).dtype == low
        assert F.conv2d(meta(1, 3, 8, 8), meta(4, 3, 3, 3)).dtype == low
        assert F.layer_norm(n, (16,)).dtype == fp32  # fp32
        assert torch.exp(n).dtype == fp32 and F.mse_loss(n, n).dtype == fp32
        assert torch.softmax(n, -1).dtype == fp32  # fp32_set_opt_dtype, without a copy
        assert n.sum().dtype == fp32 and n.sum(dtype=low).dtype == low  # a dtype given stays
        assert torch.cumsum(n, 0).dtype == fp32
        assert n.norm().dtype == fp32 and torch.norm(n, 2, [1]).dtype == fp32  # appended
        assert torch.addcmul(n, x, n).dtype == fp32 and torch.addcmul(n, n, n).dtype == low
        assert (n * 0.5).dtype == low and F.gelu(n).dtype == low  # not listed: unchanged
        f64 = meta(4, 16, dtype=torch.float64)
        assert F.linear(f64, f64).dtype == torch.float64  # float64 is never cast
        cpu = torch.ones(2, 16)
        assert F.linear(cpu, torch.ones(4, 16)).dtype == fp32  # other devices are not cast
    assert F.linear(x, w).dtype == fp32  # nor anything after


def test_binary_cross_entropy_is_refused_as_autocast_refuses_it() -> None:
    p = meta(8)
    with meta_autocast(), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(p, p)
    assert F.binary_cross_entropy_with_logits(p, p).dtype == fp32


def test_a_bad_type_is_refused() -> None:
    with pytest.raises(ValueError, match=r"bfloat16 or torch\.float16"), meta_autocast(fp32):
        pass
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="autocast must be"):
        record(
            model,
            (torch.ones(2, 4), torch.ones(2, 4)),
            F.mse_loss,
            lambda m: None,
            path="x",
            autocast=torch.float64,
        )


# -- where and when it casts ----------------------------------------------------------------------


def graph(loss: Any) -> Counter[str]:
    """The autograd nodes behind `loss`, by type (also used by tests/gpu)."""
    seen, todo, names = set(), [loss.grad_fn], Counter[str]()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__  # on a GPU, cuDNN's attention saves what flash saves
        names[name.replace("CudnnAttention", "FlashAttention")] += 1
        todo += [n for n, _ in node.next_functions]
    return names


class MLP(nn.Module):
    """Two linear layers sharing one weight, a convolution; ops CPU and CUDA autocast cast
    alike (lower: linear, conv2d, bmm; fp32: mse_loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.conv = nn.Conv2d(1, 1, 3, padding=1)

    def forward(self, x: Any) -> Any:
        h = torch.relu(self.a(x))
        h = self.a(h)  # the same weight again: cast once
        h = self.conv(h[:, None, :, :].expand(-1, 1, -1, -1))[:, 0]
        return torch.bmm(h, h.transpose(1, 2))


def test_the_casts_are_autogrammed_as_cpu_autocast_records_them() -> None:
    """The same step, under the CPU's own autocast on CPU tensors and under meta_autocast on
    meta tensors, builds the same autograd graph: the casts are above autograd, and each
    weight is cast once (the cache)."""
    model, x = MLP(), torch.randn(2, 4, 16)
    with torch.autocast("cpu", dtype=bf16):
        real = F.mse_loss(model(x), torch.zeros(2, 4, 4))
    meta_model = MLP().to("meta")
    with meta_autocast(bf16):
        emulated = F.mse_loss(meta_model(x.to("meta")), meta(2, 4, 4))
    assert emulated.dtype == real.dtype == fp32
    assert graph(emulated) == graph(real)
    assert graph(real)["ToCopyBackward0"] == 5  # x, a's weight and bias, conv's two; not a's again


def test_the_weight_cache_holds_one_copy_per_region() -> None:
    w = meta(4, 4, grad=True)
    with meta_autocast():
        first = ac.cast(w, bf16)
        assert ac.cast(w, bf16) is first
        assert ac.cast(w.detach(), bf16) is not first  # not a leaf that requires grad
        with meta_autocast():
            assert ac.cast(w, bf16) is first  # nested: the same region's cache
        assert ac.cast(w, bf16) is first
    with meta_autocast():
        assert ac.cast(w, bf16) is not first  # a new region casts again


def test_nesting_and_enabled_false() -> None:
    x, w = meta(2, 4), meta(4, 4)
    with meta_autocast(bf16):
        with meta_autocast(fp16):
            assert F.linear(x, w).dtype == fp16
            with meta_autocast(enabled=False):
                assert F.linear(x, w).dtype == fp32 and ac.active() is None
            assert ac.active() == fp16
        assert F.linear(x, w).dtype == bf16
    assert ac.active() is None and F.linear(x, w).dtype == fp32


def test_other_threads_are_not_cast_and_kernels_go_with_the_last_region() -> None:
    x, w = meta(2, 4), meta(4, 4)
    seen: list[Any] = []
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with meta_autocast():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(10)
    registered = torch._C._dispatch_has_kernel_for_dispatch_key
    assert registered("aten::linear", "AutocastPrivateUse1")
    seen.append(F.linear(x, w).dtype)  # this thread has no region open
    with meta_autocast():
        seen.append(F.linear(x, w).dtype)
    assert registered("aten::linear", "AutocastPrivateUse1")  # the other region holds them
    leave.set()
    thread.join(10)
    assert seen == [fp32, bf16]
    assert not registered("aten::linear", "AutocastPrivateUse1")
    with pytest.raises(RuntimeError, match="boom"), meta_autocast():
        raise RuntimeError("boom")
    assert not registered("aten::linear", "AutocastPrivateUse1") and ac.active() is None


# -- recording ------------------------------------------------------------------------------------


class Blocks(nn.Module):
    def __init__(self, width: int = 256, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, 4 * width),
                nn.GELU(),
                nn.Linear(4 * width, width),
            )
            for _ in range(depth)
        )
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)

    def forward(self, x: Any) -> Any:
        for block in self.blocks:
            x = x + block(x)
        return x + self.attn(x, x, x, need_weights=False, is_causal=False)[0]


def adamw(m: Any) -> Any:
    return torch.optim.AdamW(m.parameters(), lr=1e-3)


def step(tmp_path: Path, **kwargs: Any) -> Events:
    model = Blocks()
    x = torch.randn(8, 128, 256)
    return record(
        model, (x, torch.zeros_like(x)), F.mse_loss, adamw, path=tmp_path / "t.csv", **kwargs
    )


def test_record_under_autocast_holds_16_bit_activations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Gpu, "here", classmethod(lambda cls: H100))
    plain, cast = step(tmp_path), step(tmp_path, autocast=bf16)
    names = op_names(cast)
    copies = "aten._to_copy.default"  # in both: the batch, copied to the device
    # 16 weights and biases cast in each forward, their gradients cast back in backward
    assert names.count(copies) > op_names(plain).count(copies) + 3 * 2 * 16
    # attention's q, k, v are cast before the kernel is chosen: cuDNN's, as on an H100
    assert "aten._scaled_dot_product_cudnn_attention.default" in names
    assert "aten._scaled_dot_product_efficient_attention.default" in op_names(plain)
    # each block saves its hidden activations (two of 8·128·1024) in 2 bytes, not 4
    assert peak(plain) - peak(cast) >= 3 * 2 * 8 * 128 * 1024 * 2
    assert "autocast=bfloat16" in (tmp_path / "t.csv").read_text().splitlines()[0]


def test_recomputed_blocks_are_cast_again_in_backward(tmp_path: Path) -> None:
    """checkpoint restores torch.autocast for the recomputation, not meta_autocast: without
    the blocks' own context the recomputed forward runs in fp32, and checkpoint refuses its
    tensors (their dtypes differ from the first forward's)."""
    model = Blocks()
    x = torch.randn(8, 128, 256)
    kinds = []
    for blocks in ([], list(model.blocks)):
        events = record(
            model,
            (x, torch.zeros_like(x)),
            F.mse_loss,
            adamw,
            path=tmp_path / "t.csv",
            autocast=bf16,
            recompute=blocks,
        )
        kinds.append(Counter(op_names(events)))
    plain, again = kinds
    assert again["aten.addmm.default"] > plain["aten.addmm.default"]  # run again in backward
    assert again["aten._to_copy.default"] > plain["aten._to_copy.default"]  # and cast again
    segments = measure(
        model, (x, torch.zeros_like(x)), F.mse_loss, list(model.blocks), autocast=bf16
    )
    fp32_segments = measure(model, (x, torch.zeros_like(x)), F.mse_loss, list(model.blocks))
    assert sum(s.freed for s in segments) < sum(s.freed for s in fp32_segments)
    plan = plan_recompute(
        model,
        (x, torch.zeros_like(x)),
        F.mse_loss,
        adamw,
        list(model.blocks),
        limit=1 << 40,
        autocast=bf16,
    )
    assert plan.chosen.chosen == () and plan.plain_compute_ns > 0


def test_attention_is_chosen_after_its_inputs_are_cast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 q, k and v under autocast: cast to 16 bits first, so a 16-bit kernel runs, cuDNN's
    on an H100 (memory-efficient attention without autocast)."""
    monkeypatch.setattr(Gpu, "here", classmethod(lambda cls: H100))

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x: Any) -> Any:
            return F.scaled_dot_product_attention(x * self.scale, x, x)  # all fp32

    x = torch.randn(2, 4, 128, 64)
    names = []
    for autocast in (None, bf16):
        events = record(
            Attention(),
            (x, torch.zeros_like(x)),
            F.mse_loss,
            adamw,
            path=tmp_path / "t.csv",
            autocast=autocast,
        )
        names.append(op_names(events))
    plain, cast = names
    assert "aten._scaled_dot_product_efficient_attention.default" in plain
    assert cast.count("aten._scaled_dot_product_cudnn_attention.default") == 3
    assert "aten._scaled_dot_product_efficient_attention.default" not in cast
