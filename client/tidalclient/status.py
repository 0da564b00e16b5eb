"""`tidalpool status`: pool usage and sessions of a running daemon."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.table import Table
from tidalcore.units import format_size
from tidalcore.v1 import admin_pb2, admin_pb2_grpc
from tidalcore.wire import GRPC_SOCKET


def fetch(
    socket_dir: Path, timeout: float = 5.0
) -> tuple[admin_pb2.PoolStatusResponse, admin_pb2.ListSessionsResponse]:
    with grpc.insecure_channel(f"unix:{socket_dir / GRPC_SOCKET}") as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        pool = admin.PoolStatus(admin_pb2.PoolStatusRequest(), timeout=timeout)
        sessions = admin.ListSessions(admin_pb2.ListSessionsRequest(), timeout=timeout)
    return pool, sessions


def render(
    pool: admin_pb2.PoolStatusResponse, sessions: admin_pb2.ListSessionsResponse, console: Console
) -> None:
    uptime = (time.time_ns() - pool.started_unix_ns) / 1e9
    usage = Table(
        title=f"tidalpoold {pool.version} · backend {pool.backend} ({pool.mode}) · chunks of"
        f" {format_size(pool.chunk_bytes)} · up {uptime:.0f} s"
    )
    for column in ("pool", "total", "leased", "used", "free"):
        usage.add_column(column, justify="right" if column != "pool" else "left")
    for name, u in (("device", pool.device), ("host", pool.host)):
        usage.add_row(
            name,
            *(format_size(x) for x in (u.total_bytes, u.leased_bytes, u.used_bytes, u.free_bytes)),
        )
    console.print(usage)
    if pool.facts:
        console.print("  ".join(f"{key}: {value}" for key, value in sorted(pool.facts.items())))

    table = Table(title=f"{len(sessions.sessions)} session(s)")
    for column in (
        "session",
        "job",
        "pid",
        "state",
        "device lease",
        "used",
        "peak",
        "host lease",
        "events",
        "iterations",
    ):
        table.add_column(
            column, justify="left" if column in ("session", "job", "state") else "right"
        )
    for s in sessions.sessions:
        table.add_row(
            s.session_id,
            s.job_name,
            str(s.pid),
            s.state,
            f"{format_size(s.lease.device.length)} ({len(s.lease.device.chunks)} chunks)",
            format_size(s.device_used_bytes),
            format_size(s.device_peak_bytes),
            format_size(s.lease.host.length),
            f"{s.events_received:,}",
            str(s.iterations_seen),
        )
    console.print(table)


def as_json(pool: admin_pb2.PoolStatusResponse, sessions: admin_pb2.ListSessionsResponse) -> str:
    return json.dumps(
        {
            "pool": MessageToDict(pool, preserving_proto_field_name=True),
            "sessions": [
                MessageToDict(s, preserving_proto_field_name=True) for s in sessions.sessions
            ],
        },
        indent=2,
    )
