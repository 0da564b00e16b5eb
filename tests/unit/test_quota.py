"""Elastic leases in the daemon: the sharing rule (`tidalpoold.quota.share`) and the registry
that applies it (floors guaranteed, QuotaChange sent, chunks taken back, a newcomer's floor
freed from borrowers, an overdue borrower ended, operators' quota changes)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tidalcore.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from tidalcore.units import Bytes
from tidalcore.v1 import pool_pb2
from tidalpoold.backends import SimBackend
from tidalpoold.quota import Claim, share
from tidalpoold.sessions import Registry, Session
from tidalpoold.settings import Settings

C = 2 * 1024 * 1024  # one chunk
PAGE = 64 * 1024


# -- the rule ------------------------------------------------------------------------------------
def test_share_matches_the_worked_example() -> None:
    claims = [Claim("a", 4, 16, 12), Claim("b", 2, 16, 3), Claim("c", 2, 16, 8)]
    assert share(16, claims) == {"a": 9, "b": 3, "c": 4}


def test_share_lends_nothing_nobody_needs_and_refuses_floors_over_the_pool() -> None:
    assert share(10, [Claim("a", 2, 10, 2), Claim("b", 3, 10, 4)]) == {"a": 2, "b": 4}
    with pytest.raises(ValueError, match="floors of 11 chunks do not fit in a pool of 10"):
        share(10, [Claim("a", 6, 6, 6), Claim("b", 5, 5, 5)])
    with pytest.raises(ValueError, match="must be positive and in that order"):
        Claim("a", 3, 2, 2)


@given(
    st.integers(1, 64),
    st.lists(st.tuples(st.integers(1, 8), st.integers(0, 40), st.integers(0, 40)), max_size=8),
)
def test_share_keeps_floors_needs_and_the_pool(pool: int, raw: list[tuple[int, int, int]]) -> None:
    claims = []
    for k, (floor, up_need, up_most) in enumerate(raw):
        most = floor + up_most
        claims.append(Claim(f"s{k}", floor, most, min(most, floor + up_need)))
    if sum(c.floor for c in claims) > pool:
        return
    quotas = share(pool, claims)
    assert sum(quotas.values()) <= pool
    for c in claims:
        assert c.floor <= quotas[c.key] <= c.need
    # Chunks stay free only when every claim has all it needs.
    if sum(quotas.values()) < pool:
        assert all(quotas[c.key] == c.need for c in claims)
    # No starvation: each claim wanting more than its floor gets at least its share of the
    # spare in proportion to floors, rounded down (or all it needs).
    wanting = [c for c in claims if c.need > c.floor]
    spare, weight = pool - sum(c.floor for c in claims), sum(c.floor for c in wanting)
    for c in wanting:
        assert quotas[c.key] >= min(c.need, c.floor + spare * c.floor // weight)


# -- the registry --------------------------------------------------------------------------------
def settings(tmp_path: Path, **overrides: object) -> Settings:
    return Settings(
        device_pool=Bytes(8 * C),
        host_pool=Bytes(8 * C),
        default_device_lease=Bytes(C),
        default_host_lease=Bytes(C),
        chunk_size=Bytes(C),
        socket_dir=tmp_path,
        plan_cache_dir=tmp_path,
        metrics_address="",
        **overrides,  # type: ignore[arg-type]
    )


@pytest.fixture
def sim() -> Iterator[SimBackend]:
    backend = SimBackend(8 * C, 8 * C, C)
    yield backend
    backend.close()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def elastic(registry: Registry, floor: int, most: int = 0, swap: int = 64 * C) -> Session:
    session = registry.open(most * C, C, "job", 1, 0, elastic=True, device_min=floor * C)
    registry.attach(session, swap_limit=swap, page_bytes=PAGE)
    return session


def quotas(session: Session) -> list[pool_pb2.QuotaChange]:
    """The QuotaChange messages on the session's stream so far (taken off it)."""
    out = []
    while not session.outbox.empty():
        msg = session.outbox.get()
        if msg is not None and msg.WhichOneof("body") == "quota":
            out.append(msg.quota)
    return out


def grown(registry: Registry, session: Session) -> tuple[int, ...]:
    return registry.grow(session.token, 0)[1].chunks


def test_an_elastic_session_holds_its_floor_and_grows_to_its_quota(
    tmp_path: Path, sim: SimBackend
) -> None:
    registry = Registry(settings(tmp_path), sim)
    a = registry.open(0, C, "job", 1, 0, elastic=True, device_min=2 * C)
    assert len(a.device.chunks) == 2 and a.elastic is not None and a.elastic.most == 8
    registry.attach(a, swap_limit=64 * C, page_bytes=PAGE)
    told = quotas(a)
    assert [(q.device_chunks, q.deadline_ms) for q in told] == [(8, 0)]  # all 8, nothing due
    assert len(grown(registry, a)) == 6
    assert len(a.device.chunks) == 8 and registry.device.free_chunks == 0
    assert a.swap_limit == 8 * C  # the plan's limit is the quota
    info = a.info(sim)
    assert (info.device_floor_bytes, info.device_quota_bytes, info.device_max_bytes) == (
        2 * C,
        8 * C,
        8 * C,
    )


@pytest.mark.parametrize("newcomer", ["elastic", "fixed"])
def test_a_newcomer_gets_its_floor_from_a_borrower_that_gives_back(
    tmp_path: Path, sim: SimBackend, newcomer: str
) -> None:
    registry = Registry(settings(tmp_path), sim)
    a = elastic(registry, 2)
    grown(registry, a)
    quotas(a)
    latencies: list[float] = []
    registry.on_give_back = latencies.append
    got: list[Session] = []
    if newcomer == "elastic":
        opener = threading.Thread(
            target=lambda: got.append(
                registry.open(0, C, "b", 2, 0, elastic=True, device_min=3 * C)
            )
        )
    else:  # a fixed lease is a floor as high as its ceiling
        opener = threading.Thread(target=lambda: got.append(registry.open(3 * C, C, "b", 2, 0)))
    opener.start()
    # The borrower is asked for 3 chunks (its quota drops to 5) with a deadline.
    while not (told := quotas(a)):
        pass
    assert told[-1].device_chunks == 5 and told[-1].deadline_ms > 0
    returned = a.device.chunks[-3:]
    registry.take_back(a, pool_pb2.LeaseReturn(device_chunks=returned, quota_id=told[-1].quota_id))
    opener.join(timeout=30)
    assert got and len(got[0].device.chunks) == 3
    assert set(got[0].device.chunks) == set(returned)
    assert len(a.device.chunks) == 5 and a.elastic is not None and a.elastic.deadline == 0.0
    assert len(latencies) == 1 and latencies[0] >= 0
    assert registry.given_back_chunks == 3


def test_a_borrower_that_does_not_give_back_is_ended_and_nobody_else_notices(
    tmp_path: Path, sim: SimBackend
) -> None:
    registry = Registry(settings(tmp_path, quota_deadline_s=0.2), sim)
    c = elastic(registry, 1, most=1)
    held_by_c = c.device.chunks
    a = elastic(registry, 2)
    assert len(grown(registry, a)) == 5  # all but c's chunk
    quotas(c)
    b = registry.open(0, C, "b", 2, 0, elastic=True, device_min=3 * C)  # waits for a, in vain
    assert len(b.device.chunks) == 3
    assert a.ended and not c.ended
    goodbye = [m for m in iter(a.outbox.get, None) if m.WhichOneof("body") == "goodbye"]
    assert (
        goodbye and "did not give back 3 device chunks within 0.2 s" in goodbye[0].goodbye.message
    )
    assert goodbye[0].goodbye.reason == pool_pb2.Goodbye.REASON_EVICTED
    assert c.device.chunks == held_by_c and all(q.deadline_ms == 0 for q in quotas(c))
    assert registry.ended_total == {"evicted": 1}


def test_floors_are_guaranteed_and_fixed_leases_say_who_borrows(
    tmp_path: Path, sim: SimBackend
) -> None:
    registry = Registry(settings(tmp_path), sim)
    with pytest.raises(InvalidArgument, match="an elastic lease needs pages"):
        registry.attach(registry.open(0, C, "b", 2, 0, elastic=True, device_min=C))
    a = elastic(registry, 2)
    assert len(grown(registry, a)) == 5  # the unattached one holds its floor
    with pytest.raises(ResourceExhausted, match="elastic sessions borrow 5 chunks"):
        registry.open(7 * C, C, "fixed", 3, 0)
    with pytest.raises(ResourceExhausted, match="floor of 6 chunks cannot be guaranteed"):
        registry.open(0, C, "b", 2, 0, elastic=True, device_min=6 * C)
    with pytest.raises(InvalidArgument, match=r"floor of 3 chunks .* is over its ceiling of 2"):
        registry.open(2 * C, C, "b", 2, 0, elastic=True, device_min=3 * C)
    with pytest.raises(InvalidArgument, match=r"floor of 9 chunks .* is over its ceiling of 8"):
        registry.open(12 * C, C, "b", 2, 0, elastic=True, device_min=9 * C)  # the pool's 8


def test_returns_are_checked_and_an_operator_moves_the_bounds(
    tmp_path: Path, sim: SimBackend
) -> None:
    registry = Registry(settings(tmp_path), sim)
    b = elastic(registry, 1, most=1)
    a = elastic(registry, 2)
    assert len(grown(registry, a)) == 5
    theirs = b.device.chunks[0]
    with pytest.raises(InvalidArgument, match="not all distinct and the session's"):
        registry.take_back(a, pool_pb2.LeaseReturn(device_chunks=[theirs]))
    with pytest.raises(InvalidArgument, match="would leave the session no device chunk"):
        registry.take_back(b, pool_pb2.LeaseReturn(device_chunks=[theirs]))
    quotas(a)
    registry.set_quota(a.id, 0, 4 * C)  # a lower ceiling: a gives back down to it
    told = quotas(a)
    assert told[-1].device_chunks == 4 and told[-1].deadline_ms > 0
    with pytest.raises(ResourceExhausted, match="cannot be guaranteed"):
        registry.set_quota(b.id, 8 * C, 8 * C)
    registry.take_back(a, pool_pb2.LeaseReturn(device_chunks=a.device.chunks[4:]))
    assert len(a.device.chunks) == 4 and a.elastic is not None and not a.elastic.deadline
    fixed = registry.open(C, C, "fixed", 3, 0)
    with pytest.raises(FailedPrecondition, match="fixed lease"):
        registry.set_quota(fixed.id, C, C)


def test_a_session_short_of_its_quota_is_told_again_when_chunks_come_free(
    tmp_path: Path, sim: SimBackend
) -> None:
    registry = Registry(settings(tmp_path), sim)
    fixed = registry.open(3 * C, C, "fixed", 3, 0)
    a = elastic(registry, 2)
    assert [q.device_chunks for q in quotas(a)] == [5]  # the pool less the fixed lease
    registry.end(fixed.id, pool_pb2.Goodbye.REASON_DETACHED, "done")
    assert [q.device_chunks for q in quotas(a)] == [8]
    other = registry.open(2 * C, C, "fixed", 3, 0)  # takes 2 of the 6 free before a grows
    assert [q.device_chunks for q in quotas(a)] == [6]
    assert len(grown(registry, a)) == 4  # all that is free: it holds its quota
    registry.end(other.id, pool_pb2.Goodbye.REASON_DETACHED, "done")
    told = quotas(a)
    assert [q.device_chunks for q in told] == [8] and told[0].deadline_ms == 0
    assert len(grown(registry, a)) == 2 and len(a.device.chunks) == 8


def test_a_session_under_its_quota_is_told_again_when_chunks_come_free(
    tmp_path: Path, sim: SimBackend
) -> None:
    registry = Registry(settings(tmp_path), sim)
    a = elastic(registry, 2)
    grown(registry, a)
    quotas(a)
    got: list[Session] = []
    opener = threading.Thread(
        target=lambda: got.append(registry.open(0, C, "c", 2, 0, elastic=True, device_min=2 * C))
    )
    opener.start()
    while not (told := quotas(a)):
        pass
    assert told[-1].device_chunks == 6 and told[-1].deadline_ms > 0
    # It gives back one more than asked: it holds 5, one under its quota, and one is free.
    registry.take_back(a, pool_pb2.LeaseReturn(device_chunks=a.device.chunks[-3:]))
    opener.join(timeout=30)
    assert got and len(got[0].device.chunks) == 2 and registry.device.free_chunks == 1
    again = quotas(a)
    assert [(q.device_chunks, q.deadline_ms) for q in again] == [(6, 0)]
    assert again[0].quota_id > told[-1].quota_id
    assert len(grown(registry, a)) == 1
    registry.end(got[0].id, pool_pb2.Goodbye.REASON_DETACHED, "done")
    assert not [q for q in quotas(a) if q.device_chunks != 8]  # c's chunks lent to a again
