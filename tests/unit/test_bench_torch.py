"""bench/torch_train.py without a GPU: its models train on the CPU in small sizes, in the
configurations that need no daemon, and its batch search finds the largest batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
from torch_train import largest_batch, run_child, saves_host_lease  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20


@pytest.mark.parametrize(
    ("model", "mode", "dtype"),
    [
        ("gpt2", "plain", "fp32"),
        ("gpt2", "checkpoint", "bf16"),
        ("resnet50", "save_on_cpu", "fp32"),
    ],
)
def test_a_small_model_trains_on_the_cpu(model: str, mode: str, dtype: str) -> None:
    command = [sys.executable, str(BENCH / "torch_train.py"), "child", "--model", model]
    command += ["--mode", mode, "--dtype", dtype, "--batch", "2", "--steps", "2", "--warmup", "1"]
    command += ["--tiny", "--device", "cpu"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert "error" not in result, result
    assert result["step_ms"] > 0 and result["warmup_steps"] == 1


def test_a_child_keeps_the_pythonpath_of_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child sees what the environment's PYTHONPATH holds (a machine that brings its
    packages that way, as the GPU machines' wheels do), not a path of the bench's own."""
    (tmp_path / "sitecustomize.py").write_text(
        f"open({str(tmp_path / 'seen')!r}, 'w').write('yes')\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = run_child(
        model="gpt2",
        mode="plain",
        dtype="fp32",
        batch=2,
        steps=1,
        warmup=1,
        tiny=True,
        device="cpu",
    )
    assert "error" not in result, result
    assert (tmp_path / "seen").read_text() == "yes"


def test_the_saves_host_lease_is_sized_from_the_pool_or_refused_naming_both() -> None:
    # By default all the pool can lease beside the allocator session's one chunk.
    assert saves_host_lease(None, 16 * GiB, 64 * MiB) == 16 * GiB - 64 * MiB
    assert saves_host_lease(8 * GiB, 16 * GiB, 64 * MiB) == 8 * GiB
    assert saves_host_lease(16 * GiB - 64 * MiB, 16 * GiB, 64 * MiB) == 16 * GiB - 64 * MiB
    with pytest.raises(SystemExit) as refused:  # the H200 run of 2026-11-27: 40 GiB of 16
        saves_host_lease(40 * GiB, 16 * GiB, 64 * MiB)
    assert str(refused.value) == (
        "torch_train: --host-lease 40 GiB is more than the daemon's host pool of 16 GiB can"
        " lease beside an allocator session (15.94 GiB): ask for less, or give --host-pool more"
    )


@pytest.mark.parametrize(("limit", "start"), [(1, 1), (37, 4), (64, 8), (1000, 3), (5, 8)])
def test_the_batch_search_finds_the_largest_fitting_batch(limit: int, start: int) -> None:
    tried: list[int] = []

    def fits(batch: int) -> bool:
        tried.append(batch)
        return batch <= limit

    found = largest_batch(fits, start)
    if start > limit:
        assert found == 0
        return
    assert found <= limit
    assert limit - found <= max(1, found // 16)  # within the search's resolution
    assert len(tried) < 30


@pytest.mark.timeout(300)  # about 70 s of CPU: more than 120 s on a busy machine
def test_the_prediction_records_simulates_and_compares_with_the_bandwidth_bound(
    tmp_path: Path,
) -> None:
    out = tmp_path / "predict.json"
    command = [sys.executable, str(BENCH / "torch_predict.py"), "--tiny", "--models", "gpt2"]
    command += ["--batches", "2,16", "--memory", "4MiB", "--bandwidth", "0.5", "--json", str(out)]
    command += ["--recompute-batches", "16"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    gpt2 = json.loads(out.read_text())["gpt2"]
    half = gpt2["limit"]
    assert half["limit_bytes"] == half["peak_bytes"] // 2
    # peak - limit bytes each way at 0.5 GB/s against the recorded compute
    bound = half["peak_bytes"] / 2 / 0.5 / (half["compute_ms"] * 1e6) - 1
    assert abs(half["bound_overhead"] - max(0.0, bound)) < 1e-3
    tidalpool = half["policies"]["tidalpool"]
    if tidalpool["feasible"]:  # no schedule beats the bound
        assert tidalpool["overhead"] >= half["bound_overhead"] - 1e-9
    small, large = gpt2["batches"]
    assert small["peak_bytes"] < large["peak_bytes"]
    assert large["peak_bytes"] > 4 << 20  # over the fixed limit: tidalpool's schedule decides
    assert set(large["policies"]) == {"tidalpool"}
    assert 0 < small["op_bound_bytes"] < large["op_bound_bytes"] <= large["peak_bytes"]
    placed = large["policies"]["tidalpool"]
    assert placed["feasible"] and placed["fits"]  # the placement of what it schedules fits...
    assert placed["footprint_bytes"] <= 4 << 20
    assert placed["planned_for_bytes"] <= 4 << 20  # ...scheduled for the limit or less
    # Recomputing: checkpointing every block holds less than plain; the plan at half the peak
    # is feasible and costs at most what checkpointing every block does when that fits.
    rc = half["recompute"]
    assert rc["checkpoint"]["peak_bytes"] < half["peak_bytes"]
    assert rc["plan"]["feasible"] and rc["plan"]["overhead"] >= 0
    if rc["checkpoint"]["overhead"] is not None:
        assert rc["plan"]["overhead"] <= rc["checkpoint"]["overhead"] + 1e-9
    (at16,) = gpt2["recompute_batches"]
    assert at16["batch"] == 16 and at16["limit_bytes"] == 4 << 20
    if at16["plan"]["feasible"]:
        assert at16["plan"]["footprint_bytes"] <= 4 << 20  # placed inside the fixed limit


def test_the_phase_bound_counts_when_copies_can_run() -> None:
    import dataclasses

    from tidalcore.units import Bytes, Tick
    from tidalplan.model import IterBlock
    from torch_predict import phase_bound

    from tests.unit.iterations import build

    steps = ["a A 1000", "o 10 >A", "a B 1000", "o 10 A >B", "o 10 B", "o 10 A", "f A", "f B"]
    it = build(steps, persistent={"W": 100})
    # From tick 2 to 5, 2,100 bytes are live; under 1,600 the 100 persistent ones may be off
    # (copied out in the previous iteration), the other 400 must leave after the iteration
    # began and come back before it ends: 400 ns each way at 1 GB/s around any such tick,
    # against 40 ns of compute.
    assert phase_bound(it, 1600, 1.0) == 800
    assert phase_bound(it, 2100, 1.0) == 40  # fits: the compute alone
    # A block crossing the boundary may have left in the previous iteration too.
    crossing = IterBlock(id=9, size=Bytes(300), start=Tick(2), end=Tick(9), crosses=True)
    assert phase_bound(dataclasses.replace(it, blocks=(*it.blocks, crossing)), 1600, 1.0) == 800


@pytest.mark.parametrize("trace", ["resnet50.b32", "gpt2.b4"])
def test_no_swap_schedule_beats_the_phase_bound(trace: str) -> None:
    from tidaloffline.formats import read_trace_csv
    from tidalplan import learn
    from tidalplan.autoswap import durations, load
    from tidalplan.policies import plan as swap_plan
    from tidalplan.policies import swaps_only
    from tidalplan.simulate import simulate
    from torch_predict import phase_bound

    from tests.conftest import shared_file

    events = read_trace_csv(shared_file(f"traces/models/{trace}.trace.csv"))
    it = learn.extract(events, events.marks())
    peak, compute = int(load(it).max()), int(durations(it).sum())
    feasible = 0
    for fraction in (0.5, 0.7):
        limit = int(peak * fraction)
        bound = phase_bound(it, limit, 25.0)
        assert bound > 2 * compute  # these GPU traces' kernels are short: copies dominate
        for policy in ("vdnn-all", "autoswap-aoa", "tidalpool"):
            # The phase bound is for swap schedules: tidalpool's search with swaps only.
            made = (
                swaps_only(it, limit, 25.0, 25.0)
                if policy == "tidalpool"
                else swap_plan(it, policy, limit, 25.0, 25.0)
            )
            result = simulate(it, made, limit, 25.0, 25.0)
            if result.feasible:
                feasible += 1
                assert result.iteration_ns >= bound, (policy, fraction)
    assert feasible >= 4


def test_the_child_recomputes_the_blocks_the_plan_picks_for_its_limit(tmp_path: Path) -> None:
    import torch
    from tidalplan import learn
    from tidalplan.autoswap import load
    from tidalpool.torch import record
    from torch_train import LOOP, build

    model, make_batch, _ = build("gpt2", True)
    events = record(
        model,
        make_batch(4),  # at 2 the step peaks in AdamW's step, where recomputing cannot help
        torch.nn.functional.cross_entropy,
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4),
        path=tmp_path / "t.csv",
        **LOOP,  # the child's loop, which its plan records
    )
    peak = int(load(learn.extract(events, events.marks())).max())
    picked = {}
    for limit in (peak, peak * 19 // 20):
        command = [sys.executable, str(BENCH / "torch_train.py"), "child", "--model", "gpt2"]
        command += ["--mode", "plain", "--batch", "4", "--steps", "2", "--warmup", "1"]
        command += ["--tiny", "--device", "cpu", "--recompute", str(limit)]
        command += ["--bandwidth", "1e-6"]  # copies hopeless: only recomputation can fit it
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.splitlines()[-1])
        assert "error" not in result and result["step_ms"] > 0, result
        picked[limit] = result["recompute"]
    assert picked[peak] == {"blocks": [], "of": 2, "predicted_overhead": 0.0}
    tight = picked[peak * 19 // 20]
    assert tight["blocks"] and set(tight["blocks"]) <= {"blocks.0", "blocks.1"}
    assert tight["predicted_overhead"] > 0


def test_a_bf16_child_plans_its_recomputation_in_bf16() -> None:
    """The plan of a bf16 run is recorded under autocast: nothing to recompute at a limit
    between the bf16 step's peak and the fp32 step's."""
    import torch
    from tidalpool.torch import plan_recompute
    from torch_train import LOOP, build

    model, make_batch, blocks = build("gpt2", True)
    peaks = {}
    for autocast in (None, torch.bfloat16):
        plan = plan_recompute(
            model,
            make_batch(4),
            torch.nn.functional.cross_entropy,
            lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4),
            blocks,
            limit=1 << 40,
            autocast=autocast,
            **LOOP,
        )
        peaks[autocast] = plan.candidates[0].peak_bytes
    limit = (peaks[None] + peaks[torch.bfloat16]) // 2
    assert peaks[torch.bfloat16] < limit < peaks[None]
    command = [sys.executable, str(BENCH / "torch_train.py"), "child", "--model", "gpt2"]
    command += ["--mode", "plain", "--dtype", "bf16", "--batch", "4", "--steps", "1"]
    command += ["--warmup", "1", "--tiny", "--device", "cpu", "--recompute", str(limit)]
    command += ["--bandwidth", "1e-6"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert "error" not in result, result
    assert result["recompute"]["blocks"] == []
