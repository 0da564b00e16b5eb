"""The sim backend's copy-bandwidth probe, and the plan worker planning at what it measured."""

from __future__ import annotations

import ctypes
import math
import mmap
import threading

import pytest
from tidalpoold.backends import SimBackend
from tidalpoold.backends.bandwidth import gbps, repeats_for, significant
from tidalpoold.backends.memfd import resident_bytes
from tidalpoold.backends.sim import PROBE_REPEATS, probe_copies, time_copies
from tidalpoold.plan_worker import DEFAULT_COPY_GBPS, copy_gbps_of

C = 2 * 1024 * 1024  # one chunk


def test_the_sim_backend_measures_both_copy_directions_at_start() -> None:
    backend = SimBackend(4 * C, 3 * C, C)
    try:
        facts = backend.facts()
        for way in ("h2d_gbps", "d2h_gbps"):
            value = facts[way]
            assert isinstance(value, float) and math.isfinite(value) and value > 0, facts
            assert significant(value) == value  # two significant figures: a stable cache key
        # The span is the smaller pool (3 chunks), copied until 256 MiB moved each way.
        assert backend.bandwidth.bytes_each_way == 3 * C * math.ceil(256 * 2**20 / (3 * C))
        # The probe gave the pages it touched back: both pools are sparse, as never used.
        assert facts["resident_bytes"] == 0
        assert sum(resident_bytes(c) for c in backend.host.chunks) == 0
    finally:
        backend.close()


def test_unthrottled_sessions_are_planned_at_the_slower_direction_sim_measured() -> None:
    backend = SimBackend(2 * C, 2 * C, C)
    try:
        facts = backend.facts()
        slower = min(float(facts["h2d_gbps"]), float(facts["d2h_gbps"]))
        assert copy_gbps_of(backend) == slower > 0
    finally:
        backend.close()


def test_probe_bytes_0_skips_the_probe_and_the_planner_assumes_its_default() -> None:
    backend = SimBackend(2 * C, 2 * C, C, probe_bytes=0)
    try:
        facts = backend.facts()
        assert (facts["h2d_gbps"], facts["d2h_gbps"]) == (0.0, 0.0)
        assert backend.bandwidth.bytes_each_way == 0
        assert copy_gbps_of(backend) == DEFAULT_COPY_GBPS
    finally:
        backend.close()


def test_the_probe_span_is_clamped_to_the_smaller_pool_and_copied_at_least_five_times() -> None:
    backend = SimBackend(2 * C, 3 * C, C, probe_bytes=1 << 30, probe_total=4 * C)
    try:
        assert PROBE_REPEATS == 5
        assert backend.bandwidth.bytes_each_way == 5 * 2 * C  # 2 chunks, 5 > 4C / 2C copies
    finally:
        backend.close()


def test_a_probe_beyond_a_pool_is_refused() -> None:
    backend = SimBackend(2 * C, 2 * C, C, probe_bytes=0)
    try:
        with pytest.raises(ValueError, match="probe span of 6291456 bytes"):
            probe_copies(backend.device, backend.host, 3 * C, C)
        with pytest.raises(ValueError, match="probe span of 0 bytes"):
            probe_copies(backend.device, backend.host, 0, C)
    finally:
        backend.close()


def test_the_probed_chunks_read_zeros_afterwards() -> None:
    backend = SimBackend(2 * C, 2 * C, C, probe_bytes=0)
    try:
        for pool in (backend.device, backend.host):
            with mmap.mmap(pool.chunks[0].fd, C) as m:
                m[:] = b"\xab" * C  # as if a session had left bytes there
        probe_copies(backend.device, backend.host, 2 * C, 2 * C)
        for pool in (backend.device, backend.host):
            for chunk in pool.chunks:
                assert resident_bytes(chunk) == 0
                with mmap.mmap(chunk.fd, C) as m:
                    assert m[:] == bytes(C)
    finally:
        backend.close()


def test_time_copies_moves_the_bytes_on_a_worker_thread_and_times_each_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src = (ctypes.c_char * 4096).from_buffer_copy(bytes(range(256)) * 16)
    dst = (ctypes.c_char * 4096)()
    threads: list[str] = []
    real = ctypes.memmove

    def memmove(d: int, s: int, n: int) -> int:
        threads.append(threading.current_thread().name)
        return int(real(d, s, n))

    monkeypatch.setattr(ctypes, "memmove", memmove)
    a, b = ctypes.addressof(dst), ctypes.addressof(src)
    times = time_copies({"there": (a, b), "back": (b, a)}, 4096, 3)
    assert dst.raw == src.raw == bytes(range(256)) * 16
    assert {way: len(t) for way, t in times.items()} == {"there": 3, "back": 3}
    assert all(t > 0 for t in times["there"] + times["back"])
    assert threads == ["tidalpool-probe"] * 8  # one warm-up each way, then 3 rounds of two


def test_two_significant_figures() -> None:
    assert significant(8.537) == 8.5
    assert significant(12.34) == 12.0
    assert significant(123.4) == 120.0
    assert significant(0.01234) == 0.012
    assert significant(9.96) == 10.0
    assert (significant(0.0), significant(-3.456)) == (0.0, -3.5)


def test_repeats_and_gbps() -> None:
    assert repeats_for(64, 512) == 8
    assert repeats_for(64, 500) == 8
    assert repeats_for(64, 64, least=5) == 5
    assert repeats_for(1 << 30, 8) == 1
    with pytest.raises(ValueError):
        repeats_for(0, 8)
    assert gbps(10**9, 1000.0) == 1.0
    with pytest.raises(ValueError):
        gbps(5, 0.0)
