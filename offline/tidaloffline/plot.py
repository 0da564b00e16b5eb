"""Pictures of placements (SmartPool's Fig. 3) and of swap policies (AutoSwap's Figs. 8, 9).

matplotlib is imported only here and only when a picture is asked for (the
`dev` extra installs it); without it, drawing raises MatplotlibMissing. Each
picture is a `Figure` made by a function of its own (`placement_figure`,
`swaps_figure`), so that what it shows can be checked on the figure's objects;
`plot` and `plot_swaps` write it as a PNG.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tidalcore.units import format_size
from tidalplan.model import Placement, Problem

from tidaloffline.outputs import plural

ANNOTATED = 5  # the largest blocks a placement picture names
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h", "p", "d", "8")
LINESTYLES = ("-", "--", "-.", ":")


class MatplotlibMissing(ImportError):
    """Drawing was asked for and matplotlib is not installed."""


def _matplotlib(path: str | Path) -> tuple[Any, Any, Any]:
    """(FigureCanvasAgg, PolyCollection, Figure), or MatplotlibMissing naming `path`."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.collections import PolyCollection
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MatplotlibMissing(
            f"drawing {path} needs matplotlib, which is not installed"
            " (pip install matplotlib, or the dev extra)"
        ) from e
    return FigureCanvasAgg, PolyCollection, Figure


def _legend_outside(axes: Any, fontsize: str = "small") -> Any:
    """The legend right of the axes, over none of the curves (constrained layout makes room)."""
    return axes.legend(
        loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=fontsize
    )


def largest(problem: Problem, n: int) -> list[int]:
    """Indices of the `n` largest buffers: most bytes first, then the longest lived, then by
    position."""
    order = sorted(
        range(len(problem.buffers)),
        key=lambda i: (
            -problem.buffers[i].size,
            -(problem.buffers[i].upper - problem.buffers[i].lower),
            i,
        ),
    )
    return order[: max(n, 0)]


def placement_figure(
    problem: Problem,
    placement: Placement,
    title: str = "",
    names: Sequence[str] | None = None,
    annotate: int = ANNOTATED,
    path: str | Path = "the picture",
) -> Any:
    """The placement as a figure: buffers as rectangles, the height as a dashed line (and
    the lower bound, when `placement.stats` has it and the height is above, as a dotted one),
    the `annotate` largest buffers named on their rectangles, one line each ("block 12,
    98 MiB": `names`, parallel to the buffers, by default "buffer ID", and the size)."""
    FigureCanvasAgg, PolyCollection, Figure = _matplotlib(path)
    if len(placement.offsets) != len(problem.buffers):
        raise ValueError(
            f"{len(placement.offsets)} offsets for {len(problem.buffers)} buffers: nothing to draw"
        )
    if names is not None and len(names) != len(problem.buffers):
        raise ValueError(f"{len(names)} names for {len(problem.buffers)} buffers")
    mib = 1024.0 * 1024.0
    scale, unit = (mib, "MiB") if placement.height >= 16 * mib else (1.0, "bytes")
    rectangles = []
    for b, offset in zip(problem.buffers, placement.offsets, strict=True):
        bottom, top = offset / scale, (offset + b.size) / scale
        rectangles.append(((b.lower, bottom), (b.upper, bottom), (b.upper, top), (b.lower, top)))
    figure = Figure(figsize=(11, 5), dpi=120, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    colours = [(b.id * 0.618034) % 1.0 for b in problem.buffers]  # neighbours differ in hue
    collection = PolyCollection(
        rectangles,
        array=colours,
        cmap="tab20",
        edgecolors="black",
        linewidths=0.2 if len(rectangles) <= 5000 else 0.0,
    )
    axes.add_collection(collection)
    if problem.buffers:
        first = min(b.lower for b in problem.buffers)
        last = max(b.upper for b in problem.buffers)
        axes.set_xlim(first, last)
    axes.set_ylim(0, max(placement.height / scale, 1e-9) * 1.05)
    for i in largest(problem, annotate):
        b, offset = problem.buffers[i], placement.offsets[i]
        name = names[i] if names is not None else f"buffer {b.id}"
        axes.text(
            (b.lower + b.upper) / 2,
            (offset + b.size / 2) / scale,
            f"{name}, {format_size(b.size)}",
            ha="center",
            va="center",
            fontsize=7,
            clip_on=True,
            zorder=5,
            bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "alpha": 0.8, "lw": 0},
        )
    axes.axhline(
        placement.height / scale, color="black", linestyle="--", linewidth=0.8, label="height"
    )
    bound = placement.stats.get("lower_bound")
    if bound is not None and bound < placement.height:
        axes.axhline(bound / scale, color="red", linestyle=":", linewidth=0.8, label="lower bound")
    _legend_outside(axes)
    axes.set_xlabel("tick")
    axes.set_ylabel(f"address ({unit})")
    axes.set_title(title or f"{plural(len(problem.buffers), 'buffer')}, {placement.solver}")
    return figure


def plot(
    problem: Problem,
    placement: Placement,
    path: str | Path,
    title: str = "",
    names: Sequence[str] | None = None,
    annotate: int = ANNOTATED,
) -> None:
    """Write a PNG of the placement (`placement_figure`)."""
    figure = placement_figure(problem, placement, title, names, annotate, path)
    figure.savefig(str(path), format="png")


def style(k: int) -> dict[str, Any]:
    """The look of the k-th policy's curve: its own colour, marker and line style; later
    curves are drawn above earlier ones, thinner and with smaller hollow markers, so that
    a curve on top of another leaves the one below visible around it."""
    from matplotlib import colormaps

    return {
        "color": colormaps["tab20"](2 * (k % 10) + (k // 10) % 2),  # the dark ten, then the light
        "marker": MARKERS[k % len(MARKERS)],
        "linestyle": LINESTYLES[k % len(LINESTYLES)],
        "markersize": max(3.0, 10.0 - 0.6 * k),
        "markerfacecolor": "none",
        "linewidth": max(0.8, 2.4 - 0.12 * k),
        "zorder": 3 + k,
    }


def missing_matplotlib(path: str | Path) -> str | None:
    """Why `--plot path` cannot draw (matplotlib is not installed), or None when it can."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (
            f"--plot {path}: drawing needs matplotlib, which is not installed"
            " (pip install matplotlib, or the dev extra)"
        )
    return None


def swaps_figure(
    name: str,
    sweep: Mapping[str, Sequence[tuple[float, float]]],
    memory: Mapping[str, Sequence[tuple[int, int]]],
    unconstrained: Sequence[tuple[int, int]],
    limit: int,
    peak: int,
    path: str | Path = "the picture",
) -> Any:
    """Swap policies as a figure titled `name` (the trace's): device bytes over time under
    each policy's plan at `limit` next to the unconstrained curve (AutoSwap's Fig. 8), and,
    when `sweep` has points, overhead against the limit (a fraction of `peak`) per policy
    (Figs. 9 and 11), from 0% up on a scale linear to 1% and logarithmic above."""
    FigureCanvasAgg, _, Figure = _matplotlib(path)
    panels = 2 if any(sweep.values()) else 1
    figure = Figure(figsize=(11, 4.5 * panels), dpi=120, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(name)
    names = list(dict.fromkeys([*sweep, *memory]))  # one style per policy in both panels
    gib = float(1 << 30)
    axes = figure.add_subplot(panels, 1, 1)
    if unconstrained:
        t, b = zip(*unconstrained, strict=True)
        axes.step(
            [x / 1e6 for x in t],
            [y / gib for y in b],
            where="post",
            color="black",
            linewidth=1.6,
            label="no limit",
            zorder=2,
        )
    for policy, curve in memory.items():
        if curve:
            t, b = zip(*curve, strict=True)
            look = style(names.index(policy))
            axes.step(
                [x / 1e6 for x in t],
                [y / gib for y in b],
                where="post",
                color=look["color"],
                linestyle=look["linestyle"],
                linewidth=look["linewidth"],
                zorder=look["zorder"],
                label=policy,
            )
    axes.axhline(limit / gib, color="red", linestyle=":", linewidth=1.0, label="limit", zorder=1)
    axes.set_xlabel("time (ms)")
    axes.set_ylabel("device memory (GiB)")
    share = f" ({limit / peak:.0%} of the peak {format_size(peak)})" if peak else ""
    axes.set_title(f"device memory under each plan at a limit of {format_size(limit)}{share}")
    _legend_outside(axes, "x-small")
    if panels == 2:
        axes = figure.add_subplot(2, 1, 2)
        highest = 0.0
        for policy, points in sweep.items():
            if points:
                x, y = zip(*points, strict=True)
                axes.plot(
                    [100 * v for v in x],
                    [100 * v for v in y],
                    label=policy,
                    **style(names.index(policy)),
                )
                highest = max(highest, *(100 * v for v in y))
        axes.set_xlabel("limit (% of the unconstrained peak)")
        axes.set_ylabel("overhead (%)")
        axes.invert_xaxis()
        axes.set_yscale("symlog", linthresh=1.0, linscale=0.5)
        axes.set_ylim(0.0, max(highest * 1.5, 2.0))  # no negative overheads: none below 0
        axes.set_title("overhead against the limit (feasible placed plans)")
        _legend_outside(axes, "x-small")
    return figure


def plot_swaps(
    path: str | Path,
    name: str,
    sweep: Mapping[str, Sequence[tuple[float, float]]],
    memory: Mapping[str, Sequence[tuple[int, int]]],
    unconstrained: Sequence[tuple[int, int]],
    limit: int,
    peak: int,
) -> None:
    """Write a PNG of swap policies (`swaps_figure`)."""
    figure = swaps_figure(name, sweep, memory, unconstrained, limit, peak, path)
    figure.savefig(str(path), format="png")
