"""Framing over a Unix socket pair: round trips with fds, every FramingError, no fd leaks."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator

import pytest
from tidalcore.framing import (
    MAX_FDS,
    MAX_MESSAGE,
    FramingError,
    receive,
    receive_fds,
    send,
    send_fds,
)
from tidalcore.v1.common_pb2 import Lease, PoolLease
from tidalcore.v1.handles_pb2 import FdBatch, HandlesRequest, HandlesResponse


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def segment_fds() -> set[int]:
    """The fds of this process open on the `segments` files (however many times)."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:  # the directory listing's own fd
            continue
        if target.startswith("/memfd:tp-test-"):
            found.add(int(name))
    return found


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def segments() -> Iterator[tuple[int, int]]:
    """Two anonymous files, as the daemon's device and host segments."""
    device = os.memfd_create("tp-test-device")
    host = os.memfd_create("tp-test-host")
    os.ftruncate(device, 4096)
    os.ftruncate(host, 8192)
    yield device, host
    os.close(device)
    os.close(host)


def response() -> HandlesResponse:
    return HandlesResponse(
        session_id="s-1",
        token="t0k3n",
        lease=Lease(
            device=PoolLease(length=4 * 1024**2, chunks=[5, 2], chunk_bytes=2 * 1024**2),
            host=PoolLease(length=2 * 1024**2, chunks=[0], chunk_bytes=2 * 1024**2),
            backend="sim",
            mode="memfd",
        ),
        fd_count=3,
    )


def test_round_trip_with_two_fds(
    pair: tuple[socket.socket, socket.socket], segments: tuple[int, int]
) -> None:
    a, b = pair
    device, host = segments
    send(a, response(), [device, host])
    msg, fds = receive(b, HandlesResponse)
    try:
        assert msg == response()
        assert list(msg.lease.device.chunks) == [5, 2]
        assert len(fds) == 2
        assert set(fds).isdisjoint({device, host})  # new descriptors of the same files
        got_device, got_host = fds
        assert os.fstat(got_device).st_ino == os.fstat(device).st_ino
        assert os.fstat(got_host).st_ino == os.fstat(host).st_ino
        assert os.fstat(got_device).st_size == 4096
        assert os.fstat(got_host).st_size == 8192
        os.pwrite(device, b"device bytes", 100)
        os.pwrite(host, b"host bytes", 5000)
        assert os.pread(got_device, 12, 100) == b"device bytes"
        assert os.pread(got_host, 10, 5000) == b"host bytes"
        os.pwrite(got_host, b"back", 0)
        assert os.pread(host, 4, 0) == b"back"
    finally:
        for fd in fds:
            os.close(fd)


def test_round_trip_without_fds(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    request = HandlesRequest(version=2, device_bytes=1 << 30, host_bytes=0, job_name="bert")
    send(a, request)
    assert receive(b, HandlesRequest) == (request, [])


def test_wire_format_is_little_endian_length_then_body(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    request = HandlesRequest(version=2, job_name="x")
    send(a, request)
    body = request.SerializeToString()
    assert b.recv(1024) == struct.pack("<I", len(body)) + body
    assert body == b"\x08\x02\x22\x01x"


def test_empty_message_round_trips(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    send(a, HandlesResponse())
    assert receive(b, HandlesResponse) == (HandlesResponse(), [])


def test_messages_arrive_one_at_a_time(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    first = HandlesRequest(version=2, job_name="first")
    second = HandlesRequest(version=2, job_name="second")
    send(a, first)
    send(a, second)
    assert receive(b, HandlesRequest) == (first, [])
    assert receive(b, HandlesRequest) == (second, [])


def test_message_of_max_size_is_accepted(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    big = HandlesResponse(error_message="x" * 65532)
    assert big.ByteSize() == MAX_MESSAGE
    send(a, big)
    assert receive(b, HandlesResponse) == (big, [])


def test_length_over_max_is_refused_and_its_fds_closed(
    pair: tuple[socket.socket, socket.socket], segments: tuple[int, int]
) -> None:
    a, b = pair
    before = open_fds()
    socket.send_fds(a, [struct.pack("<I", MAX_MESSAGE + 1)], list(segments))
    with pytest.raises(FramingError) as e:
        receive(b, HandlesResponse)
    assert str(e.value) == "message of 65537 bytes exceeds the limit of 65536"
    assert open_fds() == before


def test_huge_length_is_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(b"\xff\xff\xff\xff")
    with pytest.raises(FramingError) as e:
        receive(b, HandlesResponse)
    assert str(e.value) == "message of 4294967295 bytes exceeds the limit of 65536"


def test_peer_closing_before_anything(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.close()
    with pytest.raises(FramingError) as e:
        receive(b, HandlesResponse)
    assert str(e.value) == "connection closed after 0 of 4 bytes"


def test_peer_closing_mid_length_closes_the_fds(
    pair: tuple[socket.socket, socket.socket], segments: tuple[int, int]
) -> None:
    a, b = pair
    before = open_fds()
    socket.send_fds(a, [b"\x0a\x00"], list(segments))
    a.close()
    with pytest.raises(FramingError) as e:
        receive(b, HandlesResponse)
    assert str(e.value) == "connection closed after 2 of 4 bytes"
    assert open_fds() == before - 1  # `a` was closed here; the received fds were too


def test_peer_closing_mid_body(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(struct.pack("<I", 10) + b"\x0a\x03")
    a.close()
    with pytest.raises(FramingError) as e:
        receive(b, HandlesResponse)
    assert str(e.value) == "connection closed after 2 of 10 bytes"


def test_peer_closing_mid_body_closes_the_fds(
    pair: tuple[socket.socket, socket.socket], segments: tuple[int, int]
) -> None:
    a, b = pair
    socket.send_fds(a, [struct.pack("<I", 10) + b"\x0a\x03"], list(segments))
    a.close()
    before = segment_fds()
    with pytest.raises(FramingError) as e:
        receive(b, HandlesResponse)
    leaked = sorted(segment_fds() - before)
    for fd in leaked:  # so that the leak does not outlive the test
        os.close(fd)
    assert str(e.value) == "connection closed after 2 of 10 bytes"
    assert leaked == []


def test_garbage_body_is_malformed_and_its_fds_closed(
    pair: tuple[socket.socket, socket.socket], segments: tuple[int, int]
) -> None:
    a, b = pair
    garbage = b"\x0a\x05ab"  # field 1 claims 5 bytes, 2 follow
    before = open_fds()
    socket.send_fds(a, [struct.pack("<I", len(garbage)) + garbage], list(segments))
    with pytest.raises(FramingError) as e:
        receive(b, HandlesResponse)
    assert str(e.value).startswith("malformed tidalpool.v1.HandlesResponse: ")
    assert open_fds() == before


def test_send_and_receive_leak_no_fds(
    pair: tuple[socket.socket, socket.socket], segments: tuple[int, int]
) -> None:
    a, b = pair
    before = open_fds()
    for _ in range(20):
        send(a, response(), list(segments))
        _, fds = receive(b, HandlesResponse)
        assert len(fds) == 2
        for fd in fds:
            os.close(fd)
    assert open_fds() == before


# -- fds in batches --------------------------------------------------------------------------------


def many_fds(n: int) -> list[int]:
    """`n` new descriptors of one memfd (the caller closes them)."""
    fd = os.memfd_create("tp-test-many")
    try:
        return [os.dup(fd) for _ in range(n)]
    finally:
        os.close(fd)


@pytest.mark.parametrize("n", [0, 1, MAX_FDS, MAX_FDS + 1, 2 * MAX_FDS + 94])
def test_fds_travel_in_batches_of_at_most_max_fds(
    pair: tuple[socket.socket, socket.socket], n: int
) -> None:
    a, b = pair
    sent = many_fds(n)
    try:
        before = open_fds()
        send_fds(a, sent)
        got = receive_fds(b, n)
        assert len(got) == n
        assert [os.fstat(fd).st_ino for fd in got] == [os.fstat(fd).st_ino for fd in sent]
        for fd in got:
            os.close(fd)
        assert open_fds() == before
        a.sendall(b"!")  # nothing else was left on the socket
        assert b.recv(16) == b"!"
    finally:
        for fd in sent:
            os.close(fd)


def test_batch_sizes_are_the_kernel_limit(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    sent = many_fds(2 * MAX_FDS + 1)
    try:
        send_fds(a, sent)
        batches = []
        for _ in range(3):
            batch, fds = receive(b, FdBatch)
            batches.append((batch.first, batch.count, len(fds)))
            for fd in fds:
                os.close(fd)
        assert MAX_FDS == 253
        assert batches == [(0, 253, 253), (253, 253, 253), (506, 1, 1)]
    finally:
        for fd in sent:
            os.close(fd)


def test_more_than_max_fds_in_one_message_is_refused(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, _ = pair
    sent = many_fds(MAX_FDS + 1)
    try:
        with pytest.raises(ValueError) as e:
            send(a, FdBatch(), sent)
        assert str(e.value) == "254 fds in one message: the kernel passes at most 253"
    finally:
        for fd in sent:
            os.close(fd)


def test_a_batch_that_does_not_add_up_is_refused_and_its_fds_closed(
    pair: tuple[socket.socket, socket.socket], segments: tuple[int, int]
) -> None:
    a, b = pair
    before = open_fds()
    send(a, FdBatch(first=0, count=1), [segments[0]])
    send(a, FdBatch(first=0, count=1), [segments[1]])  # should say first=1
    with pytest.raises(FramingError) as e:
        receive_fds(b, 2)
    assert str(e.value) == "fd batch at 0 says 1 fds and brought 1; expected a batch at 1"
    assert open_fds() == before


def test_fds_lost_to_the_open_files_limit_are_an_error(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    import resource

    a, b = pair
    sent = many_fds(300)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        send_fds(a, sent)
        before = open_fds()
        resource.setrlimit(resource.RLIMIT_NOFILE, (before + 10, hard))
        with pytest.raises(FramingError) as e:
            receive_fds(b, 300)
        assert "file descriptors were lost in transit" in str(e.value)
        assert open_fds() == before
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in sent:
            os.close(fd)
