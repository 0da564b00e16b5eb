"""The daemon's planner in a process of its own: the plans it makes are the ones made in the
daemon's thread, what it logs and counts reaches the daemon, and a process that is killed,
stopped past a plan's deadline or ends between plans costs at most the plan it was making."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tidalcore.events import Events
from tidalcore.unplanned import FAILED, PlanUnavailable
from tidalpoold.plan_worker import PlanWorker
from tidalpoold.planning import (
    Job,
    Made,
    Planner,
    PlannerProcess,
    PlannerStopped,
    PlanningFailed,
)
from tidalpoold.sessions import Registry
from tidalpoold.trace import decode_chunk

from . import test_plan_worker
from .test_plan_worker import HIDE, C, chunk, end, session, settings_in, told

registry = test_plan_worker.registry  # sessions with a device lease of one chunk (C bytes)

DEADLINE_S = 60.0  # for a process to start, or a plan to come, on a busy machine


def wait_for(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.01)


def state(pid: int) -> str:
    """Process `pid`'s state letter (/proc/PID/stat), "" once reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


def gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie, or reaped)."""
    return state(pid) in ("Z", "")


def stopped(pid: int) -> bool:
    return state(pid) == "T"


def job(shape: str = "", budget_s: float = 30.0) -> Job:
    """HIDE's plan under a swap limit of 1500 bytes at 1 GB/s."""
    message = chunk(HIDE, {})
    events = Events.concat([decode_chunk(message)], dict(message.new_names))
    return Job("s1", events, shape, False, 1500, 1.0, False, C, C, budget_s)


@pytest.fixture
def process(tmp_path: Path) -> Iterator[PlannerProcess]:
    p = PlannerProcess(settings_in(tmp_path))
    yield p
    p.close()


def test_the_process_makes_the_plan_the_thread_makes(
    process: PlannerProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Made in the process or by a Planner here (another cache: both solve), HIDE's plan is
    the same update; a defect the process finds in the cache is logged and counted here."""
    made = process.run(job())
    here = Planner(settings_in(tmp_path / "here")).run(job())
    assert isinstance(made, Made) and isinstance(here, Made)
    assert made.update == here.update and list(made.update.swap_blocks) == [0]
    assert (made.source, made.height, made.lower_bound) == (here.source, 1024, 1024)
    (entry,) = (tmp_path / "plans").glob("*.plan")
    entry.write_bytes(b"not a plan")
    with caplog.at_level(logging.WARNING, logger="tidalpoold.planning"):
        again = process.run(job())
    assert isinstance(again, Made) and again.update == made.update and again.source != "cache"
    (defect,) = [r for r in caplog.records if r.getMessage() == "plan.cache_defect"]
    assert defect.key == entry.stem and process.defects == 1
    assert process.restarts == 0


def test_what_the_planner_raises_fails_the_plan_alone(process: PlannerProcess) -> None:
    pid = process.pid
    with pytest.raises(PlanningFailed, match=r"^NoIteration: the trace held has no whole"):
        process.run(job(shape="nope"))
    assert isinstance(process.run(job()), Made)
    assert (process.pid, process.restarts) == (pid, 0)


def test_a_process_killed_between_plans_is_replaced_before_the_next(
    process: PlannerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    pid = process.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: gone(pid), "ended")
    with caplog.at_level(logging.WARNING, logger="tidalpoold.planning"):
        assert isinstance(process.run(job()), Made)
    assert process.restarts == 1 and process.pid not in (None, pid)
    (record,) = [r for r in caplog.records if r.getMessage() == "plan.planner_stopped"]
    assert (record.how, record.when) == ("killed by signal 9", "between plans")


def test_a_process_killed_under_a_plan_fails_that_plan_alone(process: PlannerProcess) -> None:
    """Stopped first, so that the plan cannot be done before the kill."""
    pid = process.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: stopped(pid), "stopped")
    failed: list[BaseException] = []

    def plan() -> None:
        try:
            process.run(job())
        except PlannerStopped as e:
            failed.append(e)

    planning = threading.Thread(target=plan)
    planning.start()
    wait_for(lambda: process._busy is not None, "planning")
    os.kill(pid, signal.SIGKILL)
    planning.join()
    assert [str(e) for e in failed] == [
        "the planner's process ended while making this plan (killed by signal 9)"
    ]
    assert isinstance(process.run(job()), Made) and process.restarts == 1


def test_a_plan_past_its_deadline_is_stopped_and_the_session_told(
    registry: Registry, tmp_path: Path
) -> None:
    """The daemon's worker with its planner in a process: that process stopped (as one stuck
    in extraction would be), the plan is cut 0.2 s past its deadline of 0.1 s, the session is
    told, and the next plan is made in a new process."""
    settings = settings_in(tmp_path, plan_time_limit_s=0.1, plan_deadline_s=0.1)
    planner = PlannerProcess(settings, grace_s=0.2)
    worker = PlanWorker(settings, planners=[planner])
    try:
        pid = planner.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: stopped(pid), "stopped")
        s = session(registry, swap_limit=1500)
        worker._plan_quietly(s)
        (said,) = told(s)
        assert said.kind == FAILED and said.limit_bytes == 1500
        assert said.reason.startswith("planning failed: the planner was stopped ")
        assert said.reason.endswith(
            " s into the plan, 0.2 s past what was left of the daemon's deadline for a plan"
            " (its setting plan_deadline_s)"
        )
        assert said == PlanUnavailable(1500, FAILED, said.reason)
        assert worker.plans_failed == 1 and planner.restarts == 1 and planner.pid != pid
        assert isinstance(planner.run(job()), Made)  # a whole budget: time to start
        end(registry, s)
    finally:
        worker.close()


def test_closing_stops_the_process(tmp_path: Path) -> None:
    planner = PlannerProcess(settings_in(tmp_path))
    pid = planner.pid
    assert pid is not None
    planner.close()
    assert gone(pid) and planner.pid is None
    with pytest.raises(PlannerStopped, match="the daemon is stopping"):
        planner.run(job())
