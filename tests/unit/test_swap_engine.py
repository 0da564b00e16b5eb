"""The swap engine on the sim backend: LRU eviction under a limit, copies and their events,
locks and pins, scheduled swaps, and bit-exact round trips (property tests)."""

from __future__ import annotations

import itertools
import os
import random
import threading
import zlib
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tidalclient.errors import InvalidBlock, LeaseExceeded
from tidalclient.executors.base import ARRIVING, DEVICE, HOST, LEAVING, Block
from tidalclient.executors.python import PythonExecutor
from tidalclient.executors.swapping import Swapping
from tidalclient.plans import Plan, PlanTable
from tidalcore.chunks import ChunkMapping
from tidalcore.planupdate import ScheduledSwap

KiB = 1024


def mapping(nbytes: int) -> ChunkMapping:
    fd = os.memfd_create("tidalpool-test")
    try:
        os.ftruncate(fd, nbytes)
        return ChunkMapping([fd], nbytes)
    finally:
        os.close(fd)


class Rig:
    """A swapping executor over memfd-backed device and host mappings."""

    def __init__(
        self, limit: int | None, device: int = 64 * KiB, host: int = 64 * KiB, **kw: object
    ) -> None:
        self.device = mapping(device)
        self.host = mapping(host)
        self.ex = Swapping(
            PythonExecutor(device),
            device_address=self.device.address,
            host_address=self.host.address,
            host_capacity=host,
            limit=limit,
            **kw,  # type: ignore[arg-type]
        )

    def op(self, *blocks: Block, write: bytes | None = None) -> list[bytes]:
        """One op over `blocks`: the bytes each holds (all must be on the device), and `write`
        into the first one if given."""
        offsets = self.ex.begin_op(blocks)
        try:
            for b in blocks:
                entry = self.ex._entries[b.id]
                assert entry.where == DEVICE and entry.flight is None, "op on a non-resident block"
            seen = [
                bytes(self.device.buffer(o, b.size)) for b, o in zip(blocks, offsets, strict=True)
            ]
            if write is not None:
                self.device.buffer(offsets[0], blocks[0].size)[:] = write
        finally:
            self.ex.end_op(blocks)
        return seen

    def filled(self, size: int, byte: int) -> Block:
        block = self.ex.malloc(size)
        self.op(block, write=bytes([byte]) * size)
        return block

    def where(self, *blocks: Block) -> list[str]:
        return [self.ex.where(b) for b in blocks]

    def gate(self, stream: str) -> threading.Event:
        """Hold the out or in stream until the returned event is set."""
        gate = threading.Event()
        (self.ex._out if stream == "out" else self.ex._in).launch(gate.wait)
        return gate


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for rig in made:
        rig.ex.close()
        assert not rig.ex._out._thread.is_alive() and not rig.ex._in._thread.is_alive()


@pytest.fixture
def rig(rigs: list[Rig]) -> Rig:
    """Limit 4 KiB: four 1 KiB blocks fit."""
    r = Rig(limit=4 * KiB)
    rigs.append(r)
    return r


# ---------------------------------------------------------------- LRU cache


def test_malloc_over_the_limit_evicts_the_least_recently_used(rig: Rig) -> None:
    a, b, c, d = (rig.filled(KiB, n) for n in (1, 2, 3, 4))
    rig.op(a)  # a is now the most recently used; b the least
    e = rig.ex.malloc(KiB)
    rig.ex.synchronize()
    assert rig.where(a, b, c, d, e) == [DEVICE, HOST, DEVICE, DEVICE, DEVICE]
    s = rig.ex.swap_stats()
    assert (s.swap_outs, s.swapped_out_bytes, s.swap_ins, s.resident_bytes) == (1, KiB, 0, 4 * KiB)


def test_access_brings_a_block_back_bit_exact(rig: Rig) -> None:
    a, b, c, d = (rig.filled(KiB, n) for n in (1, 2, 3, 4))
    rig.ex.malloc(KiB)  # evicts a
    assert rig.op(a) == [bytes([1]) * KiB]  # evicts b, the least recently used now
    rig.ex.synchronize()
    assert rig.where(a, b, c, d) == [DEVICE, HOST, DEVICE, DEVICE]
    s = rig.ex.swap_stats()
    assert (s.swap_outs, s.swap_ins, s.swapped_in_bytes) == (2, 1, KiB)
    assert s.peak_resident_bytes == 4 * KiB
    # e took a's bytes at 0 once a's copy out completed; a came back into b's, at 1 KiB
    assert [rig.ex.offset(x) for x in (a, c, d)] == [KiB, 2 * KiB, 3 * KiB]
    assert rig.ex.inner.high_water == 4 * KiB
    assert rig.op(b, c, d) == [bytes([n]) * KiB for n in (2, 3, 4)]


def test_locked_blocks_are_never_evicted(rig: Rig) -> None:
    a, b, c = (rig.filled(KiB, n) for n in (1, 2, 3))
    rig.ex.begin_op([a, b])  # the least recently used two, locked
    rig.ex.malloc(KiB)
    rig.ex.malloc(KiB)  # over the limit: c goes, not a or b
    rig.ex.synchronize()
    assert rig.where(a, b, c) == [DEVICE, DEVICE, HOST]
    rig.ex.end_op([a, b])


def test_limit_unmet_with_everything_unlocked_out_is_lease_exceeded(rig: Rig) -> None:
    a, b, c, d = (rig.filled(KiB, n) for n in (1, 2, 3, 4))
    rig.ex.begin_op([a, b, c])
    with pytest.raises(
        LeaseExceeded,
        match=r"2 KiB \(2048 bytes\) do not fit under the swap limit of 4 KiB \(4096 bytes\) even "
        r"with every unlocked block swapped out: 3 KiB \(3072 bytes\) held by locked or pinned",
    ):
        rig.ex.malloc(2 * KiB)
    rig.ex.end_op([a, b, c])
    assert rig.where(d) == [HOST]  # evicted on the way
    assert rig.ex.inner.live_blocks == 4


def test_block_larger_than_the_limit_is_lease_exceeded(rig: Rig) -> None:
    with pytest.raises(LeaseExceeded, match=r"4\.2 KiB \(4352 bytes\) exceed the swap limit"):
        rig.ex.malloc(4 * KiB + 1)


def test_an_op_whose_blocks_exceed_the_limit_leaves_nothing_locked(rig: Rig) -> None:
    blocks = [rig.filled(KiB, n) for n in range(5)]
    with pytest.raises(LeaseExceeded):
        rig.ex.begin_op(blocks)
    assert all(e.locks == 0 for e in rig.ex._entries.values())
    assert rig.op(*blocks[:4]) == [bytes([n]) * KiB for n in range(4)]


def test_host_lease_full_is_lease_exceeded(rigs: list[Rig]) -> None:
    r = Rig(limit=2 * KiB, host=KiB)
    rigs.append(r)
    r.filled(KiB, 1)
    r.filled(KiB, 2)
    r.filled(KiB, 3)  # the first one goes to the host, which is now full
    with pytest.raises(LeaseExceeded, match=r"the host lease of 1 KiB \(1024 bytes\) is full"):
        r.ex.malloc(KiB)


# ---------------------------------------------------------------- copies and events


def test_device_bytes_are_released_when_the_out_copy_completes(rig: Rig) -> None:
    a = rig.filled(KiB, 7)
    gate = rig.gate("out")
    assert rig.ex.swap_out(a)
    assert rig.where(a) == [LEAVING]
    assert rig.ex.used_bytes == KiB  # still held: the copy has not run
    gate.set()
    rig.ex.synchronize()
    assert rig.where(a) == [HOST]
    assert rig.ex.used_bytes == 0
    assert rig.ex._host.used_bytes == KiB


def test_block_wanted_while_leaving_keeps_its_device_bytes(rig: Rig) -> None:
    a = rig.filled(KiB, 7)
    offset = rig.ex.offset(a)
    gate = rig.gate("out")
    rig.ex.swap_out(a)
    assert rig.ex.begin_op([a]) == [offset]  # no copy back: the bytes never left
    rig.ex.end_op([a])
    gate.set()
    rig.ex.synchronize()
    assert rig.where(a) == [DEVICE]
    assert rig.ex._host.used_bytes == 0  # the copy's host bytes were given back
    assert rig.ex.swap_stats().swap_ins == 0
    assert rig.op(a) == [bytes([7]) * KiB]


def test_access_waits_for_the_in_copy_and_counts_the_stall(rig: Rig) -> None:
    a = rig.filled(KiB, 9)
    rig.ex.swap_out(a)
    rig.ex.synchronize()
    gate = rig.gate("in")
    rig.ex.prefetch(a)
    assert rig.where(a) == [ARRIVING]
    threading.Timer(0.02, gate.set).start()
    assert rig.op(a) == [bytes([9]) * KiB]  # waited for the copy
    assert rig.ex.swap_stats().stall_ns >= 10_000_000
    assert rig.where(a) == [DEVICE]


@pytest.mark.parametrize("state", [LEAVING, HOST, ARRIVING])
def test_free_in_any_state_returns_every_byte(rig: Rig, state: str) -> None:
    a = rig.filled(KiB, 1)
    gates = []
    if state == LEAVING:
        gates.append(rig.gate("out"))
    rig.ex.swap_out(a)
    if state != LEAVING:
        rig.ex.synchronize()
    if state == ARRIVING:
        gates.append(rig.gate("in"))
        rig.ex.prefetch(a)
    assert rig.where(a) == [state]
    rig.ex.free(a)
    for gate in gates:
        gate.set()
    rig.ex.synchronize()
    assert (rig.ex.used_bytes, rig.ex._host.used_bytes, rig.ex.inner.live_blocks) == (0, 0, 0)
    assert rig.ex.inner.free_ranges() == [(0, 64 * KiB)]
    with pytest.raises(InvalidBlock, match="not live"):
        rig.ex.free(a)


def test_free_of_a_block_in_use_is_refused(rig: Rig) -> None:
    a = rig.filled(KiB, 1)
    rig.ex.begin_op([a])
    with pytest.raises(InvalidBlock, match=r"block 1 .* is in use by an op"):
        rig.ex.free(a)
    rig.ex.end_op([a])
    rig.ex.free(a)


def test_pinned_block_is_brought_in_and_never_evicted(rig: Rig) -> None:
    a = rig.filled(KiB, 5)
    rig.ex.swap_out(a)
    rig.ex.pin(a)
    assert rig.where(a) == [DEVICE]
    assert not rig.ex.swap_out(a)
    for n in range(6):
        rig.filled(KiB, n)
    assert rig.where(a) == [DEVICE]
    assert rig.op(a) == [bytes([5]) * KiB]


def test_offset_of_a_swapped_out_block_is_refused(rig: Rig) -> None:
    a = rig.filled(KiB, 5)
    rig.ex.swap_out(a)
    rig.ex.synchronize()
    with pytest.raises(InvalidBlock, match="is swapped out: access it inside an op"):
        rig.ex.offset(a)


def test_placement_plan_above_the_limit_is_deferred(rig: Rig) -> None:
    rig.ex.install_plan(
        Plan(PlanTable.build(1, [KiB] * 8, [KiB * i for i in range(8)], 8 * KiB, 256))
    )
    rig.ex.step()
    assert rig.ex.inner.mode == "learning"
    assert rig.ex.plans_deferred == 1


def test_placement_plan_is_not_used_under_a_limit_even_when_it_fits(rigs: list[Rig]) -> None:
    # Its arena's blocks could not be evicted; without a limit the same plan is used.
    plan = PlanTable.build(1, [KiB] * 2, [0, KiB], 2 * KiB, 256)
    limited, free = Rig(limit=32 * KiB), Rig(limit=None)
    rigs += [limited, free]
    for r in (limited, free):
        r.ex.install_plan(Plan(plan))
        r.ex.step()
    assert (limited.ex.inner.mode, limited.ex.plans_deferred) == ("learning", 1)
    assert (free.ex.inner.mode, free.ex.plans_deferred) == ("planned", 0)


def test_a_plans_blocks_stay_when_the_lease_is_full(rigs: list[Rig]) -> None:
    # With the lease as the limit a plan is used. A block in a slot of its arena holds bytes the
    # arena keeps as a whole: evicting it would give none back, so the LRU leaves it, however
    # long unused, and evicts blocks placed online.
    r = Rig(limit=None, device=8 * KiB)
    rigs.append(r)
    r.ex.install_plan(Plan(PlanTable.build(1, [KiB, 512], [0, KiB], KiB + 512, 256)))
    r.ex.step()
    assert r.ex.inner.mode == "planned"
    a = r.filled(KiB, 1)  # allocation 0: slot 0 of the arena
    online = [r.filled(KiB, 2 + i) for i in range(6)]  # misses (slot 1 is 512 bytes): online
    assert r.ex.inner.used_bytes == KiB + 512 + 6 * KiB  # the lease is full
    r.ex.malloc(KiB)  # room comes from an online block, not from the older `a`
    r.ex.synchronize()
    assert r.where(a, online[0]) == [DEVICE, HOST]
    assert r.op(a) == [bytes([1]) * KiB]


# ---------------------------------------------------------------- scheduled swaps


def test_schedule_swaps_out_after_and_in_before_the_named_ops(rigs: list[Rig]) -> None:
    r = Rig(limit=None)  # the lease is the limit: only the schedule moves blocks
    rigs.append(r)
    w = r.filled(KiB, 0xAA)  # persistent: named by its id
    # Per iteration: a = alloc 0, op 0 writes a, op 1 and op 2 other work, op 3 reads a.
    # a out after op 0, in issued at op 2, needed before op 3. w crosses the boundary:
    # out after op 3, back before op 1 of the next iteration (issued at op 0).
    r.ex.install_schedule(
        [
            ScheduledSwap(block=0, out_after=0, in_before=3),
            ScheduledSwap(block=w.id, out_after=3, in_before=1, persistent=True),
        ]
    )
    for it in range(3):
        r.ex.step()
        assert r.where(w) == ([DEVICE] if it == 0 else [HOST])
        a = r.ex.malloc(KiB)
        r.op(a, write=bytes([it]) * KiB)  # op 0; w's swap-in is issued here (from iteration 2)
        r.ex.synchronize()
        assert r.where(a, w) == [HOST, DEVICE]
        r.op(w)  # op 1
        r.ex.synchronize()
        assert r.where(a) == [HOST]
        r.op()  # op 2: a's swap-in issued
        r.ex.synchronize()
        assert r.where(a) == [DEVICE]
        assert r.op(a, w) == [bytes([it]) * KiB, bytes([0xAA]) * KiB]  # op 3, then w out
        r.ex.synchronize()
        assert r.where(w) == [HOST]
        r.ex.free(a)
    s = r.ex.swap_stats()
    assert (s.swap_outs, s.swap_ins, s.scheduled_swaps, s.schedule_skips) == (6, 5, 2, 0)


def test_schedule_skips_blocks_that_are_gone_or_locked(rigs: list[Rig]) -> None:
    r = Rig(limit=None)
    rigs.append(r)
    r.ex.install_schedule([ScheduledSwap(block=0, out_after=0, in_before=2)])
    r.ex.step()
    r.op()  # op 0: no allocation 0 yet
    assert r.ex.schedule_skips == 1


def test_a_scheduled_swap_in_without_room_waits_for_the_op_that_needs_it(rig: Rig) -> None:
    rig.ex.install_schedule([ScheduledSwap(block=0, out_after=0, in_before=2, in_at=1)])
    rig.ex.step()
    a = rig.ex.malloc(KiB)
    rig.op(a, write=b"a" * KiB)  # op 0, then a goes out
    others = [rig.ex.malloc(KiB) for _ in range(4)]  # with a out, they fill the limit
    rig.op(*others)  # op 1 locks all four: no room to bring a in early, so its swap-in waits
    assert rig.where(a) == [HOST] and rig.ex.schedule_skips == 1
    assert rig.op(a) == [b"a" * KiB]  # op 2 brings it in, evicting the least recently used
    assert rig.ex.swap_stats().swap_ins == 1


@pytest.mark.parametrize(
    ("swap", "message"),
    [
        (ScheduledSwap(0, out_after=3, in_before=3), "only a persistent block may cross"),
        (ScheduledSwap(0, out_after=1, in_before=4, in_at=1), "must be issued between"),
        (ScheduledSwap(0, out_after=1, in_before=4, in_at=5), "must be issued between"),
        (ScheduledSwap(-1, out_after=1, in_before=4), "must not be negative"),
    ],
)
def test_malformed_schedules_are_refused(rig: Rig, swap: ScheduledSwap, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rig.ex.install_schedule([swap])


def test_default_issue_op_is_the_one_before_the_need() -> None:
    assert ScheduledSwap(0, out_after=2, in_before=7).issue_at() == 6
    assert ScheduledSwap(0, out_after=2, in_before=3).issue_at() == 3
    assert ScheduledSwap(0, out_after=5, in_before=0, persistent=True).issue_at() == 0


# ---------------------------------------------------------------- invariants


def test_ten_thousand_round_trips_are_bit_exact(rigs: list[Rig]) -> None:
    r = Rig(limit=16 * KiB, device=64 * KiB, host=256 * KiB)
    rigs.append(r)
    rng = random.Random(20240601)
    crc: dict[Block, int] = {}
    for _ in range(24):  # 24 blocks of up to 2 KiB in a 16 KiB limit: most live on the host
        size = rng.randrange(1, 2 * KiB)
        block = r.ex.malloc(size)
        data = rng.randbytes(size)
        r.op(block, write=data)
        crc[block] = zlib.crc32(data)
    mismatches = 0
    blocks = list(crc)
    while r.ex.swap_ins < 10_000:
        block = rng.choice(blocks)
        r.ex.swap_out(block)
        if rng.random() < 0.3:
            r.ex.prefetch(rng.choice(blocks))
        [seen] = r.op(block)
        mismatches += zlib.crc32(seen) != crc[block]
        if rng.random() < 0.1:  # rewrite it now and then
            data = rng.randbytes(block.size)
            r.op(block, write=data)
            crc[block] = zlib.crc32(data)
    assert mismatches == 0
    assert r.ex.swap_stats().peak_resident_bytes <= 16 * KiB


actions = st.lists(
    st.tuples(
        st.sampled_from(["malloc", "op", "write", "free", "out", "prefetch"]),
        st.integers(0, 1 << 16),
        st.lists(st.integers(0, 1 << 16), min_size=1, max_size=3),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(actions=actions, limit_kib=st.integers(3, 8))
def test_no_op_reads_a_non_resident_block_and_data_survives(
    actions: list[tuple[str, int, list[int]]], limit_kib: int
) -> None:
    r = Rig(limit=limit_kib * KiB, device=32 * KiB, host=128 * KiB)
    try:
        rng = random.Random(len(actions))
        data: dict[Block, bytes] = {}
        for kind, arg, picks in actions:
            live = list(data)
            if kind == "malloc" or not live:
                block = r.ex.malloc(1 + arg % (KiB + 100))
                data[block] = rng.randbytes(block.size)
                r.op(block, write=data[block])
            elif kind in ("op", "write"):
                chosen = list(dict.fromkeys(live[p % len(live)] for p in picks))
                write = rng.randbytes(chosen[0].size) if kind == "write" else None
                try:
                    seen = r.op(*chosen, write=write)  # asserts every block is resident
                except LeaseExceeded:  # more than the limit at once: refused, nothing changed
                    continue
                assert seen == [data[b] for b in chosen]
                if write is not None:
                    data[chosen[0]] = write
            elif kind == "free":
                block = live[arg % len(live)]
                r.ex.free(block)
                del data[block]
            elif kind == "out":
                r.ex.swap_out(live[arg % len(live)])
            else:
                r.ex.prefetch(live[arg % len(live)])
            resident = [e for e in r.ex._entries.values() if e.where != HOST]
            spans = sorted((e.offset, e.offset + e.block.size) for e in resident)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "device ranges overlap"
            assert r.ex.used_bytes <= limit_kib * KiB
        r.ex.synchronize()
        assert [r.op(b)[0] for b in data] == list(data.values())
    finally:
        r.ex.close()
