"""PoolAccount: leases as sets of chunks, lowest free first, counters, every error's text."""

from __future__ import annotations

import random

import pytest
from tidalpoold.pool import Lease, PoolAccount, PoolExhausted

KiB = 1024


def pool(count: int = 8, chunk: int = KiB) -> PoolAccount:
    return PoolAccount("device", chunk, count)


def lease(*chunks: int, chunk: int = KiB) -> Lease:
    return Lease(tuple(chunks), chunk)


# -- construction ----------------------------------------------------------------------------------


def test_a_new_pool_is_all_free() -> None:
    p = PoolAccount("host", 4096, 3)
    assert (p.name, p.chunk_bytes, p.count) == ("host", 4096, 3)
    assert (p.total, p.free_bytes, p.leased_bytes, p.free_chunks) == (12288, 12288, 0, 3)


def test_an_empty_pool_leases_nothing() -> None:
    p = PoolAccount("host", 4096, 0)
    assert p.total == 0
    with pytest.raises(PoolExhausted) as e:
        p.lease(1)
    assert str(e.value) == (
        "host pool cannot lease 1 chunks (4 KiB) for 1 bytes: 0 of 0 chunks of 4 KiB free"
    )


@pytest.mark.parametrize(("chunk", "count"), [(0, 4), (-1, 4), (1024, -1)])
def test_a_pool_needs_positive_chunks(chunk: int, count: int) -> None:
    with pytest.raises(ValueError) as e:
        PoolAccount("device", chunk, count)
    assert str(e.value) == f"device pool of {count} chunks of {chunk} bytes is not a pool"


# -- lease -----------------------------------------------------------------------------------------


def test_a_lease_takes_whole_chunks() -> None:
    p = pool()
    assert p.lease(1) == lease(0)
    assert p.lease(KiB) == lease(1)
    assert p.lease(KiB + 1) == lease(2, 3)
    assert p.lease(3 * KiB - 1) == lease(4, 5, 6)
    assert p.lease(KiB) == lease(7)
    with pytest.raises(PoolExhausted):
        p.lease(1)


def test_lengths_and_counters() -> None:
    p = pool()
    a = p.lease(KiB + 1)
    assert (a.chunks, a.length, a.chunk_bytes) == ((0, 1), 2 * KiB, KiB)
    assert (p.leased_bytes, p.free_bytes, p.free_chunks) == (2 * KiB, 6 * KiB, 6)
    p.release(a)
    assert (p.leased_bytes, p.free_bytes, p.free_chunks) == (0, 8 * KiB, 8)


@pytest.mark.parametrize("nbytes", [0, -1, -4096])
def test_lease_of_non_positive_size_is_refused(nbytes: int) -> None:
    p = pool()
    with pytest.raises(ValueError) as e:
        p.lease(nbytes)
    assert str(e.value) == f"device lease of {nbytes} bytes: size must be positive"
    assert p.leased_bytes == 0


def test_lease_of_the_whole_pool() -> None:
    p = pool(count=4)
    assert p.lease(4 * KiB) == lease(0, 1, 2, 3)
    assert p.free_bytes == 0


def test_chunks_need_not_be_adjacent() -> None:
    p = pool(count=6)
    a, b, c = p.lease(KiB), p.lease(KiB), p.lease(KiB)
    p.release(a)
    p.release(c)
    # Free: 0, 2, 3, 4, 5. The lowest three, across the hole that b leaves.
    assert b == lease(1)
    assert p.lease(3 * KiB) == lease(0, 2, 3)
    assert p.lease(2 * KiB) == lease(4, 5)


def test_exhausted_message_names_the_numbers() -> None:
    p = pool(count=4)
    p.lease(3 * KiB)
    with pytest.raises(PoolExhausted) as e:
        p.lease(KiB + 1)
    assert str(e.value) == (
        "device pool cannot lease 2 chunks (2 KiB) for 1025 bytes: 1 of 4 chunks of 1 KiB free"
    )
    # The failed lease changed nothing.
    assert (p.free_chunks, p.leased_bytes) == (1, 3 * KiB)
    assert p.lease(KiB) == lease(3)


def test_fragmentation_never_refuses_a_lease_that_fits_in_free_chunks() -> None:
    """Unlike ranges, chunks never fragment: any set of free chunks serves any lease."""
    rng = random.Random(7)
    p = pool(count=64)
    held: list[Lease] = []
    for _ in range(2000):
        if held and (rng.random() < 0.5 or p.free_chunks == 0):
            p.release(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 8)
            if n <= p.free_chunks:
                held.append(p.lease(n * KiB))
            else:
                with pytest.raises(PoolExhausted):
                    p.lease(n * KiB)
        taken = [c for h in held for c in h.chunks]
        assert len(taken) == len(set(taken))  # no chunk in two leases
        assert p.free_chunks + len(taken) == 64


def test_consecutive_leases_take_the_lowest_run_of_adjacent_chunks() -> None:
    """cuda "ipc" mode: a lease is one offset range of the pool's one allocation."""
    p = PoolAccount("device", KiB, 8, consecutive=True)
    a, b, c = p.lease(KiB), p.lease(2 * KiB), p.lease(KiB)
    assert (a, b, c) == (lease(0), lease(1, 2), lease(3))
    p.release(a)
    p.release(c)
    # Free: 0, 3, 4, 5, 6, 7. Two chunks skip the single hole at 0.
    assert p.lease(2 * KiB) == lease(3, 4)
    assert p.lease(KiB) == lease(0)
    assert p.lease(3 * KiB) == lease(5, 6, 7)
    assert p.free_chunks == 0


def test_consecutive_lease_refused_when_free_chunks_are_not_side_by_side() -> None:
    p = PoolAccount("device", KiB, 4, consecutive=True)
    held = [p.lease(KiB) for _ in range(4)]
    p.release(held[0])
    p.release(held[2])
    with pytest.raises(PoolExhausted) as e:
        p.lease(2 * KiB)
    assert str(e.value) == (
        "device pool has no 2 consecutive free chunks (2 KiB) for 2048 bytes, as a lease in ipc"
        " mode needs: 2 of 4 chunks of 1 KiB free, but not side by side"
    )
    assert p.free_chunks == 2  # the refusal changed nothing
    p.release(held[1])
    assert p.lease(3 * KiB) == lease(0, 1, 2)


def test_consecutive_leases_are_always_runs() -> None:
    rng = random.Random(11)
    p = PoolAccount("device", KiB, 32, consecutive=True)
    held: list[Lease] = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            p.release(held.pop(rng.randrange(len(held))))
            continue
        n = rng.randint(1, 6)
        taken = {c for h in held for c in h.chunks}
        free = [k for k in range(32) if k not in taken]
        runs = [k for k in free if all(k + j in free for j in range(n))]
        if runs:
            got = p.lease(n * KiB)
            assert got == lease(*range(runs[0], runs[0] + n))
            held.append(got)
        else:
            with pytest.raises(PoolExhausted):
                p.lease(n * KiB)


# -- release ---------------------------------------------------------------------------------------


def test_released_chunks_are_leased_again_lowest_first() -> None:
    p = pool(count=4)
    a, b = p.lease(2 * KiB), p.lease(2 * KiB)
    p.release(b)
    p.release(a)
    assert p.lease(3 * KiB) == lease(0, 1, 2)


def test_release_of_chunks_not_leased_is_a_key_error() -> None:
    p = pool()
    p.lease(2 * KiB)
    with pytest.raises(KeyError) as e:
        p.release(lease(1, 2))
    assert e.value.args == ("device pool has not leased chunks [1, 2]",)
    assert p.leased_bytes == 2 * KiB


def test_release_with_another_chunk_size_is_a_key_error() -> None:
    p = pool()
    p.lease(KiB)
    with pytest.raises(KeyError) as e:
        p.release(lease(0, chunk=2 * KiB))
    assert e.value.args == ("device pool has not leased chunks [0]",)


def test_double_release_is_a_key_error() -> None:
    p = pool()
    a = p.lease(KiB)
    p.release(a)
    with pytest.raises(KeyError) as e:
        p.release(a)
    assert e.value.args == ("device pool has not leased chunks [0]",)
    assert p.free_chunks == 8


def test_a_lease_naming_a_chunk_twice_is_a_key_error() -> None:
    p = pool()
    p.lease(2 * KiB)
    with pytest.raises(KeyError) as e:
        p.release(lease(0, 0))
    assert e.value.args == ("device lease names a chunk twice: [0, 0]",)
    assert p.free_chunks == 6


def test_part_of_a_lease_may_be_released() -> None:
    """The registry keeps a chunk that could not be scrubbed out of the pool."""
    p = pool(count=4)
    p.lease(3 * KiB)
    p.release(lease(0, 2))
    assert (p.free_chunks, p.lease(2 * KiB)) == (3, lease(0, 2))
    with pytest.raises(KeyError):
        p.release(lease(3))


def test_lease_is_a_frozen_value() -> None:
    a = lease(3, 1)
    assert a == lease(3, 1) != lease(1, 3)
    assert hash(a) == hash(lease(3, 1))
    with pytest.raises(AttributeError):
        a.chunks = (0,)  # type: ignore[misc]
