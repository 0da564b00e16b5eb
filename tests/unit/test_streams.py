"""Sim streams and events: real copies, stream order, cross-stream waits, throttling, shutdown."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from tidalclient.devices.streams import Elapsed, Stream, StreamError


@pytest.fixture
def streams() -> Iterator[list[Stream]]:
    """Streams made by the test; all closed at the end (no thread outlives a test)."""
    made: list[Stream] = []
    yield made
    for s in made:
        s.close()
    assert not any(s._thread.is_alive() for s in made)


def buffers(n: int, *sizes: int) -> list[np.ndarray]:
    rng = np.random.default_rng(n)
    return [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]


def test_copies_bytes_between_addresses(streams: list[Stream]) -> None:
    s = Stream("t")
    streams.append(s)
    src, dst = buffers(1, 10_000, 10_000)
    s.copy(dst.ctypes.data + 100, src.ctypes.data + 200, 5_000)
    s.synchronize()
    assert np.array_equal(dst[100:5_100], src[200:5_200])
    assert s.bytes_copied == 5_000


def test_work_runs_in_enqueue_order(streams: list[Stream]) -> None:
    # Three copies into the same bytes: the last one enqueued wins.
    s = Stream("t")
    streams.append(s)
    a, b, c, dst = buffers(2, 4096, 4096, 4096, 4096)
    for src in (a, b, c):
        s.copy(dst.ctypes.data, src.ctypes.data, 4096)
    seen: list[int] = []
    s.launch(lambda: seen.append(int(dst[0])))
    s.synchronize()
    assert np.array_equal(dst, c)
    assert seen == [int(c[0])]


def test_event_completes_after_earlier_work_only(streams: list[Stream]) -> None:
    s = Stream("t")
    streams.append(s)
    gate = threading.Event()
    s.launch(gate.wait)  # holds the stream until the test opens the gate
    event = s.record()
    assert not event.query()
    assert event.wait(timeout=0.01) is False
    gate.set()
    assert event.wait(timeout=10) is True
    assert event.query()


def test_stream_waits_for_another_streams_event(streams: list[Stream]) -> None:
    out, inward = Stream("out"), Stream("in")
    streams += [out, inward]
    device, host = buffers(3, 8192, 8192)
    original = device.copy()
    gate = threading.Event()
    out.launch(gate.wait)
    out.copy(host.ctypes.data, device.ctypes.data, 8192)  # device -> host, held by the gate
    copied = out.record()
    inward.wait_event(copied)  # the in stream must not overwrite the device bytes before
    inward.launch(lambda: device.fill(0))
    done = inward.record()
    assert not done.wait(timeout=0.05)  # blocked behind the other stream's event
    assert np.array_equal(device, original)
    gate.set()
    assert done.wait(timeout=10)
    assert np.array_equal(host, original)
    assert not device.any()


def test_throttled_copy_takes_at_least_bytes_over_bandwidth(streams: list[Stream]) -> None:
    s = Stream("t", gbps=0.5)  # 4 MB at 0.5 GB/s: at least 8 ms
    streams.append(s)
    src, dst = buffers(4, 4_000_000, 4_000_000)
    start = time.perf_counter()
    s.copy(dst.ctypes.data, src.ctypes.data, 4_000_000)
    s.synchronize()
    assert time.perf_counter() - start >= 0.008
    assert np.array_equal(dst, src)


def test_bandwidth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stream bandwidth must be positive, got 0 GB/s"):
        Stream("t", gbps=0)


def test_failure_is_reported_by_the_next_event_only(streams: list[Stream]) -> None:
    s = Stream("t")
    streams.append(s)

    def fail() -> None:
        raise OSError("copy engine on fire")

    s.launch(fail)
    with pytest.raises(StreamError, match="copy engine on fire"):
        s.record().wait()
    s.synchronize()  # the stream goes on; the error was reported once


def test_close_runs_pending_work_then_stops(streams: list[Stream]) -> None:
    s = Stream("t", gbps=1.0)
    src, dst = buffers(5, 1_000_000, 1_000_000)
    s.copy(dst.ctypes.data, src.ctypes.data, 1_000_000)
    event = s.record()
    s.close()
    s.close()  # idempotent
    assert event.query()
    assert np.array_equal(dst, src)
    assert not s._thread.is_alive()
    with pytest.raises(RuntimeError, match="stream t is closed"):
        s.record()


def test_a_stream_knows_when_the_events_it_waited_for_completed(streams: list[Stream]) -> None:
    out, inward = Stream("out"), Stream("in")
    streams += [out, inward]
    gate = threading.Event()
    out.launch(gate.wait)
    copied = out.record()
    inward.wait_event(copied)
    seen: list[int] = []
    inward.launch(lambda: seen.append(inward.ready_ns))
    before = time.perf_counter_ns()
    gate.set()
    inward.synchronize()
    assert seen == [copied.done_ns] and copied.done_ns >= before


def test_an_ops_time_is_its_work_on_the_stream_known_once_it_has_run(
    streams: list[Stream],
) -> None:
    """The host enqueues the op's work and goes on; its time is the stream's, from the event
    recorded as it began to the one as it ended, whenever the host asks."""
    s = Stream("compute")
    streams.append(s)
    gate = threading.Event()
    s.launch(gate.wait)  # earlier work: the op's time starts once it is done
    began = s.timed()
    s.launch(lambda: time.sleep(0.002))  # the op's work
    took = Elapsed(s, began, s.timed(), host_ns=1_000)
    assert not took.ready()
    gate.set()
    assert took.ns() >= 2_000_000
    assert took.ready()


def test_an_ops_time_is_the_hosts_when_its_work_failed(streams: list[Stream]) -> None:
    s = Stream("compute")
    streams.append(s)

    def fail() -> None:
        raise OSError("kernel on fire")

    began = s.timed()
    s.launch(fail)
    took = Elapsed(s, began, s.timed(), host_ns=1_234)
    s.synchronize()
    assert took.ready() and took.ns() == 1_234


def test_an_ops_time_is_the_hosts_when_its_work_does_not_run_within_the_wait(
    streams: list[Stream],
) -> None:
    s = Stream("compute")
    streams.append(s)
    gate = threading.Event()
    began = s.timed()
    s.launch(gate.wait)  # a wedged kernel
    took = Elapsed(s, began, s.timed(), host_ns=5_678)
    assert took.ns(timeout=0) == 5_678
    gate.set()
