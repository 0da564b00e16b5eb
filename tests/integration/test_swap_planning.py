"""A swapping session gets the daemon's swap schedule for its limit and runs by it."""

from __future__ import annotations

import time

import tidalpool
from tidalclient.executors.base import DEVICE, HOST, LEAVING
from tidalclient.executors.swapping import Swapping
from tidalclient.local import LocalDaemon

from .ready import measured_copy_gbps

KiB = 1024


def op(s: tidalpool.Session, name: str, reads: list[object], writes: list[object]) -> None:
    """An op that fills what it writes and lasts 2 ms (long enough to hide a 64 KiB copy)."""
    with s.op(reads=reads, writes=writes, name=name) as views:
        for view in views[len(reads) :]:
            view[...] = 1
        time.sleep(0.002)


def iteration(s: tidalpool.Session) -> str:
    """a, b, c of 64 KiB: all three live in fwd3, over a 160 KiB limit. a is idle from fwd1 to
    bwd1, so the plan swaps it out there. Returns where a is right after fwd1."""
    s.step()
    a = s.tensor(64 * KiB, "uint8")
    op(s, "fwd1", [], [a])
    ex = s.executor
    assert isinstance(ex, Swapping)
    after_fwd1 = ex.where(a.block)
    b = s.tensor(64 * KiB, "uint8")
    op(s, "fwd2", [], [b])
    c = s.tensor(64 * KiB, "uint8")
    op(s, "fwd3", [b], [c])
    s.release(b)
    op(s, "bwd3", [c], [])
    s.release(c)
    with s.op(reads=[a], name="bwd1") as (a_,):
        assert (a_ == 1).all()
    s.release(a)
    return after_fwd1


def test_schedule_from_the_daemon_swaps_out_after_the_planned_op(daemon: LocalDaemon) -> None:
    with tidalpool.attach(
        daemon.socket_dir, device_limit="1MiB", host_limit="1MiB", swap_limit=160 * KiB
    ) as s:
        deadline = time.monotonic() + 30
        while True:  # a schedule takes over at a step(): judge each iteration by the one it ran
            where = iteration(s)
            swap = s.stats().swap
            assert swap is not None
            if swap.scheduled_swaps:
                break
            assert where == DEVICE  # the LRU cache waits until c needs the room
            assert time.monotonic() < deadline, "no swap schedule arrived"
        assert swap.scheduled_swaps == 1
        skips = swap.schedule_skips
        for _ in range(3):
            assert iteration(s) in (LEAVING, HOST)  # out right after fwd1, as planned
        swap = s.stats().swap
        assert swap is not None and swap.schedule_skips == skips
        assert swap.peak_resident_bytes <= 160 * KiB
        # The plan places a's pieces too: c takes a's bytes while a is away, and a comes back
        # into b's, so its arena (128 KiB, where placing the three blocks whole takes 192 KiB)
        # fits under the limit and the session runs planned.
        assert s.stats().mode == "planned"
    (sent,) = [line for line in daemon.log_path.read_text().splitlines() if "plan.sent" in line]
    for field in ("height=131072", "footprint=131072", "limit=163840", "swaps=1"):
        assert field in sent.split()


def test_the_plan_sent_is_cached_as_checked_with_where_each_swap_in_lands(
    daemon: LocalDaemon,
) -> None:
    from tidalcore.v1 import pool_pb2

    with tidalpool.attach(
        daemon.socket_dir, device_limit="1MiB", host_limit="1MiB", swap_limit=160 * KiB
    ) as s:
        deadline = time.monotonic() + 30
        while s.stats().mode != "planned":
            iteration(s)
            assert time.monotonic() < deadline, "no plan arrived"
    (cached,) = (daemon.socket_dir / "plans").glob("*.plan")
    plan = pool_pb2.PlanUpdate.FromString(cached.read_bytes())
    # a, b, c in allocation order; a out after fwd1 (op 0), issued back at bwd3 (op 3) for
    # bwd1 (op 4), into the bytes b held; c in a's.
    assert (plan.version, list(plan.sizes), list(plan.offsets)) == (
        2,
        [64 * KiB] * 3,
        [0, 64 * KiB, 0],
    )
    assert (list(plan.swap_blocks), list(plan.swap_out_after), list(plan.swap_in_at)) == (
        [0],
        [0],
        [3],
    )
    assert (list(plan.swap_in_before), list(plan.swap_in_offsets)) == ([4], [64 * KiB])
    assert (plan.height_bytes, plan.limit_bytes, plan.resident_persistent_bytes) == (
        128 * KiB,
        160 * KiB,
        0,
    )
    p = plan.prediction
    assert (p.out_bytes, p.in_bytes, p.peak_bytes, p.footprint_bytes, p.copy_gbps) == (
        64 * KiB,
        64 * KiB,
        128 * KiB,
        128 * KiB,
        measured_copy_gbps(daemon),  # unthrottled: at what the sim backend measured
    )
    assert cached.name.startswith(plan.signature.hex() + "-")  # and what it was made for
