"""A real daemon plans past what a local user put under a plan's name in its cache: a FIFO
(which held the planning thread for good), a plan shifted past the session's lease (which it
sent). Each is logged once as `plan.cache_defect`, the next session of the job runs planned
all the same, and the plan made replaces the entry."""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import tidalpool
from tidalcore.v1 import pool_pb2

from ..conftest import StartDaemon
from .test_planning import iteration, run_until_planned

LEASE = 8 * 1024 * 1024
DEADLINE_S = 60.0  # for a plan on a busy machine; a blocked planning thread never makes one


def shifted_past_the_lease(path: Path, good: bytes) -> None:
    """The plan with every allocation a lease length higher, its height and footprint with
    them: consistent in itself, and all of it outside the session's bytes."""
    plan = pool_pb2.PlanUpdate.FromString(good)
    plan.offsets[:] = [o + LEASE for o in plan.offsets]
    plan.height_bytes += LEASE
    plan.prediction.footprint_bytes += LEASE
    path.write_bytes(plan.SerializeToString())


HOSTILE: dict[str, tuple[Callable[[Path, bytes], object], str]] = {
    "a FIFO": (lambda path, good: os.mkfifo(path), "why=not a regular file but a FIFO"),
    "a plan shifted past the lease": (
        shifted_past_the_lease,
        r"why=refused by wire\.check: ValueError: piece \d+ \(allocation \d+'s first\) lies at"
        rf" \[{LEASE}, \d+\) of the arena, past the {LEASE} bytes of the session's device lease",
    ),
}


def release(path: Path) -> None:
    """Open a FIFO at `path` for writing and close it: a daemon thread blocked opening it for
    reading goes on, and the daemon can stop."""
    with contextlib.suppress(OSError):  # no FIFO there, or no reader: nothing to release
        if stat.S_ISFIFO(os.lstat(path).st_mode):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_cache_entry_is_logged_once_and_the_job_planned_anew(
    start_daemon: StartDaemon, name: str
) -> None:
    plant, why = HOSTILE[name]
    d = start_daemon()
    with tidalpool.attach(d.socket_dir, device_limit=LEASE) as s:
        run_until_planned(s, DEADLINE_S)
    (path,) = (d.socket_dir / "plans").glob("*.plan")
    good = path.read_bytes()
    path.unlink()
    plant(path, good)
    try:
        with tidalpool.attach(d.socket_dir, device_limit=LEASE) as s:
            run_until_planned(s, DEADLINE_S)
            for _ in range(3):
                iteration(s)
            assert s.stats().plan_misses == 0
    finally:
        release(path)
    lines = d.log_path.read_text().splitlines()
    (defect,) = [line for line in lines if "plan.cache_defect" in line]
    assert f"path={path}" in defect
    assert re.search(why, defect), defect
    assert not [line for line in lines if "plan.failed" in line]
    sent = [line for line in lines if "plan.sent" in line]
    assert len(sent) == 2 and "source=cache" not in sent[1]
    # The plan made replaces the entry: a regular file holding the first run's plan.
    assert stat.S_ISREG(os.lstat(path).st_mode)
    assert path.read_bytes() == good
