"""The pictures, checked on matplotlib's objects: the overhead axis from 0 up, legends beside
the axes and over no curve, a curve on top of another leaves it visible, titles that name the
trace and the limit, and a placement that names its largest blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tidalcore.units import Bytes, Offset, Tick
from tidalplan.model import Buffer, Placement, Problem

pytest.importorskip("matplotlib")

from tidaloffline.plot import placement_figure, swaps_figure

GiB = 1 << 30
SWEEP = {
    "vdnn-all": [(1.0, 20.371), (0.9, 25.0)],
    "vdnn-dyn": [(1.0, 20.371), (0.9, 25.0)],  # the same points as vdnn-all
    "autoswap-doa": [(1.0, 0.0), (0.9, 5.908), (0.8, 21.49)],
    "tidalpool": [(1.0, 0.0), (0.9, 0.744), (0.8, 9.709)],
}
MEMORY = {
    "vdnn-all": [(0, 2 * GiB), (5_000_000, 3 * GiB), (9_000_000, GiB)],
    "vdnn-dyn": [(0, 2 * GiB), (5_000_000, 3 * GiB), (9_000_000, GiB)],
}
UNCONSTRAINED = [(0, 2 * GiB), (4_000_000, 4 * GiB), (8_000_000, GiB)]


def _figure() -> Any:
    figure = swaps_figure(
        "vgg16.b32.trace.csv", SWEEP, MEMORY, UNCONSTRAINED, int(3.2 * GiB), 4 * GiB
    )
    figure.canvas.draw()  # lays the figure out, as saving it does
    return figure


def test_the_overhead_axis_starts_at_zero_and_reaches_the_highest_point() -> None:
    _, overhead = _figure().axes
    low, high = overhead.get_ylim()
    assert low == 0.0
    assert high >= 2537.1  # 25.0 is 2500%
    assert overhead.get_yscale() == "symlog"
    assert overhead.get_xlim()[0] > overhead.get_xlim()[1]  # the limit falls to the right


def test_legends_are_beside_the_axes() -> None:
    figure = _figure()
    renderer = figure.canvas.get_renderer()
    for axes in figure.axes:
        legend = axes.get_legend()
        assert legend is not None
        box = legend.get_window_extent(renderer)
        assert box.x0 >= axes.get_window_extent(renderer).x1  # right of the axes, over nothing
        assert box.x1 <= figure.bbox.x1  # and inside the picture


def test_every_policy_has_its_own_look_and_a_curve_on_top_leaves_the_one_below_visible() -> None:
    overhead = _figure().axes[1]
    lines = {line.get_label(): line for line in overhead.get_lines()}
    assert sorted(lines) == sorted(SWEEP)
    looks = {
        (str(line.get_color()), line.get_marker(), line.get_linestyle()) for line in lines.values()
    }
    assert len(looks) == len(SWEEP)
    below, above = sorted((lines["vdnn-all"], lines["vdnn-dyn"]), key=lambda x: x.get_zorder())
    assert below.get_zorder() < above.get_zorder()
    assert above.get_markersize() < below.get_markersize()
    assert above.get_linewidth() < below.get_linewidth()
    assert above.get_markerfacecolor() == "none"  # hollow: the marker below shows through
    memory = _figure().axes[0]
    styles = {line.get_label(): line.get_linestyle() for line in memory.get_lines()}
    assert styles["vdnn-all"] != styles["vdnn-dyn"]


def test_titles_name_the_trace_and_the_limit() -> None:
    figure = _figure()
    assert figure.get_suptitle() == "vgg16.b32.trace.csv"
    memory, overhead = figure.axes
    assert memory.get_title() == (
        "device memory under each plan at a limit of 3.2 GiB (80% of the peak 4 GiB)"
    )
    assert overhead.get_title() == "overhead against the limit (feasible placed plans)"


def test_without_a_sweep_there_is_one_panel() -> None:
    figure = swaps_figure("t.csv", {}, MEMORY, UNCONSTRAINED, 3 * GiB, 4 * GiB)
    assert len(figure.axes) == 1


SIX = Problem(
    tuple(
        Buffer(i, Tick(lo), Tick(up), Bytes(s))
        for i, (lo, up, s) in enumerate(
            [(0, 2, 4), (1, 5, 2), (2, 6, 3), (4, 6, 1), (0, 1, 1), (3, 4, 2)]
        )
    )
)
SIX_PLACED = Placement(tuple(Offset(o) for o in (0, 4, 0, 3, 4, 6)), Bytes(8), "smartpool")


def test_a_placement_names_its_largest_blocks_on_their_rectangles() -> None:
    names = ("a", "b", "c", "d", "e", "f")
    axes = placement_figure(SIX, SIX_PLACED, "six", names, annotate=3).axes[0]
    got = [(t.get_text(), t.get_position()) for t in axes.texts]
    # 4, 3 and 2 bytes; of the two with 2, b lives longer (ticks 1 to 5) than f.
    assert got == [("a, 4 B", (1.0, 2.0)), ("c, 3 B", (4.0, 1.5)), ("b, 2 B", (3.0, 5.0))]
    assert list(placement_figure(SIX, SIX_PLACED, annotate=0).axes[0].texts) == []
    unnamed = placement_figure(SIX, SIX_PLACED, annotate=1).axes[0]
    assert [t.get_text() for t in unnamed.texts] == ["buffer 0, 4 B"]


def test_plan_plot_names_trace_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tidaloffline import plan_command, plot

    drawn: list[tuple[Any, ...]] = []
    monkeypatch.setattr(plot, "plot", lambda *args: drawn.append(args))
    trace = tmp_path / "tiny.trace.csv"
    trace.write_text(
        "kind,id,size,ns,name\nalloc,1,4096,,\n"
        + "".join(
            f"iter,{k},,,\nalloc,{10 * k + 2},1024,,\nop,0,,1000,aten.mm.default\n"
            f"free,{10 * k + 2},,,\n"
            for k in range(3)
        )
    )
    status = plan_command.main(
        ["plan", str(trace), "--plot", str(tmp_path / "p.png"), "--annotate", "2"]
    )
    assert status == 0
    ((_, _, _, title, names, annotate),) = drawn
    assert (names, annotate) == (("block 12",), 2)
    assert title == "tiny.trace.csv: canonical/length, height 1 KiB"
