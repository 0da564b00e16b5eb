"""Learn the steady training iteration from an event stream.

Iteration boundaries come from step marks when the job sends them; otherwise
from the stream itself (SmartPool, Section III): the stream's symbols, one per
alloc (its size), free (the freed block's size) and op (its kernel name), end
with two equal iterations once training is steady. The longest square (two
equal halves) that ends the stream is found in linear time with the Z-function
of the reversed symbols, and its smallest period is the iteration. Longest,
because short squares are everywhere (repeated layers, the optimizer's loop
over parameters); the first iteration differs (optimizer state appears), so the
square stops before it.

    symbols:  w w │ a a o a o f o │ f a a o f o │ f a a o f o │   end of stream
              setup, iteration 0  └─ extracted ─┴─ successor ─┘   the square's halves

A live stream (the daemon's) ends inside an iteration, so `extract` takes the one between the
last two marks. A finished trace (a file) ends with its last iteration, and
`extract_finished` takes the last iteration that the next one repeats, saying why.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from tidalcore.events import ALLOC, FREE, OP, READ, WRITE, Events
from tidalcore.units import Bytes, Tick

from tidalplan.model import Access, Buffer, Iteration, IterBlock, Op, Problem

MIN_PERIOD = 2  # symbols; a period must also contain an alloc


class NoIteration(ValueError):
    """The stream holds no complete iteration: too short, or not (yet) periodic."""


@dataclass(frozen=True, slots=True)
class Rotation:
    """Where `to_problem` cuts the periodic time axis, and what still crosses the cut."""

    cut: Tick  # the iteration's tick that becomes tick 0
    cut_bytes: Bytes  # transient bytes live across the cut
    wrapped: tuple[int, ...]  # indices in `Iteration.blocks` given the conservative [0, ticks)


# -- symbols and periods ---------------------------------------------------------------------------


def _lives(events: Events) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """For every event: the index of the free of the block it allocates (-1: never freed or
    not an alloc), and the index of the alloc of the block it frees (-1: unknown or not a free)."""
    n = len(events)
    free_of = np.full(n, -1, np.int64)
    alloc_of = np.full(n, -1, np.int64)
    live: dict[int, int] = {}
    kinds = events.kinds.tolist()
    ids = events.block_ids.tolist()
    for i in np.flatnonzero((events.kinds == ALLOC) | (events.kinds == FREE)).tolist():
        if kinds[i] == ALLOC:
            live[ids[i]] = i
        else:
            a = live.pop(ids[i], -1)
            alloc_of[i] = a
            if a >= 0:
                free_of[a] = i
    return free_of, alloc_of


def _symbols(events: Events, alloc_of: npt.NDArray[np.int64]) -> tuple[list[int], list[int]]:
    """The (kind, size or name) symbols of the alloc, free and op events, encoded as ints,
    and each symbol's event index."""
    kinds = events.kinds
    where = np.flatnonzero((kinds == ALLOC) | (kinds == FREE) | (kinds == OP))
    k = kinds[where]
    value = events.sizes[where]  # a copy: fancy indexing
    frees = np.flatnonzero(k == FREE)
    source = alloc_of[where[frees]]
    known = source >= 0
    value[frees[known]] = events.sizes[source[known]]  # clients send frees with size 0
    ops = k == OP
    value[ops] = events.name_ids[where[ops]]
    symbols = [v * 8 + c for v, c in zip(value.tolist(), k.tolist(), strict=True)]
    return symbols, where.tolist()


def _z_function(s: Sequence[int]) -> list[int]:
    """z[i]: the length of the longest common prefix of s and s[i:] (z[0] = len(s))."""
    n = len(s)
    z = [0] * n
    if n:
        z[0] = n
    left = right = 0
    for i in range(1, n):
        k = min(right - i, z[i - left]) if i < right else 0
        while i + k < n and s[k] == s[i + k]:
            k += 1
        z[i] = k
        if i + k > right:
            left, right = i, i + k
    return z


@dataclass(frozen=True, slots=True)
class _Period:
    length: int  # symbols in one period
    copies: int  # whole periods ending the stream (>= 2)
    starts: tuple[int, int]  # event index where the last two periods begin
    ends: tuple[int, int]  # event index where they end


def _period(events: Events) -> _Period | None:
    _, alloc_of = _lives(events)
    symbols, where = _symbols(events, alloc_of)
    n = len(symbols)
    z = _z_function(symbols[::-1])  # the suffix of length 2p is a square iff z[p] >= p
    longest = next((p for p in range(n // 2, MIN_PERIOD - 1, -1) if z[p] >= p), 0)
    allocs = [i for i, s in enumerate(symbols) if s % 8 == ALLOC]
    if not longest or not allocs:
        return None

    def fits(d: int) -> bool:  # the last 2*longest symbols have period d, which holds an alloc
        return d >= MIN_PERIOD and z[d] >= 2 * longest - d and allocs[-1] >= n - d

    if not fits(longest):
        return None
    divisors = [d for d in range(1, int(longest**0.5) + 1) if longest % d == 0]
    candidates = sorted({*divisors, *(longest // d for d in divisors)})
    d = next(d for d in candidates if fits(d))  # the smallest period divides `longest`

    def start(symbol: int) -> int:  # reads and writes before the first symbol go with it
        return where[symbol - 1] + 1 if symbol > 0 else 0

    return _Period(
        length=d,
        copies=min(z[d] + d, n) // d,
        starts=(start(n - 2 * d), start(n - d)),
        ends=(start(n - d), where[-1] + 1),
    )


def find_period(events: Events) -> tuple[int, int] | None:
    """(start, end) event indices of the stream's last full iteration, found without marks.

    The iteration is the smallest period of the longest square (two equal halves
    of alloc/free/op symbols) that ends the stream; None if there is no square of
    at least MIN_PERIOD symbols whose half contains an alloc.
    """
    period = _period(events)
    return None if period is None else (period.starts[1], period.ends[1])


# -- the iteration ---------------------------------------------------------------------------------


def extract(events: Events, steps: Sequence[int] | None = None) -> Iteration:
    """The steady iteration of the stream.

    `steps` are event indices where iterations begin (`Events.marks()`, or
    StepMark.events_before): the iteration between the last two is taken. With
    fewer than two, the period is detected (`find_period`), and the iteration
    taken is the first half of the final square: the second half follows it, so
    the stream shows when its crossing blocks are freed. NoIteration if neither
    gives an iteration with at least one alloc, free or op.

    `Iteration.index` is, with steps, the position of its first boundary among
    them; detected, the number of repeats before it, plus one if anything
    precedes the repeats (the first iteration, which differs, and the setup).
    """
    bounds = sorted({s for s in steps or () if 0 <= s <= len(events)})
    if len(bounds) >= 2:
        return _iteration(events, bounds[-2], bounds[-1], len(bounds) - 2)
    period = _period(events)
    if period is None:
        raise NoIteration(f"no repeating iteration in {len(events)} events and no step marks")
    n_symbols = int(np.count_nonzero(np.isin(events.kinds, (ALLOC, FREE, OP))))
    rest = n_symbols - period.copies * period.length  # symbols before the repeats: iteration 0
    index = period.copies - 2 + (1 if rest > 0 else 0)
    return _iteration(events, period.starts[0], period.ends[0], index)


@dataclass(frozen=True, slots=True)
class Chosen:
    """The iteration `extract_finished` took as the steady one, and why that one."""

    iteration: Iteration
    marked: int  # iterations the trace marks (0: none, the iteration was found by its repeats)
    why: str

    def __str__(self) -> str:
        of = f" of {self.marked}" if self.marked else ""
        return f"iteration {self.iteration.index}{of} ({self.why})"


def mark_shapes(events: Events, marks: Sequence[int]) -> list[str]:
    """The iteration shape each of `marks` (indices of ITER events) begins: its name, ""
    for none."""
    return [events.names.get(int(events.name_ids[m]), "") for m in marks]


def shapes(events: Events) -> list[str]:
    """The iteration shapes a stream marks, in the order they first appear; [] without
    marks."""
    return list(dict.fromkeys(mark_shapes(events, events.marks())))


def extract_shape(events: Events, shape: str) -> Iteration:
    """The steady iteration of `shape` in a live stream: where every iteration it marks is of
    that shape (a stream of one shape), `extract`'s; else the last whole iteration of that
    shape. NoIteration if there is none."""
    marks = events.marks()
    named = mark_shapes(events, marks)
    if all(s == shape for s in named):
        return extract(events, marks)
    whole = [k for k in range(len(marks) - 1) if named[k] == shape]
    if not whole:
        raise NoIteration(f"the trace held has no whole iteration of shape {shape!r}")
    return extract(events, marks[: whole[-1] + 2])


def extract_finished(events: Events, shape: str | None = None) -> Chosen:
    """The steady iteration of a finished trace (a file, as `record` writes it: its last
    iteration ends where the stream ends), and why it was chosen.

    With several iteration shapes (`shapes`), `shape` names the one taken, and each of its
    iterations is compared with the next of the same shape; None is for a trace of one shape
    (ValueError names the shapes otherwise, and an unknown one).

    With step marks, iteration i runs from mark i to mark i + 1, the last one to the end of
    the stream. Taken: the last iteration that the next one repeats (the same allocs, frees
    and ops), which is steady and followed by a whole iteration that shows when what it leaves
    alive is freed. If no iteration repeats the one before it, the last one is taken (the first
    allocates what later ones keep: gradients, optimizer state); a block it leaves alive then
    counts as live until the next iteration allocates it again (one instance at a time: the
    placement and the simulator count the same bytes). One marked iteration is refused
    (NoIteration): the first iteration of training is not the steady one. Without marks, the
    iteration is found by its repeats, as `extract` finds it.
    """
    marks = sorted({m for m in events.marks() if 0 <= m <= len(events)})
    if not marks:
        if shape:
            raise ValueError(f"the trace marks no iterations, so none of shape {shape!r}")
        return Chosen(extract(events), 0, "found by its repeats: the trace marks no iterations")
    bounds = [*marks, len(events)]
    _, alloc_of = _lives(events)
    symbols, where = _symbols(events, alloc_of)
    first = np.searchsorted(np.asarray(where, np.int64), bounds).tolist()  # symbol per bound

    def symbols_of(i: int) -> list[int]:
        return symbols[first[i] : first[i + 1]]

    n = len(marks)
    while n > 1 and not symbols_of(n - 1):  # a mark at the end begins no iteration
        n -= 1
    named = mark_shapes(events, marks[:n])
    kinds = list(dict.fromkeys(named))
    if shape is None and len(kinds) > 1:
        raise ValueError(
            f"the trace has {len(kinds)} iteration shapes ({', '.join(map(repr, kinds))}):"
            " name the one to take"
        )
    if shape is not None and shape not in kinds:
        raise ValueError(
            f"the trace has no iteration of shape {shape!r} (its shapes:"
            f" {', '.join(map(repr, kinds))})"
        )
    if len(kinds) > 1:
        return _of_shape(events, bounds, named, symbols_of, shape or "")
    if n == 1 and symbols_of(0):
        raise NoIteration(
            "the trace marks 1 iteration, and the first iteration of training is not the steady"
            " one (it allocates what the next ones keep: gradients, optimizer state): record at"
            " least 3, the first, the steady one and one that repeats it"
        )
    for k in range(n - 2, -1, -1):
        mine = symbols_of(k)
        if mine and mine == symbols_of(k + 1):
            it = _iteration(events, bounds[k], bounds[k + 1], k)
            return Chosen(it, n, f"iteration {k + 1} repeats it")
    it = _iteration(events, bounds[n - 1], bounds[n], n - 1)
    why = "the last: none repeats the one before it, so what it leaves alive counts as live"
    return Chosen(it, n, why + " until the next allocates it again")


def _of_shape(
    events: Events,
    bounds: list[int],
    named: list[str],
    symbols_of: Callable[[int], list[int]],
    shape: str,
) -> Chosen:
    """`extract_finished` for one shape of several: the last of its iterations that its next
    one repeats, else its last (the stream's first iteration is not taken while it has
    another)."""
    mine = [k for k, name in enumerate(named) if name == shape]
    for a, b in itertools.pairwise(reversed(mine)):  # b before a
        if symbols_of(b) and symbols_of(b) == symbols_of(a):
            it = _iteration(events, bounds[b], bounds[b + 1], b)
            return Chosen(it, len(named), f"iteration {a} of shape {shape!r} repeats it")
    last = mine[-1]
    if last == 0:
        raise NoIteration(
            f"the trace's only iteration of shape {shape!r} is its first, which allocates what"
            " later ones keep: record more of that shape"
        )
    it = _iteration(events, bounds[last], bounds[last + 1], last)
    why = f"the last of shape {shape!r}: none repeats the one of its shape before it"
    return Chosen(it, len(named), why)


def _iteration(events: Events, start: int, end: int, index: int) -> Iteration:
    kinds = events.kinds
    is_tick = (kinds == ALLOC) | (kinds == FREE) | (kinds == OP)
    before = np.concatenate(([0], np.cumsum(is_tick, dtype=np.int64)))  # ticks before event i
    base = int(before[start])
    ticks = int(before[end]) - base
    if ticks == 0:
        raise NoIteration(f"events [{start}, {end}) hold no alloc, free or op")
    free_of, _ = _lives(events)
    ids = events.block_ids

    blocks = []
    for i in np.flatnonzero(kinds[start:end] == ALLOC).tolist():
        a = start + i
        f = int(free_of[a])
        began = int(before[a]) - base
        # Never freed (the last iteration of a trace none repeats): live until the next
        # iteration allocates it again, one instance at a time, as the job keeps it.
        stop = int(before[f]) - base if f >= 0 else began + ticks
        blocks.append(
            IterBlock(
                id=int(ids[a]),
                size=Bytes(int(events.sizes[a])),
                start=Tick(began),
                end=Tick(stop),
                crosses=f < 0 or f >= end,
            )
        )
    earlier = np.flatnonzero(kinds[:start] == ALLOC)
    kept = earlier[(free_of[earlier] < 0) | (free_of[earlier] >= end)]
    persistent = tuple((int(ids[a]), Bytes(int(events.sizes[a]))) for a in kept.tolist())

    op_at = start + np.flatnonzero(kinds[start:end] == OP)
    ops = tuple(
        Op(
            tick=Tick(int(before[o]) - base),
            name=events.names.get(int(events.name_ids[o]), ""),
            duration_ns=int(events.durations_ns[o]),
        )
        for o in op_at.tolist()
    )
    touch = start + np.flatnonzero((kinds[start:end] == READ) | (kinds[start:end] == WRITE))
    next_op = np.searchsorted(op_at, touch)  # the op each read or write belongs to
    accesses = tuple(
        Access(tick=ops[k].tick, block=int(ids[t]), write=bool(kinds[t] == WRITE))
        for t, k in zip(touch.tolist(), next_op.tolist(), strict=True)
        if k < len(ops)  # after the last op: the next iteration's
    )
    return Iteration(
        ticks=ticks,
        blocks=tuple(blocks),
        ops=ops,
        accesses=accesses,
        persistent=persistent,
        index=index,
    )


# -- the placement problem -------------------------------------------------------------------------


def _add_periodic(acc: npt.NDArray[np.int64], first: int, count: int, size: int) -> None:
    """Add `size` to `count` consecutive ticks from `first`, wrapping around len(acc)."""
    t = len(acc)
    acc += size * (count // t)
    count %= t
    first %= t
    tail = min(count, t - first)
    acc[first : first + tail] += size
    acc[: count - tail] += size


def live_bytes(it: Iteration) -> npt.NDArray[np.int64]:
    """Transient bytes live during each tick in the steady state: every block of the iteration,
    and the previous iteration's instance of each crossing block, over [0, end - ticks)."""
    t = it.ticks
    if not it.blocks:
        return np.zeros(t, np.int64)
    start = np.fromiter((b.start for b in it.blocks), np.int64, len(it.blocks))
    count = np.fromiter((b.end - b.start for b in it.blocks), np.int64, len(it.blocks))
    size = np.fromiter((b.size for b in it.blocks), np.int64, len(it.blocks))
    # One pass with a difference array: whole wraps add to every tick, the rest is a
    # range [first, first + rest) that may wrap past the end once.
    first, rest = start % t, count % t
    diff = np.zeros(t + 1, np.int64)
    np.add.at(diff, first, size)
    end = first + rest
    wraps = end > t
    np.add.at(diff, np.where(wraps, t, end), -size)
    np.add.at(diff, np.zeros(int(wraps.sum()), np.intp), size[wraps])
    np.add.at(diff, end[wraps] - t, -size[wraps])
    return np.cumsum(diff[:t]) + int((size * (count // t)).sum())


def rotation(it: Iteration) -> Rotation:
    """The cut tick with the fewest transient bytes live across it (the earliest of ties)."""
    across = np.zeros(it.ticks, np.int64)  # across[c]: bytes live from tick c-1 into tick c
    for b in it.blocks:
        _add_periodic(across, b.start + 1, b.end - b.start - 1, b.size)
    cut = int(np.argmin(across))
    wrapped = tuple(
        i
        for i, b in enumerate(it.blocks)
        if (b.start - cut) % it.ticks + b.end - b.start > it.ticks
    )
    return Rotation(cut=Tick(cut), cut_bytes=Bytes(int(across[cut])), wrapped=wrapped)


def to_problem(it: Iteration, alignment: int = 1) -> tuple[Problem, list[int]]:
    """The placement problem of the iteration's blocks, and each buffer's index in `it.blocks`.

    In the steady state a crossing block b (allocated at tick a, freed at tick f
    of the next iteration) holds its bytes over [a, T) and, as the previous
    iteration's instance at the same offset, over [0, f). Cutting the periodic
    time axis at a tick c that no block is live across makes every lifetime one
    interval, so the problem is exact:

        tick   0      f        c         a           T
        b      ███████┘        ┆         └███████████│   its previous instance, then itself
        x           └████┘     ┆                     │
                               ┆ cut: nothing is live across it
        rotated, tick 0 is c: a block lives over [(start - c) mod T, + its length)
        tick   0         a-c                T+f-c    T
        b                └██████████████████┘        │
        x                                 └████┘     │

    A block that still wraps (only when every cut has bytes live across it: see
    `rotation`) gets the conservative [0, T). Sizes are rounded up to
    `alignment`; zero-size blocks are left out. Buffer ids are indices in
    `it.blocks`.
    """
    if alignment < 1:
        raise ValueError(f"alignment must be positive, got {alignment}")
    rot = rotation(it)
    wrapped = set(rot.wrapped)
    buffers = []
    index = []
    for i, b in enumerate(it.blocks):
        if b.size <= 0:
            continue
        lower = (b.start - rot.cut) % it.ticks
        upper = lower + b.end - b.start
        if i in wrapped:
            lower, upper = 0, it.ticks
        size = -(-b.size // alignment) * alignment
        buffers.append(Buffer(id=i, lower=Tick(lower), upper=Tick(upper), size=Bytes(size)))
        index.append(i)
    return Problem(buffers=tuple(buffers), alignment=alignment), index


# -- the plan cache's key --------------------------------------------------------------------------


def signature(it: Iteration) -> bytes:
    """A 16-byte hash of the iteration's symbols, tick by tick: (alloc, size), (free, size)
    (frees of crossing blocks' previous instances included), (op, name); and, for one whose
    persistent blocks stay on the device across its boundary, that."""
    symbols: list[tuple[int, int, bytes]] = []
    for b in it.blocks:
        symbols.append((b.start, ALLOC, struct.pack("<q", b.size)))
        if b.end - it.ticks < it.ticks:
            symbols.append((b.end % it.ticks, FREE, struct.pack("<q", b.size)))
    symbols.extend((op.tick, OP, op.name.encode()) for op in it.ops)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(struct.pack("<q", it.ticks))
    if not it.boundary_swaps:
        digest.update(b"persistent on the device at the boundary")
    for tick, kind, value in sorted(symbols):
        digest.update(struct.pack("<qBI", tick, kind, len(value)))
        digest.update(value)
    return digest.digest()
