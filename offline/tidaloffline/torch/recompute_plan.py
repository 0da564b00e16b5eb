"""Choosing which blocks to recompute (cost-aware recomputation), on the meta device.

    import tidalpool.torch

    plan = tidalpool.torch.plan_recompute(model, (x, y), loss_fn, optimizer,
                                          blocks=model.blocks, limit=8 << 30)
    plan.apply()                  # the chosen blocks now recompute in backward

`plan_recompute` chooses which of `blocks` to recompute so that a training step fits `limit`
bytes of device memory in the least time, with what recomputation does not free swapped by
tidalpool's swap policy (SuperNeurons' cost-aware recomputation beside its tensor offloading;
`tidalplan.recompute`). On the meta device, without a GPU and without memory:

1. `measure` runs one forward and finds, for each block, the bytes autograd saves inside it
   (what recomputing it frees; its inputs and outputs are not counted) and the roofline
   estimate of its forward's kernels (what recomputing it costs).
2. The blocks are ranked by cost per freed byte. For each count of the cheapest blocks, from
   none to enough to bring the peak under `limit` by themselves, a training step is recorded
   with those blocks recomputed (`record(..., recompute=...)`: the recomputation's kernels and
   allocations in backward are in the trace), and Planner II simulates it under `limit` with
   copies at `bandwidth_gbps` each way.
3. The count whose simulated step is shortest wins.

A prediction from the roofline: only a GPU measures. The simulation swaps any block of the
trace, so it assumes the swapping of planned mode with saved tensors swapped or better.
"""

from __future__ import annotations

import gc
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tidalclient.errors import TidalpoolError
from tidalclient.torch.aten import tensors_in
from tidalclient.torch.recompute import Recomputed, is_recomputed, names_of, recompute
from tidalplan import learn
from tidalplan.autoswap import durations, load
from tidalplan.combined import fit
from tidalplan.policies import swaps_only
from tidalplan.recompute import Candidate, Segment, best, order, prefixes
from tidalplan.simulate import simulate
from torch import nn

from tidaloffline.torch.attention import fused_attention
from tidaloffline.torch.capture import Capture
from tidaloffline.torch.record import _held, _upload, autocast_region, call, record, to_meta
from tidaloffline.torch.roofline import Roofline

__all__ = ["Candidate", "RecomputeError", "RecomputePlan", "Segment", "measure", "plan_recompute"]


class RecomputeError(TidalpoolError, RuntimeError):
    """No choice of recomputed blocks, with swapping, fits the limit."""


def measure(
    model: nn.Module,
    example_batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    blocks: Sequence[nn.Module],
    *,
    roofline: Roofline | None = None,
    autocast: torch.dtype | None = None,
) -> list[Segment]:
    """For each block, what recomputing it would free and cost, from one forward on the meta
    device (the model is not touched; blocks already recomputed are measured as they would
    run without it).

    `freed`: the bytes (rounded as the CUDA caching allocator rounds them) of the storages
    that autograd saves during the block's forward and that the block allocated, less those
    of its outputs, which the next layer holds anyway. `recompute_ns`: the roofline estimate of
    the kernels of the block's forward. A block called twice counts both calls. `start_ns`:
    the estimate of the forward's kernels before the block first runs (a block never run
    gets 0 and frees nothing). `autocast` runs the forward and loss as `record` runs them."""
    names = names_of(model, blocks, "measure")
    meta_of: dict[int, torch.Tensor] = {}
    meta_model = to_meta(model, meta_of)
    meta_loss = to_meta(loss_fn, meta_of) if isinstance(loss_fn, nn.Module) else loss_fn
    meta_blocks = [meta_model.get_submodule(name) for name in names]
    for block in meta_blocks:
        if is_recomputed(block):
            Recomputed((block,)).remove()
    capture = Capture(roofline or Roofline())
    ns = [0] * len(names)
    starts: dict[int, int] = {}  # block index -> compute before it first ran
    saved: list[dict[int, int]] = [{} for _ in names]  # block id -> rounded bytes
    active: list[tuple[int, int, int]] = []  # (block index, first block id, compute_ns) at entry

    def enter(i: int) -> None:
        starts.setdefault(i, capture.compute_ns)
        active.append((i, capture.allocated, capture.compute_ns))

    def leave(i: int, output: Any) -> None:
        j, _, start_ns = active.pop()
        assert j == i, "blocks entered and left out of order"
        ns[i] += capture.compute_ns - start_ns
        for t in tensors_in(output):
            if (b := capture.block_of(t)) is not None:
                saved[i].pop(b[0], None)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if active and (b := capture.block_of(t)) is not None:
            i, first, _ = active[-1]
            if b[0] >= first:
                saved[i][b[0]] = b[1]
        return t

    handles = []
    for i, block in enumerate(meta_blocks):
        handles.append(block.register_forward_pre_hook(lambda _m, _a, i=i: enter(i)))
        handles.append(block.register_forward_hook(lambda _m, _a, out, i=i: leave(i, out)))
    inputs, target = example_batch
    try:
        capture.persistent(_held(meta_model, meta_loss))
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with fused_attention(), capture, hooks, autocast_region(autocast):
            output = call(meta_model, _upload(inputs))
            loss = meta_loss(output, _upload(target))
            del output, loss
    finally:
        for h in handles:
            h.remove()
        capture.close()
        gc.collect()
    return [
        Segment(name, ns[i], sum(saved[i].values()), starts.get(i, 0))
        for i, name in enumerate(names)
    ]


@dataclass(frozen=True, slots=True)
class RecomputePlan:
    """What `plan_recompute` chose, with every candidate it simulated."""

    blocks: tuple[nn.Module, ...]  # the chosen blocks of the model, in the order given
    names: tuple[str, ...]  # their qualified names
    segments: tuple[Segment, ...]  # every block given, as measured
    candidates: tuple[Candidate, ...]  # in the order simulated (0, 1, ... blocks recomputed)
    chosen: Candidate
    limit: int

    @property
    def plain_compute_ns(self) -> int:
        """The step's compute with nothing recomputed (the first candidate's)."""
        return self.candidates[0].compute_ns

    @property
    def overhead(self) -> float:
        """The chosen step's predicted time over the unconstrained step's, less 1."""
        assert self.chosen.step_ns is not None  # a chosen candidate is feasible
        return self.chosen.step_ns / self.plain_compute_ns - 1 if self.plain_compute_ns else 0.0

    def apply(self) -> Recomputed:
        """`recompute(self.blocks)`: the chosen blocks of the model recompute in backward."""
        return recompute(self.blocks)


def plan_recompute(
    model: nn.Module,
    example_batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Any,
    blocks: Sequence[nn.Module],
    *,
    limit: int,
    bandwidth_gbps: float = 50.0,
    roofline: Roofline | None = None,
    place: bool = False,
    place_time_s: float = 1.0,
    set_to_none: bool = False,
    keep_output: bool = True,
    autocast: torch.dtype | None = None,
    progress: Callable[[str], None] | None = None,
) -> RecomputePlan:
    """Which of `blocks` to recompute so a training step fits `limit` bytes soonest (see the
    module). `example_batch`, `loss_fn`, `optimizer`, `set_to_none`, `keep_output` and
    `autocast` are as for `record` (make them match the training loop: they move the peak);
    copies to and from the host run at `bandwidth_gbps` GB/s each way. With `place`, a
    candidate fits only when the placement of what its schedule leaves on the device (Planner
    I, `place_time_s` of search per placement) fits too, as in planned mode, its schedule made
    for a lower limit where needed (`combined.fit`). `progress` gets a line per candidate.

    Raises RecomputeError when no candidate is feasible (the limit is below what a step needs
    with everything recomputed and swapped), ValueError for a limit or bandwidth that is not
    positive or blocks that are not distinct submodules of the model, none inside another."""
    if limit <= 0:
        raise ValueError(f"plan_recompute: limit must be positive, got {limit}")
    if not bandwidth_gbps > 0:
        raise ValueError(f"plan_recompute: bandwidth_gbps must be positive, got {bandwidth_gbps}")
    names = names_of(model, blocks, "plan_recompute")
    gbps = bandwidth_gbps
    say = progress or (lambda _line: None)
    segments = measure(model, example_batch, loss_fn, blocks, roofline=roofline, autocast=autocast)
    ranked = order(segments)
    with tempfile.TemporaryDirectory(prefix="tidalpool-recompute-") as tmp:

        def evaluate(chosen: tuple[int, ...]) -> Candidate:
            events = record(
                model,
                example_batch,
                loss_fn,
                optimizer,
                path=Path(tmp) / f"{len(chosen)}.csv",
                roofline=roofline,
                set_to_none=set_to_none,
                keep_output=keep_output,
                recompute=[blocks[i] for i in chosen],
                autocast=autocast,
            )
            it = learn.extract(events, events.marks())
            peak, compute = int(load(it).max()), int(durations(it).sum())
            step: int | None = compute
            footprint = None
            if place:
                f = fit(it, swaps_only, limit, gbps, gbps, time_limit_s=place_time_s)
                step = f.result.iteration_ns if f.fits else None
                footprint = f.footprint if f.fits else None
            elif peak > limit:
                swaps = swaps_only(it, limit, gbps, gbps)
                result = simulate(it, swaps, limit, gbps, gbps)
                step = result.iteration_ns if result.feasible else None
            c = Candidate(chosen, compute, peak, step, footprint)
            say(
                f"{len(chosen)} of {len(blocks)} blocks recomputed: peak {peak / 2**30:.2f} GiB,"
                f" compute {compute / 1e6:.1f} ms, step "
                + ("infeasible" if step is None else f"{step / 1e6:.1f} ms")
                + ("" if footprint is None else f", placed in {footprint / 2**30:.2f} GiB")
            )
            return c

        candidates = [evaluate(())]
        for k in prefixes(segments, ranked, candidates[0].peak_bytes - limit)[1:]:
            candidates.append(evaluate(tuple(ranked[:k])))
    winner = best(candidates)
    if winner is None:
        least = min(candidates, key=lambda c: c.peak_bytes)
        raise RecomputeError(
            f"plan_recompute: nothing fits {limit} bytes: every candidate is infeasible with"
            f" swapping; the least peak before swapping was {least.peak_bytes} bytes, with"
            f" {len(least.chosen)} of {len(blocks)} blocks recomputed"
        )
    chosen = tuple(sorted(winner.chosen))
    return RecomputePlan(
        blocks=tuple(blocks[i] for i in chosen),
        names=tuple(names[i] for i in chosen),
        segments=tuple(segments),
        candidates=tuple(candidates),
        chosen=winner,
        limit=limit,
    )
