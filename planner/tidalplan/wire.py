"""A plan on the wire: a `placed.Plan` as the `PlanUpdate` a session executes, and back.

    placed.Plan ──encode────▶ PlanUpdate (version 2) ──▶ plan cache, session stream
                                  │
                                  └─check─▶ decode ─▶ simulate ─▶ validate_swaps ─▶ split
                                       ─▶ bounds (limit, lease) ─▶ validate (the offsets)

    paged.PagedPlan ──encode_paged──▶ PlanUpdate (version 3) ──▶ plan cache, session stream
                                           │
                                           └─check_paged─▶ decode_paged ─▶ Layout (+ the
                                  session's persistent addresses) ─▶ paged ─▶ simulate
                                  ─▶ validate_swaps ─▶ validate_pages (the limit)

The schedule travels against the iteration's structure: ops by their index in the iteration,
transient blocks by their allocation index, persistent blocks by their trace id. The placement
travels as arena offsets of the plan's pieces (`placed.split`): `offsets[i]` is where
allocation i's first piece lies (so the version-1 fields alone still place the allocations
consistently), `swap_in_offsets[j]` where the piece that swap j's swap-in starts lies.

Under virtual residency (version 3, `tidalplan.paged`) every block keeps one address for life:
the placement travels as `addresses[i]`, bytes from the start of the plan's region (the part of
the session's range past the persistent blocks it placed itself, `Layout.region_start`), with
`owning[i]` and the region's length; the persistent blocks' addresses are the session's own
and do not travel.

The columns are written and read by the codec both ends share (`tidalcore.planupdate`), which
checks what needs only the update; this module puts a plan into them and takes it back onto
the iteration's ticks, checking what needs the iteration.

A client issues a swap-in when an op begins; `on_ops` makes a schedule say exactly that, and
only such a schedule is encoded, so that what `check` simulates is what the client runs.
Pure: no I/O.
"""

from __future__ import annotations

import functools
import re
import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tidalcore import planupdate
from tidalcore.pages import pages_of
from tidalcore.planupdate import ARENA_VERSION, PAGED_VERSION, Arena, Columns, Pages, Prediction
from tidalcore.units import ALIGNMENT, Bytes, Offset
from tidalcore.v1 import pool_pb2

from tidalplan import paged
from tidalplan.learn import signature, to_problem
from tidalplan.model import Iteration, Placement, Problem, Recompute, Swap, SwapPlan
from tidalplan.placed import PERSISTENT, SCRATCH, Combined, Plan, Policy, split
from tidalplan.search import search
from tidalplan.simulate import Result, simulate
from tidalplan.validate import InvalidPlacement, validate, validate_swaps

VERSION = ARENA_VERSION
"""The PlanUpdate version `encode` writes and `decode` reads (`tidalcore.planupdate`);
`encode_paged` and `decode_paged`'s is `PAGED_VERSION`."""


def on_ops(it: Iteration, schedule: SwapPlan) -> SwapPlan:
    """`schedule` as a client runs it: every swap-in's `in_at` the tick of the op whose start
    issues it. With an `in_at`, the first op at or after it (at most `in_before`); without,
    the op before `in_before`, but not before the op after `out_after` (op 0 for a swap across
    the boundary). Recomputations are kept as they are."""
    ticks = [op.tick for op in it.ops]
    index = {tick: k for k, tick in enumerate(ticks)}
    swaps = []
    for s in schedule.swaps:
        in_before = index[s.in_before]
        if s.in_at is not None:
            at = min(bisect_left(ticks, s.in_at), in_before)
        else:
            earliest = 0 if s.in_before <= s.out_after else index[s.out_after] + 1
            at = max(in_before - 1, earliest)
        swaps.append(replace(s, in_at=ticks[at]))
    return SwapPlan(tuple(swaps), schedule.recomputes)


def session_schedule(
    it: Iteration, limit: int, out_gbps: float, in_gbps: float, deadline: float | None = None
) -> SwapPlan:
    """The schedule the daemon sends a session: tidalpool's search with swaps alone
    (`policies.swaps_only`: a session's executor moves blocks but does not rebuild them), its
    swap-ins issued at op starts as the client issues them (`on_ops`); `deadline` as
    `search`'s."""
    return on_ops(it, search(it, limit, out_gbps, in_gbps, recompute=False, deadline=deadline))


def session_schedule_within(budget_s: float | None) -> Policy:
    """`session_schedule`, its search ending `budget_s` seconds from now (None: when its
    budget of simulations is spent), as the daemon bounds a whole plan."""
    deadline = None if budget_s is None else time.monotonic() + budget_s
    return functools.partial(session_schedule, deadline=deadline)


def encode(it: Iteration, plan: Plan, copy_gbps: float) -> pool_pb2.PlanUpdate:
    """`plan` (made for `it`, simulated at `copy_gbps` each way) as a version-2 PlanUpdate:

    - `sizes[i]`, `offsets[i]`: allocation i's size and the arena offset of its first piece;
      `height_bytes`: the placement's height;
    - swap j: `swap_blocks` (allocation index, or with `swap_persistent` the trace id),
      `swap_out_after`, `swap_in_at`, `swap_in_before` (op indices), `swap_in_offsets` (the
      arena offset of the piece its swap-in starts) and `swap_in_ticks` (the tick that piece
      starts at: the simulated copy starts after it);
    - recomputation k: `recompute_blocks` (allocation index), `recompute_drop_after`,
      `recompute_before` (op indices);
    - `limit_bytes` (0: no limit), `resident_persistent_bytes`, and the simulator's
      `prediction` with the footprint and `copy_gbps`.

    Zero-size pieces are not placed: their offset is 0. ValueError for a plan that does not
    fit, or whose schedule a client would not run as it says (`on_ops` rounds it)."""
    placed = plan.combined
    if placed is None or not plan.fits:
        raise ValueError(
            f"the plan does not fit its limit {plan.limit} (footprint {plan.footprint}):"
            " nothing to send"
        )
    if on_ops(it, plan.schedule) != plan.schedule:
        raise ValueError("the schedule issues swap-ins between ops: round it with on_ops")
    index = {op.tick: k for k, op in enumerate(it.ops)}
    _, mapping = to_problem(placed.pieces)
    offset_of = {
        placed.pieces.blocks[b].id: int(offset)
        for offset, b in zip(placed.placement.offsets, mapping, strict=True)
    }
    starts = {b.id: int(b.start) for b in placed.pieces.blocks}
    return planupdate.write(
        Columns(
            plan_id=0,
            version=VERSION,
            signature=signature(it),
            sizes=tuple(int(b.size) for b in it.blocks),
            placement=Arena(
                offsets=tuple(
                    offset_of.get(placed.first_pieces[i], 0) for i in range(len(it.blocks))
                ),
                height=int(placed.placement.height),
                swap_in_offsets=tuple(offset_of.get(piece, 0) for piece in placed.in_pieces),
                resident_persistent=int(placed.resident_persistent),
            ),
            swaps=_swaps(it, plan.schedule),
            swap_in_ticks=tuple(starts[piece] for piece in placed.in_pieces),
            recomputes=tuple(
                planupdate.Recompute(c.block, index[c.drop_after], index[c.before])
                for c in plan.schedule.recomputes
            ),
            limit=int(plan.limit),
            prediction=_prediction(plan.result, int(placed.footprint), copy_gbps),
        )
    )


def _swaps(it: Iteration, schedule: SwapPlan) -> tuple[planupdate.ScheduledSwap, ...]:
    """`schedule`'s swaps on the wire: op indices, persistent blocks by their trace id."""
    index = {op.tick: k for k, op in enumerate(it.ops)}
    swaps = []
    for s in schedule.swaps:
        assert s.in_at is not None  # on_ops sets every one
        swaps.append(
            planupdate.ScheduledSwap(
                block=it.persistent[s.block][0] if s.persistent else s.block,
                out_after=index[s.out_after],
                in_before=index[s.in_before],
                in_at=index[s.in_at],
                persistent=s.persistent,
            )
        )
    return tuple(swaps)


def _prediction(r: Result, footprint: int, copy_gbps: float) -> Prediction:
    """The simulator's timeline `r` as a plan's prediction."""
    return Prediction(
        step_ns=r.iteration_ns,
        baseline_ns=r.baseline_ns,
        out_bytes=int(r.out_bytes),
        in_bytes=int(r.in_bytes),
        stall_ns=r.stall_ns,
        peak_bytes=int(r.peak_bytes),
        footprint_bytes=footprint,
        copy_gbps=copy_gbps,
    )


def _simulated_as_predicted(result: Result, p: Prediction) -> None:
    """ValueError unless `result` ran feasibly and is the timeline `p` predicts."""
    simulated = (
        result.iteration_ns,
        result.baseline_ns,
        result.out_bytes,
        result.in_bytes,
        result.stall_ns,
        result.peak_bytes,
    )
    predicted = (p.step_ns, p.baseline_ns, p.out_bytes, p.in_bytes, p.stall_ns, p.peak_bytes)
    if not result.feasible or simulated != predicted:
        raise ValueError(
            f"the schedule simulates to (step, baseline, out, in, stall, peak) {simulated}"
            f"{'' if result.feasible else ', infeasibly'}, not the predicted {predicted}"
        )


@dataclass(frozen=True, slots=True)
class Decoded:
    """A PlanUpdate back on its iteration's ticks and indices."""

    schedule: SwapPlan  # every swap with its `in_at`
    offsets: tuple[Offset, ...]  # per allocation: its first piece's arena offset
    swap_in_offsets: tuple[Offset, ...]  # per swap: the arena offset of its in-piece
    height: Bytes
    limit: Bytes | None  # None: no limit
    resident_persistent: Bytes
    copy_gbps: float


def decode(it: Iteration, update: pool_pb2.PlanUpdate) -> Decoded:
    """The schedule and offsets `update` carries, on `it`'s ticks (op index → op tick,
    persistent trace id → index in `it.persistent`). ValueError names the first column that
    does not fit `it` or the others (`planupdate.read`'s checks, then `it`'s)."""
    if update.version != VERSION:
        raise ValueError(f"plan version {update.version}, not {VERSION}")
    c = _read(it, update)
    arena = c.placement
    assert isinstance(arena, Arena)  # version 2
    if len(arena.swap_in_offsets) != len(c.swaps):
        raise ValueError("the swap columns (swap_in_offsets included) differ in length")
    return Decoded(
        schedule=_on_ticks(it, c),
        offsets=tuple(Offset(o) for o in arena.offsets),
        swap_in_offsets=tuple(Offset(o) for o in arena.swap_in_offsets),
        height=Bytes(arena.height),
        limit=Bytes(c.limit) if c.limit else None,
        resident_persistent=Bytes(arena.resident_persistent),
        copy_gbps=c.prediction.copy_gbps if c.prediction is not None else 0.0,
    )


def _read(it: Iteration, update: pool_pb2.PlanUpdate) -> Columns:
    """`planupdate.read` of an update made for `it`: its sizes `it`'s, its op indices in
    `it`'s ops."""
    sizes = [int(b.size) for b in it.blocks]
    if list(update.sizes) != sizes:
        raise ValueError(f"sizes {list(update.sizes)[:8]}... are not the iteration's allocations")
    return planupdate.read(update, len(it.ops))


def _on_ticks(it: Iteration, c: Columns) -> SwapPlan:
    """The swaps and recomputations of `c` (read against `it`) on `it`'s ticks, persistent
    blocks by their index in `it.persistent`. ValueError names a persistent id `it` has not."""
    ticks = [op.tick for op in it.ops]
    persistent = {pid: k for k, (pid, _) in enumerate(it.persistent)}
    swaps = []
    for k, s in enumerate(c.swaps):
        if s.persistent and s.block not in persistent:
            raise ValueError(f"swap_blocks[{k}] = {s.block}: no persistent block has that id")
        swaps.append(
            Swap(
                block=persistent[s.block] if s.persistent else s.block,
                out_after=ticks[s.out_after],
                in_before=ticks[s.in_before],
                in_at=ticks[s.issue_at()],
                persistent=s.persistent,
            )
        )
    recomputes = tuple(
        Recompute(block=r.block, drop_after=ticks[r.drop_after], before=ticks[r.before])
        for r in c.recomputes
    )
    return SwapPlan(tuple(swaps), recomputes)


def check(
    it: Iteration,
    update: pool_pb2.PlanUpdate,
    compute_scale: float = 1.0,
    lease: int | None = None,
) -> Combined:
    """Check `update` as a whole against `it`, sharing no state with the plan that made it:

    decode it; simulate its schedule at `prediction.copy_gbps` (under `prediction.peak_bytes`:
    the timeline of the limit the schedule was made for, since the simulator only ever waits
    when the bytes it would reach exceed its limit) and require the prediction to be that
    simulation; `validate_swaps` under `limit_bytes`; split the iteration into its pieces;
    `validate` the offsets (allocation i's first piece at `offsets[i]`, swap j's in-piece at
    `swap_in_offsets[j]`) as a placement of those pieces within `limit_bytes` less the resident
    persistent bytes. A piece the update cannot place (a rebuilt block's, a rebuild's scratch)
    is refused, and so is one that lies, once its size is aligned, past the bytes the session
    can use beside the resident persistent ones: `limit_bytes`, and the session's device
    `lease` where one is given (the arena is a range of the lease; without either, an offset
    must still fit 63 bits). Returns the checked plan's pieces and placement; ValueError
    (InvalidPlacement, InvalidSwapPlan) names the problem."""
    d = decode(it, update)
    if update.signature != signature(it):
        raise ValueError("the plan's signature is not the iteration's")
    if not update.HasField("prediction") or not d.copy_gbps > 0:
        raise ValueError("the plan has no prediction, or no copy bandwidth to simulate it at")
    p = Prediction.of(update.prediction)
    if d.limit is not None and p.peak_bytes > d.limit:
        raise ValueError(f"the predicted peak {p.peak_bytes} is over the limit {d.limit}")
    schedule = d.schedule
    result = simulate(
        it,
        schedule,
        None if d.limit is None else p.peak_bytes,
        d.copy_gbps,
        d.copy_gbps,
        compute_scale,
    )
    _simulated_as_predicted(result, p)
    validate_swaps(it, schedule, result, d.limit, d.copy_gbps, compute_scale)
    parts = split(it, schedule, result)
    problem, mapping = to_problem(parts.pieces, ALIGNMENT)
    offset_of = {parts.first_pieces[i]: o for i, o in enumerate(d.offsets)}
    offset_of.update(zip(parts.in_pieces, d.swap_in_offsets, strict=True))
    starts = [int(parts.pieces.blocks[k].start) for k in _indices(parts.pieces, parts.in_pieces)]
    if list(update.swap_in_ticks) != starts:
        raise ValueError(
            f"the swap-ins start after ticks {list(update.swap_in_ticks)}; their pieces start"
            f" at {starts}"
        )
    names = _names(it, parts.origin, parts.first_pieces, parts.in_pieces)
    resident = Bytes(sum(size for _, size in parts.pieces.persistent))
    room, bounded_by = _room(d.limit, lease, resident)
    offsets = []
    for buf, b in zip(problem.buffers, mapping, strict=True):
        piece = parts.pieces.blocks[b].id
        if piece not in offset_of:
            raise ValueError(f"{names[piece]}: the plan carries no offset for it")
        offset = offset_of[piece]
        end = offset + -(-buf.size // problem.alignment) * problem.alignment
        if end > room:
            raise ValueError(
                f"{names[piece]} lies at [{offset}, {end}) of the arena, past the {room} bytes"
                f" {bounded_by}"
            )
        offsets.append(offset)
    # Buffers named by piece id, so that the validator's message can say which piece is which.
    named = Problem(
        tuple(
            replace(buf, id=parts.pieces.blocks[b].id)
            for buf, b in zip(problem.buffers, mapping, strict=True)
        ),
        problem.alignment,
    )
    placement = Placement(tuple(offsets), d.height, "wire")
    try:
        validate(named, placement, None if d.limit is None else d.limit - resident)
    except InvalidPlacement as e:
        pieces = sorted({int(k) for k in re.findall(r"\b(?:buffers?|and) (\d+)", str(e))})
        life = {b.id: (b.start, b.end) for b in parts.pieces.blocks}
        legend = "; ".join(
            f"{names[k]} over ticks [{life[k][0]}, {life[k][1]})" for k in pieces if k in names
        )
        raise InvalidPlacement(
            f"{e}; the buffers are pieces, in the iteration's ticks: {legend}"
        ) from e
    if d.height > room:  # no piece to refuse: the resident persistent bytes alone are over
        raise ValueError(f"the plan's height {d.height} is more than the {room} bytes {bounded_by}")
    if d.resident_persistent != resident or p.footprint_bytes != resident + d.height:
        raise ValueError(
            f"resident persistent bytes {d.resident_persistent} and footprint"
            f" {p.footprint_bytes}: the plan's pieces leave {resident} and {resident + d.height}"
        )
    return Combined(
        parts.pieces,
        placement,
        resident,
        Bytes(resident + d.height),
        parts.origin,
        parts.in_pieces,
        parts.first_pieces,
    )


def refreshed(
    it: Iteration,
    update: pool_pb2.PlanUpdate,
    gbps: float | None = None,
    compute_scale: float = 1.0,
) -> pool_pb2.PlanUpdate:
    """A copy of the version-2 `update` with its prediction and swap-in starts simulated again
    on `it`, for `check` to judge as any plan. A plan holds for every run of the iteration it
    was made for (its signature: the iteration's structure, not its times), but the op times a
    run measures are not the last run's, and the prediction is the timeline of the times. The
    schedule runs under the plan's predicted peak, so its bytes stay within what the placement
    holds, with copies at `gbps` each way (None: the plan's own bandwidth). ValueError when
    `update` does not decode against `it`, or its schedule no longer runs within that peak."""
    d = decode(it, update)
    if not update.HasField("prediction") or not d.copy_gbps > 0:
        raise ValueError("the plan has no prediction, or no copy bandwidth to simulate it at")
    p = update.prediction
    limit = None if d.limit is None else int(p.peak_bytes)
    gbps = d.copy_gbps if gbps is None else gbps
    result = simulate(it, d.schedule, limit, gbps, gbps, compute_scale)
    if not result.feasible:
        raise ValueError(f"the schedule no longer runs within its peak of {limit} bytes")
    parts = split(it, d.schedule, result)
    starts = [int(parts.pieces.blocks[k].start) for k in _indices(parts.pieces, parts.in_pieces)]
    return _retimed(update, _prediction(result, int(p.footprint_bytes), gbps), starts)


def _retimed(
    update: pool_pb2.PlanUpdate, prediction: Prediction, starts: Sequence[int]
) -> pool_pb2.PlanUpdate:
    """A copy of `update` with another `prediction` and swap-in starts (`swap_in_ticks`)."""
    fresh = pool_pb2.PlanUpdate()
    fresh.CopyFrom(update)
    fresh.prediction.CopyFrom(prediction.message())
    del fresh.swap_in_ticks[:]
    fresh.swap_in_ticks.extend(starts)
    return fresh


_MAX_END = 2**63 - 1
"""The highest end of a piece a plan may claim without a limit or a lease: the validator
holds offsets as 64-bit signed integers."""


def _room(limit: int | None, lease: int | None, resident: int) -> tuple[int, str]:
    """The bytes of the arena a plan's pieces may span, the least that `limit` and the
    session's device `lease` (None: not known) leave beside the `resident` persistent bytes,
    and those bounds in words for a message."""
    room, said = _MAX_END, "an offset can reach"
    for bound, what in ((limit, "its limit"), (lease, "the session's device lease")):
        if bound is not None and bound - resident < room:
            room = bound - resident
            said = (
                f"{what} of {bound} leaves beside {resident} resident persistent bytes"
                if resident
                else f"of {what}"
            )
    return room, said


def _indices(pieces: Iteration, ids: tuple[int, ...]) -> list[int]:
    """The indices in `pieces.blocks` of the pieces with these ids."""
    where = {b.id: k for k, b in enumerate(pieces.blocks)}
    return [where[i] for i in ids]


def _names(
    it: Iteration,
    origin: dict[int, tuple[str, int]],
    first: dict[int, int],
    in_pieces: tuple[int, ...],
) -> dict[int, str]:
    """Piece id -> what it is, in the wire's terms."""
    names: dict[int, str] = {}
    for piece, (kind, k) in origin.items():
        if kind == SCRATCH:
            names[piece] = f"piece {piece} (the scratch of the rebuild before the op at tick {k})"
        elif kind == PERSISTENT:
            names[piece] = f"piece {piece} (of persistent block {it.persistent[k][0]})"
        else:
            names[piece] = f"piece {piece} (of allocation {k}, rebuilt)"
    for i, piece in first.items():
        names[piece] = f"piece {piece} (allocation {i}'s first)"
    for j, piece in enumerate(in_pieces):
        names[piece] = f"piece {piece} (swap {j}'s swap-in)"
    return names


# -- version 3: virtual residency --------------------------------------------------------------


def paged_session_plan(
    it: Iteration,
    limit: int,
    gbps: float,
    page: int,
    persistent_at: Sequence[tuple[int, bool]],
    compute_scale: float = 1.0,
    time_limit_s: float = 2.0,
    budget_s: float | None = None,
) -> paged.PagedPlan:
    """The plan the daemon sends a session under virtual residency: `paged.plan` of `it` for
    `limit` mapped bytes (0: no limit, no schedule) in pages of `page` bytes, with
    `session_schedule` as its policy and copies at `gbps` each way, the persistent blocks
    where the session put them (`persistent_at`: address and page ownership per
    `it.persistent`), layouts tried and schedules searched within `budget_s`. Whether it fits
    is the plan's `fits`."""
    return paged.plan(
        it,
        session_schedule_within(budget_s),
        limit,
        gbps,
        gbps,
        compute_scale,
        page=page,
        time_limit_s=time_limit_s,
        persistent_at=persistent_at,
        budget_s=budget_s,
    )


def encode_paged(it: Iteration, plan: paged.PagedPlan, copy_gbps: float) -> pool_pb2.PlanUpdate:
    """`plan` (made for `it` by `paged.plan`, simulated at `copy_gbps` each way) as a
    version-3 PlanUpdate:

    - `sizes[i]`, `addresses[i]` (bytes from `Layout.region_start`), `owning[i]`; `page_bytes`
      and `region_bytes` (the layout's length past `region_start`, whole pages);
    - the swap columns as in version 2, `swap_in_ticks[j]` the tick after which swap j's
      pages are mapped again (the simulated copy starts after it);
    - `limit_bytes` (0: no limit), `mapped_peak_bytes`, and the simulator's `prediction` on
      the paged iteration (its footprint: the mapped peak).

    ValueError for a plan that does not fit, one that rebuilds blocks (a paged session does
    not), or one whose schedule a client would not run as it says (`on_ops` rounds it)."""
    if not plan.fits or plan.mapped_peak is None:
        raise ValueError(
            f"the plan does not fit its limit {plan.limit} in mapped pages: nothing to send"
        )
    schedule, lay, r = plan.schedule, plan.layout, plan.result
    if schedule.recomputes:
        raise ValueError("the schedule rebuilds blocks: a paged plan only swaps them")
    if on_ops(it, schedule) != schedule:
        raise ValueError("the schedule issues swap-ins between ops: round it with on_ops")
    base = lay.region_start
    if any(a < base for a in lay.addresses):
        raise ValueError(f"a block lies before the plan's region, which starts at {base}")
    return planupdate.write(
        Columns(
            plan_id=0,
            version=PAGED_VERSION,
            signature=signature(it),
            sizes=tuple(int(b.size) for b in it.blocks),
            placement=Pages(
                page=lay.page,
                addresses=tuple(a - base for a in lay.addresses),
                owning=tuple(lay.owning),
                region_bytes=lay.length - base,
                mapped_peak=int(plan.mapped_peak),
            ),
            swaps=_swaps(it, schedule),
            swap_in_ticks=tuple(_mapped_after(r)),
            limit=int(plan.limit),
            prediction=_prediction(r, int(plan.mapped_peak), copy_gbps),
        )
    )


@dataclass(frozen=True, slots=True)
class DecodedPaged:
    """A version-3 PlanUpdate back on its iteration's ticks and indices."""

    schedule: SwapPlan  # every swap with its `in_at`; no recomputations
    addresses: tuple[int, ...]  # per allocation: bytes from the start of the plan's region
    owning: tuple[bool, ...]  # per allocation: it has whole pages of its own
    region_bytes: int  # the region's length, whole pages
    page: int
    limit: Bytes | None  # None: no limit
    copy_gbps: float
    mapped_peak: Bytes


def decode_paged(it: Iteration, update: pool_pb2.PlanUpdate) -> DecodedPaged:
    """The schedule and addresses a version-3 `update` carries, on `it`'s ticks. ValueError
    names the first column that does not fit `it` or the others (`planupdate.read`'s checks:
    the page, the addresses and the region, version-2 fields, swaps of blocks that share
    pages, recomputations; then `it`'s)."""
    if update.version != PAGED_VERSION:
        raise ValueError(f"plan version {update.version}, not {PAGED_VERSION}")
    if not update.page_bytes:
        raise ValueError(f"page_bytes 0 is not a power of two of at least {ALIGNMENT} bytes")
    c = _read(it, update)
    pages = c.placement
    assert isinstance(pages, Pages)  # version 3 with a page
    return DecodedPaged(
        schedule=_on_ticks(it, c),
        addresses=pages.addresses,
        owning=pages.owning,
        region_bytes=pages.region_bytes,
        page=pages.page,
        limit=Bytes(c.limit) if c.limit else None,
        copy_gbps=c.prediction.copy_gbps if c.prediction is not None else 0.0,
        mapped_peak=Bytes(pages.mapped_peak),
    )


def check_paged(
    it: Iteration,
    update: pool_pb2.PlanUpdate,
    swap_limit: int,
    gbps: float,
    persistent_at: Sequence[tuple[int, bool]],
    compute_scale: float = 1.0,
) -> paged.PagedPlan:
    """Check a version-3 `update` as a whole against `it`, for a session whose swap limit is
    `swap_limit` (0: none), whose copies run at `gbps` and whose persistent blocks lie at
    `persistent_at` (address in its range and page ownership, per `it.persistent`), sharing
    no state with the plan that made it:

    decode it; require it made for that limit and bandwidth, its mapped peak within the
    limit; rebuild the layout (the region starts at the first page past every persistent
    block, as `paged.layout` puts it); simulate the schedule on `paged.paged(it, layout)` and
    require the prediction to be that simulation; `validate_swaps` under `limit_bytes`;
    count the mapped pages again from the addresses (`paged.validate_pages`) and require the
    mapped peak to be that count. Returns the plan as checked; ValueError (InvalidSwapPlan)
    names the problem."""
    d = decode_paged(it, update)
    if update.signature != signature(it):
        raise ValueError("the plan's signature is not the iteration's")
    if not update.HasField("prediction") or not d.copy_gbps > 0:
        raise ValueError("the plan has no prediction, or no copy bandwidth to simulate it at")
    made_for = (int(update.limit_bytes), d.copy_gbps)
    if made_for != (swap_limit, gbps):
        raise ValueError(
            f"made for limit {made_for[0]} at {made_for[1]:g} GB/s, not the session's"
            f" {swap_limit} at {gbps:g} GB/s"
        )
    if d.limit is not None and d.mapped_peak > d.limit:
        raise ValueError(f"the mapped peak {d.mapped_peak} is over the limit {d.limit}")
    lay = _layout(it, d, persistent_at)
    pit = paged.paged(it, lay)
    schedule = d.schedule
    result = simulate(pit, schedule, d.limit, gbps, gbps, compute_scale)
    p = Prediction.of(update.prediction)
    _simulated_as_predicted(result, p)
    validate_swaps(pit, schedule, result, d.limit, gbps, compute_scale)
    starts = _mapped_after(result)
    if list(update.swap_in_ticks) != starts:
        raise ValueError(
            f"the swap-ins start after ticks {list(update.swap_in_ticks)}; the simulation"
            f" maps their pages after {starts}"
        )
    peak = paged.validate_pages(it, lay, schedule, result, d.limit)
    if peak != d.mapped_peak or p.footprint_bytes != peak:
        raise ValueError(
            f"mapped peak {d.mapped_peak} and footprint {p.footprint_bytes}: the addresses map"
            f" {peak} bytes at most"
        )
    return paged.PagedPlan(schedule, result, lay, Bytes(int(update.limit_bytes)), Bytes(peak))


def _mapped_after(result: Result) -> list[int]:
    """Per swap of a paged plan simulated as `result`: the tick after which its pages are
    mapped again and its copy in starts (its `swap_in_ticks`)."""
    return [max(back - 1, 0) for _, back in result.swap_ticks]


def _layout(
    it: Iteration, d: DecodedPaged, persistent_at: Sequence[tuple[int, bool]]
) -> paged.Layout:
    """The layout a decoded version-3 plan of `it` says, its region past the persistent
    blocks at `persistent_at` (as `paged.layout` puts it). ValueError for persistent
    addresses that do not suit its pages, or a swap of a persistent block that shares pages."""
    page = d.page
    if len(persistent_at) != len(it.persistent):
        raise ValueError(
            f"{len(persistent_at)} persistent addresses for {len(it.persistent)} persistent blocks"
        )
    region_start = 0
    for (pid, size), (address, own) in zip(it.persistent, persistent_at, strict=True):
        if address < 0 or (own and address % page):
            raise ValueError(
                f"persistent block {pid} at {address} cannot"
                f" {'own pages' if own else 'lie'} there with pages of {page} bytes"
            )
        end = address + (pages_of(size, page) if own else size)
        region_start = max(region_start, -(-end // page) * page)
    for k, s in enumerate(d.schedule.swaps):
        if s.persistent and not persistent_at[s.block][1]:
            raise ValueError(
                f"swap_blocks[{k}] = {it.persistent[s.block][0]}: the persistent block shares"
                " pages, and never moves"
            )
    addresses = tuple(region_start + a for a in d.addresses)
    owned_end = max(
        (
            a + pages_of(b.size, page)
            for a, b, own in zip(addresses, it.blocks, d.owning, strict=True)
            if own
        ),
        default=region_start,
    )
    return paged.Layout(
        page=page,
        addresses=addresses,
        persistent_addresses=tuple(a for a, _ in persistent_at),
        owning=d.owning,
        persistent_owning=tuple(o for _, o in persistent_at),
        packed_start=max(owned_end, region_start),
        length=region_start + d.region_bytes,
        solver="wire",
        region_start=region_start,
    )


def refreshed_paged(
    it: Iteration,
    update: pool_pb2.PlanUpdate,
    persistent_at: Sequence[tuple[int, bool]],
    compute_scale: float = 1.0,
    gbps: float | None = None,
) -> pool_pb2.PlanUpdate:
    """A copy of the version-3 `update` with its prediction, swap-in starts and mapped peak
    simulated again on `it` (its persistent blocks at `persistent_at`), with copies at `gbps`
    each way (None: the plan's own bandwidth), for `check_paged` to judge as any plan:
    `refreshed` for a session under virtual residency. The schedule runs under the plan's
    limit. ValueError when `update` does not decode against `it`, or its schedule no longer
    runs within the limit."""
    d = decode_paged(it, update)
    if not update.HasField("prediction") or not d.copy_gbps > 0:
        raise ValueError("the plan has no prediction, or no copy bandwidth to simulate it at")
    lay = _layout(it, d, persistent_at)
    gbps = d.copy_gbps if gbps is None else gbps
    result = simulate(paged.paged(it, lay), d.schedule, d.limit, gbps, gbps, compute_scale)
    if not result.feasible:
        raise ValueError(f"the schedule no longer runs within its limit of {d.limit} bytes")
    peak = paged.validate_pages(it, lay, d.schedule, result, d.limit)
    starts = _mapped_after(result)
    fresh = _retimed(update, _prediction(result, peak, gbps), starts)
    fresh.mapped_peak_bytes = peak
    return fresh


@dataclass(frozen=True, slots=True)
class Simulated:
    """A PlanUpdate's schedule simulated on the iteration it was made for: the iteration as
    simulated (a paged plan's: blocks in whole pages, `paged.paged`), the schedule on its
    ticks, and the simulation."""

    iteration: Iteration
    schedule: SwapPlan
    result: Result


def simulated(
    it: Iteration,
    update: pool_pb2.PlanUpdate,
    persistent_at: Sequence[tuple[int, bool]] = (),
    compute_scale: float = 1.0,
) -> Simulated:
    """Simulate `update` (version 2, or 3 with the session's persistent blocks at
    `persistent_at`) on `it` at its prediction's copy bandwidth, as `check` and `check_paged`
    do, without requiring the result to be its prediction: what a tool lays beside a live run
    (`it` may be the trace the run replayed, its op times not the ones the daemon measured).
    ValueError names what does not fit `it`."""
    if not update.HasField("prediction") or not update.prediction.copy_gbps > 0:
        raise ValueError("the plan has no prediction, or no copy bandwidth to simulate it at")
    gbps = update.prediction.copy_gbps
    if update.version == PAGED_VERSION:
        d = decode_paged(it, update)
        pit = paged.paged(it, _layout(it, d, persistent_at))
        result = simulate(pit, d.schedule, d.limit, gbps, gbps, compute_scale)
        return Simulated(pit, d.schedule, result)
    v2 = decode(it, update)
    limit = None if v2.limit is None else int(update.prediction.peak_bytes)
    result = simulate(it, v2.schedule, limit, gbps, gbps, compute_scale)
    return Simulated(it, v2.schedule, result)
