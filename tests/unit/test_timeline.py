"""`tidalpool simulate --timeline`: the simulated step in the Chrome trace event format, its
tracks agreeing with the plan and the simulator (ops in order, copies as the plan's swaps,
the memory counter's highest value the simulated peak)."""

from __future__ import annotations

import functools
import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from tidaloffline.simulate_command import evaluate, load
from tidaloffline.timeline import COMPUTE, COUNTER, SWAP_IN, SWAP_OUT, document
from tidalplan.combined import Plan
from tidalplan.model import Iteration
from tidalpool.cli import main

from ..conftest import shared_file

GBPS = 12.0


@functools.cache
def _case() -> tuple[Iteration, list[tuple[str, Plan]]]:
    """vgg16 at 70% of its peak: AutoSwap swaps only, tidalpool swaps and recomputes."""
    it = load(shared_file("traces/models/vgg16.b32.trace.csv"))
    peak = sum(int(s) for _, s in it.persistent) + max(
        sum(int(b.size) for b in it.blocks if b.start <= t < b.end) for t in range(it.ticks)
    )
    rows = evaluate(it, ["autoswap-doa", "tidalpool"], int(0.7 * peak), GBPS, GBPS, 1.0)
    plans = [(r.name, r.plan) for r in rows if r.of is None]
    assert all(p.fits for _, p in plans)
    return it, plans


def _ns(us: float) -> int:
    return round(us * 1000)


def _by_track(events: list[dict[str, Any]]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append(e)
    return tracks


def test_the_document_is_json_with_the_fields_every_event_needs() -> None:
    it, plans = _case()
    doc = json.loads(json.dumps(document(it, plans, GBPS, GBPS)))
    assert doc["displayTimeUnit"] == "ns"
    events = doc["traceEvents"]
    required = {
        "X": {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"},
        "C": {"name", "ph", "ts", "pid", "args"},
        "M": {"name", "ph", "pid", "tid", "args"},
    }
    assert {e["ph"] for e in events} == set(required)
    for e in events:
        assert required[e["ph"]] <= e.keys(), e
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0
    names = {
        (e["pid"], e["tid"], e["name"]): e["args"]
        for e in events
        if e["ph"] == "M" and e["name"] in ("process_name", "thread_name")
    }
    for pid, (policy, _) in enumerate(plans, start=1):
        assert names[(pid, 0, "process_name")] == {"name": policy}
        assert names[(pid, COMPUTE, "thread_name")] == {"name": "compute"}
        assert names[(pid, SWAP_OUT, "thread_name")] == {"name": "swap-out"}
        assert names[(pid, SWAP_IN, "thread_name")] == {"name": "swap-in"}


def test_ops_run_in_order_without_overlap_and_the_rebuilds_between_them() -> None:
    it, plans = _case()
    tracks = _by_track(document(it, plans, GBPS, GBPS)["traceEvents"])
    for pid, (_, plan) in enumerate(plans, start=1):
        compute = tracks[(pid, COMPUTE)]
        ops = [e for e in compute if e["cat"] == "op"]
        assert [e["args"]["tick"] for e in ops] == [int(op.tick) for op in it.ops]
        assert [e["name"] for e in ops] == [op.name for op in it.ops]
        spans = sorted((_ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])) for e in compute)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start
        rebuilds = [e for e in compute if e["cat"] == "recompute"]
        assert sum(len(e["args"]["blocks"]) for e in rebuilds) == len(plan.schedule.recomputes)
        assert sum(e["args"]["bytes"] for e in rebuilds) == plan.result.recomputed_bytes
        assert sum(_ns(e["dur"]) for e in rebuilds) == plan.result.recompute_ns
    assert any(p.schedule.recomputes for _, p in plans)  # the case has rebuilds to show


def test_copies_are_the_plans_swaps_one_engine_each_way_in_time() -> None:
    it, plans = _case()
    tracks = _by_track(document(it, plans, GBPS, GBPS)["traceEvents"])
    for pid, (_, plan) in enumerate(plans, start=1):
        swaps, result = plan.schedule.swaps, plan.result
        for tid, moved in ((SWAP_OUT, result.out_bytes), (SWAP_IN, result.in_bytes)):
            copies = tracks[(pid, tid)]
            assert len(copies) == len(swaps) > 0
            assert sum(e["args"]["bytes"] for e in copies) == moved
            spans = sorted((_ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])) for e in copies)
            for (_, end), (start, _) in itertools.pairwise(spans):
                assert end <= start  # each engine copies one block at a time
        # Every swap-in ends before the op that needs its block starts.
        for e in tracks[(pid, SWAP_IN)]:
            need = e["args"]["in_before_tick"]
            assert _ns(e["ts"]) + _ns(e["dur"]) <= result.tick_ns[need]
            assert f"b{e['args']['block']} " in e["name"]


def test_the_memory_counter_peaks_at_the_simulated_peak() -> None:
    it, plans = _case()
    events = document(it, plans, GBPS, GBPS)["traceEvents"]
    for pid, (_, plan) in enumerate(plans, start=1):
        counter = [e for e in events if e["ph"] == "C" and e["pid"] == pid]
        assert {e["name"] for e in counter} == {COUNTER}
        assert max(e["args"]["resident"] for e in counter) == plan.result.peak_bytes
        times = [e["ts"] for e in counter]
        assert times == sorted(times)


def test_simulate_writes_the_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "step.json"
    trace = str(shared_file("traces/models/vgg16.b32.trace.csv"))
    argv = ["simulate", trace, "--limit", "0.7", "--policy", "vdnn-all,autoswap-doa"]
    assert main([*argv, "--timeline", str(path)]) == 0
    assert (
        f"timeline: {path} (1 feasible plan; open it in ui.perfetto.dev)" in capsys.readouterr().out
    )
    events = json.loads(path.read_text())["traceEvents"]
    processes = [e["args"]["name"] for e in events if e["name"] == "process_name"]
    assert len(processes) == 1 and processes[0].startswith("autoswap-doa: step ")
