"""Sessions with a swap limit against a real daemon: tensors, op views, stats, shutdown."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
import tidalpool
from tidalclient import status
from tidalclient.local import LocalDaemon
from tidalclient.numpy import Tensor

KiB = 1024


def swap_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tidalpool-swap")]


def test_tensors_swap_under_the_limit_and_keep_their_values(daemon: LocalDaemon) -> None:
    with tidalpool.attach(
        daemon.socket_dir, device_limit="1MiB", host_limit="1MiB", swap_limit=16 * KiB
    ) as s:
        assert sorted(swap_threads()) == ["tidalpool-swap-in", "tidalpool-swap-out"]
        tensors = [s.tensor((1024,), "float32") for _ in range(8)]  # 4 KiB each, 32 KiB in all
        for i, t in enumerate(tensors):
            with s.op(writes=[t], name="fill") as (v,):
                v[:] = np.arange(1024, dtype=np.float32) * i
        for i, t in enumerate(tensors):
            with s.op(reads=[t], name="check") as (v,):
                assert np.array_equal(v, np.arange(1024, dtype=np.float32) * i)
        stats = s.stats()
        assert stats.swap is not None
        assert stats.swap.limit == 16 * KiB
        assert stats.swap.peak_resident_bytes <= 16 * KiB
        assert stats.swap.swap_outs >= 4 and stats.swap.swapped_out_bytes >= 16 * KiB
        assert stats.swap.swapped_in_bytes == stats.swap.swap_ins * 4 * KiB
        assert stats.live_blocks == 8
    assert swap_threads() == []


def test_op_yields_arrays_for_arrays_tensors_and_blocks(daemon: LocalDaemon) -> None:
    with tidalpool.attach(daemon.socket_dir, swap_limit="64KiB") as s:
        pinned = s.array((4,), "int64")
        tensor = s.tensor((2, 3), "float64")
        block = s.malloc(10)
        with s.op(reads=[pinned], writes=[tensor, block]) as (p, t, b):
            assert p is pinned
            assert (t.shape, t.dtype, b.shape, b.dtype) == ((2, 3), np.float64, (10,), np.uint8)
            t[:] = 1.5
            b[:] = 7
        with s.op(reads=[tensor, block]) as (t, b):
            assert t.sum() == 9.0 and bytes(b) == b"\x07" * 10
        assert isinstance(tensor, Tensor) and tensor.nbytes == 48 and tensor.ndim == 2


def test_pinned_arrays_stay_while_tensors_swap(daemon: LocalDaemon) -> None:
    with tidalpool.attach(daemon.socket_dir, swap_limit=8 * KiB) as s:
        pinned = s.array(KiB, "uint8")
        pinned[:] = 42
        tensors = [s.tensor(3 * KiB, "uint8") for _ in range(4)]  # 12 KiB: some must go out
        for t in tensors:
            with s.op(writes=[t]) as (v,):
                v[:] = 1
        assert (pinned == 42).all()
        assert s.address(tidalpool_block(pinned)) == pinned.ctypes.data
        stats = s.stats()
        assert stats.swap is not None and stats.swap.swap_outs >= 2


def tidalpool_block(arr: np.ndarray) -> tidalpool.Block:
    from tidalclient.numpy import block_of

    return block_of(arr)


def test_garbage_tensors_are_freed_at_the_next_op(daemon: LocalDaemon) -> None:
    with tidalpool.attach(daemon.socket_dir, swap_limit="64KiB") as s:
        t = s.tensor(100, "uint8")
        del t
        gc.collect()
        assert s.stats().live_blocks == 1  # queued by the finalizer, not freed under it
        with s.op():
            pass
        assert s.stats().live_blocks == 0


def test_garbage_tensors_are_freed_before_the_next_boundary(daemon: LocalDaemon) -> None:
    # A tensor that died in an iteration is freed in it: not live across the step mark.
    with tidalpool.attach(daemon.socket_dir, swap_limit="64KiB") as s:
        t = s.tensor(100, "uint8")
        del t
        gc.collect()
        assert s.stats().live_blocks == 1
        s.step()
        assert s.stats().live_blocks == 0


def test_released_tensor_cannot_be_released_again(daemon: LocalDaemon) -> None:
    with tidalpool.attach(daemon.socket_dir) as s:
        t = s.tensor(16, "uint8")
        s.release(t)
        with pytest.raises(tidalpool.InvalidBlock, match="not live"):
            s.release(t)
        assert s.stats().live_blocks == 0


def test_an_op_beyond_the_limit_is_lease_exceeded(daemon: LocalDaemon) -> None:
    with tidalpool.attach(daemon.socket_dir, swap_limit=8 * KiB) as s:
        a, b, c = (s.tensor(3 * KiB, "uint8") for _ in range(3))
        with (
            pytest.raises(tidalpool.LeaseExceeded, match="even with every unlocked block"),
            s.op(reads=[a, b, c]),
        ):
            pass
        with s.op(reads=[a, b]):  # nothing stayed locked
            pass


def test_without_a_swap_limit_there_are_no_swap_threads_or_stats(daemon: LocalDaemon) -> None:
    with tidalpool.attach(daemon.socket_dir) as s:
        assert swap_threads() == []
        t = s.tensor(8, "float32")
        with s.op(writes=[t]) as (v,):
            v[:] = 2
        with s.op(reads=[t]) as (v,):
            assert v.sum() == 16
        assert s.stats().swap is None


def test_copy_bandwidth_must_be_positive(daemon: LocalDaemon) -> None:
    with pytest.raises(ValueError, match="copy_gbps must be positive, got 0"):
        tidalpool.attach(daemon.socket_dir, swap_limit="1MiB", copy_gbps=0)


def test_an_op_recorded_with_record_op_counts_in_the_swap_schedule(daemon: LocalDaemon) -> None:
    """The daemon numbers every op of the trace, those of record_op included: a swap scheduled
    after such an op starts right after it, not one op later."""
    from tidalclient.executors.base import DEVICE, HOST, LEAVING
    from tidalclient.executors.swapping import Swapping
    from tidalcore.planupdate import ScheduledSwap

    with tidalpool.attach(daemon.socket_dir, swap_limit="1MiB", host_limit="1MiB") as s:
        executor = s.executor
        assert isinstance(executor, Swapping)
        # op 0 writes the block, op 1 is compute the session cannot see, op 2 reads the block
        executor.install_schedule([ScheduledSwap(block=0, out_after=1, in_before=2)])
        s.step()
        t = s.tensor((1024,), "float32")
        with s.op(writes=[t]) as (view,):
            view[:] = 7.0
        assert executor.where(t.block) == DEVICE
        s.record_op("compute", 1_000)  # op 1: the swap-out follows it
        assert executor.where(t.block) in (LEAVING, HOST)
        with s.op(reads=[t]) as (view,):  # op 2: back before it begins
            assert executor.where(t.block) == DEVICE
            assert float(view.sum()) == 7.0 * 1024
        assert s.stats().swap is not None and s.stats().swap.schedule_skips == 0


def test_a_swap_limit_below_one_block_is_refused_and_leaves_nothing(daemon: LocalDaemon) -> None:
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="swap limit of 100 bytes is below one aligned block"):
        tidalpool.attach(daemon.socket_dir, device_limit="1MiB", host_limit="1MiB", swap_limit=100)
    deadline = time.monotonic() + 30  # the recorder's thread too, once it has drained
    while {t.name for t in threading.enumerate()} != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {t.name for t in threading.enumerate()} == before
    deadline = time.monotonic() + 10
    while status.fetch(daemon.socket_dir)[1].sessions and time.monotonic() < deadline:
        time.sleep(0.05)  # the daemon ends the session when its stream closes
    pool, sessions = status.fetch(daemon.socket_dir)
    assert (pool.device.leased_bytes, pool.host.leased_bytes, len(sessions.sessions)) == (0, 0, 0)
