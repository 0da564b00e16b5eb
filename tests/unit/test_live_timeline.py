"""The live timeline (`tidalclient.timeline`): spans from any thread, device spans put on the
host clock, the Chrome trace events, and the parts that add spans (a sim stream's copies, a
CUDA stream's copies, the swap engine's waits)."""

from __future__ import annotations

import ctypes

import pytest
from tidalclient.devices.cuda import CudaStream
from tidalclient.devices.streams import Stream
from tidalclient.timeline import HOST_TRACK, TRACKS, WAIT, CudaClock, Timeline
from tidalcore.cuda_driver import DevicePtr

from .fake_cuda import FakeDriver


def test_chrome_events_name_each_track_and_put_spans_on_it_from_the_origin() -> None:
    t = Timeline()
    t.span("swap-in", "in 1 MiB", 5_000, 9_000, bytes=1 << 20)
    t.span("compute", "mm", 1_000, 4_000)
    t.span("custom", "x", 2_000, 2_500)
    events = t.chrome(3, "measured", origin_ns=1_000)
    names = {
        e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert list(names) == [*TRACKS, "custom"]  # the known tracks first, in their order
    spans = [e for e in events if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["ts"], e["dur"]) for e in spans] == [
        ("mm", names["compute"], 0.0, 3.0),
        ("x", names["custom"], 1.0, 0.5),
        ("in 1 MiB", names["swap-in"], 4.0, 4.0),
    ]
    assert spans[2]["args"] == {"bytes": 1 << 20} and all(e["pid"] == 3 for e in events)


def test_busy_time_counts_overlaps_once_inside_the_window_and_by_name() -> None:
    t = Timeline()
    t.span(HOST_TRACK, "iteration 4 (steady)", 0, 100)
    t.span(HOST_TRACK, WAIT + "copy in, for an op", 10, 30)
    t.span(HOST_TRACK, WAIT + "the oldest copy, for its pages", 20, 50)
    t.span(HOST_TRACK, WAIT + "copy in, for an op", 90, 120)
    assert t.busy_ns(HOST_TRACK, 0, 100) == 100
    assert t.busy_ns(HOST_TRACK, 0, 100, prefix=WAIT) == 40 + 10  # [10, 50) and [90, 100)
    assert t.busy_ns("compute", 0, 100) == 0


def test_device_spans_are_put_on_the_host_clock_from_the_reference() -> None:
    elapsed = {("ref", "a"): 1.5, ("ref", "b"): 2.25}
    t = Timeline()
    t.device_span("compute", "op", "a", "b", tick=3)
    with pytest.raises(ValueError, match="without a clock"):
        t.settle()
    t = Timeline()
    t.device_span("compute", "op", "a", "b", tick=3)
    t.clock = CudaClock("ref", 1_000_000, lambda x, y: elapsed[(x, y)])
    t.settle()
    assert [(s.start_ns, s.end_ns, s.args) for s in t.spans] == [
        (2_500_000, 3_250_000, {"tick": 3})
    ]
    t.settle()  # nothing left to settle
    assert len(t.spans) == 1


def test_a_sim_stream_puts_each_copy_on_its_track() -> None:
    src = (ctypes.c_ubyte * 4096)(*range(256), *([7] * 3840))
    dst = (ctypes.c_ubyte * 4096)()
    stream = Stream("swap-out")
    try:
        stream.timeline = t = Timeline()
        stream.copy(ctypes.addressof(dst), ctypes.addressof(src), 4096)
        stream.copy(ctypes.addressof(dst), ctypes.addressof(src), 1024)
        stream.synchronize()
    finally:
        stream.close()
    assert bytes(dst) == bytes(src)
    spans = t.spans
    assert [(s.track, s.args["bytes"]) for s in spans] == [("swap-out", 4096), ("swap-out", 1024)]
    assert spans[0].start_ns <= spans[0].end_ns <= spans[1].start_ns <= spans[1].end_ns


def test_a_cuda_stream_times_each_copy_with_events_when_a_timeline_is_set() -> None:
    fake = FakeDriver(h2d_gbps=25.0)
    fake.open_device(0)
    device = int(fake.mem_alloc(1 << 20))
    host = ctypes.create_string_buffer(1 << 20)
    stream = CudaStream(fake, "swap-in", "h2d")
    stream.copy(device, ctypes.addressof(host), 4096)  # no timeline: no span, no event
    records = sum(1 for c in fake.calls if c[0] == "event_record")
    stream.timeline = t = Timeline()
    t.clock = stream.clock()
    stream.copy(device, ctypes.addressof(host), 50_000)
    stream.synchronize()
    t.settle()
    [span] = t.spans
    assert span.track == "swap-in" and span.args == {"bytes": 50_000}
    # The fake copies at 25 GB/s: 50,000 bytes take 2,000 ns between the two events.
    assert span.end_ns - span.start_ns == 2_000
    assert t.clock.host_ns <= span.start_ns
    assert sum(1 for c in fake.calls if c[0] == "event_record") == records + 1 + 2 + 1
    stream.close()
    fake.mem_free(DevicePtr(device))
