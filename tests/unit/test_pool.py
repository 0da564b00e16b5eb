"""PoolAccount: first-fit offsets, alignment, merging on release, counters, every error's text."""

from __future__ import annotations

import pytest
from tidalpool.units import Bytes, Offset
from tidalpoold.pool import LeaseRange, PoolAccount, PoolExhausted

KiB = 1024


def rng(offset: int, length: int) -> LeaseRange:
    return LeaseRange(Offset(offset), Bytes(length))


def pool(total: int = 16 * KiB, alignment: int = KiB) -> PoolAccount:
    return PoolAccount("device", total, alignment)


# -- construction ----------------------------------------------------------------------------------


def test_total_is_rounded_down_to_alignment() -> None:
    p = PoolAccount("device", 10_000, 1024)
    assert p.total == 9216
    assert p.alignment == 1024
    assert p.name == "device"
    assert p.free_bytes == 9216
    assert p.largest_free == 9216
    assert p.leased_bytes == 0


def test_total_already_aligned_is_kept() -> None:
    assert PoolAccount("host", 8192, 4096).total == 8192


def test_total_below_alignment_is_an_empty_pool() -> None:
    p = PoolAccount("host", 1000, 1024)
    assert p.total == 0
    assert p.free_bytes == 0
    assert p.largest_free == 0
    with pytest.raises(PoolExhausted) as e:
        p.lease(1)
    assert str(e.value) == (
        "host pool cannot lease 1024 bytes: 0 of 0 bytes free, largest free range 0 bytes"
    )


@pytest.mark.parametrize("alignment", [0, -4, 3, 6, 1000])
def test_alignment_must_be_a_power_of_two(alignment: int) -> None:
    with pytest.raises(ValueError) as e:
        PoolAccount("device", 4096, alignment)
    assert str(e.value) == f"pool alignment must be a power of two, got {alignment}"


def test_alignment_of_one_is_accepted() -> None:
    p = PoolAccount("device", 7, 1)
    assert p.total == 7
    assert p.lease(3) == rng(0, 3)
    assert p.lease(4) == rng(3, 4)


# -- lease -----------------------------------------------------------------------------------------


def test_first_fit_offsets_with_alignment_rounding() -> None:
    p = pool()
    assert p.lease(1) == rng(0, 1024)
    assert p.lease(1024) == rng(1024, 1024)
    assert p.lease(1025) == rng(2048, 2048)
    assert p.lease(3000) == rng(4096, 3072)
    assert p.leased_bytes == 7168
    assert p.free_bytes == 16 * KiB - 7168
    assert p.largest_free == 16 * KiB - 7168


@pytest.mark.parametrize("nbytes", [0, -1, -4096])
def test_lease_of_non_positive_size_is_refused(nbytes: int) -> None:
    p = pool()
    with pytest.raises(ValueError) as e:
        p.lease(nbytes)
    assert str(e.value) == f"device lease of {nbytes} bytes: size must be positive"
    assert p.leased_bytes == 0
    assert p.lease(1) == rng(0, 1024)


def test_lease_of_exactly_the_whole_pool() -> None:
    p = pool(total=4 * KiB)
    assert p.lease(4 * KiB) == rng(0, 4 * KiB)
    assert p.free_bytes == 0
    assert p.largest_free == 0
    assert p.leased_bytes == 4 * KiB


def test_first_fit_takes_the_lowest_hole_that_fits() -> None:
    p = pool()
    a = p.lease(KiB)  # 0
    b = p.lease(3 * KiB)  # 1 KiB
    c = p.lease(KiB)  # 4 KiB
    d = p.lease(2 * KiB)  # 5 KiB
    assert (a.offset, b.offset, c.offset, d.offset) == (0, 1024, 4096, 5120)
    p.release(a)  # hole [0, 1 KiB)
    p.release(c)  # hole [4 KiB, 5 KiB)
    # 2 KiB fits in neither small hole: it goes to the tail at 7 KiB.
    assert p.lease(2 * KiB) == rng(7168, 2048)
    # 1 KiB fits in the lowest hole.
    assert p.lease(KiB) == rng(0, 1024)
    assert p.lease(KiB) == rng(4096, 1024)
    assert p.lease(KiB) == rng(9216, 1024)


def test_exhausted_message_names_the_numbers() -> None:
    p = pool(total=8 * KiB)
    leases = [p.lease(KiB) for _ in range(8)]
    p.release(leases[1])
    p.release(leases[5])
    assert p.free_bytes == 2048
    assert p.largest_free == 1024
    with pytest.raises(PoolExhausted) as e:
        p.lease(1500)
    assert str(e.value) == (
        "device pool cannot lease 2048 bytes: 2048 of 8192 bytes free, "
        "largest free range 1024 bytes"
    )
    # The failed lease changed nothing.
    assert p.free_bytes == 2048
    assert p.leased_bytes == 6144
    assert p.lease(KiB) == rng(1024, 1024)


def test_exhausted_when_full() -> None:
    p = pool(total=2 * KiB)
    p.lease(2 * KiB)
    with pytest.raises(PoolExhausted) as e:
        p.lease(1)
    assert str(e.value) == (
        "device pool cannot lease 1024 bytes: 0 of 2048 bytes free, largest free range 0 bytes"
    )


# -- release and merging ---------------------------------------------------------------------------


def five_leases(p: PoolAccount) -> list[LeaseRange]:
    """Five 2 KiB leases at 0, 2, 4, 6, 8 KiB of a 16 KiB pool; the tail [10, 16) KiB is free."""
    leases = [p.lease(2 * KiB) for _ in range(5)]
    assert [r.offset for r in leases] == [0, 2048, 4096, 6144, 8192]
    return leases


def test_release_merges_with_left_neighbour() -> None:
    p = pool()
    r = five_leases(p)
    p.release(r[1])  # free [2, 4)
    p.release(r[2])  # free [4, 6): merges left into [2, 6)
    assert p.largest_free == 6 * KiB  # the tail is still the largest
    assert p.free_bytes == 10 * KiB
    assert p.lease(4 * KiB) == rng(2048, 4096)
    assert p.free_bytes == 6 * KiB


def test_release_merges_with_right_neighbour() -> None:
    p = pool()
    r = five_leases(p)
    p.release(r[2])  # free [4, 6)
    p.release(r[1])  # free [2, 4): merges right into [2, 6)
    assert p.lease(4 * KiB) == rng(2048, 4096)


def test_release_merges_with_both_neighbours() -> None:
    p = pool()
    r = five_leases(p)
    p.release(r[1])  # free [2, 4)
    p.release(r[3])  # free [6, 8)
    assert p.largest_free == 6 * KiB
    p.release(r[2])  # free [4, 6): merges both sides into [2, 8)
    assert p.free_bytes == 12 * KiB
    assert p.lease(6 * KiB) == rng(2048, 6144)
    assert p.largest_free == 6 * KiB  # the tail [10, 16)


def test_release_next_to_the_free_tail_merges_into_it() -> None:
    p = pool()
    r = five_leases(p)
    p.release(r[4])  # [8, 10) joins the tail [10, 16)
    assert p.largest_free == 8 * KiB
    assert p.lease(8 * KiB) == rng(8192, 8192)
    assert p.free_bytes == 0


def test_release_everything_restores_one_range() -> None:
    p = pool()
    r = five_leases(p)
    for i in (3, 0, 4, 2, 1):
        p.release(r[i])
    assert p.leased_bytes == 0
    assert p.free_bytes == 16 * KiB
    assert p.largest_free == 16 * KiB
    assert p.lease(16 * KiB) == rng(0, 16 * KiB)


def test_release_without_neighbours_does_not_merge() -> None:
    p = pool()
    r = five_leases(p)
    p.release(r[1])  # [2, 4) between leases 0 and 2
    assert p.largest_free == 6 * KiB
    with pytest.raises(PoolExhausted):
        p.lease(7 * KiB)
    assert p.lease(3 * KiB) == rng(10240, 3072)  # does not fit [2, 4)
    assert p.lease(2 * KiB) == rng(2048, 2048)


def test_counters_follow_leases_and_releases() -> None:
    p = pool()
    a = p.lease(1)
    b = p.lease(5000)
    assert b == rng(1024, 5120)
    assert (p.leased_bytes, p.free_bytes, p.largest_free) == (6144, 10240, 10240)
    p.release(a)
    assert (p.leased_bytes, p.free_bytes, p.largest_free) == (5120, 11264, 10240)
    p.release(b)
    assert (p.leased_bytes, p.free_bytes, p.largest_free) == (0, 16384, 16384)


def test_release_of_unknown_range_is_a_key_error() -> None:
    p = pool()
    p.lease(2 * KiB)
    with pytest.raises(KeyError) as e:
        p.release(rng(4096, 1024))
    assert e.value.args == ("device pool has no lease at 4096+1024",)


def test_release_with_wrong_length_is_a_key_error() -> None:
    p = pool()
    r = p.lease(2 * KiB)
    with pytest.raises(KeyError) as e:
        p.release(rng(r.offset, 1024))
    assert e.value.args == ("device pool has no lease at 0+1024",)
    assert p.leased_bytes == 2048


def test_double_release_is_a_key_error() -> None:
    p = pool()
    r = p.lease(KiB)
    p.release(r)
    with pytest.raises(KeyError) as e:
        p.release(r)
    assert e.value.args == ("device pool has no lease at 0+1024",)
    assert p.free_bytes == 16 * KiB
    assert p.largest_free == 16 * KiB


def test_lease_range_is_a_frozen_value() -> None:
    r = rng(0, 1024)
    assert r == rng(0, 1024)
    assert hash(r) == hash(rng(0, 1024))
    with pytest.raises(AttributeError):
        r.offset = Offset(5)  # type: ignore[misc]
