"""A placement as a picture: one rectangle per buffer, tick across, address up (SmartPool's Fig. 3).

matplotlib is imported only here and only when a picture is asked for (the
`dev` extra installs it); without it, `plot` raises MatplotlibMissing.
"""

from __future__ import annotations

from pathlib import Path

from tidalpoold.planner.model import Placement, Problem


class MatplotlibMissing(ImportError):
    """Drawing was asked for and matplotlib is not installed."""


def plot(problem: Problem, placement: Placement, path: str | Path, title: str = "") -> None:
    """Write a PNG of the placement: buffers as rectangles, the height as a dashed line (and
    the lower bound, when `placement.stats` has it and the height is above, as a dotted one)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.collections import PolyCollection
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MatplotlibMissing(
            f"drawing {path} needs matplotlib, which is not installed"
            " (pip install matplotlib, or the dev extra)"
        ) from e
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
