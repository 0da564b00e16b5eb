"""`tidalpool top`: `tidalpool status`, live — the pools, the sessions and their swap traffic,
redrawn every `--interval` seconds from the same Admin calls.

    sample ──▶ view(now, before) ──▶ the terminal (redrawn in place)    or
    sample ──▶ view(now, before) ──▶ stdout (one frame after another, when it is not a terminal)

Rates (bytes swapped per second, the share of time ops waited for copies) are the difference
between two samples of a session's counts; the first frame shows the counts alone.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.text import Text
from tidalcore.signals import Flag
from tidalcore.units import format_size
from tidalcore.v1 import admin_pb2, common_pb2

from tidalclient.status import Unreachable, fetch, lease_text, peak_text
from tidalclient.tables import Fitted

Fetch = Callable[[Path], tuple[admin_pb2.PoolStatusResponse, admin_pb2.ListSessionsResponse]]


@dataclass(frozen=True, slots=True)
class Sample:
    """What the daemon said at one instant (`at`: monotonic seconds)."""

    at: float
    pool: admin_pb2.PoolStatusResponse
    sessions: tuple[common_pb2.SessionInfo, ...]


@dataclass(frozen=True, slots=True)
class Rates:
    """A session's swapping between two samples."""

    out_bytes_per_s: float
    in_bytes_per_s: float
    stalled: float  # the share of the wall time its ops waited for copies, 0..1


def rates(
    before: common_pb2.SessionInfo, now: common_pb2.SessionInfo, seconds: float
) -> Rates | None:
    """The rates of one session between two samples `seconds` apart; None if they are not of
    the same session or no time passed. A count that went down (never sent) counts as 0."""
    if before.session_id != now.session_id or seconds <= 0:
        return None

    def grew(field: str) -> int:
        return max(0, int(getattr(now, field)) - int(getattr(before, field)))

    return Rates(
        grew("swapped_out_bytes") / seconds,
        grew("swapped_in_bytes") / seconds,
        min(1.0, grew("swap_stall_ns") / 1e9 / seconds),
    )


def _per_second(nbytes: float) -> str:
    return f"{format_size(round(nbytes))}/s"


def view(now: Sample, before: Sample | None, interval: float) -> RenderableType:
    """One frame: a title line, the pools, the swap traffic of the daemon, the sessions."""
    pool = now.pool
    uptime = (time.time_ns() - pool.started_unix_ns) / 1e9
    title = Text(
        f"tidalpoold {pool.version} · backend {pool.backend} ({pool.mode}) · chunks of"
        f" {format_size(pool.chunk_bytes)} · up {uptime:.0f} s · {len(now.sessions)} session(s)"
        f" · every {interval:g} s · Ctrl-C quits",
        style="bold",
    )

    pool_rows = []
    for name, u in (("device", pool.device), ("host", pool.host)):
        share = 100 * u.leased_bytes / u.total_bytes if u.total_bytes else 0.0
        sizes = (u.total_bytes, u.leased_bytes, u.used_bytes, u.free_bytes)
        pool_rows.append((name, *(format_size(x) for x in sizes), f"{share:.0f} %"))
    pools = Fitted(("pool", "total", "leased", "used", "free", "leased %"), pool_rows, plain=True)

    earlier = {s.session_id: s for s in before.sessions} if before is not None else {}
    seconds = now.at - before.at if before is not None else 0.0
    headers = (
        "session",
        "job",
        "pid",
        "state",
        "device used",
        "lease",
        "device peak",
        "host used",
        "swap limit",
        "swapped out",
        "swapped in",
        "stalled",
        "iterations",
    )
    rows: list[tuple[str, ...]] = []
    total_out = total_in = 0.0
    measured = False
    for s in now.sessions:
        r = rates(earlier[s.session_id], s, seconds) if s.session_id in earlier else None
        out, into, stalled = format_size(s.swapped_out_bytes), format_size(s.swapped_in_bytes), "–"
        if r is not None:
            measured = True
            total_out, total_in = total_out + r.out_bytes_per_s, total_in + r.in_bytes_per_s
            out += f" ({_per_second(r.out_bytes_per_s)})"
            into += f" ({_per_second(r.in_bytes_per_s)})"
            stalled = f"{100 * r.stalled:.0f} %"
        rows.append(
            (
                s.session_id,
                s.job_name,
                str(s.pid),
                s.state,
                format_size(s.device_used_bytes),
                lease_text(s, chunks=False),
                peak_text(s),
                format_size(s.host_used_bytes),
                format_size(s.swap_limit_bytes) if s.swap_limit_bytes else "–",
                out,
                into,
                stalled,
                str(s.iterations_seen),
            )
        )
    sessions = Fitted(headers, rows, left=(0, 1, 3), plain=True)
    swap = (
        f"swap traffic: {_per_second(total_out)} out, {_per_second(total_in)} in"
        if measured
        else "swap traffic: measured from the next refresh on"
    )
    parts: list[RenderableType] = [title, Text(""), pools, Text(""), Text(swap), Text("")]
    parts.append(sessions if now.sessions else Text("no sessions"))
    return Group(*parts)


@contextlib.contextmanager
def _screen(console: Console) -> Iterator[Callable[[RenderableType], None]]:
    """Where frames go: redrawn in place on a terminal (its alternate screen, restored on exit),
    else printed one after another with a blank line between them."""
    if console.is_terminal:
        with Live(console=console, screen=True, auto_refresh=False) as live:
            yield lambda frame: live.update(frame, refresh=True)
        return
    shown = 0

    def show(frame: RenderableType) -> None:
        nonlocal shown
        if shown:
            console.print()
        shown += 1
        console.print(frame)

    yield show


@contextlib.contextmanager
def _ctrl_c() -> Iterator[Flag]:
    """A flag set by Ctrl-C (SIGINT) instead of KeyboardInterrupt, on the main thread: the
    loop then ends between two calls, never inside gRPC's, which a KeyboardInterrupt could
    leave with a thread that keeps the process from exiting."""
    pressed = Flag()
    try:
        if threading.current_thread() is not threading.main_thread():
            yield pressed
            return
        previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.set())
        wakeup = pressed.wake_on_signals()  # a Ctrl-C taken by one of gRPC's threads too
        try:
            yield pressed
        finally:
            signal.set_wakeup_fd(wakeup)
            signal.signal(signal.SIGINT, previous)
    finally:
        pressed.close()


def run(
    socket_dir: Path,
    console: Console,
    errors: Console,
    interval: float = 1.0,
    iterations: int | None = None,
    fetch_status: Fetch = fetch,
) -> int:
    """Show a frame every `interval` seconds, `iterations` times (None: until Ctrl-C or the
    daemon goes away). Returns the exit status: 0 after the frames or Ctrl-C, 1 when no
    daemon answers, saying so on `errors` once the screen is restored."""
    before: Sample | None = None
    problem: str | None = None
    shown = 0
    try:
        with _ctrl_c() as pressed, _screen(console) as show:
            while not pressed.is_set():
                try:
                    pool, listed = fetch_status(socket_dir)
                except Unreachable as e:
                    problem = (
                        f"no daemon answers at {socket_dir}: {e}"
                        if before is None
                        else f"the daemon at {socket_dir} went away: {e}"
                    )
                    break
                now = Sample(time.monotonic(), pool, tuple(listed.sessions))
                show(view(now, before, interval))
                shown += 1
                if iterations is not None and shown >= iterations:
                    break
                before = now
                pressed.wait(interval)
    except KeyboardInterrupt:  # off the main thread, or before the handler was in place
        return 0
    if problem is not None:
        errors.print(f"tidalpool: {problem}", markup=False, highlight=False, soft_wrap=True)
        return 1
    return 0
