"""Iteration shapes: the daemon's counts of a session's shapes (bounded, least recent
forgotten), the iteration it plans for each shape, the recorder's marks, and an executor
leaving a plan for an iteration of a shape without one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from tidalclient.executors.python import PythonExecutor
from tidalclient.plans import Plan, PlanTable
from tidalclient.recorder import Recorder
from tidalcore.errors import InvalidArgument
from tidalcore.events import ALLOC, FREE, ITER, OP, Events
from tidalcore.units import Bytes, Tick
from tidalcore.v1 import pool_pb2
from tidaloffline.formats import read_trace_csv, write_trace_csv
from tidalplan import learn
from tidalplan.gap_cover import gaps
from tidalplan.learn import NoIteration, extract, extract_shape
from tidalplan.model import Access, Iteration, IterBlock, Op, Swap, SwapPlan
from tidalplan.simulate import simulate
from tidalplan.validate import InvalidSwapPlan, validate_swaps
from tidalpoold.trace import TraceStore


def mark(store: TraceStore, n: int, shape: str) -> tuple[str | None, list[str]]:
    return store.step(pool_pb2.StepMark(iteration=n, shape=shape))


def test_the_store_counts_each_shapes_marks_and_whole_iterations() -> None:
    store = TraceStore(1000)
    assert mark(store, 1, "a") == (None, [])
    assert mark(store, 2, "b") == ("a", [])
    assert mark(store, 3, "a") == ("b", [])
    a, b = store.shape_counts("a"), store.shape_counts("b")
    assert a is not None and (a.marks, a.whole) == (2, 1)
    assert b is not None and (b.marks, b.whole) == (1, 1)
    assert store.shape_counts("c") is None
    assert store.iterations_seen == 3


def test_a_shape_past_the_bound_forgets_the_least_recently_stepped() -> None:
    store = TraceStore(1000, max_shapes=2)
    for n, shape in enumerate(["a", "b", "a"], 1):
        mark(store, n, shape)
    assert mark(store, 4, "c") == ("a", ["b"])  # a was stepped into after b
    assert store.shape_counts("b") is None
    assert mark(store, 5, "b") == ("c", ["a"])
    b = store.shape_counts("b")
    assert b is not None and (b.marks, b.whole) == (1, 0)  # counted afresh


def test_a_shape_too_long_is_refused_and_nothing_is_counted() -> None:
    store = TraceStore(1000)
    with pytest.raises(InvalidArgument, match="step mark's shape is 129 bytes, longer than 128"):
        mark(store, 1, "x" * 129)
    assert store.iterations_seen == 0
    assert store.shapes.counts == {}


class Stream:
    """Events as a session sends them: iteration marks named by their shape."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int, int, int]] = []
        self.names: dict[str, int] = {}
        self.next_id = 1
        self.iterations = 0

    def name(self, text: str) -> int:
        return self.names.setdefault(text, len(self.names) + 1)

    def iteration(self, shape: str, size: int) -> Stream:
        """A mark, then one block of `size` bytes around one op."""
        self.rows.append((ITER, self.iterations, 0, 0, self.name(shape) if shape else 0))
        self.iterations += 1
        block, self.next_id = self.next_id, self.next_id + 1
        self.rows.append((ALLOC, block, size, 0, 0))
        self.rows.append((OP, 0, 0, 1000, self.name("op")))
        self.rows.append((FREE, block, 0, 0, 0))
        return self

    def events(self) -> Events:
        columns = list(zip(*self.rows, strict=True))
        return Events(*columns, names={v: k for k, v in self.names.items()})


def test_each_shape_is_planned_from_its_last_whole_iteration() -> None:
    s = Stream()
    for size in (64, 128, 96, 64, 128, 96, 64):
        s.iteration(str(size), size)
    events = s.events()
    for size in (64, 128, 96):
        it = extract_shape(events, str(size))
        assert [b.size for b in it.blocks] == [size]
    # The last 64 has not ended: the one before it is taken.
    assert extract_shape(events, "64").index == 3
    with pytest.raises(NoIteration, match="no whole iteration of shape '32'"):
        extract_shape(events, "32")


def test_a_session_of_one_shape_is_planned_as_ever() -> None:
    s = Stream()
    for _ in range(4):
        s.iteration("", 64)
    events = s.events()
    assert extract_shape(events, "") == extract(events, events.marks())


def test_the_recorder_names_each_mark_with_the_shape_expected_for_it() -> None:
    sent: list[pool_pb2.ClientMessage] = []
    recorder = Recorder(sent.append, period_s=60)
    try:
        recorder.expect("train")
        recorder.expect("eval")
        for n in (1, 2, 3):  # the third was expected with no shape
            recorder.step(n)
        recorder.flush()
    finally:
        recorder.close()
    marks = [m.step for m in sent if m.WhichOneof("body") == "step"]
    assert [(m.iteration, m.shape) for m in marks] == [(1, "train"), (2, "eval"), (3, "")]
    (chunk,) = [m.trace for m in sent if m.WhichOneof("body") == "trace"]
    assert [chunk.new_names.get(i, "") for i in chunk.name_ids] == ["train", "eval", ""]


def plan(plan_id: int, sizes: list[int]) -> Plan:
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += size
    return Plan(PlanTable.build(plan_id, sizes, offsets, at, 256))


def test_an_executor_leaves_its_plan_for_an_unplanned_shape_and_takes_it_up_again() -> None:
    ex = PythonExecutor(1 << 20)
    a = plan(1, [1024, 2048])
    ex.install_plan(a)
    ex.step()
    x, y = ex.malloc(1024), ex.malloc(2048)
    assert ex.mode == "planned"
    base = x.offset
    ex.free(x)
    ex.free(y)
    ex.install_plan(None)  # the next iteration's shape has no plan
    ex.step()
    z = ex.malloc(4096)
    assert ex.mode == "learning"
    ex.free(z)
    ex.install_plan(a)  # back to the first shape
    ex.step()
    x = ex.malloc(1024)
    assert ex.mode == "planned" and x.offset == base
    stats = ex.stats()
    assert (stats.plan_hits, stats.plan_misses) == (3, 0)


def test_an_executor_switches_plans_before_an_iterations_first_allocation_only() -> None:
    """`switch_plan`: the iteration just begun runs another plan (or none) from its first
    allocation, as if installed before its step; once it has allocated, RuntimeError."""
    ex = PythonExecutor(1 << 20)
    a, b = plan(1, [1024, 2048]), plan(2, [4096])
    ex.install_plan(a)
    ex.step()
    ex.switch_plan(b)  # the iteration turns out to be b's
    x = ex.malloc(4096)
    assert ex.mode == "planned" and ex.plan_table is b.table
    with pytest.raises(RuntimeError, match="allocated already"):
        ex.switch_plan(a)
    ex.free(x)
    ex.step()  # b goes on
    ex.switch_plan(None)  # a shape with no plan: online from its first allocation
    y = ex.malloc(512)
    assert ex.mode == "learning"
    ex.free(y)
    ex.step()
    ex.switch_plan(a)
    x, y = ex.malloc(1024), ex.malloc(2048)
    assert ex.mode == "planned" and ex.plan_table is a.table
    stats = ex.stats()
    assert (stats.plan_hits, stats.plan_misses) == (3, 0)


# -- offline: traces of several shapes --------------------------------------------------------
def test_a_trace_file_keeps_each_iterations_shape(tmp_path: Path) -> None:
    s = Stream()
    for size in (64, 128, 64):
        s.iteration(str(size), size)
    path = tmp_path / "shapes.trace.csv"
    write_trace_csv(path, s.events())
    assert "iter,1,,,128\n" in path.read_text()
    back = read_trace_csv(path)
    assert learn.shapes(back) == ["64", "128"]


def test_a_recording_of_several_batches_names_each_iteration_by_its_shape(
    tmp_path: Path,
) -> None:
    torch = pytest.importorskip("torch")
    from tidaloffline.torch.record import record

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def batch(n: int) -> tuple[object, object]:
        return torch.randn(n, 16), torch.randint(0, 4, (n,))

    def sgd(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.1)

    path = tmp_path / "mlp.trace.csv"
    loss = torch.nn.functional.cross_entropy
    events = record(model, batch(8), loss, sgd, path=path, batches=[batch(3)])
    marks = events.marks()
    assert [events.names[int(events.name_ids[m])] for m in marks] == ["8x16", "3x16"] * 3
    for shape, rows in (("8x16", 8), ("3x16", 3)):
        chosen = learn.extract_finished(events, shape)
        assert chosen.iteration.index in (2, 3, 4, 5)
        assert f"of shape {shape!r}" in chosen.why
        # the input's upload is the iteration's first allocation: rows × 16 floats, rounded
        assert chosen.iteration.blocks[0].size == 512 * -(-rows * 16 * 4 // 512)
    with pytest.raises(ValueError, match=r"2 iteration shapes \('8x16', '3x16'\): name"):
        learn.extract_finished(events)
    with pytest.raises(ValueError, match="no iteration of shape '5x16'"):
        learn.extract_finished(events, "5x16")
    with pytest.raises(ValueError, match="two example batches have the same shape"):
        record(model, batch(8), loss, sgd, path=path, batches=[batch(8)])


# -- plans of several shapes keep the persistent blocks on the device at the boundary -----------
def weights_used_twice() -> Iteration:
    """A 1 MiB weight (persistent, id 100) read by the first and the last of five ops, a
    transient block of 64 KiB between: the weight's longest gap is across the boundary."""
    ops = tuple(Op(Tick(k), f"op{k}", 1_000_000) for k in range(5))
    return Iteration(
        ticks=5,
        blocks=(IterBlock(1, Bytes(65536), Tick(1), Tick(4)),),
        ops=ops,
        accesses=(
            Access(Tick(0), 100, False),
            Access(Tick(2), 1, True),
            Access(Tick(4), 100, False),
        ),
        persistent=((100, Bytes(1 << 20)),),
    )


def test_an_iteration_closed_at_its_boundary_offers_no_swap_across_it() -> None:
    it = weights_used_twice()
    closed = dataclasses.replace(it, boundary_swaps=False)
    assert [(g.a, g.c) for g in gaps(it, 12.0, 12.0) if g.persistent] == [(0, 4), (4, 0)]
    assert [(g.a, g.c) for g in gaps(closed, 12.0, 12.0) if g.persistent] == [(0, 4)]
    assert learn.signature(closed) != learn.signature(it)
    across = SwapPlan((Swap(0, Tick(4), Tick(0), persistent=True),))
    validate_swaps(it, across, simulate(it, across, None, 1.0, 1.0), None, 1.0)
    with pytest.raises(InvalidSwapPlan, match="away across the boundary of an iteration"):
        validate_swaps(closed, across, simulate(closed, across, None, 1.0, 1.0), None, 1.0)


# -- offline: plan and simulate each shape of a trace -------------------------------------------
def test_simulate_takes_each_shape_at_one_limit_of_the_largest_peak(
    shapes_trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tidalpool.cli import main

    argv = ["simulate", str(shapes_trace), "--limit", "0.8", "--policy", "autoswap-doa"]
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    shapes = {s["shape"]: s for s in got["shapes"]}
    assert list(shapes) == ["512x256", "128x256"]
    largest = max(s["unconstrained_peak_bytes"] for s in shapes.values())
    assert shapes["512x256"]["unconstrained_peak_bytes"] == largest
    assert shapes["128x256"]["unconstrained_peak_bytes"] < largest
    for s in shapes.values():  # the session's one limit, for every shape
        assert s["limit_bytes"] == got["limit_bytes"] == int(0.8 * largest)
        assert [p["name"] for p in s["policies"]] == ["autoswap-doa"]
    # The same as each shape alone.
    assert main([*argv, "--shape", "128x256", "--limit", str(got["limit_bytes"]), "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["policies"] == shapes["128x256"]["policies"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "shape '512x256' (1 of 2)" in text and "shape '128x256' (2 of 2)" in text
    assert main([*argv, "--plot", "x.png"]) == 2
    assert "--plot shows one iteration shape" in capsys.readouterr().err


def test_plan_places_each_shape(shapes_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tidalpool.cli import main

    assert main(["plan", str(shapes_trace), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    heights = {s["shape"]: s["height_bytes"] for s in got["shapes"]}
    assert list(heights) == ["512x256", "128x256"]
    assert heights["128x256"] < heights["512x256"]  # a smaller batch, a smaller arena
    assert main(["plan", str(shapes_trace), "--shape", "128x256", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["height_bytes"] == heights["128x256"]
    assert main(["plan", str(shapes_trace), "--out", "x.csv"]) == 2
    assert "pick one with --shape" in capsys.readouterr().err


def test_buckets_cost_each_choice_padding_shapes_to_larger_ones(
    shapes_trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tidalpool.cli import main

    assert main(["simulate", str(shapes_trace), "--buckets", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    shapes = got["shapes"]
    assert list(shapes) == ["128x256", "512x256"]  # smallest first, by peak
    small, large = (shapes[s]["step_ns"] for s in shapes)
    assert 0 < small < large
    assert [s["iterations"] for s in shapes.values()] == [3, 3]  # how often the trace runs each
    one, two = got["choices"]
    assert (one["buckets"], one["padded"], one["plans"]) == (["512x256"], ["128x256"], 1)
    assert one["mean_step_ns"] == large  # the small batch padded: every step the large one's
    assert (two["buckets"], two["padded"], two["plans"]) == (["128x256", "512x256"], [], 2)
    assert two["mean_step_ns"] == (small + large) / 2
    assert one["over_every_shape_its_own"] == pytest.approx(2 * large / (small + large))
    assert main(["simulate", str(shapes_trace), "--buckets"]) == 0
    assert "the fastest buckets for each number of plans" in capsys.readouterr().out
    # Under a limit, each bucket runs the daemon's plan: no faster than with no limit.
    limited = ["simulate", str(shapes_trace), "--buckets", "--limit", "0.8", "--page", "64KiB"]
    assert main([*limited, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["limit_bytes"] == int(0.8 * shapes["512x256"]["peak_bytes"])
    assert got["shapes"]["128x256"]["step_ns"] >= small
    assert got["shapes"]["512x256"]["step_ns"] >= large
    assert all(c["feasible"] for c in got["choices"])
    argv = ["simulate", str(shapes_trace), "--buckets", "--shape", "128x256"]
    assert main(argv) == 2
    assert "--buckets compares the shapes of a trace of several" in capsys.readouterr().err
