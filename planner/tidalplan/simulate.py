"""Simulate one steady iteration under a memory limit and a swap plan.

Three engines, deterministic, in integer nanoseconds (AutoSwap, SmartPool IV-E):

    compute   ─[op]─[op]──wait──[op]─[op]─▶ ticks in order; allocs and frees take no time
    swap-out        └──[out b]──┐           serial; starts after its op, frees b's bytes at its end
    swap-in                     └─[in b]──┐ serial; takes b's bytes at its start,
                                          ▼ must end before the op that needs b

Device bytes at any moment are the persistent bytes plus `learn.live_bytes` at
the tick compute has reached, less the bytes of blocks swapped out (copy done,
swap-in not yet started). A tick where `live_bytes` rises is a malloc: compute
waits there until it fits under the limit (delayed malloc); a swap-in waits
likewise (delayed swap-in). Only finishing swap-outs free bytes while compute
waits, so a wait with none pending is reported as infeasible instead of hanging.
At equal times, swap-outs finish first, then swap-ins start, then compute moves.

A recomputed block (`Recompute`) leaves the device when the op after which it is
dropped ends, with no copy. At the op that needs it back, once that op's swap-ins
have arrived, compute rebuilds it: it waits, as a malloc does, until the rebuilt
blocks and the rebuild's scratch fit, then runs the writers again (one rebuild
per op for every block it needs back), then runs the op.

    compute   ─[op a]─ ... ─wait─[writers of b again]─[op c]─▶
    b         ████████┘                ┌████████████████    dropped after a, rebuilt for c
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from tidalcore.units import Bytes

from tidalplan.accesses import Accesses, accesses
from tidalplan.model import Iteration, Swap, SwapPlan

_NEVER = 1 << 62  # a time after every event


@dataclass(frozen=True, slots=True)
class Result:
    """The simulated iteration.

    The iteration ends when compute has run every tick and both copy engines are
    idle. When `feasible` is False (a malloc or a swap-in can never fit, or the
    device starts over the limit) the times and bytes describe the timeline up to
    the point where it got stuck.
    """

    iteration_ns: int
    baseline_ns: int  # the same iteration with no limit and no swaps
    overhead: float  # iteration_ns / baseline_ns - 1 (0.0 when baseline_ns is 0)
    peak_bytes: Bytes  # device bytes at their highest over the timeline
    out_bytes: Bytes  # bytes of the swap-outs that started
    in_bytes: Bytes  # bytes of the swap-ins that started
    stall_ns: int  # compute waiting for swap-ins or delayed mallocs
    feasible: bool
    curve: tuple[tuple[int, int], ...]  # (time ns, device bytes) at the start and at each change
    # When each tick happened (an op started, after any wait); per swap of the plan (in plan
    # order): when its bytes left
    # (its swap-out finished) and came back (its swap-in started). _NEVER: did not happen.
    tick_ns: tuple[int, ...] = field(default=(), compare=False)
    swap_ns: tuple[tuple[int, int], ...] = field(default=(), compare=False)
    # The same as ticks: the first tick that saw the bytes gone / back (`ticks`: after the last
    # tick, the next iteration's start), -1 if it did not happen. Ticks order events that share
    # a time: compute's allocs and frees take none.
    swap_ticks: tuple[tuple[int, int], ...] = field(default=(), compare=False)
    # Per recomputation of the plan (in plan order): when its rebuild started (_NEVER: it
    # did not); the rebuilds' compute and the bytes they rebuilt, over the iteration.
    rebuild_ns: tuple[int, ...] = field(default=(), compare=False)
    recompute_ns: int = 0
    recomputed_bytes: int = 0


def copy_ns(size: int, gbps: float) -> int:
    """ceil(size / gbps) nanoseconds: `size` bytes at `gbps` GB/s (GB = 1e9 bytes), exactly."""
    num, den = gbps.as_integer_ratio()
    return -(-size * den // num)


@dataclass(slots=True)
class _In:
    """A swap-in in the in-engine's queue."""

    size: int
    issue_tick: int
    need_tick: int
    out: int  # index of its swap-out in the out list, -1: none this iteration (wraps)
    ns: int
    swap: int  # its index in the plan
    issued: int = _NEVER  # when compute reached `issue_tick`
    started: int = _NEVER  # when the copy started (the bytes came back)
    started_tick: int = -1  # the first tick that saw them back
    done: int = _NEVER  # when the copy finished


def _checked(it: Iteration, plan: SwapPlan, ix: Accesses) -> list[tuple[int, Swap]]:
    """(size, swap) for every swap of the plan; ValueError names the first bad one."""
    op_index = ix.op_pos
    touched = ix.touched
    per_block: dict[tuple[bool, int], list[Swap]] = {}
    out: list[tuple[int, Swap]] = []
    for s in plan.swaps:
        where = it.persistent if s.persistent else it.blocks
        if not 0 <= s.block < len(where):
            raise ValueError(f"{s}: no such block")
        per_block.setdefault((s.persistent, s.block), []).append(s)
        if s.out_after not in op_index or s.in_before not in op_index:
            raise ValueError(f"{s}: out_after and in_before must be op ticks")
        first = 0 if s.in_before <= s.out_after else s.out_after + 1
        if s.in_at is not None and not first <= s.in_at <= s.in_before:
            raise ValueError(f"{s}: in_at must lie in [{first}, in_before]")
        if s.persistent:
            trace_id, size = it.persistent[s.block]
        else:
            b = it.blocks[s.block]
            trace_id, size = b.id, b.size
            if not b.start < s.out_after < s.in_before < b.end:
                raise ValueError(f"{s}: not start < out_after < in_before < end of its block")
        lo, hi = s.out_after, s.in_before
        away = (
            [t for t in touched.get(trace_id, ()) if lo < t < hi]
            if lo < hi
            else [t for t in touched.get(trace_id, ()) if t > lo or t < hi]
        )
        if away:
            raise ValueError(f"{s}: block accessed at tick {away[0]} while swapped out")
        out.append((size, s))
    for r in plan.recomputes:  # a drop is away like a swap, never across the boundary
        if 0 <= r.block < len(it.blocks):
            per_block.setdefault((False, r.block), []).append(Swap(r.block, r.drop_after, r.before))
    for mine in per_block.values():
        _disjoint(mine)
    return out


@dataclass(slots=True)
class Rebuild:
    """The rebuild before one op: every block recomputed for it, at once."""

    size: int  # bytes rebuilt
    scratch: int  # bytes the writers also write, held over the rebuild
    ns: int  # the writers' durations
    members: list[int]  # plan indices of its recomputations


def rebuilds(it: Iteration, plan: SwapPlan, durations: dict[int, int]) -> dict[int, Rebuild]:
    """The plan's recomputations grouped by the op that needs them back, keyed by its tick;
    ValueError names the first that cannot run (see `Recompute`)."""
    if not plan.recomputes:
        return {}
    ix = accesses(it)
    reads, writes, written, touched = ix.reads, ix.writes, ix.written, ix.touched
    index, persistent = ix.index, ix.persistent
    away: dict[int, list[tuple[int, int, bool]]] = {}  # block id -> (from, to, crosses)
    for sw in plan.swaps:
        pid = it.persistent[sw.block][0] if sw.persistent else it.blocks[sw.block].id
        away.setdefault(pid, []).append((sw.out_after, sw.in_before, sw.in_before <= sw.out_after))
    groups: dict[int, list[int]] = {}
    for j, r in enumerate(plan.recomputes):
        if not 0 <= r.block < len(it.blocks):
            raise ValueError(f"{r}: no such block")
        if r.drop_after not in durations or r.before not in durations:
            raise ValueError(f"{r}: drop_after and before must be op ticks")
        b = it.blocks[r.block]
        if not b.start < r.drop_after < r.before < b.end:
            raise ValueError(f"{r}: not start < drop_after < before < end of its block")
        if any(r.drop_after < t < r.before for t in touched.get(b.id, ())):
            raise ValueError(f"{r}: block accessed while dropped")
        if not any(b.start <= t <= r.drop_after for t in written.get(b.id, ())):
            raise ValueError(f"{r}: no op writes the block before it is dropped")
        away.setdefault(b.id, []).append((r.drop_after, r.before, False))
        groups.setdefault(r.before, []).append(j)
    out: dict[int, Rebuild] = {}
    for before, members in groups.items():
        rebuilt = {it.blocks[plan.recomputes[j].block].id for j in members}
        ops: set[int] = set()
        for j in members:
            r = plan.recomputes[j]
            b = it.blocks[r.block]
            ops.update(t for t in written[b.id] if b.start <= t <= r.drop_after)
        scratch: set[int] = set()
        for w in ops:
            scratch |= writes.get(w, set()) - rebuilt
            for pid in reads.get(w, set()) - rebuilt:
                i = index.get(pid)
                live = pid in persistent or (
                    i is not None and it.blocks[i].start < before < it.blocks[i].end
                )
                gone = any(
                    (lo < before < hi) if not wraps else (before > lo or before < hi)
                    for lo, hi, wraps in away.get(pid, ())
                )
                if not live or gone:
                    raise ValueError(
                        f"{plan.recomputes[members[0]]}: op {w} reads block {pid}, which is"
                        f" not on the device at op {before}"
                    )
                if any(w <= t < before for t in written.get(pid, ())):
                    raise ValueError(
                        f"{plan.recomputes[members[0]]}: op {w} reads block {pid}, which is"
                        f" written again before op {before}"
                    )
        out[before] = Rebuild(
            size=sum(it.blocks[plan.recomputes[j].block].size for j in members),
            scratch=sum(ix.sizes.get(pid, 0) for pid in scratch),
            ns=sum(durations[w] for w in ops),
            members=members,
        )
    return out


def _disjoint(swaps: list[Swap]) -> None:
    """ValueError unless the away intervals of one block's swaps do not overlap."""
    if len(swaps) < 2:
        return
    crossing = [s for s in swaps if s.in_before <= s.out_after]
    inside = sorted((s for s in swaps if s.in_before > s.out_after), key=lambda s: s.out_after)
    if len(crossing) > 1:
        raise ValueError(f"{crossing[1]}: block swapped across the boundary twice")
    for prev, nxt in itertools.pairwise(inside):
        if nxt.out_after < prev.in_before:
            raise ValueError(f"{nxt}: overlaps {prev}, another swap of the same block")
    for c in crossing:
        for s in inside:
            if s.out_after < c.in_before or s.in_before > c.out_after:
                raise ValueError(f"{s}: overlaps {c}, another swap of the same block")


def simulate(
    it: Iteration,
    plan: SwapPlan,
    limit_bytes: int | None,
    out_gbps: float,
    in_gbps: float,
    compute_scale: float = 1.0,
) -> Result:
    """Run one steady iteration of `it` under `plan` and `limit_bytes` (None: no limit).

    Op durations are the trace's times `compute_scale`, rounded to whole ns;
    copies take `copy_ns` at `out_gbps` / `in_gbps`. ValueError for a malformed
    plan or non-positive bandwidths.
    """
    if not (0 < out_gbps < math.inf and 0 < in_gbps < math.inf and 0 <= compute_scale < math.inf):
        raise ValueError("bandwidths must be positive and compute_scale non-negative")
    ix = accesses(it)
    swaps = _checked(it, plan, ix)
    limit = _NEVER if limit_bytes is None else limit_bytes
    durations = ix.scaled(compute_scale)
    rebuild_at = rebuilds(it, plan, durations)
    drops_after: dict[int, int] = {}  # op tick -> bytes dropped when it ends
    for r in plan.recomputes:
        drops_after[r.drop_after] = drops_after.get(r.drop_after, 0) + it.blocks[r.block].size
    rebuild_ns = [_NEVER] * len(plan.recomputes)
    recompute_ns = recomputed = 0
    baseline = sum(durations.values())
    live = ix.live
    op_ticks = ix.op_ticks
    op_pos = ix.op_pos

    # Swap-outs leave after their op, in op order (then plan order): (size, ns) per op tick.
    outs_after: dict[int, list[int]] = {}
    out_size: list[int] = []
    out_ns: list[int] = []
    out_done: list[int] = []
    out_tick: list[int] = []
    ins: list[_In] = []
    off = 0  # bytes off the device now
    out_swap: list[int] = []  # plan index of each swap-out
    order = sorted(range(len(swaps)), key=lambda j: (swaps[j][1].out_after, swaps[j][1].in_before))
    for j in order:
        size, s = swaps[j]
        wraps = s.in_before <= s.out_after
        k = len(out_size)
        out_swap.append(j)
        outs_after.setdefault(s.out_after, []).append(k)
        out_size.append(size)
        out_ns.append(copy_ns(size, out_gbps))
        out_done.append(_NEVER)
        out_tick.append(-1)
        pos = op_pos[s.in_before]
        first = 0 if wraps else s.out_after + 1
        issue = s.in_at if s.in_at is not None else max(op_ticks[pos - 1] if pos else 0, first)
        ins.append(_In(size, issue, s.in_before, -1 if wraps else k, copy_ns(size, in_gbps), j))
        if wraps:
            off += size
    ins.sort(key=lambda x: (x.issue_tick, x.need_tick))
    needs: dict[int, list[_In]] = {}
    for x in ins:
        needs.setdefault(x.need_tick, []).append(x)

    persistent = sum(size for _, size in it.persistent)
    level = live[-1]  # transient bytes compute has reached: the previous iteration's end
    device = persistent + level - off
    held = 0  # a rebuild's scratch, while it runs
    curve = [(0, device)]
    peak = device
    moved_out = moved_in = 0
    releases: deque[tuple[int, int, int]] = deque()  # swap-out ends in time order: (time, size, k)
    out_free = 0
    in_free = 0
    head = 0  # the next swap-in to start
    blocked = False  # the head did not fit; it retries after the next free
    retry = 0

    def note(t: int) -> None:
        nonlocal peak
        d = persistent + level - off + held
        curve.append((int(t), d))
        peak = max(peak, d)

    def next_start() -> int:
        if head == len(ins) or blocked:
            return _NEVER
        x = ins[head]
        after = 0 if x.out < 0 else out_done[x.out]
        return max(x.issued, in_free, after, retry)

    def step(until: int) -> int | None:
        """Process the earliest copy event at or before `until`; its time, None if none."""
        nonlocal off, head, blocked, retry, in_free, moved_in
        r = releases[0][0] if releases else _NEVER
        s = next_start()
        t = min(r, s)
        if t > until or t == _NEVER:
            return None
        if r <= s:
            _, size, k = releases.popleft()
            off += size
            out_tick[k] = tick
            note(r)
            if blocked:
                blocked, retry = False, r
            return r
        x = ins[head]
        if persistent + level - off + held + x.size > limit:
            blocked = True
            return s
        off -= x.size
        moved_in += x.size
        note(s)
        x.started, x.started_tick = s, tick
        in_free = x.done = s + x.ns
        head += 1
        retry = 0
        return s

    def room(extra: int, since: int) -> int | None:
        """When `extra` more bytes fit under the limit, waiting from `since` for swap-outs to
        finish; None if they never will (none is pending)."""
        at = since
        while persistent + level - off + extra > limit:
            if not releases:
                return None
            t = step(_NEVER)
            at = max(at, t if t is not None else at)
        return at

    now = 0
    stall = 0
    feasible = device <= limit
    issue_at: dict[int, list[_In]] = {}
    for x in ins:
        issue_at.setdefault(x.issue_tick, []).append(x)
    tick = 0
    tick_ns: list[int] = []
    while feasible and tick < it.ticks:
        tick_ns.append(now)
        for x in issue_at.get(tick, ()):
            x.issued = now
        while (releases and releases[0][0] <= now) or (
            head < len(ins) and not blocked and ins[head].issued <= now
        ):  # a copy event may be due: let `step` decide
            if step(now) is None:
                break
        rise = live[tick] - level
        if tick in durations:  # an op: wait for its swap-ins, run, then queue its swap-outs
            waiting = [x for x in needs.get(tick, ()) if x.done == _NEVER]
            while waiting and feasible:
                if step(_NEVER) is None:
                    feasible = False
                waiting = [x for x in waiting if x.done == _NEVER]
            if not feasible:
                break
            start = max([now, *(x.done for x in needs.get(tick, ()))])
            stall += start - now
            if (rb := rebuild_at.get(tick)) is not None:  # rebuild what the op needs back
                while step(start) is not None:
                    pass
                ready = room(rb.size + rb.scratch, start)
                if ready is None:
                    feasible = False
                    break
                stall += ready - start
                off -= rb.size
                held = rb.scratch
                note(ready)
                for j in rb.members:
                    rebuild_ns[j] = ready
                start = ready + rb.ns
                while step(start - 1) is not None:  # copies during the rebuild see the scratch
                    pass
                held = 0
                note(start)
                recompute_ns += rb.ns
                recomputed += rb.size
            tick_ns[-1] = start
            now = start + durations[tick]
            for k in outs_after.get(tick, ()):
                out_free = out_done[k] = max(now, out_free) + out_ns[k]
                releases.append((out_free, out_size[k], k))
                moved_out += out_size[k]
            if dropped := drops_after.get(tick, 0):  # recomputed later: gone at once
                off += dropped
                note(now)
                if blocked:
                    blocked, retry = False, now
        elif rise > 0:  # a malloc: wait for swap-outs to make room
            made = room(rise, now)
            if made is None:
                feasible = False
                break
            stall += made - now
            tick_ns[-1] = now = made
        if rise:
            level = live[tick]
            note(now)
            if rise < 0 and blocked:
                blocked, retry = False, now
        tick += 1
    end = now
    if feasible:
        while (t := step(_NEVER)) is not None:
            end = max(end, t)
        if head < len(ins):
            feasible = False
        end = max([end, out_free, in_free])
    iteration = int(end)
    swap_ns = [(_NEVER, _NEVER)] * len(swaps)
    swap_ticks = [(-1, -1)] * len(swaps)
    for k, j in enumerate(out_swap):
        swap_ns[j] = (out_done[k], swap_ns[j][1])
        swap_ticks[j] = (out_tick[k], swap_ticks[j][1])
    for x in ins:
        swap_ns[x.swap] = (swap_ns[x.swap][0], x.started)
        swap_ticks[x.swap] = (swap_ticks[x.swap][0], x.started_tick)
    return Result(
        iteration_ns=iteration,
        baseline_ns=baseline,
        overhead=iteration / baseline - 1 if baseline else 0.0,
        peak_bytes=Bytes(peak),
        out_bytes=Bytes(moved_out),
        in_bytes=Bytes(moved_in),
        stall_ns=int(stall),
        feasible=feasible,
        curve=tuple(curve),
        tick_ns=tuple(tick_ns),
        swap_ns=tuple((int(a), int(b)) for a, b in swap_ns),
        swap_ticks=tuple(swap_ticks),
        rebuild_ns=tuple(rebuild_ns),
        recompute_ns=recompute_ns,
        recomputed_bytes=recomputed,
    )


def no_limit(it: Iteration, compute_scale: float = 1.0) -> Result:
    """The baseline: `it` with no limit and no swaps."""
    return simulate(it, SwapPlan(), None, 1.0, 1.0, compute_scale)
