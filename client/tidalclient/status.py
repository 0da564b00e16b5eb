"""`tidalpool status`: pool usage and sessions of a running daemon, as tables that fit the
terminal (`tidalclient.tables.Fitted`: no value is ever cut) or as JSON."""

from __future__ import annotations

import base64
import json
import math
import os
import time
from pathlib import Path
from typing import Any, cast

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from rich.console import Console
from tidalcore.units import format_size
from tidalcore.v1 import admin_pb2, admin_pb2_grpc, common_pb2
from tidalcore.wire import ADMIN_SOCKET

from tidalclient.tables import Fitted


class Unreachable(Exception):
    """The daemon's Admin service could not be asked; the message says why, in a few words."""


def _admin_socket(socket_dir: Path) -> Path:
    """The daemon's admin socket, or Unreachable saying why this process cannot use it."""
    path = socket_dir / ADMIN_SOCKET
    if not path.exists():
        raise Unreachable(f"{path} does not exist")
    if not os.access(path, os.W_OK):
        raise Unreachable(
            f"permission denied on {path}: the Admin service (status, top, quota) answers the"
            " daemon's uid and root only, unless the daemon's admin_socket_mode lets others in"
        )
    return path


def fetch(
    socket_dir: Path, timeout: float = 5.0
) -> tuple[admin_pb2.PoolStatusResponse, admin_pb2.ListSessionsResponse]:
    """Pool usage and sessions from the Admin service on the daemon's admin socket, which by
    default only the daemon's uid and root may use; Unreachable says why it cannot be asked."""
    path = _admin_socket(socket_dir)
    try:
        with grpc.insecure_channel(f"unix:{path}") as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            pool = admin.PoolStatus(admin_pb2.PoolStatusRequest(), timeout=timeout)
            sessions = admin.ListSessions(admin_pb2.ListSessionsRequest(), timeout=timeout)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise Unreachable(f"no answer from {path} within {timeout:g} s") from e
        raise Unreachable(e.details() or e.code().name) from e
    return pool, sessions


def set_quota(
    socket_dir: Path, session_id: str, device_min: int, device_max: int, timeout: float = 5.0
) -> common_pb2.SessionInfo:
    """Give an elastic session a new floor and ceiling (bytes; 0: unchanged) through the
    Admin service; the session as it is then. Unreachable says why it could not be asked,
    grpc.RpcError why the daemon refused."""
    path = _admin_socket(socket_dir)
    try:
        with grpc.insecure_channel(f"unix:{path}") as channel:
            reply: admin_pb2.SetQuotaResponse = admin_pb2_grpc.AdminStub(channel).SetQuota(
                admin_pb2.SetQuotaRequest(
                    session_id=session_id, device_min_bytes=device_min, device_max_bytes=device_max
                ),
                timeout=timeout,
            )
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise Unreachable(e.details() or e.code().name) from e
        raise
    return reply.session


def lease_text(s: common_pb2.SessionInfo, chunks: bool = True) -> str:
    """A session's device lease (with its chunks); an elastic one's floor, quota and ceiling
    beside it."""
    held = format_size(s.lease.device.length)
    if chunks:
        held += f" ({len(s.lease.device.chunks)} chunks)"
    if not s.device_max_bytes:
        return held
    bounds = (s.device_floor_bytes, s.device_quota_bytes, s.device_max_bytes)
    return f"{held} of {' / '.join(format_size(x) for x in bounds)}"


def peak_text(s: common_pb2.SessionInfo) -> str:
    """A session's device peak (the bytes resident at once); for one that swapped, what its
    live blocks came to at their most beside it, swapped-out ones included."""
    device = format_size(s.device_peak_bytes)
    if s.swap_limit_bytes and s.live_peak_bytes > s.device_peak_bytes:
        return f"{device} ({format_size(s.live_peak_bytes)} live)"
    return device


def render(
    pool: admin_pb2.PoolStatusResponse, sessions: admin_pb2.ListSessionsResponse, console: Console
) -> None:
    """The pools and the sessions as tables that fit the console (`Fitted`)."""
    uptime = (time.time_ns() - pool.started_unix_ns) / 1e9
    usage = Fitted(
        ("pool", "total", "leased", "used", "free"),
        [
            (
                name,
                *(
                    format_size(x)
                    for x in (u.total_bytes, u.leased_bytes, u.used_bytes, u.free_bytes)
                ),
            )
            for name, u in (("device", pool.device), ("host", pool.host))
        ],
        title=f"tidalpoold {pool.version} · backend {pool.backend} ({pool.mode}) · chunks of"
        f" {format_size(pool.chunk_bytes)} · up {uptime:.0f} s",
    )
    console.print(usage)
    if pool.facts:
        console.print(
            "  ".join(f"{key}: {value}" for key, value in sorted(pool.facts.items())),
            markup=False,
            highlight=False,
        )
    table = Fitted(
        (
            "session",
            "job",
            "pid",
            "state",
            "device lease",
            "used",
            "device peak",
            "host lease",
            "events",
            "iterations",
        ),
        [
            (
                s.session_id,
                s.job_name,
                str(s.pid),
                s.state,
                lease_text(s),
                format_size(s.device_used_bytes),
                peak_text(s),
                format_size(s.lease.host.length),
                f"{s.events_received:,}",
                str(s.iterations_seen),
            )
            for s in sessions.sessions
        ],
        title=f"{len(sessions.sessions)} session(s)",
        left=(0, 1, 3),
    )
    console.print(table)


_INT64 = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def _value(field: FieldDescriptor, value: Any) -> Any:
    """One value of `field` as JSON: a number for every integer (MessageToDict writes 64-bit
    ones as strings, proto3's JSON mapping for JavaScript), a message as `plain`."""
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return plain(value)
    if field.type == FieldDescriptor.TYPE_ENUM and field.enum_type is not None:
        known = field.enum_type.values_by_number.get(value)
        return known.name if known is not None else value
    if field.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode("ascii")
    if field.type in _INT64:
        return int(value)
    return value


def plain(message: Message) -> dict[str, Any]:
    """Every field of `message` by its proto name, zeros and empty ones included, sizes and
    counts as JSON numbers: what `status --json` prints for each message."""
    out: dict[str, Any] = {}
    for described in message.DESCRIPTOR.fields:
        field = cast(FieldDescriptor, described)  # the stubs add the C type's own class
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name["value"]
            out[field.name] = {str(k): _value(entry, v) for k, v in sorted(value.items())}
        elif field.is_repeated:
            out[field.name] = [_value(field, v) for v in value]
        else:
            out[field.name] = _value(field, value)
    return out


def fact(text: str) -> str | int | float:
    """A backend fact as the backend gave it: the wire carries facts as text (`str()` of an
    int, a float or a string), so a number's text is a number again."""
    for number in (int, float):
        try:
            value = number(text)
        except ValueError:
            continue
        if str(value) == text and math.isfinite(value):  # " 1", "1_0", "nan" stay text
            return value
    return text


def as_json(pool: admin_pb2.PoolStatusResponse, sessions: admin_pb2.ListSessionsResponse) -> str:
    """The pools and sessions as one JSON object; byte counts, times and numeric facts are
    numbers."""
    shown = plain(pool)
    shown["facts"] = {key: fact(value) for key, value in shown["facts"].items()}
    return json.dumps({"pool": shown, "sessions": [plain(s) for s in sessions.sessions]}, indent=2)
