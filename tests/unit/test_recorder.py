"""Recorder: exact chunks, names, step marks, counters; every event once, in order, under load."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest
from tidalclient.recorder import Recorder
from tidalcore.events import ALLOC, FREE, ITER, OP, READ, WRITE
from tidalcore.v1.pool_pb2 import ClientMessage, StepMark, TraceChunk

Event = tuple[int, int, int, int, int]


class Sink:
    """A `send` that keeps what it is given."""

    def __init__(self) -> None:
        self.messages: list[ClientMessage] = []

    def __call__(self, msg: ClientMessage) -> None:
        self.messages.append(msg)

    @property
    def chunks(self) -> list[TraceChunk]:
        return [m.trace for m in self.messages if m.WhichOneof("body") == "trace"]

    def bodies(self) -> list[str]:
        return [str(m.WhichOneof("body")) for m in self.messages]


def events_of(c: TraceChunk) -> list[Event]:
    return list(zip(c.kinds, c.block_ids, c.sizes, c.durations_ns, c.name_ids, strict=True))


@pytest.fixture
def sink() -> Sink:
    return Sink()


@pytest.fixture
def frequent_switches() -> Iterator[None]:
    """Switch threads every microsecond instead of every 5 ms, so that races show."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.fixture
def recorder(sink: Sink) -> Iterator[Recorder]:
    """A recorder whose drainer only runs when woken (step, close): flush() decides the chunks."""
    r = Recorder(sink, chunk_events=3, period_s=3600)
    yield r
    r.close()


SAMPLE: list[Event] = [
    (ALLOC, 1, 4096, 0, 0),
    (WRITE, 1, 0, 0, 0),
    (OP, 0, 0, 1500, 0),
    (READ, 1, 0, 0, 0),
    (ALLOC, 2, 512, 0, 0),
    (OP, 1, 0, 2500, 0),
    (FREE, 1, 0, 0, 0),
]


def record_all(r: Recorder, events: list[Event]) -> None:
    for kind, block, size, duration, name in events:
        r.record(kind, block, size, duration, name)


def test_flush_sends_columns_split_at_chunk_events(recorder: Recorder, sink: Sink) -> None:
    record_all(recorder, SAMPLE)
    assert recorder.events_recorded == 7
    assert sink.messages == []  # nothing leaves before a drain
    recorder.flush()
    assert sink.bodies() == ["trace", "trace", "trace"]
    chunks = sink.chunks
    assert [events_of(c) for c in chunks] == [SAMPLE[0:3], SAMPLE[3:6], SAMPLE[6:7]]
    assert [c.first_event for c in chunks] == [0, 3, 6]
    assert list(chunks[0].kinds) == [ALLOC, WRITE, OP]
    assert list(chunks[1].durations_ns) == [0, 0, 2500]
    assert all(len(c.new_names) == 0 for c in chunks)
    assert recorder.events_recorded == 7
    assert recorder.events_sent == 7
    assert recorder.chunks_sent == 3


def test_record_defaults_are_zero(recorder: Recorder, sink: Sink) -> None:
    recorder.record(FREE, 42)
    recorder.flush()
    assert [events_of(c) for c in sink.chunks] == [[(FREE, 42, 0, 0, 0)]]


def test_flush_with_nothing_sends_nothing(recorder: Recorder, sink: Sink) -> None:
    recorder.flush()
    assert sink.messages == []
    assert recorder.chunks_sent == 0
    assert recorder.events_sent == 0


def test_successive_flushes_continue_the_numbering(recorder: Recorder, sink: Sink) -> None:
    record_all(recorder, SAMPLE[:2])
    recorder.flush()
    record_all(recorder, SAMPLE[2:])
    assert recorder.events_recorded == 7
    assert recorder.events_sent == 2
    recorder.flush()
    chunks = sink.chunks
    assert [c.first_event for c in chunks] == [0, 2, 5]
    assert [events_of(c) for c in chunks] == [SAMPLE[0:2], SAMPLE[2:5], SAMPLE[5:7]]
    assert recorder.events_sent == 7
    assert recorder.chunks_sent == 3


def test_chunk_of_exactly_chunk_events(recorder: Recorder, sink: Sink) -> None:
    record_all(recorder, SAMPLE[:6])
    recorder.flush()
    assert [len(c.kinds) for c in sink.chunks] == [3, 3]
    assert recorder.chunks_sent == 2


def test_name_ids_are_stable_and_travel_once(recorder: Recorder, sink: Sink) -> None:
    matmul = recorder.name_id("matmul")
    relu = recorder.name_id("relu")
    assert (matmul, relu) == (1, 2)
    assert recorder.name_id("matmul") == 1
    for i in range(4):
        recorder.record(OP, i, duration_ns=10, name_id=matmul if i % 2 == 0 else relu)
    recorder.flush()
    chunks = sink.chunks
    assert [len(c.kinds) for c in chunks] == [3, 1]
    assert dict(chunks[0].new_names) == {1: "matmul", 2: "relu"}
    assert dict(chunks[1].new_names) == {}
    assert list(chunks[0].name_ids) + list(chunks[1].name_ids) == [1, 2, 1, 2]

    softmax = recorder.name_id("softmax")
    assert softmax == 3
    assert recorder.name_id("relu") == 2
    recorder.record(OP, 4, duration_ns=5, name_id=softmax)
    recorder.record(OP, 5, duration_ns=5, name_id=matmul)
    recorder.flush()
    later = sink.chunks[2:]
    assert len(later) == 1
    assert dict(later[0].new_names) == {3: "softmax"}
    assert events_of(later[0]) == [(OP, 4, 0, 5, 3), (OP, 5, 0, 5, 1)]
    all_names: dict[int, str] = {}
    for c in sink.chunks:
        assert not set(c.new_names) & set(all_names)  # no name travels twice
        all_names.update(c.new_names)
    assert all_names == {1: "matmul", 2: "relu", 3: "softmax"}


def test_names_registered_without_events_travel_in_an_empty_chunk(
    recorder: Recorder, sink: Sink
) -> None:
    recorder.record(ALLOC, 1, 256)
    recorder.flush()
    assert recorder.name_id("conv") == 1
    recorder.flush()
    assert len(sink.chunks) == 2
    names_only = sink.chunks[1]
    assert names_only.first_event == 1
    assert dict(names_only.new_names) == {1: "conv"}
    assert list(names_only.kinds) == []
    assert recorder.events_sent == 1
    assert recorder.chunks_sent == 1  # the names-only chunk carries no events
    recorder.flush()
    assert len(sink.messages) == 2  # sent once only


def test_step_mark_follows_the_chunk_of_its_iter_event(recorder: Recorder, sink: Sink) -> None:
    record_all(recorder, SAMPLE[:4])
    recorder.step(0)
    recorder.flush()
    assert recorder.events_sent == 5
    assert sink.bodies() == ["trace", "trace", "step"]
    chunks = sink.chunks
    assert [events_of(c) for c in chunks] == [SAMPLE[0:3], [SAMPLE[3], (ITER, 0, 0, 0, 0)]]
    assert sink.messages[2].step == StepMark(iteration=0, events_before=5)
    assert recorder.chunks_sent == 2


def test_step_marks_count_every_event_before_them(recorder: Recorder, sink: Sink) -> None:
    recorder.step(0)
    recorder.flush()
    recorder.record(ALLOC, 1, 256)
    recorder.record(FREE, 1)
    recorder.step(1)
    recorder.flush()
    recorder.step(2)
    recorder.flush()
    marks = [m.step for m in sink.messages if m.WhichOneof("body") == "step"]
    assert marks == [
        StepMark(iteration=0, events_before=1),
        StepMark(iteration=1, events_before=4),
        StepMark(iteration=2, events_before=5),
    ]
    # Each mark comes after the chunk holding its ITER event.
    sent = 0
    for m in sink.messages:
        if m.WhichOneof("body") == "trace":
            assert m.trace.first_event == sent
            sent += len(m.trace.kinds)
        else:
            assert sent >= m.step.events_before
            iter_index = m.step.events_before - 1
            kinds = [k for c in sink.chunks for k in c.kinds]
            ids = [b for c in sink.chunks for b in c.block_ids]
            assert (kinds[iter_index], ids[iter_index]) == (ITER, m.step.iteration)
    assert sent == 5
    assert recorder.events_sent == 5
    assert recorder.events_recorded == 5


def test_close_sends_what_is_pending(sink: Sink) -> None:
    r = Recorder(sink, chunk_events=2, period_s=3600)
    record_all(r, SAMPLE[:3])
    r.close()
    assert [events_of(c) for c in sink.chunks] == [SAMPLE[0:2], SAMPLE[2:3]]
    assert r.events_sent == 3
    assert r.chunks_sent == 2


def test_drainer_sends_without_flush(sink: Sink) -> None:
    r = Recorder(sink, chunk_events=4, period_s=0.001)
    try:
        record_all(r, SAMPLE)
        for _ in range(2000):
            if r.events_sent == 7:
                break
            threading.Event().wait(0.001)
        assert r.events_sent == 7
        assert [e for c in sink.chunks for e in events_of(c)] == SAMPLE
    finally:
        r.close()


@pytest.mark.usefixtures("frequent_switches")
def test_concurrent_recording_every_event_once_in_order(sink: Sink) -> None:
    n = 200_000
    recording = threading.Event()
    sent_while_recording: list[int] = []

    def send(msg: ClientMessage) -> None:
        if recording.is_set():
            sent_while_recording.append(len(msg.trace.kinds))
        sink(msg)

    r = Recorder(send, chunk_events=4096, period_s=0.001)
    try:

        def produce() -> None:
            recording.set()
            record = r.record
            for i in range(n):
                record(ALLOC, i, 256)
            recording.clear()

        t = threading.Thread(target=produce)
        t.start()
        t.join()
        assert r.events_recorded == n
    finally:
        r.close()
    assert sent_while_recording  # the drainer really ran while events arrived
    chunks = sink.chunks
    assert sink.bodies() == ["trace"] * len(chunks)
    assert all(len(c.kinds) <= 4096 for c in chunks)
    first = 0
    for c in chunks:
        assert c.first_event == first
        first += len(c.kinds)
    ids = [b for c in chunks for b in c.block_ids]
    assert len(ids) == n
    assert ids == list(range(n))
    assert r.events_sent == n
    assert r.events_recorded == n
    assert r.chunks_sent == len(chunks)


@pytest.mark.usefixtures("frequent_switches")
def test_concurrent_steps_follow_their_iter_events(sink: Sink) -> None:
    r = Recorder(sink, chunk_events=1000, period_s=0.001)
    try:

        def produce() -> None:
            for step in range(20):
                for i in range(2500):
                    r.record(ALLOC, i, 256)
                r.step(step)

        t = threading.Thread(target=produce)
        t.start()
        t.join()
    finally:
        r.close()
    kinds: list[int] = []
    ids: list[int] = []
    marks: list[StepMark] = []
    for m in sink.messages:
        if m.WhichOneof("body") == "trace":
            assert m.trace.first_event == len(kinds)
            kinds.extend(m.trace.kinds)
            ids.extend(m.trace.block_ids)
        else:
            assert m.step.events_before <= len(kinds)  # its ITER event was sent before it
            marks.append(m.step)
    assert len(kinds) == 20 * 2501
    assert marks == [StepMark(iteration=k, events_before=2501 * (k + 1)) for k in range(20)]
    for mark in marks:
        assert (kinds[mark.events_before - 1], ids[mark.events_before - 1]) == (
            ITER,
            mark.iteration,
        )
    assert r.events_sent == 20 * 2501


def test_a_daemon_that_stops_taking_the_trace_stops_the_recorder_and_it_says_so(
    sink: Sink, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing the recorder sends is taken (a stopped daemon): once the backlog would pass its
    bound, it sends no more of the trace, ever, drops and counts what it is given, and warns
    once; what it sent before is whole and in order."""
    taken = 0

    def backlog() -> int:
        return sum(len(c.kinds) for c in sink.chunks) - taken

    r = Recorder(sink, chunk_events=4, period_s=3600, backlog=backlog, max_backlog_events=10)
    try:
        with caplog.at_level("WARNING", logger="tidalpool"):
            record_all(r, SAMPLE)  # 7 events: under the bound
            r.flush()
            assert r.events_sent == 7 and not r.stopped
            record_all(r, SAMPLE[:4])  # 7 behind + 4 > 10
            r.flush()
            assert r.stopped and (r.events_sent, r.events_dropped) == (7, 4)
            r.step(1)  # its ITER event and the mark are dropped too
            taken = 7  # the daemon catches up: the trace stays stopped (it would have a hole)
            record_all(r, SAMPLE)
            r.flush()
        assert (r.events_sent, r.events_dropped) == (7, 4 + 1 + 7)
        assert [e for c in sink.chunks for e in events_of(c)] == SAMPLE
        assert "step" not in sink.bodies()
        warnings = [m for m in caplog.messages if "stops sending its trace" in m]
        assert len(warnings) == 1 and "the last 7 trace events" in warnings[0]
    finally:
        r.close()


class Later:
    """An op's duration known once its work has run (`done`): what `Elapsed` is to the
    recorder. `ns()` waits for it, as a stream's does; here the wait completes the work."""

    def __init__(self, ns: int) -> None:
        self.value = ns
        self.done = False
        self.waited = 0

    def ready(self) -> bool:
        return self.done

    def ns(self, timeout: float | None = None) -> int:
        if not self.done:
            self.waited += 1
            self.done = True
        return self.value


def test_events_from_an_op_whose_time_is_not_known_wait_with_their_step_mark(
    recorder: Recorder, sink: Sink
) -> None:
    """The drainer never waits for a stream: it sends the events before the first op whose
    time is not known yet and holds the rest, and the step marks after them, in order."""
    later = Later(7_000)
    recorder.record(ALLOC, 1, 256)
    recorder.record(OP, 0, 0, later, 3)
    recorder.record(FREE, 1)
    recorder.step(0)
    recorder._drain()  # the drainer's pass: no waiting
    assert [e for c in sink.chunks for e in events_of(c)] == [(ALLOC, 1, 256, 0, 0)]
    assert "step" not in sink.bodies() and recorder.events_recorded == 4
    later.done = True  # the work has run
    recorder._drain()
    assert [e for c in sink.chunks for e in events_of(c)] == [
        (ALLOC, 1, 256, 0, 0),
        (OP, 0, 0, 7_000, 3),
        (FREE, 1, 0, 0, 0),
        (ITER, 0, 0, 0, 0),
    ]
    assert sink.bodies()[-1] == "step" and sink.messages[-1].step.events_before == 4
    assert later.waited == 0


def test_flush_waits_for_the_times_of_the_ops_recorded(recorder: Recorder, sink: Sink) -> None:
    later = Later(9_000)
    recorder.record(OP, 0, 0, later, 1)
    recorder.step(0)
    recorder.flush()
    assert later.waited == 1
    assert [e for c in sink.chunks for e in events_of(c)] == [
        (OP, 0, 0, 9_000, 1),
        (ITER, 0, 0, 0, 0),
    ]
    assert sink.bodies()[-1] == "step" and recorder.steps_sent == 1


def test_a_step_whose_shape_is_told_later_holds_the_trace_from_its_iter_event(
    recorder: Recorder, sink: Sink
) -> None:
    """`expect(None)`: the ITER event and the mark wait, with every event after them, until
    `decide` names the shape; both then carry it."""
    recorder.record(ALLOC, 1, 256)
    recorder.expect(None)
    recorder.step(0)
    recorder.record(OP, 0, 0, 100, 0)  # an op before the allocation that tells the shape
    recorder.flush()
    assert [e for c in sink.chunks for e in events_of(c)] == [(ALLOC, 1, 256, 0, 0)]
    assert "step" not in sink.bodies()
    recorder.expect(None)
    with pytest.raises(RuntimeError, match="not told yet"):
        recorder.step(1)  # a second one before the first is told
    recorder.decide("auto-512")
    recorder.record(ALLOC, 2, 512)
    recorder.flush()
    name = recorder.name_id("auto-512")
    assert [e for c in sink.chunks for e in events_of(c)] == [
        (ALLOC, 1, 256, 0, 0),
        (ITER, 0, 0, 0, name),
        (OP, 0, 0, 100, 0),
        (ALLOC, 2, 512, 0, 0),
    ]
    [mark] = [m.step for m in sink.messages if m.WhichOneof("body") == "step"]
    assert mark == StepMark(iteration=0, events_before=2, shape="auto-512")
    with pytest.raises(RuntimeError, match="no step waits for its shape"):
        recorder.decide("again")
