"""A session on the native allocator: a framework allocates through the C hot path, the trace
reaches a real daemon through the ring, and the daemon's plan serves the next iterations.

The "framework" here calls tidalpool_alloc/tidalpool_free through ctypes (HotPath.alloc/free),
the same entry points PyTorch's pluggable allocator calls; on sim the lease is host memory, so
every block is written to prove it is real lease memory.
"""

from __future__ import annotations

import ctypes
import time

import pytest
import tidalpool
from tidalclient.executors.native import NativeExecutor
from tidalclient.hotpath import HotPath, NativeError
from tidalclient.status import fetch
from tidalcore.events import ALLOC, FREE, OP, READ, WRITE

from ..conftest import StartDaemon

KiB = 1024
SIZES = (192 * KiB, 64 * KiB, 300 * KiB, 40 * KiB)  # one "forward" of four activations


def iteration(s: tidalpool.Session, hp: HotPath) -> list[int]:
    """Forward allocates activations, backward a gradient per activation before freeing it."""
    s.step()
    acts = []
    for size in SIZES:
        address = hp.alloc(size)
        assert address is not None
        ctypes.memset(address, 0xA5, size)  # lease memory: writable
        acts.append(address)
    grads = []
    for address, size in zip(reversed(acts), reversed(SIZES), strict=True):
        grad = hp.alloc(size)
        assert grad is not None
        ctypes.memset(grad, 0x5A, size)
        grads.append(grad)
        hp.free(address)
    for grad in grads:
        hp.free(grad)
    return acts + grads


def lease_of(s: tidalpool.Session) -> range:
    return range(s.device.address, s.device.address + s.device.length)


def test_the_daemon_learns_the_native_trace_and_its_plan_serves_the_native_allocator(
    start_daemon: StartDaemon,
) -> None:
    d = start_daemon()
    with tidalpool.attach(d.socket_dir, device_limit="8MiB", allocator="native") as s:
        assert isinstance(s.executor, NativeExecutor)
        hp = s.executor.hotpath
        deadline, learning = time.monotonic() + 20, 0
        while s.stats().mode != "planned":
            assert time.monotonic() < deadline, "no plan reached the native table"
            addresses = iteration(s, hp)
            assert all(a in lease_of(s) for a in addresses)
            learning += 1
            time.sleep(0.01)
        hits_before = s.stats().plan_hits
        for _ in range(3):
            addresses = iteration(s, hp)
            assert all(a in lease_of(s) for a in addresses)
        stats = s.stats()
        assert stats.plans_received >= 1
        assert stats.plan_misses == 0
        assert stats.plan_hits - hits_before == 3 * 2 * len(SIZES)  # every allocation planned
        assert stats.mallocs == stats.frees == (learning + 3) * 2 * len(SIZES)
        assert stats.live_blocks == 0
        # every event the native path produced reached the daemon, the ITER marks included
        produced = (learning + 3) * (4 * len(SIZES) + 1)
        assert stats.events_sent == stats.events_recorded == produced
        while s.stats().events_received != produced:  # the stream is ahead of the Stats call
            assert time.monotonic() < deadline + 10, "the daemon did not receive every event"
            time.sleep(0.02)
        assert hp.stats().overflow == 0
    final = s.stats()
    assert final.mallocs == (learning + 3) * 2 * len(SIZES)  # kept after the session ended
    assert hp.alloc(64) is None  # the lease is forgotten: NULL, not a dangling block
    assert "plan.sent" in d.log_path.read_text()


def test_the_daemon_sees_native_blocks_in_heartbeats_and_the_next_session_reuses_the_device(
    start_daemon: StartDaemon,
) -> None:
    d = start_daemon()
    with tidalpool.attach(d.socket_dir, device_limit="8MiB", allocator="native") as s:
        hp = s.executor.hotpath
        held = [hp.alloc(100 * KiB) for _ in range(3)]
        assert s.stats().live_bytes == 300 * KiB
        assert s.stats().used_bytes == 300 * KiB  # 100 KiB is a multiple of the alignment
        assert s.stats().footprint_bytes == 300 * KiB
        for address in held:
            assert address is not None
            hp.free(address)
    with tidalpool.attach(d.socket_dir, device_limit="8MiB", allocator="native") as s2:
        address = s2.executor.hotpath.alloc(4 * KiB)
        assert address in lease_of(s2)


def test_python_code_allocates_and_computes_in_a_native_session(
    start_daemon: StartDaemon,
) -> None:
    """`malloc`, `tensor` and an `op` on blocks work in a native session: its blocks come from
    the native table, and the trace says their allocations before the accesses to them."""
    d = start_daemon()
    with tidalpool.attach(d.socket_dir, device_limit="8MiB", allocator="native") as s:
        assert s.residency is None  # no swap limit: nothing moves
        seen: list[tuple[int, int]] = []
        record = s.recorder.record

        def spy(kind: int, block: int, size: int = 0, duration_ns: int = 0, name: int = 0) -> None:
            seen.append((kind, block))
            record(kind, block, size, duration_ns, name)

        s.recorder.record = spy  # type: ignore[method-assign]
        block = s.malloc(1024)
        assert s.address(block) in lease_of(s)
        with s.op(writes=[block]) as (view,):
            view[:] = 7
        with s.op(reads=[block]) as (view,):
            assert bytes(view) == bytes([7]) * 1024
        t = s.tensor((16,))
        with s.op(writes=[t]) as (values,):
            values[:] = 1.5
        s.release(t)
        s.free(block)
        s.record_op("after", 10)
        stats = s.stats()
        assert (stats.mallocs, stats.frees, stats.live_blocks) == (2, 2, 0)
        mine = [(kind, b) for kind, b in seen if b in (block.id, t.block.id) or kind == OP]
        assert mine == [
            (ALLOC, block.id),
            (WRITE, block.id),
            (OP, 0),
            (READ, block.id),
            (OP, 0),
            (ALLOC, t.block.id),
            (WRITE, t.block.id),
            (OP, 0),
            (FREE, t.block.id),
            (FREE, block.id),
            (OP, 0),
        ]


def test_one_native_device_serves_one_session_of_a_process(start_daemon: StartDaemon) -> None:
    d = start_daemon()
    with tidalpool.attach(d.socket_dir, device_limit="8MiB", allocator="native") as s:
        with pytest.raises(NativeError, match="native device 0 already serves"):
            tidalpool.attach(d.socket_dir, device_limit="8MiB", allocator="native")
        with tidalpool.attach(
            d.socket_dir, device_limit="8MiB", allocator="native", native_device=1
        ) as other:
            assert other.executor.hotpath.alloc(256) in lease_of(other)
        assert s.executor.hotpath.alloc(256) in lease_of(s)  # untouched by the refusal
    # the refused attach did not leave a session behind at the daemon
    deadline = time.monotonic() + 10
    while fetch(d.socket_dir)[1].sessions:
        assert time.monotonic() < deadline, "a session was left behind"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"allocator": "cuda"}, "allocator must be 'python' or 'native'"),
        ({"allocator": "native", "swap_limit": "4MiB"}, "native allocator does not swap"),
        ({"allocator": "native", "native_device": 64}, "out of range"),
    ],
)
def test_bad_native_arguments_are_refused(
    start_daemon: StartDaemon, kwargs: dict[str, object], message: str
) -> None:
    d = start_daemon()
    with pytest.raises(ValueError, match=message):
        tidalpool.attach(d.socket_dir, device_limit="8MiB", **kwargs)  # type: ignore[arg-type]
