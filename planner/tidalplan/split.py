"""Ops too big for their step, and how many parts over the batch bring them under it.

SuperNeurons' op-wise bound (`profile.op_bound`: the most bytes one op touches) is a floor no
swap or recomputation plan can go under: an op's blocks must all be on the device while it
runs. μ-cuDNN divides a convolution's mini-batch into micro-batches run one after another
(mu-cudnn.txt, 3.1); the same division applies to every op whose work is independent per
sample (or per row): convolutions, the log-softmax and negative log-likelihood of a
cross-entropy, attention over batch × heads.

The bound counts whole blocks, so a division lowers it only where the parts are blocks of their
own, made and used part by part:
- the cross-entropy with the output head before it (`LinearCrossEntropy`): each part's logits
  are made, used and freed in turn, in forward and again in backward, so the whole logits and
  their gradient never exist;
- attention with the layer that makes its q, k and v (`BatchSplit`): each part's q, k, v and
  scores are its own.
A convolution run alone in micro-batches still reads and writes its whole input and output
blocks: what its division shrinks is its workspace (`tidalplan.workspace`), not its blocks, so
it is reported, never counted as fitting.

`big_ops` finds the ops whose touched bytes exceed the memory free at their step and says, for
those that can be split, the fewest parts that fit, and for the others why not; `split_bound`
is the op-wise bound the iteration would have with those parts. Kinds are read from the op
names (the aten names the PyTorch recorder writes).
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
# The kinds whose parts are blocks of their own, and what splits them.
SPLIT_WITH = {
    "cross_entropy": "the output head before it (LinearCrossEntropy)",
    "attention": "the layer that makes its q, k and v (BatchSplit)",
}


def kind_of(name: str) -> str | None:
    """The separable kind of an op named `name` ("aten.convolution.default", or the bare
    "convolution"), or None when it is not known to be independent per sample."""
    return _KIND.get(_base(name))


@dataclass(frozen=True, slots=True)
class BigOp:
    """One op over its budget: what it touches, what of that every part must hold, and the
    fewest parts over the batch that fit, or None and `why` not."""

    tick: int
    name: str
    kind: str | None
    touched: int  # distinct blocks it reads or writes, persistent ones included
    fixed: int  # persistent blocks among them: every part reads them whole
    budget: int
    parts: int | None
    why: str = ""  # when `parts` is None

    @property
    def split_touched(self) -> int:
        """What one part touches: the fixed bytes and its share of the rest (rounded up)."""
        if self.parts is None:
            return self.touched
        return self.fixed + -(-(self.touched - self.fixed) // self.parts)


def _blocks_by_tick(it: Iteration) -> dict[int, set[int]]:
    """Per op tick, the distinct blocks it reads or writes."""
    blocks: dict[int, set[int]] = {}
    for a in it.accesses:
        blocks.setdefault(a.tick, set()).add(a.block)
    return blocks


def touched(it: Iteration, blocks: dict[int, set[int]] | None = None) -> dict[int, tuple[int, int]]:
    """Per op tick: (bytes of the distinct blocks it touches, of those the persistent ones).
    `blocks`: `_blocks_by_tick(it)`, when the caller has it."""
    sizes: dict[int, int] = {b.id: int(b.size) for b in it.blocks}
    persistent: dict[int, int] = {b: int(size) for b, size in it.persistent}
    sizes.update(persistent)
    if blocks is None:
        blocks = _blocks_by_tick(it)
    return {
        tick: (
            sum(sizes.get(b, 0) for b in bs),
            sum(persistent.get(b, 0) for b in bs),
        )
        for tick, bs in blocks.items()
    }


def keeping_persistent(it: Iteration, limit: int) -> dict[int, int]:
    """Per op tick, the memory free for the op's blocks when every persistent block (weights,
    optimizer state: live at every step) stays on the device: `limit` less the persistent bytes
    the op does not touch. A plan can swap those too, at a cost every step; this budget leaves
    them in place."""
    total = sum(int(size) for _, size in it.persistent)
    return {tick: limit - (total - fixed) for tick, (_, fixed) in touched(it).items()}


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
        parts, why = None, ""
        if kind is None:
            why = "not known to be independent per sample"
        elif kind not in SPLIT_WITH:
            why = (
                f"a {kind} in parts still reads and writes its whole input and output blocks"
                " (its division shrinks its workspace, not its blocks)"
            )
        elif fixed >= budget:
            why = f"its persistent blocks alone ({fixed} bytes) are over the budget ({budget})"
        else:
            parts = -(-(total - fixed) // (budget - fixed))
        out.append(BigOp(tick, names.get(tick, ""), kind, total, fixed, budget, parts, why))
    return tuple(out)


def parts_by_kind(ops: tuple[BigOp, ...]) -> dict[str, int]:
    """The parts each separable kind needs: the most any of its ops needs (one loss or one
    attention is split once, for all of its forward and backward ops)."""
    out: dict[str, int] = {}
    for op in ops:
        if op.kind is not None and op.parts is not None:
            out[op.kind] = max(out.get(op.kind, 1), op.parts)
    return out


# Matrix products: the output head before a cross-entropy is one of these.
_PRODUCTS = ("mm", "addmm", "bmm", "matmul", "linear")


def split_bound(it: Iteration, parts: Mapping[str, int]) -> int:
    """The op-wise bound of `it` with every op of a kind in `parts` run in that many parts:
    a prediction from the trace, which a recording of the split model checks. Only the kinds
    of `SPLIT_WITH` are split; other entries of `parts` are ignored. A cross-entropy is split
    with its head (`LinearCrossEntropy`), so the matrix products that make its input or use its
    gradient (those touching a transient block a cross-entropy op touches) run in parts too."""
    names: dict[int, str] = {op.tick: op.name for op in it.ops}
    persistent = {b for b, _ in it.persistent}
    by_tick = _blocks_by_tick(it)
    loss_blocks: set[int] = set()
    if "cross_entropy" in parts:
        for tick, blocks in by_tick.items():
            if kind_of(names.get(tick, "")) == "cross_entropy":
                loss_blocks |= blocks - persistent
    best = 0
    for tick, (total, fixed) in touched(it, by_tick).items():
        name = names.get(tick, "")
        kind = kind_of(name) or ""
        k = parts.get(kind, 1) if kind in SPLIT_WITH else 1
        if k == 1 and _base(name) in _PRODUCTS and by_tick.get(tick, set()) & loss_blocks:
            k = parts["cross_entropy"]
        best = max(best, fixed + -(-(total - fixed) // k))
    return best


def _base(name: str) -> str:
    """ "aten.mm.default" -> "mm"."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else parts[0]
