"""A real daemon that cannot plan a session says why on its stream, once, and the session shows
it in `stats()`: here a swap limit under the op-wise bound, with that bound as the lowest limit
that could work."""

from __future__ import annotations

import logging
import time

import pytest
import tidalpool
from tidalclient.local import LocalDaemon
from tidalcore.events import ALLOC, FREE, OP, READ, WRITE
from tidalcore.unplanned import UNDER_OP_BOUND, PlanUnavailable

KiB = 1024
W, A, B = 64 * KiB, 128 * KiB, 32 * KiB  # the persistent weight; two blocks of each iteration
BOUND = W + A + B  # op "fwd" reads W and A and writes B: the most bytes one op touches
LIMIT = 160 * KiB  # under BOUND, over every single block
ITERATIONS = 4  # the daemon plans after three step marks


def test_a_limit_under_the_op_wise_bound_is_told_with_the_exact_bound(
    daemon: LocalDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    # The executor refuses an op over the limit, so the trace is written as the recorder would
    # send it: the daemon only ever sees the trace.
    with (
        caplog.at_level(logging.WARNING, logger="tidalpool"),
        tidalpool.attach(
            daemon.socket_dir, device_limit="1MiB", host_limit="1MiB", swap_limit=LIMIT
        ) as s,
    ):
        record = s.recorder.record
        fwd, bwd = s.recorder.name_id("fwd"), s.recorder.name_id("bwd")
        record(ALLOC, 1, W)
        for n in range(ITERATIONS):
            s.recorder.step(n)
            a, b = 10 + 2 * n, 11 + 2 * n
            record(ALLOC, a, A)
            record(ALLOC, b, B)
            record(READ, 1)
            record(READ, a)
            record(WRITE, b)
            record(OP, 0, 0, 1_000_000, fwd)
            record(FREE, a)
            record(READ, b)
            record(OP, 0, 0, 500_000, bwd)
            record(FREE, b)
        s.recorder.flush()
        deadline = time.monotonic() + 30
        while s.plan_unavailable is None:
            assert time.monotonic() < deadline, "the daemon said nothing of its plan"
            time.sleep(0.01)
        stats = s.stats()
    expected = PlanUnavailable(
        LIMIT,
        UNDER_OP_BOUND,
        "swap limit 160 KiB is under the op-wise bound 224 KiB, the bytes one op needs on the"
        " device at once: no plan fits it",
        BOUND,
    )
    assert stats.plan_unavailable == expected
    assert (stats.plans_received, stats.mode) == (0, "learning")
    assert [r.getMessage() for r in caplog.records] == [
        f"tidalpool: session {s.id}: the daemon cannot plan this session: {expected.reason};"
        " the lowest limit that could work is 224 KiB (229376 bytes)"
    ]
    log = daemon.log_path.read_text()
    assert "plan.unfit" in log and "plan.sent" not in log
