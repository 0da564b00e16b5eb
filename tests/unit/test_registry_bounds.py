"""What one client can make the registry and the trace store hold, and what it reports: each
bound with its exact refusal, and chunks whose scrub fails kept apart and freed again."""

from __future__ import annotations

import errno
import gc
import logging
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from tidalcore.errors import InvalidArgument, NotFound, ResourceExhausted
from tidalcore.units import Bytes
from tidalcore.v1 import pool_pb2
from tidalcore.v1.pool_pb2 import EVENT_KIND_ALLOC, Heartbeat, TraceChunk
from tidalpoold.backends import SimBackend
from tidalpoold.backends.base import Chunk, Pool
from tidalpoold.metrics import DaemonCollector
from tidalpoold.plan_worker import PlanWorker
from tidalpoold.services import MAX_QUEUED_ERRORS, PoolService, worth_logging
from tidalpoold.sessions import INT64_MAX, Counts, Reason, Registry, Session, clip
from tidalpoold.settings import Settings
from tidalpoold.trace import (
    EVENT_BYTES,
    MAX_NAME_BYTES,
    NAME_ENTRY_BYTES,
    TraceStore,
    bound_bytes,
)

C = 2 * 1024 * 1024  # one chunk
NUMPY_CACHE_BYTES = 64 * 1024  # numpy's cache of freed small buffers, at most
U64_MAX = 2**64 - 1


class FlakyScrub(SimBackend):
    """The sim backend, but its scrub fails (EMFILE, as at the open-files limit) `failures`
    times before it works again."""

    def __init__(self, failures: int) -> None:
        super().__init__(8 * C, 4 * C, C)
        self.failures = failures
        self.scrubs = 0  # scrub calls, failed ones included

    def scrub(self, pool: Pool, chunk: Chunk) -> None:
        self.scrubs += 1
        if self.failures > 0:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        super().scrub(pool, chunk)


@pytest.fixture
def flaky() -> Iterator[FlakyScrub]:
    backend = FlakyScrub(failures=0)
    yield backend
    backend.close()


def settings(tmp_path: Path, **overrides: object) -> Settings:
    """Pools of 8 device and 4 host chunks, leases of one chunk each by default."""
    return Settings(
        device_pool=Bytes(8 * C),
        host_pool=Bytes(4 * C),
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
    backend = SimBackend(8 * C, 4 * C, C)
    yield backend
    backend.close()


@pytest.fixture
def registry(tmp_path: Path, sim: SimBackend) -> Registry:
    return Registry(settings(tmp_path), sim)


def attached(registry: Registry, device: int = 2 * C, host: int = C, uid: int = 0) -> Session:
    session = registry.open(device, host, "job", 1, uid)
    registry.attach(session)
    return session


def numbers(s: Session) -> tuple[int, int, int, Counts]:
    return s.device_used, s.device_peak, s.host_used, Counts(**vars(s.counts))


# -- heartbeats ----------------------------------------------------------------------------------

# The counts a heartbeat carries, each within int64 and never going down.
COUNTS = (
    "plan_misses",
    "swapped_out_bytes",
    "swapped_in_bytes",
    "swap_stall_ns",
    "on_demand_out_bytes",
    "on_demand_in_bytes",
)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "device_used_bytes",
            2 * C + 1,
            f"heartbeat device_used_bytes {2 * C + 1} exceeds the session's device lease of"
            f" {2 * C} bytes",
        ),
        (
            "device_used_bytes",
            U64_MAX,
            f"heartbeat device_used_bytes {U64_MAX} exceeds the session's device lease of"
            f" {2 * C} bytes",
        ),
        (
            "device_peak_bytes",
            U64_MAX,
            f"heartbeat device_peak_bytes {U64_MAX} exceeds the session's device lease of"
            f" {2 * C} bytes",
        ),
        (
            "host_used_bytes",
            C + 1,
            f"heartbeat host_used_bytes {C + 1} exceeds the session's host lease of {C} bytes",
        ),
        *(
            (
                name,
                INT64_MAX + 1,
                f"heartbeat {name} {INT64_MAX + 1} exceeds the bound of a count ({INT64_MAX})",
            )
            for name in COUNTS
        ),
    ],
)
def test_a_heartbeat_past_a_bound_is_refused_whole(
    registry: Registry, field: str, value: int, message: str
) -> None:
    s = attached(registry)
    good = Heartbeat(device_used_bytes=1000, device_peak_bytes=2000, host_used_bytes=10)
    good.swapped_out_bytes, good.swap_stall_ns, good.plan_misses = 4096, 7, 1
    registry.touch(s, good)
    before, totals = numbers(s), Counts(**vars(registry.counts))
    bad = Heartbeat()
    bad.CopyFrom(good)
    bad.device_used_bytes = 500  # would change, were the heartbeat taken
    setattr(bad, field, value)
    with pytest.raises(InvalidArgument) as e:
        registry.touch(s, bad)
    assert str(e.value) == message
    assert numbers(s) == before
    assert registry.counts == totals
    device, host = registry.usage()
    assert (device.used_bytes, host.used_bytes) == (1000, 10)


def test_the_bounds_themselves_are_taken(registry: Registry) -> None:
    s = attached(registry)
    full = dict.fromkeys(COUNTS, INT64_MAX)
    registry.touch(
        s, Heartbeat(device_used_bytes=2 * C, device_peak_bytes=2 * C, host_used_bytes=C, **full)
    )
    assert numbers(s) == (2 * C, 2 * C, C, Counts(**full))
    assert registry.counts == Counts(**full)


@pytest.mark.parametrize("name", COUNTS)
def test_a_count_going_down_is_refused(registry: Registry, name: str) -> None:
    s = attached(registry)
    registry.touch(s, Heartbeat(**{name: 100}))
    with pytest.raises(InvalidArgument) as e:
        registry.touch(s, Heartbeat(**{name: 99}))
    assert str(e.value) == (
        f"heartbeat {name} 99 is below the 100 reported before: a count since attach never"
        " decreases"
    )
    assert getattr(s.counts, name) == getattr(registry.counts, name) == 100
    registry.touch(s, Heartbeat(**{name: 100}))  # the same again is fine
    registry.touch(s, Heartbeat(**{name: 250}))
    assert getattr(s.counts, name) == getattr(registry.counts, name) == 250


def test_a_refused_heartbeat_is_no_sign_of_life(tmp_path: Path, sim: SimBackend) -> None:
    now = [0.0]
    registry = Registry(settings(tmp_path), sim, clock=lambda: now[0])
    s = attached(registry)
    now[0] = 10.0
    with pytest.raises(InvalidArgument):
        registry.touch(s, Heartbeat(device_used_bytes=U64_MAX))
    assert s.last_seen == 0.0
    registry.touch(s, Heartbeat(device_used_bytes=5))
    assert s.last_seen == 10.0


def test_detach_with_a_bad_last_heartbeat_is_refused_and_the_session_goes_on(
    registry: Registry,
) -> None:
    s = attached(registry)
    registry.touch(s, Heartbeat(swapped_out_bytes=10))
    with pytest.raises(InvalidArgument, match=f"device_used_bytes {U64_MAX} exceeds"):
        registry.end(
            s.id, Reason.REASON_DETACHED, "detached", last=Heartbeat(device_used_bytes=U64_MAX)
        )
    assert registry.get(s.id) is s and not s.ended
    assert registry.usage()[0].leased_bytes == 2 * C
    ended = registry.end(
        s.id, Reason.REASON_DETACHED, "detached", last=Heartbeat(swapped_out_bytes=30)
    )
    assert ended is s and s.ended
    assert registry.counts.swapped_out_bytes == 30
    registry.touch(s, Heartbeat(swapped_out_bytes=5))  # behind the Detach: ignored
    assert (s.counts.swapped_out_bytes, registry.counts.swapped_out_bytes) == (30, 30)


def test_sums_stay_within_the_pool_whatever_a_session_holds(registry: Registry) -> None:
    """Numbers that bypass the checks (as a session's fields set directly) still make a
    PoolStatus and a scrape: what sessions use is held within what they lease."""
    a, b = attached(registry), attached(registry)
    for s in (a, b):
        s.device_used = s.host_used = U64_MAX
    device, host = registry.usage()
    assert (device.leased_bytes, device.used_bytes, device.free_bytes) == (4 * C, 4 * C, 4 * C)
    assert (host.leased_bytes, host.used_bytes, host.free_bytes) == (2 * C, 2 * C, 2 * C)
    planner = PlanWorker(registry.settings)
    try:
        scraped = CollectorRegistry(auto_describe=False)
        scraped.register(DaemonCollector(registry, planner, dict))
        used = {"pool": "device", "state": "used"}
        assert scraped.get_sample_value("tidalpool_pool_bytes", used) == 4 * C
    finally:
        planner.close()


# -- pending leases ------------------------------------------------------------------------------


def test_pending_leases_per_uid_are_bounded(tmp_path: Path) -> None:
    backend = SimBackend(16 * C, 16 * C, C)
    try:
        registry = Registry(settings(tmp_path, max_pending_per_uid=3), backend)
        mine = [registry.open(C, C, "job", 1, 1000) for _ in range(3)]
        with pytest.raises(ResourceExhausted) as e:
            registry.open(C, C, "job", 1, 1000)
        assert str(e.value) == (
            "uid 1000 already holds 3 leases not attached, the most one uid may"
            " (max_pending_per_uid 3): attach them, or wait 5 s (attach_timeout_s) for them"
            " to be reclaimed"
        )
        assert registry.usage()[0].leased_bytes == 3 * C  # the refused one took nothing
        registry.open(C, C, "job", 2, 1001)  # another uid is not held back
        registry.attach(mine[0])
        registry.open(C, C, "job", 1, 1000)  # an attached lease no longer counts
        registry.end(mine[1].id, Reason.REASON_EVICTED, "test")
        registry.open(C, C, "job", 1, 1000)  # nor one that ended
        with pytest.raises(ResourceExhausted, match="uid 1000 already holds 3 leases"):
            registry.open(C, C, "job", 1, 1000)
    finally:
        backend.close()


def test_a_pending_lease_goes_back_at_its_own_uids_word_only(tmp_path: Path) -> None:
    """give_back: the pending session of a token ends at once (its chunks free, its uid's
    pending count down); another uid's word, an attached session and an unknown token end
    nothing."""
    backend = SimBackend(16 * C, 16 * C, C)
    try:
        registry = Registry(settings(tmp_path, max_pending_per_uid=1), backend)
        pending = registry.open(C, C, "job", 1, 1000)
        for token, uid in [(pending.token, 1001), ("not a token", 1000)]:
            with pytest.raises(NotFound, match="no lease pending under that token for this uid"):
                registry.give_back(token, uid)
        assert registry.usage()[0].leased_bytes == C
        assert registry.give_back(pending.token, 1000) is pending and pending.ended
        assert registry.usage()[0].leased_bytes == 0
        attached = registry.open(C, C, "job", 1, 1000)  # the uid's one pending place is free
        registry.attach(attached)
        with pytest.raises(NotFound):
            registry.give_back(attached.token, 1000)  # it detaches instead
        assert not attached.ended
    finally:
        backend.close()


# -- client strings ------------------------------------------------------------------------------


def test_client_strings_are_clipped_in_messages(registry: Registry) -> None:
    assert clip("s-0123") == "'s-0123'"
    long = "x" * 100_000
    assert clip(long) == f"'{'x' * 64}'… (100000 bytes)"
    assert clip("é" * 70) == f"'{'é' * 64}'… (140 bytes)"
    with pytest.raises(NotFound) as e:
        registry.end(long, Reason.REASON_EVICTED, "test")
    assert str(e.value) == f"no session '{'x' * 64}'… (100000 bytes)"
    with pytest.raises(NotFound) as e:
        registry.get(long)
    assert len(str(e.value)) < 100


def test_bad_messages_are_logged_first_then_at_powers_of_two() -> None:
    logged = [n for n in range(1, 20_001) if worth_logging(n)]
    assert logged == [1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def test_a_client_that_never_reads_its_stream_gets_a_bounded_queue_of_refusals(
    registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    """20,000 bad messages read from a stream nobody drains: every one is refused, at most
    MAX_QUEUED_ERRORS refusals wait for the client, 17 log lines say so."""
    s = attached(registry)
    registry.open_stream(s)
    with caplog.at_level(logging.WARNING, logger="tidalpoold.services"):
        PoolService(registry)._read(s, iter([b""] * 20_000))  # ClientMessages with no body
    assert s.bad_messages == 20_000
    replies: list[pool_pb2.ServerMessage] = []
    while (reply := s.outbox.get_nowait()) is not None:
        replies.append(reply)
    assert s.outbox.empty()
    assert len(replies) == MAX_QUEUED_ERRORS + 1  # then the goodbye (the stream ended), None
    assert {r.error.message for r in replies[:MAX_QUEUED_ERRORS]} == {
        "client message has no body (heartbeat, trace, step or lease_return)"
    }
    assert replies[-1].goodbye.message == "client closed its session stream"
    records = [r for r in caplog.records if r.getMessage() == "session.bad_message"]
    assert [r.__dict__["count"] for r in records] == [
        n for n in range(1, 20_001) if worth_logging(n)
    ]


# -- op names ------------------------------------------------------------------------------------


def named(first_event: int, names: dict[int, str], n: int = 0) -> TraceChunk:
    """`n` ALLOC events (block ids first_event..) and `names`."""
    ids = range(first_event, first_event + n)
    return TraceChunk(
        first_event=first_event,
        kinds=[EVENT_KIND_ALLOC] * n,
        block_ids=list(ids),
        sizes=[256] * n,
        durations_ns=[0] * n,
        name_ids=[0] * n,
        new_names=names,
    )


def test_op_names_are_bounded_and_a_chunk_past_the_bound_is_refused_whole() -> None:
    budget = 3 * (100 + NAME_ENTRY_BYTES)  # room for three names of 100 bytes
    s = TraceStore(max_events=100, max_name_bytes=budget)
    s.add(named(0, {1: "a" * 100, 2: "b" * 100}, n=2))
    assert s.name_bytes == 2 * (100 + NAME_ENTRY_BYTES)
    with pytest.raises(InvalidArgument) as e:
        s.add(named(2, {3: "c" * 100, 4: "d"}, n=3))
    assert str(e.value) == (
        f"trace chunk's op names would bring the session's to {budget + 1 + NAME_ENTRY_BYTES}"
        f" bytes, more than max_trace_name_bytes ({budget}; each name counts its UTF-8 bytes"
        f" + {NAME_ENTRY_BYTES})"
    )
    assert s.names == {1: "a" * 100, 2: "b" * 100}  # nothing of the chunk was taken
    assert (s.events_received, s.events_held, s.name_bytes) == (2, 2, 2 * (100 + NAME_ENTRY_BYTES))
    s.add(named(2, {3: "c" * 100}, n=3))  # exactly the bound
    assert s.name_bytes == budget
    s.add(named(5, {1: "a" * 40}))  # an id defined again gives its old bytes back
    assert s.name_bytes == budget - 60
    assert s.names[1] == "a" * 40
    s.add(named(5, {2: "b" * 160}))  # and may take them again
    assert s.name_bytes == budget
    assert s.events_received == 5


def test_one_op_name_is_at_most_1_kib() -> None:
    s = TraceStore(max_events=100)
    s.add(named(0, {1: "n" * MAX_NAME_BYTES}))  # exactly 1 KiB
    with pytest.raises(InvalidArgument) as e:
        s.add(named(0, {2: "ok", 3: "é" * 513}, n=1))
    assert str(e.value) == "trace chunk defines op name 3 of 1026 bytes, longer than 1024"
    assert s.names == {1: "n" * MAX_NAME_BYTES}
    assert s.events_received == 0


def test_a_bad_name_id_refuses_the_names_before_it_too() -> None:
    s = TraceStore(max_events=100)
    with pytest.raises(InvalidArgument, match="name id 0"):
        s.add(named(0, {5: "fine", 0: "reserved", 6: "also fine"}, n=1))
    assert (s.names, s.name_bytes, s.events_received) == ({}, 0, 0)


def test_the_registry_gives_each_session_its_name_budget(tmp_path: Path, sim: SimBackend) -> None:
    registry = Registry(settings(tmp_path, max_trace_name_bytes=Bytes(4096)), sim)
    s = attached(registry)
    assert (s.trace.max_events, s.trace.max_name_bytes) == (1_000_000, 4096)


# -- the store's memory --------------------------------------------------------------------------


def test_bytes_per_event_come_from_the_column_dtypes() -> None:
    assert EVENT_BYTES == 1 + 8 + 8 + 8 + 4
    assert bound_bytes(4_000_000, 4 << 20) == 4_000_000 * 29 + 1954 * 1024 + (4 << 20)


def test_many_small_chunks_and_names_stay_within_the_stated_bound() -> None:
    """One-event chunks (a client flushing every few events) and one-letter names, as many as
    the bounds allow and more: what the store allocates and keeps stays within `bound_bytes`."""
    max_events, max_name_bytes = 8192, 32 * 1024
    gc.collect()
    tracemalloc.start()
    try:
        s = TraceStore(max_events=max_events, max_name_bytes=max_name_bytes)
        next_id = 1
        for i in range(2 * max_events):
            names: dict[int, str] = {}
            if s.name_bytes + len(f"op{next_id}") + NAME_ENTRY_BYTES <= max_name_bytes:
                names, next_id = {next_id: f"op{next_id}"}, next_id + 1
            s.add(named(i, names, n=1))
        gc.collect()
        mine = tracemalloc.Filter(inclusive=True, filename_pattern="*/tidalpoold/trace.py")
        snapshot = tracemalloc.take_snapshot().filter_traces([mine])
        held = sum(stat.size for stat in snapshot.statistics("filename"))
    finally:
        tracemalloc.stop()
    assert s.events_received == 2 * max_events
    assert s.events_held <= max_events
    assert len(s.names) == next_id - 1 > 200
    assert s.name_bytes > max_name_bytes - (6 + NAME_ENTRY_BYTES)
    assert len(s.chunks) <= 2 * max_events // 4096 + 1
    assert held > max_events * EVENT_BYTES  # the events are counted
    # Beside the store, numpy keeps some freed small buffers for reuse (process-wide).
    assert held <= bound_bytes(max_events, max_name_bytes) + NUMPY_CACHE_BYTES, held


def test_a_chunk_with_more_events_than_kept_is_refused(registry: Registry) -> None:
    s = TraceStore(max_events=3)
    with pytest.raises(InvalidArgument, match="trace chunk has 4 events, more than the 3"):
        s.add(named(0, {1: "x"}, n=4))
    assert (s.names, s.events_received) == ({}, 0)


# -- quarantine ----------------------------------------------------------------------------------


def pool_numbers(registry: Registry) -> list[tuple[int, int, int, int]]:
    return [
        (u.total_bytes, u.leased_bytes, u.free_bytes, u.quarantined_bytes) for u in registry.usage()
    ]


def test_chunks_whose_scrub_fails_are_quarantined_then_freed_by_the_reaper(
    tmp_path: Path, flaky: FlakyScrub, caplog: pytest.LogCaptureFixture
) -> None:
    flaky.failures = 5
    registry = Registry(settings(tmp_path), flaky)
    s = attached(registry, device=3 * C, host=2 * C)
    assert pool_numbers(registry) == [(8 * C, 3 * C, 5 * C, 0), (4 * C, 2 * C, 2 * C, 0)]
    with caplog.at_level(logging.INFO, logger="tidalpoold.sessions"):
        registry.end(s.id, Reason.REASON_DETACHED, "test")  # 5 scrubs, all fail
        assert pool_numbers(registry) == [(8 * C, 0, 5 * C, 3 * C), (4 * C, 0, 2 * C, 2 * C)]
        snap = registry.snapshot()
        assert (snap.device.quarantined_bytes, snap.host.quarantined_bytes) == (3 * C, 2 * C)
        assert [r.getMessage() for r in caplog.records].count("chunk.quarantined") == 5
        flaky.failures = 3
        assert registry.reap() == []  # the device's 3 fail again, the host's 2 are freed
        assert pool_numbers(registry) == [(8 * C, 0, 5 * C, 3 * C), (4 * C, 0, 4 * C, 0)]
        assert registry.reap() == []  # the rest
        assert pool_numbers(registry) == [(8 * C, 0, 8 * C, 0), (4 * C, 0, 4 * C, 0)]
        assert flaky.scrubs == 5 + 5 + 3
        messages = [r.getMessage() for r in caplog.records]
    assert messages.count("chunk.quarantined") == 5  # retries that fail are not logged again
    assert messages.count("chunk.restored") == 5
    registry.reap()
    assert flaky.scrubs == 13  # nothing left to scrub
    # Every chunk can be leased again, and was renewed by its scrub.
    again = registry.open(8 * C, 4 * C, "job", 1, 0)
    assert (again.device.length, again.host.length) == (8 * C, 4 * C)


def test_a_quarantined_chunk_is_never_leased(tmp_path: Path, flaky: FlakyScrub) -> None:
    flaky.failures = 1
    registry = Registry(settings(tmp_path), flaky)
    s = attached(registry, device=C, host=C)
    dirty = s.device.chunks
    registry.end(s.id, Reason.REASON_DETACHED, "test")  # the device chunk stays out
    flaky.failures = 1_000_000  # the daemon stays at its limit
    assert registry.reap() == []
    rest = registry.open(7 * C, 4 * C, "job", 1, 0)
    assert not set(rest.device.chunks) & set(dirty)
    with pytest.raises(ResourceExhausted, match="device pool cannot lease 1 chunks"):
        registry.open(C, C, "job", 1, 0)
    assert pool_numbers(registry)[0] == (8 * C, 7 * C, 0, C)


def test_a_stream_message_is_never_taken_from_an_ended_session(registry: Registry) -> None:
    s = attached(registry)
    registry.end(s.id, Reason.REASON_EVICTED, "test")
    registry.touch(s, pool_pb2.Heartbeat(device_used_bytes=C))
    assert s.device_used == 0
