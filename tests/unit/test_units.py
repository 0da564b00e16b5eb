"""parse_size, format_size and align_up: exact bytes, exact strings, every error's text."""

from __future__ import annotations

import pytest
from tidalcore.units import ALIGNMENT, align_up, format_size, parse_size

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4
ACCEPTED = (
    "B; k, m, g, t, Ki, Mi, Gi, Ti, KiB, MiB, GiB, TiB (powers of 1024);"
    " kB, MB, GB, TB (powers of 1000); any case"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 * GiB),
        ("512MB", 512_000_000),
        ("1.5KiB", 1536),
        ("1048576", 1_048_576),
        (" 2 gib ", 2 * GiB),
        ("512 MB", 512_000_000),
        ("1.5g", 3 * GiB // 2),
        ("0", 0),
        ("0B", 0),
        ("7b", 7),
        ("3k", 3 * KiB),
        ("3kB", 3000),
        ("3KB", 3000),
        ("3Ki", 3 * KiB),
        ("5M", 5 * MiB),
        ("5Mi", 5 * MiB),
        ("5mib", 5 * MiB),
        ("2T", 2 * TiB),
        ("2TB", 2_000_000_000_000),
        ("2TiB", 2 * TiB),
        ("0.5GiB", GiB // 2),
        ("0.25MiB", MiB // 4),
        ("1.0B", 1),
        ("2.50kB", 2500),
        ("18446744073709551615", 2**64 - 1),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    value = parse_size(text)
    assert value == expected
    assert type(value) is int


@pytest.mark.parametrize("value", [0, 7, 4 * GiB, 2**70])
def test_parse_size_of_int_is_the_int(value: int) -> None:
    assert parse_size(value) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("-1", "not a size: '-1' (examples: 4GiB, 4g, 512MB, 1048576)"),
        ("", "not a size: '' (examples: 4GiB, 4g, 512MB, 1048576)"),
        ("GiB", "not a size: 'GiB' (examples: 4GiB, 4g, 512MB, 1048576)"),
        (".5GiB", "not a size: '.5GiB' (examples: 4GiB, 4g, 512MB, 1048576)"),
        ("1e3", "not a size: '1e3' (examples: 4GiB, 4g, 512MB, 1048576)"),
        ("4 G B", "not a size: '4 G B' (examples: 4GiB, 4g, 512MB, 1048576)"),
        ("1,000", "not a size: '1,000' (examples: 4GiB, 4g, 512MB, 1048576)"),
        ("4XB", "unknown size unit 'XB' in '4XB' (accepted: " + ACCEPTED + ")"),
        ("4 bytes", "unknown size unit 'bytes' in '4 bytes' (accepted: " + ACCEPTED + ")"),
        ("4PiB", "unknown size unit 'PiB' in '4PiB' (accepted: " + ACCEPTED + ")"),
        ("1.3B", "size '1.3B' is not a whole number of bytes"),
        ("0.5", "size '0.5' is not a whole number of bytes"),
        ("1.0001kB", "size '1.0001kB' is not a whole number of bytes"),
    ],
)
def test_parse_size_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_size(text)
    assert str(e.value) == message


@pytest.mark.parametrize(
    ("value", "message"), [(True, "not a size: True"), (False, "not a size: False")]
)
def test_parse_size_refuses_bools(value: bool, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_size(value)
    assert str(e.value) == message


@pytest.mark.parametrize("value", [-5, -1])
def test_parse_size_refuses_negative_ints(value: int) -> None:
    with pytest.raises(ValueError) as e:
        parse_size(value)
    assert str(e.value) == f"size must not be negative: {value}"


@pytest.mark.parametrize(
    ("text", "expected"), [("4.1MB", 4_100_000), ("8.3MB", 8_300_000), ("8.2GB", 8_200_000_000)]
)
def test_parse_size_of_exact_decimal_fractions(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_parse_size_refuses_a_fraction_below_float_precision() -> None:
    with pytest.raises(ValueError) as e:
        parse_size("1.00000000000000001B")
    assert str(e.value) == "size '1.00000000000000001B' is not a whole number of bytes"


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (1100, "1.1 KiB"),
        (10 * KiB, "10 KiB"),
        (100 * KiB, "100 KiB"),
        (MiB, "1 MiB"),
        (MiB - 1, "1 MiB"),  # rounds up into the next unit, not "1024 KiB"
        (KiB * 1023 + 1000, "1 MiB"),  # 1023.98 KiB shows as 1024.0 at one decimal
        (MiB + MiB // 4, "1.2 MiB"),  # 1.25 rounds half to even
        (5 * MiB // 2, "2.5 MiB"),
        (512 * MiB, "512 MiB"),
        (4 * GiB, "4 GiB"),
        (4294967296, "4 GiB"),
        (3 * TiB, "3 TiB"),
        (2048 * TiB, "2048 TiB"),
        (-1536, "-1.5 KiB"),
        (-5, "-5 B"),
    ],
)
def test_format_size(nbytes: int, expected: str) -> None:
    assert format_size(nbytes) == expected


@pytest.mark.parametrize(
    ("n", "alignment", "expected"),
    [
        (0, 256, 0),
        (1, 256, 256),
        (255, 256, 256),
        (256, 256, 256),
        (257, 256, 512),
        (5, 1, 5),
        (3 * MiB + 1, 2 * MiB, 4 * MiB),
        (4 * MiB, 2 * MiB, 4 * MiB),
    ],
)
def test_align_up(n: int, alignment: int, expected: int) -> None:
    assert align_up(n, alignment) == expected


def test_default_alignment() -> None:
    assert ALIGNMENT == 256
