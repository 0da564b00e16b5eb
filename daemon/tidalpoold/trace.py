"""A session's trace as the daemon keeps it: validated columnar chunks.

Chunks arrive as protobuf `TraceChunk`s with packed columns; they are checked
(equal column lengths, known kinds, contiguous event numbering) and stored as
NumPy arrays. The store is bounded: past `max_events`, the oldest chunks go.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from tidalcore.errors import InvalidArgument
from tidalcore.v1 import pool_pb2

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


class TraceStore:
    """The events one session has sent, oldest dropped beyond `max_events`."""

    def __init__(self, max_events: int) -> None:
        self.max_events = max_events
        self.chunks: deque[Chunk] = deque()
        self.names: dict[int, str] = {}
        self.events_received = 0  # all events ever accepted, dropped ones included
        self.iterations_seen = 0
        self._held = 0

    def add(self, msg: pool_pb2.TraceChunk) -> Chunk:
        if msg.first_event != self.events_received:
            raise InvalidArgument(
                f"trace chunk starts at event {msg.first_event}, expected {self.events_received}"
            )
        chunk = decode_chunk(msg)
        for name_id, text in msg.new_names.items():
            if name_id == 0:
                raise InvalidArgument("trace chunk defines name id 0 (reserved for no name)")
            self.names[name_id] = text
        self.chunks.append(chunk)
        self.events_received += len(chunk)
        self._held += len(chunk)
        while self._held > self.max_events and len(self.chunks) > 1:
            self._held -= len(self.chunks.popleft())
        return chunk

    def step(self, mark: pool_pb2.StepMark) -> None:
        if mark.events_before > self.events_received:
            raise InvalidArgument(
                f"step mark after event {mark.events_before}, but only "
                f"{self.events_received} events were sent"
            )
        self.iterations_seen += 1

    @property
    def events_held(self) -> int:
        return self._held
