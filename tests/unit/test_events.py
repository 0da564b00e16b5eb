"""Event kinds have one definition (tidalcore.events), tied to the protocol's enum; the native
hot path's C header and the trace CSV's kind names follow it."""

from __future__ import annotations

import re
from pathlib import Path

from tidalcore.events import ALLOC, FREE, ITER, OP, READ, WRITE, EventKind
from tidalcore.v1 import pool_pb2
from tidaloffline.formats import KIND_NAMES

HEADER = Path(__file__).resolve().parents[2] / "client" / "tidalclient" / "_native" / "hotpath.h"


def test_the_kinds_are_the_protocols_enum() -> None:
    proto = {
        name.removeprefix("EVENT_KIND_"): value
        for name, value in pool_pb2.EventKind.items()
        if value != pool_pb2.EVENT_KIND_UNSPECIFIED
    }
    assert {kind.name: kind.value for kind in EventKind} == proto
    assert tuple(int(k) for k in EventKind) == (ALLOC, FREE, READ, WRITE, OP, ITER)


def test_the_c_header_repeats_the_kinds_it_names() -> None:
    """hotpath.h names the three kinds the native ring emits; each must equal the enum's."""
    found = dict(re.findall(r"TIDALPOOL_EV_(\w+)\s*=\s*(\d+)", HEADER.read_text()))
    assert sorted(found) == ["ALLOC", "FREE", "ITER"]
    assert {name: int(value) for name, value in found.items()} == {
        name: int(EventKind[name]) for name in found
    }


def test_the_trace_files_kind_names_are_the_kinds() -> None:
    assert KIND_NAMES == {
        "alloc": ALLOC,
        "free": FREE,
        "read": READ,
        "write": WRITE,
        "op": OP,
        "iter": ITER,
    }
