"""The native trace ring: exact events, overflow counted and visible as gaps in seq, every event
seen once and in order while a C loop produces and Python drains; the recorder's format."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from tidalclient.hotpath import EVENT_DTYPE, Events, HotPath, forward, recorder_events
from tidalclient.plans import PlanTable
from tidalclient.recorder import Recorder
from tidalcore.events import ALLOC, FREE, ITER
from tidalcore.v1 import pool_pb2

from .native_twin import BASE, fresh

KiB = 1024


@pytest.fixture
def hp() -> Iterator[HotPath]:
    yield from fresh(3)


def rows(events: Events) -> list[tuple[int, ...]]:
    """(kind, slot, seq, block, size, offset) of each event: all but the time."""
    return [tuple(int(e[f]) for f in EVENT_DTYPE.names[:-1]) for e in events]  # type: ignore[index]


def test_events_name_every_malloc_free_and_step_exactly(hp: HotPath) -> None:
    hp.configure(BASE, 4 * KiB)
    t0 = time.monotonic_ns()  # CLOCK_MONOTONIC, as the library's stamps
    a = hp.alloc(100)
    hp.install_plan(PlanTable.build(4, [512], [0], 512, 256))
    hp.step()
    b = hp.alloc(512)
    hp.free(a or 0)
    hp.free(b or 0)
    t1 = time.monotonic_ns()
    events = hp.drain()
    assert rows(events) == [
        (ALLOC, -1, 0, 1, 100, 0),
        (ITER, -1, 1, 1, 0, 0),
        (ALLOC, 0, 2, 2, 512, 256),  # slot 0 of the plan, whose region is at 256
        (FREE, -1, 3, 1, 100, 0),
        (FREE, 0, 4, 2, 512, 256),
    ]
    stamps = events["t_ns"].astype(np.int64)
    assert t0 <= stamps[0] and stamps[-1] <= t1 and (np.diff(stamps) >= 0).all()
    assert len(hp.drain()) == 0
    assert hp.stats().events == 5


def test_without_timestamps_events_are_the_same_but_unstamped(hp: HotPath) -> None:
    hp.configure(BASE, 4 * KiB, timestamps=False)
    hp.free(hp.alloc(100) or 0)
    events = hp.drain()
    assert rows(events) == [(ALLOC, -1, 0, 1, 100, 0), (FREE, -1, 1, 1, 100, 0)]
    assert events["t_ns"].tolist() == [0, 0]


def test_a_full_ring_drops_and_counts_and_seq_shows_the_gap(hp: HotPath) -> None:
    hp.configure(BASE, 64 * KiB, ring_events=3)  # rounded up to 4
    blocks = [hp.alloc(256) for _ in range(5)]
    for address in blocks:
        hp.free(address or 0)
    s = hp.stats()
    assert (s.events, s.overflow) == (10, 6)
    first = hp.drain()
    assert first["seq"].tolist() == [0, 1, 2, 3]
    assert first["block"].tolist() == [1, 2, 3, 4]
    hp.step()
    hp.alloc(7)
    second = hp.drain(max_events=1)
    third = hp.drain()
    assert second["seq"].tolist() == [10] and third["seq"].tolist() == [11]
    assert (third["kind"][0], third["size"][0]) == (ALLOC, 7)
    assert hp.stats().overflow == 6


def test_drain_into_refuses_a_wrong_buffer(hp: HotPath) -> None:
    hp.configure(BASE, 4 * KiB)
    with pytest.raises(TypeError, match="writable contiguous array of EVENT_DTYPE"):
        hp.drain_into(np.zeros(4, dtype=np.uint64))
    with pytest.raises(TypeError, match="writable contiguous array of EVENT_DTYPE"):
        hp.drain_into(np.zeros(8, dtype=EVENT_DTYPE)[::2])
    assert hp.drain_into(np.zeros(0, dtype=EVENT_DTYPE)) == 0


PAIRS = 25  # per round: alloc h0 (256 B), alloc h1 (768 B), free h0, free h1, PAIRS times
PER_ROUND = 1 + 4 * PAIRS  # the ITER event, then the mallocs and frees


def script() -> tuple[np.ndarray, np.ndarray]:
    handles = np.array([0, 1, 0, 1] * PAIRS, dtype=np.uint64)
    sizes = np.array([256, 768, 0, 0] * PAIRS, dtype=np.uint64)
    return handles, sizes


def expected(seq: np.ndarray) -> list[tuple[int, ...]]:
    """What event number `seq` of the script is: every field follows from it."""
    found = []
    for s in seq.tolist():
        r, j = divmod(s, PER_ROUND)
        if j == 0:
            found.append((ITER, -1, s, r + 1, 0, 0))
            continue
        q, m = divmod(j - 1, 4)
        block = r * 2 * PAIRS + 2 * q + (1 if m in (0, 2) else 2)
        kind, size, offset = [(ALLOC, 256, 0), (ALLOC, 768, 256), (FREE, 256, 0), (FREE, 768, 256)][
            m
        ]
        found.append((kind, -1, s, block, size, offset))
    return found


@pytest.mark.parametrize("ring_events", [64, 1 << 16])
@pytest.mark.parametrize("consumers", [1, 2])
def test_while_c_produces_every_event_is_drained_once_in_order_or_counted(
    hp: HotPath, ring_events: int, consumers: int
) -> None:
    hp.configure(BASE, 64 * KiB, ring_events=ring_events)
    handles, sizes = script()
    rounds = 20_000 if ring_events == 64 else 2000  # few are seen through a small ring
    table = np.zeros(2, dtype=np.uint64)
    done = threading.Event()

    def produce() -> None:
        hp.replay(table, handles, sizes, np.zeros(0, dtype=np.uint64), rounds)
        done.set()

    batches: list[list[Events]] = [[] for _ in range(consumers)]

    def consume(mine: list[Events]) -> None:
        buffer = np.empty(64, dtype=EVENT_DTYPE)  # small batches: many drains race the producer
        while True:
            finished = done.is_set()  # read before draining: nothing is produced after it
            n = hp.drain_into(buffer)
            if n:
                mine.append(buffer[:n].copy())
            elif finished:
                return

    threads = [threading.Thread(target=produce)]
    threads += [threading.Thread(target=consume, args=(b,)) for b in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    seen = np.concatenate([e for mine in batches for e in mine])
    seen = seen[np.argsort(seen["seq"], kind="stable")]
    s = hp.stats()
    assert s.events == rounds * PER_ROUND
    assert len(seen) + s.overflow == s.events  # each event seen or counted as dropped
    assert len(np.unique(seen["seq"])) == len(seen)  # none twice
    for mine in batches:  # each consumer's batches in order
        seqs = np.concatenate(mine)["seq"] if mine else np.zeros(0)
        assert (np.diff(seqs.astype(np.int64)) > 0).all()
    assert rows(seen) == expected(seen["seq"])  # and each is what the producer made at that seq
    if ring_events == 1 << 16:
        assert s.overflow < s.events  # the big ring keeps up at least in part


def test_two_threads_allocating_never_share_bytes(hp: HotPath) -> None:
    """Two C loops on one device (the spinlock), a plan in use: the event log, replayed in seq
    order, never has two live blocks overlapping, and every block is freed once."""
    hp.configure(BASE, 64 * KiB, ring_events=1 << 20)
    hp.install_plan(PlanTable.build(1, [256, 768], [0, 0], 768, 256))  # slots share bytes
    handles, sizes = script()
    rounds = 300

    def produce() -> None:
        hp.replay(np.zeros(2, dtype=np.uint64), handles, sizes, np.zeros(0, np.uint64), rounds)

    threads = [threading.Thread(target=produce) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    events = hp.drain(max_events=1 << 20)
    s = hp.stats()
    assert s.overflow == 0 and len(events) == s.events == 2 * rounds * PER_ROUND
    assert events["seq"].tolist() == list(range(len(events)))
    assert s.mallocs == s.frees == 2 * rounds * 2 * PAIRS and s.live_blocks == 0
    assert s.hits > 0 and s.misses > 0
    assert hp.free_ranges() == [(0, 64 * KiB)]
    live: dict[int, tuple[int, int]] = {}
    for kind, block, offset, size in zip(
        events["kind"].tolist(),
        events["block"].tolist(),
        events["offset"].tolist(),
        events["size"].tolist(),
        strict=True,
    ):
        if kind == ALLOC:
            end = offset + -(-size // 256) * 256
            assert all(end <= o or e <= offset for o, e in live.values()), (block, live)
            live[block] = (offset, end)
        elif kind == FREE:
            del live[block]
    assert not live


class Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def record(
        self, kind: int, block_id: int, size: int = 0, duration_ns: int = 0, name_id: int = 0
    ) -> None:
        self.calls.append(("record", kind, block_id, size))

    def step(self, iteration: int) -> None:
        self.calls.append(("step", iteration))


def test_events_forward_to_a_recorder_as_the_executor_records_them(hp: HotPath) -> None:
    hp.configure(BASE, 4 * KiB)
    a = hp.alloc(100)
    hp.step()
    hp.free(a or 0)
    events = hp.drain()
    assert list(recorder_events(events)) == [(ALLOC, 1, 100), (ITER, 1, 0), (FREE, 1, 0)]
    sink = Sink()
    forward(events, sink)
    assert sink.calls == [("record", ALLOC, 1, 100), ("step", 1), ("record", FREE, 1, 0)]
    sent: list[pool_pb2.ClientMessage] = []
    recorder = Recorder(sent.append)
    forward(events, recorder)
    recorder.close()
    chunks = [m.trace for m in sent if m.WhichOneof("body") == "trace"]
    marks = [m.step for m in sent if m.WhichOneof("body") == "step"]
    assert [list(c.kinds) for c in chunks] == [[ALLOC, ITER, FREE]]
    assert [list(c.block_ids) for c in chunks] == [[1, 1, 1]]
    assert [list(c.sizes) for c in chunks] == [[100, 0, 0]]
    assert [(m.iteration, m.events_before) for m in marks] == [(1, 2)]  # ITER included
