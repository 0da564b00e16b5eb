"""A job of several iteration shapes on a sim daemon: a plan per shape, switched at each step.

Records (on PyTorch's meta device, `tidalpool.torch.record(batches=)`) GPT-2 small at batch 1
and sequence lengths 128, 256, 512 and 1,024, and ResNet-18 at batch 32 with a last batch of 8;
then, per model and limit, replays their iterations in one session in a random order of shapes
(`--iterations`, seeded), each step naming its shape (`Session.step(shape=)`) or, with
`--recognise-shapes`, naming none (the session recognises each iteration's shape from its first
allocation), against a sim daemon that plans each shape apart. The limit is a fraction of the
largest shape's peak (1.0: no swaps needed); sessions are paged (virtual residency, `--page`).
Per shape it reports:

- iterations run before its plan took over (learning: placed online, recorded);
- plan hits over the allocations of its iterations from then on (misses: placed online);
- the plan's mapped peak against the shape's own peak of live bytes (the most any placement of
  that shape alone must hold; pages round it up);
- measured over predicted step in its planned iterations (median of the steady ones; compute
  scaled by `--compute-scale`, copies throttled to `--copy-gbps`, as `tidalpool replay`);
- the seconds the daemon took to plan it (its `plan.sent` log line);
- bytes checked: every block's stamps, read back across swaps (mismatches must be 0).

    .venv/bin/python bench/shapes.py [--iterations 100] [--fractions 1.0,0.6] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "traces"))
sys.path.insert(0, str(ROOT / "bench"))

CHUNK = 2 << 20
SEQUENCES = (128, 256, 512, 1024)


def record_models(directory: Path) -> dict[str, Path]:
    """The two multi-shape traces, recorded into `directory`."""
    import record as samples  # traces/record.py: the sample models
    import tidalpool.torch
    import torch
    from torch.nn import functional as F
    from torch_train import gpt2

    paths = {}
    with torch.device("meta"):
        model = gpt2(50257, max(SEQUENCES))
    batches = [
        (torch.zeros(1, n, dtype=torch.long), torch.zeros(n, dtype=torch.long)) for n in SEQUENCES
    ]
    paths["gpt2"] = directory / "gpt2.b1.shapes.trace.csv"
    tidalpool.torch.record(
        model, batches[0], F.cross_entropy, samples.adamw, path=paths["gpt2"], batches=batches[1:]
    )
    with torch.device("meta"):
        model = samples.resnet18()
    batches = [(torch.zeros(n, 3, 224, 224), torch.zeros(n, dtype=torch.long)) for n in (32, 8)]
    paths["resnet18"] = directory / "resnet18.b32-8.shapes.trace.csv"
    tidalpool.torch.record(
        model, batches[0], F.cross_entropy, samples.sgd, path=paths["resnet18"], batches=batches[1:]
    )
    return paths


def iterations_of(path: Path) -> dict[str, Any]:
    """Each shape's steady iteration (refused if a block of it outlives it: the replay of
    several shapes frees every block within its own iteration)."""
    from tidaloffline.formats import read_trace_csv
    from tidalplan import learn

    events = read_trace_csv(path)
    its = {s: learn.extract_finished(events, s).iteration for s in learn.shapes(events)}
    for s, it in its.items():
        crossing = sum(b.crosses for b in it.blocks)
        if crossing:
            raise SystemExit(f"{path}: {crossing} blocks of shape {s} outlive its iteration")
    return its


def plan_seconds(log: str) -> dict[str, float]:
    """The seconds of each shape's first plan, from the daemon's `plan.sent` lines."""
    found: dict[str, float] = {}
    for line in log.splitlines():
        if "plan.sent" not in line:
            continue
        shape = re.search(r"\bshape=(\S*)", line)
        seconds = re.search(r"\bseconds=([0-9.]+)", line)
        if shape and seconds:
            found.setdefault(shape.group(1), float(seconds.group(1)))
    return found


def run(its: dict[str, Any], fraction: float, args: argparse.Namespace) -> dict[str, Any]:
    """One session replaying the shapes in a random order under `fraction` of the largest
    shape's peak; its per-shape results."""
    from tidaloffline.replay.compute import SimCompute
    from tidaloffline.replay.replayer import Replayer
    from tidaloffline.replay.session import open_session, private_daemon
    from tidalplan.autoswap import load as load_curve

    peaks = {s: int(load_curve(it).max(initial=0)) for s, it in its.items()}
    peak = max(peaks.values())
    limit = int(peak * fraction)
    rows: list[dict[str, Any]] = []
    recognise = args.recognise_shapes
    with private_daemon("sim", peak, lambda text: None) as directory:
        session, limit = open_session(args, directory, limit, peak, lambda text: None)
        with session:
            compute = SimCompute(session.compute)
            replayers = {
                s: Replayer(session, it, compute, args.compute_scale, shape="" if recognise else s)
                for s, it in its.items()
            }
            shared: dict[int, Any] = {}
            for r in replayers.values():
                r.setup(shared)
            rng = random.Random(args.seed)
            order = [rng.choice(list(its)) for _ in range(args.iterations)]
            started = time.monotonic()
            for n, shape in enumerate(order):
                before = session.stats()
                record = replayers[shape].iteration()
                after = session.stats()
                rows.append(
                    {
                        "n": n,
                        "shape": shape,
                        "phase": record.phase,
                        "step_ns": record.step_ns,
                        "hits": after.plan_hits - before.plan_hits,
                        "misses": after.plan_misses - before.plan_misses,
                        "on_demand_bytes": record.on_demand_out_bytes + record.on_demand_in_bytes,
                        "mismatches": record.mismatches,
                        "stamps_checked": record.stamps_checked,
                        "session_shape": session.shape,  # as named, or as recognised
                    }
                )
                if args.verbose:
                    print(f"  {n:3d} {shape:>14} {record.phase:9} {record.step_ns / 1e6:8.1f} ms")
            seconds = time.monotonic() - started
            plans = session.plans
            unavailable = session.plan_unavailable
        log = (directory / "tidalpoold.log").read_text()
    planned_at = plan_seconds(log)
    shapes = {}
    for s in its:
        mine = [r for r in rows if r["shape"] == s]
        told = sorted({r["session_shape"] for r in mine})  # one per shape, unless misread
        key = told[0] if len(told) == 1 else s
        first = next((i for i, r in enumerate(mine) if r["phase"] != "learning"), None)
        after_plan = mine[first:] if first is not None else []
        hits = sum(r["hits"] for r in after_plan)
        misses = sum(r["misses"] for r in after_plan)
        steady = [r["step_ns"] for r in after_plan if r["phase"] == "steady"]
        plan = plans.get(key)
        p = plan.prediction if plan is not None else None
        shapes[s] = {
            "iterations": len(mine),
            "unplanned_iterations": first if first is not None else len(mine),
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else None,
            "peak_bytes": peaks[s],
            "mapped_peak_bytes": plan.paging.mapped_peak if plan and plan.paging else None,
            "swaps": len(plan.swaps) if plan else None,
            "measured_step_ns": statistics.median(steady) if steady else None,
            "predicted_step_ns": p.step_ns if p is not None else None,
            "plan_seconds": planned_at.get(key),
            "session_shapes": told,
            "on_demand_bytes_after_plan": sum(r["on_demand_bytes"] for r in after_plan),
            "mismatches": sum(r["mismatches"] for r in mine),
            "stamps_checked": sum(r["stamps_checked"] for r in mine),
        }
    return {
        "fraction": fraction,
        "limit_bytes": limit,
        "largest_peak_bytes": peak,
        "seconds": round(seconds, 1),
        "unavailable": None if unavailable is None else unavailable.line(),
        "order": order,
        "shapes": shapes,
        "rows": rows,
    }


def show(model: str, result: dict[str, Any]) -> None:
    def ms(ns: float | None) -> str:
        return "—" if ns is None else f"{ns / 1e6:.1f}"

    def mib(n: int | None) -> str:
        return "—" if n is None else f"{n / 2**20:.0f}"

    print(
        f"\n{model} at {result['fraction']} of its largest shape's peak"
        f" ({mib(result['limit_bytes'])} MiB), {len(result['order'])} iterations in"
        f" {result['seconds']} s"
    )
    print(
        f"{'shape':>14} {'iters':>5} {'unplanned':>9} {'hit rate':>8} {'peak MiB':>8}"
        f" {'mapped MiB':>10} {'swaps':>5} {'measured ms':>11} {'predicted ms':>12}"
        f" {'ratio':>5} {'plan s':>6} {'mismatch':>8}"
    )
    for s, r in result["shapes"].items():
        ratio = (
            f"{r['measured_step_ns'] / r['predicted_step_ns']:.3f}"
            if r["measured_step_ns"] and r["predicted_step_ns"]
            else "—"
        )
        rate = "—" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.2f}%"
        print(
            f"{s:>14} {r['iterations']:>5} {r['unplanned_iterations']:>9} {rate:>8}"
            f" {mib(r['peak_bytes']):>8} {mib(r['mapped_peak_bytes']):>10}"
            f" {'—' if r['swaps'] is None else r['swaps']:>5} {ms(r['measured_step_ns']):>11}"
            f" {ms(r['predicted_step_ns']):>12} {ratio:>5}"
            f" {'—' if r['plan_seconds'] is None else r['plan_seconds']:>6}"
            f" {r['mismatches']:>8}"
        )
    told = {
        s: r["session_shapes"] for s, r in result["shapes"].items() if r["session_shapes"] != [s]
    }
    if told:
        print("  the session told: " + "; ".join(f"{s} as {', '.join(t)}" for s, t in told.items()))
    if result["unavailable"]:
        print(f"  the daemon: {result['unavailable']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--fractions", default="1.0,0.6")
    parser.add_argument("--models", default="gpt2,resnet18")
    parser.add_argument("--compute-scale", type=float, default=20.0)
    parser.add_argument("--copy-gbps", type=float, default=2.0)
    parser.add_argument("--page", default="2MiB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument(
        "--recognise-shapes",
        action="store_true",
        help="steps name no shape: the session tells each from its first allocation",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tp-shapes-traces-"))
    try:
        paths = record_models(work)
        results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
        for model in args.models.split(","):
            its = iterations_of(paths[model])
            for fraction in (float(f) for f in args.fractions.split(",")):
                result = run(its, fraction, args)
                show(model, result)
                results.setdefault(model, []).append(result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
