"""Length-prefixed protobuf messages with file descriptors, for the handles socket.

    | u32 little-endian length | message bytes |   (+ SCM_RIGHTS fds on the first send)

Shared by the daemon and the client: the framing is part of the protocol.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

MAX_MESSAGE = 64 * 1024
MAX_FDS = 16
_LEN = struct.Struct("<I")

M = TypeVar("M", bound=Message)


class FramingError(Exception):
    """The peer sent something that is not one framed message."""


def send(sock: socket.socket, msg: Message, fds: list[int] | tuple[int, ...] = ()) -> None:
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
            chunk, got, _, _ = socket.recv_fds(sock, n - len(data), MAX_FDS)
            fds.extend(got)
        else:
            chunk = sock.recv(n - len(data))
        if not chunk:
            _close_all(fds)
            raise FramingError(f"connection closed after {len(data)} of {n} bytes")
        data += chunk
    return data, fds


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
