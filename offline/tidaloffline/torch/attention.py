"""Scaled dot-product attention on the meta device, run by the kernel a GPU would run.

`torch.nn.functional.scaled_dot_product_attention` picks its kernel by device. On the meta
device (and the CPU) that is the math path: it materialises the `batch × heads × L × S`
score matrix and its softmax, and autograd saves the softmax for backward. On an NVIDIA GPU
of compute capability 8.0 or newer PyTorch picks a fused kernel that never does: flash
attention or memory-efficient attention, each saving only its inputs, its output and one
log-sum-exp per query row. Recording a transformer with the math path puts every layer's
score matrices into the trace (on GPT-2 small at sequence 1,024 and batch 8, 384 MiB a
layer), a peak the GPU never sees.

Within `fused_attention()`, attention on meta tensors calls the fused kernel's own
ATen op (`aten._scaled_dot_product_flash_attention`, `..._efficient_attention`), whose meta
kernels and autograd formulas give the outputs, saved tensors and backward of the GPU's run.
The choice follows PyTorch's CUDA rules (`sdp_utils.cpp`), in its order, under the same
switches (`torch.nn.attention.sdpa_kernel`, `torch.backends.cuda.enable_*_sdp`):

- flash: 16-bit inputs, no `attn_mask`, q, k and v of one head size, at most 256 (padded to
  a multiple of 8, as PyTorch pads it);
- memory-efficient: 32- or 16-bit inputs, q and k of one head size, q and v head sizes
  multiples of 4 (32-bit) or 8 (16-bit), as many key/value heads as query heads; a mask is
  made additive and padded as PyTorch does;
- math: anything else, and every call on other devices (left to PyTorch).

Under `tidaloffline.torch.autocast.meta_autocast`, q, k, v and a floating mask are cast to its
16-bit type first, as autocast casts them before PyTorch chooses.
PyTorch may run cuDNN's attention instead of flash for 16-bit inputs on some GPUs; it saves
the same tensors. Dropout is kept (its random state is a scalar).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from tidaloffline.torch import autocast

_SDPA = F.scaled_dot_product_attention
_HALF = frozenset({torch.float16, torch.bfloat16})


def kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    enable_gqa: bool = False,
) -> str:
    """ "flash", "efficient" or "math": the kernel PyTorch runs this call with on a GPU of
    compute capability 8.0 or newer (see the module)."""
    tensors = (query, key, value)
    if any(t.dim() != 4 or t.is_nested or t.stride(-1) != 1 for t in tensors):
        return "math"
    if any(t.dtype != query.dtype for t in tensors) or any(t.numel() == 0 for t in tensors):
        return "math"
    q, k, v = (t.shape[-1] for t in tensors)
    heads_match = query.shape[1] == key.shape[1] == value.shape[1]
    gqa_ok = heads_match or (enable_gqa and query.shape[1] % key.shape[1] == 0)
    if (
        torch.backends.cuda.flash_sdp_enabled()  # type: ignore[no-untyped-call]
        and query.dtype in _HALF
        and attn_mask is None
        and q == k == v
        and q <= 256
        and gqa_ok
    ):
        return "flash"
    align = 8 if query.dtype in _HALF else 4
    if (
        torch.backends.cuda.mem_efficient_sdp_enabled()  # type: ignore[no-untyped-call]
        and query.dtype in _HALF | {torch.float32}
        and q == k
        and q % align == 0
        and v % align == 0
        and heads_match
    ):
        return "efficient"
    return "math"


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
    choice = kernel(query, key, value, attn_mask, enable_gqa)
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
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
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
