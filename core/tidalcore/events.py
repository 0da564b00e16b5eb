"""Trace events: their kinds, one definition for every layer, and a columnar event stream.

The kinds are the values of the protocol's `EventKind` enum (proto/tidalpool/v1/pool.proto);
the native hot path's C header repeats three of them, and a unit test holds it to these.

`Events` is a stream of events, one column per field: what a session records (sent as
`TraceChunk`s), the daemon stores, the trace CSV v1 file holds, and the planner learns from.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tidalcore.v1 import pool_pb2


class EventKind(enum.IntEnum):
    """What an event says (pool.proto's `EventKind`, without its UNSPECIFIED zero)."""

    ALLOC = pool_pb2.EVENT_KIND_ALLOC  # block_id becomes live with size bytes
    FREE = pool_pb2.EVENT_KIND_FREE  # block_id dies
    READ = pool_pb2.EVENT_KIND_READ  # the next op reads block_id
    WRITE = pool_pb2.EVENT_KIND_WRITE  # the next op writes block_id
    OP = pool_pb2.EVENT_KIND_OP  # op block_id ran for duration_ns, named name_id
    ITER = pool_pb2.EVENT_KIND_ITER  # iteration block_id begins


# Plain ints for the hot paths, where an enum member costs an attribute lookup more.
ALLOC = int(EventKind.ALLOC)
FREE = int(EventKind.FREE)
READ = int(EventKind.READ)
WRITE = int(EventKind.WRITE)
OP = int(EventKind.OP)
ITER = int(EventKind.ITER)


@dataclass(frozen=True, eq=False)
class Events:
    """An event stream, one column per field; the i-th event is the i-th of every column.

    `names` maps name ids (op kernel names) to text; id 0 means no name. The
    columns are converted to their canonical dtypes and made read-only.
    """

    kinds: npt.NDArray[np.uint8]
    block_ids: npt.NDArray[np.uint64]  # op: the op's number; iter: the iteration's number
    sizes: npt.NDArray[np.int64]  # alloc: bytes; free: the block's bytes, or 0 as clients send
    durations_ns: npt.NDArray[np.int64]  # op: run time
    name_ids: npt.NDArray[np.uint32]  # op: kernel name id
    names: dict[int, str]

    def __post_init__(self) -> None:
        columns = {
            "kinds": np.uint8,
            "block_ids": np.uint64,
            "sizes": np.int64,
            "durations_ns": np.int64,
            "name_ids": np.uint32,
        }
        lengths = set()
        for name, dtype in columns.items():
            array = np.array(getattr(self, name), dtype=dtype)  # a private copy
            if array.ndim != 1:
                raise ValueError(f"events: column {name} is not one-dimensional")
            array.flags.writeable = False
            object.__setattr__(self, name, array)
            lengths.add(len(array))
        if len(lengths) > 1:
            raise ValueError("events: columns differ in length")

    def __len__(self) -> int:
        return len(self.kinds)

    @classmethod
    def concat(cls, chunks: Sequence[Any], names: dict[int, str]) -> Events:
        """The events of the daemon's stored chunks (`tidalpoold.trace.Chunk`), in order."""

        def column(name: str, dtype: type[np.generic]) -> npt.NDArray[Any]:
            parts = [np.asarray(getattr(c, name)) for c in chunks]
            if not parts:
                return np.zeros(0, dtype)
            return np.concatenate(parts).astype(dtype, copy=False)

        return cls(
            kinds=column("kinds", np.uint8),
            block_ids=column("block_ids", np.uint64),
            sizes=column("sizes", np.int64),
            durations_ns=column("durations_ns", np.int64),
            name_ids=column("name_ids", np.uint32),
            names=dict(names),
        )

    def marks(self) -> list[int]:
        """Indices of the ITER events: where iterations begin, as `learn.extract` takes them."""
        return [int(i) for i in np.flatnonzero(self.kinds == ITER)]
