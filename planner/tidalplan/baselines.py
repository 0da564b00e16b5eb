"""Swap plans of the published baselines, for `simulate` to judge: vDNN and SuperNeurons.

    forward                       split                   backward
    ─[conv]─[bn]─[relu]─[conv]─…─┃─[…bwd]─[conv bwd]─[bn bwd]─▶ op ticks
          └─out b (after b's last     prefetch b ─┘└─ b needed
            forward access)            (issued one layer ahead)

Layers are ops. The forward/backward split is the first op whose name contains
"backward" (`aten.nll_loss_backward.default` in the traces): every later op is
backward. An iteration with no such op has no backward pass and nothing to
offload. A convolution is an op whose name contains "convolution"
(`aten.convolution.default` forward, `aten.convolution_backward.default` backward).

A candidate block is swapped out after its last forward access and back in before
its first backward access, so it is never touched while away; `simulate`'s checks
hold by construction and candidates that would break them are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tidalcore.units import Tick

from tidalplan.model import Iteration, Swap, SwapPlan
from tidalplan.simulate import simulate

CONV = "convolution"
BACKWARD = "backward"


@dataclass(frozen=True, slots=True)
class Uses:
    """Which ops touch each transient block (by `Iteration.blocks` index); where backward starts."""

    split: Tick  # first backward op tick; `it.ticks` when there is none
    ticks: tuple[tuple[Tick, ...], ...]  # distinct op ticks accessing block i, ascending
    reads: tuple[frozenset[Tick], ...]  # op ticks reading block i
    writes: tuple[frozenset[Tick], ...]  # op ticks writing block i
    conv: frozenset[Tick]  # op ticks of convolutions, forward and backward

    def first(self, b: int) -> Tick | None:
        return self.ticks[b][0] if self.ticks[b] else None

    def last(self, b: int) -> Tick | None:
        return self.ticks[b][-1] if self.ticks[b] else None

    def last_forward(self, b: int) -> Tick | None:
        """The last access of block b before the split, None if it has none."""
        before = [t for t in self.ticks[b] if t < self.split]
        return before[-1] if before else None

    def next_after(self, b: int, tick: int) -> Tick | None:
        """The first access of block b after `tick`, None if it has none."""
        return next((t for t in self.ticks[b] if t > tick), None)


def uses(it: Iteration) -> Uses:
    """The access analysis every baseline starts from."""
    index = {b.id: i for i, b in enumerate(it.blocks)}
    ticks: list[set[Tick]] = [set() for _ in it.blocks]
    reads: list[set[Tick]] = [set() for _ in it.blocks]
    writes: list[set[Tick]] = [set() for _ in it.blocks]
    for a in it.accesses:
        i = index.get(a.block)
        if i is None:  # persistent, or a block of another iteration
            continue
        ticks[i].add(a.tick)
        (writes if a.write else reads)[i].add(a.tick)
    split = next((op.tick for op in it.ops if BACKWARD in op.name), Tick(it.ticks))
    return Uses(
        split=split,
        ticks=tuple(tuple(sorted(s)) for s in ticks),
        reads=tuple(frozenset(s) for s in reads),
        writes=tuple(frozenset(s) for s in writes),
        conv=frozenset(op.tick for op in it.ops if CONV in op.name),
    )


def _offload(
    it: Iteration, u: Uses, b: int, prefetch_at: Callable[[Tick, Tick], Tick | None]
) -> Swap | None:
    """Block b out after its last forward access and in before its next (backward) access,
    the swap-in issued at `prefetch_at(out_after, in_before)`, clamped to simulate's window
    [out_after + 1, in_before]; None when b is not live across the split that way."""
    out_after = u.last_forward(b)
    if out_after is None:
        return None
    in_before = u.next_after(b, out_after)
    block = it.blocks[b]
    if in_before is None or not block.start < out_after < in_before < block.end:
        return None
    at = prefetch_at(out_after, in_before)
    in_at = max(out_after + 1, at if at is not None else in_before)
    return Swap(block=b, out_after=out_after, in_before=in_before, in_at=Tick(in_at))


def _previous_op(it: Iteration) -> Callable[[Tick, Tick], Tick | None]:
    """vDNN's prefetch one layer ahead: issued at the op just before the one that needs it."""
    op_ticks = [op.tick for op in it.ops]

    def at(out_after: Tick, in_before: Tick) -> Tick | None:
        before = [t for t in op_ticks if t < in_before]
        return before[-1] if before else None

    return at


def _previous_conv(it: Iteration, u: Uses) -> Callable[[Tick, Tick], Tick | None]:
    """SuperNeurons' prefetch one convolution ahead: issued at the last backward convolution
    before the op that needs it, or at the op just before it where no such convolution is."""
    previous_op = _previous_op(it)
    convs = sorted(t for t in u.conv if t >= u.split)

    def at(out_after: Tick, in_before: Tick) -> Tick | None:
        before = [t for t in convs if t < in_before]
        return before[-1] if before else previous_op(out_after, in_before)

    return at


def _vdnn(it: Iteration, conv_only: bool) -> SwapPlan:
    u = uses(it)
    at = _previous_op(it)
    swaps = []
    for b in range(len(it.blocks)):
        readers = [t for t in u.reads[b] if t < u.split and (not conv_only or t in u.conv)]
        if readers and (s := _offload(it, u, b, at)) is not None:
            swaps.append(s)
    return SwapPlan(tuple(swaps))


def vdnn_all(it: Iteration) -> SwapPlan:
    """vDNN_all: offload every block a forward op reads (a layer's input X) and backward needs."""
    return _vdnn(it, conv_only=False)


def vdnn_conv(it: Iteration) -> SwapPlan:
    """vDNN_conv: the same for the blocks a forward convolution reads."""
    return _vdnn(it, conv_only=True)


def _fits(it: Iteration, plan: SwapPlan, limit: int, out_gbps: float, in_gbps: float) -> bool:
    r = simulate(it, plan, limit, out_gbps, in_gbps)
    return r.feasible and r.peak_bytes <= limit


def vdnn_dyn(it: Iteration, limit: int, out_gbps: float, in_gbps: float) -> SwapPlan:
    """vDNN_dyn's profiling pass: of no swapping, vDNN_conv and vDNN_all, the plan that fits
    `limit` with the least simulated overhead (earlier in that order on a tie); vDNN_all, the
    most memory-frugal, when none fits (`simulate` then reports it infeasible)."""
    best: tuple[float, SwapPlan] | None = None
    for plan in (SwapPlan(), vdnn_conv(it), vdnn_all(it)):
        r = simulate(it, plan, limit, out_gbps, in_gbps)
        if r.feasible and r.peak_bytes <= limit and (best is None or r.overhead < best[0]):
            best = (r.overhead, plan)
    return best[1] if best is not None else vdnn_all(it)


def superneurons_candidates(it: Iteration) -> tuple[Swap, ...]:
    """Convolution outputs (written by a forward convolution, next used in backward), prefetched
    one convolution ahead, least recently used (earliest last forward access) first."""
    u = uses(it)
    at = _previous_conv(it, u)
    swaps = []
    for b in range(len(it.blocks)):
        if any(t < u.split and t in u.conv for t in u.writes[b]) and (s := _offload(it, u, b, at)):
            swaps.append(s)
    return tuple(sorted(swaps, key=lambda s: (s.out_after, s.block)))


def superneurons(it: Iteration, limit: int, out_gbps: float, in_gbps: float) -> SwapPlan:
    """SuperNeurons' tensor cache: swap only when memory is short. Candidates are taken in LRU
    order until the simulated iteration fits `limit`; all of them when it never does."""
    swaps: list[Swap] = []
    candidates = superneurons_candidates(it)
    for s in (None, *candidates):
        if s is not None:
            swaps.append(s)
        if _fits(it, SwapPlan(tuple(swaps)), limit, out_gbps, in_gbps):
            break
    return SwapPlan(tuple(swaps))


Baseline = Callable[[Iteration, int, float, float], SwapPlan]

BASELINES: dict[str, Baseline] = {
    "vdnn-all": lambda it, limit, out_gbps, in_gbps: vdnn_all(it),
    "vdnn-conv": lambda it, limit, out_gbps, in_gbps: vdnn_conv(it),
    "vdnn-dyn": vdnn_dyn,
    "superneurons": superneurons,
}
