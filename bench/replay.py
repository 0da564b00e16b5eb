"""The simulator against reality: `tidalpool replay` of the model traces under the daemon's plan.

For every trace in ../shared/traces/models and each limit (0.7 and 0.5 of the unconstrained
peak by default), runs `tidalpool replay TRACE --limit F --copy-gbps G --compute-scale K
--json` with its own private sim daemon, one case at a time, and reports per case and over
all: the measured steady step over the simulator's predicted step for the same plan (goal:
within 10%), the bytes moved on demand in steady iterations (goal 0), the stamp mismatches
(goal 0), the planned bytes each way against the prediction's, and the plan's arrival.

Copies are throttled and compute is scaled so the ratio of copy time to compute time is an
H100's at 50 GB/s each way (the traces' op times are an H100's roofline): K = 50 / G. The
2-core machine must keep the training thread, the compute worker, two copy streams and the
daemon going, which is why G is low. `--copy-gbps 0` leaves copies unthrottled (memmove
speed; the daemon plans them at the bandwidth its backend measured), and then `--compute-scale`
says K (default 1).

    .venv/bin/python bench/replay.py [--json PATH] [--traces NAME ...] [--dir DIR]
        [--fractions 0.7,0.5] [--copy-gbps 2] [--compute-scale K] [--iterations 8]
        [--plan-timeout 600] [--page BYTES] [--timeline-dir DIR]

`--page` runs every case paged (virtual residency, `tidalpool replay --page`); `--dir traces`
replays this repository's sample traces instead of the model traces; `--timeline-dir` writes
each case's timeline (`replay --timeline`) and adds what it shows: the compute stream's busy
and idle time beside the simulator's, the training thread's waits and CPU time, and the rate
each copy stream reached while it copied.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT.parent / "shared" / "traces" / "models"
H100_GBPS = 50.0


def run_case(
    trace: Path,
    fraction: str,
    gbps: float,
    scale: float,
    iterations: int,
    plan_timeout: float,
    page: str | None = None,
    timeline_dir: Path | None = None,
) -> dict[str, Any]:
    """One `tidalpool replay` run; `gbps` 0 leaves its copies unthrottled; `page`: paged;
    `timeline_dir`: write its timeline there and report what it shows."""
    throttle = ("--copy-gbps", str(gbps)) if gbps > 0 else ()
    paging = ("--page", page) if page else ()
    timeline = None
    if timeline_dir is not None:
        timeline = timeline_dir / f"{trace.name.removesuffix('.trace.csv')}-{fraction}.json"
    argv = [
        *(sys.executable, "-m", "tidalpool", "replay", str(trace)),
        *("--limit", fraction, *throttle, "--compute-scale", f"{scale:g}", *paging),
        *("--iterations", str(iterations), "--plan-timeout", f"{plan_timeout:g}", "--json"),
        *(("--timeline", str(timeline)) if timeline is not None else ()),
    ]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    case: dict[str, Any] = {
        "trace": trace.name,
        "fraction": float(fraction),
        "copy_gbps": gbps or None,  # None: unthrottled
        "compute_scale": scale,
        "page": page,
        "exit": done.returncode,
        "seconds": round(seconds, 1),
    }
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        case["error"] = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return case
    steady = [r for r in report.get("per_iteration", ()) if r["phase"] == "steady"]
    predicted = report.get("predicted") or {}
    case.update(
        outcome=report.get("outcome"),
        plan=report.get("plan"),
        steady_iterations=len(steady),
        planned_gbps=predicted.get("copy_gbps"),
        predicted_step_ns=predicted.get("step_ns"),
        predicted_out_bytes=predicted.get("out_bytes"),
        predicted_in_bytes=predicted.get("in_bytes"),
        measured_step_ns=statistics.median(r["step_ns"] for r in steady) if steady else None,
        planned_out_bytes=[r["planned_out_bytes"] for r in steady],
        planned_in_bytes=[r["planned_in_bytes"] for r in steady],
        on_demand_bytes=sum(r["on_demand_out_bytes"] + r["on_demand_in_bytes"] for r in steady),
        piece_misses=sum(r["piece_misses"] for r in steady),
        mismatches=report.get("checks", {}).get("mismatches"),
        stamps_checked=report.get("checks", {}).get("stamps_checked"),
        peak_resident_bytes=report.get("peak_resident_bytes"),
        limit_bytes=report.get("limit_bytes"),
        mapped_peak_bytes=(report.get("plan") or {}).get("mapped_peak_bytes"),
        plan_unavailable=report.get("plan_unavailable"),
    )
    if case["measured_step_ns"] and case["predicted_step_ns"]:
        case["step_ratio"] = case["measured_step_ns"] / case["predicted_step_ns"]
    measured = report.get("measured") or {}
    case["host_cpu_ns"] = measured.get("host_cpu_ns")
    if report.get("timeline") is not None and steady:
        case["timeline"] = report["timeline"] | copy_rates(Path(report["timeline"]["path"]))
    return case


def copy_rates(path: Path) -> dict[str, float | None]:
    """What each copy stream moved in the steady iterations of a `--timeline` file, and at
    what rate while it copied (GB/s: its bytes over the time its copies took)."""
    events = json.loads(path.read_text())["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X" and e["pid"] == 1]
    steady = [
        (e["ts"], e["ts"] + e["dur"])
        for e in spans
        if names[(1, e["tid"])] == "host" and e["name"].endswith("(steady)")
    ]
    rates: dict[str, float | None] = {}
    for track in ("swap-out", "swap-in"):
        copies = [
            e
            for e in spans
            if names[(1, e["tid"])] == track and any(a <= e["ts"] < b for a, b in steady)
        ]
        moved = sum(int(e["args"]["bytes"]) for e in copies)
        took_us = sum(float(e["dur"]) for e in copies)
        rates[f"{track}_gbps"] = round(moved / took_us / 1e3, 2) if took_us else None
    return rates


def summary(cases: list[dict[str, Any]]) -> list[str]:
    lines = [
        "trace                        limit  exit  plan swaps  measured/predicted step"
        "  on demand  misses  mismatches  planned bytes = predicted"
    ]
    for c in cases:
        ratio = c.get("step_ratio")
        exact = c.get("predicted_out_bytes") is not None and all(
            o == c["predicted_out_bytes"] and i == c["predicted_in_bytes"]
            for o, i in zip(c["planned_out_bytes"], c["planned_in_bytes"], strict=True)
        )
        lines.append(
            f"{c['trace']:<28} {c['fraction']:>5}  {c['exit']:>4}"
            f"  {(c.get('plan') or {}).get('swaps', '-'):>10}"
            f"  {'-' if ratio is None else f'{ratio:.3f}':>23}"
            f"  {c.get('on_demand_bytes', '-'):>9}  {c.get('piece_misses', '-'):>6}"
            f"  {c.get('mismatches', '-'):>10}  {'yes' if exact else 'no':>25}"
            + (f"  ({c['error']})" if "error" in c else "")
            + (
                f"  (no plan: {c['plan_unavailable']['reason']})"
                if c.get("plan_unavailable")
                else ""
            )
        )
    ratios = [c["step_ratio"] for c in cases if "step_ratio" in c]
    if ratios:
        within = sum(abs(r - 1) <= 0.10 for r in ratios)
        lines.append(
            f"{len(ratios)} of {len(cases)} cases compared; within 10% of the prediction:"
            f" {within}; ratio median {statistics.median(ratios):.3f},"
            f" range {min(ratios):.3f}-{max(ratios):.3f}"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--traces", nargs="*", default=None)
    parser.add_argument("--fractions", default="0.7,0.5")
    parser.add_argument("--copy-gbps", type=float, default=2.0, help="0: unthrottled")
    parser.add_argument(
        "--compute-scale", type=float, default=None, help="default 50 / copy-gbps, or 1"
    )
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--plan-timeout", type=float, default=600.0)
    parser.add_argument("--page", default=None, help="replay paged, in pages of this size")
    parser.add_argument("--dir", type=Path, default=TRACES, help="where the traces are")
    parser.add_argument(
        "--timeline-dir",
        type=Path,
        default=None,
        help="write each case's `replay --timeline` here and report what it shows",
    )
    args = parser.parse_args()
    scale = args.compute_scale
    if scale is None:
        scale = H100_GBPS / args.copy_gbps if args.copy_gbps > 0 else 1.0
    traces = sorted(args.dir.glob("*.trace.csv"))
    if args.traces:
        traces = [t for t in traces if any(t.name.startswith(n) for n in args.traces)]
    cases = []
    for trace in traces:
        for fraction in args.fractions.split(","):
            print(f"{trace.name} at {fraction} ...", file=sys.stderr, flush=True)
            case = run_case(
                trace,
                fraction,
                args.copy_gbps,
                scale,
                args.iterations,
                args.plan_timeout,
                args.page,
                args.timeline_dir,
            )
            print(f"  {case}", file=sys.stderr, flush=True)
            cases.append(case)
    print("\n".join(summary(cases)))
    if args.json is not None:
        args.json.write_text(json.dumps(cases, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
