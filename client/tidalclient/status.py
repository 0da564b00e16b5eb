"""`tidalpool status`: pool usage and sessions of a running daemon.

Its tables, `top`'s and the offline tools' are `Fitted`: drawn whole where they fit the
width, else with their headers folded, else one record per block, so that no value is cut.
"""

from __future__ import annotations

import base64
import json
import os
import re
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, cast

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text
from tidalcore.units import format_size
from tidalcore.v1 import admin_pb2, admin_pb2_grpc
from tidalcore.wire import ADMIN_SOCKET


class Unreachable(Exception):
    """The daemon's Admin service could not be asked; the message says why, in a few words."""


def fetch(
    socket_dir: Path, timeout: float = 5.0
) -> tuple[admin_pb2.PoolStatusResponse, admin_pb2.ListSessionsResponse]:
    """Pool usage and sessions from the Admin service on the daemon's admin socket, which by
    default only the daemon's uid and root may use; Unreachable says why it cannot be asked."""
    path = socket_dir / ADMIN_SOCKET
    if not path.exists():
        raise Unreachable(f"{path} does not exist")
    if not os.access(path, os.W_OK):
        raise Unreachable(
            f"permission denied on {path}: the Admin service (status, top) answers the"
            " daemon's uid and root only, unless the daemon's admin_socket_mode lets others in"
        )
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


_WIDE = 1 << 20  # a width no table reaches: measures what a table needs, not what it is given


class Fitted:
    """A table that is never cut: each column as wide as its widest value, drawn in the first
    of these layouts that fits the width it is given:

    1. whole;
    2. with headers folded onto lines of their own (at spaces and after hyphens, no
       narrower than the column's values);
    3. in groups of columns stacked one under the other, each led by the first column (the
       row's name), headers folded only where whole ones would take more groups;
    4. one block per row: the row's name, then `header  value` lines.

        ┏━━━━━━━━━━━┳━━━━━━━━━━━┓                 autoswap-doa
        ┃ autoswap- ┃ autoswap- ┃    or, at 30      feasible  yes
        ┃       doa ┃       aoa ┃    columns:       overhead  3935.5%
        ┡━━━━━━━━━━━╇━━━━━━━━━━━┩
        │   3935.5% │   3337.6% │

    `left`: the columns aligned left (the others, numbers, right). `plain`: no box (top).
    """

    def __init__(
        self,
        headers: Sequence[str],
        rows: Sequence[Sequence[str]],
        *,
        title: str | None = None,
        left: Collection[int] = (0,),
        plain: bool = False,
    ) -> None:
        if len(set(headers)) != len(headers):
            raise ValueError(f"two columns share a header: {list(headers)}")
        for row in rows:
            if len(row) != len(headers):
                raise ValueError(f"{len(row)} values for {len(headers)} columns: {list(row)}")
        self.headers = tuple(headers)
        self.rows = tuple(tuple(row) for row in rows)
        self.title, self.left, self.plain = title, frozenset(left), plain

    def _cells(self, j: int) -> int:
        """The width of column j's widest value."""
        return max((Text(row[j]).cell_len for row in self.rows), default=0)

    def _header(self, j: int, folded: bool) -> str:
        """Column j's header: whole, or folded to the column's width (at least its longest
        word): at spaces, where the pieces are joined by a space, and after hyphens."""
        header = self.headers[j]
        if not folded:
            return header
        pieces = re.findall(r"[^\s-]*-+|[^\s-]+", header)
        width = max([self._cells(j), *(Text(p).cell_len for p in pieces)])
        lines = [""]
        for piece in pieces:
            glue = "" if not lines[-1] or lines[-1].endswith("-") else " "
            if lines[-1] and Text(lines[-1] + glue + piece).cell_len > width:
                lines.append(piece)
            else:
                lines[-1] += glue + piece
        return "\n".join(lines)

    def table(
        self, folded: bool = False, columns: Sequence[int] | None = None, titled: bool = True
    ) -> Table:
        """The table with its headers whole, or `folded`, of all columns or of `columns`; no
        value is ever wrapped."""
        title = self.title if titled else None
        table = Table(title=title, box=None, pad_edge=False) if self.plain else Table(title=title)
        chosen = range(len(self.headers)) if columns is None else columns
        for j in chosen:
            header = self._header(j, folded)
            widest = max([self._cells(j), *(Text(line).cell_len for line in header.split("\n"))])
            table.add_column(
                Text(header),
                justify="left" if j in self.left else "right",
                no_wrap=True,
                min_width=widest,
            )
        for row in self.rows:
            table.add_row(*(Text(row[j]) for j in chosen))
        return table

    def records(self, width: int) -> Group:
        """Layout 4, one block per row: `header  value` lines, aligned where they fit `width`,
        else each value on a line of its own under its header."""
        pad = max((Text(h).cell_len for h in self.headers[1:]), default=0)
        widest = max((Text(c).cell_len for row in self.rows for c in row[1:]), default=0)
        aligned = 2 + pad + 2 + widest <= width
        parts: list[RenderableType] = []
        if self.title:
            parts.append(Text(self.title, style="italic", overflow="fold"))
        for k, row in enumerate(self.rows):
            if k or self.title:
                parts.append(Text(""))
            parts.append(Text(row[0], style="bold", overflow="fold"))
            for header, cell in zip(self.headers[1:], row[1:], strict=True):
                if aligned:
                    parts.append(Text(f"  {header:<{pad}}  {cell}"))
                else:
                    parts.append(Text(f"  {header}", overflow="fold"))
                    parts.append(Text(f"    {cell}", overflow="fold"))
        return Group(*parts)

    def _groups(self, fits: Callable[[Table], bool], folded: bool) -> list[list[int]] | None:
        """Layout 3: the columns after the first in groups, as many to a group as `fits`,
        headers whole or `folded`; None when even one column beside the first does not."""
        groups: list[list[int]] = []
        for j in range(1, len(self.headers)):
            if groups and fits(self.table(folded, [0, *groups[-1], j], not groups[:-1])):
                groups[-1].append(j)
            elif fits(self.table(folded, [0, j], not groups)):
                groups.append([j])
            else:
                return None
        return groups

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        wide = options.update_width(_WIDE)

        def fits(table: Table) -> bool:
            return Measurement.get(console, wide, table).minimum <= options.max_width

        for table in (self.table(folded=False), self.table(folded=True)):
            if fits(table):
                yield table
                return
        if len(self.headers) < 3:
            yield self.records(options.max_width)
            return
        whole, folded = self._groups(fits, False), self._groups(fits, True)
        if folded is None:
            yield self.records(options.max_width)
            return
        # Whole headers where they take no more groups than folded ones.
        fold = whole is None or len(whole) > len(folded)
        parts: list[RenderableType] = []
        for k, group in enumerate(folded if fold or whole is None else whole):
            if k:
                parts.append(Text(""))
            parts.append(self.table(fold, [0, *group], titled=not k))
        yield Group(*parts)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        whole = Measurement.get(console, options.update_width(_WIDE), self.table())
        return Measurement(min(whole.maximum, 1), whole.maximum).with_maximum(options.max_width)


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
            "peak",
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
                f"{format_size(s.lease.device.length)} ({len(s.lease.device.chunks)} chunks)",
                format_size(s.device_used_bytes),
                format_size(s.device_peak_bytes),
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


def as_json(pool: admin_pb2.PoolStatusResponse, sessions: admin_pb2.ListSessionsResponse) -> str:
    """The pools and sessions as one JSON object; byte counts and times are numbers."""
    return json.dumps(
        {"pool": plain(pool), "sessions": [plain(s) for s in sessions.sessions]}, indent=2
    )
