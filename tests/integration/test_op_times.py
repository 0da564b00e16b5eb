"""Op times of work that runs on a stream, as the daemon learns them, with and without a limit.

The ops here enqueue their work on the session's compute stream and return, as CuPy's kernels
do on cuda, and the last op of each iteration reads a result (the host waits for the stream, as
`float(loss)` does). Without a limit that wait is the only one, inside an op; under a swap limit
the swap engine's waits for copies ordered after the kernels come first, between the ops, and
timed on the host clock the work went to none of them (the H200 run of bench/gpu.py: a planned
compute of 9 ms per iteration for 28 ms of kernels).
"""

from __future__ import annotations

import time

import pytest
import tidalpool
from tidalclient.local import LocalDaemon

KiB = 1024
WORK_NS = 2_000_000  # each layer's work on the compute stream
LAYERS = 4
SIZE = 32 * KiB


def work() -> None:
    """At least WORK_NS on the compute stream's thread."""
    end = time.perf_counter_ns() + WORK_NS
    while (left := end - time.perf_counter_ns()) > 0:
        time.sleep(left / 1e9)


@pytest.mark.parametrize("swap_limit", [None, 7 * SIZE], ids=["no limit", "limit"])
def test_the_daemon_learns_each_ops_time_on_its_stream(
    daemon: LocalDaemon, swap_limit: int | None
) -> None:
    with tidalpool.attach(
        daemon.socket_dir,
        device_limit="2MiB",
        host_limit="2MiB",
        swap_limit=swap_limit,
        async_compute=True,
    ) as s:
        compute = s.compute
        weights = [s.tensor(SIZE, "uint8") for _ in range(LAYERS)]  # 9 blocks of SIZE at peak
        for _ in range(4):  # the daemon plans after 3 step marks
            s.step()
            acts = [s.tensor(SIZE, "uint8")]
            for k in range(LAYERS):
                out = s.tensor(SIZE, "uint8")
                with s.op(reads=[weights[k], acts[-1]], writes=[out], name=f"layer{k}"):
                    compute.launch(work)  # enqueued: the op's body returns at once
                acts.append(out)
            with s.op(reads=[acts[-1]], name="loss"):
                compute.synchronize()  # the host reads the result
            for a in acts:
                s.release(a)
        s.step()
        plan = s.wait_for_plan(30)
        assert plan is not None and plan.prediction is not None
        # every op's work counted once: on its stream, whoever waited for it on the host
        assert plan.prediction.baseline_ns >= LAYERS * WORK_NS
