"""The Grafana dashboards of dashboards/, written from one description here.

    .venv/bin/python -m tools.dashboards   # rewrites dashboards/*.json

Every dashboard has the variables `datasource` (a Prometheus), `instance` and `gpu` (both
multi-value, All by default); every query selects `instance=~"$instance",gpu=~"$gpu"`.
A unit test checks that the committed files are what this writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DASHBOARDS = Path(__file__).resolve().parent.parent / "dashboards"

S = 'instance=~"$instance",gpu=~"$gpu"'
"""The selector of the dashboards' variables."""

R = "$__rate_interval"
BY = "instance, gpu"
WHERE = "{{instance}} gpu {{gpu}}"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass(frozen=True)
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str
    description: str = ""
    kind: str = "timeseries"  # or "table" (instant queries, one row per series)
    stack: bool = False
    width: int = 12


@dataclass(frozen=True)
class Row:
    title: str
    panels: list[Panel] = field(default_factory=list)


def _target(ref: int, expr: str, legend: str, table: bool) -> dict[str, Any]:
    return {
        "datasource": DATASOURCE,
        "expr": expr,
        "legendFormat": legend,
        "refId": chr(ord("A") + ref),
        "range": not table,
        "instant": table,
        **({"format": "table"} if table else {}),
    }


def _panel(p: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    table = p.kind == "table"
    out: dict[str, Any] = {
        "id": panel_id,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": p.width, "x": x, "y": y},
        "targets": [_target(i, e, legend, table) for i, (e, legend) in enumerate(p.targets)],
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
    }
    if table:
        out["transformations"] = [
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True}}},
        ]
        out["options"] = {"showHeader": True}
    else:
        out["fieldConfig"]["defaults"]["custom"] = {
            "fillOpacity": 40 if p.stack else 10,
            "lineWidth": 1,
            "stacking": {"mode": "normal" if p.stack else "none", "group": "A"},
        }
        out["options"] = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    return out


def _variables() -> list[dict[str, Any]]:
    def query(name: str, label: str, source: str) -> dict[str, Any]:
        expr = f"label_values({source}, {name})"
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DATASOURCE,
            "definition": expr,
            "query": {"query": expr, "refId": f"{name}-values"},
            "refresh": 2,  # on time range change
            "multi": True,
            "includeAll": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 1,
        }

    return [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "refresh": 1,
        },
        query("instance", "Instance", "tidalpool_build_info"),
        query("gpu", "GPU", 'tidalpool_build_info{instance=~"$instance"}'),
    ]


def dashboard(uid: str, title: str, description: str, rows: list[Row]) -> dict[str, Any]:
    """A Grafana dashboard: each row's panels laid out left to right, two to a line."""
    panels: list[dict[str, Any]] = []
    y = 0
    for row in rows:
        panels.append(
            {
                "id": len(panels) + 1,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        y, x = y + 1, 0
        for p in row.panels:
            if x + p.width > 24:
                y, x = y + 8, 0
            panels.append(_panel(p, len(panels) + 1, x, y))
            x += p.width
        y += 8
    return {
        "id": None,
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["tidalpool"],
        "editable": True,
        "graphTooltip": 1,  # shared crosshair
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "annotations": {"list": []},
        "links": [
            {
                "type": "dashboards",
                "tags": ["tidalpool"],
                "asDropdown": False,
                "includeVars": True,
                "keepTime": True,
                "title": "tidalpool",
            }
        ],
        "templating": {"list": _variables()},
        "panels": panels,
    }


def pool() -> dict[str, Any]:
    per_session = "{{job_name}} {{session_id}}"
    return dashboard(
        "tidalpool-pool",
        "tidalpool / Pool",
        "The pools of each daemon: bytes by state, leases and use by session, fragmentation"
        " of the plans, the device, the daemon's gRPC calls.",
        [
            Row(
                "Pools",
                [
                    Panel(
                        "Device pool by state",
                        [(f'tidalpool_pool_bytes{{{S},pool="device"}}', f"{WHERE} {{{{state}}}}")],
                        "bytes",
                        "free: not leased; leased: leased to sessions; used: live bytes the"
                        " sessions report (part of leased).",
                    ),
                    Panel(
                        "Host pool by state",
                        [(f'tidalpool_pool_bytes{{{S},pool="host"}}', f"{WHERE} {{{{state}}}}")],
                        "bytes",
                        "The pinned host pool: swapped-out blocks live in the host leases.",
                    ),
                    Panel(
                        "Pool leased",
                        [
                            (
                                f'tidalpool_pool_bytes{{{S},state="leased"}}'
                                f" / ignoring(state) tidalpool_pool_size_bytes{{{S}}}",
                                f"{WHERE} {{{{pool}}}}",
                            )
                        ],
                        "percentunit",
                        "Share of each pool leased: at 100% new sessions are refused.",
                    ),
                    Panel(
                        "Device memory",
                        [
                            (f"tidalpool_device_memory_used_bytes{{{S}}}", f"{WHERE} used"),
                            (f"tidalpool_device_memory_total_bytes{{{S}}}", f"{WHERE} total"),
                        ],
                        "bytes",
                        "cuda: the GPU's memory by any process, the pool included (NVML);"
                        " sim: the device pool's resident pages.",
                    ),
                ],
            ),
            Row(
                "Sessions",
                [
                    Panel(
                        "Sessions",
                        [
                            (f"tidalpool_sessions{{{S}}}", f"{WHERE} {{{{state}}}}"),
                            (f"tidalpool_sessions_max{{{S}}}", f"{WHERE} max"),
                        ],
                        "short",
                    ),
                    Panel(
                        "Sessions attached and ended per minute",
                        [
                            (
                                f"60 * rate(tidalpool_sessions_attached_total{{{S}}}[{R}])",
                                f"{WHERE} attached",
                            ),
                            (
                                f"60 * rate(tidalpool_sessions_ended_total{{{S}}}[{R}])",
                                f"{WHERE} ended: {{{{reason}}}}",
                            ),
                        ],
                        "short",
                        "Ended by reason: detached (the job closed or exited), evicted (an"
                        " operator, or missed heartbeats), shutdown.",
                    ),
                    Panel(
                        "tidalpool.sock connections",
                        [
                            (f"tidalpool_connections{{{S}}}", f"{WHERE} {{{{state}}}}"),
                            (
                                f"60 * rate(tidalpool_connections_refused_total{{{S}}}[{R}])",
                                f"{WHERE} refused per minute",
                            ),
                        ],
                        "short",
                        "Connections waiting for their HTTP/2 preface and relayed to the gRPC"
                        " server, and those the daemon closed (a uid past its share, the"
                        " waiting room full, silent or not HTTP/2): a rise is a flood or a"
                        " misbehaving client (front.refused in the log names its uid and pid).",
                    ),
                    Panel(
                        "Device lease by session",
                        [(f'tidalpool_session_lease_bytes{{{S},pool="device"}}', per_session)],
                        "bytes",
                        stack=True,
                    ),
                    Panel(
                        "Device bytes used by session",
                        [(f'tidalpool_session_used_bytes{{{S},pool="device"}}', per_session)],
                        "bytes",
                        "Live bytes each session reports in its heartbeats.",
                        stack=True,
                    ),
                    Panel(
                        "Peak device bytes by session",
                        [(f"tidalpool_session_peak_bytes{{{S}}}", per_session)],
                        "bytes",
                    ),
                    Panel(
                        "Host lease by session",
                        [(f'tidalpool_session_lease_bytes{{{S},pool="host"}}', per_session)],
                        "bytes",
                        stack=True,
                    ),
                    Panel(
                        "Elastic leases by session",
                        [
                            (
                                f'tidalpool_session_device_quota_bytes{{{S},bound="{bound}"}}',
                                f"{per_session} {bound}",
                            )
                            for bound in ("floor", "quota", "borrowed")
                        ],
                        "bytes",
                        "An elastic session's floor (guaranteed), quota (what the daemon lets it"
                        " hold now) and borrowed bytes (held above its floor): the pool lends what"
                        " no floor holds, by need, in proportion to floors.",
                    ),
                    Panel(
                        "Give-back latency",
                        [
                            (
                                f"histogram_quantile({q}, sum by ({BY}, le)"
                                f" (rate(tidalpool_quota_give_back_seconds_bucket{{{S}}}[{R}])))",
                                f"{WHERE} p{round(q * 100)}",
                            )
                            for q in (0.5, 0.99)
                        ],
                        "s",
                        "From a QuotaChange asking an elastic session for chunks to those chunks"
                        " scrubbed and free in the pool (empty while none is asked for).",
                    ),
                ],
            ),
            Row(
                "Fragmentation",
                [
                    Panel(
                        "Plan footprint and its lower bound",
                        [
                            (
                                f"tidalpool_session_plan_footprint_bytes{{{S}}}",
                                f"{per_session} footprint",
                            ),
                            (
                                f"tidalpool_session_plan_lower_bound_bytes{{{S}}}",
                                f"{per_session} lower bound",
                            ),
                        ],
                        "bytes",
                        "The height of each session's latest placement plan and the peak of its"
                        " aligned live bytes, which no placement can go under.",
                    ),
                    Panel(
                        "Fragmentation ratio",
                        [(f"tidalpool_session_plan_fragmentation_ratio{{{S}}}", per_session)],
                        "short",
                        "Plan footprint over its lower bound: 1 is no fragmentation.",
                    ),
                ],
            ),
            Row(
                "Daemon",
                [
                    Panel(
                        "Up",
                        [('up{job="tidalpool",instance=~"$instance"}', "{{instance}}")],
                        "short",
                        "1 while Prometheus scrapes the daemon.",
                    ),
                    Panel(
                        "gRPC calls per second",
                        [
                            (
                                f"sum by ({BY}, method, code)"
                                f" (rate(tidalpool_grpc_requests_total{{{S}}}[{R}]))",
                                f"{WHERE} {{{{method}}}} {{{{code}}}}",
                            )
                        ],
                        "reqps",
                    ),
                    Panel(
                        "gRPC latency p99 (calls with one reply)",
                        [
                            (
                                f"histogram_quantile(0.99, sum by ({BY}, method, le)"
                                f" (rate(tidalpool_grpc_request_duration_seconds_bucket{{{S}}}"
                                f"[{R}])))",
                                f"{WHERE} {{{{method}}}}",
                            )
                        ],
                        "s",
                    ),
                    Panel(
                        "Device and build",
                        [
                            (f"tidalpool_device_info{{{S}}}", ""),
                            (f"tidalpool_build_info{{{S}}}", ""),
                        ],
                        "short",
                        "The device (PCIe link at start; empty on sim) and the daemon's build.",
                        kind="table",
                    ),
                ],
            ),
        ],
    )


def _bandwidth_use(direction: str, link: str) -> tuple[str, str]:
    """Swap traffic one way over the copy bandwidth of that direction."""
    traffic = f'tidalpool_swapped_bytes_total{{{S},direction="{direction}"}}'
    bandwidth = f'tidalpool_copy_bandwidth_bytes_per_second{{{S},direction="{link}"}}'
    return (
        f"sum by ({BY}) (rate({traffic}[{R}])) / on({BY}) {bandwidth}",
        f"{WHERE} {direction} ({link})",
    )


def swap() -> dict[str, Any]:
    per_session = "{{job_name}} {{session_id}}"
    return dashboard(
        "tidalpool-swap",
        "tidalpool / Swap",
        "Swapping between device and host: traffic against the copy bandwidth, the time jobs"
        " wait for copies, the host bytes holding swapped-out blocks.",
        [
            Row(
                "Traffic",
                [
                    Panel(
                        "Swap traffic and copy bandwidth",
                        [
                            (
                                f"sum by ({BY}, direction)"
                                f" (rate(tidalpool_swapped_bytes_total{{{S}}}[{R}]))",
                                f"{WHERE} {{{{direction}}}}",
                            ),
                            (
                                f"tidalpool_copy_bandwidth_bytes_per_second{{{S}}}",
                                f"{WHERE} bandwidth {{{{direction}}}} ({{{{source}}}})",
                            ),
                        ],
                        "Bps",
                        "Bytes swapped out (device to host) and in per second, and the copy"
                        " bandwidth the backend's probe measured at start (or, on sim, the one"
                        " the planner assumes).",
                    ),
                    Panel(
                        "Copy bandwidth in use",
                        [_bandwidth_use("out", "d2h"), _bandwidth_use("in", "h2d")],
                        "percentunit",
                        "Swap traffic over the copy bandwidth of its direction. Near 100%, swaps"
                        " queue behind each other and jobs stall.",
                    ),
                    Panel(
                        "Swap traffic by session",
                        [
                            (
                                f"rate(tidalpool_session_swapped_bytes_total{{{S}}}[{R}])",
                                f"{per_session} {{{{direction}}}}",
                            )
                        ],
                        "Bps",
                    ),
                    Panel(
                        "Host bytes of swapped-out blocks by session",
                        [(f'tidalpool_session_used_bytes{{{S},pool="host"}}', per_session)],
                        "bytes",
                        stack=True,
                    ),
                ],
            ),
            Row(
                "Stalls",
                [
                    Panel(
                        "Swap stall fraction by session",
                        [
                            (
                                f"rate(tidalpool_session_swap_stall_seconds_total{{{S}}}[{R}])",
                                per_session,
                            )
                        ],
                        "percentunit",
                        "Share of each session's time its ops and mallocs waited for swap"
                        " copies: the cost of swapping in training speed.",
                    ),
                    Panel(
                        "Swap stall seconds per second, all sessions",
                        [
                            (
                                f"rate(tidalpool_swap_stall_seconds_total{{{S}}}[{R}])",
                                WHERE,
                            )
                        ],
                        "short",
                        "Summed over sessions, ended ones included: above 1 when several wait.",
                    ),
                ],
            ),
        ],
    )


def planner() -> dict[str, Any]:
    per_session = "{{job_name}} {{session_id}}"
    return dashboard(
        "tidalpool-planner",
        "tidalpool / Planner",
        "The planner: plans made and how long they took, allocations the plans could not serve,"
        " the traces it learns from.",
        [
            Row(
                "Plans",
                [
                    Panel(
                        "Plans per minute by outcome",
                        [
                            (
                                f"60 * sum by ({BY}, outcome)"
                                f" (rate(tidalpool_plans_total{{{S}}}[{R}]))",
                                f"{WHERE} {{{{outcome}}}}",
                            )
                        ],
                        "short",
                        "solved: a placement search; cached: from the plan cache (a job seen"
                        " before); failed: the session keeps learning.",
                    ),
                    Panel(
                        "Plans since start",
                        [(f"tidalpool_plans_total{{{S}}}", f"{WHERE} {{{{outcome}}}}")],
                        "short",
                    ),
                    Panel(
                        "Plan time quantiles",
                        [
                            (
                                f"histogram_quantile({q}, sum by ({BY}, outcome, le)"
                                f" (rate(tidalpool_plan_duration_seconds_bucket{{{S}}}[{R}])))",
                                f"{WHERE} {{{{outcome}}}} p{round(q * 100)}",
                            )
                            for q in (0.5, 0.99)
                        ],
                        "s",
                        "From a session's trace to its plan on the stream (empty while no plan"
                        " is made).",
                    ),
                    Panel(
                        "Mean plan time since start",
                        [
                            (
                                f"tidalpool_plan_duration_seconds_sum{{{S}}}"
                                f" / tidalpool_plan_duration_seconds_count{{{S}}}",
                                f"{WHERE} {{{{outcome}}}}",
                            )
                        ],
                        "s",
                    ),
                ],
            ),
            Row(
                "Misses and traces",
                [
                    Panel(
                        "Plan misses per minute",
                        [
                            (
                                f"60 * rate(tidalpool_plan_misses_total{{{S}}}[{R}])",
                                f"{WHERE} all sessions",
                            ),
                            (
                                f"60 * rate(tidalpool_session_plan_misses_total{{{S}}}[{R}])",
                                per_session,
                            ),
                        ],
                        "short",
                        "Allocations a plan could not serve (size or order differed), placed"
                        " online instead; many in one iteration send a job back to learning.",
                    ),
                    Panel(
                        "Trace events received per second",
                        [
                            (
                                f"rate(tidalpool_trace_events_received_total{{{S}}}[{R}])",
                                f"{WHERE} all sessions",
                            ),
                            (
                                f"rate(tidalpool_session_trace_events_received_total{{{S}}}[{R}])",
                                per_session,
                            ),
                        ],
                        "short",
                    ),
                ],
            ),
        ],
    )


def build() -> dict[str, dict[str, Any]]:
    """Every dashboard by its file name."""
    return {"pool.json": pool(), "swap.json": swap(), "planner.json": planner()}


def text(board: dict[str, Any]) -> str:
    return json.dumps(board, indent=2) + "\n"


def main() -> None:
    DASHBOARDS.mkdir(exist_ok=True)
    for name, board in build().items():
        (DASHBOARDS / name).write_text(text(board))
        print(DASHBOARDS / name)


if __name__ == "__main__":
    main()
