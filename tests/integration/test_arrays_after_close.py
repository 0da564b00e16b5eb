"""An array is the job's until it lets go: after `close()`, with the daemon alive or killed,
it still reads its own bytes (never zeros in their place), and its writes reach no chunk the
pool leases to anyone else."""

from __future__ import annotations

import time

import numpy as np
import tidalpool
from tidalclient.local import LocalDaemon

from ..conftest import StartDaemon


def filled(s: tidalpool.Session, n: int, value: float) -> np.ndarray:
    a = s.array(n, "float32")
    a[:] = value
    return a


def test_arrays_keep_their_bytes_after_a_killed_daemon_and_close(daemon: LocalDaemon) -> None:
    s = tidalpool.attach(daemon.socket_dir, device_limit="4MiB", job_name="checkpointing")
    weights = filled(s, 1000, 3.25)
    view = weights[10:20]  # a view keeps the array's bytes alive too
    daemon.process.kill()
    daemon.process.wait()
    deadline = time.monotonic() + 30
    while not s.closed:
        assert time.monotonic() < deadline, "the session never learned its daemon died"
        time.sleep(0.01)
    assert float(weights.sum()) == 3250.0  # readable while the job holds the lease
    s.close()
    assert float(weights.sum()) == 3250.0 and float(view.sum()) == 32.5
    weights[:] = 1.0  # private memory now: writable, and nobody else's
    assert float(view.sum()) == 10.0


def test_arrays_kept_after_close_reach_no_chunk_of_the_next_session(
    start_daemon: StartDaemon,
) -> None:
    d = start_daemon("--device-pool", "4MiB", "--default-device-lease", "4MiB")
    s = tidalpool.attach(d.socket_dir, device_limit="4MiB")
    kept = filled(s, 1000, 7.0)
    s.close()
    with tidalpool.attach(d.socket_dir, device_limit="4MiB") as again:  # the same chunks
        fresh = again.array(1000, "float32")
        assert not fresh.any()  # scrubbed for the next session, not the old bytes
        fresh[:] = 2.0
        kept[:] = 5.0
        assert float(fresh.sum()) == 2000.0 and float(kept.sum()) == 5000.0


def test_a_paged_session_keeps_its_arrays_bytes_after_close(daemon: LocalDaemon) -> None:
    s = tidalpool.attach(daemon.socket_dir, swap_limit="2MiB", page_bytes="64KiB")
    a = filled(s, 5000, 1.5)
    s.close()
    assert float(a.sum()) == 7500.0
