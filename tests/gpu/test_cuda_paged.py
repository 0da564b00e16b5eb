"""A paged session on the cuda backend: every block keeps its device address while its pages
(2 MiB VMM pages of the lease's chunks) go to the host lease and come back, and the daemon's
version-3 plan runs under the limit with the tensors' values intact."""

from __future__ import annotations

import pytest
import tidalpool

from ..conftest import StartDaemon

MiB = 1 << 20


def test_a_paged_cuda_session_runs_the_daemons_plan_and_keeps_its_values(
    start_daemon: StartDaemon,
) -> None:
    cp = pytest.importorskip("cupy")
    pytest.importorskip("cuda.bindings")
    daemon = start_daemon(backend="cuda", chunk_size="2MiB")
    with tidalpool.attach(
        daemon.socket_dir,
        device_limit="64MiB",
        host_limit="64MiB",
        swap_limit="10MiB",
        page_bytes="2MiB",
    ) as s:
        assert s.page_bytes == 2 * MiB
        layers = [s.tensor((1024, 1024), "float32") for _ in range(3)]  # 4 MiB, two pages each
        for i, w in enumerate(layers):
            with s.op(writes=[w], name="init") as (w_,):
                w_[:] = i + 1
        seen: list[int] = []
        for iteration in range(10):
            s.step()
            if iteration == 4:
                assert s.wait_for_plan(timeout_s=120) is not None, s.plan_unavailable
            x = s.tensor((512, 1024), "float32")  # 2 MiB: one page
            with s.op(writes=[x], name="load") as (x_,):
                x_[:] = 1.0
            for w in layers:  # 10 MiB: x, one layer and y at a time
                y = s.tensor((512, 1024), "float32")
                with s.op(reads=[x, w], writes=[y], name="matmul") as (x_, w_, y_):
                    cp.matmul(x_, w_, out=y_)
                    seen.append(w_.data.ptr)
                s.release(x)
                x = y
            with s.op(reads=[x], name="check") as (x_,):
                assert float(x_[0, 0]) == 1024.0**3 * 6  # 1 · 1024·1 · 1024·2 · 1024·3
            s.release(x)
        stats = s.stats()
        assert stats.mode == "planned"
        swap = stats.swap
        assert swap is not None and swap.peak_resident_bytes <= 10 * MiB
        assert swap.planned_out_bytes > 0 and swap.schedule_skips == 0
        # each layer was at one device address however often its pages moved
        assert len(set(seen)) == 3 and len(seen) == 30
