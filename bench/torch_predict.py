"""What the planner predicts for the GPU goals of bench/torch_train.py, without a GPU.

    .venv/bin/python bench/torch_predict.py [--models gpt2,resnet50]
        [--dtype fp32|bf16] [--bandwidth 50] [--memory 8GiB] [--json PATH]

The same models as bench/torch_train.py (AdamW; fp32, or bf16 autocast with `--dtype bf16`)
are recorded on the meta device as its step trains them (`tidalpool.torch.record` with its
`LOOP`: gradients set to None, the output dropped once the loss is computed; real allocations,
op durations from the roofline of an H100 SXM), then simulated by Planner II
(`tidalpool simulate`) with copies at `--bandwidth` GB/s each way:

  limit   at half of the recorded peak, default batch: the overhead of tidalpool's swap policy
          and of vDNN's offload-all (the closest policy to save_on_cpu), beside two bounds no
          swap schedule beats: moving peak - limit bytes each way takes that long at the
          bandwidth, whatever the overlap; and the phase bound (`phase_bound`), which also
          counts when those copies can run
  batch   for a list of batches: the recorded peak (plain PyTorch fits when it is at most
          `--memory`), the most bytes one op touches (SuperNeurons' op-wise bound: no
          schedule fits a limit below it) and, at `--memory`, whether tidalpool's schedule
          is feasible, its overhead and the footprint of its placement (Planner I on the
          swapped blocks); where that placement needs more than `--memory`, the schedule
          made for a lower limit whose placement fits (`combined.fit`), its overhead and
          that limit

  recompute  at half of the recorded peak: torch.utils.checkpoint on every block (its step
          when its peak fits, else it does not) and `tidalpool.torch.plan_recompute` (the
          blocks to recompute, cheapest per freed byte, with tidalpool's swap policy for the
          rest); and at `--memory`, for `--recompute-batches`, the plan whose placement fits
          (`place=True`). Overheads are over the unconstrained step of the same batch.

A prediction, not a measurement: the roofline assumes peak FLOP/s and bandwidth, so real
kernels take longer and real overheads of the same bytes moved are lower; only `torch_train.py`
on a GPU measures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "client"), str(ROOT / "daemon")]

BATCHES = {"gpt2": (4, 5, 6, 8, 10, 12, 15), "resnet50": (64, 96, 128, 192, 288, 384)}
RECOMPUTE_BATCHES = {"gpt2": (10, 12, 13, 14), "resnet50": (384, 512, 768)}
DEFAULT = {"gpt2": 8, "resnet50": 64}


def autocast(dtype: str) -> Any:
    """The `autocast` argument of `record` for a `--dtype` ("fp32" or "bf16")."""
    import torch

    return torch.bfloat16 if dtype == "bf16" else None


def record(name: str, batch: int, tiny: bool, directory: Path, dtype: str = "fp32") -> Path:
    from torch_train import record_training

    path = directory / f"{name}.b{batch}.csv"
    record_training(name, batch, path, tiny, autocast(dtype))
    return path


def recompute_rows(
    name: str,
    batch: int,
    tiny: bool,
    limit: int,
    gbps: float,
    place: bool,
    directory: Path,
    dtype: str = "fp32",
) -> dict[str, Any]:
    """Checkpointing every block and tidalpool's recompute plan at `limit` bytes."""
    import tidalpool.torch
    import torch
    from tidalplan import learn
    from tidalplan.autoswap import durations, load
    from torch_train import LOOP, build

    model, make_batch, blocks = build(name, tiny)
    example = make_batch(batch)
    loss = torch.nn.functional.cross_entropy

    def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-4)

    events = tidalpool.torch.record(
        model,
        example,
        loss,
        adamw,
        path=directory / f"{name}.b{batch}.ckpt.csv",
        recompute=blocks,
        autocast=autocast(dtype),
        **LOOP,
    )
    it = learn.extract(events, events.marks())
    every = {"peak_bytes": int(load(it).max()), "compute_ns": int(durations(it).sum())}
    out: dict[str, Any] = {"limit_bytes": limit, "checkpoint": every}
    try:
        p = tidalpool.torch.plan_recompute(
            model,
            example,
            loss,
            adamw,
            blocks,
            limit=limit,
            bandwidth_gbps=gbps,
            place=place,
            autocast=autocast(dtype),
            **LOOP,
            progress=lambda line: print("    " + line, flush=True),
        )
    except tidalpool.torch.RecomputeError as e:
        out["plan"] = {"feasible": False, "why": str(e)}
        return out
    plain = p.plain_compute_ns
    every["overhead"] = every["compute_ns"] / plain - 1 if every["peak_bytes"] <= limit else None
    out["plan"] = {
        "feasible": True,
        "blocks": len(p.blocks),
        "of": len(blocks),
        "overhead": p.overhead,
        "peak_bytes": p.chosen.peak_bytes,
        "compute_ns": p.chosen.compute_ns,
        "footprint_bytes": p.chosen.footprint,
        "plain_compute_ns": plain,
        "candidates": [
            {"blocks": len(c.chosen), "peak_bytes": c.peak_bytes, "step_ns": c.step_ns}
            for c in p.candidates
        ],
    }
    return out


def rows(path: Path, limit: int | None, names: list[str], gbps: float) -> dict[str, Any]:
    """The trace's peak and compute time, and each policy's placed plan at `limit` bytes (None:
    half of the peak; made for a lower limit where the placement needs more). `tidalpool` is
    its search with swaps only: what PyTorch's saved tensors execute."""
    from tidaloffline.simulate_command import load as load_trace
    from tidalplan.autoswap import durations, load, op_bound
    from tidalplan.combined import fit
    from tidalplan.policies import policy, swaps_only

    it = load_trace(path)
    peak = int(load(it).max())
    limit = peak // 2 if limit is None else limit
    compute_ns = int(durations(it).sum())
    moved_ns = max(0, peak - limit) / gbps  # bytes / (GB/s) = ns
    out: dict[str, Any] = {
        "peak_bytes": peak,
        "limit_bytes": limit,
        "compute_ms": compute_ns / 1e6,
        "bound_overhead": max(0.0, moved_ns / compute_ns - 1),
        "phase_bound_overhead": phase_bound(it, limit, gbps) / compute_ns - 1,
        "op_bound_bytes": op_bound(it),  # no schedule fits a limit below it
    }
    if limit >= peak:
        out["policies"] = {n: {"feasible": True, "overhead": 0.0} for n in names}
        return out
    out["policies"] = {}
    for name in names:
        made = fit(it, swaps_only if name == "tidalpool" else policy(name), limit, gbps, gbps)
        out["policies"][name] = {
            "feasible": made.fits,
            "overhead": made.result.overhead if made.fits else None,
            "moved_bytes": made.result.out_bytes,
            "footprint_bytes": made.footprint,
            "planned_for_bytes": made.planned_for,
            "fits": made.fits,
        }
    return out


def phase_bound(it: Any, limit: int, gbps: float) -> int:
    """ns: no swap schedule of the simulator (one copy at a time each way, `gbps` GB/s) runs
    the iteration `it` under `limit` bytes faster.

    At any tick t, the bytes over the limit must be off the device. Those of blocks made in
    this iteration (not persistent, not crossing the boundary, which may have left in the
    previous one) were copied out after the iteration began and before compute reached t,
    and come back after t and before the iteration ends. So with X of them, compute C before
    t and C' from t on, the step takes at least max(C, X / bandwidth) + max(C', X / bandwidth);
    the bound is the largest over every t."""
    import dataclasses

    import numpy as np
    from tidalplan.autoswap import durations, load
    from tidalplan.learn import live_bytes

    compute = durations(it)
    if not len(compute):
        return 0
    before = np.cumsum(compute) - compute
    after = int(compute.sum()) - before
    crossing = dataclasses.replace(it, blocks=tuple(b for b in it.blocks if b.crosses))
    free = sum(size for _, size in it.persistent) + live_bytes(crossing)
    moved = np.maximum(0, load(it) - limit - free) / gbps  # bytes / (GB/s) = ns
    return int(np.ceil((np.maximum(before, moved) + np.maximum(after, moved)).max()))


def main() -> None:
    from tidalcore.units import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,resnet50")
    parser.add_argument("--bandwidth", type=float, default=50.0, help="GB/s each way")
    parser.add_argument("--memory", default="8GiB", help="the fixed limit of the batch table")
    parser.add_argument("--batches", help="comma-separated batches (default: per model)")
    parser.add_argument("--tiny", action="store_true", help="small models (tests)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument(
        "--recompute-batches", help="comma-separated batches of the recompute table at --memory"
    )
    parser.add_argument("--skip", default="", help="comma-separated: batch, recompute")
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    memory = int(parse_size(a.memory))
    skip = set(a.skip.split(",")) - {""}
    result: dict[str, Any] = {
        "bandwidth_gbps": a.bandwidth,
        "memory_bytes": memory,
        "dtype": a.dtype,
    }
    gib = 1 << 30
    with tempfile.TemporaryDirectory(prefix="tp-predict-") as tmp:
        for name in a.models.split(","):
            b = DEFAULT[name]
            trace = record(name, b, a.tiny, Path(tmp), a.dtype)
            limit = rows(trace, None, ["tidalpool", "vdnn-all"], a.bandwidth)
            p = limit["policies"]
            print(
                f"{name} batch {b} {a.dtype}: compute {limit['compute_ms']:.1f} ms, peak"
                f" {limit['peak_bytes'] / gib:.2f} GiB; at half: bound"
                f" {100 * limit['bound_overhead']:.0f}%, phase bound"
                f" {100 * limit['phase_bound_overhead']:.0f}%, tidalpool"
                f" {_pct(p['tidalpool']['overhead'])}, vdnn-all {_pct(p['vdnn-all']['overhead'])}"
            )
            result[name] = {"batch": b, "limit": limit}
            if "recompute" not in skip:
                print(f"{name} batch {b} at half the peak, recomputing:", flush=True)
                rc = recompute_rows(
                    name, b, a.tiny, limit["limit_bytes"], a.bandwidth, False, Path(tmp), a.dtype
                )
                print(f"  {_recompute_line(rc)}", flush=True)
                result[name]["limit"]["recompute"] = rc
                table = []
                listed = a.recompute_batches or ",".join(map(str, RECOMPUTE_BATCHES[name]))
                for batch in (int(x) for x in listed.split(",")):
                    print(f"{name} batch {batch} in {a.memory}, recomputing:", flush=True)
                    rc = recompute_rows(
                        name, batch, a.tiny, memory, a.bandwidth, True, Path(tmp), a.dtype
                    )
                    print(f"  {_recompute_line(rc)}", flush=True)
                    table.append({"batch": batch, **rc})
                result[name]["recompute_batches"] = table
            if "batch" in skip:
                continue
            table = []
            batches = [int(x) for x in a.batches.split(",")] if a.batches else BATCHES[name]
            for batch in batches:
                trace = record(name, batch, a.tiny, Path(tmp), a.dtype)
                r = rows(trace, memory, ["tidalpool"], a.bandwidth)
                t = r["policies"]["tidalpool"]
                fp, made_for = t.get("footprint_bytes"), t.get("planned_for_bytes")
                placed = ""
                if fp:
                    placed = f", footprint {fp / gib:.2f} GiB"
                    if t.get("fits") and made_for:
                        placed += f" (scheduled for {made_for / gib:.2f} GiB)"
                    elif t.get("fits") is False:
                        placed += " (no schedule's placement fits)"
                print(
                    f"  batch {batch:4d}: peak {r['peak_bytes'] / gib:6.2f} GiB"
                    f" plain {'fits' if r['peak_bytes'] <= memory else 'no  '};"
                    f" tidalpool {'feasible' if t['feasible'] else 'infeasible'}"
                    f" {_pct(t['overhead'])}{placed}; one op touches"
                    f" {r['op_bound_bytes'] / gib:.2f} GiB",
                    flush=True,
                )
                table.append({"batch": batch, **r})
            result[name]["batches"] = table
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))


def _recompute_line(rc: dict[str, Any]) -> str:
    gib = 1 << 30
    every, p = rc["checkpoint"], rc["plan"]
    line = f"checkpoint every block: peak {every['peak_bytes'] / gib:.2f} GiB, " + (
        "does not fit" if every.get("overhead") is None else f"{_pct(every['overhead'])}"
    )
    if not p["feasible"]:
        return line + "; tidalpool: infeasible"
    placed = (
        "" if p["footprint_bytes"] is None else f", placed {p['footprint_bytes'] / gib:.2f} GiB"
    )
    return line + (
        f"; tidalpool: {p['blocks']} of {p['of']} blocks recomputed, peak"
        f" {p['peak_bytes'] / gib:.2f} GiB{placed}, overhead {_pct(p['overhead'])}"
    )


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


if __name__ == "__main__":
    main()
