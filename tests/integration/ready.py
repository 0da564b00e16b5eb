"""What a daemon said of its backend at start: the facts of its `daemon.ready` log line."""

from __future__ import annotations

import ast
import re

from tidalclient.local import LocalDaemon


def ready_facts(daemon: LocalDaemon) -> dict[str, str | int | float]:
    """The backend's facts as `daemon.ready` logged them (text log format)."""
    (ready,) = [line for line in daemon.log_path.read_text().splitlines() if "daemon.ready" in line]
    found = re.search(r" facts=(\{[^}]*\})", ready)
    assert found is not None, ready
    facts: dict[str, str | int | float] = ast.literal_eval(found[1])
    return facts


def measured_copy_gbps(daemon: LocalDaemon) -> float:
    """The slower copy direction the daemon's backend measured at start: what it plans
    unthrottled sessions at."""
    facts = ready_facts(daemon)
    slower = min(float(facts["h2d_gbps"]), float(facts["d2h_gbps"]))
    assert slower > 0, facts
    return slower
