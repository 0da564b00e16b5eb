"""`tidalpool demo`: train a NumPy network with every tensor in a session.

Starts a sim daemon in a temporary directory unless one answers in the socket
directory, trains 20 iterations with a live table, then trains the same
network with plain NumPy and compares the losses bit for bit.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.live import Live
from rich.table import Table

import tidalpool
from tidalpool.demo.net import PlainMemory, peak_live_bytes, train
from tidalpool.local import LocalDaemon, is_serving
from tidalpool.session import Session, SessionStats
from tidalpool.units import align_up, format_size


class SessionMemory:
    """The demo network's Memory, backed by a tidalpool session."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def array(self, shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray[Any, Any]:
        return self.session.array(shape, dtype)

    def release(self, arr: np.ndarray[Any, Any]) -> None:
        self.session.release(arr)

    @contextmanager
    def op(
        self,
        name: str,
        reads: Sequence[np.ndarray[Any, Any]],
        writes: Sequence[np.ndarray[Any, Any]],
    ) -> Iterator[None]:
        with self.session.op(reads=reads, writes=writes, name=name):
            yield

    def step(self) -> None:
        self.session.step()


def run(socket_dir: Path, iterations: int = 20, console: Console | None = None) -> bool:
    """Run the demo; True when the losses are bit-identical to plain NumPy."""
    console = console or Console()
    with ExitStack() as stack:
        if is_serving(socket_dir):
            console.print(f"using the daemon at [bold]{socket_dir}[/]")
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tidalpool-demo-")))
            console.print(f"no daemon at {socket_dir}: starting a sim daemon in [bold]{tmp}[/]")
            daemon = stack.enter_context(
                LocalDaemon.start(tmp, device_pool="1GiB", host_pool="1GiB")
            )
            socket_dir = daemon.socket_dir

        peak = peak_live_bytes()
        lease = align_up(2 * peak, 1 << 20)  # room for best-fit's fragmentation while learning
        session = stack.enter_context(
            tidalpool.attach(socket_dir, device_limit=lease, job_name="demo")
        )
        console.print(
            f"session {session.id}: device lease {format_size(session.device.length)}, "
            f"network peak {format_size(peak)} live"
        )
        table = Table(title="training with tidalpool (sim backend)")
        for column in (
            "iter",
            "loss",
            "mode",
            "live",
            "footprint",
            "plan hits",
            "misses",
            "events",
        ):
            table.add_column(column, justify="left" if column == "mode" else "right")
        rows: list[SessionStats] = []

        def row(i: int, loss: float) -> None:
            s = session.stats()  # sends what is recorded, asks the daemon what it has
            rows.append(s)
            table.add_row(
                str(i),
                f"{loss:.6f}",
                s.mode,
                format_size(s.live_bytes),
                format_size(s.footprint_bytes),
                f"{s.plan_hits:,}",
                f"{s.plan_misses:,}",
                f"{s.events_received:,}/{s.events_sent:,}",
            )

        with Live(table, console=console, refresh_per_second=8):
            pooled = train(SessionMemory(session), iterations=iterations, on_iteration=row)
        if not console.is_terminal:
            console.line()  # Live leaves its last frame without a newline off a terminal

    learning = [r.footprint_bytes for r in rows if r.mode == "learning"]
    planned = [r.footprint_bytes for r in rows if r.mode == "planned"]
    if planned:
        console.print(
            f"switched to the daemon's plan after {len(learning)} iterations: footprint "
            f"{format_size(max(learning))} while learning, {format_size(max(planned))} planned; "
            f"{rows[-1].plan_misses} plan misses in {rows[-1].plan_hits + rows[-1].plan_misses:,} "
            "allocations"
        )
    else:
        console.print(f"no plan arrived in {len(rows)} iterations: the session kept learning")
    plain = train(PlainMemory(), iterations=iterations)
    same = pooled == plain
    if same:
        console.print(
            f"[green]losses bit-identical to plain NumPy over {iterations} iterations[/] "
            f"(first {plain[0]!r}, last {plain[-1]!r})"
        )
    else:
        diff = [i for i, (a, b) in enumerate(zip(pooled, plain, strict=True)) if a != b]
        console.print(f"[red]losses differ from plain NumPy at iterations {diff}[/]")
    return same
