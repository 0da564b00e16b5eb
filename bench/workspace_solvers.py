"""μ-cuDNN's workspace solvers on synthetic convolution tables: their speed, and the time won.

The tables are SYNTHETIC, drawn from a seed, not measured on a GPU. They are shaped like cuDNN
benchmarks: per kernel (one convolution pass of one layer) 8 algorithms, time about linear in
the micro-batch b with a fixed launch cost and a per-algorithm efficiency curve (some lose
efficiency past a batch where their tiles stop fitting, which is what makes micro-batching
pay), workspaces growing with b (GEMM-like ones need none, FFT-like ones a lot), and some
algorithms missing for some kernels (as Winograd is only for some filter shapes).

Measured, for the policies powerOfTwo and all at mini-batch B:
  1. WR's dynamic program (`workspace.wr`), seconds per kernel;
  2. the desirable sets (`workspace.desirable`): seconds per kernel and their sizes;
  3. WD's 0-1 program (`workspace.choose`): seconds, HiGHS' proof, its bound; on small
     instances against brute force over every combination of the desirable sets (known optima);
  4. the total convolution time of WD under a total workspace M, against WR with M/K per
     kernel and against `undivided` (cuDNN's own choice: the fastest single algorithm at B
     that fits M/K).

    .venv/bin/python bench/workspace_solvers.py [--seed N] [--kernels K] [--batch B]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from tidalcore.units import Bytes
from tidalplan.workspace import (
    BatchPolicy,
    Config,
    Micro,
    NoFit,
    Table,
    batch_sizes,
    choose,
    desirable,
    wr,
)

MIB = 1 << 20
RESULT = Path(__file__).resolve().parent / "results" / "workspace-solvers.json"
# name, efficiency (time per sample against the slowest), workspace per sample and fixed (MiB
# for a kernel of scale 1), the batch past which it slows (its tiles stop fitting; 0: never),
# the slowdown there, the chance it is missing for a kernel.
ALGORITHMS = (
    ("IMPLICIT_GEMM", 1.00, 0.0, 0.0, 0, 1.0, 0.0),
    ("IMPLICIT_PRECOMP_GEMM", 0.80, 0.02, 0.5, 0, 1.0, 0.1),
    ("GEMM", 0.90, 0.60, 0.0, 0, 1.0, 0.2),
    ("DIRECT", 1.20, 0.0, 0.0, 0, 1.0, 0.5),
    ("FFT", 0.45, 3.00, 64.0, 64, 1.35, 0.3),
    ("FFT_TILING", 0.55, 1.00, 16.0, 128, 1.20, 0.2),
    ("WINOGRAD", 0.60, 0.05, 1.0, 32, 1.15, 0.5),
    ("WINOGRAD_NONFUSED", 0.50, 1.50, 8.0, 96, 1.25, 0.4),
)
RUN_POLICIES: tuple[BatchPolicy, ...] = ("powerOfTwo", "all")
TOTALS_MIB_PER_KERNEL = (2, 8, 32, 128)  # M = K x this


def synthetic_table(rng: np.random.Generator, kernels: int, batch: int) -> Table:
    """Random but reproducible tables for `kernels` kernels, every b in 1..batch measured."""
    measured: dict[str, list[Micro]] = {}
    b = np.arange(1, batch + 1)
    for k in range(kernels):
        per_sample = float(rng.lognormal(np.log(20_000), 0.8))  # ns a sample, slowest algorithm
        ws_scale = float(rng.lognormal(0.0, 0.7))
        launch = float(rng.uniform(5_000, 20_000))
        entries: list[Micro] = []
        for name, eff, ws_per, ws_fixed, knee, slow, missing in ALGORITHMS:
            if rng.random() < missing:
                continue
            knee_k = int(knee * rng.uniform(0.7, 1.4)) if knee else 0
            penalty = np.where((b > knee_k) & (knee_k > 0), slow, 1.0)
            noise = rng.uniform(0.97, 1.03, batch)
            times = launch + per_sample * eff * b * penalty * noise
            ws = (ws_per * b + ws_fixed) * ws_scale * MIB if ws_per or ws_fixed else 0 * b
            entries += [
                Micro(int(n), name, int(t), Bytes(int(w)))
                for n, t, w in zip(b, times, np.broadcast_to(ws, b.shape), strict=True)
            ]
        measured[f"conv{k // 3}/{('fwd', 'bwd-data', 'bwd-filter')[k % 3]}"] = entries
    return Table.of(measured)


def policy_entries(entries: tuple[Micro, ...], batch: int, policy: BatchPolicy) -> list[Micro]:
    """The entries a policy would have benchmarked."""
    sizes = set(batch_sizes(policy, batch))
    return [m for m in entries if m.batch in sizes]


def spread(values: list[float], digits: int = 4) -> dict[str, float]:
    return {
        "mean": round(statistics.fmean(values), digits),
        "median": round(statistics.median(values), digits),
        "max": round(max(values), digits),
    }


def brute_force(fronts: dict[str, tuple[Config, ...]], limit: int) -> int | None:
    """The least total time over every combination of the desirable sets."""
    times = [np.array([c.time_ns for c in f], np.int64) for f in fronts.values()]
    spaces = [np.array([c.workspace for c in f], np.int64) for f in fronts.values()]
    total_t = np.zeros(1, np.int64)
    total_w = np.zeros(1, np.int64)
    for t, w in zip(times, spaces, strict=True):
        total_t = (total_t[:, None] + t[None, :]).ravel()
        total_w = (total_w[:, None] + w[None, :]).ravel()
    fits = total_w <= limit
    return int(total_t[fits].min()) if fits.any() else None


def small_instances(seed: int, count: int) -> dict[str, Any]:
    """WD against brute force on `count` instances of 4 kernels at B = 32 (policy all)."""
    rng = np.random.default_rng(seed + 1)
    matched = proven = 0
    seconds: list[float] = []
    combos: list[int] = []
    for _ in range(count):
        table = synthetic_table(rng, 4, 32)
        fronts = {k: desirable(e, 32, "all") for k, e in table.kernels.items()}
        least = sum(int(min(c.workspace for c in f)) for f in fronts.values())
        most = sum(int(max(c.workspace for c in f)) for f in fronts.values())
        limit = int(rng.integers(least, most + 1))
        started = time.perf_counter()
        got = choose(fronts, limit)
        seconds.append(time.perf_counter() - started)
        matched += got.time_ns == brute_force(fronts, limit)
        proven += got.optimal
        combos.append(int(np.prod([len(f) for f in fronts.values()])))
    return {
        "instances": count,
        "kernels": 4,
        "batch": 32,
        "policy": "all",
        "combinations_brute_forced": spread([float(c) for c in combos], 0),
        "wd_equals_brute_force": matched,
        "wd_proven_optimal": proven,
        "wd_seconds": spread(seconds),
    }


def run(seed: int, kernels: int, batch: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    table = synthetic_table(rng, kernels, batch)
    out: dict[str, Any] = {
        "synthetic": "tables drawn from the seed, shaped like cuDNN's; NOT measured on a GPU",
        "seed": seed,
        "kernels": kernels,
        "batch": batch,
        "algorithms": [a[0] for a in ALGORITHMS],
        "entries": sum(len(e) for e in table.kernels.values()),
        "table_seconds": round(time.perf_counter() - started, 2),
        "policies": {},
    }
    for p in RUN_POLICIES:
        tables = {k: policy_entries(e, batch, p) for k, e in table.kernels.items()}
        wr_s: list[float] = []
        for entries in tables.values():
            t0 = time.perf_counter()
            wr(entries, batch, 64 * MIB, p)
            wr_s.append(time.perf_counter() - t0)
        d_s: list[float] = []
        fronts: dict[str, tuple[Config, ...]] = {}
        for k, entries in tables.items():
            t0 = time.perf_counter()
            fronts[k] = desirable(entries, batch, p)
            d_s.append(time.perf_counter() - t0)
        sizes = [float(len(f)) for f in fronts.values()]
        rows = []
        for per in TOTALS_MIB_PER_KERNEL:
            total = per * MIB * kernels
            t0 = time.perf_counter()
            got = choose(fronts, total, time_limit_s=60.0)
            ilp_s = time.perf_counter() - t0
            row: dict[str, Any] = {
                "total_mib": per * kernels,
                "per_kernel_mib": per,
                "wd_ns": got.time_ns,
                "wd_workspace_mib": round(got.workspace / MIB, 1),
                "wd_seconds": round(ilp_s, 3),
                "wd_proven_optimal": got.optimal,
                "wd_bound_ns": got.bound_ns,
                "wd_gap": round((got.time_ns - got.bound_ns) / got.time_ns, 6),
                "columns": sum(len(f) for f in fronts.values()),
                "divided_kernels": sum(len(c.micros) > 1 for c in got.configs.values()),
            }
            baselines: tuple[tuple[str, BatchPolicy], ...] = (
                ("wr_even", p),
                ("undivided", "undivided"),
            )
            for name, pol in baselines:
                try:
                    t = sum(wr(e, batch, per * MIB, pol).time_ns for e in table.kernels.values())
                except NoFit:
                    row[f"{name}_ns"] = None
                    continue
                row[f"{name}_ns"] = t
                row[f"wd_saves_vs_{name}"] = round(1 - got.time_ns / t, 4)
            rows.append(row)
        out["policies"][p] = {
            "wr_seconds_per_kernel": spread(wr_s),
            "desirable_seconds_per_kernel": spread(d_s),
            "desirable_set_size": spread(sizes, 1) | {"min": min(sizes)},
            "wd": rows,
        }
    out["small_instances"] = small_instances(seed, 20)
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def ms(v: int | None) -> str:
    return "-" if v is None else f"{v / 1e6:.2f}"


def pct(row: dict[str, Any], key: str) -> str:
    return f"{100 * row[key]:.1f}%" if key in row else "-"


def show(result: dict[str, Any]) -> None:
    print(
        f"SYNTHETIC tables (seed {result['seed']}), not measured on a GPU:"
        f" {result['kernels']} kernels, B = {result['batch']}, {result['entries']} entries"
    )
    for policy, p in result["policies"].items():
        wr_s, d_s, size = (
            p["wr_seconds_per_kernel"],
            p["desirable_seconds_per_kernel"],
            p["desirable_set_size"],
        )
        print(
            f"\n{policy}: WR {wr_s['mean'] * 1e3:.2f} ms/kernel (max {wr_s['max'] * 1e3:.2f});"
            f" desirable {d_s['mean'] * 1e3:.1f} ms/kernel (max {d_s['max'] * 1e3:.1f});"
            f" |D| min {size['min']:.0f} median {size['median']:.0f} max {size['max']:.0f}"
        )
        print(
            f"  {'M total':>9} {'WD ms':>9} {'WR M/K ms':>10} {'undiv. ms':>10}"
            f" {'vs WR':>7} {'vs undiv':>8} {'ILP s':>7} {'optimal':>7} {'divided':>7}"
        )
        for r in p["wd"]:
            print(
                f"  {r['total_mib']:>6} MiB {ms(r['wd_ns']):>9} {ms(r['wr_even_ns']):>10}"
                f" {ms(r['undivided_ns']):>10} {pct(r, 'wd_saves_vs_wr_even'):>7}"
                f" {pct(r, 'wd_saves_vs_undivided'):>8} {r['wd_seconds']:>7.3f}"
                f" {r['wd_proven_optimal']!s:>7} {r['divided_kernels']:>7}"
            )
    s = result["small_instances"]
    print(
        f"\nsmall: {s['instances']} instances of {s['kernels']} kernels (B = {s['batch']}):"
        f" WD = brute force in {s['wd_equals_brute_force']}, proven optimal in"
        f" {s['wd_proven_optimal']}; ILP {s['wd_seconds']['mean'] * 1e3:.1f} ms mean;"
        f" {s['combinations_brute_forced']['median']:.0f} combinations (median)"
    )
    print(f"\n{result['seconds']} s in all")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernels", type=int, default=50)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--json", type=Path, default=RESULT, help=f"default {RESULT}")
    args = parser.parse_args()
    result = run(args.seed, args.kernels, args.batch)
    show(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
