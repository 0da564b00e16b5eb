"""The recorder: trace events from the hot path to the daemon, in the background.

`record()` is one list append (no lock, no I/O). A drainer thread takes what
has accumulated every few milliseconds, packs it into columnar `TraceChunk`s
and hands them to the session stream, followed by any step marks, in order.

    malloc/free/op ──append──▶ [pending events] ──drain──▶ TraceChunk ──▶ stream

A daemon that stops taking the stream (stopped, hung) must not make the job hold its trace
without a bound: once the events sent and not yet taken (`backlog()`) would pass
`max_backlog_events`, the recorder stops sending the trace for good, drops what it is given
from then on (`events_dropped`) and says so once. The session goes on, with the plan it has;
the daemon learns no more of it (a trace with a hole would teach it a wrong iteration).

An op timed on the stream its work runs on has a `Later` duration, known once that work has
run: the drainer sends the events up to the first op whose time is not known yet, and the step
marks up to there; the rest waits for a later drain (`flush` and `close` wait for the work).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from tidalcore.events import ITER
from tidalcore.v1 import pool_pb2


class Later(Protocol):
    """A duration known once work enqueued on a stream has run (`devices.streams.Elapsed`)."""

    def ready(self) -> bool:
        """Whether `ns()` returns at once."""
        ...

    def ns(self, timeout: float | None = None) -> int:
        """The duration, waiting for the work as needed (at most `timeout`, then a stand-in)."""
        ...


Duration = int | Later
Event = tuple[int, int, int, Duration, int]  # kind, block id, size, duration ns, name id

log = logging.getLogger("tidalpool")

MAX_BACKLOG_EVENTS = 1_000_000
"""Trace events sent and not yet taken by the stream past which the recorder stops (about
20 MB of packed chunks; a daemon keeps at most `max_trace_events`, 1 million by default, of a
session's trace)."""
SETTLE_S = 60.0
"""How long `flush` and `close` wait in all for the work of the ops recorded (a stream's), after
which each op still running is sent with its host time (a wedged GPU does not hold the session's
end)."""
SHAPES_AHEAD = 4096
"""Shapes of step marks not yet made that the recorder keeps (`expect`): the native ring's marks
are made when it is drained, a few steps behind at most."""


class TraceSink(Protocol):
    """Where executors and the native ring put their events (a `Recorder`, or a test's list)."""

    def record(
        self, kind: int, block_id: int, size: int = 0, duration_ns: Duration = 0, name_id: int = 0
    ) -> None: ...

    def step(self, iteration: int, live: Sequence[tuple[int, int, bool]] = ()) -> None: ...


class Recorder:
    def __init__(
        self,
        send: Callable[[pool_pb2.ClientMessage], None],
        chunk_events: int = 4096,
        period_s: float = 0.01,
        backlog: Callable[[], int] | None = None,
        max_backlog_events: int = MAX_BACKLOG_EVENTS,
    ) -> None:
        self._send = send
        self.chunk_events = chunk_events
        self.period_s = period_s
        self._backlog = backlog  # trace events `send` has and the stream has not taken
        self.max_backlog_events = max_backlog_events
        self.stopped = False  # the trace is no longer sent (the daemon stopped taking it)
        self.events_dropped = 0
        self._pending: list[Event] = []
        self._names: dict[str, int] = {}
        self._new_names: dict[int, str] = {}
        self._steps: list[pool_pb2.StepMark] = []
        # Shapes of the iterations the next step marks begin, in order (`expect`): a mark made
        # on another thread (the native ring's) takes the shape given when its step was. None:
        # told later (`decide`).
        self._shapes: deque[str | None] = deque(maxlen=SHAPES_AHEAD)
        # The mark whose shape is not told yet, and its ITER event's number in the trace: the
        # trace is sent up to that event, not past it, until `decide`.
        self._undecided: tuple[pool_pb2.StepMark, int] | None = None
        self._lock = threading.Lock()  # drainer vs. step/flush; never taken by record()
        self._wake = threading.Event()
        self._stopped = False
        self.source: Callable[[], object] | None = None  # called before each drain (native path)
        self.events_sent = 0
        self.chunks_sent = 0
        self.steps_sent = 0
        self._thread = threading.Thread(target=self._run, name="tidalpool-recorder", daemon=True)
        self._thread.start()

    # -- hot path -----------------------------------------------------------------
    def record(
        self, kind: int, block_id: int, size: int = 0, duration_ns: Duration = 0, name_id: int = 0
    ) -> None:
        self._pending.append((kind, block_id, size, duration_ns, name_id))

    def name_id(self, name: str) -> int:
        """A small id for an op name; new names travel with the next chunk."""
        found = self._names.get(name)
        if found is None:
            with self._lock:
                found = self._names.setdefault(name, len(self._names) + 1)
                self._new_names[found] = name
        return found

    # -- boundaries ---------------------------------------------------------------
    @property
    def events_recorded(self) -> int:
        with self._lock:
            return self.events_sent + len(self._pending)

    def expect(self, shape: str | None) -> None:
        """The shape of the iteration the next step mark not yet made begins (StepMark.shape);
        a mark with none expected is of shape "". None: `decide` tells it, later (the trace
        waits for it)."""
        self._shapes.append(shape)

    def decide(self, shape: str) -> None:
        """The shape of the iteration begun by the step whose shape was not told (`expect(None)`):
        its mark and ITER event take it, and the trace goes on from there."""
        name = self.name_id(shape) if shape else 0
        with self._lock:
            if self._undecided is None:
                raise RuntimeError("no step waits for its shape")
            mark, event = self._undecided
            i = self._index(event)
            if 0 <= i < len(self._pending):  # else dropped with the trace (`stopped`)
                kind, iteration, size, duration, _ = self._pending[i]
                self._pending[i] = (kind, iteration, size, duration, name)
            mark.shape = shape
            self._undecided = None
        self._wake.set()

    def step(self, iteration: int, live: Sequence[tuple[int, int, bool]] = ()) -> None:
        """Mark an iteration boundary after every event recorded so far: an ITER event named
        by the iteration's shape (`expect`; no name for ""), and a step mark; `live`: under
        virtual residency, every live block as (id, address, owns whole pages)."""
        shape = self._shapes.popleft() if self._shapes else ""
        mark = pool_pb2.StepMark(iteration=iteration, shape=shape or "")
        for block_id, address, owning in live:
            mark.live_block_ids.append(block_id)
            mark.live_addresses.append(address)
            mark.live_owning.append(owning)
        name = self.name_id(shape) if shape else 0
        with self._lock:  # the drainer sends no ITER of a shape not told yet
            if shape is None:
                if self._undecided is not None:
                    raise RuntimeError("the shape of the step before is not told yet (`decide`)")
                self._undecided = (mark, self._number(len(self._pending)))
            self._pending.append((ITER, iteration, 0, 0, name))
            mark.events_before = self.events_sent + len(self._pending)
            self._steps.append(mark)
        self._wake.set()

    def flush(self) -> None:
        """Send everything recorded so far (synchronously; ops timed on a stream are waited
        for)."""
        self._drain(settle=True)

    def close(self) -> None:
        """Stop the drainer and hand everything still pending to `send` (the last chunk and
        step marks): what is sent after this is what the session recorded."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)
        self._drain(settle=True)

    # -- drainer ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self.period_s)
            self._wake.clear()
            self._drain()

    def _drain(self, settle: bool = False) -> None:
        """Send what is known; `settle`: wait for the times of the ops recorded so far first
        (outside the lock: `step` never waits for a stream)."""
        source = self.source
        if source is not None:  # events kept elsewhere (the native ring) come in first
            source()
        if settle:
            deadline = time.monotonic() + SETTLE_S
            for event in self._pending[:]:
                if not isinstance(event[3], int):
                    event[3].ns(max(0.0, deadline - time.monotonic()))
        with self._lock:
            n = len(self._pending) if self.stopped else self._known()
            batch = self._pending[:n]
            del self._pending[:n]  # appends after index n survive: only this thread deletes
            new_names, self._new_names = self._new_names, {}
            steps, self._steps = self._steps, []
            if not self.stopped and self._backlog is not None and n:
                behind = self._backlog()
                if behind + n > self.max_backlog_events:
                    self.stopped = True
                    log.warning(
                        "tidalpool: the daemon has not taken the last %d trace events of this"
                        " session: it stops sending its trace (what it records from now on is"
                        " dropped and counted in events_dropped); it goes on with the plan it"
                        " has, and the daemon learns no more of it",
                        behind,
                    )
            if self.stopped:
                self.events_dropped += n
                return
            for start in range(0, n, self.chunk_events):
                part = batch[start : start + self.chunk_events]
                self._send(pool_pb2.ClientMessage(trace=self._pack(part, new_names)))
                new_names = {}
                self.events_sent += len(part)
                self.chunks_sent += 1
            if new_names:  # names registered with no events yet
                self._send(pool_pb2.ClientMessage(trace=self._pack([], new_names)))
            for k, mark in enumerate(steps):
                if mark.events_before > self.events_sent:  # its events wait for their times
                    self._steps[:0] = steps[k:]
                    break
                self._send(pool_pb2.ClientMessage(step=mark))
                self.steps_sent += 1

    def _known(self) -> int:
        """How many pending events, from the first, have their durations known and follow no
        step whose shape is not told yet. Under the lock."""
        pending = self._pending
        end = len(pending)
        if self._undecided is not None:
            end = self._index(self._undecided[1])
        for i in range(end):
            duration = pending[i][3]
            if not isinstance(duration, int) and not duration.ready():
                return i
        return end

    def _number(self, index: int) -> int:
        """The number in the trace of the pending event at `index` (counting those sent and
        those dropped). Under the lock."""
        return self.events_sent + self.events_dropped + index

    def _index(self, number: int) -> int:
        """Where the event numbered `number` is pending (out of range: sent or dropped)."""
        return number - self._number(0)

    def _pack(self, events: list[Event], new_names: dict[int, str]) -> pool_pb2.TraceChunk:
        chunk = pool_pb2.TraceChunk(first_event=self.events_sent, new_names=new_names)
        if events:
            kinds, ids, sizes, durations, names = zip(*events, strict=True)
            chunk.kinds.extend(kinds)
            chunk.block_ids.extend(ids)
            chunk.sizes.extend(sizes)
            chunk.durations_ns.extend(d if isinstance(d, int) else d.ns() for d in durations)
            chunk.name_ids.extend(names)
        return chunk
