"""Convolution workspaces: μ-cuDNN's WR and WD against brute force, the desirable sets, and
SuperNeurons' per-step budgets on hand-placed plans."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import numpy as np
import pytest
from tidalcore.units import Bytes, Offset, Tick
from tidalplan.combined import Combined, combine
from tidalplan.model import Iteration, IterBlock, Op, Placement, SwapPlan
from tidalplan.simulate import simulate
from tidalplan.workspace import (
    BatchPolicy,
    Config,
    Micro,
    NoFit,
    Table,
    batch_sizes,
    budgets,
    choose,
    desirable,
    fastest_fitting,
    wd,
    wr,
)

from .iterations import TWO_LAYERS, build

POLICY_CYCLE: tuple[BatchPolicy, ...] = ("all", "all", "powerOfTwo", "undivided")


def random_entries(rng: random.Random, batch: int, algorithms: int) -> list[Micro]:
    """A table shaped like a convolution's: time about linear in b, an algorithm's efficiency
    and workspace its own; some entries missing."""
    out = []
    for a in range(algorithms):
        per = rng.randint(3, 12)
        ws_per = rng.choice((0, 0, 5, 20))
        for b in range(1, batch + 1):
            if rng.random() < 0.15 and b != batch:
                continue
            time = per * b + rng.randint(0, 15)
            ws = ws_per * b + rng.choice((0, 10, 30)) if ws_per else rng.choice((0, 0, 10))
            out.append(Micro(b, f"algo{a}", time, Bytes(ws)))
    return out


def divisions(entries: list[Micro], batch: int) -> Iterator[tuple[Micro, ...]]:
    """Every multiset of entries whose micro-batches sum to `batch`."""

    def grow(first: int, left: int) -> Iterator[tuple[Micro, ...]]:
        if left == 0:
            yield ()
            return
        for i in range(first, len(entries)):
            if entries[i].batch <= left:
                for rest in grow(i, left - entries[i].batch):
                    yield (entries[i], *rest)

    return grow(0, batch)


def brute_points(entries: list[Micro], batch: int, policy: BatchPolicy) -> set[tuple[int, int]]:
    sizes = set(batch_sizes(policy, batch))
    usable = [m for m in entries if m.batch in sizes]
    return {
        (sum(m.time_ns for m in d), max(m.workspace for m in d)) for d in divisions(usable, batch)
    }


def cases(n: int, seed: int) -> Iterator[tuple[list[Micro], int, BatchPolicy]]:
    rng = random.Random(seed)
    for k in range(n):
        batch = 12 if k % 4 == 0 else rng.randint(1, 10)
        entries = random_entries(rng, batch, rng.choice((3, 4)))
        yield entries, batch, POLICY_CYCLE[k % len(POLICY_CYCLE)]


# -- types and tables -------------------------------------------------------------------------


def test_a_configuration_sums_its_times_and_shares_one_workspace() -> None:
    c = Config((Micro(2, "fft", 30, Bytes(500)), Micro(6, "gemm", 70, Bytes(100))))
    assert (c.batch, c.time_ns, c.workspace) == (8, 100, 500)
    assert [m.batch for m in c.micros] == [6, 2]  # kept in one order: equal sets compare equal
    assert c == Config((Micro(6, "gemm", 70, Bytes(100)), Micro(2, "fft", 30, Bytes(500))))


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ((0, "gemm", 10, 0), "batch must be positive, got 0"),
        ((4, "gemm", -1, 0), "time_ns must not be negative, got -1"),
        ((4, "gemm", 10, -5), "workspace must not be negative, got -5"),
        ((4, "gemm", 1.5, 0), "time_ns must be an integer, got 1.5"),
        ((4, "gemm", 10), "not enough values to unpack (expected 4, got 3)"),
    ],
)
def test_a_bad_table_names_the_kernel_and_the_entry(entry: object, reason: str) -> None:
    good = (8, "fft", 20, 1 << 20)
    with pytest.raises(ValueError) as e:
        Table.of({"conv0/fwd": [good], "conv1/fwd": [good, entry]})  # type: ignore[list-item]
    assert str(e.value) == f"kernel 'conv1/fwd', entry 1 {entry!r}: {reason}"


def test_an_entry_measured_twice_is_refused() -> None:
    with pytest.raises(ValueError) as e:
        Table.of({"conv1/fwd": [(8, "fft", 20, 0), (4, "fft", 9, 0), (8, "fft", 10, 0)]})
    assert str(e.value) == (
        "kernel 'conv1/fwd', entry 2: batch 8 with algorithm 'fft' is measured twice"
    )


def test_a_kernel_with_no_entry_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^kernel 'conv2/bwd-data' has no measured entry$"):
        Table.of({"conv2/bwd-data": []})


def test_a_table_keeps_its_entries() -> None:
    table = Table.of({"k": [(4, "gemm", 10, 0), Micro(2, "fft", 4, Bytes(64))]})
    assert table.kernels == {"k": (Micro(4, "gemm", 10, Bytes(0)), Micro(2, "fft", 4, Bytes(64)))}


def test_the_batch_size_policies() -> None:
    assert batch_sizes("all", 5) == (1, 2, 3, 4, 5)
    assert batch_sizes("powerOfTwo", 256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert batch_sizes("powerOfTwo", 100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert batch_sizes("powerOfTwo", 1) == (1,)
    assert batch_sizes("undivided", 256) == (256,)
    with pytest.raises(ValueError, match=r"^unknown batch-size policy 'half'"):
        batch_sizes("half", 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^the mini-batch must be positive, got 0$"):
        batch_sizes("all", 0)


# -- WR ---------------------------------------------------------------------------------------


def test_wr_equals_brute_force_on_random_tables() -> None:
    for entries, batch, policy in cases(24, seed=7):
        points = brute_points(entries, batch, policy)
        for limit in [*sorted({w for _, w in points})[:4], 10**9]:
            best = min(t for t, w in points if w <= limit)
            got = wr(entries, batch, limit, policy)
            assert got.time_ns == best
            assert got.batch == batch and got.workspace <= limit
            assert all(m in entries for m in got.micros)
            assert set(got.micros) <= {m for m in entries if m.batch in batch_sizes(policy, batch)}


# Fig. 5: algorithm 4 at micro-batch 60 is efficient (5 ns a sample), so B = 240 runs as four
# of it; an undivided FFT at 240 is faster still (1,000 ns) but needs 10,000 bytes.
FIG5 = [
    Micro(240, "gemm", 2450, Bytes(0)),
    Micro(120, "gemm", 1250, Bytes(0)),
    Micro(60, "gemm", 650, Bytes(0)),
    Micro(120, "alg4", 1130, Bytes(4000)),
    Micro(60, "alg4", 300, Bytes(2000)),
    Micro(30, "alg4", 320, Bytes(1000)),
]
FFT240 = Micro(240, "fft", 1000, Bytes(10_000))


def test_fig5_an_efficient_micro_batch_is_used_repeatedly() -> None:
    got = wr(FIG5, 240, 1 << 30)
    assert got.micros == (Micro(60, "alg4", 300, Bytes(2000)),) * 4
    assert (got.time_ns, got.workspace) == (1200, 2000)


def test_fig5_the_undivided_configuration_when_it_is_fastest() -> None:
    got = wr([*FIG5, FFT240], 240, 1 << 30)
    assert got.micros == (FFT240,)
    # A limit below the FFT's 10,000 bytes forces division again; below alg4's 2,000 at 60,
    # the undivided GEMM.
    assert wr([*FIG5, FFT240], 240, 9_999).micros == (Micro(60, "alg4", 300, Bytes(2000)),) * 4
    assert wr([*FIG5, FFT240], 240, 1_999).micros == (Micro(240, "gemm", 2450, Bytes(0)),)
    assert wr([*FIG5, FFT240], 240, 1 << 30, "undivided").micros == (FFT240,)
    assert wr([*FIG5, FFT240], 240, 9_999, "undivided").micros == (FIG5[0],)


def test_wr_refuses_when_nothing_fits() -> None:
    with pytest.raises(NoFit) as e:
        wr([Micro(8, "fft", 10, Bytes(100)), Micro(4, "fft", 6, Bytes(60))], 8, 59)
    assert str(e.value) == (
        "no division of the mini-batch 8 (all) fits a workspace of 59 bytes;"
        " the least any measured entry needs is 60"
    )


# -- desirable sets ---------------------------------------------------------------------------


def test_desirable_sets_are_the_pareto_front_of_brute_force() -> None:
    for entries, batch, policy in cases(24, seed=11):
        points = brute_points(entries, batch, policy)
        front = desirable(entries, batch, policy)
        got = [(c.time_ns, int(c.workspace)) for c in front]
        for c in front:  # real configurations of this kernel
            assert c.batch == batch and all(m in entries for m in c.micros)
        assert set(got) <= points
        # Every configuration is dominated by, or equal to, one in D ...
        for t, w in points:
            assert any(t2 <= t and w2 <= w for t2, w2 in got), (t, w)
        # ... and nothing in D is dominated by another.
        for a, b in itertools.permutations(got, 2):
            assert not (a[0] <= b[0] and a[1] <= b[1])
        assert got == sorted(got, key=lambda p: p[1])


def test_desirable_fig5() -> None:
    front = desirable([*FIG5, FFT240], 240)
    assert [(c.time_ns, c.workspace) for c in front] == [(2450, 0), (1200, 2000), (1000, 10_000)]


# -- WD ---------------------------------------------------------------------------------------


def random_fronts(rng: random.Random, kernels: int) -> dict[str, tuple[Config, ...]]:
    out = {}
    for k in range(kernels):
        batch = rng.randint(4, 8)
        out[f"conv{k}"] = desirable(random_entries(rng, batch, rng.choice((3, 4))), batch)
    return out


def brute_wd(fronts: dict[str, tuple[Config, ...]], limit: int) -> int | None:
    best = None
    for pick in itertools.product(*fronts.values()):
        if sum(c.workspace for c in pick) <= limit:
            t = sum(c.time_ns for c in pick)
            best = t if best is None else min(best, t)
    return best


def test_wd_equals_brute_force_over_the_desirable_sets() -> None:
    rng = random.Random(3)
    for trial in range(12):
        fronts = random_fronts(rng, 3 + trial % 2)
        least = sum(min(c.workspace for c in f) for f in fronts.values())
        most = sum(max(c.workspace for c in f) for f in fronts.values())
        for limit in sorted({least, most, *(rng.randint(least, most) for _ in range(3))}):
            got = choose(fronts, limit)
            assert got.time_ns == brute_wd(fronts, limit)
            assert got.optimal and got.bound_ns == got.time_ns
            assert got.workspace == sum(c.workspace for c in got.configs.values()) <= limit
            assert got.time_ns == sum(c.time_ns for c in got.configs.values())
            assert all(got.configs[k] in fronts[k] for k in fronts)


def test_wd_refuses_when_even_the_least_workspaces_pass_the_limit() -> None:
    fronts = {
        "a": (Config((Micro(4, "fft", 10, Bytes(300)),)),),
        "b": (Config((Micro(4, "fft", 10, Bytes(200)),)), Config((Micro(4, "w", 5, Bytes(900)),))),
    }
    assert choose(fronts, 500).time_ns == 20
    with pytest.raises(NoFit) as e:
        choose(fronts, 499)
    assert str(e.value) == (
        "the 2 kernels need at least 500 bytes of workspace together, over the limit of 499 bytes"
    )


def test_wd_is_never_worse_than_wr_with_the_limit_split_evenly() -> None:
    rng = random.Random(5)
    compared = 0
    for _ in range(8):
        batch = rng.randint(4, 8)
        table = Table.of(
            {f"conv{k}": random_entries(rng, batch, 4) for k in range(rng.choice((3, 4)))}
        )
        kernels = len(table.kernels)
        for limit in (30 * kernels, 80 * kernels, 200 * kernels):
            try:
                even = sum(wr(e, batch, limit // kernels).time_ns for e in table.kernels.values())
            except NoFit:
                continue
            assert wd(table, batch, limit).time_ns <= even
            compared += 1
    assert compared >= 10


def test_wd_of_one_kernel_is_wr() -> None:
    rng = random.Random(9)
    for _ in range(10):
        batch = rng.randint(2, 10)
        entries = random_entries(rng, batch, 4)
        for limit in (0, 25, 60, 150, 10**6):
            try:
                alone = wr(entries, batch, limit).time_ns
            except NoFit:
                with pytest.raises(NoFit):
                    wd(Table.of({"k": entries}), batch, limit)
                continue
            assert wd(Table.of({"k": entries}), batch, limit).time_ns == alone


# -- SuperNeurons' budgets ----------------------------------------------------------------------

# Five blocks over 14 ticks; E crosses the boundary (allocated at 13, freed at 2 of the next
# iteration, so live at ticks 0 and 1 too). W, 1000 persistent bytes, stays resident.
#   tick   0 a A  1 conv0  2 (E freed)  3 a B  4 a C  5 conv1  6 f B  7 conv2  8 a D  9 conv3
#          10 f D  11 f C  12 f A  13 a E
# The arena, above W, up to the limit 1500 (500 bytes), by hand:
#   offset   0 ─ 100   A [0, 12)
#          100 ─ 300   B [3, 6)        D [8, 10) at 100 ─ 150
#          300 ─ 400   C [4, 11)       E [13, 16) at 300 ─ 360
HAND = Iteration(
    ticks=14,
    blocks=(
        IterBlock(11, Bytes(100), Tick(0), Tick(12)),
        IterBlock(12, Bytes(200), Tick(3), Tick(6)),
        IterBlock(13, Bytes(100), Tick(4), Tick(11)),
        IterBlock(14, Bytes(50), Tick(8), Tick(10)),
        IterBlock(15, Bytes(60), Tick(13), Tick(16), crosses=True),
    ),
    ops=tuple(Op(Tick(t), f"conv{k}", 1000) for k, t in enumerate((1, 5, 7, 9))),
    accesses=(),
    persistent=((1, Bytes(1000)),),
)
HAND_PLAN = Combined(
    pieces=HAND,
    placement=Placement(tuple(Offset(o) for o in (0, 100, 300, 100, 300)), Bytes(400), "hand"),
    resident_persistent=Bytes(1000),
    footprint=Bytes(1400),
)


def test_budgets_are_the_largest_hole_at_each_op() -> None:
    got = [(b.tick, b.op, b.contiguous, b.free) for b in budgets(HAND_PLAN, 1500, alignment=1)]
    assert got == [
        (1, "conv0", 200, 340),  # A and E's previous instance: holes 200 and 140
        (5, "conv1", 100, 100),  # A B C: only above C
        (7, "conv2", 200, 300),  # A and C: B's 200 and 100 above
        (9, "conv3", 150, 250),  # A C D: 150 between D and C, 100 above
    ]
    # The limit sets the top: 100 bytes more, 100 more above every piece.
    assert [b.contiguous for b in budgets(HAND_PLAN, 1600, alignment=1)] == [240, 200, 200, 200]


def test_budgets_count_pieces_in_whole_alignment_units() -> None:
    # A placement with alignment 64: sizes round up (B 200 -> 256, C 100 -> 128, ...).
    plan = Combined(
        pieces=HAND,
        placement=Placement(tuple(Offset(o) for o in (0, 128, 384, 128, 384)), Bytes(512), "hand"),
        resident_persistent=Bytes(1000),
        footprint=Bytes(1512),
    )
    got = [(b.contiguous, b.free) for b in budgets(plan, 1000 + 640, alignment=64)]
    assert got == [(256, 448), (128, 128), (256, 384), (192, 320)]


def test_budgets_refuse_a_plan_over_the_limit() -> None:
    with pytest.raises(ValueError, match=r"^the placed plan needs 1400 bytes, over the limit of"):
        budgets(HAND_PLAN, 1399, alignment=1)


def occupied_runs(plan: Combined, limit: int) -> list[tuple[int, int]]:
    """Brute force, byte by byte: the largest free run and the free bytes at each op."""
    it = plan.pieces
    sized = [b for b in it.blocks if b.size > 0]
    out = []
    for op in it.ops:
        t = int(op.tick)
        used = np.zeros(limit - int(plan.resident_persistent), bool)
        for b, o in zip(sized, plan.placement.offsets, strict=True):
            if b.start <= t < b.end or (b.crosses and t < b.end - it.ticks):
                used[o : o + b.size] = True
        run = longest = 0
        for u in used:
            run = 0 if u else run + 1
            longest = max(longest, run)
        out.append((longest, int((~used).sum())))
    return out


def test_budgets_of_a_placed_plan_match_a_byte_by_byte_count() -> None:
    it = build(TWO_LAYERS, {"W": 3000})
    placed = combine(it, SwapPlan(), simulate(it, SwapPlan(), None, 1.0, 1.0), alignment=1)
    limit = int(placed.footprint) + 700
    got = [(b.contiguous, b.free) for b in budgets(placed, limit, alignment=1)]
    assert got == occupied_runs(placed, limit)
    assert got[0][1] == limit - 3000 - 1000 - 4000  # fwd1: W resident, X and A live


def test_each_convolution_gets_the_fastest_configuration_that_fits_its_step() -> None:
    table = [
        Micro(4, "gemm", 100, Bytes(0)),
        Micro(4, "fft", 40, Bytes(300)),
        Micro(4, "wino", 60, Bytes(150)),
        Micro(2, "gemm", 55, Bytes(0)),
        Micro(2, "fft", 24, Bytes(140)),
        Micro(2, "wino", 28, Bytes(70)),
    ]
    chosen = [fastest_fitting(table, b.contiguous) for b in budgets(HAND_PLAN, 1500, alignment=1)]
    assert [c.time_ns if c else None for c in chosen] == [48, 56, 48, 48]
    assert chosen[1] == Config((Micro(2, "wino", 28, Bytes(70)),) * 2)
    # The sum of the holes at conv0, 340 bytes, would promise the undivided FFT: no one
    # allocation of 300 bytes fits there.
    assert fastest_fitting(table, 340) == Config((Micro(4, "fft", 40, Bytes(300)),))
    assert fastest_fitting(table, 0) == Config((Micro(4, "gemm", 100, Bytes(0)),))
    assert fastest_fitting(table[1:3], 149) is None
    assert fastest_fitting(table, 150, batch=2) == Config((Micro(2, "fft", 24, Bytes(140)),))
