"""A live timeline: when a session's copies, ops and waits ran, on which stream.

Spans on named tracks, on the host clock (`time.perf_counter_ns`):

    host      ─[wait: copy out]──────        ─[wait: pages]─     the training thread blocked
    compute   ─[op]─[op]─[op]─────[op]─[op]─                     the ops' work
    swap-out        └[out 3.0 MiB]─
    swap-in                   └[in 3.0 MiB]─

Whoever runs the work adds its spans: a sim stream times its copies on its own thread, the
swap engine times each wait of the training thread, the replay times its ops. On cuda the GPU
runs them, so a copy or an op is a pair of timing events (`device_span`); `settle()` puts the
pairs on the host clock once they have completed, through one reference event whose host time
was taken when it completed (`CudaClock`). `chrome()` gives the spans as the Chrome trace event
format's events (`ts` and `dur` in microseconds), one thread per track.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

HOST_TRACK, COMPUTE_TRACK = "host", "compute"  # the copy streams' tracks: their names
TRACKS = (HOST_TRACK, COMPUTE_TRACK, "swap-out", "swap-in")
"""The tracks in the order a viewer shows them; a span on another track goes after them."""
WAIT = "wait: "
"""How the name of a span of the training thread blocked begins (then what it waited for)."""


@dataclass(frozen=True, slots=True)
class Span:
    track: str
    name: str
    start_ns: int  # host clock
    end_ns: int
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Pending:
    """A span of GPU work: the timing events around it, not yet on the host clock."""

    track: str
    name: str
    start: Any  # an event handle of `clock`'s driver
    end: Any
    args: dict[str, Any]


class CudaClock:
    """The host time of GPU timing events: a reference event, recorded on a stream and waited
    for, and the host clock read when it had completed. `elapsed_ms(a, b)`: the driver's
    cuEventElapsedTime."""

    def __init__(
        self, reference: Any, host_ns: int, elapsed_ms: Callable[[Any, Any], float]
    ) -> None:
        self.reference = reference
        self.host_ns = host_ns
        self._elapsed_ms = elapsed_ms

    def at(self, event: Any) -> int:
        """The host time at which `event` completed (it must have)."""
        return self.host_ns + round(self._elapsed_ms(self.reference, event) * 1e6)


class Timeline:
    """Spans added from any thread; `settle` and `chrome` from one, once the work is done."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._pending: list[_Pending] = []
        self._lock = threading.Lock()
        self.clock: CudaClock | None = None  # set by whoever adds device spans

    @staticmethod
    def now() -> int:
        return time.perf_counter_ns()

    def span(self, track: str, name: str, start_ns: int, end_ns: int, **args: Any) -> None:
        """Something that ran on `track` from `start_ns` to `end_ns` (host clock)."""
        with self._lock:
            self.spans.append(Span(track, name, start_ns, end_ns, args))

    def device_span(self, track: str, name: str, start: Any, end: Any, **args: Any) -> None:
        """GPU work between two recorded timing events (`settle` times it)."""
        with self._lock:
            self._pending.append(_Pending(track, name, start, end, args))

    def settle(self) -> None:
        """Put the device spans on the host clock: call once their events have completed
        (after a synchronize). ValueError when there are some and no `clock`."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        clock = self.clock
        if clock is None:
            raise ValueError("device spans without a clock to put them on the host's")
        for p in pending:
            self.span(p.track, p.name, clock.at(p.start), clock.at(p.end), **p.args)

    def chrome(self, pid: int, name: str, origin_ns: int = 0) -> list[dict[str, Any]]:
        """The spans as Chrome trace events of process `pid` called `name`, one thread per
        track, times from `origin_ns`."""
        with self._lock:
            spans = sorted(self.spans, key=lambda s: (s.start_ns, s.end_ns))
        tracks = list(TRACKS) + sorted({s.track for s in spans} - set(TRACKS))
        events = names(pid, name, dict(enumerate(tracks, start=1)))
        tid_of = {track: tid for tid, track in enumerate(tracks, start=1)}
        for s in spans:
            events.append(
                {
                    "ph": "X",
                    "cat": s.track,
                    "name": s.name,
                    "pid": pid,
                    "tid": tid_of[s.track],
                    "ts": (s.start_ns - origin_ns) / 1000,
                    "dur": max(0, s.end_ns - s.start_ns) / 1000,
                    "args": s.args,
                }
            )
        return events

    def busy_ns(self, track: str, start_ns: int, end_ns: int, prefix: str = "") -> int:
        """Nanoseconds of `track`'s spans (those whose name starts with `prefix`) inside
        [start_ns, end_ns), overlaps counted once."""
        with self._lock:
            parts = sorted(
                (max(s.start_ns, start_ns), min(s.end_ns, end_ns))
                for s in self.spans
                if s.track == track
                and s.end_ns > start_ns
                and s.start_ns < end_ns
                and s.name.startswith(prefix)
            )
        total, reach = 0, start_ns
        for a, b in parts:
            if b > reach:
                total += b - max(a, reach)
                reach = b
        return total


def names(pid: int, name: str, tracks: Mapping[int, str]) -> list[dict[str, Any]]:
    """The Chrome trace metadata events that name process `pid` `name` and each of its
    threads (`tracks`: tid → name), and keep them in the order of their ids."""

    def meta(what: str, tid: int, args: dict[str, Any]) -> dict[str, Any]:
        return {"ph": "M", "name": what, "pid": pid, "tid": tid, "args": args}

    events = [
        meta("process_name", 0, {"name": name}),
        meta("process_sort_index", 0, {"sort_index": pid}),
    ]
    for tid, track in tracks.items():
        events.append(meta("thread_name", tid, {"name": track}))
        events.append(meta("thread_sort_index", tid, {"sort_index": tid}))
    return events
