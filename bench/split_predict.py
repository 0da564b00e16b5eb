"""Micro-batching the ops too big for a fixed memory: the op-wise bound and the largest batch
whose planned step fits, before and after, predicted on the meta device without a GPU.

    .venv/bin/python bench/split_predict.py [--models gpt2,resnet50] [--memory 8GiB]
        [--batches gpt2=13,14,16] [--plan gpt2=13,14,16] [--bandwidth 50] [--split-blocks]
        [--json PATH]

The models and training loop of bench/torch_train.py (fp32, AdamW, gradients set to None, the
output dropped after the loss), recorded on the meta device (`tidalpool.torch.record`, op
times from an H100's roofline). For each batch:

- before: SuperNeurons' op-wise bound (the most bytes one op touches; no swap or
  recomputation plan fits under it) and the recorded peak;
- `tidalpool.torch.plan_split(..., limit=--memory, head="head")`: the ops over the memory,
  the parts each separable kind runs in, the bound `tidalplan.split.split_bound` predicts,
  and the bound and peak recorded again with the split applied (GPT-2's head and
  cross-entropy as `LinearCrossEntropy`; with `--split-blocks`, its transformer layers too, as
  `BatchSplit`s, while ops inside them are over); ops over the memory not split, with why;
- for the batches in `--plan`: `plan_recompute(..., place=True)` in --memory on the model as
  it is and on the split model (the blocks to recompute, the rest swapped, the placement
  fitted): feasible or not, the step's overhead and the placed footprint. A model whose
  op-wise bound is over the memory is infeasible without planning.

A prediction from the roofline; only a GPU measures a step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "client"), str(ROOT / "offline")]

GIB = 1 << 30
BATCHES = {"gpt2": (13, 14, 16, 20), "resnet50": (384, 512)}


def per_model(text: str | None, default: dict[str, tuple[int, ...]]) -> dict[str, list[int]]:
    """`gpt2=13,14;resnet50=384` as lists per model; the default for a model not named."""
    out = {k: list(v) for k, v in default.items()}
    for item in (text or "").split(";"):
        if item.strip():
            name, _, batches = item.partition("=")
            out[name.strip()] = [int(b) for b in batches.split(",") if b.strip()]
    return out


def case(
    name: str, batch: int, memory: int, gbps: float, plan: bool, split_blocks: bool
) -> dict[str, Any]:
    import tidalpool.torch
    import torch
    from torch_train import LOOP, build

    def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-4)

    model, make_batch, blocks = build(name, False)
    example = make_batch(batch)
    loss = torch.nn.functional.cross_entropy
    out: dict[str, Any] = {"model": name, "batch": batch, "memory_bytes": memory}

    def planned(loss_fn: Any, bound: int, blocks: list[Any]) -> dict[str, Any]:
        if bound > memory:
            return {"feasible": False, "why": f"one op touches {bound / GIB:.2f} GiB"}
        try:
            p = tidalpool.torch.plan_recompute(
                model,
                example,
                loss_fn,
                adamw,
                blocks,
                limit=memory,
                bandwidth_gbps=gbps,
                place=True,
                **LOOP,
                progress=lambda line: print("    " + line, flush=True),
            )
        except tidalpool.torch.RecomputeError as e:
            return {"feasible": False, "why": str(e)}
        return {
            "feasible": True,
            "step_ns": p.chosen.step_ns,
            # Over the model as it was, unsplit and unconstrained: what the split costs too.
            "overhead_vs_unsplit": p.chosen.step_ns / split.compute_before_ns - 1,
            "blocks": len(p.blocks),
            "of": len(blocks),
            "overhead": p.overhead,
            "footprint_bytes": p.chosen.footprint,
            "peak_bytes": p.chosen.peak_bytes,
        }

    gpt2 = name == "gpt2"
    split = tidalpool.torch.plan_split(
        model,
        example,
        loss,
        adamw,
        limit=memory,
        head="head" if gpt2 else None,
        blocks=blocks if gpt2 and split_blocks else (),
        **LOOP,
    )
    out.update(
        bound_before=split.bound_before,
        peak_before=split.peak_before,
        over=[{"op": op.name, "touched": op.touched, "parts": op.parts} for op in split.big],
        parts=split.parts,
        unsplit=[{"op": op.name, "touched": op.touched, "why": op.why} for op in split.unsplit],
        bound_predicted=split.bound_predicted,
        bound_after=split.bound_after,
        peak_after=split.peak_after,
        block_parts=split.block_parts,
        compute_before_ns=split.compute_before_ns,
        compute_after_ns=split.compute_after_ns,
    )
    print(
        f"{name} batch {batch}: one op {split.bound_before / GIB:.2f} GiB, peak"
        f" {split.peak_before / GIB:.2f} GiB; {len(split.big)} ops over"
        f" {memory / GIB:.2f} GiB, parts {split.parts or '-'}, blocks in {split.block_parts};"
        f" after: one op"
        f" {split.bound_after / GIB:.2f} GiB (predicted {split.bound_predicted / GIB:.2f}),"
        f" peak {split.peak_after / GIB:.2f} GiB",
        flush=True,
    )
    if plan:
        if split.parts:
            print(f"  planning the split model in {memory / GIB:.2f} GiB:", flush=True)
            planned_blocks = list(split.blocks) or blocks
            out["plan_after"] = planned(split.loss_fn, split.bound_after, planned_blocks)
            # The model as it was, for the plan before.
            model, _, blocks = build(name, False)
        else:
            out["plan_after"] = None
        print(f"  planning the model as it is in {memory / GIB:.2f} GiB:", flush=True)
        out["plan_before"] = planned(loss, split.bound_before, blocks)
        if out["plan_after"] is None:
            out["plan_after"] = out["plan_before"]
        for when in ("plan_before", "plan_after"):
            p = out[when]
            print(
                f"  {when}: "
                + (
                    f"{100 * p['overhead']:.0f}% ({100 * p['overhead_vs_unsplit']:.0f}% over the"
                    f" unsplit step), {p['blocks']} of {p['of']} blocks recomputed,"
                    f" placed in {p['footprint_bytes'] / GIB:.2f} GiB"
                    if p["feasible"]
                    else f"infeasible ({p['why']})"
                ),
                flush=True,
            )
    return out


def main() -> None:
    from tidalcore.units import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,resnet50")
    parser.add_argument("--memory", default="8GiB")
    parser.add_argument("--bandwidth", type=float, default=50.0, help="GB/s each way")
    parser.add_argument("--batches", help="per model: gpt2=13,14;resnet50=384")
    parser.add_argument("--plan", default="", help="per model, the batches to plan in --memory")
    parser.add_argument(
        "--split-blocks",
        action="store_true",
        help="also run GPT-2's transformer blocks in parts when ops inside them are over",
    )
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    memory = int(parse_size(a.memory))
    batches = per_model(a.batches, BATCHES)
    plans = per_model(a.plan, {})
    results = []
    for name in a.models.split(","):
        for batch in batches[name]:
            plan = batch in plans.get(name, [])
            results.append(case(name, batch, memory, a.bandwidth, plan, a.split_blocks))
            if a.json:  # after every case: a long run keeps what it measured
                doc = {"memory_bytes": memory, "bandwidth_gbps": a.bandwidth, "cases": results}
                a.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
