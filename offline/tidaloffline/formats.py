"""The files the offline tools read and write.

Trace CSV v1 (`*.trace.csv`), one event a line in program order after the header
`kind,id,size,ns,name`; `#` lines are comments:

    alloc,B,BYTES,,     block B becomes live with BYTES bytes
    free,B,,,           block B dies
    read,B,,,           the next op reads B          write,B,,,   the next op writes B
    op,K,,NS,NAME       op K (a kernel, e.g. aten.convolution.default) ran NS ns on the
                        compute stream, accessing the blocks named since the previous op
    iter,N,,,SHAPE      iteration N begins; blocks allocated before the first `iter` live
                        across iterations (weights, optimizer state); SHAPE (optional)
                        names the iteration's shape where iterations differ (a batch size,
                        a sequence length: `Session.step(shape=)`)

A placement problem CSV (MiniMalloc's): header `id,lower,upper,size`, lifetimes half-open
`[lower, upper)`; a solution adds `offset`. A PyTorch memory snapshot is the pickle of
`torch.cuda.memory._dump_snapshot`.

The readers turn the three input formats of `tidalpool plan` into
values: a trace CSV v1 into `Events`, a MiniMalloc placement CSV into a
`Problem`, a PyTorch memory snapshot pickle into a `Problem`. Every refusal
names the file, the line (or entry) and the problem, as `FormatError`. The
writers go the other way: `Events` to a trace CSV v1, a placement to a solution.
"""

from __future__ import annotations

import csv
import io
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tidalcore.events import ALLOC, FREE, ITER, OP, EventKind, Events
from tidalcore.units import Bytes, Tick
from tidalplan.model import Buffer, Placement, Problem

from tidaloffline.outputs import plural

KIND_NAMES = {kind.name.lower(): int(kind) for kind in EventKind}
"""The kind column of a trace CSV v1: each event kind by its name in lower case."""

TRACE_HEADER = ("kind", "id", "size", "ns", "name")
SOLUTION_HEADER = ("id", "lower", "upper", "size", "offset")


class FormatError(ValueError):
    """An input file the planner cannot read; the message names file, line and problem."""


MAX_TOTAL = 2**62
"""The most bytes a file may hold live at once (a trace) or in all (a placement CSV): half of a
signed 64-bit integer, so that every sum the tools make of them (a block's instance in the next
iteration beside its own, sizes rounded up to an alignment, persistent bytes with the rest)
stays within the 64-bit integers their arrays hold."""


MAX_ALIGNMENT = 2**30
"""The largest alignment (1 GiB): with `MAX_TOTAL`, sizes rounded up to it add up within 64 bits."""


def too_many_bytes(total: int) -> str:
    """The end of a message refusing `total` bytes."""
    return f"{total} bytes, {MAX_TOTAL} (2**62) at most: sums of them would overflow 64 bits"


# -- trace CSV v1 ----------------------------------------------------------------------------------


def _rows(path: Path, text: str) -> list[tuple[int, list[str]]]:
    """(line number, fields) of every line that is not blank or a `#` comment."""
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line or line[0] == "#" or line.isspace():
            continue
        fields = next(csv.reader([line])) if '"' in line else line.split(",")
        if " " in line or "\t" in line:
            fields = [f.strip() for f in fields]
        rows.append((number, fields))
    return rows


def _whole(path: Path, number: int, field: str, text: str) -> int:
    """A non-negative integer field below 2**63, or a FormatError naming the line."""
    try:
        value = int(text)
    except ValueError:
        raise FormatError(f"{path}:{number}: {field} {text!r} is not a whole number") from None
    if value < 0 or value >= 2**63:
        raise FormatError(f"{path}:{number}: {field} {value} is out of range")
    return value


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(
            f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})"
        ) from None


def read_trace_csv(path: str | Path) -> Events:
    """Read a trace CSV v1 file (the module's docstring) into events.

    Frees get the freed block's size. Refused: a bad header, an unknown kind, a
    field that is not a whole number, an alloc without a positive size, the
    alloc of an id that is live, and the free of an id that is not.
    """
    path = Path(path)
    rows = _rows(path, _read_text(path))
    if not rows:
        raise FormatError(f"{path}: empty: expected the header {','.join(TRACE_HEADER)}")
    number, header = rows[0]
    if tuple(header) != TRACE_HEADER:
        raise FormatError(
            f"{path}:{number}: bad header {','.join(header)!r}: expected {','.join(TRACE_HEADER)}"
        )
    n = len(rows) - 1
    kinds = [0] * n
    ids = [0] * n
    sizes = [0] * n
    durations = [0] * n
    name_ids = [0] * n
    names: dict[str, int] = {}
    live: dict[int, int] = {}
    live_bytes = 0
    for i, (number, fields) in enumerate(rows[1:]):
        if len(fields) != 5:
            if len(fields) > 5:
                raise FormatError(
                    f"{path}:{number}: {plural(len(fields), 'field')}, expected at most 5"
                )
            fields += [""] * (5 - len(fields))
        kind_text, id_text, size_text, ns_text, name = fields
        kind = KIND_NAMES.get(kind_text)
        if kind is None:
            raise FormatError(
                f"{path}:{number}: unknown kind {kind_text!r} (expected one of "
                f"{', '.join(KIND_NAMES)})"
            )
        kinds[i] = kind
        ids[i] = block = _whole(path, number, "id", id_text)
        if kind == ALLOC:
            if not size_text:
                raise FormatError(f"{path}:{number}: alloc of block {block} has no size")
            size = _whole(path, number, "size", size_text)
            if size == 0:
                raise FormatError(f"{path}:{number}: alloc of block {block} has size 0")
            if block in live:
                raise FormatError(f"{path}:{number}: alloc of block {block}, which is live")
            live[block] = sizes[i] = size
            live_bytes += size
            if live_bytes > MAX_TOTAL:
                raise FormatError(
                    f"{path}:{number}: alloc of block {block} brings the bytes live at once to"
                    f" {too_many_bytes(live_bytes)}"
                )
        elif kind == FREE:
            freed = live.pop(block, 0)
            if not freed:
                raise FormatError(f"{path}:{number}: free of block {block}, which is not live")
            sizes[i] = freed
            live_bytes -= freed
        elif kind == OP:
            if ns_text:
                durations[i] = _whole(path, number, "ns", ns_text)
            if name:
                name_ids[i] = names.setdefault(name, len(names) + 1)
        elif kind == ITER and name:
            name_ids[i] = names.setdefault(name, len(names) + 1)
    return Events(
        kinds=np.array(kinds, np.uint8),
        block_ids=np.array(ids, np.uint64),
        sizes=np.array(sizes, np.int64),
        durations_ns=np.array(durations, np.int64),
        name_ids=np.array(name_ids, np.uint32),
        names={v: k for k, v in names.items()},
    )


def write_trace_csv(path: str | Path, events: Events, comments: Sequence[str] = ()) -> None:
    """Write events as a trace CSV v1 file; `read_trace_csv` reads back equal columns (name
    ids as it numbers them: by first appearance).

    `comments` become `#` lines before the header (one line each, no newlines
    inside). Frees are written without their size (the reader takes it from the
    alloc); an op's name goes through `names`, quoted when it holds a comma.
    """
    out = io.StringIO()
    for line in comments:
        if "\n" in line or "\r" in line:
            raise ValueError(f"a trace comment must be one line: {line!r}")
        out.write(f"# {line}\n")
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(TRACE_HEADER)
    text = {v: k for k, v in KIND_NAMES.items()}
    columns = zip(
        events.kinds.tolist(),
        events.block_ids.tolist(),
        events.sizes.tolist(),
        events.durations_ns.tolist(),
        events.name_ids.tolist(),
        strict=True,
    )
    for kind, block, size, ns, name_id in columns:
        if kind == ALLOC:
            writer.writerow((text[kind], block, size, "", ""))
        elif kind == OP:
            writer.writerow((text[kind], block, "", ns, events.names.get(name_id, "")))
        elif kind == ITER:
            writer.writerow((text[kind], block, "", "", events.names.get(name_id, "")))
        elif kind in text:
            writer.writerow((text[kind], block, "", "", ""))
        else:
            raise ValueError(f"events: unknown kind {kind}")
    Path(path).write_text(out.getvalue(), encoding="utf-8")


# -- placement problem CSV (MiniMalloc) ------------------------------------------------------------

_ALIASES = {
    "id": "id",
    "buffer": "id",
    "buffer_id": "id",
    "lower": "lower",
    "begin": "lower",
    "start": "lower",
    "upper": "upper",
    "end": "end",  # inclusive upper bound
    "size": "size",
    "alignment": "alignment",
    "offset": None,  # a solution's column: ignored on input
    "hint": None,  # a solver hint: ignored
    "gaps": None,  # times within the lifetime the buffer is not live: ignoring them is safe
}


def read_problem_csv_with_labels(path: str | Path) -> tuple[Problem, tuple[str, ...]]:
    """A MiniMalloc CSV as a problem, and the buffers' ids as the file writes them.

    Integer ids are kept as `Buffer.id`; otherwise buffers are numbered 0, 1, ...
    in file order and the labels keep the names (pass them to
    `write_solution_csv`). A per-buffer `alignment` column sets the problem's
    alignment to the largest one (alignments are powers of two).
    """
    path = Path(path)
    rows = _rows(path, _read_text(path))
    if not rows:
        raise FormatError(f"{path}: empty: expected the header id,lower,upper,size")
    number, header = rows[0]
    columns: dict[str, int] = {}
    for j, name in enumerate(header):
        if name not in _ALIASES:
            raise FormatError(f"{path}:{number}: bad header: unknown column {name!r}")
        key = _ALIASES[name]
        if key is None:
            continue
        if key in columns or (key in ("upper", "end") and {"upper", "end"} & columns.keys()):
            raise FormatError(f"{path}:{number}: bad header: column {name!r} given twice")
        columns[key] = j
    missing = [c for c in ("id", "lower", "size") if c not in columns]
    if "upper" not in columns and "end" not in columns:
        missing.append("upper")
    if missing:
        raise FormatError(f"{path}:{number}: bad header: missing column {', '.join(missing)}")

    labels: list[str] = []
    bounds: list[tuple[int, int, int, int]] = []  # line, lower, upper, size
    alignment = 1
    total = 0
    for number, fields in rows[1:]:
        if len(fields) != len(header):
            raise FormatError(
                f"{path}:{number}: {plural(len(fields), 'field')}, expected {len(header)}"
            )

        def whole(key: str, fields: list[str] = fields, number: int = number) -> int:
            return _whole(path, number, key, fields[columns[key]])

        lower = whole("lower")
        upper = whole("upper") if "upper" in columns else whole("end") + 1
        size = whole("size")
        if size <= 0:
            raise FormatError(f"{path}:{number}: size {size} is not positive")
        if upper <= lower:
            raise FormatError(f"{path}:{number}: empty lifetime [{lower}, {upper})")
        if "alignment" in columns:
            a = whole("alignment")
            if a <= 0 or a & (a - 1):
                raise FormatError(f"{path}:{number}: alignment {a} is not a power of two")
            if a > MAX_ALIGNMENT:
                raise FormatError(
                    f"{path}:{number}: alignment {a}: at most {MAX_ALIGNMENT} (1 GiB), so that"
                    " sizes rounded up to it stay within 64 bits"
                )
            alignment = max(alignment, a)
        total += size
        if total > MAX_TOTAL:
            raise FormatError(
                f"{path}:{number}: size {size} brings the buffers' total size to"
                f" {too_many_bytes(total)}"
            )
        labels.append(fields[columns["id"]])
        bounds.append((number, lower, upper, size))

    try:
        ids = [int(label) for label in labels]
    except ValueError:
        ids = list(range(len(labels)))
    seen: dict[str, int] = {}
    for label, (number, *_) in zip(labels, bounds, strict=True):
        if label in seen:
            raise FormatError(f"{path}:{number}: id {label!r} repeats line {seen[label]}")
        seen[label] = number
    buffers = tuple(
        Buffer(id=i, lower=Tick(lo), upper=Tick(up), size=Bytes(sz))
        for i, (_, lo, up, sz) in zip(ids, bounds, strict=True)
    )
    return Problem(buffers=buffers, alignment=alignment), tuple(labels)


def read_problem_csv(path: str | Path) -> Problem:
    """A MiniMalloc CSV (`id,lower,upper,size`, half-open lifetimes) as a problem."""
    return read_problem_csv_with_labels(path)[0]


def write_solution_csv(
    path: str | Path,
    problem: Problem,
    placement: Placement,
    labels: Sequence[str] | None = None,
) -> None:
    """Write `id,lower,upper,size,offset`, one row per buffer (ids from `labels` if given)."""
    if len(placement.offsets) != len(problem.buffers):
        raise ValueError(
            f"placement has {len(placement.offsets)} offsets for {len(problem.buffers)} buffers"
        )
    if labels is not None and len(labels) != len(problem.buffers):
        raise ValueError(f"{len(labels)} labels for {len(problem.buffers)} buffers")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(SOLUTION_HEADER)
    for i, (b, offset) in enumerate(zip(problem.buffers, placement.offsets, strict=True)):
        label = labels[i] if labels is not None else b.id
        writer.writerow((label, b.lower, b.upper, b.size, offset))
    Path(path).write_text(out.getvalue(), encoding="utf-8")


# -- PyTorch memory snapshot -----------------------------------------------------------------------


class _PlainUnpickler(pickle.Unpickler):
    """Loads only plain values (dicts, lists, numbers, strings): no code runs, no torch needed."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def read_snapshot(path: str | Path, device: int | None = None) -> Problem:
    """A PyTorch memory snapshot (`torch.cuda.memory._dump_snapshot`) as a problem.

    Times are entry indices in the device's trace (`device_traces[device]`; by
    default the device with the most allocations). An `alloc` at an address
    opens a buffer; the next free of that address closes it: `free_completed`
    when it follows `free_requested` (the bytes are busy until then), else the
    request. Blocks live at the end last until the end; blocks freed but never
    allocated within the trace (allocated before recording began) live from 0.
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            snapshot = _PlainUnpickler(f).load()
    except Exception as exc:  # arbitrary bytes fail in many ways
        raise FormatError(f"{path}: not a PyTorch memory snapshot: {exc}") from None
    traces = snapshot.get("device_traces") if isinstance(snapshot, dict) else None
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise FormatError(f"{path}: not a PyTorch memory snapshot: no device_traces list")
    if device is None:
        counts = [sum(1 for e in t if isinstance(e, dict) and e.get("action") == "alloc")
                  for t in traces]  # fmt: skip
        device = counts.index(max(counts)) if counts else 0
    if not 0 <= device < len(traces):
        raise FormatError(f"{path}: no trace for device {device} ({plural(len(traces), 'device')})")
    entries = traces[device]

    buffers: list[tuple[int, int, int]] = []  # lower, upper, size
    live: dict[int, tuple[int, int]] = {}  # addr -> (lower, size)
    requested: dict[int, tuple[int, int, int]] = {}  # addr -> (lower, size, request entry)
    for index, entry in enumerate(entries):
        action = entry.get("action") if isinstance(entry, dict) else None
        if action not in ("alloc", "free_requested", "free_completed", "free"):
            continue  # segment_alloc, segment_map, snapshot, oom, ...: not a block's life
        try:
            addr, size = int(entry["addr"]), int(entry["size"])
        except (KeyError, TypeError, ValueError):
            raise FormatError(
                f"{path}: device {device} entry {index}: {action} without an integer addr and size"
            ) from None
        if addr in requested and action != "free_completed":  # the completion never came
            lower, size0, upper = requested.pop(addr)
            buffers.append((lower, upper, size0))
        if action == "alloc":
            if addr in live:
                raise FormatError(
                    f"{path}: device {device} entry {index}: alloc at {addr:#x}, which is live"
                )
            live[addr] = (index, size)
            continue
        lower, size = live.pop(addr, (0, size))  # unknown: allocated before recording began
        if action == "free_requested":
            requested[addr] = (lower, size, index)
        elif action == "free_completed" and addr in requested:
            lower, size, _ = requested.pop(addr)
            buffers.append((lower, index, size))
        else:
            buffers.append((lower, index, size))
    buffers.extend((lower, upper, size) for lower, size, upper in requested.values())
    buffers.extend((lower, len(entries), size) for lower, size in live.values())
    buffers.sort()
    kept = [(lo, up, sz) for lo, up, sz in buffers if up > lo and sz > 0]
    if (total := sum(sz for _, _, sz in kept)) > MAX_TOTAL:
        raise FormatError(f"{path}: device {device}: blocks of {too_many_bytes(total)}")
    return Problem(
        buffers=tuple(
            Buffer(id=i, lower=Tick(lo), upper=Tick(up), size=Bytes(sz))
            for i, (lo, up, sz) in enumerate(kept)
        )
    )


# -- format detection ------------------------------------------------------------------------------


FORMATS = {
    "trace": f"a trace CSV v1 (header {','.join(TRACE_HEADER)})",
    "problem": "a placement CSV (header id,lower,upper,size)",
    "snapshot": "a PyTorch memory snapshot pickle",
}
"""What `detect_format` returns, and how a message names each."""


def detect_format(path: str | Path, accepted: Sequence[str] = tuple(FORMATS)) -> str:
    """Which reader fits: "problem", "trace" or "snapshot", by header line or pickle magic.
    A file of none of them is refused with the `accepted` ones named (those its command reads).
    """
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(65536)
    if len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5:  # pickle protocol 2 to 5
        return "snapshot"
    text = head.decode("utf-8", errors="replace")  # 64 KiB may end inside a character
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        columns = [c.strip() for c in line.split(",")]
        if tuple(columns) == TRACE_HEADER:
            return "trace"
        if set(columns) <= _ALIASES.keys() and "size" in columns:
            return "problem"
        break
    names = [FORMATS[kind] for kind in accepted]
    expected = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    raise FormatError(f"{path}: unknown format: expected {expected}")
