"""PyTorch in place on sim: the sample models trained with `tidalpool.torch.InPlace` under
limits, against the same training without tidalpool, in one run.

For each model of traces/record.py (the MLP, ResNet-18, GPT-2 small at sequence 128), with
random inputs from a fixed seed:

- plain: `--iterations` steps of PyTorch alone (the losses, and the median step);
- in place, unconstrained: the same steps in a paged session (`--page`) with the swap limit at
  the device lease, so nothing moves: the session's peak of mapped bytes P;
- in place under a limit, for each of `--fractions` of P: the steps, waiting after the
  `--learn` first for the daemon's plan (or its word that none can be made, and why).

Each row: whether every loss and every parameter equal plain PyTorch's bit for bit, the plan
(or the daemon's refusal and the lowest limit it names), plan hits and misses once it runs, the
bytes the plan moved each way an iteration and those moved on demand, the mapped peak, and the
median step of the planned iterations against plain and against the plan's prediction.

    .venv/bin/python bench/torch_inplace.py [--models mlp resnet18 gpt2] [--iterations 12]
        [--learn 8] [--fractions 0.9,0.7,0.5,0.3] [--page 64KiB] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "traces"))

import tidalpool  # noqa: E402
from record import GPT2_VOCAB, SAMPLES  # noqa: E402  (traces/record.py)
from tidalclient.errors import LeaseExceeded  # noqa: E402
from tidalclient.local import LocalDaemon  # noqa: E402
from tidalcore.units import format_size, parse_size  # noqa: E402
from tidalpool.torch import InPlace  # noqa: E402

Batch = tuple[torch.Tensor, torch.Tensor]


def batches(name: str, count: int) -> list[Batch]:
    """`count` random batches of the sample's shapes, from a fixed seed."""
    x0, y0 = SAMPLES[name].batch()
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        if x0.dtype == torch.long:  # token ids
            x = torch.randint(0, GPT2_VOCAB, x0.shape, generator=g)
            y = torch.randint(0, GPT2_VOCAB, y0.shape, generator=g)
        else:
            x = torch.randn(x0.shape, generator=g)
            y = torch.randint(0, 10, y0.shape, generator=g)
        out.append((x, y))
    return out


def made(name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = SAMPLES[name].model()
    return model, SAMPLES[name].optimizer(model)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> tuple[float, int]:
    """One training step as traces/record.py's: its loss and its ns."""
    started = time.perf_counter_ns()
    optimizer.zero_grad()
    x, y = batch
    out = model(x)
    loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y)
    loss.backward()
    optimizer.step()
    value = loss.item()
    return value, time.perf_counter_ns() - started


def plain(name: str, data: list[Batch]) -> dict[str, Any]:
    model, optimizer = made(name)
    losses, times = zip(*(step(model, optimizer, b) for b in data), strict=True)
    return {"losses": list(losses), "step_ns": statistics.median(times[1:]), "model": model}


def in_place(
    name: str,
    data: list[Batch],
    daemon: LocalDaemon,
    lease: int,
    limit: int,
    page: int,
    learn: int,
) -> dict[str, Any]:
    model, optimizer = made(name)
    losses: list[float] = []
    times: list[int] = []
    row: dict[str, Any] = {"limit": limit}
    with tidalpool.attach(
        daemon.socket_dir,
        device_limit=lease,
        host_limit=lease,
        swap_limit=limit,
        page_bytes=page,
    ) as session:
        with InPlace(session, model, optimizer) as held:
            planned_from = len(data)
            after: list[Any] = []  # the session's stats after each step
            for k, batch in enumerate(data):
                if k == learn:
                    deadline = time.monotonic() + 600
                    while not answered(session.stats()) and time.monotonic() < deadline:
                        time.sleep(0.05)
                    stats = session.stats()
                    row["unavailable"] = (
                        None
                        if stats.plan_unavailable is None
                        else {
                            "kind": stats.plan_unavailable.kind,
                            "reason": stats.plan_unavailable.reason,
                            "lowest_limit": stats.plan_unavailable.lowest_limit_bytes,
                        }
                    )
                    if stats.plans_received:
                        planned_from = k + 1  # the first whole iteration after the switch
                loss, ns = step(model, optimizer, batch)
                losses.append(loss)
                times.append(ns)
                after.append(session.stats())
            seen = held.stats()
        stats = session.stats()
        plan = next(iter(session.plans.values()), None)
    steady = times[planned_from:]
    n = len(steady)
    first, last = after[planned_from - 1], after[-1]  # around the steady planned iterations

    def per_iteration(value: Callable[[Any], int]) -> int | None:
        return (value(last) - value(first)) // n if n else None

    row.update(
        {
            "losses": losses,
            "tensors": seen.tensors,
            "saves_per_iteration": seen.saves / len(data),
            "ops_per_iteration": seen.ops / len(data),
            "mode": stats.mode,
            "plans": stats.plans_received,  # a second plan mid-run moves blocks at its switch
            "steady_iterations": n,
            "plan_hits": per_iteration(lambda s: s.plan_hits),
            "plan_misses": per_iteration(lambda s: s.plan_misses),
            "planned_out_bytes": per_iteration(lambda s: s.swap.planned_out_bytes),
            "schedule_skips": per_iteration(lambda s: s.swap.schedule_skips),
            "on_demand_bytes": per_iteration(
                lambda s: s.swap.on_demand_out_bytes + s.swap.on_demand_in_bytes
            ),
            "peak_mapped": stats.swap.peak_resident_bytes if stats.swap else 0,
            "step_ns": statistics.median(steady) if steady else None,
            "predicted_ns": plan.prediction.step_ns if plan and plan.prediction else None,
            # the learned ops' time, without stalls, and the copy rate the plan assumed
            "predicted_compute_ns": plan.prediction.baseline_ns
            if plan and plan.prediction
            else None,
            "predicted_stall_ns": plan.prediction.stall_ns if plan and plan.prediction else None,
            "plan_copy_gbps": plan.prediction.copy_gbps if plan and plan.prediction else None,
        }
    )
    row["model"] = model
    return row


def size_text(n: int | None) -> str:
    return "-" if n is None else format_size(n)


def answered(stats: Any) -> bool:
    """The daemon sent the session a plan, or its word that none can be made."""
    return bool(stats.plans_received > 0 or stats.plan_unavailable is not None)


def ms_text(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:.1f}"


def same(row: dict[str, Any], base: dict[str, Any]) -> bool:
    if row["losses"] != base["losses"]:
        return False
    pairs = zip(row["model"].parameters(), base["model"].parameters(), strict=True)
    return all(torch.equal(a, b) for a, b in pairs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["mlp", "resnet18", "gpt2"])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--learn", type=int, default=8)
    parser.add_argument("--fractions", default="0.9,0.7,0.5,0.3")
    parser.add_argument("--page", default="64KiB")
    parser.add_argument("--pool", default="8GiB", help="the sim daemon's device and host pools")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    page, pool = parse_size(args.page), parse_size(args.pool)
    results = []
    directory = Path(tempfile.mkdtemp(prefix="tp-", dir="/tmp"))
    daemon = LocalDaemon.start(
        directory,
        device_pool=args.pool,
        host_pool=args.pool,
        default_lease=args.pool,
        chunk_size="2MiB",
    )
    try:
        for name in args.models:
            data = batches(name, args.iterations)
            base = plain(name, data)
            print(f"{name}: plain step {base['step_ns'] / 1e6:.1f} ms", flush=True)
            free = in_place(
                name,
                data,
                daemon,
                pool,
                pool,
                page,
                args.learn,
            )
            peak = free["peak_mapped"]
            rows = [dict(free, fraction=None)]
            refused = []
            for fraction in (float(f) for f in args.fractions.split(",")):
                limit = int(peak * fraction)
                try:
                    row = in_place(
                        name,
                        data,
                        daemon,
                        pool,
                        limit,
                        page,
                        args.learn,
                    )
                except LeaseExceeded as e:  # an op needs more than the limit: it cannot run
                    print(f"  {fraction:>4} limit {format_size(limit)}: refused: {e}", flush=True)
                    refused.append({"fraction": fraction, "limit": limit, "refused": str(e)})
                    break
                rows.append(dict(row, fraction=fraction))
            for row in rows:
                row["bit_identical"] = same(row, base)
                del row["model"], row["losses"]
                ratio = (row["step_ns"] / base["step_ns"]) if row["step_ns"] else None
                row["over_plain"] = None if ratio is None else round(ratio, 3)
                told = row.get("unavailable")
                print(
                    f"  {'-' if row['fraction'] is None else row['fraction']:>4}"
                    f" limit {format_size(row['limit'])}: bits {row['bit_identical']},"
                    f" {row['mode']} ({row['plans']} plans),"
                    f" {row['steady_iterations']} planned its: hits"
                    f" {row['plan_hits']}/it misses {row['plan_misses']}/it,"
                    f" planned out {size_text(row['planned_out_bytes'])}/it,"
                    f" on demand {size_text(row['on_demand_bytes'])}/it,"
                    f" skips {row['schedule_skips']}/it,"
                    f" peak {format_size(row['peak_mapped'])},"
                    f" step {ms_text(row['step_ns'])} ms"
                    f" (x{row['over_plain']} plain; predicted {ms_text(row['predicted_ns'])} ms:"
                    f" compute {ms_text(row['predicted_compute_ns'])}, stall"
                    f" {ms_text(row['predicted_stall_ns'])}, at {row['plan_copy_gbps']} GB/s)"
                    + (f", no plan: {told['reason']}" if told else ""),
                    flush=True,
                )
            del base["model"], base["losses"]
            results.append(
                {"model": name, "plain_step_ns": base["step_ns"], "rows": rows + refused}
            )
    finally:
        daemon.stop()
    if args.json:
        args.json.write_text(json.dumps({"page": page, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
