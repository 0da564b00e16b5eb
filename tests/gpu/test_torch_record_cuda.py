"""`record` against a GPU: the kernel PyTorch picks for attention on the GPU is the one the
recording runs, autocast casts on the GPU as `meta_autocast` casts on the meta device, and the
peak a training step records on the meta device, in fp32 and in bf16 autocast, is the peak
PyTorch's caching allocator reaches running the same step on the GPU."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tidaloffline.torch.attention import fused_attention, kernel  # noqa: E402
from tidaloffline.torch.autocast import meta_autocast  # noqa: E402
from tidalplan import learn  # noqa: E402
from tidalplan.autoswap import load  # noqa: E402
from tidalpool.torch import record  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from tests.unit.test_torch_autocast import graph  # noqa: E402

nn = torch.nn
RAN = {  # the profiler's op name -> the kernel it is
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_safe_softmax": "math",
    "aten::_softmax": "math",
}


def ran(q: Any, k: Any, v: Any, **kwargs: Any) -> set[str]:
    """The kernels a forward and backward of this call ran on the GPU. One profiling cycle:
    acc_events changes nothing in it, and PyTorch 2.11 warns without it ("Profiler clears
    events at the end of each cycle"), which the suite's warnings-as-errors made a failure."""
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, acc_events=True) as prof:
        F.scaled_dot_product_attention(q, k, v, **kwargs).sum().backward()
    return {RAN[e.key] for e in prof.key_averages() if e.key in RAN}


# Should acc_events not keep it quiet in some release: the warning is PyTorch's own, about
# cycles this one-cycle profile does not have (fixed upstream after 2.11).
@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events at the end of each cycle")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("head", "masked"), [(64, False), (64, True), (12, False), (6, False)])
def test_the_gpu_runs_the_kernel_the_recording_runs(dtype: Any, head: int, masked: bool) -> None:
    """On an H100 or H200 with PyTorch 2.11's CUDA 13 wheels, cuDNN's attention for 16-bit
    inputs of head size 64, masked or causal; flash for head size 12; efficient in fp32."""
    q, k, v = (
        torch.randn(2, 4, 256, head, device="cuda", dtype=dtype, requires_grad=True)
        for _ in range(3)
    )
    mask = torch.ones(256, 256, device="cuda", dtype=torch.bool).tril() if masked else None
    kwargs = {"attn_mask": mask} if masked else {"is_causal": True}
    on_meta = kernel(*(t.to("meta") for t in (q, k, v)), None if mask is None else mask.to("meta"))
    assert ran(q, k, v, **kwargs) == {on_meta}


class Layers(nn.Module):
    """Two pre-norm causal transformer layers of width 512 and a 64-way head per token."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(2)
        )
        self.head = nn.Linear(512, 64)

    def forward(self, x: Any) -> Any:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(x).flatten(0, 1)


def adamw(m: Any) -> Any:
    return torch.optim.AdamW(m.parameters(), lr=1e-4)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_cuda_autocast_casts_as_meta_autocast(low: Any) -> None:
    """The same step under torch.autocast on the GPU and under meta_autocast on the meta
    device: the same autograd graph (every cast, every kernel), the same loss type."""
    torch.manual_seed(0)
    model = Layers()
    x, y = torch.randn(2, 128, 512), torch.randint(0, 64, (2 * 128,))
    on_meta = Layers().to("meta")
    with fused_attention(), meta_autocast(low):
        emulated = F.cross_entropy(on_meta(x.to("meta")), y.to("meta"))
    model = model.cuda()
    with torch.autocast("cuda", dtype=low):
        real = F.cross_entropy(model(x.cuda()), y.cuda())
    assert emulated.dtype == real.dtype
    assert graph(emulated) == graph(real)


def recorded_peak(model: Any, batch: Any, tmp_path: Path, autocast: Any = None) -> int:
    events = record(
        model,
        batch,
        F.cross_entropy,
        adamw,
        path=tmp_path / "t.csv",
        set_to_none=True,
        keep_output=False,
        autocast=autocast,
    )
    return int(load(learn.extract(events, events.marks())).max())


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_the_recorded_peak_is_the_gpus(tmp_path: Path, autocast: Any) -> None:
    torch.manual_seed(0)
    model = Layers()
    x, y = torch.randn(8, 1024, 512), torch.randint(0, 64, (8 * 1024,))
    fused = recorded_peak(model, (x, y), tmp_path, autocast)
    with sdpa_kernel(SDPBackend.MATH):
        math_path = recorded_peak(model, (x, y), tmp_path, autocast)
    model = model.cuda()
    optimizer = adamw(model)
    torch.cuda.synchronize()
    for i in range(3):  # the third step is the steady one: gradients and state exist
        if i == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            # Python frames: the C++ ones PyTorch records by default name only the recorder
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)
        optimizer.zero_grad(set_to_none=True)
        xs, ys = x.cuda(), y.cuda()
        region = torch.autocast("cuda", dtype=autocast) if autocast else contextlib.nullcontext()
        with region:
            loss = F.cross_entropy(model(xs), ys)
        loss.backward()
        optimizer.step()
        del xs, ys
    torch.cuda.synchronize()
    gpu = torch.cuda.max_memory_allocated()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    # cuBLAS and attention-kernel workspaces come from the caching allocator on the GPU and
    # are not recorded: a few tens of MiB.
    assert abs(gpu - fused) <= 0.03 * gpu + (64 << 20), (gpu, fused, at_the_peak(snapshot))
    assert math_path - gpu > 128 << 20  # the score matrices the GPU never makes


def at_the_peak(snapshot: dict[str, Any], most: int = 12) -> str:
    """What a failed comparison needs: the largest allocations of the steady step live at its
    peak on the GPU (those made before the step, weights and optimizer state, are not in the
    history), each with the innermost Python frames that made it."""
    try:
        trace = snapshot["device_traces"][torch.cuda.current_device()]
        live: dict[int, dict[str, Any]] = {}
        now = best = 0
        peak: list[dict[str, Any]] = []
        for event in trace:
            if event["action"] == "alloc":
                live[event["addr"]] = event
                now += event["size"]
            elif event["action"] == "free_completed" and event["addr"] in live:
                now -= live.pop(event["addr"])["size"]
            if now > best:
                best, peak = now, list(live.values())
        peak.sort(key=lambda e: -e["size"])
        rows = [
            f"{e['size']:,} B at "
            + " < ".join(
                f"{f['name']} ({Path(f['filename']).name}:{f['line']})" for f in e["frames"][:3]
            )
            for e in peak[:most]
        ]
        return f"the step's own peak {best:,} B; largest live then: " + "; ".join(rows)
    except (KeyError, IndexError, TypeError) as e:  # a history this PyTorch keeps otherwise
        return f"no memory history to read ({type(e).__name__}: {e})"
