"""What a replay runs in: the rule's numbers, the options' checks, the daemon it starts for a
run, and its session and compute stream (`command` replays one iteration shape, `shapes`
several)."""

from __future__ import annotations

import argparse
import contextlib
import math
import mmap
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tidalcore.units import align_up, format_size, parse_size

from tidaloffline.replay.compute import Compute, CudaCompute, SimCompute, need_cupy
from tidaloffline.replay.errors import ReplayError
from tidaloffline.simulate_command import InputError

if TYPE_CHECKING:
    from tidalclient.session import Session

LEARNING_ITERATIONS = 3
"""Iterations the daemon needs before it plans (its `plan_after_iterations`, 3 by default and
for the daemon this command starts); the command waits for the plan after them."""
DEFAULT_ITERATIONS = 8
MIN_ITERATIONS = LEARNING_ITERATIONS + 2  # the learning ones, the switch, one steady
EXTRA_ITERATIONS = 3  # run beyond N while the session has not switched to the plan
DEFAULT_PLAN_TIMEOUT_S = 60.0
CHUNK = 2 << 20  # chunk size of the daemon this command starts
OS_PAGE = mmap.PAGESIZE


def refuse(problem: object) -> None:
    """The command's error: one line on stderr (a daemon's log, say, folded onto it)."""
    print(f"tidalpool replay: {' '.join(str(problem).split())}", file=sys.stderr)


def say_from(started: float) -> Callable[[str], None]:
    """Progress lines on stderr, each with the seconds since `started`."""

    def say(text: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {text}", file=sys.stderr, flush=True)

    return say


def check_options(args: argparse.Namespace) -> None:
    if not (math.isfinite(args.compute_scale) and args.compute_scale > 0):
        raise InputError("--compute-scale must be positive")
    if args.iterations < MIN_ITERATIONS:
        raise InputError(
            f"--iterations must be at least {MIN_ITERATIONS}: {LEARNING_ITERATIONS} learning,"
            " the switch to the plan and one steady iteration"
        )
    if args.copy_gbps is not None and not (math.isfinite(args.copy_gbps) and args.copy_gbps > 0):
        raise InputError("--copy-gbps must be positive")
    if not (math.isfinite(args.plan_timeout) and args.plan_timeout > 0):
        raise InputError("--plan-timeout must be a positive number of seconds")
    if args.timeline is not None:
        folder = args.timeline.parent
        if not folder.is_dir():
            raise InputError(f"--timeline {args.timeline}: no directory {folder} to write it in")
        if args.timeline.is_dir():
            raise InputError(f"--timeline {args.timeline}: a directory, not a file")
    for name in ("device_min", "device_lease"):
        value = getattr(args, name, None)
        if value is None:
            continue
        option = "--" + name.replace("_", "-")
        try:
            setattr(args, name, parse_size(value))
        except ValueError as e:
            raise InputError(f"{option}: {e}") from None
        if getattr(args, name) <= 0:
            raise InputError(f"{option} must be a positive size")
    if getattr(args, "recognise_shapes", False) and args.page is None:
        raise InputError(
            "--recognise-shapes switches plans at an iteration's first allocation, which a"
            " swapping session does only when paged: give --page too"
        )
    if getattr(args, "device_min", None) is not None:
        if args.page is None:
            raise InputError("--device-min makes an elastic lease, which needs --page")
        if getattr(args, "device_lease", None) is not None:
            raise InputError("--device-min (elastic) and --device-lease (fixed): give one")
    if args.page is not None:
        try:
            args.page = parse_size(args.page)
        except ValueError as e:
            raise InputError(f"--page: {e}") from None
        if args.page < OS_PAGE or args.page & (args.page - 1) or CHUNK % args.page:
            raise InputError(
                f"--page {args.page} bytes: a power of two from {OS_PAGE} bytes (the OS page)"
                f" to {format_size(CHUNK)} (the daemon's chunk)"
            )


def check_backend(args: argparse.Namespace, socket_dir: Path | None) -> None:
    """InputError (or ReplayError, without CuPy) when the daemon this run would start on cuda
    cannot run it."""
    if args.backend != "cuda" or socket_dir is not None:
        return
    if args.page is not None and args.page != CHUNK:
        raise InputError(
            f"--page {format_size(args.page)} on cuda: a page there is a whole chunk of"
            f" the daemon's ({format_size(CHUNK)}), because CUDA maps a VMM handle only"
            f" from its first byte: use --page {CHUNK >> 20}MiB"
        )
    need_cupy()


def lease_bytes(peak: int) -> int:
    """Device (and host) lease for a replay whose unconstrained peak is `peak`: the peak and a
    quarter more (alignment and best-fit's fragmentation while learning), whole chunks."""
    return align_up(peak + peak // 4 + CHUNK, CHUNK)


@contextlib.contextmanager
def private_daemon(backend: str, peak: int, say: Callable[[str], None]) -> Iterator[Path]:
    """A daemon of `backend` for this run only, with pools for one lease of each kind."""
    from tidalclient.local import LocalDaemon

    directory = Path(tempfile.mkdtemp(prefix="tp-replay-", dir="/tmp"))
    pool = str(lease_bytes(peak))
    say(f"starting a {backend} daemon in {directory}")
    try:
        try:
            daemon = LocalDaemon.start(
                directory,
                device_pool=pool,
                host_pool=pool,
                default_lease=pool,
                extra=("--plan-after-iterations", str(LEARNING_ITERATIONS)),
                backend=backend,
                chunk_size=str(CHUNK),
            )
        except RuntimeError as e:
            raise ReplayError(f"could not start a {backend} daemon: {e}") from None
        try:
            yield directory
        finally:
            daemon.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def open_session(
    args: argparse.Namespace, directory: Path, limit: int, peak: int, say: Callable[[str], None]
) -> tuple[Session, int]:
    """The replay's session at the daemon of `directory`, leases sized from `peak`, under the
    swap limit `limit`; and the limit it keeps to (a paged session's is at most its lease)."""
    from tidalclient.errors import AttachError
    from tidalclient.local import is_serving
    from tidalclient.session import attach

    if not is_serving(directory):
        raise ReplayError(f"no daemon answers at {directory}")
    lease = lease_bytes(peak)
    floor, fixed = getattr(args, "device_min", None), getattr(args, "device_lease", None)
    try:
        session = attach(
            directory,
            device_limit=None if floor is not None else fixed or lease,
            device_min=floor,
            device_max=max(lease, floor) if floor is not None else None,
            host_limit=lease,
            job_name=os.environ.get("TIDALPOOL_JOB_NAME") or "tidalpool-replay",
            swap_limit=limit,
            copy_gbps=args.copy_gbps,
            async_compute=True,
            page_bytes=args.page,
            recognise_shapes=getattr(args, "recognise_shapes", False),
        )
    except AttachError as e:
        raise ReplayError(f"the daemon at {directory} refused the session: {e}") from None
    lease_text = (
        f"an elastic lease of {format_size(floor)} to {format_size(max(lease, floor))}"
        if floor is not None
        else f"leases of {format_size(fixed or lease)} and {format_size(lease)}"
    )
    say(f"session {session.id}: {lease_text}, swap limit {format_size(limit)}")
    swap = session.stats().swap
    if args.page and floor is None and swap is not None and swap.limit < limit:  # the lease's
        say(f"the limit is the lease's {format_size(swap.limit)}: no more pages can be mapped")
        limit = swap.limit
    return session, limit


def compute_of(session: Session) -> Compute:
    """The stream the replay's ops run on: a timed wait on sim, a kernel on cuda."""
    if session.cuda is None:
        return SimCompute(session.compute)
    return CudaCompute(session.compute, session.cuda.ordinal)
