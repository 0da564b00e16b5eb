"""A session's link to the daemon: Attach, the Session stream, and its two threads.

    Attach (gRPC) ──▶ Session stream ──▶ out: heartbeats, trace chunks, step marks (send)
                                     ◀── in:  plans (on_plan), why none (on_unplanned),
                                              quota changes (on_quota), refusals, goodbye
                  ──▶ flush: the outbox handed to the stream, then Stats until the daemon has
                             the whole trace ──▶ Detach

The listener thread reads what the daemon sends; the heartbeat thread sends the session's
counts every `heartbeat_interval_ms`. Nothing here knows of blocks or arrays: plans are handed
on as they came, heartbeats are asked for when due.

Detach is a call of its own, not a message on the stream: the daemon could end the session
before its reader has taken in the trace chunks still in flight, so `flush` waits until the
daemon's own count (Stats) says it has them all.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
from tidalcore import __version__
from tidalcore.v1 import pool_pb2, pool_pb2_grpc
from tidalcore.wire import GRPC_SOCKET, STREAM_OPEN_KEY, TOKEN_KEY

from tidalclient.errors import AttachError

log = logging.getLogger("tidalpool")


RECONNECT = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 1000)]
"""The session channel's reconnection: a connection refused while the daemon's socket is
crowded (its backlog full under a flood of connections) is tried again within 50 ms, backing
off to a second, until the call's deadline."""


class Connection:
    """The gRPC side of one session (its token in every call's metadata)."""

    def __init__(
        self, socket_dir: Path, session_id: str, token: str, daemon_uid: int | None = None
    ) -> None:
        """`daemon_uid`: the uid the handles socket's peer ran as; the token goes only to a
        gRPC socket that uid made (a socket someone else put there would receive it)."""
        path = socket_dir / GRPC_SOCKET
        if daemon_uid is not None:
            try:
                owner = os.stat(path).st_uid
            except OSError as e:
                raise AttachError(f"cannot reach tidalpoold at {path}: {e.strerror}") from e
            if owner != daemon_uid:
                raise AttachError(
                    f"{path} belongs to uid {owner}, but the daemon that granted the lease runs"
                    f" as uid {daemon_uid}: refusing to send it the session's token"
                )
        self.session_id = session_id
        self._metadata = ((TOKEN_KEY, token),)
        self._channel = grpc.insecure_channel(f"unix:{path}", options=RECONNECT)
        self._stub = pool_pb2_grpc.PoolStub(self._channel)
        self._outbox: queue.SimpleQueue[pool_pb2.ClientMessage | None] = queue.SimpleQueue()
        self._flow = threading.Condition()  # guards the two counts below and `goodbye` changes
        self._queued = 0  # messages put in the outbox
        self._taken = 0  # of them, handed to the stream
        self._backlog_events = 0  # trace events in the outbox
        self._responses: Iterator[pool_pb2.ServerMessage] | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.goodbye: pool_pb2.Goodbye | None = None  # how the daemon ended the session
        self.errors: list[pool_pb2.SessionError] = []  # messages the daemon refused

    def attach(
        self, swap_limit: int | None, copy_gbps: float | None, page_bytes: int = 0
    ) -> pool_pb2.AttachResponse:
        """Confirm the lease (AttachError when the daemon refuses), then open the stream;
        `page_bytes` > 0: the session is paged (virtual residency)."""
        try:
            reply: pool_pb2.AttachResponse = self._stub.Attach(
                pool_pb2.AttachRequest(
                    client_version=__version__,
                    pid=os.getpid(),
                    swap_limit_bytes=swap_limit or 0,
                    copy_gbps=copy_gbps or 0.0,
                    page_bytes=page_bytes,
                ),
                metadata=self._metadata,
                timeout=10,
                wait_for_ready=True,  # the daemon is there (it granted the lease): connect again
            )
        except grpc.RpcError as e:
            raise AttachError(f"Attach failed ({e.code().name}): {e.details()}") from e
        responses = self._stub.Session(self._outgoing(), metadata=self._metadata)
        # The daemon sends headers once the stream is the session's: from then on every end of
        # the session (a shutdown included) reaches this client as a Goodbye on it.
        if (STREAM_OPEN_KEY, "1") not in (responses.initial_metadata() or ()):
            code, details = responses.code(), responses.details()
            raise AttachError(f"session stream refused ({code.name}): {details}")
        self._responses = responses
        return reply

    def start(
        self,
        on_plan: Callable[[pool_pb2.PlanUpdate], None],
        on_unplanned: Callable[[pool_pb2.PlanUnavailable], None],
        on_end: Callable[[], None],
        heartbeat: Callable[[], pool_pb2.Heartbeat],
        interval_s: float,
        on_quota: Callable[[pool_pb2.QuotaChange], None] | None = None,
    ) -> None:
        """Start the listener (plans to `on_plan`, the daemon's word that it cannot make one
        to `on_unplanned`, an elastic lease's quota changes to `on_quota`, `on_end()` once the
        session is over) and the heartbeats (`heartbeat()` every `interval_s`)."""
        self._threads = [
            threading.Thread(
                target=self._listen,
                args=(on_plan, on_unplanned, on_end, on_quota),
                name="tidalpool-listen",
                daemon=True,
            ),
            threading.Thread(
                target=self._beat,
                args=(heartbeat, interval_s),
                name="tidalpool-heartbeat",
                daemon=True,
            ),
        ]
        for t in self._threads:
            t.start()

    def send(self, message: pool_pb2.ClientMessage) -> None:
        """Queue a message on the stream (any thread)."""
        events = len(message.trace.kinds) if message.HasField("trace") else 0
        with self._flow:
            self._queued += 1
            self._backlog_events += events
        self._outbox.put(message)

    def backlog_events(self) -> int:
        """Trace events queued on the stream and not yet handed to it (a daemon that does
        not read makes them pile up)."""
        with self._flow:
            return self._backlog_events

    @property
    def ended(self) -> bool:
        """The daemon ended the session (Goodbye), or the stream broke."""
        return self.goodbye is not None

    def events_received(self) -> int:
        """What the daemon has received of the trace; -1 when it does not answer."""
        try:
            reply = self._stub.Stats(pool_pb2.StatsRequest(), metadata=self._metadata, timeout=10)
        except grpc.RpcError:
            return -1
        return int(reply.session.events_received)

    def flush(self, events: int, steps: int, timeout_s: float) -> int:
        """Wait until the outbox has been handed to the stream and the daemon has taken in
        `events` trace events and `steps` step marks, for at most `timeout_s`; the events the
        daemon has confirmed (-1: it did not answer). Short of them, one warning says how many
        are missing, unless the daemon ended the session meanwhile (then nothing waits for
        them)."""
        deadline = time.monotonic() + timeout_s
        with self._flow:
            target = self._queued
            self._flow.wait_for(
                lambda: self._taken >= target or self.goodbye is not None, timeout=timeout_s
            )
        received, why = self._received(events, steps, deadline) if events or steps else (0, "")
        if received < events and not self.ended:
            log.warning(
                "tidalpool: session %s detaches with %d of its %d trace events not delivered"
                " to the daemon (%s)",
                self.session_id,
                events - max(received, 0),
                events,
                why or f"waited {timeout_s:g} s",
            )
        return received

    def _received(self, events: int, steps: int, deadline: float) -> tuple[int, str]:
        """Ask the daemon (Stats) until it has `events` and `steps`, the deadline passes, the
        session ends or the daemon does not answer: the events it has (-1: no answer), and
        why it did not answer."""
        received, pause = -1, 0.001
        while not self.ended:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                reply = self._stub.Stats(
                    pool_pb2.StatsRequest(), metadata=self._metadata, timeout=left
                )
            except grpc.RpcError as e:  # gone, or the session ended under us
                return received, f"it did not answer: {e.code().name}"
            received = int(reply.session.events_received)
            if received >= events and reply.session.iterations_seen >= steps:
                break
            time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
            pause = min(2 * pause, 0.05)
        return received, ""

    def detach(self, last: pool_pb2.Heartbeat) -> None:
        """End the session with the daemon (nothing if it already ended it)."""
        try:
            request = pool_pb2.DetachRequest(last=last)
            self._stub.Detach(request, metadata=self._metadata, timeout=10)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAUTHENTICATED:  # already ended daemon-side
                log.warning("tidalpool: Detach failed: %s", e.details())

    def close(self) -> None:
        """Stop both threads and close the channel."""
        self._stop.set()
        self._outbox.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        self._channel.close()

    # -- background -----------------------------------------------------------------------
    def _outgoing(self) -> Iterator[pool_pb2.ClientMessage]:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            with self._flow:
                self._taken += 1
                if msg.HasField("trace"):
                    self._backlog_events -= len(msg.trace.kinds)
                if self._taken >= self._queued:
                    self._flow.notify_all()
            yield msg

    def _listen(
        self,
        on_plan: Callable[[pool_pb2.PlanUpdate], None],
        on_unplanned: Callable[[pool_pb2.PlanUnavailable], None],
        on_end: Callable[[], None],
        on_quota: Callable[[pool_pb2.QuotaChange], None] | None,
    ) -> None:
        assert self._responses is not None
        try:
            for msg in self._responses:
                body = msg.WhichOneof("body")
                if body == "goodbye":
                    self._end(msg.goodbye)
                    on_end()
                elif body == "plan":
                    on_plan(msg.plan)
                elif body == "unplanned":
                    on_unplanned(msg.unplanned)
                elif body == "quota":
                    if on_quota is None:
                        log.warning(
                            "tidalpool: the daemon changed the quota of a fixed lease: ignored"
                        )
                    else:
                        on_quota(msg.quota)
                elif body == "error":
                    self.errors.append(msg.error)
                    log.warning(
                        "tidalpool: daemon refused a message: %s %s",
                        msg.error.code,
                        msg.error.message,
                    )
        except grpc.RpcError as e:
            if not self._stop.is_set() and self.goodbye is None:
                self._end(pool_pb2.Goodbye(message=stream_broke(e.code())))
                on_end()

    def _end(self, goodbye: pool_pb2.Goodbye) -> None:
        """The session is over: nothing waits for the outbox any longer."""
        with self._flow:
            self.goodbye = goodbye
            self._flow.notify_all()

    def _beat(self, heartbeat: Callable[[], pool_pb2.Heartbeat], interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.send(pool_pb2.ClientMessage(heartbeat=heartbeat()))


def stream_broke(code: grpc.StatusCode) -> str:
    """Why the session ended when its stream broke without a Goodbye: UNAVAILABLE is the
    daemon gone (killed, crashed, or its machine away), since any end it chose is a Goodbye."""
    if code == grpc.StatusCode.UNAVAILABLE:
        return (
            "the daemon went away without ending the session (killed or crashed?); its lease"
            " is gone"
        )
    return f"the session's stream to the daemon broke ({code.name})"
