"""Memory policies against each other and against a lower bound on the step.

For every trace in ../shared/traces/models and two recorded here on the meta device with the
op durations of an H100 SXM's roofline (`tidalpool.torch.record`; GPT-2 small, sequence 1,024,
batch 8, and ResNet-50, batch 64, AdamW, the models of bench/torch_train.py), at each
bandwidth (12, 25, 50 GB/s each way) and each limit (0.9 to 0.3 of the unconstrained peak),
every policy makes its placed plan (`combined.fit`: schedule, simulation, `validate_swaps`,
placement by Planner I's first greedy run, `validate`, and again for a lower limit while the
placement does not fit). A plan counts only when its placement fits the limit. Beside them,
`bound.step_bound`: no plan can step faster under that limit.

Reported per trace and bandwidth, and over all cases:

  - whether `tidalpool` (its own search, made from no other policy's plan) steps no slower
    than every baseline at every limit, and is feasible wherever one of them is; where not,
    the limits and the baselines;
  - its step over the bound: median and worst over its feasible cases (targets 1.05, 1.15);
  - the portfolio (the best plan of all the policies) against `tidalpool` alone;
  - at half the peak of the two H100-roofline recordings: each policy's overhead beside the
    bound's (target: tidalpool within 10% where the bound allows it);
  - planning time per limit: `tidalpool`'s slowest, and on densenet121 tiled to 10,000+ ops
    (target 10 s).

    .venv/bin/python bench/swap.py [--json PATH] [--traces NAME ...] [--jobs N]
        [--fractions 0.9,0.8,...] [--bandwidths 12,25,50] [--no-record] [--no-speed]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tidalcore.units import Tick
from tidaloffline.formats import read_trace_csv
from tidalplan.autoswap import load, op_bound
from tidalplan.bound import step_bound
from tidalplan.combined import fit
from tidalplan.learn import extract
from tidalplan.model import Access, Iteration, IterBlock, Op
from tidalplan.policies import BASELINE_POLICIES, POLICIES, policy
from tidalplan.simulate import no_limit

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT.parent / "shared/traces/models"
RECORDED = ROOT / "build/bench-traces"
FRACTIONS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
BANDWIDTHS = (12.0, 25.0, 50.0)
SPEED_OPS = 10_000
SPEED_TARGET_S = 10.0


@dataclass
class Cell:
    """One policy at one limit."""

    fits: bool
    step_ns: int
    overhead: float
    footprint: int | None
    planned_for: int
    recomputed_bytes: int
    out_bytes: int
    seconds: float


@dataclass
class Case:
    trace: str
    gbps: float
    peak: int
    baseline_ns: int
    op_bound: int
    limits: list[int] = field(default_factory=list)
    bounds: list[int | None] = field(default_factory=list)
    cells: dict[str, list[Cell]] = field(default_factory=dict)
    seconds: float = 0.0


def slower(it: Iteration, scale: float) -> Iteration:
    """`it` on a GPU `scale` times slower: every op's duration multiplied."""
    ops = tuple(Op(o.tick, o.name, round(o.duration_ns * scale)) for o in it.ops)
    return Iteration(it.ticks, it.blocks, ops, it.accesses, it.persistent, it.index)


def iteration(path: Path) -> Iteration:
    events = read_trace_csv(path)
    return extract(events, events.marks())


def run_case(path: Path, gbps: float, fractions: tuple[float, ...]) -> Case:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # autoswap-bo's studies, one a plan
    started = time.perf_counter()
    it = iteration(path)
    peak = int(load(it).max())
    case = Case(
        path.name.removesuffix(".trace.csv").removesuffix(".csv"),
        gbps,
        peak,
        no_limit(it).baseline_ns,
        op_bound(it),
    )
    case.cells = {n: [] for n in POLICIES}
    for fraction in fractions:
        limit = int(fraction * peak)
        case.limits.append(limit)
        case.bounds.append(step_bound(it, limit, gbps, gbps).ns)
        for name in POLICIES:
            t = time.perf_counter()
            made = fit(it, policy(name), limit, gbps, gbps, time_limit_s=0.0)
            r = made.result
            case.cells[name].append(
                Cell(
                    made.fits,
                    r.iteration_ns,
                    r.overhead,
                    made.footprint,
                    made.planned_for,
                    r.recomputed_bytes,
                    r.out_bytes,
                    time.perf_counter() - t,
                )
            )
    case.seconds = time.perf_counter() - started
    return case


def record_traces(directory: Path) -> list[Path]:
    """GPT-2 small (batch 8) and ResNet-50 (batch 64) recorded on the meta device with an
    H100's roofline durations; kept in `directory` and reused."""
    sys.path.insert(0, str(ROOT / "bench"))
    from tidaloffline.torch.roofline import Roofline
    from torch_train import record_training

    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for name, batch in (("gpt2", 8), ("resnet50", 64)):
        path = directory / f"{name}-h100.b{batch}.trace.csv"
        if not path.exists():
            print(f"recording {path.name} on the meta device ...", file=sys.stderr, flush=True)
            record_training(name, batch, path, roofline=Roofline())
        out.append(path)
    return out


def tile(it: Iteration, copies: int) -> Iteration:
    """`copies` iterations of `it` back to back as one (block ids and ticks shifted)."""
    ids = max([b.id for b in it.blocks] + [p for p, _ in it.persistent] + [0]) + 1
    blocks, ops, accesses = [], [], []
    persistent_ids = {p for p, _ in it.persistent}
    for k in range(copies):
        shift = k * it.ticks

        def rename(block: int, k: int = k) -> int:
            return block if block in persistent_ids else block + k * ids

        blocks += [
            IterBlock(rename(b.id), b.size, Tick(b.start + shift), Tick(b.end + shift), b.crosses)
            for b in it.blocks
        ]
        ops += [Op(Tick(o.tick + shift), o.name, o.duration_ns) for o in it.ops]
        accesses += [Access(Tick(a.tick + shift), rename(a.block), a.write) for a in it.accesses]
    last = copies * it.ticks
    blocks = [
        b if b.end <= last else IterBlock(b.id, b.size, b.start, Tick(last - 1)) for b in blocks
    ]
    return Iteration(last, tuple(blocks), tuple(ops), tuple(accesses), it.persistent)


def speed() -> dict[str, float]:
    """`tidalpool`'s planning time, placement included, on densenet121 tiled to 10,000+ ops."""
    it = iteration(MODELS / "densenet121.b32.trace.csv")
    big = tile(it, -(-SPEED_OPS // len(it.ops)))
    out: dict[str, float] = {"ops": len(big.ops), "ticks": big.ticks}
    peak = int(load(big).max())
    for fraction in (0.7, 0.5):
        t = time.perf_counter()
        made = fit(big, policy("tidalpool"), int(fraction * peak), 25.0, 25.0, time_limit_s=0.0)
        out[f"seconds_at_{fraction}"] = time.perf_counter() - t
        out[f"fits_at_{fraction}"] = float(made.fits)
    return out


def summary(cases: list[Case]) -> dict[str, Any]:
    """The figures the docstring lists, over `cases`."""
    losses: list[str] = []
    infeasible_where_baseline_fits: list[str] = []
    ratios: list[float] = []
    portfolio_gain: list[float] = []
    slowest = 0.0
    for c in cases:
        for k, limit in enumerate(c.limits):
            where = f"{c.trace}@{c.gbps:g}GB/s,{limit / c.peak:.2f}"
            mine = c.cells["tidalpool"][k]
            slowest = max(slowest, mine.seconds)
            theirs = {n: c.cells[n][k] for n in BASELINE_POLICIES if c.cells[n][k].fits}
            if theirs and not mine.fits:
                infeasible_where_baseline_fits.append(f"{where} ({', '.join(theirs)})")
            if mine.fits:
                for n, cell in theirs.items():
                    if cell.step_ns < mine.step_ns:
                        losses.append(
                            f"{where}: {mine.step_ns / cell.step_ns - 1:.1%} slower than {n}"
                        )
                b = c.bounds[k]
                if b:
                    ratios.append(mine.step_ns / b)
                best = min([cell.step_ns for cell in theirs.values()] + [mine.step_ns])
                portfolio_gain.append(1 - best / mine.step_ns)
    return {
        "cases": sum(len(c.limits) for c in cases),
        "tidalpool_feasible": sum(
            c.cells["tidalpool"][k].fits for c in cases for k in range(len(c.limits))
        ),
        "losses": losses,
        "infeasible_where_a_baseline_fits": infeasible_where_baseline_fits,
        "ratio_median": statistics.median(ratios) if ratios else None,
        "ratio_worst": max(ratios) if ratios else None,
        "portfolio_gain_max": max(portfolio_gain) if portfolio_gain else None,
        "portfolio_better_cases": sum(g > 1e-9 for g in portfolio_gain),
        "slowest_plan_s": slowest,
    }


def _print(cases: list[Case], total: dict[str, Any], fast: dict[str, float]) -> None:
    for c in cases:
        print(
            f"\n{c.trace} at {c.gbps:g} GB/s: step {c.baseline_ns / 1e6:.2f} ms, peak"
            f" {c.peak / 2**30:.2f} GiB, op-wise bound {c.op_bound / c.peak:.0%}; overhead per"
            " feasible placed plan (— none), bound first"
        )
        names = list(POLICIES)
        print(f"{'limit':>6} {'bound':>8} " + " ".join(f"{n[:12]:>12}" for n in names))
        for k, limit in enumerate(c.limits):
            b = c.bounds[k]
            row = [f"{limit / c.peak:6.2f}", f"{b / c.baseline_ns - 1:8.1%}" if b else f"{'—':>8}"]
            for n in names:
                cell = c.cells[n][k]
                row.append(f"{cell.overhead:12.1%}" if cell.fits else f"{'—':>12}")
            print(" ".join(row))
    print(
        f"\n{total['cases']} cases; tidalpool feasible in {total['tidalpool_feasible']};"
        f" slower than a baseline in {len(total['losses'])}; infeasible where a baseline fits in"
        f" {len(total['infeasible_where_a_baseline_fits'])}"
    )
    for line in total["losses"][:20] + total["infeasible_where_a_baseline_fits"][:20]:
        print(f"    {line}")
    if total["ratio_median"] is not None:
        print(
            f"tidalpool's step over the bound: median {total['ratio_median']:.3f}, worst"
            f" {total['ratio_worst']:.3f} (targets 1.05 and 1.15)"
        )
    print(
        f"the portfolio beats tidalpool alone in {total['portfolio_better_cases']} cases, by up"
        f" to {100 * (total['portfolio_gain_max'] or 0):.1f}% of its step;"
        f" slowest tidalpool plan {total['slowest_plan_s']:.1f} s"
    )
    if fast:
        print(
            f"planning densenet121 tiled to {fast['ops']:.0f} ops: "
            + ", ".join(
                f"{f} of the peak {fast[f'seconds_at_{f}']:.1f} s"
                f" ({'fits' if fast[f'fits_at_{f}'] else 'does not fit'})"
                for f in (0.7, 0.5)
            )
            + f" (target {SPEED_TARGET_S:.0f} s)"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results here")
    parser.add_argument("--traces", nargs="*", help="trace names (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    parser.add_argument("--bandwidths", default=",".join(f"{g:g}" for g in BANDWIDTHS))
    parser.add_argument("--no-record", action="store_true", help="skip the recorded traces")
    parser.add_argument("--no-speed", action="store_true", help="skip the 10,000-op timing")
    args = parser.parse_args()
    if not MODELS.is_dir():
        print(f"no traces at {MODELS}", file=sys.stderr)
        return 1
    fractions = tuple(float(f) for f in args.fractions.split(","))
    bandwidths = tuple(float(g) for g in args.bandwidths.split(","))
    paths = sorted(MODELS.glob("*.trace.csv"))
    if not args.no_record:
        paths += record_traces(RECORDED)
    if args.traces:
        paths = [p for p in paths if any(n in p.name for n in args.traces)]
    jobs = [(p, g) for g in bandwidths for p in paths]
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        futures = [pool.submit(run_case, p, g, fractions) for p, g in jobs]
        cases = []
        for f in futures:
            c = f.result()
            cases.append(c)
            print(
                f"[{time.perf_counter() - started:6.0f} s] {c.trace} at {c.gbps:g} GB/s:"
                f" {c.seconds:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    fast = {} if args.no_speed else speed()
    total = summary(cases)
    _print(cases, total, fast)
    if args.json:
        args.json.write_text(
            json.dumps({"cases": [asdict(c) for c in cases], "summary": total, "speed": fast})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
