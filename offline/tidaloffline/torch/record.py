"""`record()`: a trace CSV v1 of real training iterations, without a GPU and without memory.

The model, the loss (when it is a module) and the batch are copied to the meta device, the
optimizer is rebuilt for the copy, and `iterations` training steps run under a `Capture`:

    alloc parameters and buffers           persistent: they live across iterations
    iter 0   zero_grad, batch to device, forward, loss, backward, optimizer step
             (gradients and optimizer state appear here, and persist)
    iter 1   the steady iteration: what `tidalpool plan` and the daemon extract
    iter 2   the same again: it shows that iter 1 repeats, and when what iter 1 left alive
             (gradients set to None at the next step, a kept output) is freed

Fewer than MIN_ITERATIONS are refused: such a trace has no steady iteration to plan.

Each iteration runs in a function, so its batch, output and loss are freed at its end (the
output once the loss is computed, with `keep_output=False`).
Activations autograd saves for backward live until backward has used them (their storages
go when autograd releases them). The caller's model, loss, batch and optimizer are never
touched: meta copies of parameters take no memory, whatever the model's size.
"""

from __future__ import annotations

import copy
import gc
import inspect
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, TypeVar

import torch
from tidalclient.errors import TidalpoolError
from tidalclient.torch.aten import tensors_in
from tidalclient.torch.recompute import is_recomputed, names_of
from tidalclient.torch.recompute import recompute as recompute_blocks
from tidalcore.events import Events
from torch import nn
from torch.optim import Optimizer

from tidaloffline.formats import write_trace_csv
from tidaloffline.torch.attention import fused_attention
from tidaloffline.torch.autocast import meta_autocast
from tidaloffline.torch.capture import GRANULE, Capture
from tidaloffline.torch.roofline import Roofline

OptimizerFactory = Callable[[nn.Module], Optimizer]
"""Builds the optimizer for a model (the meta copy): `lambda m: SGD(m.parameters(), lr=0.1)`."""

_M = TypeVar("_M", bound=nn.Module)

MIN_ITERATIONS = 3
"""The first iteration allocates what later ones keep (gradients, optimizer state), the second
is the steady one `tidalpool plan` and `simulate` take, and the third repeats it."""


class RecordError(TidalpoolError, RuntimeError):
    """The training step cannot run on the meta device; the message says where and why."""


def record(
    model: nn.Module,
    example_batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Optimizer | OptimizerFactory,
    iterations: int = MIN_ITERATIONS,
    *,
    path: str | os.PathLike[str],
    roofline: Roofline | None = None,
    set_to_none: bool = False,
    keep_output: bool = True,
    recompute: Sequence[nn.Module] = (),
    autocast: torch.dtype | None = None,
    batches: Sequence[tuple[Any, Any]] = (),
) -> Events:
    """Run `iterations` training steps on the meta device, write their trace to `path`, and
    return its events.

    `batches`: example batches of other shapes (a smaller last batch, other sequence lengths).
    The steps then go round `example_batch` and each of `batches` in turn, `iterations` rounds,
    and each iteration is named by its batch's shape (`shape_of`), as a job names it with
    `Session.step(shape=)`: `tidalpool plan`, `simulate` and `replay` take a shape at a time.

    `example_batch` is `(inputs, target)`: each step calls `model(inputs)` (`model(*inputs)`
    for a tuple or list, `model(**inputs)` for a dict) and `loss_fn(output, target)`, which
    must return a scalar tensor. Tensors anywhere in the batch are copied to the device at
    the start of each step, as a training loop uploads each batch.

    `optimizer` is either the optimizer built for `model`, rebuilt here as
    `type(optimizer)(param_groups, **optimizer.defaults)` with the meta copies in its groups
    (the defaults its constructor takes; its state, if any, is not carried over), or a factory
    that builds one for the model it is given. Param groups whose `foreach` is None get True,
    PyTorch's choice on a GPU.

    Steps start with `optimizer.zero_grad(set_to_none=set_to_none)`: by default gradients are
    zeroed in place and so persist like the parameters; with `set_to_none=True` they are freed
    at each step's start and allocated again in backward.

    `keep_output=True` holds the model's output until the step ends, as a loop that names it
    does (`output = model(x)`, `loss = loss_fn(output, y)`, backward, step); `False` drops it
    once the loss is computed, as `loss = loss_fn(model(x), y)` does (autograd still holds
    whatever backward needs of it). A large output, such as a language model's logits, makes
    the two steps' peaks differ by its size.

    `roofline` estimates the op durations (default: an H100 SXM, see `Roofline`). Scaled
    dot-product attention runs the fused kernel a GPU would (`tidaloffline.torch.attention`),
    not the meta device's math path, whose score matrices a GPU never makes.
    `recompute`: blocks of the model to record as `tidalpool.torch.recompute` runs them
    (their saved tensors dropped after their forward and rebuilt in backward); the model itself
    is not changed.
    `autocast` (torch.bfloat16 or torch.float16) runs each step's forward and loss as
    `with torch.autocast("cuda", dtype=autocast):` runs them on a GPU
    (`tidaloffline.torch.autocast.meta_autocast`); backward and the optimizer step run outside.
    `iterations` is at least MIN_ITERATIONS (3): the first one allocates gradients and
    optimizer state, the second is the steady one `tidalpool plan` and `simulate` take, and
    the third repeats it.

    Raises ValueError or TypeError for unusable arguments (a model without trainable
    parameters, an optimizer over other tensors or that cannot be rebuilt) and RecordError
    when a step cannot run on the meta device (code that reads tensor values, such as
    `.item()` or data-dependent shapes, needs real data).
    """
    if iterations < MIN_ITERATIONS:
        raise ValueError(
            f"record: iterations must be at least {MIN_ITERATIONS}, got {iterations}: the first"
            " allocates what later ones keep (gradients, optimizer state), the second is the"
            " steady one tidalpool plan and simulate take, and the third repeats it, showing"
            " when what the second leaves alive is freed"
        )
    for batch in (example_batch, *batches):
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            what = type(batch).__name__
            if isinstance(batch, (tuple, list)):
                what += f" of length {len(batch)}"
            raise TypeError(f"record: example_batch must be a pair (inputs, target), got a {what}")
    rounds = [(example_batch, "")]
    if batches:
        rounds = [(b, shape_of(b)) for b in (example_batch, *batches)]
        named = [shape for _, shape in rounds]
        if len(set(named)) < len(named):
            raise ValueError(f"record: two example batches have the same shape ({named})")
    parameters = list(model.parameters())
    if not parameters:
        raise ValueError(f"record: the model ({type(model).__name__}) has no parameters to train")
    if not any(p.requires_grad for p in parameters):
        raise ValueError(
            f"record: no parameter of the model ({type(model).__name__}) requires grad"
        )
    if autocast not in (None, torch.bfloat16, torch.float16):
        raise ValueError(
            f"record: autocast must be torch.bfloat16, torch.float16 or None, got {autocast}"
        )
    roofline = roofline or Roofline()

    meta_of: dict[int, torch.Tensor] = {}
    meta_model = to_meta(model, meta_of)
    meta_loss = to_meta(loss_fn, meta_of) if isinstance(loss_fn, nn.Module) else loss_fn
    meta_optimizer = _optimizer(optimizer, meta_model, meta_of)
    if recompute:
        blocks = [meta_model.get_submodule(n) for n in names_of(model, recompute, "record")]
        recompute_blocks(b for b in blocks if not is_recomputed(b))

    capture = Capture(roofline)
    collecting = gc.isenabled()
    gc.disable()  # cyclic garbage is freed at iteration ends, not at random points
    try:
        capture.persistent(_held(meta_model, meta_loss))
        with fused_attention(), capture:
            for i, (batch, shape) in enumerate(rounds * iterations):
                capture.begin_iteration(shape)
                _step(
                    i,
                    meta_model,
                    batch,
                    meta_loss,
                    meta_optimizer,
                    set_to_none=set_to_none,
                    keep_output=keep_output,
                    autocast=autocast,
                )
                gc.collect(0)  # all the step made is young: the gc has not run since
            capture.settle()
        events = capture.events()
    finally:
        capture.close()
        if collecting:
            gc.enable()
    described = "; ".join(
        ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors_in(b))
        for b, _ in rounds
    )
    write_trace_csv(
        Path(path),
        events,
        comments=[
            f"tidalpool trace v1; model={type(model).__name__} batch={described or 'none'}"
            f" optimizer={type(meta_optimizer).__name__} iters={iterations * len(rounds)}"
            + ("" if autocast is None else f" autocast={str(autocast).removeprefix('torch.')}"),
            f"recorded on the meta device; sizes rounded to {GRANULE} B as the CUDA caching"
            " allocator rounds them",
            f"op ns = roofline estimate: {roofline.flops_per_s:.4g} FLOP/s (32/64-bit),"
            f" {roofline.tensor_flops_per_s:.4g} FLOP/s (16/8-bit), {roofline.bytes_per_s:.4g}"
            f" B/s, host {roofline.host_bytes_per_s:.4g} B/s, at least {roofline.min_op_ns} ns",
        ],
    )
    return events


def _step(
    i: int,
    model: nn.Module,
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Optimizer,
    *,
    set_to_none: bool,
    keep_output: bool,
    autocast: torch.dtype | None = None,
) -> None:
    """One training step on the device; what it made and did not keep goes when it returns."""
    try:
        optimizer.zero_grad(set_to_none=set_to_none)
        x, y = _upload(batch[0]), _upload(batch[1])
        with autocast_region(autocast):
            output = call(model, x)
            loss = loss_fn(output, y)
        if not keep_output:
            del output
    except Exception as e:
        raise RecordError(
            f"record: the forward of iteration {i} cannot run on the meta device"
            f" ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"record: loss_fn returned {type(loss).__name__}, expected a scalar tensor")
    if loss.numel() != 1:
        raise TypeError(
            f"record: loss_fn returned a tensor of shape {tuple(loss.shape)}, expected a scalar"
        )
    if not loss.requires_grad:
        raise ValueError("record: the loss does not require grad: nothing to backpropagate")
    try:
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in PyTorch
        optimizer.step()
    except Exception as e:
        raise RecordError(
            f"record: the backward or optimizer step of iteration {i} cannot run on the meta"
            f" device ({type(e).__name__}: {e})"
        ) from e


def shape_of(batch: tuple[Any, Any]) -> str:
    """A batch's shape as its iterations are named: its inputs' tensors' sizes, "x" between
    dimensions and "," between tensors ("4x128", "8x3x224x224"); "scalar" for none."""
    sizes = ["x".join(str(d) for d in t.shape) or "scalar" for t in tensors_in(batch[0])]
    return ",".join(sizes) or "scalar"


def autocast_region(dtype: torch.dtype | None) -> AbstractContextManager[None]:
    """`meta_autocast(dtype)`, or nothing for None."""
    return nullcontext() if dtype is None else meta_autocast(dtype)


def call(model: nn.Module, x: Any) -> Any:
    """`model(**x)` for a dict, `model(*x)` for a tuple or list, `model(x)` otherwise."""
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, (tuple, list)):
        return model(*x)
    return model(x)


def to_meta(module: _M, meta_of: dict[int, torch.Tensor]) -> _M:
    """A deep copy of the module on the meta device, made without copying any parameter's bytes.

    Adds to `meta_of` the `id()` of each of the module's parameters and buffers, mapped to its
    meta copy; those already in it are reused (a loss sharing the model's parameters keeps
    sharing them; a parameter tied within the module stays tied).
    """
    for p in module.parameters():
        if id(p) not in meta_of:
            meta_of[id(p)] = nn.Parameter(
                torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
            )
    for b in module.buffers():
        if id(b) not in meta_of:
            meta_of[id(b)] = torch.empty_like(b, device="meta")
    memo: dict[int, Any] = dict(meta_of)  # deepcopy takes these instead of copying
    return copy.deepcopy(module, memo)


def _optimizer(
    given: Optimizer | OptimizerFactory, model: nn.Module, meta_of: dict[int, torch.Tensor]
) -> Optimizer:
    """The optimizer for the meta model: rebuilt from `given`, or made by the factory."""
    if isinstance(given, Optimizer):
        groups = []
        for g in given.param_groups:
            params = []
            for p in g["params"]:
                meta = meta_of.get(id(p))
                if meta is None:
                    raise ValueError(
                        f"record: the optimizer updates a tensor of shape {tuple(p.shape)} that is"
                        " not a parameter of the model or of loss_fn"
                    )
                params.append(meta)
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
        kind = type(given)
        # Each group carries every hyperparameter; the constructor gets the defaults it takes
        # (AdamW's defaults hold `decoupled_weight_decay`, which its constructor fixes).
        accepted = inspect.signature(kind).parameters
        anything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        defaults = {k: v for k, v in given.defaults.items() if anything or k in accepted}
        try:
            optimizer = kind(groups, **defaults)
        except Exception as e:
            raise TypeError(
                f"record: cannot rebuild {kind.__name__} for the meta copy of the model"
                f" ({type(e).__name__}: {e}); pass a factory instead, e.g."
                f" optimizer=lambda model: {kind.__name__}(model.parameters(), ...)"
            ) from e
    elif callable(given):
        optimizer = given(model)
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"record: the optimizer factory returned {type(optimizer).__name__},"
                " expected a torch.optim.Optimizer"
            )
        copies = {id(t) for t in meta_of.values()}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in copies:
                    raise ValueError(
                        "record: the optimizer factory's optimizer updates a tensor of shape"
                        f" {tuple(p.shape)} on {p.device} that is not a parameter of the model"
                        " it was given"
                    )
    else:
        raise TypeError(
            "record: optimizer must be a torch.optim.Optimizer or a function of the model that"
            f" returns one, got {type(given).__name__}"
        )
    for g in optimizer.param_groups:
        if g.get("foreach", False) is None and not g.get("differentiable", False):
            g["foreach"] = True
    return optimizer


def _held(model: nn.Module, loss_fn: Any) -> list[torch.Tensor]:
    tensors = [*model.parameters(), *model.buffers()]
    if isinstance(loss_fn, nn.Module):
        tensors += [*loss_fn.parameters(), *loss_fn.buffers()]
    return tensors


def _upload(value: Any) -> Any:
    """The value with every tensor in it copied to the meta device (a new storage each)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("meta", copy=True).requires_grad_(value.requires_grad)
    if isinstance(value, tuple):
        items = [_upload(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)  # named tuple
    if isinstance(value, list):
        return [_upload(v) for v in value]
    if isinstance(value, dict):
        return {k: _upload(v) for k, v in value.items()}
    return value
