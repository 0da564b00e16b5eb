"""decode_chunk and TraceStore: exact columns, every refusal's text, the bound, step marks."""

from __future__ import annotations

from typing import cast

import grpc
import numpy as np
import pytest
from tidalcore.errors import InvalidArgument
from tidalcore.v1.pool_pb2 import (
    EVENT_KIND_ALLOC,
    EVENT_KIND_FREE,
    EVENT_KIND_ITER,
    EVENT_KIND_OP,
    EVENT_KIND_READ,
    EVENT_KIND_WRITE,
    EventKind,
    StepMark,
    TraceChunk,
)
from tidalpoold.trace import TraceStore, decode_chunk

U64_MAX = 2**64 - 1


def raw_kind(value: int) -> EventKind:
    """Any number as an event kind: proto3 enums are open, the message carries unknown values."""
    return cast(EventKind, value)


def chunk(first_event: int, n: int, *, base: int = 0) -> TraceChunk:
    """`n` ALLOC events with block ids base.. base+n-1, sizes 256*(id+1)."""
    return TraceChunk(
        first_event=first_event,
        kinds=[EVENT_KIND_ALLOC] * n,
        block_ids=[base + i for i in range(n)],
        sizes=[256 * (base + i + 1) for i in range(n)],
        durations_ns=[0] * n,
        name_ids=[0] * n,
    )


# -- decode_chunk ----------------------------------------------------------------------------------


def test_decode_columns_exact() -> None:
    msg = TraceChunk(
        first_event=7,
        kinds=[
            EVENT_KIND_ITER,
            EVENT_KIND_ALLOC,
            EVENT_KIND_WRITE,
            EVENT_KIND_OP,
            EVENT_KIND_READ,
            EVENT_KIND_FREE,
        ],
        block_ids=[3, 10, 10, 1, 10, U64_MAX],
        sizes=[0, 4096, 0, 0, 0, U64_MAX],
        durations_ns=[0, 0, 0, 12_345, 0, 1],
        name_ids=[0, 0, 0, 2, 0, 2**32 - 1],
    )
    c = decode_chunk(msg)
    assert c.first_event == 7
    assert len(c) == 6
    assert c.kinds.dtype == np.uint8
    assert c.block_ids.dtype == np.uint64
    assert c.sizes.dtype == np.uint64
    assert c.durations_ns.dtype == np.uint64
    assert c.name_ids.dtype == np.uint32
    assert c.kinds.tolist() == [6, 1, 4, 5, 3, 2]
    assert c.block_ids.tolist() == [3, 10, 10, 1, 10, U64_MAX]
    assert c.sizes.tolist() == [0, 4096, 0, 0, 0, U64_MAX]
    assert c.durations_ns.tolist() == [0, 0, 0, 12_345, 0, 1]
    assert c.name_ids.tolist() == [0, 0, 0, 2, 0, 2**32 - 1]


def test_decode_empty_chunk() -> None:
    c = decode_chunk(TraceChunk(first_event=3))
    assert c.first_event == 3
    assert len(c) == 0
    assert c.kinds.dtype == np.uint8
    assert c.kinds.tolist() == []
    assert c.block_ids.tolist() == []


@pytest.mark.parametrize(
    ("column", "expected"),
    [
        ("block_ids", "{'kinds': 2, 'block_ids': 1, 'sizes': 2, 'durations_ns': 2, 'name_ids': 2}"),
        ("sizes", "{'kinds': 2, 'block_ids': 2, 'sizes': 1, 'durations_ns': 2, 'name_ids': 2}"),
        (
            "durations_ns",
            "{'kinds': 2, 'block_ids': 2, 'sizes': 2, 'durations_ns': 1, 'name_ids': 2}",
        ),
        ("name_ids", "{'kinds': 2, 'block_ids': 2, 'sizes': 2, 'durations_ns': 2, 'name_ids': 1}"),
    ],
)
def test_decode_refuses_mismatched_column_lengths(column: str, expected: str) -> None:
    msg = chunk(0, 2)
    del getattr(msg, column)[1]
    with pytest.raises(InvalidArgument) as e:
        decode_chunk(msg)
    assert str(e.value) == f"trace chunk columns differ in length: {expected}"


def test_decode_refuses_kinds_longer_than_the_rest() -> None:
    msg = chunk(0, 2)
    msg.kinds.append(EVENT_KIND_FREE)
    with pytest.raises(InvalidArgument) as e:
        decode_chunk(msg)
    assert str(e.value) == (
        "trace chunk columns differ in length: "
        "{'kinds': 3, 'block_ids': 2, 'sizes': 2, 'durations_ns': 2, 'name_ids': 2}"
    )


@pytest.mark.parametrize("bad", [0, 7, 99])
def test_decode_refuses_unknown_kind(bad: int) -> None:
    msg = chunk(0, 3)
    msg.kinds[1] = raw_kind(bad)
    with pytest.raises(InvalidArgument) as e:
        decode_chunk(msg)
    assert str(e.value) == f"trace chunk has unknown event kind {bad}"


def test_decode_names_the_first_unknown_kind() -> None:
    msg = chunk(0, 4)
    msg.kinds[1] = raw_kind(99)
    msg.kinds[3] = raw_kind(0)
    with pytest.raises(InvalidArgument) as e:
        decode_chunk(msg)
    assert str(e.value) == "trace chunk has unknown event kind 99"


# -- TraceStore ------------------------------------------------------------------------------------


def test_store_starts_empty() -> None:
    s = TraceStore(max_events=100)
    assert s.max_events == 100
    assert s.events_received == 0
    assert s.events_held == 0
    assert s.iterations_seen == 0
    assert s.names == {}
    assert list(s.chunks) == []


def test_add_keeps_events_in_order_and_stores_small_chunks_as_one() -> None:
    s = TraceStore(max_events=100)
    a = s.add(chunk(0, 3))
    b = s.add(chunk(3, 2, base=3))
    assert [len(a), len(b)] == [3, 2]
    assert [(c.first_event, len(c)) for c in s.chunks] == [(0, 5)]  # 3 + 2 <= 100: merged
    assert np.concatenate([c.block_ids for c in s.chunks]).tolist() == [0, 1, 2, 3, 4]
    assert s.chunks[0].sizes.tolist() == [256, 512, 768, 1024, 1280]
    assert b.sizes.tolist() == [1024, 1280]
    assert s.events_received == 5
    assert s.events_held == 5


@pytest.mark.parametrize("first_event", [0, 2, 4, 100])
def test_add_refuses_non_contiguous_first_event(first_event: int) -> None:
    s = TraceStore(max_events=100)
    s.add(chunk(0, 3))
    with pytest.raises(InvalidArgument) as e:
        s.add(chunk(first_event, 2))
    assert str(e.value) == f"trace chunk starts at event {first_event}, expected 3"
    assert s.events_received == 3
    assert s.events_held == 3
    assert len(s.chunks) == 1


def test_first_chunk_must_start_at_zero() -> None:
    s = TraceStore(max_events=100)
    with pytest.raises(InvalidArgument) as e:
        s.add(chunk(1, 2))
    assert str(e.value) == "trace chunk starts at event 1, expected 0"


def test_refused_chunk_changes_nothing() -> None:
    s = TraceStore(max_events=100)
    s.add(chunk(0, 2))
    bad = chunk(2, 2)
    bad.kinds[0] = raw_kind(0)
    bad.new_names[1] = "matmul"
    with pytest.raises(InvalidArgument):
        s.add(bad)
    assert s.events_received == 2
    assert s.events_held == 2
    assert len(s.chunks) == 1
    assert s.names == {}


def test_names_are_recorded() -> None:
    s = TraceStore(max_events=100)
    first = chunk(0, 1)
    first.new_names.update({1: "matmul", 2: "relu"})
    s.add(first)
    second = chunk(1, 1)
    second.new_names[3] = "softmax"
    s.add(second)
    assert s.names == {1: "matmul", 2: "relu", 3: "softmax"}


def test_names_only_chunk_is_accepted() -> None:
    s = TraceStore(max_events=100)
    s.add(chunk(0, 2))
    s.add(TraceChunk(first_event=2, new_names={1: "conv"}))
    assert s.names == {1: "conv"}
    assert s.events_received == 2
    assert s.events_held == 2


def test_name_id_zero_is_refused() -> None:
    s = TraceStore(max_events=100)
    msg = chunk(0, 2)
    msg.new_names[0] = "nothing"
    with pytest.raises(InvalidArgument) as e:
        s.add(msg)
    assert str(e.value) == "trace chunk defines name id 0 (reserved for no name)"
    assert s.names == {}
    assert s.events_received == 0
    assert len(s.chunks) == 0


def test_bound_drops_oldest_chunks() -> None:
    s = TraceStore(max_events=10)
    held, stored = [], []
    for i in range(4):
        s.add(chunk(4 * i, 4, base=4 * i))
        held.append(s.events_held)
        stored.append([(c.first_event, len(c)) for c in s.chunks])
    # 4; 4 + 4 <= 10 merged (8); 8 + 4 > 10 apart, 12 > 10 drops the first (4 held); the
    # fourth merges into the third (8).
    assert held == [4, 8, 4, 8]
    assert stored == [[(0, 4)], [(0, 8)], [(8, 4)], [(8, 8)]]
    assert s.events_received == 16
    assert np.concatenate([c.block_ids for c in s.chunks]).tolist() == list(range(8, 16))


def test_bound_exactly_reached_drops_nothing() -> None:
    s = TraceStore(max_events=8)
    s.add(chunk(0, 4))
    s.add(chunk(4, 4))
    assert s.events_held == 8
    assert [(c.first_event, len(c)) for c in s.chunks] == [(0, 8)]


def test_a_chunk_larger_than_the_bound_is_refused() -> None:
    s = TraceStore(max_events=10)
    s.add(chunk(0, 4))
    with pytest.raises(InvalidArgument) as e:
        s.add(chunk(4, 11, base=4))
    assert str(e.value) == (
        "trace chunk has 11 events, more than the 10 a session's trace keeps (max_trace_events)"
    )
    assert (s.events_received, s.events_held) == (4, 4)
    s.add(chunk(4, 10, base=4))  # exactly the bound: taken, the older chunk goes
    assert (s.events_received, s.events_held) == (14, 10)
    assert [(c.first_event, len(c)) for c in s.chunks] == [(4, 10)]


def test_step_counts_iterations() -> None:
    s = TraceStore(max_events=100)
    s.add(chunk(0, 5))
    s.step(StepMark(iteration=0, events_before=3))
    s.step(StepMark(iteration=1, events_before=5))  # equal to received: allowed
    assert s.iterations_seen == 2


def test_step_beyond_received_events_is_refused() -> None:
    s = TraceStore(max_events=100)
    s.add(chunk(0, 5))
    s.step(StepMark(iteration=0, events_before=5))
    with pytest.raises(InvalidArgument) as e:
        s.step(StepMark(iteration=1, events_before=6))
    assert str(e.value) == "step mark after event 6, but only 5 events were sent"
    assert s.iterations_seen == 1


def test_step_counts_events_dropped_by_the_bound() -> None:
    s = TraceStore(max_events=4)
    for i in range(3):
        s.add(chunk(4 * i, 4))
    assert s.events_held == 4
    s.step(StepMark(iteration=0, events_before=12))
    assert s.iterations_seen == 1


def test_invalid_argument_maps_to_its_grpc_code() -> None:
    with pytest.raises(InvalidArgument) as e:
        decode_chunk(
            TraceChunk(
                kinds=[raw_kind(0)], block_ids=[0], sizes=[0], durations_ns=[0], name_ids=[0]
            )
        )
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_caught_up_once_the_next_iteration_is_as_long_as_the_one_before() -> None:
    s = TraceStore(max_events=100)
    s.add(chunk(0, 10))
    s.step(StepMark(iteration=0, events_before=0))
    assert s.caught_up()  # one mark: no iteration ended yet
    s.step(StepMark(iteration=1, events_before=6))
    assert not s.caught_up()  # 4 events of the next iteration, the one before had 6
    s.add(chunk(10, 2))
    assert s.caught_up()


def test_allocations_of_a_shape_count_the_allocs_of_its_last_ended_iteration() -> None:
    """Counted when a mark ends the iteration, across chunks stored apart, of what the store
    still holds: never more than the iteration made; by shape, and forgotten with it."""
    s = TraceStore(max_events=10_000, max_shapes=2)
    n = 3000  # two neighbours hold more than COALESCE_EVENTS: stored apart
    frees = TraceChunk(first_event=n, kinds=[EVENT_KIND_FREE] * n, block_ids=range(n))
    frees.sizes[:] = frees.durations_ns[:] = frees.name_ids[:] = [0] * n
    s.add(chunk(0, n))
    s.add(frees)
    s.add(chunk(2 * n, n, base=n))
    assert [(c.first_event, len(c)) for c in s.chunks] == [(0, n), (n, n), (2 * n, n)]
    assert s.allocations_of("a") == 0  # no mark yet
    s.step(StepMark(iteration=0, events_before=2000, shape="a"))
    assert s.allocations_of("a") == 0  # one mark: no iteration ended
    s.step(StepMark(iteration=1, events_before=7000, shape="b"))
    assert s.allocations_of("a") == 1000 + 1000  # events 2000..2999 and 6000..6999
    assert s.allocations_of("b") == 0
    s.add(chunk(3 * n, n, base=2 * n))  # the first chunk is dropped by the bound
    assert s.allocations_of("a") == 2000  # counted when its iteration ended
    s.step(StepMark(iteration=2, events_before=9500, shape="c"))  # "a" is forgotten
    assert s.allocations_of("b") == 2000 + 500  # 7000..8999 of the third chunk, 9000..9499
    assert s.allocations_of("a") == 0
