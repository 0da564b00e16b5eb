"""Streams and events of the sim backend, with CUDA's ordering rules, on worker threads.

A `Stream` is one worker thread running its work in the order it was enqueued: byte copies
between two addresses of this process (the device and host mappings of a lease), host functions,
event records and waits on other streams' events. An `Event` recorded on a stream completes once
everything enqueued on that stream before it has run.

    out stream:  [copy D→H]──[copy D→H]──(E1)──[copy D→H]──(E2)
    in stream:   [copy H→D]──wait(E1)──[copy H→D]──(E3)      runs only once E1 has completed

A stream may be throttled to a bandwidth: a copy of n bytes then takes at least n / bandwidth
seconds, like a transfer over PCIe. Copies use `ctypes.memmove`, which releases the GIL.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from tidalcore.units import format_size

from tidalclient.timeline import HOST_TRACK, WAIT

if TYPE_CHECKING:
    from tidalclient.timeline import Timeline

Work = Callable[[], object]


class Completion(Protocol):
    """A recorded event: sim `Event` or `devices.cuda.CudaEvent`."""

    def query(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class CopyStream(Protocol):
    """What the swap engine uses of a stream: sim `Stream` or `devices.cuda.CudaStream`.
    `wait_event` takes an event of the same kind of stream. With a `timeline`, each copy
    adds a span on the track of the stream's name."""

    name: str
    timeline: Timeline | None

    def copy(self, dst: int, src: int, nbytes: int) -> None: ...

    def record(self) -> Completion: ...

    def wait_event(self, event: Any) -> None: ...

    def synchronize(self) -> None: ...

    def close(self) -> None: ...


class TimedStream(Protocol):
    """A stream that times its work: sim `Stream` or `devices.cuda.CudaStream`."""

    def timed(self) -> Any: ...

    def elapsed_ns(self, start: Any, end: Any) -> int: ...


class StreamError(RuntimeError):
    """Work enqueued on a stream failed; the event after it reports the failure."""


class Event:
    """Completes when its stream has run everything enqueued before `Stream.record()`."""

    __slots__ = ("_done", "_error", "done_ns")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.done_ns = 0

    def query(self) -> bool:
        """True once the event has completed (cudaEventQuery); never blocks."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until completed (cudaEventSynchronize); False on timeout. Raises StreamError
        when work before the event failed."""
        if not self._done.wait(timeout):
            return False
        if self._error is not None:
            raise StreamError(f"stream work before this event failed: {self._error!r}")
        return True

    def _complete(self, error: BaseException | None = None) -> None:
        self.done_ns = time.perf_counter_ns()  # when it completed (perf_counter_ns)
        self._error = error
        self._done.set()


class Stream:
    """An in-order queue of work run by its own thread; `gbps` throttles its copies."""

    def __init__(self, name: str, gbps: float | None = None) -> None:
        if gbps is not None and gbps <= 0:
            raise ValueError(f"stream bandwidth must be positive, got {gbps} GB/s")
        self.name = name
        self.gbps = gbps
        self._seconds_per_byte = 0.0 if gbps is None else 1 / (gbps * 1e9)
        self._work: queue.SimpleQueue[Work | None] = queue.SimpleQueue()
        self._error: BaseException | None = None  # the first failure since the last record
        self._closed = False
        self.bytes_copied = 0
        self.ready_ns = 0  # when the last event this stream waited for completed
        self.timeline: Timeline | None = None  # each copy a span on it, when set
        self._thread = threading.Thread(target=self._run, name=f"tidalpool-{name}", daemon=True)
        self._thread.start()

    # -- enqueue ---------------------------------------------------------------------------
    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy `nbytes` from address `src` to address `dst` (cudaMemcpyAsync)."""
        if nbytes < 0:
            raise ValueError(f"copy of {nbytes} bytes")
        self._put(lambda: self._copy(dst, src, nbytes))

    def launch(self, fn: Work) -> None:
        """Run `fn` on the stream's thread in stream order (cudaLaunchHostFunc)."""
        self._put(fn)

    def record(self) -> Event:
        """An event that completes after all work enqueued so far (cudaEventRecord)."""
        event = Event()
        self._put(lambda: self._mark(event))
        return event

    def timed(self) -> Event:
        """A timing event recorded now (every sim event carries when it completed)."""
        return self.record()

    @staticmethod
    def elapsed_ns(start: Event, end: Event) -> int:
        """The stream's time from `start` to `end`, two of its completed timing events."""
        return end.done_ns - start.done_ns

    def wait_event(self, event: Event) -> None:
        """Work enqueued after this call starts only once `event` has completed
        (cudaStreamWaitEvent); the calling thread does not block."""
        self._put(lambda: self._waited(event))

    def synchronize(self) -> None:
        """Block until everything enqueued so far has run (cudaStreamSynchronize)."""
        self.record().wait()

    def close(self) -> None:
        """Run what is enqueued, then stop the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._work.put(None)
        self._thread.join()

    # -- the worker ------------------------------------------------------------------------
    def _put(self, work: Work) -> None:
        if self._closed:
            raise RuntimeError(f"stream {self.name} is closed")
        self._work.put(work)

    def _run(self) -> None:
        while (work := self._work.get()) is not None:
            try:
                work()
            except BaseException as e:  # reported by the next event, never lost
                if self._error is None:
                    self._error = e

    def _waited(self, event: Event) -> None:
        event._done.wait()
        self.ready_ns = max(self.ready_ns, event.done_ns)

    def _mark(self, event: Event) -> None:
        error, self._error = self._error, None
        event._complete(error)

    def _copy(self, dst: int, src: int, nbytes: int) -> None:
        start = time.perf_counter_ns()
        ctypes.memmove(dst, src, nbytes)
        self.bytes_copied += nbytes
        if self._seconds_per_byte:
            left = start / 1e9 + nbytes * self._seconds_per_byte - time.perf_counter()
            if left > 0:
                time.sleep(left)
        timeline = self.timeline
        if timeline is not None:
            end = time.perf_counter_ns()
            timeline.span(self.name, format_size(nbytes), start, end, bytes=nbytes)


class Waits:
    """A swap engine's waits on its copies' events, and where its copies and waits are seen:
    `stall_ns` counts the time the calling thread blocked; with a `timeline`, each wait is a
    span on its host track and the copies of `streams` are spans on theirs."""

    def __init__(self, *streams: CopyStream) -> None:
        self.stall_ns = 0
        self._streams = streams
        self._timeline: Timeline | None = None

    @property
    def timeline(self) -> Timeline | None:
        return self._timeline

    @timeline.setter
    def timeline(self, timeline: Timeline | None) -> None:
        self._timeline = timeline
        for stream in self._streams:
            stream.timeline = timeline

    def wait(self, event: Completion, why: str) -> None:
        """Block until `event` has completed, when it has not: a stall, named `why`."""
        if event.query():
            return
        start = time.perf_counter_ns()
        try:
            event.wait()
        finally:
            end = time.perf_counter_ns()
            self.stall_ns += end - start
            if self._timeline is not None:
                self._timeline.span(HOST_TRACK, WAIT + why, start, end)


class Elapsed:
    """An op's time on the stream its work runs on: from a timing event recorded as the op
    began to one recorded as it ended, known once the stream has passed the second.

    The work runs after the host enqueued it, so the host's clock around the op times only the
    enqueueing; the work's time goes to whichever later wait of the host's meets it: an op that
    reads a result (the op's then), or a swap engine waiting for a copy ordered after the
    kernels (no op's at all). The stream's own clock gives each op its work wherever the host
    waits. `host_ns`, the host's time of the op, stands in when the work failed or did not
    finish within the wait (its failure is for whoever waits on the stream to raise)."""

    __slots__ = ("_end", "_host_ns", "_ns", "_start", "_stream")

    def __init__(self, stream: TimedStream, start: Any, end: Any, host_ns: int) -> None:
        self._stream = stream
        self._start = start
        self._end = end
        self._host_ns = host_ns
        self._ns: int | None = None

    def ready(self) -> bool:
        """Whether `ns()` returns at once (never blocks)."""
        if self._ns is not None:
            return True
        try:
            return bool(self._end.query())
        except RuntimeError:  # the work failed: `ns` falls back at once
            return True

    def ns(self, timeout: float | None = None) -> int:
        """The op's time on its stream, once its work has run (waits at most `timeout`; None:
        as long as it takes)."""
        if self._ns is None:
            try:
                done = bool(self._end.wait(timeout))
                took = self._stream.elapsed_ns(self._start, self._end) if done else -1
            except RuntimeError:  # StreamError, or the driver's CudaError
                took = -1
            self._ns = took if took >= 0 else self._host_ns
        return self._ns
