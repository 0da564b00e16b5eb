"""Planned execution and swapping, the same on every backend."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import tidalpool
from tidalclient.local import LocalDaemon

from ..integration.test_planning import iteration, run_until_planned
from .conftest import fill, host_copy

KiB = 1024


def test_a_learned_iteration_is_planned_and_served_without_misses(
    backend: str, pool_daemon: LocalDaemon
) -> None:
    d = pool_daemon
    with tidalpool.attach(d.socket_dir, device_limit="8MiB") as s:
        learning = run_until_planned(s)
        assert learning >= 3  # the daemon plans after 3 step marks
        assert s.stats().plan_hits == 8  # the first planned iteration: all 8 allocations hit
        for _ in range(5):
            iteration(s)
        stats = s.stats()
        assert (stats.mode, stats.plan_hits, stats.plan_misses) == ("planned", 48, 0)
        # 208 KiB of activations, then each gradient is made before its activation goes:
        # the peak is 208 + 96 KiB, and the plan (at offset 0: nothing else is live) reaches it
        assert stats.footprint_bytes == 304 * KiB
    log = d.log_path.read_text()
    assert "plan.sent" in log and "source=" in log
    assert list((d.socket_dir / "plans").glob("*.plan"))


def digest(view: Any) -> str:
    return hashlib.sha256(host_copy(view).tobytes()).hexdigest()


def test_swap_round_trips_keep_every_byte(backend: str, pool_daemon: LocalDaemon) -> None:
    """Tensors four times the limit, filled with random bytes, swapped out and in over and over
    (device chunks to host chunks and back): every checksum holds, the limit is never passed."""
    rng = np.random.default_rng(5)
    with tidalpool.attach(
        pool_daemon.socket_dir, device_limit="4MiB", host_limit="4MiB", swap_limit=64 * KiB
    ) as s:
        tensors = [s.tensor((4096,), "float32") for _ in range(16)]  # 16 KiB each, 256 KiB
        sums = []
        for t in tensors:
            with s.op(writes=[t], name="fill") as (v,):
                fill(v, rng.standard_normal(4096, dtype=np.float32))
                sums.append(digest(v))
        for _ in range(3):
            for i in rng.permutation(len(tensors)):
                with s.op(reads=[tensors[i]], name="check") as (v,):
                    assert digest(v) == sums[i]
        stats = s.stats()
        assert stats.swap is not None
        assert stats.swap.peak_resident_bytes <= 64 * KiB
        assert stats.swap.swap_ins >= 3 * 16 - 4  # nearly every read brought a tensor back
        assert stats.swap.swapped_in_bytes == stats.swap.swap_ins * 16 * KiB
        assert stats.live_blocks == 16
