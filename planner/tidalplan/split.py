"""Ops too big for their step, and how many parts over the batch bring them under it.

SuperNeurons' op-wise bound (`autoswap.op_bound`: the most bytes one op touches) is a floor no
swap or recomputation plan can go under: an op's blocks must all be on the device while it
runs. μ-cuDNN divides a convolution's mini-batch into micro-batches run one after another
(mu-cudnn.txt, 3.1); the same division applies to every op whose work is independent per
sample (or per row): convolutions, the log-softmax and negative log-likelihood of a
cross-entropy, attention over batch × heads. Run in k parts, such an op touches its fixed
blocks (weights, which every part reads) and about 1/k of the rest at a time.

`big_ops` finds the ops whose touched bytes exceed the memory free at their step and says, for
those separable over the batch, the fewest parts that fit; `split_bound` is the op-wise bound
the iteration would have with those parts. Which ops are separable is read from their names
(the aten op names the PyTorch recorder writes); an op of another name is reported as too big
and not separable, never split.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tidalplan.model import Iteration

# Kinds of ops independent per sample, by the aten names that compute them (forward and
# backward). Batch normalisation is absent on purpose: its statistics span the batch.
SEPARABLE: dict[str, tuple[str, ...]] = {
    "convolution": ("convolution", "convolution_backward", "_convolution", "cudnn_convolution"),
    "cross_entropy": (
        "_log_softmax",
        "_log_softmax_backward_data",
        "log_softmax",
        "nll_loss_forward",
        "nll_loss_backward",
        "nll_loss",
        "nll_loss2d_forward",
        "nll_loss2d_backward",
        "cross_entropy_loss",
    ),
    "attention": (
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_cudnn_attention_backward",
        "_efficient_attention_forward",
        "_efficient_attention_backward",
        "_flash_attention_forward",
        "_flash_attention_backward",
        "_scaled_dot_product_attention_math",
    ),
}
_KIND = {base: kind for kind, bases in SEPARABLE.items() for base in bases}


def kind_of(name: str) -> str | None:
    """The separable kind of an op named `name` ("aten.convolution.default", or the bare
    "convolution"), or None when it is not known to be independent per sample."""
    parts = name.split(".")
    base = parts[1] if len(parts) >= 2 and parts[0] == "aten" else parts[0]
    return _KIND.get(base)


@dataclass(frozen=True, slots=True)
class BigOp:
    """One op over its budget: what it touches, what of that every part must hold, and the
    fewest parts over the batch that fit (None: not separable, or its fixed bytes alone are
    over the budget)."""

    tick: int
    name: str
    kind: str | None
    touched: int  # distinct blocks it reads or writes, persistent ones included
    fixed: int  # persistent blocks among them: every part reads them whole
    budget: int
    parts: int | None

    @property
    def split_touched(self) -> int:
        """What one part touches: the fixed bytes and its share of the rest (rounded up)."""
        if self.parts is None:
            return self.touched
        return self.fixed + -(-(self.touched - self.fixed) // self.parts)


def touched(it: Iteration) -> dict[int, tuple[int, int]]:
    """Per op tick: (bytes of the distinct blocks it touches, of those the persistent ones)."""
    sizes: dict[int, int] = {b.id: int(b.size) for b in it.blocks}
    persistent: dict[int, int] = {b: int(size) for b, size in it.persistent}
    sizes.update(persistent)
    blocks: dict[int, set[int]] = {}
    for a in it.accesses:
        blocks.setdefault(a.tick, set()).add(a.block)
    return {
        tick: (
            sum(sizes.get(b, 0) for b in bs),
            sum(persistent.get(b, 0) for b in bs),
        )
        for tick, bs in blocks.items()
    }


def big_ops(it: Iteration, limit: int, free: Mapping[int, int] | None = None) -> tuple[BigOp, ...]:
    """The ops of `it` that touch more than the memory free at their step, in tick order.

    `free[tick]` is what the op may hold there; without it (or for a tick it lacks) the
    budget is `limit`, everything else having left the device (the op-wise view). A separable
    op's parts are the fewest k with fixed + ⌈(touched − fixed) / k⌉ ≤ budget."""
    if limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    names: dict[int, str] = {op.tick: op.name for op in it.ops}
    out = []
    for tick, (total, fixed) in sorted(touched(it).items()):
        budget = limit if free is None else min(limit, free.get(tick, limit))
        if total <= budget:
            continue
        kind = kind_of(names.get(tick, ""))
        parts = None
        if kind is not None and fixed < budget:
            parts = -(-(total - fixed) // (budget - fixed))
        out.append(BigOp(tick, names.get(tick, ""), kind, total, fixed, budget, parts))
    return tuple(out)


def parts_by_kind(ops: tuple[BigOp, ...]) -> dict[str, int]:
    """The parts each separable kind needs: the most any of its ops needs (one loss or one
    attention is split once, for all of its forward and backward ops)."""
    out: dict[str, int] = {}
    for op in ops:
        if op.kind is not None and op.parts is not None:
            out[op.kind] = max(out.get(op.kind, 1), op.parts)
    return out


def split_bound(it: Iteration, parts: Mapping[str, int]) -> int:
    """The op-wise bound of `it` with every op of a kind in `parts` run in that many parts:
    a prediction from the trace, which a recording of the split model checks."""
    names: dict[int, str] = {op.tick: op.name for op in it.ops}
    best = 0
    for tick, (total, fixed) in touched(it).items():
        k = parts.get(kind_of(names.get(tick, "")) or "", 1)
        best = max(best, fixed + -(-(total - fixed) // k))
    return best
