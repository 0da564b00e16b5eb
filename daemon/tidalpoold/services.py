"""The Pool and Admin services over the session registry.

A client's refused stream message is answered on its stream (while fewer than
MAX_QUEUED_ERRORS replies wait there: one that does not read gets no more), but logged only
the first LOGGED_BAD_MESSAGES times per session, then at each power of two with the count:
a client sending bad messages in a loop costs the log a line per doubling.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
from tidalcore.errors import Failure, InvalidArgument, Unauthenticated, status_of
from tidalcore.v1 import admin_pb2, pool_pb2
from tidalcore.wire import STREAM_OPEN_KEY, TOKEN_KEY

from tidalpoold import __version__
from tidalpoold.plan_worker import PlanWorker
from tidalpoold.rpc import bidi_stream, parse, service, unary
from tidalpoold.sessions import (
    SESSION_ID_CHARS,
    Reason,
    Registry,
    Session,
    clip,
    lease_message,
    live_blocks,
)

log = logging.getLogger("tidalpoold.services")

LOGGED_BAD_MESSAGES = 5
"""Refused stream messages of a session logged one by one; later ones at powers of two."""
MAX_QUEUED_ERRORS = 256
"""Replies waiting on a session's stream beyond which a refusal is not queued: a client that
does not read its stream cannot make the daemon hold its refusals (about 1.6 kB each)."""
REASON_CHARS = 256
"""Characters of an operator's eviction reason kept (in the goodbye and the log)."""


def worth_logging(count: int) -> bool:
    """Whether the `count`-th refused message of a session is logged."""
    return count <= LOGGED_BAD_MESSAGES or count & (count - 1) == 0


# The copy bandwidths a session may plan its swaps at: 1 MB/s to 1 PB/s spans every link from
# a throttled test to NVLink, and keeps the planner's simulated copy times finite.
MIN_COPY_GBPS = 1e-3
MAX_COPY_GBPS = 1e6


class PoolService:
    """What a training process speaks: Attach, Session, Detach, Stats."""

    name = "tidalpool.v1.Pool"

    def __init__(self, registry: Registry, planner: PlanWorker | None = None) -> None:
        self.registry = registry
        self.planner = planner

    def handler(self) -> Any:
        return service(
            self.name,
            {
                "Attach": unary("Attach", pool_pb2.AttachRequest, self.attach),
                "Session": bidi_stream("Session", self.session),
                "Detach": unary("Detach", pool_pb2.DetachRequest, self.detach),
                "Stats": unary("Stats", pool_pb2.StatsRequest, self.stats),
            },
        )

    def _session_of(self, context: grpc.ServicerContext) -> Session:
        tokens = [v for k, v in context.invocation_metadata() if k == TOKEN_KEY]
        if len(tokens) != 1:
            raise Unauthenticated(f"expected one {TOKEN_KEY!r} metadata entry, got {len(tokens)}")
        session = self.registry.by_token(str(tokens[0]))
        if session is None:
            raise Unauthenticated("unknown session token (never issued, or the session ended)")
        return session

    def attach(
        self, request: pool_pb2.AttachRequest, context: grpc.ServicerContext
    ) -> pool_pb2.AttachResponse:
        session = self._session_of(context)
        gbps = request.copy_gbps
        if not (gbps == 0 or MIN_COPY_GBPS <= gbps <= MAX_COPY_GBPS):  # NaN fails both
            raise InvalidArgument(
                f"copy_gbps must be 0 (not throttled) or a bandwidth from {MIN_COPY_GBPS:g} to"
                f" {MAX_COPY_GBPS:g} GB/s, got {gbps:g}"
            )
        self.registry.attach(session, request.swap_limit_bytes, gbps, request.page_bytes)
        s = self.registry.settings
        return pool_pb2.AttachResponse(
            session_id=session.id,
            lease=lease_message(session, self.registry.backend),
            heartbeat_interval_ms=int(s.heartbeat_interval_s * 1000),
            trace_chunk_events=s.trace_chunk_events,
            plan_shapes=s.max_plan_shapes,
        )

    def session(
        self, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> Iterator[pool_pb2.ServerMessage]:
        session = self._session_of(context)
        self.registry.open_stream(session)
        # However the stream ends (client gone, cancelled, broken), the session ends with it.
        context.add_callback(
            lambda: self.registry.end_quietly(
                session.id, Reason.REASON_DETACHED, "session stream ended"
            )
        )
        context.send_initial_metadata(((STREAM_OPEN_KEY, "1"),))  # attach() waits for this
        reader = threading.Thread(
            target=self._read, args=(session, requests), name=f"read-{session.id}", daemon=True
        )
        reader.start()
        while True:
            msg = session.outbox.get()
            if msg is None:
                return
            yield msg

    def _read(self, session: Session, requests: Iterator[bytes]) -> None:
        """Consume the client's half of the stream until it closes."""
        why = "client closed its session stream"
        try:
            for raw in requests:
                try:
                    self._handle(session, parse(pool_pb2.ClientMessage, raw))
                except Failure as e:
                    code, message = status_of(e)
                    session.bad_messages += 1
                    if worth_logging(session.bad_messages):
                        log.warning(
                            "session.bad_message",
                            extra={
                                "session": session.id,
                                "why": message,
                                "count": session.bad_messages,
                                **_summary(session.bad_messages),
                            },
                        )
                    if session.outbox.qsize() < MAX_QUEUED_ERRORS:  # else it does not read
                        session.outbox.put(
                            pool_pb2.ServerMessage(
                                error=pool_pb2.SessionError(code=code.name, message=message)
                            )
                        )
        except grpc.RpcError:
            why = "session stream broken"
        except Exception as e:  # keep the daemon alive whatever one client sends
            log.exception("session.reader_failed", extra={"session": session.id})
            why = f"internal error reading the stream: {e}"
        self.registry.end_quietly(session.id, Reason.REASON_DETACHED, why)

    def _handle(self, session: Session, msg: pool_pb2.ClientMessage) -> None:
        """Take one stream message, or raise a Failure saying why not (nothing is taken)."""
        body = msg.WhichOneof("body")
        if body == "heartbeat":
            self.registry.touch(session, msg.heartbeat)
            if self.planner is not None:
                self.planner.on_events(session)
        elif body == "trace":
            session.trace.add(msg.trace)
            self.registry.touch(session)
            if self.planner is not None:
                self.planner.on_events(session)
        elif body == "step":
            live = live_blocks(session, msg.step)
            ended, forgotten = session.trace.step(msg.step)
            if live is not None:
                session.live_at = live
            self.registry.touch(session)
            if self.planner is not None:
                self.planner.on_step(session, ended, forgotten)
        elif body == "lease_return":
            self.registry.take_back(session, msg.lease_return)
            self.registry.touch(session)
        else:
            raise InvalidArgument(
                "client message has no body (heartbeat, trace, step or lease_return)"
            )

    def detach(
        self, request: pool_pb2.DetachRequest, context: grpc.ServicerContext
    ) -> pool_pb2.DetachResponse:
        session = self._session_of(context)
        last = request.last if request.HasField("last") else None
        ended = self.registry.end(
            session.id, Reason.REASON_DETACHED, "detached by the client", last=last
        )
        return pool_pb2.DetachResponse(session=ended.info(self.registry.backend))

    def stats(
        self, request: pool_pb2.StatsRequest, context: grpc.ServicerContext
    ) -> pool_pb2.StatsResponse:
        session = self._session_of(context)
        return pool_pb2.StatsResponse(session=session.info(self.registry.backend))


class AdminService:
    """What operators speak: ListSessions, EvictSession, PoolStatus, SetQuota."""

    name = "tidalpool.v1.Admin"

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.started_unix_ns = time.time_ns()

    def handler(self) -> Any:
        return service(
            self.name,
            {
                "ListSessions": unary(
                    "ListSessions", admin_pb2.ListSessionsRequest, self.list_sessions
                ),
                "EvictSession": unary("EvictSession", admin_pb2.EvictSessionRequest, self.evict),
                "PoolStatus": unary("PoolStatus", admin_pb2.PoolStatusRequest, self.pool_status),
                "SetQuota": unary("SetQuota", admin_pb2.SetQuotaRequest, self.set_quota),
            },
        )

    def list_sessions(
        self, request: admin_pb2.ListSessionsRequest, context: grpc.ServicerContext
    ) -> admin_pb2.ListSessionsResponse:
        backend = self.registry.backend
        return admin_pb2.ListSessionsResponse(
            sessions=[s.info(backend) for s in self.registry.sessions()]
        )

    def evict(
        self, request: admin_pb2.EvictSessionRequest, context: grpc.ServicerContext
    ) -> admin_pb2.EvictSessionResponse:
        if not request.session_id:
            raise InvalidArgument("EvictSession needs a session_id")
        if len(request.session_id) > SESSION_ID_CHARS:
            raise InvalidArgument(
                f"session_id {clip(request.session_id)} is longer than a session id"
                f" ({SESSION_ID_CHARS} characters)"
            )
        why = request.reason or "evicted by an operator"
        if len(why) > REASON_CHARS:
            why = why[:REASON_CHARS] + f"… ({len(why.encode())} bytes)"
        ended = self.registry.end(request.session_id, Reason.REASON_EVICTED, why)
        return admin_pb2.EvictSessionResponse(session=ended.info(self.registry.backend))

    def set_quota(
        self, request: admin_pb2.SetQuotaRequest, context: grpc.ServicerContext
    ) -> admin_pb2.SetQuotaResponse:
        if not request.session_id or len(request.session_id) > SESSION_ID_CHARS:
            raise InvalidArgument(f"SetQuota needs a session id, got {clip(request.session_id)!r}")
        if not (request.device_min_bytes or request.device_max_bytes):
            raise InvalidArgument(
                "SetQuota changes nothing: give device_min_bytes or device_max_bytes"
            )
        session = self.registry.set_quota(
            request.session_id, request.device_min_bytes, request.device_max_bytes
        )
        return admin_pb2.SetQuotaResponse(session=session.info(self.registry.backend))

    def pool_status(
        self, request: admin_pb2.PoolStatusRequest, context: grpc.ServicerContext
    ) -> admin_pb2.PoolStatusResponse:
        device, host = self.registry.usage()
        backend = self.registry.backend
        return admin_pb2.PoolStatusResponse(
            backend=backend.name,
            mode=backend.mode,
            chunk_bytes=backend.device.chunk_bytes,
            facts={key: str(value) for key, value in backend.facts().items()},
            device=device,
            host=host,
            sessions=len(self.registry.sessions()),
            version=__version__,
            started_unix_ns=self.started_unix_ns,
        )


def _summary(count: int) -> dict[str, str]:
    """The note on a refused message's log line once they are no longer logged each."""
    if count < LOGGED_BAD_MESSAGES:
        return {}
    return {
        "note": f"{count} messages of this session refused so far: the first"
        f" {LOGGED_BAD_MESSAGES} are logged, then one line at each power of two"
    }
