"""Autocast on the meta device, cast as CUDA casts.

`torch.autocast("cuda")` casts only CUDA tensors: on the meta device a step under autocast
runs in fp32, and its recording holds fp32 activations where a GPU holds 16-bit ones. Within
`meta_autocast(dtype)`, ops on meta tensors are cast by CUDA autocast's own rules
(`aten/src/ATen/autocast_mode.h`), op by op and at the same point of the dispatcher, above
autograd, so the casts are recorded, saved for backward and freed as on a GPU:

- matrix products, convolutions and attention (`POLICY` "lower") run in `dtype`;
- ops that need range or precision ("fp32": layer norm, losses, `exp`, `log`, ...) in fp32;
- reductions and softmaxes with an optional `dtype` ("fp32_set_opt_dtype": `sum`,
  `softmax`, `log_softmax`, ...) read 16-bit inputs and return fp32;
- `norm` computes in fp32 ("fp32_append_dtype"); some ops of several inputs ("promote":
  `addcmul`, `index_put`, `scatter_add`, ...) run in the widest of their inputs' types;
- `binary_cross_entropy` is refused, as autocast refuses it.

A float32 leaf that requires grad (a parameter) is cast to `dtype` once per region, and the
copy kept until the outermost region ends, as autocast's weight cache does. Eligible inputs
are meta tensors of a floating type other than float64, as CUDA autocast takes CUDA ones.

The policies are Python kernels of the dispatch key `AutocastPrivateUse1`, which PyTorch's
own backends leave unused: the kernels are registered while any region is open, and the key
is added to the dispatch of the thread that opened one. Other threads, and tensors on other
devices, are not affected. A region's forward run again by `torch.utils.checkpoint` in
backward is cast the same way when run through `tidalpool.torch.recompute`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from tidalclient.torch.recompute import reenter_in_recomputation
from torch._C import DispatchKey, DispatchKeySet

_KEY = DispatchKey.AutocastPrivateUse1  # type: ignore[attr-defined]  # not in the stubs

_LOWER = (
    "_convolution _convolution.deprecated conv1d conv2d conv3d conv_tbc conv_transpose1d"
    " conv_transpose2d.input conv_transpose3d.input convolution cudnn_convolution"
    " cudnn_convolution_transpose prelu addmm addmv addr matmul einsum mm mv linalg_vecdot"
    " linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell"
    " _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell"
    " _scaled_dot_product_flash_attention scaled_dot_product_attention"
)
_FP32 = (
    "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan"
    " pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm"
    " rms_norm group_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity"
    " poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div"
    " l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss"
    " soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits"
    " dist pdist cdist renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d"
    " upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d"
    " upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d"
    " upsample_bicubic2d _upsample_bicubic2d_aa"
)
_FP32_SET_OPT_DTYPE = (
    "prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm"
    " linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList"
)
# Named-dimension overloads: CUDA autocast lists them up to PyTorch 2.11 (2.13 no longer does).
# Named tensors do not exist on the meta device, so they are listed to mirror CUDA's table.
_NAMED_FP32_SET_OPT_DTYPE = (
    "prod.dim_Dimname softmax.Dimname log_softmax.Dimname cumprod.dimname cumsum.dimname"
    " sum.dim_DimnameList"
)
_PROMOTE = (
    "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"
)

POLICY: dict[str, str] = {
    **dict.fromkeys(_LOWER.split(), "lower"),
    **dict.fromkeys(_FP32.split(), "fp32"),
    **dict.fromkeys(_FP32_SET_OPT_DTYPE.split(), "fp32_set_opt_dtype"),
    **dict.fromkeys(_NAMED_FP32_SET_OPT_DTYPE.split(), "fp32_set_opt_dtype"),
    "norm.Scalar": "fp32_append_dtype",
    "norm.ScalarOpt_dim": "fp32_append_dtype",
    "norm.names_ScalarOpt_dim": "fp32_append_dtype",
    **dict.fromkeys(_PROMOTE.split(), "promote"),
    "binary_cross_entropy": "banned",
}
"""aten op (`name` or `name.overload`) -> cast policy, CUDA autocast's (see the module)."""


def covered() -> dict[str, str]:
    """`POLICY` less the ops that CUDA autocast does not cast in this PyTorch (an op the
    installed version lacks, or does not yet list)."""
    ops = set(torch._C._dispatch_get_all_op_names())
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return {
        name: policy
        for name, policy in POLICY.items()
        if f"aten::{name}" in ops and has(f"aten::{name}", "AutocastCUDA")
    }


_APPEND = {
    "norm.Scalar": "ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "ScalarOpt_dim_dtype",
    "norm.names_ScalarOpt_dim": "names_ScalarOpt_dim_dtype",
}
_BANNED = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast;"
    " use torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss"
)


class _Local(threading.local):
    dtype: torch.dtype | None = None  # of the innermost open region, None outside
    depth = 0  # regions open in this thread

    def __init__(self) -> None:
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> cast


_local = _Local()
_lock = threading.Lock()
_users = 0  # regions open, in any thread
_libraries: tuple[torch.library.Library, torch.library.Library] | None = None


def active() -> torch.dtype | None:
    """The 16-bit type of the `meta_autocast` region open in this thread, None outside one."""
    return _local.dtype


def _eligible(t: object) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == "meta"
        and t.is_floating_point()
        and t.dtype != torch.float64
    )


def cast(value: Any, to: torch.dtype) -> Any:
    """`value` with each eligible tensor in it (alone, or in a list or tuple) cast to `to`, as
    autocast's `cached_cast` casts it."""
    if isinstance(value, (list, tuple)):
        return type(value)(cast(v, to) for v in value)
    if not _eligible(value) or value.dtype == to:
        return value
    cacheable = (
        to == _local.dtype
        and value.dtype == torch.float32
        and value.requires_grad
        and value.is_leaf
        and not value._is_view()
    )
    if not cacheable:
        return value.to(to)
    hit = _local.cache.get(id(value))
    if hit is None:
        hit = _local.cache[id(value)] = (value, value.to(to))
    return hit[1]


def _tensors(args: tuple[Any, ...]) -> Iterator[torch.Tensor]:
    """The eligible tensors among `args`, alone or in lists and tuples."""
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _tensors(tuple(a))
        elif _eligible(a):
            yield a


def _set(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str, value: Any) -> Any:
    """(args, kwargs) with the argument `name` of `op` set to `value`, unless it is given."""
    arguments = op._schema.arguments
    i = next(k for k, a in enumerate(arguments) if a.name == name)
    if arguments[i].kwarg_only:
        if kwargs.get(name) is None:
            kwargs = {**kwargs, name: value}
        return args, kwargs
    if i < len(args):
        if args[i] is None:
            args = (*args[:i], value, *args[i + 1 :])
        return args, kwargs
    if name in kwargs:
        if kwargs[name] is None:
            kwargs = {**kwargs, name: value}
        return args, kwargs
    filled = [arguments[k].default_value for k in range(len(args), i)]
    return (*args, *filled, value), kwargs


def _kernel(op: Any, policy: str) -> Any:
    """The Python kernel of `op` (an OpOverload) under `policy`."""
    name = op.name().removeprefix("aten::")
    appended: Any = getattr(torch.ops.aten.norm, _APPEND[name]) if name in _APPEND else None
    params = op._schema.arguments

    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(DispatchKeySet(_KEY)):
            dtype = _local.dtype
            if dtype is None:  # another thread's kernels, reached from a PrivateUse1 tensor
                return op(*args, **kwargs)
            first = args[0] if args else None
            if policy == "banned":
                raise RuntimeError(f"aten::{name}: {_BANNED}")
            if policy == "fp32_set_opt_dtype":
                if _eligible(first):
                    args, kwargs = _set(op, args, kwargs, "dtype", torch.float32)
            elif policy == "fp32_append_dtype":
                if _eligible(first):
                    full = [*args, *(a.default_value for a in params[len(args) :])]
                    return appended(*full, dtype=torch.float32)
            else:  # lower, fp32, promote (to the widest): every eligible input cast
                wide = policy == "promote" and any(t.dtype == torch.float32 for t in _tensors(args))
                to = torch.float32 if policy == "fp32" or wide else dtype
                args = cast(args, to)
                kwargs = {k: cast(v, to) for k, v in kwargs.items()}
            return op(*args, **kwargs)

    return run


def _overload(name: str) -> Any:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _register() -> tuple[torch.library.Library, torch.library.Library]:
    fallback = torch.library.Library("_", "IMPL")  # type: ignore[no-untyped-call]
    kernels = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    try:
        fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")  # type: ignore[no-untyped-call]
        for name, policy in covered().items():
            kernels.impl(name, _kernel(_overload(name), policy), "AutocastPrivateUse1")  # type: ignore[no-untyped-call]
    except Exception as e:
        kernels._destroy()  # type: ignore[no-untyped-call]
        fallback._destroy()  # type: ignore[no-untyped-call]
        raise RuntimeError(
            "meta_autocast: cannot register kernels for the dispatch key AutocastPrivateUse1,"
            f" which a PrivateUse1 backend in this process may use ({type(e).__name__}: {e})"
        ) from e
    return fallback, kernels


@contextmanager
def meta_autocast(dtype: torch.dtype = torch.bfloat16, enabled: bool = True) -> Iterator[None]:
    """While open, ops on meta tensors in this thread are cast as `torch.autocast("cuda",
    dtype)` casts ops on CUDA tensors (see the module); `enabled=False` turns it off within an
    open region, as `torch.autocast(..., enabled=False)` does."""
    global _users, _libraries
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"meta_autocast: dtype must be torch.bfloat16 or torch.float16, got {dtype}"
        )
    with _lock:
        if _users == 0:
            _libraries = _register()
        _users += 1
    was_dtype = _local.dtype
    was_included = torch._C._dispatch_tls_is_dispatch_key_included(_KEY)
    was_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded(_KEY)
    _local.dtype = dtype if enabled else None
    _local.depth += 1
    torch._C._dispatch_tls_set_dispatch_key_included(_KEY, enabled)
    torch._C._dispatch_tls_set_dispatch_key_excluded(_KEY, not enabled)
    try:
        yield
    finally:
        _local.dtype = was_dtype
        torch._C._dispatch_tls_set_dispatch_key_included(_KEY, was_included)
        torch._C._dispatch_tls_set_dispatch_key_excluded(_KEY, was_excluded)
        _local.depth -= 1
        if _local.depth == 0:
            _local.cache.clear()
        with _lock:
            _users -= 1
            if _users == 0 and _libraries is not None:
                for library in _libraries:
                    library._destroy()  # type: ignore[no-untyped-call]
                _libraries = None


def _recomputation_context() -> Callable[[], AbstractContextManager[None]] | None:
    """What a recomputed block's recomputation re-enters: this thread's open region, if any
    (torch.utils.checkpoint restores `torch.autocast`'s state, not this one's)."""
    dtype = active()
    if dtype is None:
        return None
    return lambda: meta_autocast(dtype)


reenter_in_recomputation(_recomputation_context)
