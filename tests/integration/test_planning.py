"""A real daemon learns a session's iteration, plans it, and the client runs from the plan."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import tidalpool

from ..conftest import StartDaemon
from .ready import measured_copy_gbps

KiB = 1024


def iteration(s: tidalpool.Session) -> None:
    """A small forward/backward tide: activations live until their gradient is made."""
    s.step()
    acts = [s.malloc(size * KiB) for size in (64, 32, 96, 16)]
    grads = []
    for block in reversed(acts):
        grads.append(s.malloc(block.size))
        s.free(block)
    for block in grads:
        s.free(block)


def run_until_planned(s: tidalpool.Session, limit: float = 20.0) -> int:
    """Iterate until the session runs planned; returns the iterations it took."""
    deadline, n = time.monotonic() + limit, 0
    while s.stats().mode != "planned":
        assert time.monotonic() < deadline, "no plan arrived"
        iteration(s)
        n += 1
        time.sleep(0.01)
    return n


def test_the_next_run_of_the_same_job_gets_its_plan_from_the_cache(
    start_daemon: StartDaemon,
) -> None:
    d = start_daemon()
    for _ in range(2):
        with tidalpool.attach(d.socket_dir, device_limit="8MiB") as s:
            run_until_planned(s)
    sources = [line for line in d.log_path.read_text().splitlines() if "plan.sent" in line]
    assert len(sources) == 2
    assert "source=cache" not in sources[0]
    assert "source=cache" in sources[1]


def test_a_corrupted_cached_plan_is_refused_and_solved_again(start_daemon: StartDaemon) -> None:
    from tidalcore.v1 import pool_pb2

    d = start_daemon()
    with tidalpool.attach(d.socket_dir, device_limit="8MiB") as s:
        run_until_planned(s)
    (cached,) = (d.socket_dir / "plans").glob("*.plan")
    plan = pool_pb2.PlanUpdate.FromString(cached.read_bytes())
    plan.offsets[:] = [0] * len(plan.offsets)  # every allocation on top of the others
    cached.write_bytes(plan.SerializeToString())
    with tidalpool.attach(d.socket_dir, device_limit="8MiB") as s:
        run_until_planned(s)
        for _ in range(3):
            iteration(s)
        assert s.stats().plan_misses == 0
    log = d.log_path.read_text()
    assert "plan.cache_defect" in log
    assert "source=cache" not in log


def test_a_plan_without_a_swap_limit_is_cached_whatever_the_copy_bandwidth(
    start_daemon: StartDaemon,
) -> None:
    """Nothing is copied without a swap limit: sessions unthrottled and throttled get the
    same plan, made once and then taken from the cache."""
    from tidalcore.v1 import pool_pb2

    d = start_daemon()
    for gbps in (None, 3.0, 3.0):
        with tidalpool.attach(d.socket_dir, device_limit="8MiB", copy_gbps=gbps) as s:
            run_until_planned(s)
    sources = [line for line in d.log_path.read_text().splitlines() if "plan.sent" in line]
    assert ["source=cache" in line.split() for line in sources] == [False, True, True]
    plans = [
        pool_pb2.PlanUpdate.FromString(path.read_bytes())
        for path in (d.socket_dir / "plans").glob("*.plan")
    ]
    # No swap limit: every block placed whole, as version 2 with the simulator's prediction.
    # Made for the unthrottled session: at the bandwidth the sim backend measured at start.
    assert [p.prediction.copy_gbps for p in plans] == [measured_copy_gbps(d)]
    for p in plans:
        assert (p.version, p.limit_bytes, len(p.swap_blocks)) == (2, 0, 0)
        # The peak, placed without a gap: the 64, 32 and 96 KiB activations with the gradients
        # of the 16 and the 96. No ops: no time.
        assert p.prediction.footprint_bytes == p.prediction.peak_bytes == p.height_bytes
        assert p.height_bytes == 304 * KiB
        assert (p.prediction.step_ns, p.prediction.stall_ns) == (0, 0)


def planner_of(pid: int) -> int:
    """The pid of daemon `pid`'s planner process (a spawned child, beside multiprocessing's
    resource tracker)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise AssertionError(f"daemon {pid} has no planner process")


def test_plans_are_made_in_a_process_that_a_kill_does_not_end_planning_for(
    start_daemon: StartDaemon,
) -> None:
    """The daemon's planner is a process of its own: killed (SIGKILL) between plans, the next
    session's plan is made by a new one, and the daemon says so in its log."""
    d = start_daemon()
    with tidalpool.attach(d.socket_dir, device_limit="8MiB") as s:
        run_until_planned(s)
    first = planner_of(d.process.pid)
    os.kill(first, signal.SIGKILL)
    with tidalpool.attach(d.socket_dir, device_limit="8MiB", swap_limit="4MiB") as s:  # not cached
        run_until_planned(s)
    assert planner_of(d.process.pid) != first
    log = d.log_path.read_text()
    assert "plan.planner_stopped" in log and "killed by signal 9" in log
    assert len([line for line in log.splitlines() if "plan.sent" in line]) == 2
    assert "source=cache" not in log
