"""What a replay measured beside the simulator's prediction for the daemon's plan: `Report`
(also the --json object) and `render`, its tables (`Fitted`: they fit the console or fold,
never cutting a value)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tidalcore.units import format_size

from tidaloffline.outputs import plural
from tidaloffline.replay.replayer import COUNTERS, Record

if TYPE_CHECKING:
    from tidalclient.session import Session


@dataclass(slots=True)
class Report:
    """What ran and how it compares with the prediction (`as_json` for --json)."""

    trace: str
    backend: str
    daemon: str  # "started" or the socket directory used
    limit_bytes: int
    peak_bytes: int
    op_bound_bytes: int
    compute_scale: float
    copy_gbps: float | None
    page_bytes: int = 0  # virtual residency's page; 0: a contiguous lease
    records: list[Record] = field(default_factory=list)
    plan: dict[str, Any] | None = None
    predicted: dict[str, Any] | None = None
    peak_resident_bytes: int = 0
    unresolved_accesses: int = 0
    missing_accesses: int = 0
    outcome: str = "compared"
    # The daemon's word that it cannot plan the session (kind, reason, lowest limit that could
    # work), as a JSON value; None when it said nothing of the kind.
    plan_unavailable: dict[str, Any] | None = None
    # `--timeline`: where it was written and what it shows of the steady iterations (means).
    timeline: dict[str, Any] | None = None

    def steady(self) -> list[Record]:
        return [r for r in self.records if r.phase == "steady"]

    def measured(self) -> dict[str, float] | None:
        """Means over the steady iterations (None without one)."""
        rows = self.steady()
        if not rows:
            return None
        names = ["step_ns", "host_cpu_ns", *COUNTERS, "footprint_bytes", "mismatches"]
        names.append("not_resident")
        means: dict[str, float] = {n: sum(getattr(r, n) for r in rows) / len(rows) for n in names}
        means["out_bytes"] = means["planned_out_bytes"] + means["on_demand_out_bytes"]
        means["in_bytes"] = means["planned_in_bytes"] + means["on_demand_in_bytes"]
        return means

    def step_ratio(self) -> float | None:
        m, p = self.measured(), self.predicted
        if m is None or p is None or not p["step_ns"]:
            return None
        return float(m["step_ns"] / p["step_ns"])

    def checks(self) -> dict[str, int]:
        return {
            "mismatches": sum(r.mismatches for r in self.records),
            "stamps_checked": sum(r.stamps_checked for r in self.records),
            "not_resident": sum(r.not_resident for r in self.records),
            "unresolved_accesses": self.unresolved_accesses,
            "missing_accesses": self.missing_accesses,
        }

    def as_json(self) -> dict[str, Any]:
        phases = [r.phase for r in self.records]
        return {
            "trace": self.trace,
            "backend": self.backend,
            "daemon": self.daemon,
            "limit_bytes": self.limit_bytes,
            "unconstrained_peak_bytes": self.peak_bytes,
            "op_bound_bytes": self.op_bound_bytes,
            "compute_scale": self.compute_scale,
            "copy_gbps": self.copy_gbps,
            "page_bytes": self.page_bytes,
            "outcome": self.outcome,
            "plan_unavailable": self.plan_unavailable,
            "iterations": len(self.records),
            "learning_iterations": phases.count("learning"),
            "steady_iterations": phases.count("steady"),
            "fell_back_iterations": phases.count("fell back"),
            "plan": self.plan,
            "measured": self.measured(),
            "predicted": self.predicted,
            "step_ratio": self.step_ratio(),
            "peak_resident_bytes": self.peak_resident_bytes,
            "checks": self.checks(),
            "timeline": self.timeline,
            "per_iteration": [asdict(r) for r in self.records],
        }


def plan_of(
    session: Session, shape: str | None = None
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The plan in use (id, version, limit, swaps), or the plan of iteration shape `shape`,
    and its prediction, as JSON values."""
    plan = session.plan if shape is None else session.plans.get(shape)
    if plan is None:
        return None, None
    about = {
        "id": plan.plan_id,
        "version": plan.version,
        "limit_bytes": plan.limit,
        "swaps": len(plan.swaps),
    }
    if plan.paging is not None:
        about["page_bytes"] = plan.paging.page
        about["mapped_peak_bytes"] = plan.paging.mapped_peak
    p = plan.prediction
    return about, None if p is None else asdict(p)


def show_ms(ns: float | None) -> str:
    """Nanoseconds as milliseconds for a table ("—" for none)."""
    return "—" if ns is None else f"{ns / 1e6:.2f} ms"


def show_size(n: float | None) -> str:
    """Bytes as a size for a table ("—" for none)."""
    return "—" if n is None else format_size(round(n))


def render(report: Report, console: Any) -> None:
    """The per-iteration table and the comparison with the prediction, fitted to `console`."""
    from tidalclient.tables import Fitted

    plan = report.plan
    console.print(
        f"{report.trace}: {report.backend}, limit {format_size(report.limit_bytes)}"
        f" ({report.limit_bytes / report.peak_bytes:.0%} of the peak"
        f" {format_size(report.peak_bytes)}), compute ×{report.compute_scale:g},"
        f" copies {'unthrottled' if report.copy_gbps is None else f'{report.copy_gbps:g} GB/s'};"
        + (f" pages of {format_size(report.page_bytes)};" if report.page_bytes else "")
        + (
            f" plan {plan['id']} (version {plan['version']}, {plural(plan['swaps'], 'swap')})"
            if plan is not None
            else " no plan"
        )
    )
    headers = (
        "#",
        "phase",
        "step",
        "out planned",
        "in planned",
        "out on demand",
        "in on demand",
        "stall",
        "piece misses",
        "high water",
        "mismatches",
    )
    rows = [
        (
            str(r.index),
            r.phase,
            show_ms(r.step_ns),
            show_size(r.planned_out_bytes),
            show_size(r.planned_in_bytes),
            show_size(r.on_demand_out_bytes),
            show_size(r.on_demand_in_bytes),
            show_ms(r.stall_ns),
            str(r.piece_misses),
            show_size(r.footprint_bytes),
            str(r.mismatches),
        )
        for r in report.records
    ]
    console.print(Fitted(headers, rows, title="iterations", left=(1,)))
    m, p = report.measured(), report.predicted or {}
    if m is None:
        console.print(f"no steady iteration to compare: {report.outcome}")
        return
    compared: list[tuple[str, str, str, str]] = []

    def row(
        name: str, got: float, want: float | None, size: bool = True, alike: bool = True
    ) -> None:
        """`alike`: the two measure the same thing, so their ratio means something."""
        fmt = show_size if size else show_ms
        ratio = f"{got / want:.3f}" if want and alike else "—"
        compared.append((name, fmt(got), fmt(want), ratio))

    row("step", m["step_ns"], p.get("step_ns"), size=False)
    # The training thread's own work: a step near it is the host's pace, not the plan's.
    row("training thread CPU", m["host_cpu_ns"], None, size=False, alike=False)
    row("out", m["out_bytes"], p.get("out_bytes"))
    row("in", m["in_bytes"], p.get("in_bytes"))
    # The session's stall is the training thread's waits; the prediction's, the compute stream's.
    row("stall (thread / compute)", m["stall_ns"], p.get("stall_ns"), size=False, alike=False)
    # The lease's high water is an address: it includes what learning placed below the arena.
    row("high water / footprint", m["footprint_bytes"], p.get("footprint_bytes"), alike=False)
    # The session's peak is over the whole run, learning included.
    row("peak resident", report.peak_resident_bytes, p.get("peak_bytes"), alike=False)
    t = report.timeline
    if t is not None and "compute_busy_ns" in t:  # from --timeline: the compute stream's time
        row("compute busy", t["compute_busy_ns"], t.get("simulated_compute_busy_ns"), size=False)
        row("compute idle", t["compute_idle_ns"], t.get("simulated_compute_idle_ns"), size=False)
    console.print(
        Fitted(
            ("", "measured", "predicted", "measured / predicted"),
            compared,
            title=f"steady iterations (mean of {len(report.steady())}) against the prediction",
        )
    )
    c = report.checks()
    console.print(
        f"out on demand {show_size(m['on_demand_out_bytes'])}, in on demand"
        f" {show_size(m['on_demand_in_bytes'])}, piece misses {m['piece_misses']:g};"
        f" {plural(c['stamps_checked'], 'stamp')} checked, {c['mismatches']} wrong,"
        f" {plural(c['not_resident'], 'access', 'accesses')} off the device"
    )
    if t is not None:
        console.print(f"timeline: {t['path']} ({t['note']})")
