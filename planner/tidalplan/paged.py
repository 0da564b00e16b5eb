"""Virtual residency: every block keeps one address for life, and the limit counts mapped pages.

A session reserves a virtual range; the plan gives every block an address in it, from its
malloc to its free, swapped or not. Physical memory is the lease's pages (`page` bytes, the
backend's mapping granularity): a page is mapped while a block on it is resident (live and not
swapped out) and unmapped otherwise. The range is laid out once per iteration, with no limit on
its length, so a schedule that keeps the mapped pages under the limit fits as it stands:

    address 0                                                                          length
    │ persistent page-owning │ transient page-owning blocks: placed │ the packed region: every │
    │ blocks, each on whole  │ on their lifetimes (Planner I), on   │ other block, persistent  │
    │ pages                  │ whole pages, page-aligned            │ first, placed tightly    │
    └─ its pages are mapped while the block is resident; only these ┴─ a page is mapped while ─┘
       blocks are swapped (a swap moves whole pages)                   any block on it is live

A page-owning block is one of a page or more whose rounding up to whole pages wastes at most
`max_waste` of its size (what its swaps copy and what it maps): rounding a 2.1 MiB block up to
4 MiB would cost nearly twice its bytes, so such blocks are packed with the small ones instead.
Packed blocks are never swapped (swapping one would free no page its neighbours still use);
which of the packed region's pages are mapped at a tick follows from the layout alone, whatever
the schedule. So the mapped bytes at a tick are the page-owning blocks resident then, at whole
pages, plus that fixed profile, and the scheduler sees exactly this in `paged(it, layout)`: the
iteration with page-owning blocks at their rounded sizes, packed blocks weighing nothing and
never accessed (no gap to swap), and the packed region's profile as blocks of whole pages that
no op touches, appended after the iteration's own (their indices are kept).

`validate_pages` counts the mapped pages again from the addresses alone, tick by tick, and is
what makes a plan feasible here: no page-owning block shares a page with a resident block, and
never more mapped bytes than the limit.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from tidalcore.pages import MAX_WASTE, PAGE, owns_pages, pages_of
from tidalcore.units import ALIGNMENT, Bytes, Tick, align_up

from tidalplan.learn import to_problem
from tidalplan.model import Iteration, IterBlock, SwapPlan
from tidalplan.placement import solve, time_left
from tidalplan.simulate import Result, simulate
from tidalplan.validate import InvalidSwapPlan, validate, validate_swaps

WASTES = (0.02, 0.05, 0.125)
"""The `max_waste`s `plan` tries, keeping the fastest plan."""

LAST_RESORT = 1.0
"""The `max_waste` `plan` tries when none of its `wastes` fits: every block of a page or more
owns its pages, so the most bytes can leave the device (at the most rounding)."""

Policy = Callable[[Iteration, int, float, float], SwapPlan]


@dataclass(frozen=True, slots=True)
class Layout:
    """Where every block of an iteration lives in the session's virtual range.

    `addresses[i]` is block i's (`Iteration.blocks`), `persistent_addresses[k]` persistent
    block k's, in bytes from the range's start; `owning[i]` / `persistent_owning[k]`: whether
    it has whole pages of its own (else it lies in the packed region, [`packed_start`,
    `length`))."""

    page: int
    addresses: tuple[int, ...]
    persistent_addresses: tuple[int, ...]
    owning: tuple[bool, ...]
    persistent_owning: tuple[bool, ...]
    packed_start: int  # whole pages
    length: int  # the range: whole pages
    solver: str  # what placed the page-owning transient blocks
    # Where the transient blocks' part of the range begins (whole pages): 0, or, for persistent
    # blocks a session placed itself (`layout(persistent_at=)`), past all of their pages. A
    # session may put that part at any page-aligned address past what it placed before.
    region_start: int = 0


def _placed(
    it: Iteration, indices: list[int], size_of: Callable[[int], int], alignment: int, seconds: float
) -> tuple[dict[int, int], int, str]:
    """Planner I over the blocks `indices` of `it` at sizes `size_of(size)`: offset per index,
    height, solver."""
    if not indices:
        return {}, 0, "none"
    part = dataclasses.replace(
        it,
        blocks=tuple(
            dataclasses.replace(it.blocks[i], size=Bytes(size_of(it.blocks[i].size)))
            for i in indices
        ),
        accesses=(),
        persistent=(),
    )
    problem, index = to_problem(part, alignment)
    placement = solve(problem, time_limit_s=seconds)
    validate(problem, placement)
    offsets = {indices[j]: int(off) for j, off in zip(index, placement.offsets, strict=True)}
    return offsets, int(placement.height), placement.solver


def _given(
    it: Iteration, page: int, persistent_at: Sequence[tuple[int, bool]]
) -> tuple[list[int], tuple[bool, ...], int]:
    """The addresses and page ownership of `it`'s persistent blocks as a session placed them,
    checked, and the first whole page past them all."""
    if len(persistent_at) != len(it.persistent):
        raise ValueError(
            f"{len(persistent_at)} persistent addresses for {len(it.persistent)} persistent blocks"
        )
    end = 0
    for (pid, size), (address, own) in zip(it.persistent, persistent_at, strict=True):
        if address < 0 or (own and (address % page or size < page)):
            raise ValueError(
                f"persistent block {pid} ({size} bytes) at {address} cannot"
                f" {'own pages' if own else 'lie'} there with pages of {page} bytes"
            )
        end = max(end, address + (pages_of(size, page) if own else size))
    return [a for a, _ in persistent_at], tuple(o for _, o in persistent_at), align_up(end, page)


def layout(
    it: Iteration,
    page: int = PAGE,
    max_waste: float = MAX_WASTE,
    time_limit_s: float = 2.0,
    persistent_at: Sequence[tuple[int, bool]] | None = None,
) -> Layout:
    """Lay `it` out in a virtual range of pages of `page` bytes (see the module doc).

    `persistent_at`: per persistent block, the address and page ownership a session already
    gave it (a block keeps its address for life, and persistent blocks are allocated before
    any plan); the transient blocks are then laid out past them, from `region_start`, in
    pages of their own."""
    if page < ALIGNMENT or page % ALIGNMENT:
        raise ValueError(f"page of {page} bytes is not a positive multiple of {ALIGNMENT}")
    for b in it.blocks:
        if b.end - it.ticks > b.start:  # its two instances live at once: no one address
            raise ValueError(
                f"block {b.id} is allocated again (tick {b.start}) while its instance of the"
                f" iteration before is live (to tick {b.end - it.ticks}): a paged plan gives"
                " each allocation of the iteration one address, so each block must be freed"
                " before it is allocated again (drop the last reference to a tensor before"
                " making the one that replaces it)"
            )
    owning = tuple(owns_pages(b.size, page, max_waste) for b in it.blocks)
    if persistent_at is not None:
        persistent, persistent_owning, address = _given(it, page, persistent_at)
    else:
        persistent_owning = tuple(owns_pages(size, page, max_waste) for _, size in it.persistent)
        address = 0
        persistent = [0] * len(it.persistent)
        for k, (_, size) in enumerate(it.persistent):
            if persistent_owning[k]:
                persistent[k] = address
                address += pages_of(size, page)
    region_start = address if persistent_at is not None else 0
    own = [i for i, b in enumerate(it.blocks) if owning[i]]
    big, height, solver = _placed(it, own, lambda s: pages_of(s, page), page, time_limit_s)
    addresses = [0] * len(it.blocks)
    for i, off in big.items():
        addresses[i] = address + off
    packed_start = address = address + height
    for k, (_, size) in enumerate(it.persistent):
        if not persistent_owning[k] and persistent_at is None:
            persistent[k] = address
            address += align_up(size, ALIGNMENT)
    rest = [i for i, b in enumerate(it.blocks) if not owning[i] and b.size > 0]
    packed, packed_height, _ = _placed(it, rest, lambda s: s, ALIGNMENT, time_limit_s)
    for i in range(len(it.blocks)):
        if not owning[i]:  # a zero-size block holds nothing: any address of the region
            addresses[i] = address + packed.get(i, 0)
    return Layout(
        page=page,
        addresses=tuple(addresses),
        persistent_addresses=tuple(persistent),
        owning=owning,
        persistent_owning=persistent_owning,
        packed_start=packed_start,
        length=align_up(address + packed_height, page),
        solver=solver,
        region_start=region_start,
    )


def _lives(it: Iteration, first: int, end: int) -> Iterator[tuple[int, int]]:
    """The ticks of one iteration a block allocated at `first` and freed at `end` is live:
    [first, end), or, when it is freed in the next iteration, [first, ticks) and its previous
    instance's [0, end - ticks)."""
    if end <= it.ticks:
        yield first, end
    else:
        yield first, it.ticks
        yield 0, end - it.ticks


def _mapped(spans: dict[int, list[tuple[int, int]]], ticks: int) -> list[int]:
    """Pages mapped at each tick, from each page's live spans (a page is mapped over their
    union)."""
    delta = [0] * (ticks + 1)
    for held in spans.values():
        held.sort()
        lo, hi = held[0]
        for a, b in held[1:]:
            if a > hi:
                delta[lo] += 1
                delta[hi] -= 1
                lo, hi = a, b
            else:
                hi = max(hi, b)
        delta[lo] += 1
        delta[hi] -= 1
    counts, level = [], 0
    for t in range(ticks):
        level += delta[t]
        counts.append(level)
    return counts


def _packed_pages(it: Iteration, lay: Layout) -> list[int]:
    """Pages of the packed region mapped at each tick: those any live packed block lies on."""
    page = lay.page
    spans: dict[int, list[tuple[int, int]]] = {}

    def cover(address: int, size: int, lives: list[tuple[int, int]]) -> None:
        for p in range(address // page, (address + size - 1) // page + 1):
            spans.setdefault(p, []).extend(lives)

    for k, (_, size) in enumerate(it.persistent):
        if not lay.persistent_owning[k] and size > 0:
            cover(lay.persistent_addresses[k], size, [(0, it.ticks)])
    for i, b in enumerate(it.blocks):
        if not lay.owning[i] and b.size > 0:
            cover(lay.addresses[i], b.size, list(_lives(it, b.start, b.end)))
    return _mapped(spans, it.ticks)


def _profile_blocks(counts: list[int], page: int, first_id: int) -> list[IterBlock]:
    """Blocks of whole pages whose live bytes at each tick are `counts[t]` pages: each rise
    opens a block, each fall closes the most recently opened (split where it closes part)."""
    made: list[IterBlock] = []
    open_: list[tuple[int, int]] = []  # (start tick, pages), the latest last
    level = 0
    for t, count in enumerate([*counts, 0]):
        if count > level:
            open_.append((t, count - level))
        while count < level:
            start, pages = open_.pop()
            closed = min(pages, level - count)
            made.append(IterBlock(first_id + len(made), Bytes(closed * page), Tick(start), Tick(t)))
            if closed < pages:
                open_.append((start, pages - closed))
            level -= closed
        level = count
    return made


def paged(it: Iteration, lay: Layout) -> Iteration:
    """`it` as the scheduler must see it under `lay`: its live bytes at every tick are the
    mapped bytes (page-owning blocks at whole pages, packed ones at 0 and never accessed, the
    packed region's mapped pages as blocks appended after `it`'s own). Block indices are kept,
    so a schedule made on it is a schedule of `it`."""
    page = lay.page
    packed_ids = {b.id for b, own in zip(it.blocks, lay.owning, strict=True) if not own}
    packed_ids.update(
        pid for (pid, _), own in zip(it.persistent, lay.persistent_owning, strict=True) if not own
    )
    blocks = [
        dataclasses.replace(b, size=Bytes(pages_of(b.size, page) if own else 0))
        for b, own in zip(it.blocks, lay.owning, strict=True)
    ]
    persistent = tuple(
        (pid, Bytes(pages_of(size, page) if own else 0))
        for (pid, size), own in zip(it.persistent, lay.persistent_owning, strict=True)
    )
    ids = [b.id for b in it.blocks] + [pid for pid, _ in it.persistent] + [0]
    blocks += _profile_blocks(_packed_pages(it, lay), page, max(ids) + 1)
    return dataclasses.replace(
        it,
        blocks=tuple(blocks),
        accesses=tuple(a for a in it.accesses if a.block not in packed_ids),
        persistent=persistent,
    )


def validate_pages(
    it: Iteration, lay: Layout, plan: SwapPlan, result: Result, limit: int | None
) -> int:
    """The most bytes mapped at any tick of `it` under `plan` as `result` simulated it, counted
    from the addresses of `lay` alone; InvalidSwapPlan when a page-owning block is resident on
    a page with another resident block, a block lies outside the range, or the mapped bytes
    exceed `limit` (None: no limit).

    A block is resident over its lifetime less the ticks it is away ([gone, back) of each
    swap, from `result.swap_ticks`; a swap across the boundary is away from `gone` to the end
    and from the start to `back`), as `validate_swaps` counts device bytes."""
    page, ticks = lay.page, it.ticks
    if len(result.swap_ticks) != len(plan.swaps):
        raise InvalidSwapPlan("the result is not the simulation of this plan on this iteration")
    away: dict[tuple[bool, int], list[tuple[int, int]]] = {}
    for s, (gone, back) in zip(plan.swaps, result.swap_ticks, strict=True):
        spans = away.setdefault((s.persistent, s.block), [])
        if s.in_before <= s.out_after:  # across the boundary
            spans += [(gone, ticks), (0, back)]
        else:
            spans.append((gone, back))
    for r in plan.recomputes:
        away.setdefault((False, r.block), []).append((r.drop_after + 1, r.before))
    on_page: dict[int, list[tuple[int, int]]] = {}  # page -> resident spans of blocks on it
    owned: dict[int, list[tuple[int, int, str]]] = {}  # the same, of page-owning blocks

    def resident(
        lives: list[tuple[int, int]],
        gaps: list[tuple[int, int]],
        address: int,
        size: int,
        owner: bool,
        name: str,
    ) -> None:
        if size <= 0:
            return
        if address < 0 or address + size > lay.length or (owner and address % page):
            raise InvalidSwapPlan(f"{name} at {address} (+{size}) is not where it may lie")
        spans = lives
        for gone, back in sorted(gaps):  # cut the spans it is away out
            spans = [
                piece
                for lo, hi in spans
                for piece in ((lo, min(hi, gone)), (max(lo, back), hi))
                if piece[0] < piece[1]
            ]
        end = address + (pages_of(size, page) if owner else size)
        for p in range(address // page, (end - 1) // page + 1):
            on_page.setdefault(p, []).extend(spans)
            if owner:
                owned.setdefault(p, []).extend((lo, hi, name) for lo, hi in spans)

    for k, (pid, size) in enumerate(it.persistent):
        resident(
            [(0, ticks)],
            away.get((True, k), []),
            lay.persistent_addresses[k],
            size,
            lay.persistent_owning[k],
            f"persistent block {pid}",
        )
    for i, b in enumerate(it.blocks):
        resident(
            list(_lives(it, b.start, b.end)),
            away.get((False, i), []),
            lay.addresses[i],
            b.size,
            lay.owning[i],
            f"block {b.id}",
        )
    for p, mine in owned.items():  # a page-owning block's page is its alone while resident
        if len(on_page[p]) > len(mine):
            raise InvalidSwapPlan(f"page {p} holds a page-owning block and a packed one")
        mine.sort()
        for (_, hi, other), (lo, _, name) in itertools.pairwise(mine):
            if lo < hi:
                raise InvalidSwapPlan(f"{other} and {name} are both resident on page {p}")
    counts = _mapped(on_page, ticks)
    for t, count in enumerate(counts):
        if limit is not None and count * page > limit:
            raise InvalidSwapPlan(f"tick {t}: {count * page} bytes mapped > the limit {limit}")
    return max(counts, default=0) * page


@dataclass(frozen=True, slots=True)
class PagedPlan:
    """A schedule for a session whose blocks keep their addresses: the layout, the schedule
    made on `paged(it, layout)`, its simulation there, and the mapped bytes at their peak
    (`validate_pages`); `fits` when the simulation ran and both validators passed."""

    schedule: SwapPlan
    result: Result
    layout: Layout
    limit: Bytes  # 0: none
    mapped_peak: Bytes | None  # None: infeasible

    @property
    def fits(self) -> bool:
        return self.mapped_peak is not None

    @property
    def footprint(self) -> int | None:
        """The device bytes the plan needs: its mapped pages at their peak (None: infeasible)."""
        return None if self.mapped_peak is None else int(self.mapped_peak)

    @property
    def planned_for(self) -> Bytes:
        """The limit its schedule was made for: the limit itself (nothing is made again)."""
        return self.limit


def plan(
    it: Iteration,
    policy: Policy,
    limit: int,
    out_gbps: float,
    in_gbps: float,
    compute_scale: float = 1.0,
    page: int = PAGE,
    wastes: Sequence[float] = WASTES,
    time_limit_s: float = 2.0,
    persistent_at: Sequence[tuple[int, bool]] | None = None,
    budget_s: float | None = None,
) -> PagedPlan:
    """The fastest feasible of `policy`'s plans for `limit` mapped bytes (0: no limit, no
    schedule), one per layout of `wastes` (each a `max_waste`; layouts that give the same
    blocks pages are made once), then, only when none is feasible, of `LAST_RESORT`'s; each
    simulated and validated on its paged iteration. When none is feasible, the first. One
    schedule a layout: whatever fits in mapped pages fits as it is placed, so nothing is made
    again for a lower limit. `budget_s`: no layout is started once that many seconds have
    passed since the call (the first always is), a layout's two placement solves get at most
    what is left of them when it starts (`time_left`), and the plans made so far decide.

    Which blocks should own pages is a trade: rounding to whole pages costs bytes, while a
    packed block can never leave the device. Small wastes suit loose limits (few blocks need to
    move), larger ones tight limits. `persistent_at`: as `layout`'s."""
    if not wastes:
        raise ValueError("at least one max_waste is needed")
    cap = limit or None
    best: PagedPlan | None = None
    seen: set[tuple[tuple[bool, ...], tuple[bool, ...]]] = set()
    started = time.monotonic()
    for waste in [*wastes, LAST_RESORT]:
        if waste == LAST_RESORT and best is not None and best.fits:
            break
        if best is not None and budget_s is not None and time.monotonic() - started >= budget_s:
            break
        lay = layout(it, page, waste, time_left(time_limit_s, budget_s, started), persistent_at)
        if (lay.owning, lay.persistent_owning) in seen:
            continue
        seen.add((lay.owning, lay.persistent_owning))
        pit = paged(it, lay)
        schedule = policy(pit, limit, out_gbps, in_gbps) if limit else SwapPlan()
        result = simulate(pit, schedule, cap, out_gbps, in_gbps, compute_scale)
        peak = None
        if result.feasible:
            validate_swaps(pit, schedule, result, cap, in_gbps, compute_scale)
            peak = Bytes(validate_pages(it, lay, schedule, result, cap))
        made = PagedPlan(schedule, result, lay, Bytes(limit), peak)
        if best is None or (
            made.fits and (not best.fits or result.iteration_ns < best.result.iteration_ns)
        ):
            best = made
    assert best is not None
    return best
