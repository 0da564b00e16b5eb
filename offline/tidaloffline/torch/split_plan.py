"""Splitting the ops too big for their step over the batch, on the meta device.

    import tidalpool.torch

    split = tidalpool.torch.plan_split(model, (x, y), F.cross_entropy, optimizer,
                                       limit=8 << 30, head="head")
    loss_fn = split.loss_fn        # the model now returns what went into its head

1. A training step is recorded (`record`) and `tidalplan.split.big_ops` finds the ops that
   touch more than the memory free at their step (the limit less the weights and optimizer
   state they do not touch; with `keep_persistent=False`, the limit alone: SuperNeurons'
   op-wise bound, under which no swap or recomputation plan fits), with the fewest parts over
   the batch that bring each under it.
2. The split is applied: the cross-entropy (log-softmax and negative log-likelihood, forward
   and backward) runs in parts with the model's output head, named by `head`, which leaves
   the model (`LinearCrossEntropy`: each part's logits made, used and freed in turn, in
   forward and again in backward, so the logits and their gradient are never whole).
3. The step is recorded again: the op-wise bound and peak it really has, beside the bound the
   planner predicted from the first trace.

4. With `blocks` (modules independent per sample: transformer layers), while ops are still
   over, each block runs in k parts (`BatchSplit`): what it makes inside (q, k, v and the
   attention's scores, the MLP's hidden and its GELU) is made part by part. k comes from the
   worst op's excess and the step is recorded again after each choice, until nothing is over,
   a round does not lower the bound, or k reaches the batch.

Ops over the limit in the first recording that the cross-entropy's split does not cover are
listed in `SplitPlan.unsplit` with why, never ignored: ops not independent per sample,
convolutions (whose division shrinks their workspace, not their blocks: `MicroBatchConv2d`
and `tidalplan.workspace`), attention and the rest (inside `blocks`, if given, step 4 splits
them; `bound_after` says what is left).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from tidalclient.errors import TidalpoolError
from tidalclient.torch.microbatch import BatchSplit, LinearCrossEntropy
from tidalplan import learn
from tidalplan.autoswap import durations, load, op_bound
from tidalplan.model import Iteration
from tidalplan.split import BigOp, big_ops, keeping_persistent, parts_by_kind, split_bound
from torch import nn

from tidaloffline.torch.record import record

__all__ = ["SplitError", "SplitPlan", "plan_split"]

_CROSS_ENTROPY = (torch.nn.functional.cross_entropy,)


class SplitError(TidalpoolError, ValueError):
    """An op must be split for the limit and cannot be (or not by this module)."""


@dataclass
class SplitPlan:
    """What `plan_split` found and did. Byte counts are of the steady recorded iteration."""

    loss_fn: Callable[[Any, Any], torch.Tensor]  # the loss to train with from now on
    big: tuple[BigOp, ...]  # ops over the limit before the split
    parts: dict[str, int]  # per kind split, the parts it runs in
    unsplit: tuple[BigOp, ...] = ()  # over the limit and left whole
    bound_before: int = 0  # op-wise bound before
    bound_predicted: int = 0  # `split_bound` of the first trace
    bound_after: int = 0  # op-wise bound recorded after the split
    peak_before: int = 0
    peak_after: int = 0
    compute_before_ns: int = 0  # the step's op time, unconstrained (roofline)
    compute_after_ns: int = 0  # the same with the split (a split loss computes its head twice)
    blocks: tuple[BatchSplit, ...] = ()  # the blocks, each now run in `block_parts` parts
    block_parts: int = 1


def plan_split(
    model: nn.Module,
    example_batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Any,
    *,
    limit: int,
    head: str | None = None,
    blocks: Sequence[nn.Module] = (),
    keep_persistent: bool = True,
    **record_options: Any,
) -> SplitPlan:
    """Split over the batch, in place, the ops of `model` too big for `limit` (see the module).
    An op is too big when it touches more than the memory free at its step: `limit` less the
    persistent blocks it does not touch (weights and optimizer state stay on the device,
    `tidalplan.split.keeping_persistent`), or `limit` alone with `keep_persistent=False` (the
    op-wise bound: everything else swapped out around the op).

    `blocks`: submodules to run in parts while ops are still over (step 4 of the module); they
    must not contain batch normalisation. `SplitPlan.blocks` are their `BatchSplit`s, to pass
    as `plan_recompute`'s blocks.

    `head`: the qualified name of the `nn.Linear` whose output is the loss's input, needed
    when the cross-entropy must be split; `loss_fn` must then be
    `torch.nn.functional.cross_entropy` or an `nn.CrossEntropyLoss` with its defaults
    (`ignore_index` and `reduction` "mean" or "sum" carried over). `record_options` go to
    `record` for both recordings (`autocast`, `set_to_none`, `keep_output`, `roofline`).

    Raises SplitError when an op over the limit is separable but cannot be split here (no
    `head`, another loss), and ValueError for a limit that is not positive."""
    if limit <= 0:
        raise ValueError(f"plan_split: limit must be positive, got {limit}")
    own = {id(m) for m in model.modules()}
    stray = [type(b).__name__ for b in blocks if id(b) not in own or b is model]
    if stray:
        raise SplitError(f"plan_split: blocks must be submodules of the model, not {stray[0]}")
    with tempfile.TemporaryDirectory(prefix="tidalpool-split-") as tmp:
        events = record(
            model, example_batch, loss_fn, optimizer, path=Path(tmp) / "plain.csv", **record_options
        )
        it = learn.extract(events, events.marks())
        big = big_ops(it, limit, keeping_persistent(it, limit) if keep_persistent else None)
        parts = {k: v for k, v in parts_by_kind(big).items() if k == "cross_entropy"}
        plan = SplitPlan(
            loss_fn=loss_fn,
            big=big,
            parts=parts,
            unsplit=tuple(op for op in big if op.kind != "cross_entropy" or op.parts is None),
            bound_before=op_bound(it),
            bound_predicted=split_bound(it, parts),
            peak_before=int(load(it).max()),
            compute_before_ns=int(durations(it).sum()),
        )

        def again(name: str) -> Iteration:
            events = record(
                model,
                example_batch,
                plan.loss_fn,
                optimizer,
                path=Path(tmp) / f"{name}.csv",
                **record_options,
            )
            return learn.extract(events, events.marks())

        if "cross_entropy" in parts:
            plan.loss_fn = _split_loss(model, loss_fn, head, parts["cross_entropy"])
            it = again("split")
        if blocks:
            budget = keeping_persistent if keep_persistent else None
            it = _split_blocks(plan, model, example_batch, blocks, it, limit, budget, again)
        plan.bound_after, plan.peak_after = op_bound(it), int(load(it).max())
        plan.compute_after_ns = int(durations(it).sum())
    return plan


def _split_loss(
    model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], head: str | None, parts: int
) -> LinearCrossEntropy:
    """The model's head moved into a `LinearCrossEntropy` of `parts` parts."""
    if head is None:
        raise SplitError(
            f"plan_split: the cross-entropy must run in {parts} parts to fit, which needs the"
            " output head that feeds it: pass head='<name of its nn.Linear>'"
        )
    ignore_index, reduction = -100, "mean"
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        if loss_fn.weight is not None or loss_fn.label_smoothing:
            raise SplitError(
                "plan_split: a cross-entropy with class weights or label smoothing cannot be"
                " split here"
            )
        ignore_index, reduction = loss_fn.ignore_index, loss_fn.reduction
    elif loss_fn not in _CROSS_ENTROPY:
        raise SplitError(
            f"plan_split: the cross-entropy must run in {parts} parts to fit, and only"
            " torch.nn.functional.cross_entropy or nn.CrossEntropyLoss can be split, not"
            f" {getattr(loss_fn, '__name__', type(loss_fn).__name__)}"
        )
    try:
        linear = model.get_submodule(head)
    except AttributeError as e:
        raise SplitError(f"plan_split: the model has no submodule {head!r}") from e
    if not isinstance(linear, nn.Linear):
        raise SplitError(f"plan_split: {head!r} is a {type(linear).__name__}, not an nn.Linear")
    model.set_submodule(head, nn.Identity())
    return LinearCrossEntropy(linear, parts, ignore_index=ignore_index, reduction=reduction)


_ROUNDS = 4  # recordings with the blocks split, each with more parts than the last


def _split_blocks(
    plan: SplitPlan,
    model: nn.Module,
    example_batch: tuple[Any, Any],
    blocks: Sequence[nn.Module],
    it: Iteration,
    limit: int,
    budget: Callable[[Iteration, int], dict[int, int]] | None,
    again: Callable[[str], Iteration],
) -> Iteration:
    """While ops are still over their budget, `blocks` (modules independent per sample, such as
    transformer layers) run in k parts each (`BatchSplit`), so what they make inside (q, k, v,
    scores, the MLP's hidden) is made part by part; k from the worst op's excess, the step
    recorded again after each choice. Stops when nothing is over, when a round does not lower
    the bound (the ops over are outside the blocks, or their input and output), or at the
    batch. Returns the last recording kept."""
    names = {id(m): n for n, m in model.named_modules()}
    inputs = example_batch[0]
    first = inputs[0] if isinstance(inputs, (tuple, list)) and inputs else inputs
    batch = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else 1
    k, kept = 1, list[nn.Module](blocks)  # what stands in the model for each block
    for _ in range(_ROUNDS):
        over = big_ops(it, limit, None if budget is None else budget(it, limit))
        if not over or k >= batch:
            break
        need = max(-(-op.touched // max(op.budget, 1)) for op in over)
        wanted = min(batch, max(k + 1, k * need))
        split = list[nn.Module](BatchSplit(b, wanted) for b in blocks)
        for b, wrapped in zip(blocks, split, strict=True):
            model.set_submodule(names[id(b)], wrapped)
        tried = again(f"blocks{wanted}")
        if op_bound(tried) >= op_bound(it):
            for b, was in zip(blocks, kept, strict=True):  # no better: as they were
                model.set_submodule(names[id(b)], was)
            break
        it, k, kept = tried, wanted, split
    if k > 1:
        plan.blocks = tuple(cast(list[BatchSplit], kept))
        plan.block_parts = k
    return it
