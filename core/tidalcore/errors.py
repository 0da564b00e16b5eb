"""Typed failures a request can get, and the one place they become gRPC status codes: the
daemon raises them, a client sees their codes."""

from __future__ import annotations

import grpc


class Failure(Exception):
    """A request the daemon refuses; `code` is the gRPC status it maps to."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(Failure):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthenticated(Failure):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(Failure):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(Failure):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(Failure):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(Failure):
    """No room in a pool, or too many sessions."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for an exception raised while serving a request."""
    if isinstance(exc, Failure):
        return exc.code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
