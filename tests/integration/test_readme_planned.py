"""The README's first example, run for 20 iterations as its own advice says: once the daemon's
plan arrives, every allocation is served by it (no misses)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tidalpool

from ..conftest import StartDaemon

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_first_example_runs_planned_without_misses(
    start_daemon: StartDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = start_daemon(device_pool="2GiB")
    first = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    assert "for _ in range(3):" in first
    code = first.replace('"/tmp/tidalpool"', repr(str(daemon.socket_dir)))
    code = code.replace("for _ in range(3):", "for _ in range(20):")
    step, sessions = tidalpool.Session.step, []

    def step_then_plan(self: tidalpool.Session) -> int:
        """The example's step(); at the fifth, until the plan of its iteration is in (the
        daemon plans after three), so that the iterations after it run planned."""
        n = step(self)
        sessions.append(self)
        if len(sessions) == 5:
            assert self.wait_for_plan(30) is not None, "no plan arrived"
        return n

    monkeypatch.setattr(tidalpool.Session, "step", step_then_plan)
    exec(compile(code, str(README), "exec"), {})
    stats = sessions[-1].stats()
    assert len(sessions) == 20 and stats.mode == "planned"
    assert (stats.plan_misses, stats.plan_hits) == (0, 2 * 15)
