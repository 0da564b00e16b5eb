"""The size rule users of memory tools expect: `4g` is 4 GiB (docker's `-m 4g`, Java's
`-Xmx4g`), `4GB` is 4×10⁹ bytes, and the unit error lists exactly the units accepted."""

from __future__ import annotations

import itertools
import re

import pytest
from tidalcore.units import UNITS_ACCEPTED, parse_size

GiB = 1024**3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4g", 4 * GiB),
        ("4G", 4 * GiB),
        ("4Gi", 4 * GiB),
        ("4GiB", 4 * GiB),
        ("512m", 512 * 1024**2),
        ("8k", 8192),
        ("1t", 1024**4),
        ("4GB", 4_000_000_000),
        ("4gb", 4_000_000_000),
        ("512MB", 512_000_000),
        ("8kB", 8000),
    ],
)
def test_bare_letters_are_binary_and_two_letter_units_decimal(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def _listed() -> list[str]:
    """The units the error message names, as it names them."""
    with pytest.raises(ValueError) as e:
        parse_size("4XB")
    message = str(e.value)
    assert message == f"unknown size unit 'XB' in '4XB' (accepted: {UNITS_ACCEPTED})"
    words = re.sub(r"\([^)]*\)|any case", "", UNITS_ACCEPTED)
    return [w for w in re.split(r"[;,\s]+", words) if w]


def test_the_unit_error_lists_exactly_the_units_accepted() -> None:
    listed = _listed()
    assert len(listed) == len(set(listed)) == 17
    for unit in listed:  # every unit named is accepted, in any case
        for spelling in (unit, unit.lower(), unit.upper()):
            assert parse_size(f"2{spelling}") > 0
    # Every spelling of up to three letters that is accepted is one of those named.
    accepted = set()
    letters = "bgikmt"
    for n in range(1, 4):
        for combo in itertools.product(letters, repeat=n):
            unit = "".join(combo)
            try:
                parse_size(f"2{unit}")
            except ValueError:
                continue
            accepted.add(unit)
    assert accepted == {u.lower() for u in listed}
