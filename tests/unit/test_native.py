"""The native hot path on host numbers: exact offsets, plan hits and misses, bad input, and the
same decisions as the Python executor on arbitrary scripts and on real traces."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tidalclient.errors import InvalidBlock
from tidalclient.executors.bestfit import BestFit
from tidalclient.hotpath import (
    ALLOC_SYMBOL,
    FREE_SYMBOL,
    MAX_DEVICES,
    HotPath,
    NativeError,
    library_path,
    load,
    stray_calls,
)
from tidalclient.plans import PlanRejected, PlanTable
from tidalcore.units import align_up

from ..conftest import shared_file
from .native_twin import BASE, Twin, fresh, trace_plan
from .plan_scripts import SCRIPT, SLOTS, plans_of

KiB = 1024


@pytest.fixture
def hp() -> Iterator[HotPath]:
    yield from fresh(0)


def table(sizes: list[int], offsets: list[int], height: int, plan_id: int = 1) -> PlanTable:
    return PlanTable.build(plan_id, sizes, offsets, height, alignment=256)


def offsets_of(hp: HotPath, *sizes: int) -> list[int]:
    found = []
    for size in sizes:
        address = hp.alloc(size)
        assert address is not None
        found.append(address - BASE)
    return found


# ---------------------------------------------------------------- the library


def test_a_second_opening_by_path_shares_the_state_as_pytorch_would(hp: HotPath) -> None:
    """CUDAPluggableAllocator dlopens the file by path: it must see the lease set from Python."""
    hp.configure(BASE, 4 * KiB)
    other = ctypes.CDLL(str(library_path()))  # a separate dlopen of the same file
    alloc, free = getattr(other, ALLOC_SYMBOL), getattr(other, FREE_SYMBOL)
    alloc.restype, alloc.argtypes = (
        ctypes.c_void_p,
        [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p],
    )
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    address = alloc(1000, 0, None)
    assert address == BASE
    assert hp.stats().mallocs == 1
    free(address, 1000, 0, None)
    assert (hp.stats().frees, hp.free_ranges()) == (1, [(0, 4 * KiB)])


def test_the_library_depends_on_nothing_but_libc() -> None:
    if shutil.which("ldd") is None:
        pytest.skip("no ldd on this machine")
    out = subprocess.run(["ldd", str(library_path())], capture_output=True, text=True, check=True)
    needed = {line.split()[0] for line in out.stdout.splitlines() if "=>" in line}
    assert needed == {"libc.so.6"}, out.stdout


def test_the_sources_compile_warning_free(tmp_path: Path) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler on this machine")
    src = library_path().parent
    flags = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Wpedantic", "-Wshadow", "-Werror"]
    cmd = [compiler, *flags, "-shared", "-fPIC", "-o", str(tmp_path / "hotpath.so")]
    done = subprocess.run(
        [*cmd, str(src / "hotpath.c"), str(src / "bench.c")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------- online best-fit


def test_best_fit_exact_offsets_alignment_and_coalescing(hp: HotPath) -> None:
    hp.configure(BASE, 4 * KiB + 100)  # rounded down to 4 KiB
    assert hp.free_ranges() == [(0, 4 * KiB)]
    a, b, c, d = offsets_of(hp, 100, 256, 600, 256)
    assert [a, b, c, d] == [0, 256, 512, 1280]  # 600 takes 768 bytes
    hp.free(BASE + b)
    hp.free(BASE + d)  # merges with the free tail
    assert hp.free_ranges() == [(256, 256), (1280, 4 * KiB - 1280)]
    assert offsets_of(hp, 200) == [256]  # the smallest range that fits, not the first or last
    hp.free(BASE + 256)
    hp.free(BASE + c)  # merges on both sides: [256, 4096)
    assert hp.free_ranges() == [(256, 4 * KiB - 256)]
    hp.free(BASE + a)
    assert hp.free_ranges() == [(0, 4 * KiB)]
    s = hp.stats()
    assert (s.mallocs, s.frees, s.online) == (5, 5, 5)
    assert (s.live_blocks, s.live_bytes, s.used_bytes) == (0, 0, 0)
    assert (s.peak_live_bytes, s.largest_free, s.free_ranges) == (100 + 256 + 600 + 256, 4096, 1)


def test_ties_go_to_the_lowest_offset(hp: HotPath) -> None:
    hp.configure(BASE, 8 * KiB)
    blocks = offsets_of(hp, *[256] * 8)
    for offset in (blocks[5], blocks[1], blocks[3]):  # three 256-byte holes, freed out of order
        hp.free(BASE + offset)
    assert offsets_of(hp, 256, 256, 256) == [256, 768, 1280]


def test_a_real_mmap_address_works_as_a_base(hp: HotPath) -> None:
    with mmap.mmap(-1, 64 * KiB) as region:
        buf = (ctypes.c_char * len(region)).from_buffer(region)
        base = ctypes.addressof(buf)
        hp.configure(base, len(region), alignment=4096)
        first, second = hp.alloc(5000), hp.alloc(1)
        assert (first, second) == (base, base + 8192)
        hp.reset()
        del buf


def test_exhaustion_is_none_and_counted_until_room_returns(hp: HotPath) -> None:
    hp.configure(BASE, 4 * KiB)
    assert hp.alloc(4 * KiB + 1) is None
    blocks = [hp.alloc(KiB) for _ in range(4)]
    assert hp.alloc(1) is None
    assert hp.stats().failures == 2
    hp.free(blocks[2] or 0)
    assert hp.alloc(KiB) == blocks[2]
    assert hp.stats().failures == 2


def test_thousands_of_live_blocks_grow_the_table_and_free_in_any_order(hp: HotPath) -> None:
    """3,000 blocks of 1 MiB (offsets with many zero low bits) outgrow the first table twice;
    freed in a shuffled order, each is found once and the lease coalesces back to one range."""
    hp.configure(BASE, 4 << 30)
    addresses = [hp.alloc(1 << 20) for _ in range(3000)]
    assert addresses == [BASE + k * (1 << 20) for k in range(3000)]
    order = list(range(3000))
    random.Random(7).shuffle(order)
    for k in order:
        hp.free(addresses[k] or 0)
    s = hp.stats()
    assert (s.frees, s.bad_frees, s.live_blocks) == (3000, 0, 0)
    assert hp.free_ranges() == [(0, 4 << 30)]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.integers(1, 3000)),
            st.tuples(st.just("free"), st.integers(0, 1000)),
        ),
        max_size=120,
    ),
    st.sampled_from([1, 64, 256, 4096]),
)
def test_best_fit_against_a_model(script: list[tuple[str, int]], alignment: int) -> None:
    """No two live blocks overlap, all lie in the lease and are aligned, the free ranges are
    exactly the lease minus the live blocks (never touching: coalesced), offsets are those of
    the Python BestFit, and freeing everything returns one range of the whole capacity."""
    hp = next(fresh(1))
    capacity = 16 * KiB
    hp.configure(BASE, capacity, alignment=alignment)
    model = BestFit(capacity, alignment)
    live: list[tuple[int, int]] = []  # (address, size)
    for action, arg in script:
        if action == "alloc":
            address, expected = hp.alloc(arg), model.allocate(arg)
            assert (None if address is None else address - BASE) == expected
            if address is not None:
                live.append((address, arg))
        elif live:
            address, _ = live.pop(arg % len(live))
            hp.free(address)
            model.release(address - BASE)
        spans = sorted((a - BASE, a - BASE + align_up(s, alignment)) for a, s in live)
        assert all(start % alignment == 0 for start, _ in spans)
        free = [(o, o + n) for o, n in hp.free_ranges()]
        for (_, end), (start, _) in itertools.pairwise(free):
            assert end < start, f"free ranges touch (not coalesced): {free}"
        tiles = sorted(free + spans)  # live and free tile the lease: no overlap, no hole
        assert all(start < end for start, end in tiles)
        assert [start for start, _ in tiles] == [0] + [end for _, end in tiles[:-1]], tiles
        assert tiles[-1][1] == capacity
    for address, _ in live:
        hp.free(address)
    assert hp.free_ranges() == [(0, capacity)]
    assert hp.stats().live_bytes == 0
    hp.reset()


# ---------------------------------------------------------------- planned mode


def planned(hp: HotPath) -> int:
    """A 4 KiB lease, a 256-byte block at 0, and a 3-slot plan in use (its region at 256).

    slot 0: [0, 512)  slot 1: [512, 768)  slot 2: [0, 512), shares slot 0's bytes."""
    hp.configure(BASE, 4 * KiB, max_iteration_misses=8)
    weights = hp.alloc(256)
    assert weights == BASE
    hp.install_plan(table([512, 256, 512], [0, 512, 0], 768, plan_id=7))
    assert not hp.stats().planned
    assert hp.step() == 1
    s = hp.stats()
    assert (s.planned, s.plan_id, s.used_bytes) == (True, 7, 256 + 768)
    return weights


def test_plan_hits_take_the_planned_offsets_every_iteration(hp: HotPath) -> None:
    planned(hp)
    a, b = offsets_of(hp, 512, 256)
    hp.free(BASE + a)
    (c,) = offsets_of(hp, 512)
    assert [a, b, c] == [256, 256 + 512, 256]
    hp.free(BASE + b)
    hp.free(BASE + c)
    assert hp.step() == 2  # the allocation index starts again
    assert offsets_of(hp, 512, 256) == [256, 768]
    s = hp.stats()
    assert (s.hits, s.misses, s.online, s.iteration) == (5, 0, 1, 2)


def test_a_slot_whose_bytes_a_live_block_holds_is_a_miss(hp: HotPath) -> None:
    planned(hp)
    a, _ = offsets_of(hp, 512, 256)
    (late,) = offsets_of(hp, 512)  # slot 2 shares slot 0's bytes, and a is still live
    assert late == 256 + 768  # online, above the region
    assert (hp.stats().hits, hp.stats().misses) == (2, 1)
    hp.free(BASE + a)
    events = hp.drain()
    assert events["slot"][-4:].tolist() == [0, 1, -1, 0]  # the hits' slots; the miss is online


def test_a_block_left_from_the_last_iteration_blocks_its_slot(hp: HotPath) -> None:
    planned(hp)
    a, b = offsets_of(hp, 512, 256)
    hp.free(BASE + a)
    hp.step()  # b (slot 1) crosses the boundary
    assert offsets_of(hp, 512, 256) == [256, 1024]  # slot 1 is still held: a miss
    hp.free(BASE + b)
    assert (hp.stats().hits, hp.stats().misses) == (3, 1)


def test_size_and_order_divergence_are_misses(hp: HotPath) -> None:
    planned(hp)
    assert offsets_of(hp, 300) == [256 + 768]  # slot 0 is 512 bytes
    assert offsets_of(hp, 256) == [768]  # slot 1 still matches
    assert offsets_of(hp, 1024) == [256 + 768 + 512]  # slot 2 is 512 bytes
    assert offsets_of(hp, 512) == [256 + 768 + 512 + 1024]  # past the plan's end
    assert (hp.stats().hits, hp.stats().misses) == (1, 3)


def test_too_many_misses_fall_back_and_the_region_drains(hp: HotPath) -> None:
    hp.configure(BASE, 4 * KiB, max_iteration_misses=1)
    hp.alloc(256)
    hp.install_plan(table([512, 256, 512], [0, 512, 0], 768))
    hp.step()
    kept = hp.alloc(512)  # a hit, still live when the plan is abandoned
    misses = [hp.alloc(100), hp.alloc(100)]
    hp.step()
    s = hp.stats()
    assert (s.planned, s.fallbacks, s.plan_id) == (False, 1, 1)
    assert offsets_of(hp, 512) == [256 + 768 + 512]  # online now, not a miss
    for address in misses:
        hp.free(address or 0)
    hp.free(kept or 0)  # the last planned block: the region goes back to best-fit
    assert hp.stats().plan_id == 0
    assert offsets_of(hp, 768) == [256]
    assert (hp.stats().hits, hp.stats().misses) == (1, 2)


def test_a_plan_waits_for_room_for_its_region(hp: HotPath) -> None:
    hp.configure(BASE, KiB)
    filler = hp.alloc(768)
    hp.install_plan(table([512], [0], 512))
    hp.step()
    assert not hp.stats().planned
    hp.free(filler or 0)
    hp.step()
    assert hp.stats().planned
    assert hp.alloc(512) == BASE


def test_a_new_plan_takes_over_once_the_old_holds_no_block(hp: HotPath) -> None:
    planned(hp)
    a = hp.alloc(512)
    hp.install_plan(table([256], [0], 256, plan_id=8))
    hp.step()  # a holds slot 0 of plan 7: plan 7 stays
    assert hp.stats().plan_id == 7
    assert offsets_of(hp, 512) == [256 + 768]  # slot 0 held by a: a miss
    hp.free(a or 0)
    hp.step()
    assert hp.stats().plan_id == 8
    assert offsets_of(hp, 256) == [256]  # plan 8's region where plan 7's was


def test_an_empty_plan_serves_nothing_and_misses_everything(hp: HotPath) -> None:
    hp.configure(BASE, KiB)
    hp.install_plan(PlanTable.build(3, [], [], 0, 256))
    hp.step()
    assert offsets_of(hp, 10) == [0]
    s = hp.stats()
    assert (s.planned, s.plan_id, s.hits, s.misses) == (True, 3, 0, 1)


def test_the_native_conflict_sets_do_not_trust_the_caller(hp: HotPath) -> None:
    """Slots that share bytes under the lease's alignment conflict even if the caller's table
    (built for a finer alignment) says they do not."""
    hp.configure(BASE, 4 * KiB, alignment=256)
    fine = PlanTable.build(1, [100, 100], [0, 128], 256, alignment=128)
    with pytest.raises(PlanRejected, match="misaligned for this lease"):
        hp.install_plan(fine)
    same = PlanTable.build(2, [300, 256], [0, 256], 768, alignment=256)  # [0, 512) and [256, 512)
    hp.install_plan(same)
    hp.step()
    first, second = offsets_of(hp, 300, 256)
    assert (first, second) == (0, 768)  # the second slot is held by the first's rounded bytes
    assert (hp.stats().hits, hp.stats().misses) == (1, 1)


@pytest.mark.parametrize("seed", range(3))
def test_a_hit_is_exactly_a_slot_no_live_block_shares_bytes_with(hp: HotPath, seed: int) -> None:
    """Plans of 5,000 slots (three levels of the library's bitmap of held slots) followed with
    wrong sizes, frees in any order and blocks kept across steps: each allocation must be a
    hit exactly when it has its slot's size and no live planned block shares a byte of the
    slot, judged here against every live block. One slot in 250 is up to 2 MiB long and
    shares bytes with slots up to a thousand places above it in offset order."""
    rng = random.Random(seed)
    n, height = 5000, 8 << 20
    sizes, offsets = [], []
    for i in range(n):
        size = rng.randrange(256, 2 << 20) if i % 250 == 0 else rng.randrange(1, 16 * KiB)
        sizes.append(size)
        offsets.append(rng.randrange(0, (height - align_up(size, 256)) // 256 + 1) * 256)
    plan = table(sizes, offsets, height)
    hp.configure(BASE, 4 * height, max_iteration_misses=n)
    hp.install_plan(plan)
    live: dict[int, tuple[int, int] | None] = {}  # address -> planned span, None when online
    hits = blocked = wrong_size = 0
    for _ in range(3):
        hp.step()
        for i in range(n):
            size = sizes[i] + 256 * (rng.random() < 0.05)
            start, end = offsets[i], offsets[i] + align_up(sizes[i], 256)
            hit = size == sizes[i] and all(
                span is None or span[1] <= start or end <= span[0] for span in live.values()
            )
            address = hp.alloc(size)
            assert address is not None
            assert (address - BASE == start) if hit else (address - BASE >= height), (i, hit)
            live[address] = (start, end) if hit else None
            hits += hit
            wrong_size += size != sizes[i]
            blocked += size == sizes[i] and not hit
            while len(live) > rng.randrange(100):  # about 50 live blocks
                gone = rng.choice(list(live))
                hp.free(gone)
                del live[gone]
        for address in rng.sample(list(live), len(live) // 2):  # the rest cross the step
            hp.free(address)
            del live[address]
    s = hp.stats()
    assert (s.hits, s.misses, s.fallbacks) == (hits, blocked + wrong_size, 0)
    assert min(blocked, wrong_size) > n // 10  # about 1,200 and 750 of each kind of miss


# ---------------------------------------------------------------- bad input


def test_bad_input_to_the_c_functions_is_null_and_counted(hp: HotPath) -> None:
    lib = load()
    assert lib.tidalpool_alloc(100, 0, None) is None  # no lease yet
    assert hp.stats().failures == 1
    hp.configure(BASE, 4 * KiB)  # counters restart
    for size in (0, 0):
        assert lib.tidalpool_alloc(size, 0, None) is None
    for size in (4 * KiB + 1, 2**63, 2**64 - 1, 2**64 - 255):
        assert lib.tidalpool_alloc(size, 0, None) is None
    block = lib.tidalpool_alloc(100, 0, None)
    lib.tidalpool_free(block, 100, 0, None)
    lib.tidalpool_free(block, 100, 0, None)  # double free
    lib.tidalpool_free(BASE + 4 * KiB, 1, 0, None)  # beyond the lease
    lib.tidalpool_free(BASE - 256, 1, 0, None)  # before it
    lib.tidalpool_free(1, 1, 0, None)
    kept = lib.tidalpool_alloc(1000, 0, None)
    lib.tidalpool_free(kept + 256, 1, 0, None)  # inside a live block, not its start
    lib.tidalpool_free(None, 0, 0, None)  # NULL: ignored, as free(NULL)
    s = hp.stats()
    assert (s.failures, s.zero_allocs, s.bad_frees) == (4, 2, 5)
    assert (s.mallocs, s.frees, s.live_blocks, s.live_bytes) == (2, 1, 1, 1000)
    assert hp.free_ranges() == [(1024, 3 * KiB)]
    before = stray_calls()
    for device in (-1, MAX_DEVICES, 2**31 - 1):
        assert lib.tidalpool_alloc(100, device, None) is None
        lib.tidalpool_free(kept, 100, device, None)
    assert stray_calls() == before + 6
    assert hp.stats().live_blocks == 1  # nothing touched by the stray frees


@pytest.mark.parametrize(
    ("base", "capacity", "alignment"),
    [
        (0, 4096, 256),
        (BASE + 128, 4096, 256),
        (BASE, 4096, 3),
        (BASE, 4096, 0),
        (2**64 - 256, 512, 256),
    ],
)
def test_the_c_configure_rejects_bad_leases(
    hp: HotPath, base: int, capacity: int, alignment: int
) -> None:
    assert load().tidalpool_configure(0, base, capacity, alignment, 16, 8, 0) == -2  # EINVAL
    assert load().tidalpool_alloc(1, 0, None) is None


def test_the_c_configure_rejects_unknown_flags(hp: HotPath) -> None:
    assert load().tidalpool_configure(0, BASE, 4096, 256, 16, 8, 2) == -2
    assert load().tidalpool_configure(0, BASE, 4096, 256, 16, 8, 1) == 0  # NO_TIMESTAMPS


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"base": 0}, ValueError, "lease base 0x0 must be non-zero and 256-aligned"),
        ({"base": BASE + 1}, ValueError, "must be non-zero and 256-aligned"),
        ({"alignment": 96}, ValueError, "alignment must be a power of two, got 96"),
        ({"capacity": -1}, ValueError, "lease capacity -1"),
        ({"capacity": 2**64}, ValueError, "beyond the address space"),
        ({"ring_events": 1}, ValueError, r"ring_events must be in \[2, 2\*\*32\], got 1"),
        ({"max_iteration_misses": -1}, ValueError, "max_iteration_misses must be in"),
        ({"capacity": 4096.0}, TypeError, "capacity must be an int, got float"),
        ({"base": True}, TypeError, "base must be an int, got bool"),
    ],
)
def test_configure_names_what_is_wrong(
    hp: HotPath, kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    args: dict[str, object] = {"base": BASE, "capacity": 4096, **kwargs}
    with pytest.raises(error, match=message):
        hp.configure(**args)  # type: ignore[arg-type]


def test_python_side_errors_name_the_problem(hp: HotPath) -> None:
    with pytest.raises(ValueError, match=r"device 64 is out of range \[0, 64\)"):
        HotPath(MAX_DEVICES)
    with pytest.raises(NativeError, match="step: device 0 has no lease"):
        hp.step()
    with pytest.raises(NativeError, match="install plan 1: device 0 has no lease"):
        hp.install_plan(table([256], [0], 256))
    hp.configure(BASE, 4 * KiB)
    for size, error in ((0, ValueError), (-5, ValueError), (2**64, ValueError), (1.5, TypeError)):
        with pytest.raises(error):
            hp.alloc(size)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="allocation size must be an int, got bool"):
        hp.alloc(True)
    address = hp.alloc(100)
    assert address is not None
    with pytest.raises(NativeError, match="configure: device 0 is busy"):
        hp.configure(BASE, 8 * KiB)
    with pytest.raises(PlanRejected, match=r"plan 5: .* height 8192 exceeds the lease"):
        hp.install_plan(table([256], [0], 8 * KiB, plan_id=5))
    hp.free(address)
    with pytest.raises(InvalidBlock, match=f"{address:#x} is not a live block on device 0"):
        hp.free(address)
    with pytest.raises(TypeError, match="address must be an int, got str"):
        hp.free("0x10")  # type: ignore[arg-type]
    assert hp.stats().bad_frees == 1
    hp.configure(BASE, 8 * KiB)  # nothing live now: a new lease
    assert hp.stats().mallocs == 0


# ---------------------------------------------------------------- the same decisions as Python


@settings(max_examples=200, deadline=None)
@given(slots=SLOTS, script=SCRIPT, max_misses=st.integers(0, 3))
def test_every_decision_is_the_python_executors(
    slots: list[tuple[int, int]], script: list[tuple[str, int]], max_misses: int
) -> None:
    """Arbitrary plans (slots may overlap in time: the plan is not trusted) and arbitrary
    divergence from them: the same offsets, hits, misses, fallbacks and free ranges as the
    Python executor, so the native path inherits its no-overlap guarantee; checked too."""
    hp = next(fresh(2))
    plan, replan = plans_of(slots)
    sizes = plan.sizes
    twin = Twin(hp, 16 * KiB, max_misses)
    twin.install(plan)
    keys = itertools.count()
    cursor = 0
    for action, arg in script:
        if action == "plan_size":
            twin.malloc(next(keys), sizes[(cursor + arg % 2) % len(sizes)])
            cursor += 1
        elif action == "size":
            twin.malloc(next(keys), arg)
        elif action == "free" and twin.live:
            twin.free(list(twin.live)[arg % len(twin.live)])
        elif action == "step":
            twin.step()
            cursor = 0
        elif action == "replan":
            twin.install(replan)
        spans = sorted((a - BASE, a - BASE + align_up(b.size, 256)) for b, a in twin.live.values())
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, f"overlap in {spans}"
    twin.compare_ranges()
    hp.reset()


@pytest.mark.parametrize("perturb", [False, True], ids=["as recorded", "perturbed"])
@pytest.mark.parametrize("model", ["resnet50.b32", "gpt2.b4"])
def test_a_real_trace_gets_the_python_executors_decisions(
    hp: HotPath, model: str, perturb: bool
) -> None:
    """The trace's events through both, the daemon's plan installed before iteration 1: the
    same offset for every allocation. Perturbed: every 40th allocation of iterations 1 and 2
    is 512 bytes larger: exactly those miss (placed online, they hold no slot's bytes), and
    after iteration 1's misses (more than 8) both abandon the plan for iteration 2."""
    plan, script = trace_plan(shared_file(f"traces/models/{model}.trace.csv"))
    peak = max(itertools.accumulate(s if k == "alloc" else -s for k, _, s in script if k != "iter"))
    twin = Twin(hp, 2 * peak)
    iteration, allocs, grown_in_1 = -1, 0, 0
    for kind, block, size in script:
        if kind == "iter":
            iteration = block
            if iteration == 1:
                twin.install(plan)
            twin.step()
        elif kind == "alloc":
            allocs += 1
            grown = perturb and iteration >= 1 and allocs % 40 == 0
            grown_in_1 += grown and iteration == 1
            twin.malloc(block, size + 512 * grown)
        else:
            twin.free(block)
    twin.compare_ranges()
    s, n = hp.stats(), len(plan.sizes)
    assert s.failures == 0 and None not in twin.offsets
    if perturb:
        assert (s.misses, s.hits, s.fallbacks) == (grown_in_1, n - grown_in_1, 1)
        assert grown_in_1 > 8
    else:
        assert (s.hits, s.misses, s.fallbacks) == (2 * n, 0, 0)


def test_the_native_executor_refuses_a_plan_it_could_not_execute_whole(hp: HotPath) -> None:
    """A plan that swaps is executed whole or not at all: the allocator cannot move the
    framework's tensors, so it refuses it, and its placement is not half-used."""
    from tidalclient.executors.native import NativeExecutor
    from tidalclient.plans import Plan
    from tidalcore.planupdate import ScheduledSwap

    ex = NativeExecutor(hp, BASE, KiB)
    try:
        placed = table([512, 256], [0, 512], 768, plan_id=4)
        swapping = Plan(placed, (ScheduledSwap(block=0, out_after=0, in_before=2),), (0,))
        with pytest.raises(PlanRejected, match="swaps or recomputes"):
            ex.install_plan(swapping)
        ex.install_plan(Plan(placed))
        ex.step()
        assert hp.stats().plan_id == 4
    finally:
        ex.close()


def test_python_code_allocates_through_the_native_table(hp: HotPath) -> None:
    """A native session's `malloc` takes the hot path the framework takes: its block is in
    the same table and the same trace, under the id the trace gives it."""
    from tidalclient.errors import LeaseExceeded
    from tidalclient.executors.base import Block
    from tidalclient.executors.native import NativeExecutor
    from tidalcore.events import ALLOC, FREE

    ex = NativeExecutor(hp, BASE, 4 * KiB)
    try:
        framework = hp.alloc(1000)  # the framework's, through the C entry point
        block = ex.malloc(300)
        assert framework is not None and block.offset == align_up(1000, 256)
        assert (ex.offset(block), hp.block_id(BASE + block.offset)) == (block.offset, block.id)
        assert ex.try_malloc(4 * KiB) is None
        full = r"malloc of 4 KiB \(4096 bytes\) does not fit now: 1\.3 KiB"
        with pytest.raises(LeaseExceeded, match=full):
            ex.malloc(4 * KiB)
        foreign = Block(block.id, block.offset, block.size, session=-1)
        with pytest.raises(InvalidBlock, match="belongs to another session"):
            ex.free(foreign)
        ex.free(block)
        with pytest.raises(InvalidBlock, match="not a live block"):
            ex.free(block)
        events = hp.drain()
        kinds, ids = events["kind"].tolist(), events["block"].tolist()
        assert list(zip(kinds, ids, strict=True)) == [
            (ALLOC, hp.stats().mallocs - 1),
            (ALLOC, block.id),
            (FREE, block.id),
        ]
        assert (hp.stats().live_blocks, hp.stats().bad_frees) == (1, 1)
        hp.free(framework)
    finally:
        ex.close()
