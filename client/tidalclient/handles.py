"""The client side of the handles socket: ask for a lease, receive its chunks' fds."""

from __future__ import annotations

import os
import resource
import socket
from dataclasses import dataclass
from pathlib import Path

from tidalcore import framing
from tidalcore.v1 import handles_pb2
from tidalcore.wire import HANDLES_VERSION

from tidalclient.errors import AttachError


@dataclass(frozen=True, slots=True)
class Grant:
    """A granted lease: the response, and the fds of its chunks in lease order (no device fds
    in "ipc" mode). The caller maps them, then closes them with `close()`."""

    response: handles_pb2.HandlesResponse
    device_fds: tuple[int, ...]
    host_fds: tuple[int, ...]

    def close(self) -> None:
        for fd in (*self.device_fds, *self.host_fds):
            os.close(fd)


def request_lease(
    path: Path, device_bytes: int, host_bytes: int, job_name: str, timeout: float = 10.0
) -> Grant:
    """One exchange on the handles socket; AttachError names why it failed."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    with sock:
        try:
            sock.connect(str(path))
        except OSError as e:
            raise AttachError(f"cannot reach tidalpoold at {path}: {e.strerror or e}") from e
        request = handles_pb2.HandlesRequest(
            version=HANDLES_VERSION,
            device_bytes=device_bytes,
            host_bytes=host_bytes,
            job_name=job_name,
        )
        try:
            framing.send(sock, request)
            response, stray = framing.receive(sock, handles_pb2.HandlesResponse)
            for fd in stray:  # fds come in the batches that follow, never with the response
                os.close(fd)
            if response.error_code:
                raise AttachError(
                    f"tidalpoold refused the session ({response.error_code}):"
                    f" {response.error_message}"
                )
            expected = _expected_fds(response)
            if response.fd_count != expected:
                raise AttachError(
                    f"tidalpoold announced {response.fd_count} file descriptors for a lease of"
                    f" {expected} chunks"
                )
            _make_fd_room(expected)
            fds = framing.receive_fds(sock, expected)
        except (OSError, framing.FramingError) as e:
            raise AttachError(f"tidalpoold at {path} closed the handles exchange: {e}") from e
    n_device = expected - len(response.lease.host.chunks)
    return Grant(response, tuple(fds[:n_device]), tuple(fds[n_device:]))


def _expected_fds(response: handles_pb2.HandlesResponse) -> int:
    lease = response.lease
    device = 0 if lease.mode == "ipc" else len(lease.device.chunks)
    return device + len(lease.host.chunks)


def _make_fd_room(n: int) -> None:
    """Raise the soft open-files limit toward the hard one if `n` more fds might not fit (they
    are closed again once mapped, but they all arrive before the first is mapped)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    need = len(os.listdir("/proc/self/fd")) + n + 64
    if need > soft and (hard == resource.RLIM_INFINITY or hard > soft):
        new_soft = need if hard == resource.RLIM_INFINITY else min(hard, max(need, soft))
        resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
