"""BestFit and PythonExecutor: exact offsets on hand-built cases, exact errors, a property test."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tidalclient.errors import InvalidBlock, LeaseExceeded
from tidalclient.executors.base import Block
from tidalclient.executors.bestfit import BestFit
from tidalclient.executors.python import PythonExecutor
from tidalcore.events import ALLOC as EVENT_ALLOC
from tidalcore.events import FREE as EVENT_FREE
from tidalcore.events import ITER
from tidalcore.units import BlockId, Bytes, Offset

KiB = 1024


def carve(fit: BestFit, *sizes: int) -> list[int]:
    """Allocate `sizes` in order and return their offsets."""
    offsets = []
    for size in sizes:
        offset = fit.allocate(size)
        assert offset is not None
        offsets.append(offset)
    return offsets


# ---------------------------------------------------------------- BestFit


@pytest.mark.parametrize("alignment", [0, -256, 3, 96, 257])
def test_alignment_must_be_a_power_of_two(alignment: int) -> None:
    with pytest.raises(ValueError, match=f"alignment must be a power of two, got {alignment}"):
        BestFit(4096, alignment)


def test_negative_capacity_is_rejected() -> None:
    with pytest.raises(ValueError, match="capacity must not be negative, got -1"):
        BestFit(-1)


def test_capacity_rounds_down_to_alignment() -> None:
    fit = BestFit(1000)
    assert (fit.capacity, fit.alignment) == (768, 256)
    assert fit.free_ranges() == [(0, 768)]
    assert (fit.free_bytes, fit.largest_free, fit.used_bytes) == (768, 768, 0)


def test_capacity_below_alignment_is_empty() -> None:
    fit = BestFit(255)
    assert fit.capacity == 0
    assert fit.free_ranges() == []
    assert fit.largest_free == 0
    assert fit.allocate(1) is None


def test_sizes_round_up_to_alignment() -> None:
    fit = BestFit(4096)
    assert carve(fit, 1, 257, 256, 512) == [0, 256, 768, 1024]
    assert fit.used_bytes == 256 + 512 + 256 + 512
    assert fit.free_ranges() == [(1536, 2560)]


def test_alignment_one_packs_exactly() -> None:
    fit = BestFit(10, alignment=1)
    assert carve(fit, 3, 3, 4) == [0, 3, 6]
    assert fit.allocate(1) is None
    assert fit.release(3) == 3
    assert fit.free_ranges() == [(3, 3)]


def test_best_fit_prefers_the_smaller_hole() -> None:
    fit = BestFit(4096)
    a, _, c, _ = carve(fit, 1024, 256, 512, 256)  # 0, 1024, 1280, 1792; tail [2048, 4096)
    fit.release(a)
    fit.release(c)
    assert fit.free_ranges() == [(0, 1024), (1280, 512), (2048, 2048)]
    assert fit.allocate(300) == 1280  # 512 rounded: the 512 hole, not the lower 1024 one
    assert fit.allocate(768) == 0  # the 1024 hole beats the 2048 tail
    assert fit.free_ranges() == [(768, 256), (2048, 2048)]
    assert fit.allocate(257) == 2048  # 512 does not fit the 256 hole
    assert fit.free_ranges() == [(768, 256), (2560, 1536)]


def test_equal_holes_tie_to_the_lowest_offset() -> None:
    fit = BestFit(2048)
    a, _, c, _ = carve(fit, 512, 256, 512, 768)
    fit.release(c)  # the higher hole is freed first
    fit.release(a)
    assert fit.free_ranges() == [(0, 512), (768, 512)]
    assert fit.allocate(512) == 0
    assert fit.allocate(512) == 768
    assert fit.allocate(1) is None


def test_carves_from_the_low_end_of_the_hole() -> None:
    fit = BestFit(4096)
    a, _ = carve(fit, 1024, 256)
    fit.release(a)
    assert fit.allocate(256) == 0
    assert fit.free_ranges() == [(256, 768), (1280, 2816)]


def test_release_coalesces_with_left_neighbour() -> None:
    fit = BestFit(2048)
    a, b, _ = carve(fit, 256, 512, 1280)
    fit.release(a)
    assert fit.release(b) == 512
    assert fit.free_ranges() == [(0, 768)]
    assert fit.largest_free == 768


def test_release_coalesces_with_right_neighbour() -> None:
    fit = BestFit(2048)
    a, b, _ = carve(fit, 256, 512, 1280)
    fit.release(b)
    assert fit.release(a) == 256
    assert fit.free_ranges() == [(0, 768)]


def test_release_coalesces_both_sides_and_the_tail() -> None:
    fit = BestFit(2048)
    a, b, c, d = carve(fit, 256, 256, 256, 256)  # tail [1024, 2048) is free
    fit.release(a)
    fit.release(c)
    assert fit.free_ranges() == [(0, 256), (512, 256), (1024, 1024)]
    fit.release(b)
    assert fit.free_ranges() == [(0, 768), (1024, 1024)]
    fit.release(d)
    assert fit.free_ranges() == [(0, 2048)]
    assert (fit.used_bytes, fit.free_bytes, fit.largest_free) == (0, 2048, 2048)
    assert fit.allocate(2048) == 0


def test_exact_fit_consumes_the_hole() -> None:
    fit = BestFit(1024)
    assert carve(fit, 256, 256, 512) == [0, 256, 512]
    fit.release(256)
    assert fit.allocate(200) == 256
    assert fit.free_ranges() == []
    assert fit.largest_free == 0


def test_fragmented_space_does_not_fit_a_large_block() -> None:
    fit = BestFit(1024)
    a, _, c, _ = carve(fit, 256, 256, 256, 256)
    fit.release(a)
    fit.release(c)
    assert (fit.free_bytes, fit.largest_free) == (512, 256)
    assert fit.allocate(512) is None
    assert fit.free_ranges() == [(0, 256), (512, 256)]


def test_release_of_an_unknown_offset_raises_key_error_and_keeps_state() -> None:
    fit = BestFit(1024)
    a, _ = carve(fit, 256, 256)
    assert fit.release(a) == 256
    with pytest.raises(KeyError, match="offset 0 is not the start of an allocated range"):
        fit.release(a)
    with pytest.raises(KeyError, match="offset 300 is not"):
        fit.release(300)
    assert fit.free_ranges() == [(0, 256), (512, 512)]
    assert fit.used_bytes == 256


@pytest.mark.parametrize("nbytes", [0, -1])
def test_allocate_of_non_positive_size_is_an_error(nbytes: int) -> None:
    with pytest.raises(ValueError, match=f"allocate of {nbytes} bytes"):
        BestFit(1024).allocate(nbytes)


# ---------------------------------------------------------------- PythonExecutor


class TraceList(list[tuple[int, int, int]]):
    """A trace sink that keeps (kind, block id, size) of each event."""

    def record(
        self, kind: int, block_id: int, size: int = 0, duration_ns: int = 0, name_id: int = 0
    ) -> None:
        self.append((kind, block_id, size))

    def step(self, iteration: int) -> None:
        self.append((ITER, iteration, 0))


def test_malloc_numbers_blocks_and_records_events() -> None:
    events = TraceList()
    ex = PythonExecutor(4096, trace=events)
    a = ex.malloc(100)
    b = ex.malloc(300)
    assert a == Block(BlockId(1), Offset(0), Bytes(100), ex.session)
    assert b == Block(BlockId(2), Offset(256), Bytes(300), ex.session)
    ex.free(a)
    c = ex.malloc(256)
    assert (c.id, c.offset, c.size) == (3, 0, 256)
    assert events == [
        (EVENT_ALLOC, 1, 100),
        (EVENT_ALLOC, 2, 300),
        (EVENT_FREE, 1, 0),
        (EVENT_ALLOC, 3, 256),
    ]
    assert (EVENT_ALLOC, EVENT_FREE) == (1, 2)


def test_executors_have_distinct_sessions() -> None:
    assert PythonExecutor(1024).session != PythonExecutor(1024).session


def test_counters_and_peak() -> None:
    ex = PythonExecutor(8192)
    a = ex.malloc(1000)
    b = ex.malloc(10)
    assert (ex.live_bytes, ex.used_bytes, ex.peak_live_bytes) == (1010, 1280, 1010)
    ex.free(a)
    assert (ex.live_bytes, ex.used_bytes, ex.peak_live_bytes) == (10, 256, 1010)
    c = ex.malloc(500)
    assert (ex.live_bytes, ex.used_bytes, ex.peak_live_bytes) == (510, 768, 1010)
    d = ex.malloc(2000)
    assert (ex.live_bytes, ex.peak_live_bytes) == (2510, 2510)
    for block in (b, c, d):
        ex.free(block)
    assert (ex.mallocs, ex.frees, ex.live_blocks) == (4, 4, 0)
    assert (ex.live_bytes, ex.used_bytes, ex.free_bytes, ex.peak_live_bytes) == (0, 0, 8192, 2510)
    assert ex.free_ranges() == [(0, 8192)]


def test_block_lookup() -> None:
    ex = PythonExecutor(1024)
    a = ex.malloc(8)
    assert ex.block(1) is a
    ex.free(a)
    with pytest.raises(InvalidBlock, match="block 1 is not live"):
        ex.block(1)
    with pytest.raises(InvalidBlock, match="block 99 is not live"):
        ex.block(99)


@pytest.mark.parametrize("nbytes", [0, -5])
def test_malloc_of_non_positive_size(nbytes: int) -> None:
    ex = PythonExecutor(1024)
    with pytest.raises(ValueError, match=f"malloc of {nbytes} bytes: size must be positive"):
        ex.malloc(nbytes)
    assert (ex.mallocs, ex.live_blocks) == (0, 0)


def test_malloc_takes_numpy_integers() -> None:
    ex = PythonExecutor(4096)
    assert ex.malloc(np.int64(1000)) == Block(BlockId(1), Offset(0), Bytes(1000), ex.session)


@pytest.mark.parametrize(("value", "name"), [(True, "bool"), (1.5, "float"), ("8", "str")])
def test_malloc_of_non_int(value: object, name: str) -> None:
    with pytest.raises(TypeError, match=f"malloc size must be an int, got {name}"):
        PythonExecutor(1024).malloc(value)  # type: ignore[arg-type]


def test_malloc_beyond_the_lease() -> None:
    ex = PythonExecutor(4 * KiB)
    with pytest.raises(LeaseExceeded) as info:
        ex.malloc(5000)
    assert str(info.value) == (
        "malloc of 4.9 KiB (5000 bytes), 5120 aligned exceeds the lease of 4 KiB (4096 bytes)"
    )
    assert isinstance(info.value, MemoryError)
    assert (ex.mallocs, ex.live_blocks, ex.used_bytes) == (0, 0, 0)


def test_malloc_beyond_the_rounded_lease() -> None:
    ex = PythonExecutor(1000)  # 768 usable
    assert ex.capacity == 768
    message = r"^malloc of 769 bytes, 1024 aligned exceeds the lease of 768 bytes$"
    with pytest.raises(LeaseExceeded, match=message):
        ex.malloc(769)
    assert ex.malloc(768).offset == 0


def test_malloc_that_fits_the_lease_but_not_the_free_space() -> None:
    ex = PythonExecutor(4 * KiB)
    blocks = [ex.malloc(1000) for _ in range(4)]  # 1024 each after rounding
    ex.free(blocks[1])
    ex.free(blocks[3])
    with pytest.raises(LeaseExceeded) as info:
        ex.malloc(2 * KiB)
    assert str(info.value) == (
        "malloc of 2 KiB (2048 bytes) does not fit now: 2 KiB (2000 bytes) live"
        " in a lease of 4 KiB (4096 bytes), largest free range 1 KiB (1024 bytes)"
    )
    assert (ex.mallocs, ex.live_blocks, ex.used_bytes) == (4, 2, 2048)
    assert ex.malloc(KiB).offset == 1024


def test_malloc_into_a_full_lease_names_no_free_range() -> None:
    ex = PythonExecutor(512)
    ex.malloc(512)
    message = "512 bytes live in a lease of 512 bytes, largest free range 0 bytes$"
    with pytest.raises(LeaseExceeded, match=message):
        ex.malloc(1)


def test_free_of_a_foreign_block_leaves_both_executors_intact() -> None:
    ours, theirs = PythonExecutor(2048), PythonExecutor(2048)
    mine = ours.malloc(100)
    for _ in range(7):
        foreign = theirs.malloc(10)
    with pytest.raises(InvalidBlock) as info:
        ours.free(foreign)
    assert str(info.value) == "block 7 (offset 1536, 10 bytes) belongs to another session"
    assert isinstance(info.value, ValueError)
    assert theirs.block(7) is foreign
    assert (ours.live_blocks, ours.frees, ours.block(1)) == (1, 0, mine)
    theirs.free(foreign)
    assert theirs.live_blocks == 6


def test_double_free_leaves_state_intact() -> None:
    events = TraceList()
    ex = PythonExecutor(2048, trace=events)
    a = ex.malloc(1500)
    b = ex.malloc(300)
    ex.free(a)
    before = (ex.live_bytes, ex.used_bytes, ex.live_blocks, ex.mallocs, ex.frees, ex.free_ranges())
    with pytest.raises(InvalidBlock) as info:
        ex.free(a)
    message = "block 1 (offset 0, 1.5 KiB (1500 bytes)) is not live (already freed?)"
    assert str(info.value) == message
    after = (ex.live_bytes, ex.used_bytes, ex.live_blocks, ex.mallocs, ex.frees, ex.free_ranges())
    assert after == before == (300, 512, 1, 2, 1, [(0, 1536)])
    assert len(events) == 3
    assert ex.malloc(1536).offset == 0  # the freed bytes are handed out once, not twice
    ex.free(b)


def test_free_of_a_forged_block_is_rejected() -> None:
    ex = PythonExecutor(2048)
    a = ex.malloc(256)
    forged = Block(a.id, Offset(256), a.size, ex.session)
    with pytest.raises(InvalidBlock, match=r"block 1 \(offset 256, 256 bytes\) is not live"):
        ex.free(forged)
    ex.free(Block(a.id, a.offset, a.size, ex.session))  # an equal value is the same block
    assert ex.live_blocks == 0


# ---------------------------------------------------------------- property


def _check_invariants(ex: PythonExecutor, live: dict[int, Block]) -> None:
    align, capacity = ex.alignment, ex.capacity
    ranges: list[tuple[int, int]] = []
    for block in live.values():
        rounded = -(-block.size // align) * align
        assert block.offset % align == 0
        assert block.offset >= 0 and block.offset + rounded <= capacity
        ranges.append((block.offset, rounded))
    ranges.sort()
    for (start, size), (next_start, _) in itertools.pairwise(ranges):
        assert start + size <= next_start, "live ranges overlap"
    assert ex.used_bytes == sum(size for _, size in ranges)
    assert ex.live_bytes == sum(block.size for block in live.values())
    assert ex.live_blocks == len(live)
    assert ex.used_bytes + ex.free_bytes == capacity
    free = ex.free_ranges()
    assert sum(size for _, size in free) == ex.free_bytes
    for (free_start, free_size), (next_free, _) in itertools.pairwise(free):
        assert free_start + free_size < next_free, "free ranges overlap or touch"
    for start, size in free:
        assert size > 0 and start % align == 0 and start + size <= capacity
        for offset, rounded in ranges:
            assert start + size <= offset or offset + rounded <= start, "free overlaps live"


ops = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), st.integers(1, 3000)),
        st.tuples(st.just("free"), st.integers(0, 1000)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(0, 8192), alignment=st.sampled_from([1, 8, 256, 512]), steps=ops)
def test_any_interleaving_keeps_blocks_apart(
    capacity: int, alignment: int, steps: list[tuple[str, int]]
) -> None:
    ex = PythonExecutor(capacity, alignment)
    live: dict[int, Block] = {}
    peak = next_id = 0
    for op, value in steps:
        if op == "free" and live:
            block = live.pop(sorted(live)[value % len(live)])
            ex.free(block)
        elif op == "malloc":
            rounded = -(-value // alignment) * alignment
            holes = ex.free_ranges()
            try:
                block = ex.malloc(value)
            except LeaseExceeded:
                assert all(size < rounded for _, size in holes)
            else:
                next_id += 1
                fitting = [(size, start) for start, size in holes if size >= rounded]
                assert block.offset == min(fitting)[1], "not the best fit"
                assert (block.id, block.size) == (next_id, value)
                live[block.id] = block
                peak = max(peak, ex.live_bytes)
        _check_invariants(ex, live)
    assert ex.peak_live_bytes == peak


def test_step_marks_the_trace_and_counts_iterations() -> None:
    events = TraceList()
    ex = PythonExecutor(1024, trace=events)
    block = ex.malloc(10)
    assert (ex.step(), ex.step()) == (1, 2)
    assert events == [(EVENT_ALLOC, block.id, 10), (ITER, 1, 0), (ITER, 2, 0)]
