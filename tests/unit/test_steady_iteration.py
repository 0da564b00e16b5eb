"""Which iteration of a finished trace is the steady one: the last that the next repeats, else
the last; one marked iteration is refused. `tidalpool plan` says which it took, and `record`
refuses to write a trace with too few iterations before it runs anything."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import pytest
from tidalcore.events import Events
from tidaloffline import plan_command
from tidalplan.learn import Chosen, NoIteration, extract, extract_finished
from tidalplan.model import IterBlock

from tests.unit.test_learn import STEADY, Stream, training
from tests.unit.test_plan_cli import ITERATION, parse


def test_of_three_iterations_the_second_is_taken_as_the_third_repeats_it() -> None:
    chosen = extract_finished(training(3).events())
    assert chosen == Chosen(STEADY, 3, "iteration 2 repeats it")
    assert str(chosen) == "iteration 1 of 3 (iteration 2 repeats it)"


def test_of_many_equal_iterations_the_last_one_followed_by_a_repeat_is_taken() -> None:
    events = training(6).events()
    chosen = extract_finished(events)
    assert (chosen.iteration.index, chosen.marked) == (4, 6)
    assert chosen.iteration == extract(events, events.marks())  # as the live stream's choice


def test_of_two_iterations_the_last_is_taken_not_the_first() -> None:
    events = training(2).events()
    assert extract(events, events.marks()).index == 0  # between the two marks: the first
    chosen = extract_finished(events)
    # The steady iteration, but its gradient (21) is never freed in the file: it counts as
    # live until the next iteration allocates it again (tick 4 + 8), one instance at a time.
    blocks = (STEADY.blocks[0], IterBlock(id=21, size=20, start=4, end=12, crosses=True))
    assert chosen.iteration == replace(STEADY, blocks=blocks)
    assert str(chosen) == (
        "iteration 1 of 2 (the last: none repeats the one before it, so what it leaves alive"
        " counts as live until the next allocates it again)"
    )


def test_when_none_repeats_the_last_is_taken() -> None:
    stream = training(2)
    stream.iter(2).op("eval", 10).alloc(30, 40).op("fwd", 100).free(30)  # unlike iteration 1
    chosen = extract_finished(stream.events())
    assert (chosen.iteration.index, chosen.marked) == (2, 3)
    assert [b.id for b in chosen.iteration.blocks] == [30]
    assert [op.name for op in chosen.iteration.ops] == ["eval", "fwd"]


def test_one_marked_iteration_is_refused_saying_how_many_are_needed() -> None:
    with pytest.raises(NoIteration) as refused:
        extract_finished(training(1).events())
    assert str(refused.value) == (
        "the trace marks 1 iteration, and the first iteration of training is not the steady"
        " one (it allocates what the next ones keep: gradients, optimizer state): record at"
        " least 3, the first, the steady one and one that repeats it"
    )


def test_without_marks_the_repeats_find_it() -> None:
    events = training(3, marks=False).events()
    chosen = extract_finished(events)
    assert chosen == Chosen(
        extract(events), 0, "found by its repeats: the trace marks no iterations"
    )
    assert str(chosen) == "iteration 1 (found by its repeats: the trace marks no iterations)"


def test_marks_around_nothing_are_refused() -> None:
    events: Events = Stream().alloc(1, 8).iter(0).read(1).iter(1).read(1).events()
    with pytest.raises(NoIteration, match=r"events \[1, 3\) hold no alloc, free or op"):
        extract_finished(events)


def test_a_mark_at_the_end_begins_no_iteration() -> None:
    chosen = extract_finished(training(3).iter(3).read(22).events())
    assert chosen == Chosen(STEADY, 3, "iteration 2 repeats it")
    with pytest.raises(NoIteration, match="the trace marks 1 iteration"):
        extract_finished(training(1).iter(1).events())


# -- tidalpool plan --------------------------------------------------------------------------------


def plan(path: Path) -> tuple[int, list[str], str]:
    out, err = io.StringIO(), io.StringIO()
    status = plan_command.run(parse(str(path)), out=out, err=err)
    return status, out.getvalue().splitlines(), err.getvalue()


def test_plan_of_two_iterations_places_the_second_and_says_so(tmp_path: Path) -> None:
    # The first iteration allocates an optimizer state (block 5) the second keeps: it differs.
    trace = tmp_path / "two.trace.csv"
    trace.write_text(
        "kind,id,size,ns,name\nalloc,1,4096,,\niter,0,,,\nalloc,5,8192,,\n"
        + ITERATION.format(a=2, b=3, c=4)
        + "iter,1,,,\n"
        + ITERATION.format(a=12, b=13, c=14)
    )
    status, lines, err = plan(trace)
    assert (status, err) == (0, "")
    assert lines[:4] == [
        f"input: {trace} (trace CSV, iteration 1: 3 buffers, alignment 256)",
        "steady: iteration 1 of 2 (the last: none repeats the one before it, so what it leaves"
        " alive counts as live until the next allocates it again)",
        "lower bound: 2560 B (2.5 KiB): the arena, the iteration's blocks at their most",
        "persistent: 12288 B (12 KiB): 2 blocks kept across iterations, outside the arena",
    ]


def test_plan_of_one_iteration_exits_2_saying_how_many_are_needed(tmp_path: Path) -> None:
    trace = tmp_path / "one.trace.csv"
    trace.write_text("kind,id,size,ns,name\niter,0,,,\n" + ITERATION.format(a=2, b=3, c=4))
    assert plan(trace) == (
        2,
        [],
        f"tidalpool plan: {trace}: the trace marks 1 iteration, and the first iteration of"
        " training is not the steady one (it allocates what the next ones keep: gradients,"
        " optimizer state): record at least 3, the first, the steady one and one that repeats"
        " it\n",
    )


# -- record ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("iterations", [1, 2])
def test_record_refuses_too_few_iterations_before_anything_runs(
    tmp_path: Path, iterations: int
) -> None:
    torch = pytest.importorskip("torch")
    from tidalpool.torch import record

    model = torch.nn.Linear(4, 2)
    path = tmp_path / "t.csv"

    def unusable(_model: object) -> object:
        raise AssertionError("the optimizer is built after the iterations are checked")

    with pytest.raises(ValueError) as refused:
        record(
            model,
            (torch.ones(3, 4), torch.ones(3, 2)),
            torch.nn.MSELoss(),
            unusable,  # type: ignore[arg-type]
            iterations,
            path=path,
        )
    assert str(refused.value) == (
        f"record: iterations must be at least 3, got {iterations}: the first allocates what"
        " later ones keep (gradients, optimizer state), the second is the steady one tidalpool"
        " plan and simulate take, and the third repeats it, showing when what the second"
        " leaves alive is freed"
    )
    assert not path.exists()


def test_a_trace_none_repeats_gets_the_same_peak_from_plan_and_simulate(tmp_path: Path) -> None:
    """The MLP sample cut after its second iteration: what the last iteration leaves alive
    lives one iteration, as one instance (before, until the end of the next, so the simulator
    counted two instances of each and the placement one), and `plan` names the peak
    `simulate` reports where its bound is over it."""
    from tidalcore.units import format_size
    from tidaloffline.formats import read_trace_csv
    from tidalplan.learn import live_bytes

    root = Path(__file__).resolve().parents[2]
    lines = (root / "traces" / "mlp.b64.trace.csv").read_text().splitlines()
    cut = tmp_path / "mlp2.trace.csv"
    cut.write_text("\n".join(lines[: lines.index("iter,2,,,")]) + "\n")
    it = extract_finished(read_trace_csv(cut)).iteration
    assert all(b.end - b.start <= it.ticks for b in it.blocks)
    never_freed = [b for b in it.blocks if b.end == b.start + it.ticks]
    assert len(never_freed) == 6
    peak = int(live_bytes(it).max()) + sum(size for _, size in it.persistent)
    status, printed, _ = plan(cut)
    assert status == 0
    (said,) = [line for line in printed if line.startswith("lower bound + persistent:")]
    assert f"the {format_size(peak)} peak tidalpool simulate reports" in said, said
