"""A session's trace as the daemon keeps it: validated columnar chunks and op names.

Chunks arrive as protobuf `TraceChunk`s with packed columns; they are checked
(equal column lengths, known kinds, contiguous event numbering, no more events
than the store keeps, op names within their bounds) and stored as NumPy arrays.
A chunk that breaks a rule is refused whole: nothing of it is stored.

What one session can make the daemon hold here is bounded:

    events   ≤ max_events × EVENT_BYTES (29: kind u8, block id, size and duration u64,
             name id u32); past max_events the oldest chunks go
    chunks   ≤ 2 × max_events / COALESCE_EVENTS + 1 of them, at CHUNK_BYTES each: small
             chunks are stored merged (a slow client flushes a few events every 10 ms)
    names    ≤ max_name_bytes, each name counting its UTF-8 bytes plus NAME_ENTRY_BYTES
             (its string, its id and its slot in the table); a name is at most MAX_NAME_BYTES
    shapes   the counts of at most `max_shapes` iteration shapes (`Shapes`; a shape is
             also the name of its ITER events, among the names above)

so at most `bound_bytes(max_events, max_name_bytes)` per session (122 MB with the
defaults), and max_sessions times that in all. The store is read by the planner's thread
while its session's reader adds to it: both go through one lock, readers get copies.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import numpy as np
import numpy.typing as npt
from tidalcore.errors import InvalidArgument
from tidalcore.events import ALLOC
from tidalcore.v1 import pool_pb2
from tidalcore.wire import MAX_SHAPE_BYTES

_MAX_KIND = max(pool_pb2.EventKind.values())


@dataclass(frozen=True, slots=True)
class Chunk:
    first_event: int
    kinds: npt.NDArray[np.uint8]
    block_ids: npt.NDArray[np.uint64]
    sizes: npt.NDArray[np.uint64]
    durations_ns: npt.NDArray[np.uint64]
    name_ids: npt.NDArray[np.uint32]

    def __len__(self) -> int:
        return len(self.kinds)


_COLUMNS = tuple(f.name for f in fields(Chunk) if f.name != "first_event")
_DTYPES = {
    "kinds": np.uint8,
    "block_ids": np.uint64,
    "sizes": np.uint64,
    "durations_ns": np.uint64,
    "name_ids": np.uint32,
}

EVENT_BYTES = sum(np.dtype(t).itemsize for t in _DTYPES.values())
"""Bytes one stored event takes: one element of every column (29)."""
COALESCE_EVENTS = 4096
"""A chunk is merged into the one stored before it while both hold this many events or fewer
in all (at most max_events): any two stored neighbours hold more, which bounds their number."""
CHUNK_BYTES = 1024
"""Bookkeeping of one stored chunk beside its events: the object and its five array headers."""
MAX_NAME_BYTES = 1024
"""Longest op name (UTF-8 bytes) a chunk may define; a chunk with a longer one is refused."""
NAME_ENTRY_BYTES = 128
"""What an op name costs beside its bytes: its string object, its id and its table slot."""
DEFAULT_NAME_BYTES = 4 << 20
"""Op-name bytes a session may define, where no setting says otherwise."""


def bound_bytes(max_events: int, max_name_bytes: int) -> int:
    """The most memory one session's store holds: events, their chunks' bookkeeping, names."""
    chunks = 2 * max_events // min(COALESCE_EVENTS, max_events) + 1
    return max_events * EVENT_BYTES + chunks * CHUNK_BYTES + max_name_bytes


@dataclass(slots=True)
class ShapeCount:
    """Of one iteration shape: the step marks that began one, and the iterations that ended
    (the next mark came)."""

    marks: int = 0
    whole: int = 0


@dataclass(slots=True)
class Shapes:
    """The iteration shapes a session's step marks name (StepMark.shape): the counts of the
    `max_shapes` shapes stepped into most recently; a shape stepped into past those forgets
    the least recent one (`forgotten` says which, for the planner)."""

    max_shapes: int
    counts: OrderedDict[str, ShapeCount] = field(default_factory=OrderedDict)
    current: str | None = None  # the shape of the latest mark's iteration

    def step(self, shape: str) -> tuple[str | None, list[str]]:
        """Count a mark beginning an iteration of `shape`: the shape whose iteration it ends
        (None: the first mark, or one forgotten), and the shapes forgotten to make room."""
        ended = self.current
        if ended is not None and ended in self.counts:
            self.counts[ended].whole += 1
        else:
            ended = None
        forgotten: list[str] = []
        count = self.counts.pop(shape, None)
        while count is None and len(self.counts) >= self.max_shapes:
            forgotten.append(self.counts.popitem(last=False)[0])
        self.counts[shape] = count = count or ShapeCount()
        count.marks += 1
        self.current = shape
        return ended, forgotten


def decode_chunk(msg: pool_pb2.TraceChunk) -> Chunk:
    """Check a chunk's columns and turn them into arrays (InvalidArgument if malformed)."""
    n = len(msg.kinds)
    lengths = {
        "kinds": n,
        "block_ids": len(msg.block_ids),
        "sizes": len(msg.sizes),
        "durations_ns": len(msg.durations_ns),
        "name_ids": len(msg.name_ids),
    }
    if len(set(lengths.values())) != 1:
        raise InvalidArgument(f"trace chunk columns differ in length: {lengths}")
    kinds = np.array(msg.kinds, dtype=np.int64) if n else np.zeros(0, np.int64)
    if n and (kinds.min() <= 0 or kinds.max() > _MAX_KIND):
        bad = int(kinds[(kinds <= 0) | (kinds > _MAX_KIND)][0])
        raise InvalidArgument(f"trace chunk has unknown event kind {bad}")
    return Chunk(
        first_event=msg.first_event,
        kinds=kinds.astype(np.uint8),
        block_ids=np.array(msg.block_ids, dtype=np.uint64),
        sizes=np.array(msg.sizes, dtype=np.uint64),
        durations_ns=np.array(msg.durations_ns, dtype=np.uint64),
        name_ids=np.array(msg.name_ids, dtype=np.uint32),
    )


def _merged(a: Chunk, b: Chunk) -> Chunk:
    """`a` followed by `b` as one chunk (new arrays: a reader's copy of `a` stays valid)."""
    columns = {name: np.concatenate((getattr(a, name), getattr(b, name))) for name in _COLUMNS}
    return Chunk(first_event=a.first_event, **columns)


def name_cost(text: str) -> int:
    """What one op name counts against the store's name bytes."""
    return len(text.encode()) + NAME_ENTRY_BYTES


class TraceStore:
    """The events one session has sent, oldest dropped beyond `max_events`, and the op names
    it defined, at most `max_name_bytes` of them (see `name_cost`)."""

    def __init__(
        self, max_events: int, max_name_bytes: int = DEFAULT_NAME_BYTES, max_shapes: int = 8
    ) -> None:
        self.max_events = max_events
        self.max_name_bytes = max_name_bytes
        self._chunks: deque[Chunk] = deque()
        self._names: dict[int, str] = {}
        self.name_bytes = 0  # sum of name_cost over the names defined
        self.events_received = 0  # all events ever accepted, dropped ones included
        self.iterations_seen = 0
        self._marks_at: deque[int] = deque(maxlen=2)  # events before the last two step marks
        self.shapes = Shapes(max_shapes)
        self._allocations: dict[str, int] = {}  # of each shape's last ended iteration
        self._held = 0
        self._lock = threading.Lock()

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        """The chunks held now, oldest first (a copy)."""
        with self._lock:
            return tuple(self._chunks)

    @property
    def names(self) -> dict[int, str]:
        """The op names defined so far, by id (a copy)."""
        with self._lock:
            return dict(self._names)

    def add(self, msg: pool_pb2.TraceChunk) -> Chunk:
        """Store a chunk and its names, or refuse it whole (InvalidArgument naming why)."""
        if msg.first_event != self.events_received:
            raise InvalidArgument(
                f"trace chunk starts at event {msg.first_event}, expected {self.events_received}"
            )
        chunk = decode_chunk(msg)
        if len(chunk) > self.max_events:
            raise InvalidArgument(
                f"trace chunk has {len(chunk)} events, more than the {self.max_events} a"
                " session's trace keeps (max_trace_events)"
            )
        name_bytes = self._name_bytes_after(msg.new_names)
        with self._lock:
            self._names.update(msg.new_names)
            self.name_bytes = name_bytes
            if len(chunk):
                self._append(chunk)
            self.events_received += len(chunk)
        return chunk

    def _name_bytes_after(self, new: Mapping[int, str]) -> int:
        """The store's name bytes once `new` is defined (an id defined again gives back its old
        bytes), or InvalidArgument naming the name or the total that breaks a bound."""
        total = self.name_bytes
        for name_id, text in new.items():
            if name_id == 0:
                raise InvalidArgument("trace chunk defines name id 0 (reserved for no name)")
            size = len(text.encode())
            if size > MAX_NAME_BYTES:
                raise InvalidArgument(
                    f"trace chunk defines op name {name_id} of {size} bytes, longer than"
                    f" {MAX_NAME_BYTES}"
                )
            old = self._names.get(name_id)
            total += name_cost(text) - (name_cost(old) if old is not None else 0)
        if total > self.max_name_bytes:
            raise InvalidArgument(
                f"trace chunk's op names would bring the session's to {total} bytes, more than"
                f" max_trace_name_bytes ({self.max_name_bytes}; each name counts its UTF-8 bytes"
                f" + {NAME_ENTRY_BYTES})"
            )
        return total

    def _append(self, chunk: Chunk) -> None:
        """Hold `chunk` (merged into the last one while both are small), then drop the oldest
        chunks while more than max_events events are held. Under the lock."""
        limit = min(COALESCE_EVENTS, self.max_events)
        if self._chunks and len(self._chunks[-1]) + len(chunk) <= limit:
            self._chunks[-1] = _merged(self._chunks[-1], chunk)
        else:
            self._chunks.append(chunk)
        self._held += len(chunk)
        while self._held > self.max_events and len(self._chunks) > 1:
            self._held -= len(self._chunks.popleft())

    def step(self, mark: pool_pb2.StepMark) -> tuple[str | None, list[str]]:
        """Count a step mark (InvalidArgument, nothing counted, if it is malformed): the shape
        whose iteration it ends and the shapes forgotten, as `Shapes.step`."""
        if mark.events_before > self.events_received:
            raise InvalidArgument(
                f"step mark after event {mark.events_before}, but only "
                f"{self.events_received} events were sent"
            )
        size = len(mark.shape.encode())
        if size > MAX_SHAPE_BYTES:
            raise InvalidArgument(
                f"step mark's shape is {size} bytes, longer than {MAX_SHAPE_BYTES}"
            )
        with self._lock:
            self.iterations_seen += 1
            self._marks_at.append(mark.events_before)
            ended, forgotten = self.shapes.step(mark.shape)
            if ended is not None and len(self._marks_at) == 2:
                self._allocations[ended] = self._allocs_between(*self._marks_at)
            for shape in forgotten:
                self._allocations.pop(shape, None)
            return ended, forgotten

    def caught_up(self) -> bool:
        """Whether the events after the last step mark are at least as many as those between
        the two before it: the iteration the last mark ended has been followed far enough
        that a steady iteration's next has freed what it left live (the blocks that cross its
        end), so the iteration extracted now is the one it will be once the next is whole."""
        with self._lock:
            if len(self._marks_at) < 2:
                return True
            before, last = self._marks_at
            return self.events_received - last >= last - before

    def allocations_of(self, shape: str) -> int:
        """The allocations (ALLOC events) of the last iteration of `shape` a step mark ended (0
        before one), counted from the kinds column when it ended, without the iteration's
        extraction: of the events still held then, so never more than the iteration made."""
        with self._lock:
            return self._allocations.get(shape, 0)

    def _allocs_between(self, before: int, last: int) -> int:
        """ALLOC events held in [before, last) (under the lock)."""
        count = 0
        for chunk in self._chunks:
            start = max(before - chunk.first_event, 0)
            stop = min(last - chunk.first_event, len(chunk))
            if start < stop:
                count += int(np.count_nonzero(chunk.kinds[start:stop] == ALLOC))
        return count

    def shape_counts(self, shape: str) -> ShapeCount | None:
        """The counts of `shape` (a copy), None if it is not among those kept."""
        with self._lock:
            count = self.shapes.counts.get(shape)
            return None if count is None else ShapeCount(count.marks, count.whole)

    @property
    def events_held(self) -> int:
        return self._held
