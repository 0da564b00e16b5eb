"""Ops run in micro-batches: parts over the batch, the whole op's results and gradients.

An op can run in parts over the batch (μ-cuDNN's micro-batches): each part is computed, its
result written into the whole, and its temporaries freed before the next part starts. Results
and gradients are those of the unsplit op, up to floating-point rounding. What it saves
depends on what stays whole: `LinearCrossEntropy` and `BatchSplit` make the big tensors inside
them part by part (logits; q, k, v and scores), so no op touches more than about 1/k of them;
a `MicroBatchConv2d` still reads and writes its whole input and output, and its parts shrink
the workspace and temporaries of each call (μ-cuDNN's aim), not those blocks.

    batch  ┌────────────── N ──────────────┐
    parts  ├─ n0 ─┼─ n1 ─┼─ n2 ─┼── ... ──┤     parts_of(N, k): near-equal, larger first
    op     │ op() │ op() │ op() │   ...   │     one part's temporaries at a time
    result └───────────── cat ────────────┘

- `MicroBatchConv2d`: nn.Conv2d, run as one F.conv2d per micro-batch (`micro_batch_convs`
  swaps it in for chosen convolutions of a model).
- `LinearCrossEntropy`: an output head and its cross-entropy fused, over k parts of the rows:
  the (rows, vocabulary) logits are never whole, in forward or in backward.
- `BatchSplit`: any module separable over dim 0 (an attention layer, a transformer block
  without batch normalisation), run on k parts of its batch.

Everything here is ordinary torch ops with no reads of tensor values, so it runs on the meta
device as well (where `tidalpool.torch.record` records a training step).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "BatchSplit",
    "LinearCrossEntropy",
    "MicroBatchConv2d",
    "Sizes",
    "micro_batch_convs",
    "parts_of",
]

Sizes = int | Sequence[int]
"""Micro-batch sizes in order (they must sum to the batch), or an int k: k near-equal parts."""


def parts_of(batch: int, k: int) -> list[int]:
    """`batch` split into `k` near-equal sizes, larger first: parts_of(10, 4) == [3, 3, 2, 2].

    ValueError when k < 1 or k > batch (a part would be empty)."""
    if k < 1:
        raise ValueError(f"parts_of: the number of parts must be at least 1, got {k}")
    if k > batch:
        raise ValueError(f"parts_of: cannot split a batch of {batch} into {k} non-empty parts")
    whole, extra = divmod(batch, k)
    return [whole + 1] * extra + [whole] * (k - extra)


def _checked(sizes: Sizes, who: str) -> int | tuple[int, ...]:
    """`sizes` as given, checked: a positive int, or a non-empty sequence of positive ints."""
    if isinstance(sizes, bool) or not isinstance(sizes, (int, Sequence)):
        raise TypeError(f"{who}: sizes must be an int or a sequence of ints, got {sizes!r}")
    if isinstance(sizes, int):
        if sizes < 1:
            raise ValueError(f"{who}: the number of parts must be at least 1, got {sizes}")
        return sizes
    given = tuple(sizes)
    if not given:
        raise ValueError(f"{who}: sizes is empty: give at least one micro-batch size")
    for n in given:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{who}: micro-batch sizes must be positive ints, got {list(given)}")
    return given


def _resolved(sizes: int | tuple[int, ...], batch: int, who: str) -> list[int]:
    """The micro-batch sizes for an input whose batch is `batch`."""
    if isinstance(sizes, int):
        if sizes > batch:
            raise ValueError(
                f"{who}: cannot split a batch of {batch} into {sizes} non-empty micro-batches"
            )
        return parts_of(batch, sizes)
    if sum(sizes) != batch:
        raise ValueError(
            f"{who}: the micro-batch sizes {list(sizes)} sum to {sum(sizes)}, but the input's"
            f" batch is {batch}"
        )
    return list(sizes)


# -- convolution ----------------------------------------------------------------------------------


class MicroBatchConv2d(nn.Conv2d):
    """nn.Conv2d run as one F.conv2d per micro-batch, the outputs concatenated; backward is
    autograd's, part by part. Same parameters and state_dict keys as nn.Conv2d, so a conv's
    `state_dict` loads into it; `sizes` (keyword) is μ-cuDNN's configuration without its
    algorithms: the micro-batch sizes in order, or an int k for k near-equal parts.

    PyTorch picks each convolution's cuDNN algorithm itself (`torch.backends.cudnn.benchmark`,
    or cuDNN's heuristics), per input shape: the algorithm of each micro-batch is not chosen
    here. An unbatched input (C, H, W) runs whole.
    """

    sizes: int | tuple[int, ...]

    def __init__(self, *args: Any, sizes: Sizes, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sizes = _checked(sizes, type(self).__name__)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, sizes: Sizes) -> MicroBatchConv2d:
        """A micro-batched conv sharing `conv`'s parameters (the same Parameter objects), with
        its hyperparameters and training mode."""
        if not isinstance(conv, nn.Conv2d):
            raise TypeError(f"from_conv: expected a nn.Conv2d, got {type(conv).__name__}")
        made = cls(
            conv.in_channels,
            conv.out_channels,
            cast(tuple[int, int], conv.kernel_size),
            stride=cast(tuple[int, int], conv.stride),
            padding=cast(Any, conv.padding),
            dilation=cast(tuple[int, int], conv.dilation),
            groups=conv.groups,
            bias=conv.bias is not None,
            padding_mode=conv.padding_mode,
            device="meta",  # no bytes: the parameters are replaced by conv's own
            dtype=conv.weight.dtype,
            sizes=sizes,
        )
        made.weight = conv.weight
        made.bias = conv.bias
        made.train(conv.training)
        return made

    def forward(self, input: Tensor) -> Tensor:
        if input.dim() != 4:
            return super().forward(input)
        sizes = _resolved(self.sizes, input.shape[0], type(self).__name__)
        if len(sizes) == 1:
            return cast(Tensor, self._conv_forward(input, self.weight, self.bias))
        parts = [
            self._conv_forward(part, self.weight, self.bias) for part in torch.split(input, sizes)
        ]
        return torch.cat(parts)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sizes={self.sizes}"  # type: ignore[no-untyped-call]


def micro_batch_convs(
    model: nn.Module,
    sizes_for: Mapping[nn.Module | str, Sizes] | Callable[[str, nn.Conv2d], Sizes | None],
) -> list[str]:
    """Replace chosen nn.Conv2d submodules of `model`, in place, by `MicroBatchConv2d`s sharing
    their parameters; return the qualified names replaced, in the model's order.

    `sizes_for` maps a conv (the module, or its qualified name) to its sizes, or is a function
    of (name, conv) returning sizes or None (left as it is). A conv reached under several
    names is replaced by one micro-batched conv at all of them. A key that is not a Conv2d of
    the model is a ValueError naming it."""
    convs: dict[int, list[str]] = {}
    by_id: dict[int, nn.Conv2d] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if name and isinstance(module, nn.Conv2d):
            convs.setdefault(id(module), []).append(name)
            by_id[id(module)] = module
    chosen: dict[int, Sizes] = {}
    if isinstance(sizes_for, Mapping):
        name_to_id = {n: i for i, names in convs.items() for n in names}
        for key, sizes in sizes_for.items():
            if isinstance(key, str):
                if key not in name_to_id:
                    raise ValueError(f"micro_batch_convs: {key!r} is not a nn.Conv2d of the model")
                chosen[name_to_id[key]] = sizes
            elif id(key) in convs:
                chosen[id(key)] = sizes
            else:
                raise ValueError(
                    f"micro_batch_convs: a {type(key).__name__} given is not a nn.Conv2d"
                    " submodule of the model"
                )
    else:
        for ident, names in convs.items():
            got = sizes_for(names[0], by_id[ident])
            if got is not None:
                chosen[ident] = got
    replaced: list[str] = []
    for ident, sizes in chosen.items():
        new = MicroBatchConv2d.from_conv(by_id[ident], sizes)
        for name in convs[ident]:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, new)
            replaced.append(name)
    order = {n: i for i, (n, _) in enumerate(model.named_modules(remove_duplicate=False))}
    return sorted(replaced, key=lambda n: order.get(n, len(order)))


# -- the output head and its cross-entropy ------------------------------------------------------


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The type logsumexp runs in: float32, or float64 for float64 logits."""
    return torch.promote_types(dtype, torch.float32)


class _LinearCrossEntropy(torch.autograd.Function):
    """cross_entropy(hidden @ W^T + b, target) over parts of the rows; saves the per-row
    logsumexp, not the logits, and recomputes each part's logits in backward."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        target: Tensor,
        sizes: list[int],
        ignore_index: int,
        mean: bool,
    ) -> Tensor:
        lses: list[Tensor] = []
        total: Tensor | None = None
        logits_dtype = hidden.dtype
        for h, t in zip(torch.split(hidden, sizes), torch.split(target, sizes), strict=True):
            logits = F.linear(h, weight, bias)  # under autocast: in autocast's type
            logits_dtype = logits.dtype
            wide = logits.to(_wide(logits.dtype))
            del logits
            lse = torch.logsumexp(wide, dim=1)
            valid = t != ignore_index
            picked = wide.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
            del wide
            part = torch.where(valid, lse - picked, 0).sum()
            total = part if total is None else total + part
            lses.append(lse)
        lse_all = torch.cat(lses)
        count = (target != ignore_index).sum()
        assert total is not None  # at least one part
        loss = total / count if mean else total
        ctx.save_for_backward(hidden, weight, bias, target, lse_all, count)  # type: ignore[arg-type]
        ctx.sizes = sizes  # type: ignore[attr-defined]
        ctx.ignore_index = ignore_index  # type: ignore[attr-defined]
        ctx.mean = mean  # type: ignore[attr-defined]
        ctx.logits_dtype = logits_dtype  # type: ignore[attr-defined]
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, target, lse_all, count = ctx.saved_tensors  # type: ignore[attr-defined]
        sizes: list[int] = ctx.sizes  # type: ignore[attr-defined]
        ignore_index: int = ctx.ignore_index  # type: ignore[attr-defined]
        dtype: torch.dtype = ctx.logits_dtype  # type: ignore[attr-defined]
        needs = ctx.needs_input_grad  # type: ignore[attr-defined]
        scale = grad / count if ctx.mean else grad  # type: ignore[attr-defined]
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        grad_hidden = torch.empty_like(hidden) if needs[0] else None
        grad_weight = torch.zeros_like(weight) if needs[1] else None
        grad_bias = torch.zeros_like(bias) if bias is not None and needs[2] else None
        start = 0
        rows = zip(
            torch.split(hidden, sizes),
            torch.split(target, sizes),
            torch.split(lse_all, sizes),
            strict=True,
        )
        for h, t, lse in rows:
            end = start + h.shape[0]
            hc = h.to(dtype)
            # softmax - one_hot(target), rows of ignored targets zero, times d loss / d row:
            # in place, so that one part's (rows, vocabulary) block is all there is.
            g = F.linear(hc, w, b).to(_wide(dtype))
            g.sub_(lse.unsqueeze(1)).exp_()
            valid = t != ignore_index
            g.scatter_add_(1, torch.where(valid, t, 0).unsqueeze(1), lse.new_full((len(t), 1), -1))
            g.mul_((valid * scale).unsqueeze(1))
            gc = g.to(dtype)
            del g
            if grad_hidden is not None:
                grad_hidden[start:end] = gc @ w
            if grad_weight is not None:
                if dtype == weight.dtype:
                    grad_weight.addmm_(gc.t(), hc)
                else:
                    grad_weight += (gc.t() @ hc).to(weight.dtype)
            if grad_bias is not None:
                grad_bias += gc.sum(0).to(grad_bias.dtype)
            del gc, hc  # before the next part's logits
            start = end
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


class LinearCrossEntropy(nn.Module):
    """`F.cross_entropy(head(hidden), target)`, the head and the loss run together over `parts`
    parts of the rows, so the (rows, vocabulary) logits never exist whole.

    Called as `loss = lce(hidden, target)`: hidden (N, D) or (B, T, D), flattened to rows;
    target (N,) or (B, T); fewer than `parts` rows run one row per part. Forward keeps, for
    backward, hidden, the head's parameters, the target and each row's logsumexp (N numbers),
    not the logits; backward computes each part's logits again and turns them into
    softmax - one_hot(target), scaled by the incoming gradient (and 1 / the number of counted
    rows for "mean"), which gives that part's rows of d hidden and adds into d weight and
    d bias. Rows whose target is `ignore_index` count for nothing. The head is registered as a
    submodule (`head.weight`); a weight shared with an embedding receives both gradients, as
    autograd adds them.

    Precision: each part's logits are `F.linear`'s, in its type (under autocast, bf16 or fp16),
    then upcast to float32 (float64 logits stay float64) for the logsumexp, the target's logit
    and softmax - one_hot, as `cross_entropy` runs in float32 under autocast; backward's matrix
    products run in the logits' type again, d weight accumulated in the weight's type.
    """

    def __init__(
        self,
        head: nn.Linear,
        parts: int,
        ignore_index: int = -100,
        reduction: str = "mean",
    ) -> None:
        super().__init__()
        if not isinstance(head, nn.Linear):
            raise TypeError(
                f"LinearCrossEntropy: head must be a nn.Linear, got {type(head).__name__}"
            )
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise ValueError(f"LinearCrossEntropy: parts must be an int >= 1, got {parts!r}")
        if reduction not in ("mean", "sum"):
            raise ValueError(
                f"LinearCrossEntropy: reduction must be 'mean' or 'sum', got {reduction!r}"
            )
        self.head = head
        self.parts = parts
        self.ignore_index = ignore_index
        self.reduction = reduction

    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        width = self.head.in_features
        if hidden.dim() < 2 or hidden.shape[-1] != width:
            raise ValueError(
                f"LinearCrossEntropy: hidden must be (N, {width}) or (B, T, {width}), got"
                f" {tuple(hidden.shape)}"
            )
        rows = hidden.reshape(-1, width)
        targets = target.reshape(-1)
        if targets.shape[0] != rows.shape[0]:
            raise ValueError(
                f"LinearCrossEntropy: {rows.shape[0]} rows of hidden {tuple(hidden.shape)} but"
                f" {targets.shape[0]} targets {tuple(target.shape)}"
            )
        if rows.shape[0] == 0:
            raise ValueError("LinearCrossEntropy: hidden has no rows")
        sizes = parts_of(rows.shape[0], min(self.parts, rows.shape[0]))
        loss = _LinearCrossEntropy.apply(
            rows,
            self.head.weight,
            self.head.bias,
            targets,
            sizes,
            self.ignore_index,
            self.reduction == "mean",
        )
        return cast(Tensor, loss)

    def extra_repr(self) -> str:
        return f"parts={self.parts}, ignore_index={self.ignore_index}, reduction={self.reduction!r}"


# -- any module separable over the batch --------------------------------------------------------


class BatchSplit(nn.Module):
    """`module`, run on parts of its batch: every tensor argument whose dim 0 is the batch
    (dim 0 of the first tensor argument) is split, the others (an attention mask (T, T),
    flags) are passed whole to each part, and tensor outputs (also in tuples, lists and dicts)
    are concatenated along dim 0. Keyword arguments named in `whole` are never split (a (T, T)
    mask when T may equal the batch).

    Only for modules whose result for a row depends on that row alone: one containing batch
    normalisation (statistics over the batch) is refused. Parameters, buffers, submodules and
    state_dict keys are the module's own (no prefix): the wrapper shares them, so the wrapper
    stands in for the module in a model and loads its checkpoints.
    """

    def __init__(self, module: nn.Module, parts: Sizes, whole: Collection[str] = ()) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"BatchSplit: expected a nn.Module, got {type(module).__name__}")
        for name, sub in module.named_modules():
            if isinstance(sub, _BatchNorm):
                where = f"its submodule {name!r}" if name else "it"
                raise ValueError(
                    f"BatchSplit: {type(module).__name__} cannot run in parts of its batch:"
                    f" {where} is a {type(sub).__name__}, whose statistics span the batch"
                )
        self.parts = _checked(parts, "BatchSplit")
        self.whole = frozenset(whole)
        # Shared, not registered: the module's names are the wrapper's names.
        object.__setattr__(self, "module", module)
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._non_persistent_buffers_set = module._non_persistent_buffers_set
        self._modules = module._modules
        self.training = module.training

    module: nn.Module

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        self.module._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self.module._load_from_state_dict(*args, **kwargs)

    def train(self, mode: bool = True) -> BatchSplit:
        self.module.train(mode)
        self.training = mode
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        first = next(_tensors(args, kwargs, self.whole), None)
        if first is None or first.dim() == 0:
            raise ValueError("BatchSplit: no tensor argument with a batch dimension to split")
        batch = first.shape[0]
        sizes = _resolved(self.parts, batch, "BatchSplit")
        if len(sizes) == 1:
            return self.module(*args, **kwargs)

        def split(value: Any) -> tuple[Tensor, ...] | None:
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == batch:
                return torch.split(value, sizes)
            return None

        arg_parts = [split(a) for a in args]
        kwarg_parts = {k: None if k in self.whole else split(v) for k, v in kwargs.items()}
        outputs = []
        for i in range(len(sizes)):
            part_args = [a if p is None else p[i] for a, p in zip(args, arg_parts, strict=True)]
            part_kwargs = {
                k: v if (p := kwarg_parts[k]) is None else p[i] for k, v in kwargs.items()
            }
            outputs.append(self.module(*part_args, **part_kwargs))
        return _joined(outputs)

    def extra_repr(self) -> str:
        return f"{type(self.module).__name__}, parts={self.parts}"


def _tensors(
    args: Sequence[Any], kwargs: Mapping[str, Any], whole: Collection[str]
) -> Iterator[Tensor]:
    """The tensor arguments, positional first, leaving out keywords in `whole`."""
    for a in args:
        if isinstance(a, Tensor):
            yield a
    for k, v in kwargs.items():
        if isinstance(v, Tensor) and k not in whole:
            yield v


def _joined(outputs: list[Any]) -> Any:
    """The parts' outputs as one: tensors concatenated along dim 0, containers element-wise,
    anything else (None, flags) when every part returned the same."""
    first = outputs[0]
    if isinstance(first, Tensor):
        if first.dim() == 0:
            raise ValueError(
                "BatchSplit: the module returned a 0-dim tensor, which has no batch dimension"
                " to concatenate parts along"
            )
        return torch.cat(outputs)
    if isinstance(first, (tuple, list)):
        joined = [_joined([o[i] for o in outputs]) for i in range(len(first))]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*joined)
        return type(first)(joined)
    if isinstance(first, dict):
        return {k: _joined([o[k] for o in outputs]) for k in first}
    if all(o == first for o in outputs[1:]):
        return first
    raise ValueError(f"BatchSplit: the parts returned different {type(first).__name__} values")
