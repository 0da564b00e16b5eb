"""SuperNeurons (Wang et al., PPoPP 2018) as a plan: Cost-Aware Recomputation of the cheap
layers, then the Unified Tensor Pool's LRU Tensor Cache for the convolution outputs.

    forward  ─[conv]─[bn]─[relu]─[pool]─[conv]─ … ┃ … ─[conv bwd]─[pool bwd]─[relu bwd]─[bn bwd]─▶
               │    └──── one segment ────┘          ▲ rebuilt here from the checkpoint
               └ checkpoint: kept, or offloaded (LRU) when memory is still short, prefetched
                 at the backward convolution before the op that needs it

Liveness analysis (Section 3.2) is what the iteration's frees already give. On top of it:

Section 3.4, Cost-Aware Recomputation. "the runtime frees the tensors in cheap-to-compute
layers such as POOL for reconstructions"; the checkpoints are "the compute-intensive layers
such as FC and CONV" (Section 3), and "Since *non-checkpoints* layers will be freed for
recomputations, only the nearest *checkpoint* layer exists in the GPU memory." A segment is
the run of forward layers after one checkpoint; "1. The runtime iterates over all the layers
to find l_peak = max(l_i) as the threshold. 2. In a re-computation segment, the runtime
applies the speed-centric strategy ... if sum_{i=1}^{seg}(l_i^f) + l_seg^b <= l_peak, and the
memory-centric strategy ... otherwise." Speed-centric "keeps the recomputed tensors so that
other backward layers can directly reuse them": the segment is rebuilt once, at its first
backward use. Memory-centric "always recomputes the dependencies for each backward layer":
each dropped tensor is rebuilt before every backward op that needs it, with the dropped
tensors its layers read, and dropped again after it.

Section 3.3, the Tensor Cache. "we only offload the tensors from CONV layers"; "With
*Prefetching* and *Offloading*, the runtime only triggers data transfers when GPU DRAM is
insufficient", evicting "the unlocked Least Recent Used tensors ... until it has enough free
memory": `baselines.superneurons_candidates`, taken in LRU order until the iteration fits.
"At any CONV layers in the backward, the runtime asynchronously fetches the required tensors
for the previous CONV layer": a swap-in is issued at the backward convolution before the op
that needs the tensor, which is the first op that reads it or the first rebuild that does.

Layers are ops, named as in the traces: a checkpoint is a forward convolution or FC
(`aten.convolution.default`, `aten.mm`/`addmm`/`bmm`); every other forward op (BN, ReLU,
pooling, element-wise) is cheap. A tensor is dropped only when replaying its writers gives it
back: they are cheap, draw no random numbers, update no persistent state, and every tensor
they read is rebuilt with it or on the device, unchanged, when the rebuild runs. l_i is the
bytes an op accesses. When the iteration fits the limit as it is, nothing is done.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, replace

from tidalcore.units import Tick

from tidalplan.baselines import Uses, superneurons_candidates, uses
from tidalplan.model import Iteration, Recompute, Swap, SwapPlan
from tidalplan.simulate import simulate

FC = frozenset({"mm", "addmm", "bmm", "matmul", "linear"})
RANDOM = ("bernoulli", "dropout", "rand", "normal", "uniform")


def checkpoint(name: str) -> bool:
    """A compute-intensive layer: a convolution or an FC (`aten.addmm.default` -> addmm)."""
    parts = name.split(".")
    kind = parts[1] if len(parts) > 2 else parts[0]
    return "convolution" in kind or kind in FC


def stochastic(name: str) -> bool:
    """A layer that draws random numbers: running it again gives another tensor."""
    return any(word in name for word in RANDOM)


@dataclass(frozen=True, slots=True)
class _Graph:
    """Who reads and writes what, per op tick: transient blocks by `Iteration.blocks` index,
    persistent blocks by trace id."""

    reads: dict[int, frozenset[int]]
    persistent_reads: dict[int, frozenset[int]]
    persistent_written: dict[int, tuple[int, ...]]  # persistent id -> ticks writing it
    writes_persistent: frozenset[int]  # op ticks writing a persistent block
    footprint: dict[int, int]  # op tick -> bytes it accesses (l_i)


def _graph(it: Iteration) -> _Graph:
    index = {b.id: i for i, b in enumerate(it.blocks)}
    sizes = {b.id: b.size for b in it.blocks} | dict(it.persistent)
    reads: dict[int, set[int]] = {}
    preads: dict[int, set[int]] = {}
    pwritten: dict[int, list[int]] = {}
    touched: dict[int, set[int]] = {}
    for a in it.accesses:
        touched.setdefault(a.tick, set()).add(a.block)
        i = index.get(a.block)
        if i is not None:
            if not a.write:
                reads.setdefault(a.tick, set()).add(i)
        elif a.block in sizes:
            if a.write:
                pwritten.setdefault(a.block, []).append(a.tick)
            else:
                preads.setdefault(a.tick, set()).add(a.block)
    return _Graph(
        reads={t: frozenset(s) for t, s in reads.items()},
        persistent_reads={t: frozenset(s) for t, s in preads.items()},
        persistent_written={p: tuple(sorted(ts)) for p, ts in pwritten.items()},
        writes_persistent=frozenset(t for ts in pwritten.values() for t in ts),
        footprint={t: sum(sizes.get(b, 0) for b in s) for t, s in touched.items()},
    )


@dataclass(frozen=True, slots=True)
class _Dropped:
    """A block Cost-Aware Recomputation may free: where it leaves, who rebuilds it."""

    drop: Tick  # its last forward access
    back: tuple[Tick, ...]  # its backward accesses, ascending
    writers: tuple[Tick, ...]  # the forward ops that write it, ascending
    segment: int  # how many checkpoints run before its first writer


def _droppable(it: Iteration, u: Uses, g: _Graph) -> dict[int, _Dropped]:
    """The blocks of cheap layers that backward needs, before the dependency checks."""
    names = {op.tick: op.name for op in it.ops}
    checkpoints = sorted(t for t, name in names.items() if t < u.split and checkpoint(name))
    out: dict[int, _Dropped] = {}
    for b, block in enumerate(it.blocks):
        drop = u.last_forward(b)
        back = tuple(t for t in u.ticks[b] if t >= u.split)
        if drop is None or not back or any(t >= u.split for t in u.writes[b]):
            continue
        writers = tuple(sorted(t for t in u.writes[b] if block.start <= t <= drop))
        if not writers or any(
            checkpoint(names[t]) or stochastic(names[t]) or t in g.writes_persistent
            for t in writers
        ):
            continue
        out[b] = _Dropped(drop, back, writers, bisect_right(checkpoints, writers[0]))
    return out


def _speed_centric(it: Iteration, dropped: dict[int, _Dropped], g: _Graph, l_peak: int) -> set[int]:
    """The segments whose memcost, sum(l_i^f) + l_seg^b, is at most l_peak: the dropped
    bytes of the segment plus the other bytes of the backward op that first needs them."""
    members: dict[int, list[int]] = {}
    for b, d in dropped.items():
        members.setdefault(d.segment, []).append(b)
    fast = set()
    for segment, blocks in members.items():
        first = min(dropped[b].back[0] for b in blocks)
        own = sum(it.blocks[b].size for b in blocks)
        touched = sum(it.blocks[b].size for b in blocks if first in dropped[b].back)
        if own + g.footprint.get(first, 0) - touched <= l_peak:
            fast.add(segment)
    return fast


def _rebuild_ticks(
    dropped: dict[int, _Dropped], inputs: dict[int, set[int]], fast: set[int]
) -> dict[int, list[int]]:
    """The ops each dropped block is rebuilt for: speed-centric, once, at the first that needs
    anything of its segment; memory-centric, at every op that needs it. A block is needed by
    its backward accesses and by every rebuild of a block whose writers read it."""
    needs: dict[int, set[int]] = {b: {int(t) for t in d.back} for b, d in dropped.items()}
    while True:
        first: dict[int, int] = {}
        for b, d in dropped.items():
            if d.segment in fast:
                first[d.segment] = min(first.get(d.segment, 1 << 62), min(needs[b]))
        ticks = {
            b: [first[d.segment]] if d.segment in fast else sorted(needs[b])
            for b, d in dropped.items()
        }
        grown = False
        for b, ts in ticks.items():
            for x in inputs[b]:
                new = set(ts) - needs[x]
                if new:
                    needs[x] |= new
                    grown = True
        if not grown:
            return ticks


def recomputations(it: Iteration) -> tuple[Recompute, ...]:
    """Cost-Aware Recomputation: every cheap layer's tensor that backward needs is dropped
    after its last forward access and rebuilt from the nearest checkpoint, speed- or
    memory-centric per segment; in (before, block) order."""
    u = uses(it)
    g = _graph(it)
    l_peak = max(g.footprint.values(), default=0)
    dropped = _droppable(it, u, g)
    while True:
        inputs = {
            b: {x for w in d.writers for x in g.reads.get(w, ()) if x != b and x in dropped}
            for b, d in dropped.items()
        }
        fast = _speed_centric(it, dropped, g, l_peak)
        ticks = _rebuild_ticks(dropped, inputs, fast)
        bad = {b for b in dropped if not _replayable(it, u, g, b, dropped, ticks, fast)}
        if not bad:
            break
        dropped = {b: d for b, d in dropped.items() if b not in bad}
    out = []
    for b, d in dropped.items():
        previous = int(d.drop)
        for t in ticks[b]:
            out.append(Recompute(block=b, drop_after=Tick(previous), before=Tick(t)))
            previous = t
    return tuple(sorted(out, key=lambda r: (r.before, r.block)))


def _replayable(
    it: Iteration,
    u: Uses,
    g: _Graph,
    b: int,
    dropped: dict[int, _Dropped],
    ticks: dict[int, list[int]],
    fast: set[int],
) -> bool:
    """Whether b's writers can run again at each op b is rebuilt for: every block they read is
    rebuilt then, or on the device then and not written since the writer first ran."""
    d = dropped[b]
    for t in ticks[b]:
        for w in d.writers:
            for x in g.reads.get(w, ()):
                if x == b:
                    continue
                if x in dropped:
                    there = t in ticks[x] or (dropped[x].segment in fast and ticks[x][0] < t)
                    if not there or it.blocks[x].end <= t:
                        return False
                elif not it.blocks[x].start < t < it.blocks[x].end or any(
                    w <= s < t for s in u.writes[x]
                ):
                    return False
            for p in g.persistent_reads.get(w, ()):
                if any(w <= s < t for s in g.persistent_written.get(p, ())):
                    return False
    return True


def cache_candidates(it: Iteration, recomputes: tuple[Recompute, ...]) -> tuple[Swap, ...]:
    """The Tensor Cache's offload candidates in LRU order (`superneurons_candidates`), each
    brought back before the first rebuild that reads it, prefetched one convolution ahead."""
    u = uses(it)
    g = _graph(it)
    groups: dict[int, set[int]] = {}
    for r in recomputes:
        groups.setdefault(r.before, set()).add(r.block)
    read_by_rebuild: dict[int, list[int]] = {}  # block -> ticks of rebuilds that read it
    for before, rebuilt in sorted(groups.items()):
        writers = {
            w
            for r in recomputes
            if r.before == before
            for w in u.writes[r.block]
            if w <= r.drop_after
        }
        for x in {x for w in writers for x in g.reads.get(w, ())} - rebuilt:
            read_by_rebuild.setdefault(x, []).append(before)
    convs = sorted(t for t in u.conv if t >= u.split)
    op_ticks = [op.tick for op in it.ops]
    dropped = {r.block for r in recomputes}
    out = []
    for s in superneurons_candidates(it):
        if s.block in dropped:
            continue
        in_before = min(
            [s.in_before, *(t for t in read_by_rebuild.get(s.block, ()) if t > s.out_after)]
        )
        k = bisect_right(convs, in_before - 1)
        at = convs[k - 1] if k else op_ticks[max(bisect_right(op_ticks, in_before - 1) - 1, 0)]
        out.append(replace(s, in_before=Tick(in_before), in_at=Tick(max(s.out_after + 1, at))))
    return tuple(out)


def _fits(it: Iteration, plan: SwapPlan, limit: int, out_gbps: float, in_gbps: float) -> bool:
    r = simulate(it, plan, limit, out_gbps, in_gbps)
    return r.feasible and r.peak_bytes <= limit


def superneurons(it: Iteration, limit: int, out_gbps: float, in_gbps: float) -> SwapPlan:
    """Nothing when the iteration fits `limit`; else Cost-Aware Recomputation, and when memory
    is still short, the fewest Tensor Cache offloads in LRU order that make it fit (all of
    them when none does: `simulate` then reports the plan infeasible)."""
    if _fits(it, SwapPlan(), limit, out_gbps, in_gbps):
        return SwapPlan()
    recomputes = recomputations(it)
    candidates = cache_candidates(it, recomputes)

    def plan(n: int) -> SwapPlan:
        return SwapPlan(candidates[:n], recomputes)

    if _fits(it, plan(0), limit, out_gbps, in_gbps):
        return plan(0)
    low, high = 0, len(candidates)  # plan(low) does not fit; plan(high) is the answer if any
    if not _fits(it, plan(high), limit, out_gbps, in_gbps):
        return plan(high)
    while high - low > 1:
        mid = (low + high) // 2
        if _fits(it, plan(mid), limit, out_gbps, in_gbps):
            high = mid
        else:
            low = mid
    return plan(high)
