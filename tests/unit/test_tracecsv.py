"""Events and the planner's file formats: exact columns and buffers, every refusal's text."""

from __future__ import annotations

import pickle
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tidalcore.events import ALLOC, FREE, ITER, OP, READ, WRITE, Events
from tidalcore.v1 import pool_pb2
from tidalcore.v1.pool_pb2 import TraceChunk
from tidaloffline.formats import (
    FormatError,
    detect_format,
    read_problem_csv,
    read_problem_csv_with_labels,
    read_snapshot,
    read_trace_csv,
    write_solution_csv,
    write_trace_csv,
)
from tidalplan.model import Buffer, Placement, Problem
from tidalpoold.trace import decode_chunk

SHARED = Path(__file__).resolve().parents[3] / "shared"
MINIMALLOC = SHARED / "traces/minimalloc"
needs_minimalloc = pytest.mark.skipif(
    not MINIMALLOC.is_dir(), reason=f"MiniMalloc instances not found at {MINIMALLOC}"
)

TRACE = """\
# a comment, with commas, and a "quote
kind,id,size,ns,name

iter,0,,,
alloc,7,4096,,
alloc,8,512,,
read,7,,,
write,8,,,
op,0,,1500,aten.mm.default
free,7,,,
op,1,,20,"my,op"
op,2,,,aten.mm.default
iter,1,,,
free,8
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- Events ----------------------------------------------------------------------------------------


def test_kinds_are_the_protobuf_enum() -> None:
    assert (ALLOC, FREE, READ, WRITE, OP, ITER) == (
        pool_pb2.EVENT_KIND_ALLOC,
        pool_pb2.EVENT_KIND_FREE,
        pool_pb2.EVENT_KIND_READ,
        pool_pb2.EVENT_KIND_WRITE,
        pool_pb2.EVENT_KIND_OP,
        pool_pb2.EVENT_KIND_ITER,
    )


def test_concat_daemon_chunks() -> None:
    first = decode_chunk(
        TraceChunk(
            first_event=0,
            kinds=[ALLOC, WRITE, OP],
            block_ids=[2**64 - 1, 2**64 - 1, 0],
            sizes=[256, 0, 0],
            durations_ns=[0, 0, 900],
            name_ids=[0, 0, 1],
        )
    )
    second = decode_chunk(
        TraceChunk(
            first_event=3,
            kinds=[FREE, ITER],
            block_ids=[2**64 - 1, 1],
            sizes=[0, 0],
            durations_ns=[0, 0],
            name_ids=[0, 0],
        )
    )
    events = Events.concat([first, second], {1: "k"})
    assert len(events) == 5
    assert events.kinds.dtype == np.uint8
    assert events.block_ids.dtype == np.uint64
    assert events.sizes.dtype == np.int64
    assert events.durations_ns.dtype == np.int64
    assert events.name_ids.dtype == np.uint32
    assert events.kinds.tolist() == [ALLOC, WRITE, OP, FREE, ITER]
    assert events.block_ids.tolist() == [2**64 - 1, 2**64 - 1, 0, 2**64 - 1, 1]
    assert events.sizes.tolist() == [256, 0, 0, 0, 0]
    assert events.durations_ns.tolist() == [0, 0, 900, 0, 0]
    assert events.name_ids.tolist() == [0, 0, 1, 0, 0]
    assert events.names == {1: "k"}
    assert events.marks() == [4]
    assert not events.kinds.flags.writeable


def test_concat_nothing() -> None:
    events = Events.concat([], {})
    assert len(events) == 0
    assert events.marks() == []


def test_columns_of_different_lengths_refused() -> None:
    with pytest.raises(ValueError, match="columns differ in length"):
        Events([1], [1, 2], [1], [0], [0], {})


# -- trace CSV v1 ----------------------------------------------------------------------------------


def test_read_trace_exact(tmp_path: Path) -> None:
    events = read_trace_csv(write(tmp_path, "t.trace.csv", TRACE))
    assert events.kinds.tolist() == [ITER, ALLOC, ALLOC, READ, WRITE, OP, FREE, OP, OP, ITER, FREE]
    assert events.block_ids.tolist() == [0, 7, 8, 7, 8, 0, 7, 1, 2, 1, 8]
    assert events.sizes.tolist() == [0, 4096, 512, 0, 0, 0, 4096, 0, 0, 0, 512]  # frees: looked up
    assert events.durations_ns.tolist() == [0, 0, 0, 0, 0, 1500, 0, 20, 0, 0, 0]
    assert events.name_ids.tolist() == [0, 0, 0, 0, 0, 1, 0, 2, 1, 0, 0]
    assert events.names == {1: "aten.mm.default", 2: "my,op"}
    assert events.marks() == [0, 9]


def test_write_trace_round_trip(tmp_path: Path) -> None:
    events = read_trace_csv(write(tmp_path, "t.trace.csv", TRACE))
    path = tmp_path / "again.trace.csv"
    write_trace_csv(path, events, comments=["tidalpool trace v1; made by a test", "second, line"])
    lines = path.read_text().splitlines()
    assert lines[:4] == [
        "# tidalpool trace v1; made by a test",
        "# second, line",
        "kind,id,size,ns,name",
        "iter,0,,,",
    ]
    assert lines[4:9] == [
        "alloc,7,4096,,",
        "alloc,8,512,,",
        "read,7,,,",
        "write,8,,,",
        "op,0,,1500,aten.mm.default",
    ]
    assert lines[9:12] == ["free,7,,,", 'op,1,,20,"my,op"', "op,2,,0,aten.mm.default"]
    again = read_trace_csv(path)
    for column in ("kinds", "block_ids", "sizes", "durations_ns", "name_ids"):
        assert getattr(again, column).tolist() == getattr(events, column).tolist(), column
    assert again.names == events.names


def test_write_trace_refuses_a_comment_of_two_lines(tmp_path: Path) -> None:
    events = read_trace_csv(write(tmp_path, "t.trace.csv", TRACE))
    with pytest.raises(ValueError, match=r"a trace comment must be one line: 'a\\nb'"):
        write_trace_csv(tmp_path / "x.csv", events, comments=["a\nb"])
    assert not (tmp_path / "x.csv").exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty: expected the header kind,id,size,ns,name"),
        ("# only\n", "empty: expected the header kind,id,size,ns,name"),
        ("kind,id,size\n", ":1: bad header 'kind,id,size': expected kind,id,size,ns,name"),
        ("# c\nkind,id,size,ns,name\nalloc,1,8,,\nmalloc,2,8,,\n", ":4: unknown kind 'malloc'"),
        ("kind,id,size,ns,name\nalloc,1,,,\n", ":2: alloc of block 1 has no size"),
        ("kind,id,size,ns,name\nalloc,1,0,,\n", ":2: alloc of block 1 has size 0"),
        (
            "kind,id,size,ns,name\nalloc,1,8,,\nfree,2,,,\n",
            ":3: free of block 2, which is not live",
        ),
        ("kind,id,size,ns,name\nalloc,1,8,,\nalloc,1,8,,\n", ":3: alloc of block 1, which is live"),
        ("kind,id,size,ns,name\nalloc,1,8,,\nfree,1,,,\nfree,1,,,\n", ":4: free of block 1, which"),
        ("kind,id,size,ns,name\nalloc,x,8,,\n", ":2: id 'x' is not a whole number"),
        ("kind,id,size,ns,name\nalloc,1,-8,,\n", ":2: size -8 is out of range"),
        ("kind,id,size,ns,name\nop,1,,1.5,k\n", ":2: ns '1.5' is not a whole number"),
        ("kind,id,size,ns,name\nop,1,,1,k,extra\n", ":2: 6 fields, expected at most 5"),
    ],
)
def test_read_trace_refusals(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, "bad.trace.csv", text)
    with pytest.raises(FormatError) as info:
        read_trace_csv(path)
    assert str(info.value).startswith(str(path))
    assert message in str(info.value)


def test_read_trace_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bin.csv"
    path.write_bytes(b"kind,id\xff\n")
    with pytest.raises(FormatError, match=r"bin.csv: not a UTF-8 text file \(invalid start byte"):
        read_trace_csv(path)


# -- MiniMalloc CSV --------------------------------------------------------------------------------


@needs_minimalloc
def test_read_minimalloc_example() -> None:
    problem, labels = read_problem_csv_with_labels(MINIMALLOC / "examples/input.12.csv")
    assert labels == ("b1", "b2", "b3", "b4", "b5")
    assert problem == Problem(
        buffers=(
            Buffer(id=0, lower=0, upper=3, size=4),
            Buffer(id=1, lower=3, upper=9, size=4),
            Buffer(id=2, lower=0, upper=9, size=4),
            Buffer(id=3, lower=9, upper=21, size=4),
            Buffer(id=4, lower=0, upper=21, size=4),
        ),
        alignment=1,
    )


@needs_minimalloc
def test_minimalloc_example_solution_round_trip(tmp_path: Path) -> None:
    problem, labels = read_problem_csv_with_labels(MINIMALLOC / "examples/input.12.csv")
    placement = Placement(offsets=(0, 0, 4, 4, 8), height=12, solver="hand")
    out = tmp_path / "solution.csv"
    write_solution_csv(out, problem, placement, labels)
    assert out.read_text() == (
        "id,lower,upper,size,offset\nb1,0,3,4,0\nb2,3,9,4,0\nb3,0,9,4,4\nb4,9,21,4,4\nb5,0,21,4,8\n"
    )
    assert read_problem_csv_with_labels(out) == (problem, labels)  # the offset column is ignored


@needs_minimalloc
def test_minimalloc_challenging_round_trip(tmp_path: Path) -> None:
    problem = read_problem_csv(MINIMALLOC / "challenging/A.1048576.csv")
    assert len(problem.buffers) == 154
    assert problem.buffers[0] == Buffer(id=0, lower=995328, upper=1000448, size=656384)
    assert problem.buffers[3] == Buffer(id=3, lower=0, upper=307200, size=43008)
    assert [b.id for b in problem.buffers] == list(range(154))
    offsets = tuple(int(o) for o in np.cumsum([0] + [b.size for b in problem.buffers[:-1]]))
    placement = Placement(
        offsets=offsets, height=sum(b.size for b in problem.buffers), solver="stack"
    )
    out = tmp_path / "A.solution.csv"
    write_solution_csv(out, problem, placement)
    lines = out.read_text().splitlines()
    assert lines[0] == "id,lower,upper,size,offset"
    assert lines[1] == "0,995328,1000448,656384,0"
    assert lines[2] == "1,779264,828416,183296,656384"
    assert read_problem_csv(out) == problem


def test_minimalloc_aliases_and_alignment(tmp_path: Path) -> None:
    path = write(
        tmp_path, "old.csv", "buffer,begin,end,size,alignment,hint\n4,0,2,10,16,0\n9,3,3,5,64,1\n"
    )
    assert read_problem_csv(path) == Problem(
        buffers=(
            Buffer(id=4, lower=0, upper=3, size=10),  # end is inclusive
            Buffer(id=9, lower=3, upper=4, size=5),
        ),
        alignment=64,
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty: expected the header id,lower,upper,size"),
        ("id,lower,upper,size,colour\n", ":1: bad header: unknown column 'colour'"),
        ("id,lower,size\n", ":1: bad header: missing column upper"),
        ("id,lower,upper,end,size\n", ":1: bad header: column 'end' given twice"),
        ("id,lower,upper,size\n1,0,2,8\n2,0,2\n", ":3: 3 fields, expected 4"),
        ("id,lower,upper,size\n1,0,two,8\n", ":2: upper 'two' is not a whole number"),
        ("id,lower,upper,size\n1,0,2,0\n", ":2: size 0 is not positive"),
        ("id,lower,upper,size\n1,2,2,8\n", ":2: empty lifetime [2, 2)"),
        ("id,lower,upper,size\na,0,2,8\n\na,1,3,8\n", ":4: id 'a' repeats line 2"),
        ("id,lower,upper,size,alignment\na,0,2,8,3\n", ":2: alignment 3 is not a power of two"),
    ],
)
def test_minimalloc_refusals(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, "bad.csv", text)
    with pytest.raises(FormatError) as info:
        read_problem_csv(path)
    assert str(info.value).startswith(str(path))
    assert message in str(info.value)


def test_write_solution_refuses_mismatched_placement(tmp_path: Path) -> None:
    problem = Problem(buffers=(Buffer(id=0, lower=0, upper=1, size=8),))
    placement = Placement(offsets=(), height=0, solver="none")
    with pytest.raises(ValueError, match="placement has 0 offsets for 1 buffers"):
        write_solution_csv(tmp_path / "s.csv", problem, placement)


# -- PyTorch memory snapshot -----------------------------------------------------------------------


def entry(action: str, addr: int, size: int) -> dict[str, Any]:
    """One trace entry as torch.cuda.memory._snapshot() writes it."""
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": [], "time_us": 0}


SNAPSHOT: dict[str, Any] = {
    "segments": [],
    "device_traces": [
        [entry("alloc", 0x9000, 64)],
        [
            entry("segment_alloc", 0x1000, 2 << 20),  # 0: not a block
            entry("alloc", 0x1000, 512),  # 1: A
            entry("alloc", 0x2000, 1024),  # 2: B
            entry("free_requested", 0x1000, 512),  # 3
            entry("free_completed", 0x1000, 512),  # 4: A's bytes come back: [1, 4)
            entry("alloc", 0x1000, 256),  # 5: C at A's address
            entry("free_requested", 0x2000, 1024),  # 6: B, never completed: [2, 6)
            entry("free_completed", 0x3000, 2048),  # 7: D, allocated before recording: [0, 7)
            entry("alloc", 0x4000, 128),  # 8: E
            entry("free", 0x4000, 128),  # 9: E, the old action name: [8, 9)
            entry("oom", 0, 0),  # 10
        ],
    ],
}


def test_read_snapshot_exact(tmp_path: Path) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(SNAPSHOT))
    expected = Problem(
        buffers=(
            Buffer(id=0, lower=0, upper=7, size=2048),
            Buffer(id=1, lower=1, upper=4, size=512),
            Buffer(id=2, lower=2, upper=6, size=1024),
            Buffer(id=3, lower=5, upper=11, size=256),  # live at the end
            Buffer(id=4, lower=8, upper=9, size=128),
        )
    )
    assert read_snapshot(path) == expected  # device 1: the most allocations
    assert read_snapshot(path, device=1) == expected
    assert read_snapshot(path, device=0) == Problem(buffers=(Buffer(0, 0, 1, 64),))


def test_read_snapshot_refusals(tmp_path: Path) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(SNAPSHOT))
    with pytest.raises(FormatError, match=r"snap.pickle: no trace for device 2 \(2 devices\)"):
        read_snapshot(path, device=2)
    code = tmp_path / "code.pickle"
    code.write_bytes(pickle.dumps({"device_traces": [Fraction(1, 2)]}))
    with pytest.raises(FormatError, match=r"code\.pickle: not a PyTorch memory snapshot: refusing"):
        read_snapshot(code)
    junk = tmp_path / "junk.pickle"
    junk.write_bytes(b"\x80\x04garbage")
    with pytest.raises(FormatError, match=r"junk\.pickle: not a PyTorch memory snapshot: "):
        read_snapshot(junk)
    other = tmp_path / "other.pickle"
    other.write_bytes(pickle.dumps({"segments": []}))
    with pytest.raises(FormatError, match=r"other\.pickle: not a PyTorch .* no device_traces list"):
        read_snapshot(other)
    broken = tmp_path / "broken.pickle"
    broken.write_bytes(pickle.dumps({"device_traces": [[{"action": "alloc", "addr": 1}]]}))
    with pytest.raises(FormatError, match="device 0 entry 0: alloc without an integer addr"):
        read_snapshot(broken)
    twice = tmp_path / "twice.pickle"
    twice.write_bytes(pickle.dumps({"device_traces": [[entry("alloc", 16, 8)] * 2]}))
    with pytest.raises(FormatError, match="device 0 entry 1: alloc at 0x10, which is live"):
        read_snapshot(twice)


# -- format detection ------------------------------------------------------------------------------


def test_detect_format(tmp_path: Path) -> None:
    assert detect_format(write(tmp_path, "t.csv", TRACE)) == "trace"
    assert detect_format(write(tmp_path, "p.csv", "id,lower,upper,size\n0,0,1,8\n")) == "problem"
    assert detect_format(write(tmp_path, "o.csv", "buffer,start,end,size,offset\n")) == "problem"
    snapshot = tmp_path / "s.pickle"
    snapshot.write_bytes(pickle.dumps(SNAPSHOT))
    assert detect_format(snapshot) == "snapshot"


@needs_minimalloc
def test_detect_format_minimalloc_files() -> None:
    assert detect_format(MINIMALLOC / "examples/input.12.csv") == "problem"
    assert detect_format(MINIMALLOC / "challenging/A.1048576.csv") == "problem"


@pytest.mark.parametrize(
    "content", [b"", b"# only a comment\n", b"a,b,c\n1,2,3\n", b"\x89PNG\r\n\x1a\n\x00\xff"]
)
def test_detect_format_unknown(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(content)
    with pytest.raises(FormatError) as info:
        detect_format(path)
    assert str(info.value) == (
        f"{path}: unknown format: expected a trace CSV v1 (header kind,id,size,ns,name), "
        "a placement CSV (header id,lower,upper,size) or a PyTorch memory snapshot pickle"
    )
