"""Scaled dot-product attention on the meta device, run by the kernel a GPU would run.

`torch.nn.functional.scaled_dot_product_attention` picks its kernel by device. On the meta
device (and the CPU) that is the math path: it materialises the `batch × heads × L × S`
score matrix and its softmax, and autograd saves the softmax for backward. On an NVIDIA GPU
of compute capability 8.0 or newer PyTorch picks a fused kernel that never does: cuDNN's
attention, flash attention or memory-efficient attention, each saving only its inputs, its
output, one log-sum-exp per query row and, where it takes one, the additive mask. Recording a
transformer with the math path puts every layer's score matrices into the trace (on GPT-2
small at sequence 1,024 and batch 8, 384 MiB a layer), a peak the GPU never sees.

Within `fused_attention()`, attention on meta tensors calls the fused kernel's own ATen op
(`aten._scaled_dot_product_cudnn_attention`, `..._flash_attention`, `..._efficient_attention`),
whose meta kernels and autograd formulas give the outputs, saved tensors and backward of the
GPU's run. The choice follows PyTorch 2.11's CUDA rules (`aten/src/ATen/native/transformers/
cuda/sdp_utils.cpp`, `select_sdp_backend`): the kernels are tried in PyTorch's priority order,
under the same switches (`torch.nn.attention.sdpa_kernel`, `torch.backends.cuda.enable_*_sdp`,
deterministic algorithms). That order is flash, memory-efficient, math, cuDNN, unless
`check_prefer_cudnn_attention` puts cuDNN first: a runtime cuDNN newer than 9.15.0 on a GPU of
compute capability 9.x or 10.x (with PyTorch built for CUDA 12, only x.0 and x.3), as on an
H100 or H200 with PyTorch 2.11's CUDA 13 wheels. Then:

- cuDNN: 16-bit inputs, head sizes at most 128 and multiples of 8, a mask (if any) of 2 or 4
  dimensions that broadcasts to `batch × heads × L × S` and needs no gradient, grouped
  queries only with `enable_gqa`; a boolean mask is made additive (-65504 where masked, as
  PyTorch does for cuDNN) and saved for backward;
- flash: 16-bit inputs, no `attn_mask`, q, k and v of one head size, at most 256 (padded to
  a multiple of 8, as PyTorch pads it);
- memory-efficient: 32- or 16-bit inputs, q and k of one head size, q and v head sizes
  multiples of 4 (32-bit) or 8 (16-bit), as many key/value heads as query heads; a mask is
  made additive and padded as PyTorch does;
- math: anything else, and every call on other devices (left to PyTorch).

The GPU the choice stands for (`Gpu`) is this machine's when it has one, otherwise one of
compute capability 9.0 with this PyTorch's cuDNN (or, without one, a cuDNN newer than 9.15).
Not followed: PyTorch's `TORCH_CUDNN_SDPA_DEPRIORITIZED` environment variable, and cuDNN's
larger head sizes on some GPUs and cuDNN releases.

Under `tidaloffline.torch.autocast.meta_autocast`, q, k, v and a floating mask are cast to its
16-bit type first, as autocast casts them before PyTorch chooses. Dropout is kept (its random
state is a scalar).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from tidaloffline.torch import autocast

_SDPA = F.scaled_dot_product_attention
_HALF = frozenset({torch.float16, torch.bfloat16})
# PyTorch's SDPBackend numbers (torch.nn.attention.SDPBackend)
_MATH, _FLASH, _EFFICIENT, _CUDNN = 0, 1, 2, 3
_DEFAULT_ORDER = (_FLASH, _EFFICIENT, _MATH, _CUDNN, 4)  # at::Context's, 4 is "overrideable"
_CUDNN_FIRST = (_CUDNN, _FLASH, _EFFICIENT, _MATH)  # priority_order() when cuDNN is preferred


@dataclass(frozen=True)
class Gpu:
    """What PyTorch's choice reads of the GPU it runs on: the compute capability, the runtime
    cuDNN version (as `torch.backends.cudnn.version()` gives it, e.g. 91900 for 9.19.0; None
    when not known, taken as newer than 9.15) and the major CUDA version PyTorch was built for."""

    capability: tuple[int, int] = (9, 0)
    cudnn: int | None = None
    cuda: int = 13

    @classmethod
    def here(cls) -> Gpu:
        """This machine's GPU, or a compute capability 9.0 one when it has none; this
        PyTorch's cuDNN and CUDA."""
        capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
        built = torch.version.cuda  # None for a build without CUDA
        cuda = int(built.split(".")[0]) if built else 13
        return cls(capability, torch.backends.cudnn.version(), cuda)  # type: ignore[no-untyped-call]

    def prefers_cudnn(self) -> bool:
        """PyTorch 2.11's `check_prefer_cudnn_attention` (sdp_utils.cpp): `cudnn_version >
        91500 && (major == 9 || major == 10)`, and `(!minor || minor == 3)` when built with
        `CUDA_VERSION < 13000`."""
        major, minor = self.capability
        new_enough = self.cudnn is None or self.cudnn > 91500
        return new_enough and major in (9, 10) and (self.cuda >= 13 or minor in (0, 3))


def _order(gpu: Gpu) -> Sequence[int]:
    """The kernels in the order PyTorch tries them (sdp_utils.cpp, `priority_order`): the
    context's order (`sdpa_kernel(..., set_priority=True)` sets it), whose default PyTorch
    replaces by cuDNN first on the first call when `check_prefer_cudnn_attention` holds."""
    get = getattr(torch._C, "_get_sdp_priority_order", None)
    order = tuple(get()) if get is not None else _DEFAULT_ORDER
    return _CUDNN_FIRST if order == _DEFAULT_ORDER and gpu.prefers_cudnn() else order


def kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    gpu: Gpu | None = None,
) -> str:
    """ "cudnn", "flash", "efficient" or "math": the kernel PyTorch runs this call with on
    `gpu` (by default `Gpu.here()`), a GPU of compute capability 8.0 or newer (see the
    module)."""
    tensors = (query, key, value)
    if any(t.dim() != 4 or t.is_nested or t.stride(-1) != 1 for t in tensors):
        return "math"
    if any(t.dtype != query.dtype for t in tensors) or any(t.numel() == 0 for t in tensors):
        return "math"
    gpu = Gpu.here() if gpu is None else gpu
    fits = {
        _CUDNN: lambda: _cudnn_fits(query, key, value, attn_mask, enable_gqa, dropout_p, gpu),
        _FLASH: lambda: _flash_fits(query, key, value, attn_mask, enable_gqa),
        _EFFICIENT: lambda: _efficient_fits(query, key, value, attn_mask),
        _MATH: lambda: bool(torch.backends.cuda.math_sdp_enabled()),  # type: ignore[no-untyped-call]
    }
    names = {_CUDNN: "cudnn", _FLASH: "flash", _EFFICIENT: "efficient", _MATH: "math"}
    for backend in _order(gpu):
        if backend in fits and fits[backend]():
            return names[backend]
    return "math"  # none fits: PyTorch's own call runs (and raises where PyTorch raises)


def _cudnn_fits(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    enable_gqa: bool,
    dropout_p: float,
    gpu: Gpu,
) -> bool:
    """PyTorch 2.11's `can_use_cudnn_attention` (sdp_utils.cpp) for dense inputs: the cuDNN
    switch, no deterministic algorithms (unless warn-only), no dropout on cuDNN 9.11 to 9.13
    (`cudnn_version > 91100 && cudnn_version < 91400`), 16-bit inputs (`check_dtypes_low_
    precision`), `check_attn_mask_shape`, sm80 to sm121, a dropout multiple of 1/16, a mask
    with stride 1 in its last dimension, as many heads (any multiple with `enable_gqa`), and
    `check_cudnn_tensor_shapes`: head sizes at most 128 and multiples of 8, no key sequence of 1,
    no query sequence of 1 with dropout."""
    if not torch.backends.cuda.cudnn_sdp_enabled():  # type: ignore[no-untyped-call]
        return False
    deterministic = torch.are_deterministic_algorithms_enabled()
    if deterministic and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    if dropout_p > 0 and gpu.cudnn is not None and 91100 < gpu.cudnn < 91400:
        return False
    if query.dtype not in _HALF or not (8, 0) <= gpu.capability <= (12, 1):
        return False
    if attn_mask is not None:
        if attn_mask.requires_grad or attn_mask.stride(-1) != 1 or attn_mask.dim() not in (2, 4):
            return False
        if attn_mask.shape[-2] not in (query.shape[2], 1):
            return False
        if attn_mask.shape[-1] not in (key.shape[2], 1):
            return False
        if attn_mask.dim() == 4 and not (
            attn_mask.shape[0] in (1, query.shape[0]) and attn_mask.shape[1] in (1, query.shape[1])
        ):
            return False
    if dropout_p * 16 != math.floor(dropout_p * 16):
        return False
    heads = (query.shape[1], key.shape[1], value.shape[1])
    if enable_gqa:
        if heads[0] % heads[1] or heads[0] % heads[2]:
            return False
    elif len(set(heads)) != 1:
        return False
    d_qk, d_v = query.shape[-1], value.shape[-1]
    if d_qk > 128 or d_v > 128 or d_qk % 8 or d_v % 8:
        return False
    return key.shape[2] != 1 and not (dropout_p and query.shape[2] == 1)


def _flash_fits(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    enable_gqa: bool,
) -> bool:
    """`can_use_flash_attention`: 16-bit inputs, no mask, one head size of at most 256."""
    q, k, v = (t.shape[-1] for t in (query, key, value))
    heads_match = query.shape[1] == key.shape[1] == value.shape[1]
    gqa_ok = heads_match or (enable_gqa and query.shape[1] % key.shape[1] == 0)
    return bool(
        torch.backends.cuda.flash_sdp_enabled()  # type: ignore[no-untyped-call]
        and query.dtype in _HALF
        and attn_mask is None
        and q == k == v
        and q <= 256
        and gqa_ok
    )


def _efficient_fits(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None
) -> bool:
    """`can_use_mem_efficient_attention`: 32- or 16-bit inputs, aligned head sizes, as many
    heads, a mask (if any) with stride 1 in its last dimension."""
    q, k, v = (t.shape[-1] for t in (query, key, value))
    align = 8 if query.dtype in _HALF else 4
    return bool(
        torch.backends.cuda.mem_efficient_sdp_enabled()  # type: ignore[no-untyped-call]
        and query.dtype in _HALF | {torch.float32}
        and q == k
        and q % align == 0
        and v % align == 0
        and query.shape[1] == key.shape[1] == value.shape[1]
        and (attn_mask is None or attn_mask.stride(-1) == 1)
    )


def _fused(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor | None:
    """The call run by the fused kernel, None when it is the math path's."""
    if not all(
        isinstance(t, torch.Tensor) and t.device.type == "meta" for t in (query, key, value)
    ):
        return None
    if (low := autocast.active()) is not None:  # cast before the choice, as autocast casts
        query, key, value, attn_mask = autocast.cast((query, key, value, attn_mask), low)
    choice = kernel(query, key, value, attn_mask, enable_gqa, dropout_p)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if choice == "cudnn":
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # made additive as attention.cpp's convert_boolean_attn_mask_cudnn makes it:
            # where(mask.logical_not(), -65504.0, 0 of q's type), not -inf
            zero = torch.zeros((), dtype=query.dtype, device=query.device)
            attn_mask = torch.where(attn_mask.logical_not(), -65504.0, zero)
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            query, key, value, attn_mask, grad, dropout_p, is_causal, False, scale=scale
        )
        return out[0]  # type: ignore[no-any-return]  # the op's first result is its output
    if choice == "flash":
        size = query.shape[-1]
        if scale is None:
            scale = size**-0.5  # of the head size before padding
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            _pad(query, 8), _pad(key, 8), _pad(value, 8), dropout_p, is_causal, False, scale=scale
        )[0]
        return out if out.shape[-1] == size else out[..., :size]  # type: ignore[no-any-return]
    if choice == "efficient":
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # made additive
            neg_inf = torch.full((), float("-inf"), dtype=query.dtype, device=query.device)
            attn_mask = torch.where(attn_mask, 0.0, neg_inf)
        if attn_mask is not None:
            aligned = attn_mask.stride(-1) == 1 and all(s % 8 == 0 for s in attn_mask.stride()[:-1])
            if not aligned:  # padded to a multiple of 8 and sliced back, as PyTorch does
                attn_mask = _pad(attn_mask, 8, always=True)
            attn_mask = attn_mask.expand(*query.shape[:-1], key.shape[-2])
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale
        )
        return out[0]  # type: ignore[no-any-return]  # the op's first result is its output
    return None


def _pad(t: torch.Tensor, multiple: int, always: bool = False) -> torch.Tensor:
    """`t` with its last dimension padded with zeros to the next multiple (a whole `multiple`
    more when it is one already and `always`), sliced back to its size when `always`."""
    size = t.shape[-1]
    extra = multiple - size % multiple if always else -size % multiple
    if not extra:
        return t
    padded = F.pad(t, (0, extra))
    return padded[..., :size] if always else padded


def _sdpa(*args: Any, **kwargs: Any) -> Any:
    """`torch.nn.functional.scaled_dot_product_attention` while `fused_attention` is active."""
    out = _fused(*args, **kwargs)
    return _SDPA(*args, **kwargs) if out is None else out


class _FusedMode(TorchFunctionMode):
    """Routes calls to the builtin made under any other name (`torch._C._nn....`, a name
    bound before the patch) through `_fused`."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA and (out := _fused(*args, **kwargs)) is not None:
            return out
        return func(*args, **kwargs)


_lock = threading.Lock()
_users = 0  # fused_attention contexts open, in any thread


@contextmanager
def fused_attention() -> Iterator[None]:
    """While open, scaled dot-product attention on meta tensors runs the fused kernel a GPU
    would run (see the module); calls on other devices, from any thread, run as before.

    Two paths reach the builtin: `torch.nn.functional.scaled_dot_product_attention`, looked up
    when called (nn.MultiheadAttention and most models call it so; PyTorch's own Python
    functions call it with function modes off), patched while any context is open; and any
    other name for it, caught by a function mode in this thread."""
    global _users
    with _lock:
        if _users == 0:
            F.scaled_dot_product_attention = _sdpa
        _users += 1
    try:
        with _FusedMode():
            yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                F.scaled_dot_product_attention = _SDPA
