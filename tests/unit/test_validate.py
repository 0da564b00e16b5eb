"""The validator: good placements pass, and each broken promise is named exactly.

Every case runs twice: the pairwise comparison and the sweep (PAIRWISE_MAX = 0).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tidalcore.units import Bytes, Offset, Tick
from tidalplan import validate as validate_module
from tidalplan.model import Buffer, Placement, Problem
from tidalplan.validate import InvalidPlacement, validate


@pytest.fixture(autouse=True, params=["pairwise", "sweep"])
def method(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "sweep":
        monkeypatch.setattr(validate_module, "PAIRWISE_MAX", 0)
    yield str(request.param)


def problem(*rows: tuple[int, int, int], alignment: int = 1) -> Problem:
    return Problem(
        tuple(Buffer(10 + i, Tick(lo), Tick(up), Bytes(s)) for i, (lo, up, s) in enumerate(rows)),
        alignment,
    )


def placed(*offsets: int, height: int) -> Placement:
    return Placement(tuple(Offset(o) for o in offsets), Bytes(height), "test")


# Buffers 10, 11, 12: 10 and 11 meet over ticks [2, 4); 12 begins as 10 ends.
THREE = problem((0, 4, 8), (2, 6, 4), (4, 8, 8))


def test_good_placement_passes() -> None:
    validate(THREE, placed(0, 8, 0, height=12))
    validate(THREE, placed(4, 0, 4, height=12))  # 11 under 10 and under 12
    validate(THREE, placed(0, 8, 0, height=12), capacity=12)


def test_touching_lifetimes_and_touching_bytes_pass() -> None:
    p = problem((0, 2, 5), (2, 4, 5), (0, 4, 3))
    validate(p, placed(0, 0, 5, height=8))


def test_empty_problem_passes() -> None:
    validate(problem(), placed(height=0))
    validate(problem(), placed(height=0), capacity=0)


def test_overlap_names_both_buffers_ticks_and_bytes() -> None:
    with pytest.raises(InvalidPlacement) as e:
        validate(THREE, placed(0, 6, 0, height=10))
    assert str(e.value) == (
        "buffers 10 and 11 overlap: both live over ticks [2, 4) and both hold bytes [6, 8)"
        " (10 at [0, 8), 11 at [6, 10))"
    )


def test_overlap_by_one_byte_and_one_tick() -> None:
    p = problem((0, 3, 8), (2, 5, 8))
    with pytest.raises(InvalidPlacement, match=r"ticks \[2, 3\) and both hold bytes \[7, 8\)"):
        validate(p, placed(0, 7, height=15))


def test_identical_offsets_overlap() -> None:
    p = problem((0, 3, 8), (1, 2, 1))
    with pytest.raises(InvalidPlacement, match=r"buffers 10 and 11 overlap"):
        validate(p, placed(4, 4, height=12))


def test_unaligned_offset() -> None:
    p = problem((0, 2, 100), (1, 3, 300), alignment=256)
    validate(p, placed(512, 0, height=768))
    with pytest.raises(InvalidPlacement) as e:
        validate(p, placed(300, 0, height=556))
    assert str(e.value) == (
        "buffer 10: offset 300 is not a multiple of the alignment 256 (44 past 256)"
    )


def test_height_counts_sizes_padded_to_the_alignment() -> None:
    p = problem((0, 2, 100), alignment=256)
    validate(p, placed(0, height=256))
    with pytest.raises(InvalidPlacement, match=r"claimed height 100 but the buffers reach 256"):
        validate(p, placed(0, height=100))


def test_claimed_height_differs() -> None:
    with pytest.raises(InvalidPlacement) as e:
        validate(THREE, placed(0, 8, 0, height=11))
    assert str(e.value) == "claimed height 11 but the buffers reach 12 (buffer 11)"


def test_capacity_exceeded() -> None:
    with pytest.raises(InvalidPlacement) as e:
        validate(THREE, placed(0, 8, 0, height=12), capacity=11)
    assert str(e.value) == (
        "height 12 exceeds the capacity 11: buffer 11 reaches it (offset 8, size 4)"
    )


def test_wrong_number_of_offsets() -> None:
    with pytest.raises(InvalidPlacement, match=r"^2 offsets for 3 buffers \(solver test\)$"):
        validate(THREE, placed(0, 8, height=12))


def test_negative_and_non_integer_offsets() -> None:
    with pytest.raises(InvalidPlacement, match=r"^buffer 11: negative offset -8$"):
        validate(THREE, placed(0, -8, 0, height=8))
    bad = Placement((Offset(0), 8.0, Offset(0)), Bytes(12), "test")  # type: ignore[arg-type]
    with pytest.raises(InvalidPlacement, match=r"^buffer 11: offset 8.0 is not an integer$"):
        validate(THREE, bad)


def test_alignment_below_one() -> None:
    with pytest.raises(InvalidPlacement, match=r"alignment must be at least 1, got 0"):
        validate(problem((0, 1, 1), alignment=0), placed(0, height=1))


def test_many_buffers_checked_by_both_methods(method: str) -> None:
    # A staircase of 300 buffers: i lives over [i, i + 10) at offset (i % 10) * 4.
    p = problem(*((i, i + 10, 4) for i in range(300)))
    offsets = [(i % 10) * 4 for i in range(300)]
    validate(p, placed(*offsets, height=40))
    offsets[150] = offsets[151]  # buffer 160 onto 161's bytes, where 151 still lives
    with pytest.raises(InvalidPlacement) as e:
        validate(p, placed(*offsets, height=40))
    assert str(e.value) == (
        "buffers 151 and 160 overlap: both live over ticks [150, 151) and both hold bytes"
        " [4, 8) (151 at [4, 8), 160 at [4, 8))"
    )


def test_shares_no_code_with_the_solver() -> None:
    """Nothing but the model's types is imported from the planner at run time (the simulator's
    types only for the type checker)."""
    tree = ast.parse(Path(validate_module.__file__).read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    imported = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert imported == {
        "__future__",
        "bisect",
        "fractions",
        "itertools",
        "math",
        "typing",
        "numpy",
        "tidalplan.model",
    }


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 8), st.integers(1, 4), st.integers(1, 6), st.integers(0, 12)),
        max_size=10,
    )
)
def test_pairwise_and_sweep_agree(rows: list[tuple[int, int, int, int]]) -> None:
    p = problem(*((lo, lo + length, size) for lo, length, size, _ in rows))
    offsets = placed(*(o for *_, o in rows), height=0)
    verdicts = []
    for check in (validate_module._pairwise, validate_module._sweep):
        try:
            check(p, offsets)
            verdicts.append("valid")
        except InvalidPlacement:
            verdicts.append("overlap")
    assert verdicts[0] == verdicts[1]
