"""SavedTensors under a swap limit on the sim backend: step time and swap stalls of a CPU model,
with and without telling the daemon the compute between saved-tensor hooks, vs plain PyTorch.

    .venv/bin/python bench/torch_saved.py [--iterations 40] [--repeats 2] [--json]

The model: an MLP of `--depth` Linear(1024, 1024)+ReLU layers and a 10-way head, batch 512,
SGD, one CPU thread (torch.set_num_threads(1)), so its compute is steady. It saves about 2 MiB
per layer for backward. Each configuration runs in a fresh session of a fresh sim daemon with
`--swap-limit` (default 8 MiB) and copies throttled to `--copy-gbps` (default 1 GB/s, so copies
take time like PCIe does for a GPU ten times faster than this CPU):

  plain        PyTorch alone (no session): the unconstrained step
  gaps         SavedTensors (offload "lru"), the compute between hooks sent as ops (default)
  no-gaps      the same with those ops' durations zeroed: the daemon sees only the copies
  all          SavedTensors with offload "all" (each save swapped out right after its pack)

Step time is the median of the last `--measure` iterations (the daemon's schedule is in use by
then); stall is the swap engine's stall per step over those iterations. Losses are checked to
be bit-identical to plain PyTorch's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tidalpool
import tidalpool.torch as tt
import torch
from tidalclient.local import LocalDaemon

nn = torch.nn


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def run(config: str, a: argparse.Namespace, socket_dir: Path | None) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layers = [m for _ in range(a.depth) for m in (nn.Linear(1024, 1024), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(512, 1024), torch.randint(0, 10, (512,))
    steps: list[float] = []
    stalls: list[float] = []
    losses: list[float] = []

    def train(session: tidalpool.Session | None) -> None:
        for _ in range(a.iterations):
            stall = session.stats().swap.stall_ns if session is not None else 0  # type: ignore[union-attr]
            t = time.perf_counter()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            steps.append(time.perf_counter() - t)
            losses.append(loss.item())
            if session is not None:
                swap = session.stats().swap
                assert swap is not None
                stalls.append((swap.stall_ns - stall) / 1e6)

    result: dict[str, Any] = {"config": config}
    if socket_dir is None:
        train(None)
    else:
        with tidalpool.attach(
            socket_dir,
            device_limit="128MiB",
            host_limit="128MiB",
            swap_limit=a.swap_limit,
            copy_gbps=a.copy_gbps,
        ) as session:
            if config == "no-gaps":
                record = session.record_op
                session.record_op = lambda name, ns: record(name, 0)  # type: ignore[method-assign]
            offload = "all" if config == "all" else "lru"
            with tt.SavedTensors(session, opt, offload=offload) as saved:
                train(session)
            swap = session.stats().swap
            assert swap is not None
            result["scheduled_swaps"] = swap.scheduled_swaps
            result["peak_resident_mib"] = swap.peak_resident_bytes / 2**20
            result["saved_mib_per_step"] = saved.stats().saved_bytes / a.iterations / 2**20
            result["plans"] = session.stats().plans_received
            result["stall_ms"] = statistics.median(stalls[-a.measure :])
    result["step_ms"] = 1e3 * statistics.median(steps[-a.measure :])
    result["losses"] = losses
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--measure", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--swap-limit", default="8MiB")
    parser.add_argument("--copy-gbps", type=float, default=1.0)
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for repeat in range(a.repeats):
        for config in ("plain", "gaps", "no-gaps", "all"):
            if config == "plain":
                rows.append(run(config, a, None))
            else:
                with (
                    tempfile.TemporaryDirectory(prefix="tp-", dir="/tmp") as tmp,
                    LocalDaemon.start(Path(tmp), device_pool="256MiB", host_pool="256MiB") as d,
                ):
                    rows.append(run(config, a, d.socket_dir))
            rows[-1]["repeat"] = repeat
            log({k: v for k, v in rows[-1].items() if k != "losses"})
    reference = rows[0]["losses"]
    for row in rows:
        row["bit_identical"] = row.pop("losses") == reference
        plain = next(r for r in rows if r["config"] == "plain" and r["repeat"] == row["repeat"])
        row["overhead"] = row["step_ms"] / plain["step_ms"] - 1
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"{'config':<10} {'step ms':>8} {'overhead':>9} {'stall ms':>9} {'scheduled':>9} "
        f"{'peak MiB':>9}  bit-identical"
    )
    for r in rows:
        print(
            f"{r['config']:<10} {r['step_ms']:8.1f} {100 * r['overhead']:8.1f}% "
            f"{r.get('stall_ms', 0):9.1f} {r.get('scheduled_swaps', ''):>9} "
            f"{r.get('peak_resident_mib', 0):9.2f}  {r['bit_identical']}"
        )


if __name__ == "__main__":
    main()
