"""Length-prefixed protobuf messages with file descriptors, for the handles socket.

    | u32 little-endian length | message bytes |   (+ SCM_RIGHTS fds on the first send)

A message carries at most MAX_FDS fds; more travel as FdBatch messages of up to MAX_FDS each
(`send_fds`, `receive_fds`). Shared by the daemon and the client: the framing is part of the
protocol.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from tidalcore.v1 import handles_pb2

MAX_MESSAGE = 64 * 1024
MAX_FDS = 253  # SCM_MAX_FD: the most fds the kernel passes in one message
_LEN = struct.Struct("<I")

M = TypeVar("M", bound=Message)


class FramingError(Exception):
    """The peer sent something that is not one framed message."""


def send(sock: socket.socket, msg: Message, fds: list[int] | tuple[int, ...] = ()) -> None:
    if len(fds) > MAX_FDS:
        raise ValueError(f"{len(fds)} fds in one message: the kernel passes at most {MAX_FDS}")
    data = msg.SerializeToString()
    payload = _LEN.pack(len(data)) + data
    sent = socket.send_fds(sock, [payload], list(fds)) if fds else sock.send(payload)
    if sent < len(payload):
        sock.sendall(payload[sent:])


def receive(sock: socket.socket, kind: type[M]) -> tuple[M, list[int]]:
    """Read one framed message of type `kind` and any fds that came with it."""
    head, fds = _recv_exact(sock, _LEN.size, with_fds=True)
    (length,) = _LEN.unpack(head)
    if length > MAX_MESSAGE:
        _close_all(fds)
        raise FramingError(f"message of {length} bytes exceeds the limit of {MAX_MESSAGE}")
    try:
        body, _ = _recv_exact(sock, length, with_fds=False)
        return kind.FromString(body), fds
    except DecodeError as e:
        _close_all(fds)
        raise FramingError(f"malformed {kind.DESCRIPTOR.full_name}: {e}") from e
    except BaseException:
        _close_all(fds)
        raise


def _recv_exact(sock: socket.socket, n: int, with_fds: bool) -> tuple[bytes, list[int]]:
    data, fds = b"", list[int]()
    while len(data) < n:
        if with_fds and not fds:
            chunk, got, flags, _ = socket.recv_fds(sock, n - len(data), MAX_FDS)
            fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                _close_all(fds)
                raise FramingError(
                    f"file descriptors were lost in transit (got {len(got)}; is the open-files"
                    " limit, ulimit -n, reached?)"
                )
        else:
            chunk = sock.recv(n - len(data))
        if not chunk:
            _close_all(fds)
            raise FramingError(f"connection closed after {len(data)} of {n} bytes")
        data += chunk
    return data, fds


def send_fds(sock: socket.socket, fds: list[int] | tuple[int, ...]) -> None:
    """Send `fds` as FdBatch messages of at most MAX_FDS each (none for no fds)."""
    for first in range(0, len(fds), MAX_FDS):
        batch = fds[first : first + MAX_FDS]
        send(sock, handles_pb2.FdBatch(first=first, count=len(batch)), batch)


def receive_fds(sock: socket.socket, count: int) -> list[int]:
    """Receive the `count` fds that `send_fds` sent; FramingError if they do not add up."""
    fds: list[int] = []
    try:
        while len(fds) < count:
            batch, got = receive(sock, handles_pb2.FdBatch)
            fds.extend(got)
            if batch.first != len(fds) - len(got) or batch.count != len(got) or not got:
                raise FramingError(
                    f"fd batch at {batch.first} says {batch.count} fds and brought {len(got)};"
                    f" expected a batch at {len(fds) - len(got)}"
                )
        if len(fds) != count:
            raise FramingError(f"received {len(fds)} file descriptors, expected {count}")
    except BaseException:
        _close_all(fds)
        raise
    return fds


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
