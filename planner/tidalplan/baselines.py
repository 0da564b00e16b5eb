"""Swap plans of the published baselines, for `simulate` to judge: vDNN and SuperNeurons.

    forward                       split                   backward
    ─[conv]─[bn]─[relu]─[conv]─…─┃─[…bwd]─[conv bwd]─[bn bwd]─[relu bwd]─[conv bwd]─▶ op ticks
          └─out b (after b's last      prefetch b ─┘                       └─ b needed
            forward access)            (vDNN: searched from each backward layer up to
                                        the next convolution, Fig. 10)

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

from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, replace

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
    """A prefetch one op ahead: issued at the op just before the one that needs it."""
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


def find_prefetch_layers(
    backward: Sequence[Tick], offloaded: Set[Tick], conv: Set[Tick]
) -> dict[Tick, Tick]:
    """vDNN's findPrefetchLayer (III-B, Fig. 10), run before each backward layer in turn:
    {layer whose offloaded inputs are prefetched: the layer whose backward launches it}.

    "Before stream_{compute} starts a layer's backward computation, vDNN first searches for
    a potential layer that requires prefetching of its X"; Fig. 10: "Notice how the search
    operation is only up to the next closest CONV layer (line 14)". The pseudo-code walks
    from the current layer towards the input (`id = currLayerId-1` down to 0): the first
    layer that offloaded its X and is not yet prefetched is marked and returned; a CONV
    layer that is not one ends the search with none (-1). Here the layers are the `backward`
    op ticks in order, the next layer towards the input being the next backward op; a layer
    "offloaded its X" when it is in `offloaded` (it is the first backward use of an
    offloaded block); `conv` holds the convolutions. So a layer's inputs are prefetched at
    the closest backward layer before it from which no convolution lies between (a
    convolution may itself be the prefetched layer): at the previous convolution's backward
    where one is, and where none is, as far back as the search reaches (the first backward
    layer at the most). The first backward layer's own inputs are never searched for."""
    found: dict[Tick, Tick] = {}
    for k, current in enumerate(backward):
        for layer in backward[k + 1 :]:
            if layer in offloaded and layer not in found:
                found[layer] = current
                break
            if layer in conv:
                break
    return found


def _vdnn(it: Iteration, conv_only: bool) -> SwapPlan:
    """III-C's static policies with III-B's offload and prefetch: the blocks a forward op (a
    forward convolution: `conv_only`) reads, out after their last forward access ("only when
    the currently processing layer is the last consumer of its input feature maps") and
    prefetched where `find_prefetch_layers` says. A block first needed again by the first
    backward op is left resident: no layer's search reaches it, and vDNN never copies back
    on demand ("Naively copying back the data on demand will serialize the backward
    computation behind the memory copying operation of X")."""
    u = uses(it)
    backward = [op.tick for op in it.ops if op.tick >= u.split]
    away: list[Swap] = []
    for b in range(len(it.blocks)):
        readers = [t for t in u.reads[b] if t < u.split and (not conv_only or t in u.conv)]
        if readers and (s := _offload(it, u, b, lambda out_after, in_before: None)) is not None:
            away.append(s)
    found = find_prefetch_layers(backward, {s.in_before for s in away}, u.conv)
    return SwapPlan(
        tuple(replace(s, in_at=found[s.in_before]) for s in away if s.in_before in found)
    )


def vdnn_all(it: Iteration) -> SwapPlan:
    """vDNN_all (III-C): "offload all of the Xs of all of the layers": every block a forward
    op reads and backward needs, prefetched by findPrefetchLayer."""
    return _vdnn(it, conv_only=False)


def vdnn_conv(it: Iteration) -> SwapPlan:
    """vDNN_conv (III-C): "only offload Xs for the CONV layers": the blocks a forward
    convolution reads, prefetched by findPrefetchLayer."""
    return _vdnn(it, conv_only=True)


def _fits(it: Iteration, plan: SwapPlan, limit: int, out_gbps: float, in_gbps: float) -> bool:
    r = simulate(it, plan, limit, out_gbps, in_gbps)
    return r.feasible and r.peak_bytes <= limit


def vdnn_dyn(it: Iteration, limit: int, out_gbps: float, in_gbps: float) -> SwapPlan:
    """vDNN_dyn's profiling passes (III-C), each a training pass `simulate`d under `limit`:

    1. "the static vDNN_{all} is tested ... This initial pass determines if the target DNN
       can be trained at all": if it fails, vDNN_all is returned (infeasible in `simulate`).
    2. "another training phase is launched ... without any offloading. Such a configuration,
       if it passes successfully, will be adopted ... If this profiling phase fails due to
       memory oversubscription, two additional training passes are tested ... with vDNN
       offloading enabled for both vDNN_{conv} and vDNN_{all} respectively. If successful,
       vDNN employs the succeeded configuration": the first of no swapping, vDNN_conv and
       vDNN_all that fits, in that order, whatever the others' overhead.

    The passes differ in the paper also by convolution algorithm (memory-optimal in pass 1,
    fastest in pass 2) and pass 3 downgrades algorithms layer by layer; a trace fixes each
    op's algorithm, workspace and time, so those choices do not exist here and pass 1's
    vDNN_all is pass 2's."""
    every = vdnn_all(it)
    if not _fits(it, every, limit, out_gbps, in_gbps):
        return every
    for plan in (SwapPlan(), vdnn_conv(it)):
        if _fits(it, plan, limit, out_gbps, in_gbps):
            return plan
    return every


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


Baseline = Callable[[Iteration, int, float, float], SwapPlan]

BASELINES: dict[str, Baseline] = {
    "vdnn-all": lambda it, limit, out_gbps, in_gbps: vdnn_all(it),
    "vdnn-conv": lambda it, limit, out_gbps, in_gbps: vdnn_conv(it),
    "vdnn-dyn": vdnn_dyn,
}
