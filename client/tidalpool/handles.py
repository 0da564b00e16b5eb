"""The client side of the handles socket: ask for a lease, receive its fds."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from tidalpool import framing
from tidalpool.errors import AttachError
from tidalpool.v1 import handles_pb2


@dataclass(frozen=True, slots=True)
class Grant:
    response: handles_pb2.HandlesResponse
    device_fd: int
    host_fd: int

    def close(self) -> None:
        os.close(self.device_fd)
        os.close(self.host_fd)


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
            version=1, device_bytes=device_bytes, host_bytes=host_bytes, job_name=job_name
        )
        try:
            framing.send(sock, request)
            response, fds = framing.receive(sock, handles_pb2.HandlesResponse)
        except (OSError, framing.FramingError) as e:
            raise AttachError(f"tidalpoold at {path} closed the handles exchange: {e}") from e
    if response.error_code:
        for fd in fds:
            os.close(fd)
        raise AttachError(
            f"tidalpoold refused the session ({response.error_code}): {response.error_message}"
        )
    if len(fds) != 2:
        for fd in fds:
            os.close(fd)
        raise AttachError(f"tidalpoold passed {len(fds)} file descriptors, expected 2")
    return Grant(response, fds[0], fds[1])
