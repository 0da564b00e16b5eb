"""Swap policies against each other on the model traces, and the simulator's speed.

For every trace in ../shared/traces/models and each bandwidth (12 GB/s, PCIe 3, the papers'
hardware; 50 GB/s, an H100 on PCIe 5), limits walk down from the unconstrained peak: in
steps of 0.25% of the peak to 92%, of 2% to 80%, then of 5% down to the op-wise bound. At
each limit every policy plans (`swap.plans`: `tidalpool` is seeded with the baselines'
plans), `simulate` judges and `validate_swaps` checks every feasible plan. Reported per
trace and bandwidth:

  - whether `tidalpool`'s overhead is at most every baseline's at every limit (and it is
    feasible wherever one of them is);
  - each policy's memory reduction at zero overhead: the lowest limit down to which every
    limit of the walk costs at most 0.5%; `tidalpool`'s against the best baseline's
    (target: at least 1.25x);
  - `load_min`, the op-wise bound, and the lowest limit `tidalpool` reaches with at most 15%
    overhead.

Then the speed: one `simulate` of the densenet121 iteration tiled to 10,000+ ops (target
50 ms) under a `tidalpool` plan, and `autoswap-bo`'s 40 trials on the untiled iteration.

    .venv/bin/python bench/swap.py [--json] [--traces NAME ...] [--jobs N]
        [--compute-scale X] [--no-speed]
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

from tidalcore.units import Tick
from tidaloffline.formats import read_trace_csv
from tidalplan.autoswap import load, load_min, op_bound
from tidalplan.autoswap_bo import tune
from tidalplan.learn import extract
from tidalplan.model import Access, Iteration, IterBlock, Op
from tidalplan.policies import BASELINE_POLICIES, POLICIES, plans
from tidalplan.simulate import no_limit, simulate
from tidalplan.validate import validate_swaps

MODELS = Path(__file__).resolve().parents[2] / "shared/traces/models"
BANDWIDTHS = (12.0, 50.0)
ZERO = 0.005  # "zero overhead"
MODERATE = 0.15
SPEED_OPS = 10_000
SPEED_TARGET_S = 0.050


def walk(peak: int, floor: int) -> list[int]:
    """The limits of the walk, from the peak down to `floor`."""
    fractions = [1 - k * 0.0025 for k in range(33)]  # to 92%
    fractions += [0.92 - k * 0.02 for k in range(1, 7)]  # to 80%
    fractions += [0.80 - k * 0.05 for k in range(1, 16)]
    return [int(f * peak) for f in fractions if f > 0 and int(f * peak) >= floor]


@dataclass
class Case:
    trace: str
    gbps: float
    peak: int
    baseline_ms: float
    load_min: int
    op_bound: int
    limits: list[int] = field(default_factory=list)
    overhead: dict[str, list[float | None]] = field(default_factory=dict)  # None: infeasible
    never_worse: bool = True
    worse_at: list[str] = field(default_factory=list)
    zero_reduction: dict[str, float] = field(default_factory=dict)
    moderate_limit: int | None = None
    seconds: float = 0.0

    def reduction_at(self, name: str, bound: float) -> float:
        """1 - the lowest limit down to which every limit of the walk costs at most `bound`."""
        best = 0.0
        for limit, o in zip(self.limits, self.overhead[name], strict=True):
            if o is None or o > bound:
                break
            best = 1 - limit / self.peak
        return best


def slower(it: Iteration, scale: float) -> Iteration:
    """`it` on a GPU `scale` times slower: every op's duration multiplied."""
    ops = tuple(Op(o.tick, o.name, round(o.duration_ns * scale)) for o in it.ops)
    return Iteration(it.ticks, it.blocks, ops, it.accesses, it.persistent, it.index)


def run_case(path: Path, gbps: float, scale: float = 1.0) -> Case:
    started = time.perf_counter()
    events = read_trace_csv(path)
    it = slower(extract(events, events.marks()), scale)
    peak = int(load(it).max())
    base = no_limit(it)
    case = Case(
        path.name.removesuffix(".trace.csv"),
        gbps,
        peak,
        base.baseline_ns / 1e6,
        load_min(it),
        op_bound(it),
    )
    case.overhead = {n: [] for n in POLICIES}
    for limit in walk(peak, case.op_bound):
        case.limits.append(limit)
        for name, plan in plans(it, POLICIES, limit, gbps, gbps).items():
            r = simulate(it, plan, limit, gbps, gbps)
            if r.feasible:
                validate_swaps(it, plan, r, limit, gbps)
            case.overhead[name].append(r.overhead if r.feasible else None)
        mine = case.overhead["tidalpool"][-1]
        for name in BASELINE_POLICIES:
            theirs = case.overhead[name][-1]
            if theirs is not None and (mine is None or mine > theirs + 1e-12):
                case.never_worse = False
                case.worse_at.append(f"{limit / peak:.4f}:{name}")
    case.zero_reduction = {n: case.reduction_at(n, ZERO) for n in POLICIES}
    moderate = [
        limit
        for limit, o in zip(case.limits, case.overhead["tidalpool"], strict=True)
        if o is not None and o <= MODERATE
    ]
    case.moderate_limit = min(moderate) if moderate else None
    case.seconds = time.perf_counter() - started
    return case


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
    events = read_trace_csv(MODELS / "densenet121.b32.trace.csv")
    it = extract(events, events.marks())
    big = tile(it, -(-SPEED_OPS // len(it.ops)))
    limit = int(0.9 * int(load(big).max()))
    plan = plans(big, ["autoswap-swdoa"], limit, 50.0, 50.0)["autoswap-swdoa"]
    times = []
    for _ in range(7):
        t = time.perf_counter()
        r = simulate(big, plan, limit, 50.0, 50.0)
        times.append(time.perf_counter() - t)
    small_limit = int(0.9 * int(load(it).max()))
    t = time.perf_counter()
    tune(it, small_limit, 50.0, 50.0, trials=40)
    bo = time.perf_counter() - t
    return {
        "ops": len(big.ops),
        "ticks": big.ticks,
        "swaps": len(plan.swaps),
        "feasible": float(r.feasible),
        "simulate_median_ms": statistics.median(times) * 1e3,
        "simulate_max_ms": max(times) * 1e3,
        "bo_40_trials_s": bo,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--traces", nargs="*", help="trace names (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument(
        "--compute-scale",
        type=float,
        default=1.0,
        help="multiply op times (a slower GPU; default 1: the traces as recorded)",
    )
    parser.add_argument("--no-speed", action="store_true", help="skip the speed measurements")
    args = parser.parse_args()
    if not MODELS.is_dir():
        print(f"no traces at {MODELS}", file=sys.stderr)
        return 1
    paths = sorted(MODELS.glob("*.trace.csv"))
    if args.traces:
        paths = [p for p in paths if any(n in p.name for n in args.traces)]
    jobs = [(p, g) for g in BANDWIDTHS for p in paths]
    with ProcessPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        futures = [pool.submit(run_case, p, g, args.compute_scale) for p, g in jobs]
        cases = []
        for f in futures:
            c = f.result()
            cases.append(c)
            print(f"  {c.trace} at {c.gbps:g} GB/s: {c.seconds:.0f} s", file=sys.stderr)
    fast = {} if args.no_speed else speed()
    if args.json:
        print(json.dumps({"cases": [asdict(c) for c in cases], "speed": fast}))
        return 0
    for gbps in BANDWIDTHS:
        print(f"\n{gbps:g} GB/s each way")
        print(
            f"{'trace':20} {'iter ms':>8} {'never worse':>11} {'zero-overhead reduction':>24}"
            f" {'ratio':>6} {'<=15% at':>9} {'load_min':>9} {'op bound':>9}"
        )
        for c in (c for c in cases if c.gbps == gbps):
            base = {n: v for n, v in c.zero_reduction.items() if n != "tidalpool"}
            best = max(base, key=lambda n: base[n])
            mine = c.zero_reduction["tidalpool"]
            ratio = mine / base[best] if base[best] else float("inf")
            zero = f"{100 * mine:.2f}% vs {100 * base[best]:.2f}% {best}"
            moderate = f"{c.moderate_limit / c.peak:.0%}" if c.moderate_limit else "-"
            print(
                f"{c.trace:20} {c.baseline_ms:8.2f} {('yes' if c.never_worse else 'NO'):>11}"
                f" {zero:>24} {ratio:6.2f} {moderate:>9} {c.load_min / c.peak:9.0%}"
                f" {c.op_bound / c.peak:9.0%}"
            )
            if c.worse_at:
                print(f"    worse at: {', '.join(c.worse_at[:5])}")
    if not fast:
        return 0
    print(
        f"\nsimulate, densenet121 tiled to {fast['ops']:.0f} ops ({fast['ticks']:.0f} ticks,"
        f" {fast['swaps']:.0f} swaps): median {fast['simulate_median_ms']:.1f} ms, max"
        f" {fast['simulate_max_ms']:.1f} ms (target {SPEED_TARGET_S * 1e3:.0f} ms);"
        f" autoswap-bo 40 trials on densenet121: {fast['bo_40_trials_s']:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
