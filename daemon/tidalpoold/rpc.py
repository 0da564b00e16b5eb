"""Turning service methods into gRPC handlers, in one place.

Requests arrive as raw bytes and are parsed here, so that a malformed message
is answered INVALID_ARGUMENT (gRPC's own deserializer would say INTERNAL), and
every typed failure is mapped to its status code by `errors.status_of`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from tidalcore.errors import InvalidArgument, status_of

log = logging.getLogger("tidalpoold.rpc")

Req = TypeVar("Req", bound=Message)


def parse(kind: type[Req], raw: bytes) -> Req:
    try:
        return kind.FromString(raw)
    except DecodeError as e:
        raise InvalidArgument(f"malformed {kind.DESCRIPTOR.full_name}: {e}") from e


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    code, message = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("rpc.internal_error", extra={"method": method})
    context.abort(code, message)


def unary(
    method: str, kind: type[Req], fn: Callable[[Req, grpc.ServicerContext], Message]
) -> grpc.RpcMethodHandler:
    def handle(raw: bytes, context: grpc.ServicerContext) -> Message:
        try:
            return fn(parse(kind, raw), context)
        except Exception as e:  # every failure becomes a status, none escapes
            _abort(context, e, method)
            raise  # unreachable: abort raises

    return grpc.unary_unary_rpc_method_handler(handle, response_serializer=_serialize)


def unary_stream(
    method: str, kind: type[Req], fn: Callable[[Req, grpc.ServicerContext], Iterator[Message]]
) -> grpc.RpcMethodHandler:
    """A server-streaming method (a request, then the responses `fn` returns)."""

    def handle(raw: bytes, context: grpc.ServicerContext) -> Iterator[Message]:
        try:
            request = parse(kind, raw)
        except Exception as e:
            _abort(context, e, method)
            raise  # unreachable: abort raises
        return fn(request, context)

    return grpc.unary_stream_rpc_method_handler(handle, response_serializer=_serialize)


def bidi_stream(
    method: str, fn: Callable[[Iterator[bytes], grpc.ServicerContext], Iterator[Message]]
) -> grpc.RpcMethodHandler:
    """A bidirectional stream; `fn` parses the raw requests itself (see `parse`)."""

    def handle(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Message]:
        try:
            yield from fn(requests, context)
        except Exception as e:
            _abort(context, e, method)

    return grpc.stream_stream_rpc_method_handler(handle, response_serializer=_serialize)


def _serialize(msg: Message) -> bytes:
    return msg.SerializeToString()


def service(name: str, methods: dict[str, grpc.RpcMethodHandler]) -> Any:
    return grpc.method_handlers_generic_handler(name, methods)


class StreamSlots:
    """At most `count` streams of one kind open at once. A stream holds one of the server's
    workers for as long as it lasts; without a cap, a peer that opens many (Health/Watch, no
    token needed) takes every worker, and health checks and attaches time out behind them. A
    stream past the cap is refused RESOURCE_EXHAUSTED at once, naming `what` and the cap."""

    def __init__(self, count: int, what: str) -> None:
        if count < 1:
            raise ValueError(f"{count} slots for {what}")
        self.count = count
        self.what = what
        self._free = threading.BoundedSemaphore(count)
        self.refused = 0

    def capped(
        self, fn: Callable[[Req, grpc.ServicerContext], Iterator[Message]]
    ) -> Callable[[Req, grpc.ServicerContext], Iterator[Message]]:
        """`fn` (a server-streaming or bidirectional handler) under the cap."""

        def stream(request: Req, context: grpc.ServicerContext) -> Iterator[Message]:
            if not self._free.acquire(blocking=False):
                self.refused += 1
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.what}: {self.count} streams are open, the most this daemon serves"
                    " at once; close one, or ask once (Health/Check)",
                )
            try:
                yield from fn(request, context)
            finally:
                self._free.release()

        return stream
