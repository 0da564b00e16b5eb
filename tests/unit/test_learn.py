"""planner/learn: periods, iterations, rotation, signatures; exact on hand-built streams and on
every real model trace (checked against counts the test makes from the CSV itself)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tidalcore.events import ALLOC, FREE, ITER, OP, READ, WRITE, Events
from tidalcore.units import Bytes, Tick
from tidaloffline.formats import read_trace_csv
from tidalplan.learn import (
    NoIteration,
    Rotation,
    extract,
    find_period,
    live_bytes,
    rotation,
    signature,
    to_problem,
)
from tidalplan.model import Access, Buffer, Iteration, IterBlock, Op, Problem

MODELS = Path(__file__).resolve().parents[3] / "shared/traces/models"


class Stream:
    """Builds an event stream as a client sends it (frees carry size 0)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int, int, int]] = []
        self.names: dict[str, int] = {}
        self.ops = 0

    def alloc(self, block: int, size: int) -> Stream:
        self.rows.append((ALLOC, block, size, 0, 0))
        return self

    def free(self, block: int) -> Stream:
        self.rows.append((FREE, block, 0, 0, 0))
        return self

    def read(self, block: int) -> Stream:
        self.rows.append((READ, block, 0, 0, 0))
        return self

    def write(self, block: int) -> Stream:
        self.rows.append((WRITE, block, 0, 0, 0))
        return self

    def op(self, name: str, ns: int = 1000) -> Stream:
        name_id = self.names.setdefault(name, len(self.names) + 1)
        self.rows.append((OP, self.ops, 0, ns, name_id))
        self.ops += 1
        return self

    def iter(self, n: int) -> Stream:
        self.rows.append((ITER, n, 0, 0, 0))
        return self

    def events(self) -> Events:
        columns = list(zip(*self.rows, strict=True)) if self.rows else [[]] * 5
        return Events(*columns, names={v: k for k, v in self.names.items()})


def training(iterations: int, *, marks: bool = True) -> Stream:
    """A weight w (1, 100 B) allocated before training; iteration k:

    tick 0 op zero_grad          (reads the previous gradient)
    tick 1 free g[k-1]           iteration 0: alloc m (2, 30 B): optimizer state appears
    tick 2 alloc x[k] (10+k, 10 B)
    tick 3 op fwd                reads w, writes x
    tick 4 alloc g[k] (20+k, 20 B)
    tick 5 op bwd                reads x, writes g
    tick 6 free x[k]
    tick 7 op sgd                reads g and m, writes w
    """
    s = Stream().alloc(1, 100)
    for k in range(iterations):
        if marks:
            s.iter(k)
        if k:
            s.read(20 + k - 1)
        s.op("zero_grad", 10)
        if k:
            s.free(20 + k - 1)
        else:
            s.alloc(2, 30)
        s.alloc(10 + k, 10).read(1).write(10 + k).op("fwd", 100)
        s.alloc(20 + k, 20).read(10 + k).write(20 + k).op("bwd", 200)
        s.free(10 + k)
        s.read(20 + k).read(2).write(1).op("sgd", 50)
    return s


# The steady iteration of `training`, as the docstring above gives it.
STEADY = Iteration(
    ticks=8,
    blocks=(
        IterBlock(id=11, size=10, start=2, end=6),
        IterBlock(id=21, size=20, start=4, end=8 + 1, crosses=True),
    ),
    ops=(
        Op(tick=0, name="zero_grad", duration_ns=10),
        Op(tick=3, name="fwd", duration_ns=100),
        Op(tick=5, name="bwd", duration_ns=200),
        Op(tick=7, name="sgd", duration_ns=50),
    ),
    accesses=(
        Access(tick=0, block=20, write=False),
        Access(tick=3, block=1, write=False),
        Access(tick=3, block=11, write=True),
        Access(tick=5, block=11, write=False),
        Access(tick=5, block=21, write=True),
        Access(tick=7, block=21, write=False),
        Access(tick=7, block=2, write=False),
        Access(tick=7, block=1, write=True),
    ),
    persistent=((1, 100), (2, 30)),
    index=1,
)


# -- hand-built streams ----------------------------------------------------------------------------


def test_extract_with_marks_exact() -> None:
    events = training(3).events()
    assert events.marks() == [1, 17, 34]
    assert extract(events, events.marks()) == STEADY


def test_find_period_skips_the_differing_first_iteration() -> None:
    events = training(3).events()
    assert find_period(events) == (34, 51)  # iteration 2, from its `iter` mark to the end
    assert extract(events) == STEADY  # the first half of the square: iteration 1


def test_find_period_without_marks() -> None:
    events = training(3, marks=False).events()
    # the iteration starts after the previous op, with the read that goes with zero_grad
    assert find_period(events) == (32, 48)
    assert extract(events) == STEADY


def test_many_equal_iterations_give_one_period() -> None:
    # iterations 1 to 5 are equal: the longest square has two in each half; its period is one
    events = training(6).events()
    assert events.marks() == [1, 17, 34, 51, 68, 85]
    assert find_period(events) == (85, 102)
    blocks, accesses = ids_plus(STEADY.blocks, 3), accesses_plus(STEADY.accesses, 3)
    assert extract(events) == replace(STEADY, blocks=blocks, accesses=accesses, index=4)
    assert extract(events, events.marks()) == extract(events)


def ids_plus(blocks: tuple[IterBlock, ...], k: int) -> tuple[IterBlock, ...]:
    return tuple(replace(b, id=b.id + k) for b in blocks)


def accesses_plus(accesses: tuple[Access, ...], k: int) -> tuple[Access, ...]:
    return tuple(replace(a, block=a.block + k) if a.block > 2 else a for a in accesses)


def test_last_iteration_from_two_marks_never_freed() -> None:
    events = training(3).events()
    it = extract(events, [34, len(events)])
    assert it.ticks == 8
    assert it.index == 0
    assert it.blocks == (
        IterBlock(id=12, size=10, start=2, end=6),
        # never freed: live until the next iteration allocates it again (start + T), one
        # instance at a time
        IterBlock(id=22, size=20, start=4, end=12, crosses=True),
    )


def test_one_mark_falls_back_to_the_period() -> None:
    events = training(3).events()
    assert extract(events, [17]) == STEADY
    assert extract(events, [17, 17, 99]) == STEADY  # duplicates and marks past the end ignored


def test_inner_repetition_keeps_the_whole_iteration() -> None:
    # an iteration ends with the same three events four times (a repeated layer): the stream
    # ends with squares of 3 and 6 symbols, but the iteration is all of its 15 symbols
    s = Stream().alloc(0, 7)
    for k in range(3):
        s.alloc(100 + k, 64).op("f").free(100 + k)
        for j in range(4):
            s.alloc(1000 * k + j, 8).op("g").free(1000 * k + j)
        if k == 0:
            s.alloc(1, 32)  # optimizer state, at the first step: iteration 0 differs
    events = s.events()
    assert len(events) == 2 + 3 * 15
    assert find_period(events) == (2 + 2 * 15, 2 + 3 * 15)
    it = extract(events)
    assert it.ticks == 15
    assert it.index == 1
    assert it.persistent == ((0, 7), (1, 32))
    assert [(b.id, b.size, b.start, b.end) for b in it.blocks] == [(101, 64, 0, 2)] + [
        (1000 + j, 8, 3 + 3 * j, 5 + 3 * j) for j in range(4)
    ]


def test_block_living_beyond_the_iteration_is_persistent() -> None:
    s = Stream().alloc(1, 8).iter(0).alloc(5, 16).alloc(6, 4).op("a").free(6)
    s.iter(1).alloc(7, 4).op("a").free(7).iter(2).free(5).op("a")
    it = extract(s.events(), s.events().marks())
    assert it.ticks == 3
    assert it.persistent == ((1, 8), (5, 16))
    assert it.blocks == (IterBlock(id=7, size=4, start=0, end=2),)


def test_free_sizes_are_looked_up() -> None:
    # j's halves differ only in which block is freed first: its period is all of it
    s = Stream()
    for k in range(2):
        s.alloc(10 * k + 1, 8).alloc(10 * k + 2, 16).op("k").free(10 * k + 1).free(10 * k + 2)
        s.alloc(10 * k + 3, 8).alloc(10 * k + 4, 16).op("k").free(10 * k + 4).free(10 * k + 3)
    assert find_period(s.events()) == (10, 20)


@pytest.mark.parametrize(
    "stream",
    [
        Stream(),
        Stream().alloc(1, 8),
        Stream().alloc(1, 8).alloc(2, 16).alloc(3, 24).alloc(4, 32),  # no square at all
        Stream().alloc(1, 8).op("a").op("a").op("a").op("a"),  # squares without an alloc
        Stream().alloc(1, 8).alloc(2, 8),  # a square of one symbol: too short
    ],
)
def test_no_period(stream: Stream) -> None:
    events = stream.events()
    assert find_period(events) is None
    with pytest.raises(NoIteration, match=f"no repeating iteration in {len(events)} events"):
        extract(events)


def test_marks_around_nothing() -> None:
    events = Stream().alloc(1, 8).read(1).iter(0).read(1).iter(1).events()
    with pytest.raises(NoIteration, match=r"events \[2, 4\) hold no alloc, free or op"):
        extract(events, events.marks())


# -- rotation and the placement problem ------------------------------------------------------------


def test_live_bytes_and_rotation_of_the_steady_iteration() -> None:
    # tick:        0   1   2   3   4   5   6   7
    # x [2, 6)             10  10  10  10
    # g [4, 9)     20                  20  20  20   (previous instance over [0, 1))
    assert live_bytes(STEADY).tolist() == [20, 0, 10, 10, 30, 30, 20, 20]
    assert rotation(STEADY) == Rotation(cut=1, cut_bytes=0, wrapped=())
    problem, index = to_problem(STEADY, alignment=16)
    assert problem == Problem(
        buffers=(
            Buffer(id=0, lower=1, upper=5, size=16),
            Buffer(id=1, lower=3, upper=8, size=32),
        ),
        alignment=16,
    )
    assert index == [0, 1]


def test_rotation_prefers_tick_0() -> None:
    it = Iteration(
        ticks=4,
        blocks=(IterBlock(id=5, size=8, start=0, end=2), IterBlock(id=6, size=4, start=2, end=4)),
        ops=(),
        accesses=(),
        persistent=(),
    )
    assert rotation(it) == Rotation(cut=0, cut_bytes=0, wrapped=())
    assert to_problem(it) == (
        Problem(buffers=(Buffer(0, 0, 2, 8), Buffer(1, 2, 4, 4))),
        [0, 1],
    )


def test_wrapping_lifetime_becomes_conservative() -> None:
    # every cut has bytes live across it: A [0, 3) spans cuts 1, 2; B [2, 5) spans 3, 0
    it = Iteration(
        ticks=4,
        blocks=(
            IterBlock(id=5, size=8, start=0, end=3),
            IterBlock(id=6, size=4, start=2, end=5, crosses=True),
            IterBlock(id=7, size=0, start=1, end=2),  # left out
        ),
        ops=(),
        accesses=(),
        persistent=(),
    )
    assert live_bytes(it).tolist() == [12, 8, 12, 4]
    assert rotation(it) == Rotation(cut=0, cut_bytes=4, wrapped=(1,))
    assert to_problem(it, alignment=16) == (
        Problem(buffers=(Buffer(0, 0, 3, 16), Buffer(1, 0, 4, 16)), alignment=16),
        [0, 1],
    )


def test_to_problem_refuses_bad_alignment() -> None:
    with pytest.raises(ValueError, match="alignment must be positive, got 0"):
        to_problem(STEADY, alignment=0)


# -- signature -------------------------------------------------------------------------------------


def test_signature() -> None:
    digest = signature(STEADY)
    assert len(digest) == 16
    assert signature(replace(STEADY, index=7, persistent=())) == digest  # not part of the shape
    ops = (replace(STEADY.ops[0], duration_ns=99), *STEADY.ops[1:])
    assert signature(replace(STEADY, ops=ops)) == digest  # timings vary run to run
    renamed = (replace(STEADY.ops[0], name="other"), *STEADY.ops[1:])
    assert signature(replace(STEADY, ops=renamed)) != digest
    bigger = (replace(STEADY.blocks[0], size=11), STEADY.blocks[1])
    assert signature(replace(STEADY, blocks=bigger)) != digest
    later = (STEADY.blocks[0], replace(STEADY.blocks[1], end=10))
    assert signature(replace(STEADY, blocks=later)) != digest  # the free moves to tick 2
    assert signature(replace(STEADY, ticks=9)) != digest


# -- real model traces -----------------------------------------------------------------------------

TRACES = sorted(MODELS.glob("*.trace.csv")) if MODELS.is_dir() else []

# ticks, blocks, crossing, persistent count, persistent bytes, transient peak, rotation cut
EXPECTED = {
    "densenet121.b32": (6443, 1945, 364, 1093, 83564544, 4175898624, 363),
    "gpt2.b4": (2644, 767, 148, 297, 995551232, 7630054400, 147),
    "mobilenet_v3_large.b64": (2380, 692, 174, 488, 82612736, 2829830144, 173),
    "resnet50.b32": (2109, 609, 161, 483, 223975424, 2776539136, 160),
    "vgg16.b32": (403, 107, 32, 66, 1126130176, 2921509888, 31),
}


@dataclass(frozen=True)
class Reference:
    """What the test computes from the CSV lines alone, for iterations 1 and 2."""

    symbols: tuple[list[tuple[str, int | str]], list[tuple[str, int | str]]]
    ticks: int
    blocks: list[tuple[int, int, int]]  # size, start, end (ticks from `iter,1`)
    persistent: list[tuple[int, int]]  # id, size
    peak: int


def reference(path: Path) -> Reference:
    rows = [
        line.split(",")
        for line in path.read_text().splitlines()
        if not line.startswith("#") and not line.startswith("kind,")
    ]
    one = rows.index(["iter", "1", "", "", ""])
    two = rows.index(["iter", "2", "", "", ""])
    size: dict[str, int] = {}
    alloc_row: dict[str, int] = {}
    alloc_tick: dict[str, int] = {}
    free_tick: dict[str, int] = {}
    live_at_one: set[str] = set()
    freed_after_one: set[str] = set()
    symbols: tuple[list[tuple[str, int | str]], list[tuple[str, int | str]]] = ([], [])
    live: set[str] = set()
    live_bytes = most = tick = 0
    for i, (kind, block, nbytes, _, name) in enumerate(rows):
        if i == one:
            live_at_one = set(live)
            tick = 0
        if kind == "alloc":
            size[block] = int(nbytes)
            alloc_row[block] = i
            alloc_tick[block] = tick
            live.add(block)
            live_bytes += size[block]
        elif kind == "free":
            free_tick[block] = tick
            live.remove(block)
            live_bytes -= size[block]
            if i > one:
                freed_after_one.add(block)
        if kind in ("alloc", "free", "op"):
            if i > one and i != two:
                symbols[i > two].append((kind, name if kind == "op" else size[block]))
            if one < i < two:
                most = max(most, live_bytes)
            tick += 1
    persistent = sorted(live_at_one - freed_after_one, key=alloc_row.__getitem__)
    in_one = [b for i, (k, b, *_) in enumerate(rows) if k == "alloc" and one < i < two]
    return Reference(
        symbols=symbols,
        ticks=sum(1 for k, *_ in rows[one + 1 : two] if k in ("alloc", "free", "op")),
        blocks=[(size[b], alloc_tick[b], free_tick[b]) for b in in_one],
        persistent=[(int(b), size[b]) for b in persistent],
        peak=most - sum(size[b] for b in persistent),  # persistent blocks live all along
    )


@dataclass(frozen=True)
class Learned:
    name: str
    reference: Reference
    marked: Iteration
    detected: Iteration
    period: tuple[int, int] | None
    marks: list[int]
    n_events: int


@pytest.fixture(
    scope="module", params=TRACES, ids=[p.name.removesuffix(".trace.csv") for p in TRACES]
)
def learned(request: pytest.FixtureRequest) -> Iterator[Learned]:
    path: Path = request.param
    events = read_trace_csv(path)
    yield Learned(
        name=path.name.removesuffix(".trace.csv"),
        reference=reference(path),
        marked=extract(events, events.marks()),
        detected=extract(events),
        period=find_period(events),
        marks=events.marks(),
        n_events=len(events),
    )


def test_model_traces_present() -> None:
    if not TRACES:
        pytest.skip(f"no model traces at {MODELS}")
    assert sorted(p.name.removesuffix(".trace.csv") for p in TRACES) == sorted(EXPECTED)


def test_model_marks_and_period_agree(learned: Learned) -> None:
    assert learned.reference.symbols[0] == learned.reference.symbols[1]  # the premise
    assert learned.period == (learned.marks[2], learned.n_events)
    assert learned.detected == learned.marked
    assert learned.marked.index == 1


def test_model_iteration_is_iteration_1(learned: Learned) -> None:
    it, ref = learned.marked, learned.reference
    assert it.ticks == ref.ticks
    assert [(b.size, b.start, b.end) for b in it.blocks] == ref.blocks
    assert all(b.crosses == (b.end >= it.ticks) for b in it.blocks)
    assert [(op.tick, op.name) for op in it.ops] == [
        (t, s[1]) for t, s in enumerate(ref.symbols[0]) if s[0] == "op"
    ]


def test_model_persistent(learned: Learned) -> None:
    assert list(learned.marked.persistent) == learned.reference.persistent


def test_model_problem(learned: Learned) -> None:
    it = learned.marked
    problem, index = to_problem(it)
    rot = rotation(it)
    assert rot.wrapped == ()
    assert [problem.buffers[i].size for i in range(len(index))] == [
        it.blocks[i].size for i in index
    ]
    assert all(0 <= b.lower < b.upper <= it.ticks for b in problem.buffers)
    peak = sweep_peak(problem.buffers)
    assert peak <= learned.reference.peak
    assert peak == int(live_bytes(it).max()) == learned.reference.peak  # nothing wraps: exact
    crossing = sum(b.crosses for b in it.blocks)
    persistent = sum(s for _, s in it.persistent)
    numbers = (it.ticks, len(it.blocks), crossing, len(it.persistent), persistent, peak, rot.cut)
    assert numbers == EXPECTED[learned.name]


def sweep_peak(buffers: tuple[Buffer, ...]) -> int:
    """The most bytes live at once; at equal ticks ends (negative) sort first: [lower, upper)."""
    edges = sorted([(b.lower, b.size) for b in buffers] + [(b.upper, -b.size) for b in buffers])
    live = peak = 0
    for _, delta in edges:
        live += delta
        peak = max(peak, live)
    return peak


@settings(max_examples=300, deadline=None)
@given(
    ticks=st.integers(1, 12),
    spans=st.lists(
        st.tuples(st.integers(0, 11), st.integers(1, 36), st.integers(1, 9)), max_size=6
    ),
)
def test_live_bytes_matches_a_tick_by_tick_count(
    ticks: int, spans: list[tuple[int, int, int]]
) -> None:
    """Lifetimes of any length, wrapping the iteration any number of times."""
    blocks = tuple(
        IterBlock(i, Bytes(size), Tick(s % ticks), Tick(s % ticks + n), s % ticks + n > ticks)
        for i, (s, n, size) in enumerate(spans)
    )
    it = Iteration(ticks, blocks, (), (), ())
    expected = [
        sum(b.size for b in blocks for u in range(b.start, b.end) if u % ticks == t)
        for t in range(ticks)
    ]
    assert live_bytes(it).tolist() == expected
