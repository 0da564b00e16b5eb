"""`tidalpool demo`: train a small network with every tensor in a session.

Starts a daemon (`--backend sim` or `cuda`) in a temporary directory unless one
answers in the socket directory, trains 20 iterations with a live table, then
trains the same network outside tidalpool and compares the losses bit for bit:
with NumPy in host memory on the sim backend, with CuPy on the GPU on cuda
(there every CuPy allocation of the run comes from the lease too, through
`tidalpool.cupy`; the baseline uses CuPy's own memory pool). With a limit
(a fraction of the network's peak live bytes), the session swaps: the table
shows the bytes swapped out and in and the time ops waited for copies; the
demo then waits, once, for the daemon's swap plan so that the rest of the run
follows it, or until the daemon says it cannot make one (the demo prints why, with
the lowest limit that could work when the daemon knows it). A limit below what
the network's largest op needs at once is refused (`limit_problem`). The table is
`Fitted`: it fits the terminal or a pipe, never cut.
"""

from __future__ import annotations

import importlib
import math
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.live import Live
from tidalcore.units import ALIGNMENT, align_up, format_size
from tidalcore.unplanned import PlanUnavailable

from tidalclient.demo.net import (
    CupyMemory,
    Memory,
    PlainMemory,
    largest_op,
    peak_live_bytes,
    train,
)
from tidalclient.local import LocalDaemon, is_serving
from tidalclient.numpy import Tensor
from tidalclient.session import Session, SessionStats
from tidalclient.session import attach as session_attach
from tidalclient.tables import Fitted

PLAN_WAIT_AT = 4
"""Under a limit, the iteration after which the demo waits for the daemon's plan (planning
starts after three step marks; a swap plan weighs every policy and takes about a second)."""
PLAN_WAIT_S = 15.0

SIM_PAGE = 4 << 10
"""The page of a demo session under a limit on sim (virtual residency): the OS page. The demo
network's blocks are of a few KiB to 256 KiB, all under the cuda page of 2 MiB (in pages of
2 MiB they would all share pages and none could move), and at 0.5 of its peak a plan has a few
KiB to spare, which larger pages' rounding would take."""


class SessionMemory:
    """The demo network's Memory, backed by a tidalpool session: every array a Tensor."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def array(self, shape: tuple[int, ...], dtype: npt.DTypeLike) -> Tensor:
        return self.session.tensor(shape, dtype)

    def release(self, arr: Tensor) -> None:
        self.session.release(arr)

    @contextmanager
    def op(
        self, name: str, reads: Sequence[Tensor], writes: Sequence[Tensor]
    ) -> Iterator[tuple[np.ndarray[Any, Any], ...]]:
        with self.session.op(reads=reads, writes=writes, name=name) as views:
            yield views

    def step(self) -> None:
        self.session.step()


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.1f} ms"


def limit_problem(limit: float, page: int | None = None) -> str | None:
    """Why the demo cannot train under `limit` (a fraction of the network's peak live bytes),
    in one line naming the lowest limit that works; None when it can. `page`: in a paged
    session, whose ops need their arrays' whole pages and the packed pages live then."""
    if not (math.isfinite(limit) and 0 < limit <= 1):
        return f"--limit must be a fraction in (0, 1], not {limit:g}"
    peak = peak_live_bytes()
    name, need = largest_op(alignment=ALIGNMENT, page=page)  # the executor's alignment
    if int(limit * peak) >= need:
        return None
    return (
        f"--limit {limit:g} is too low: the network's op {name} needs {format_size(need)} on the"
        f" device at once, {need / peak:.1%} of its peak of {format_size(peak)} live: use"
        f" {lowest_fraction(need, peak):.2f} or more (at most 1)"
    )


def lowest_fraction(need: int, peak: int) -> float:
    """The least `--limit` in hundredths whose bytes (`int(limit * peak)`, as `run` takes
    them) are `need` or more."""
    lowest = math.ceil(need / peak * 100) / 100
    while int(lowest * peak) < need:  # a rounding away from the exact share
        lowest += 0.01
    return lowest


def _unplanned_line(told: PlanUnavailable, peak: int) -> str:
    """The daemon's reason for sending no plan, with the lowest `--limit` that could work
    when it knows one."""
    line = f"no plan: {told.line()}"
    if told.lowest_limit_bytes:
        line += f": --limit {lowest_fraction(told.lowest_limit_bytes, peak):.2f} or more"
    return line


def run(
    socket_dir: Path,
    iterations: int = 20,
    console: Console | None = None,
    limit: float | None = None,
    copy_gbps: float | None = None,
    backend: str = "sim",
    page: int | None = None,
) -> bool:
    """Run the demo; True when the losses are bit-identical to the same training outside
    tidalpool (plain NumPy on sim, plain CuPy on cuda).

    `limit`: swap to keep the device bytes held at or under this fraction of the network's peak
    live bytes; `copy_gbps` throttles the swap copies; `backend`: the daemon to start when none
    answers in `socket_dir`. A `limit` the network cannot train under is a ValueError
    (`limit_problem`). Under a limit on sim the session is paged (virtual residency) with pages
    of `page` bytes (default `SIM_PAGE`); on cuda its lease stays contiguous unless `page` is
    given (the network's blocks are all under the 2 MiB VMM granularity)."""
    if limit is not None and page is None and backend == "sim":
        page = SIM_PAGE
    if limit is not None and (problem := limit_problem(limit, page)) is not None:
        raise ValueError(problem)
    console = console or Console()
    with ExitStack() as stack:
        if is_serving(socket_dir):
            console.print(f"using the daemon at [bold]{socket_dir}[/]")
        else:
            if backend == "cuda":
                _cupy_or_exit()
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tidalpool-demo-")))
            # Each path on a line that holds it whole: a terminal of 80 columns does not cut it.
            console.print(f"no daemon answers at {socket_dir}")
            console.print(f"starting a {backend} daemon in [bold]{tmp}[/]")
            daemon = stack.enter_context(
                LocalDaemon.start(tmp, device_pool="1GiB", host_pool="1GiB", backend=backend)
            )
            socket_dir = daemon.socket_dir

        peak = peak_live_bytes()
        lease = align_up(2 * peak, 1 << 20)  # room for best-fit's fragmentation while learning
        swap_limit = None if limit is None else int(limit * peak)
        session = stack.enter_context(
            session_attach(
                socket_dir,
                device_limit=lease,
                host_limit=lease if swap_limit is not None else None,
                job_name="demo",
                swap_limit=swap_limit,
                copy_gbps=copy_gbps,
                page_bytes=page if swap_limit is not None else None,
            )
        )
        baseline: Memory = PlainMemory()
        if session.cuda is not None:
            baseline = _use_gpu(session, stack)
        where = "sim" if session.cuda is None else f"cuda, GPU {session.cuda.pci_bus_id}"
        console.print(
            f"session {session.id} ({where}): device lease {format_size(session.device.length)}, "
            f"network peak {format_size(peak)} live"
            + ("" if swap_limit is None else f", swap limit {format_size(swap_limit)} ({limit:g})")
            + (f", pages of {format_size(session.page_bytes)}" if session.page_bytes else "")
        )
        title = f"training with tidalpool ({where})"
        swaps = swap_limit is not None or copy_gbps is not None
        # A session that swaps shows what each iteration moved instead of its blocks and plan
        # counts (the lines after the table total them): either way the table fits 80 columns.
        columns = ["iter", "loss", "mode", *(SWAP_COLUMNS if swaps else BLOCK_COLUMNS), "trace"]
        rows: list[SessionStats] = []
        cells: list[list[str]] = []

        def table() -> Fitted:  # unboxed
            return Fitted(columns, cells, title=title, left=(columns.index("mode"),), plain=True)

        def add_row(i: int, loss: float) -> None:
            if swap_limit is not None and i == PLAN_WAIT_AT and i + 1 < iterations:
                session.wait_for_plan(PLAN_WAIT_S)  # so the rest of the run follows the plan
            s = session.stats()  # sends what is recorded, asks the daemon what it has
            before = rows[-1].swap if rows else None
            rows.append(s)
            row = [str(i), f"{loss:.6f}", s.mode]
            if not swaps:
                row += [
                    format_size(s.live_bytes),
                    format_size(s.footprint_bytes),
                    f"{s.plan_hits:,}",
                    f"{s.plan_misses:,}",
                ]
            elif (swap := s.swap) is None:
                row += ["–"] * len(SWAP_COLUMNS)
            else:
                row += [
                    format_size(swap.resident_bytes),
                    format_size(
                        swap.swapped_out_bytes - (before.swapped_out_bytes if before else 0)
                    ),
                    format_size(swap.swapped_in_bytes - (before.swapped_in_bytes if before else 0)),
                    _ms(swap.stall_ns - (before.stall_ns if before else 0)),
                ]
            row.append(f"{s.events_received:,}/{s.events_sent:,}")
            cells.append(row)
            live.update(table())

        with Live(table(), console=console, refresh_per_second=8) as live:
            pooled = train(SessionMemory(session), iterations=iterations, on_iteration=add_row)
        if not console.is_terminal:
            console.line()  # Live leaves its last frame without a newline off a terminal
        console.print(TRACE_NOTE)
        if swaps:
            console.print(SWAP_NOTE)

    learning = [r.footprint_bytes for r in rows if r.mode == "learning"]
    planned = [r.footprint_bytes for r in rows if r.mode == "planned"]
    swap = rows[-1].swap
    if swap is not None:
        under = (
            f"swapping under {format_size(swap.limit)} ({limit:g} of the peak {format_size(peak)})"
            if limit is not None
            else f"copies at {copy_gbps:g} GB/s, no --limit: swapping only when the lease is full"
        )
        console.print(
            f"{under}: at most {format_size(swap.peak_resident_bytes)} on the device; "
            f"{format_size(swap.swapped_out_bytes)} out in {swap.swap_outs:,} copies, "
            f"{format_size(swap.swapped_in_bytes)} in in {swap.swap_ins:,}; "
            f"ops waited {_ms(swap.stall_ns)} for copies; on demand (the LRU cache, no plan): "
            f"{format_size(swap.on_demand_out_bytes)} out, "
            f"{format_size(swap.on_demand_in_bytes)} in"
        )
    if planned:
        console.print(
            f"switched to the daemon's plan after {len(learning)} iterations: footprint "
            f"{format_size(max(learning))} while learning, {format_size(max(planned))} planned; "
            f"{rows[-1].plan_misses} plan misses in {rows[-1].plan_hits + rows[-1].plan_misses:,} "
            "allocations"
        )
    elif (told := rows[-1].plan_unavailable) is not None:
        console.print(f"{_unplanned_line(told, peak)}; the session kept learning, on the LRU cache")
    elif rows[-1].plans_received and swap is not None:
        console.print(
            "the daemon's plan was not made for this swap limit: the session kept learning; "
            f"its swap schedule has {swap.scheduled_swaps} swaps, the LRU cache swaps the rest"
        )
    elif swap is not None:
        console.print(
            f"no plan arrived in {len(rows)} iterations: the session kept learning, on the LRU "
            "cache (a plan is sent only when its placement fits the limit: the daemon logs "
            "plan.unfit otherwise)"
        )
    else:
        console.print(f"no plan arrived in {len(rows)} iterations: the session kept learning")
    plain = train(baseline, iterations=iterations)
    name = "plain NumPy" if isinstance(baseline, PlainMemory) else "plain CuPy"
    same = pooled == plain
    if same:
        console.print(
            f"[green]losses bit-identical to {name} over {iterations} iterations[/] "
            f"(first {plain[0]!r}, last {plain[-1]!r})"
        )
    else:
        diff = [i for i, (a, b) in enumerate(zip(pooled, plain, strict=True)) if a != b]
        console.print(f"[red]losses differ from {name} at iterations {diff}[/]")
    return same


BLOCK_COLUMNS = ("live", "footprint", "plan hits", "misses")
SWAP_COLUMNS = ("device", "out", "in", "stall")
"""The columns between `mode` and `trace`: a run's blocks and its plan's hits and misses so
far; a swapping run's bytes mapped on the device now, and what the iteration swapped out and
in and how long its ops waited for copies."""

SWAP_NOTE = (
    "device: bytes on the device at the iteration's end; out, in: what the iteration swapped"
    " out and in; stall: how long it waited for copies"
)
TRACE_NOTE = (
    "trace: of the events the session had recorded by the iteration's end (mallocs, frees,"
    " ops), those the daemon had received / all; it plans from them, the rest are on their way"
)


def _cupy_or_exit() -> Any:
    try:
        return importlib.import_module("cupy")
    except ImportError:
        raise SystemExit(
            "tidalpool demo on the cuda backend trains with CuPy, which is not installed:"
            " pip install 'tidalpool[cupy,cuda]'"
        ) from None


def _use_gpu(session: Session, stack: ExitStack) -> Memory:
    """On cuda: CuPy on the lease's GPU, every CuPy allocation from the lease until the demo
    ends; returns the baseline memory (plain CuPy)."""
    import tidalclient.cupy as tpc

    cupy = _cupy_or_exit()
    assert session.cuda is not None
    cupy.cuda.Device(session.cuda.ordinal).use()
    tpc.use(session, pinned=False)
    stack.callback(tpc.stop)
    return CupyMemory()
