"""A placement as a picture: one rectangle per buffer, tick across, address up (SmartPool's Fig. 3).

matplotlib is imported only here and only when a picture is asked for (the
`dev` extra installs it); without it, `plot` raises MatplotlibMissing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tidalplan.model import Placement, Problem


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


def plot(problem: Problem, placement: Placement, path: str | Path, title: str = "") -> None:
    """Write a PNG of the placement: buffers as rectangles, the height as a dashed line (and
    the lower bound, when `placement.stats` has it and the height is above, as a dotted one)."""
    FigureCanvasAgg, PolyCollection, Figure = _matplotlib(path)
    if len(placement.offsets) != len(problem.buffers):
        raise ValueError(
            f"{len(placement.offsets)} offsets for {len(problem.buffers)} buffers: nothing to draw"
        )
    mib = 1024.0 * 1024.0
    scale, unit = (mib, "MiB") if placement.height >= 16 * mib else (1.0, "bytes")
    rectangles = []
    for b, offset in zip(problem.buffers, placement.offsets, strict=True):
        bottom, top = offset / scale, (offset + b.size) / scale
        rectangles.append(((b.lower, bottom), (b.upper, bottom), (b.upper, top), (b.lower, top)))
    figure = Figure(figsize=(10, 5), dpi=120)
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
    axes.axhline(
        placement.height / scale, color="black", linestyle="--", linewidth=0.8, label="height"
    )
    bound = placement.stats.get("lower_bound")
    if bound is not None and bound < placement.height:
        axes.axhline(bound / scale, color="red", linestyle=":", linewidth=0.8, label="lower bound")
    axes.legend(loc="upper right", fontsize="small")
    axes.set_xlabel("tick")
    axes.set_ylabel(f"address ({unit})")
    axes.set_title(title or f"{len(problem.buffers)} buffers, {placement.solver}")
    figure.tight_layout()
    figure.savefig(str(path), format="png")


def plot_swaps(
    path: str | Path,
    title: str,
    sweep: Mapping[str, Sequence[tuple[float, float]]],
    memory: Mapping[str, Sequence[tuple[int, int]]],
    unconstrained: Sequence[tuple[int, int]],
    limit: int,
) -> None:
    """Write a PNG of swap policies: overhead against the limit (a fraction of the peak) per
    policy, when `sweep` has points (AutoSwap's Figs. 9 and 11), and device bytes over time
    under each policy's plan at `limit` next to the unconstrained curve (Fig. 8)."""
    FigureCanvasAgg, _, Figure = _matplotlib(path)
    panels = 2 if any(sweep.values()) else 1
    figure = Figure(figsize=(10, 4.5 * panels), dpi=120)
    FigureCanvasAgg(figure)
    gib = float(1 << 30)
    axes = figure.add_subplot(panels, 1, 1)
    if unconstrained:
        t, b = zip(*unconstrained, strict=True)
        axes.step(
            [x / 1e6 for x in t],
            [y / gib for y in b],
            where="post",
            color="black",
            linewidth=1.2,
            label="no limit",
        )
    for name, curve in memory.items():
        if curve:
            t, b = zip(*curve, strict=True)
            axes.step(
                [x / 1e6 for x in t], [y / gib for y in b], where="post", linewidth=0.8, label=name
            )
    axes.axhline(limit / gib, color="red", linestyle=":", linewidth=0.8, label="limit")
    axes.set_xlabel("time (ms)")
    axes.set_ylabel("device memory (GiB)")
    axes.set_title(f"{title}: memory under each plan")
    axes.legend(loc="upper right", fontsize="x-small", ncol=2)
    if panels == 2:
        axes = figure.add_subplot(2, 1, 2)
        for name, points in sweep.items():
            if points:
                x, y = zip(*points, strict=True)
                axes.plot([100 * v for v in x], [100 * v for v in y], marker=".", label=name)
        axes.set_xlabel("limit (% of the unconstrained peak)")
        axes.set_ylabel("overhead (%)")
        axes.invert_xaxis()
        axes.set_yscale("symlog", linthresh=1.0)
        axes.set_title("overhead against memory")
        axes.legend(loc="upper left", fontsize="x-small", ncol=2)
    figure.tight_layout()
    figure.savefig(str(path), format="png")
