"""The `tidalpool` swap policy with its gap-cover integer program solved by HiGHS through highspy
(what the planner uses) and through SciPy's `milp` (its bundled HiGHS), everything else equal.

For every trace of ../shared/traces/models (or --traces), 12 and 50 GB/s, and limits from 0.95
to 0.40 of the peak in steps of 0.05: both plans are simulated; a case counts as identical when
feasibility, step time and bytes moved all agree. SciPy's HiGHS writes some messages to file
descriptor 1 whatever its options say, so this benchmark, not the planner, sends them away.

    .venv/bin/python bench/cover_solver.py [--json] [--traces NAME ...] [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import optuna
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_matrix
from tidaloffline.formats import read_trace_csv
from tidalplan import gap_cover
from tidalplan.autoswap import load
from tidalplan.learn import extract
from tidalplan.policies import plan
from tidalplan.simulate import simulate

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "models"
FRACTIONS = tuple(round(0.95 - 0.05 * k, 2) for k in range(12))
BANDWIDTHS = (12.0, 50.0)


@contextmanager
def _stdout_to_null() -> Iterator[None]:
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def scipy_cover(
    cost: npt.NDArray[np.float64], cover: csr_matrix, need: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64] | None:
    """`gap_cover._cover_milp`'s program, by scipy.optimize.milp with the same limits."""
    options = {
        "node_limit": gap_cover._NODE_LIMIT,
        "presolve": False,
        "mip_rel_gap": gap_cover._GAP,
    }
    with _stdout_to_null():
        result = milp(
            c=cost,
            constraints=LinearConstraint(cover, lb=need),
            integrality=np.ones(cover.shape[1]),
            bounds=Bounds(0, 1),
            options=options,
        )
    return None if result.x is None else np.asarray(result.x, dtype=np.float64)


def case(job: tuple[str, float]) -> list[dict[str, Any]]:
    path, gbps = job
    events = read_trace_csv(path)
    it = extract(events, events.marks())
    peak = int(load(it).max())
    highspy_cover = gap_cover._cover_milp
    rows = []
    for fraction in FRACTIONS:
        limit = int(fraction * peak)
        row: dict[str, Any] = {"trace": Path(path).name, "gbps": gbps, "fraction": fraction}
        for name, solver in (("highspy", highspy_cover), ("scipy", scipy_cover)):
            gap_cover._cover_milp = solver  # type: ignore[assignment]
            try:
                r = simulate(it, plan(it, "tidalpool", limit, gbps, gbps), limit, gbps, gbps)
            finally:
                gap_cover._cover_milp = highspy_cover
            row[name] = {"feasible": r.feasible, "step_ns": r.iteration_ns, "out": r.out_bytes}
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print every case as JSON")
    parser.add_argument("--traces", nargs="*", default=None, help="trace file names to use")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # AutoSwap's tuning, in the baselines
    traces = sorted(TRACES.glob("*.trace.csv"))
    if args.traces:
        traces = [t for t in traces if t.name in args.traces or t.name.split(".")[0] in args.traces]
    if not traces:
        raise SystemExit(f"no model traces at {TRACES}")
    jobs = [(str(t), g) for t in traces for g in BANDWIDTHS]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = [row for rows in pool.map(case, jobs) for row in rows]
    if args.json:
        print(json.dumps(rows))
        return
    key = lambda r: (not r["feasible"], r["step_ns"])  # noqa: E731
    same = [r for r in rows if r["highspy"] == r["scipy"]]
    better = [r for r in rows if key(r["highspy"]) < key(r["scipy"])]
    worse = [r for r in rows if key(r["highspy"]) > key(r["scipy"])]
    print(
        f"{len(rows)} cases: {len(same)} identical, highspy better in {len(better)},"
        f" worse in {len(worse)}"
    )
    for r in [*better, *worse]:
        h, s = r["highspy"]["step_ns"] / 1e6, r["scipy"]["step_ns"] / 1e6
        print(
            f"  {r['trace']} {r['gbps']:g} GB/s at {r['fraction']:.2f}: {h:.3f} ms against"
            f" {s:.3f} ms"
        )


if __name__ == "__main__":
    main()
