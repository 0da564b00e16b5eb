"""Stream ordering in the native hot path, against fake CUDA driver functions that log calls:
an allocation on a stream waits (on the GPU) for the streams that freed bytes since it last
waited, and only then; work on one stream never waits."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import pytest
from tidalclient.errors import InvalidBlock
from tidalclient.hotpath import (
    HotPath,
    NativeError,
    cuda_stream_functions,
    load,
    loaded_cuda_runtime,
    order_streams,
    stray_calls,
)

DEVICE = 43
BASE = 1 << 32
S1, S2, S3 = 0x5100, 0x5200, 0x5300

Create = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)
Record = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
Wait = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
Destroy = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class FakeDriver:
    """cuEventCreate/Record/StreamWaitEvent/EventDestroy that log and can be told to fail."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.fail_record = False
        self.gone: set[int] = set()  # streams whose calls fail (destroyed)
        self._next = 0xE000

        def create(event: ctypes._Pointer[ctypes.c_void_p], flags: int) -> int:
            self._next += 1
            event[0] = self._next
            self.calls.append(("create", self._next, flags))
            return 0

        def record(event: int, stream: int | None) -> int:
            self.calls.append(("record", event, stream or 0))
            return 700 if self.fail_record or (stream or 0) in self.gone else 0  # a CUresult

        def wait(stream: int | None, event: int, flags: int) -> int:
            self.calls.append(("wait", stream or 0, event))
            return 400 if (stream or 0) in self.gone else 0

        def destroy(event: int) -> int:
            self.calls.append(("destroy", event))
            return 0

        self.functions = (Create(create), Record(record), Wait(wait), Destroy(destroy))

    def addresses(self) -> tuple[int, int, int, int]:
        a = [ctypes.cast(f, ctypes.c_void_p).value for f in self.functions]
        return (int(a[0] or 0), int(a[1] or 0), int(a[2] or 0), int(a[3] or 0))

    def take(self) -> list[tuple[object, ...]]:
        calls, self.calls = self.calls, []
        return calls


@pytest.fixture
def driver() -> Iterator[FakeDriver]:
    fake = FakeDriver()
    order_streams(fake.addresses())
    HotPath(DEVICE).configure(BASE, 1 << 20)
    yield fake
    HotPath(DEVICE).reset()
    order_streams(None)


def test_one_stream_never_waits(driver: FakeDriver) -> None:
    hp = HotPath(DEVICE)
    for _ in range(50):
        blocks = [hp.alloc(4096, S1) for _ in range(4)]
        for b in blocks:
            assert b is not None
            hp.free(b)
    s = hp.stats()
    assert (s.streams, s.cross_stream, s.stream_waits) == (1, 0, 0)
    assert driver.take() == []


def test_an_allocation_after_another_streams_free_waits_for_that_stream(
    driver: FakeDriver,
) -> None:
    hp = HotPath(DEVICE)
    a = hp.alloc(4096, S1)
    assert a is not None
    hp.free(a)  # S1's queued work may still use these bytes
    b = hp.alloc(4096, S2)
    assert b == a  # best-fit reuses them...
    ((_, event, flags), *rest) = driver.take()  # ...after S2 waits for S1's work so far
    assert flags == 0x2  # CU_EVENT_DISABLE_TIMING
    assert rest == [("record", event, S1), ("wait", S2, event)]
    assert hp.alloc(4096, S2) is not None  # nothing freed since: no wait
    assert hp.alloc(4096, S1) is not None  # S2 freed nothing: S1 owes nothing
    assert driver.take() == []
    hp.free(b)
    assert hp.alloc(4096, S1) is not None
    ((_, event2, _), *rest) = driver.take()  # S2's event is created once, on first need
    assert rest == [("record", event2, S2), ("wait", S1, event2)]
    c = hp.alloc(4096, S1)
    assert c is not None
    hp.free(c)
    assert hp.alloc(4096, S2) is not None
    assert driver.take() == [("record", event, S1), ("wait", S2, event)]  # S1's event again
    s = hp.stats()
    assert (s.streams, s.cross_stream, s.stream_waits, s.stream_errors) == (2, 3, 3, 0)


def test_a_new_stream_waits_for_the_streams_that_have_freed(driver: FakeDriver) -> None:
    hp = HotPath(DEVICE)
    blocks = [hp.alloc(4096, stream) for stream in (S1, S2)]
    assert None not in blocks
    hp.free(blocks[0])  # S1 freed; S2 did not
    assert hp.alloc(4096, S3) is not None
    calls = driver.take()
    assert [c[0] for c in calls] == ["create", "record", "wait"]
    assert calls[1][2] == S1 and calls[2][1] == S3


def s2_waits_for_s1(hp: HotPath, driver: FakeDriver) -> list[int]:
    """S1 frees a block and S2 allocates, so S1's event is created: the events created."""
    a = hp.alloc(4096, S1)
    assert a is not None
    hp.free(a)
    assert hp.alloc(4096, S2) is not None
    return [c[1] for c in driver.take() if c[0] == "create"]


def test_reset_destroys_the_events_it_created(driver: FakeDriver) -> None:
    hp = HotPath(DEVICE)
    created = s2_waits_for_s1(hp, driver)
    hp.reset()
    assert driver.take() == [("destroy", e) for e in created]
    hp.configure(BASE, 1 << 20)
    assert hp.stats().streams == 0


def test_events_are_destroyed_by_the_functions_that_created_them(driver: FakeDriver) -> None:
    hp = HotPath(DEVICE)
    created = s2_waits_for_s1(hp, driver)
    assert len(created) == 1
    order_streams(None)  # ordering off: the event must not leak
    hp.reset()
    assert driver.take() == [("destroy", created[0])]
    hp.configure(BASE, 1 << 20)
    other = FakeDriver()
    order_streams(driver.addresses())
    created = s2_waits_for_s1(hp, driver)
    order_streams(other.addresses())  # replaced: the first set still destroys its own events
    hp.reset()
    assert driver.take() == [("destroy", e) for e in created]
    assert other.take() == []
    hp.configure(BASE, 1 << 20)


def test_a_failed_driver_call_is_counted_and_the_allocation_still_served(
    driver: FakeDriver,
) -> None:
    hp = HotPath(DEVICE)
    a = hp.alloc(4096, S1)
    assert a is not None
    hp.free(a)
    driver.fail_record = True
    assert hp.alloc(4096, S2) is not None
    s = hp.stats()
    assert (s.cross_stream, s.stream_waits, s.stream_errors) == (1, 0, 1)
    driver.fail_record = False
    ((_, event, _), *_) = driver.take()  # the event was made before the record failed
    assert hp.alloc(4096, S2) is not None  # the failed wait is still owed: tried again
    assert driver.take() == [("record", event, S1), ("wait", S2, event)]
    s = hp.stats()
    assert (s.cross_stream, s.stream_waits, s.stream_errors) == (2, 1, 1)
    assert hp.alloc(4096, S2) is not None  # paid: no more waits
    assert driver.take() == []


def test_without_driver_functions_the_debt_is_only_counted() -> None:
    order_streams(None)
    hp = HotPath(DEVICE)
    hp.configure(BASE, 1 << 20)
    try:
        a = hp.alloc(4096, S1)
        assert a is not None
        hp.free(a)
        assert hp.alloc(4096, S2) is not None
        s = hp.stats()
        assert (s.streams, s.cross_stream, s.stream_waits) == (2, 1, 0)
    finally:
        hp.reset()


def test_while_sixteen_streams_hold_live_blocks_a_new_one_is_untracked(
    driver: FakeDriver,
) -> None:
    hp = HotPath(DEVICE)
    for k in range(18):
        assert hp.alloc(256, 0x9000 + k) is not None
    s = hp.stats()
    assert (s.streams, s.untracked_stream, s.streams_recycled) == (16, 2, 0)


def _fill(hp: HotPath, first: int, count: int) -> list[int]:
    """A live block on each of `count` new streams from `first` (kept: their slots are named)."""
    blocks = [hp.alloc(256, first + k) for k in range(count)]
    assert None not in blocks
    return [b for b in blocks if b is not None]


def test_a_new_stream_takes_the_slot_of_one_with_no_live_block_and_its_debts_pass_to_the_fence(
    driver: FakeDriver,
) -> None:
    hp = HotPath(DEVICE)
    x = hp.alloc(4096, S1)  # slot 0
    k = hp.alloc(4096, S2)  # slot 1, kept live
    assert x is not None and k is not None
    _fill(hp, 0x9000, 14)  # slots 2..15, kept live
    hp.free(x)  # S1 freed: every stream owes S1; S1 names no live block
    assert driver.take() == []
    n = hp.alloc(4096, S3)  # the table is full: S3 takes S1's slot
    assert n is not None
    fence = driver.calls[0][1]
    assert driver.take() == [
        ("create", fence, 0x2),
        ("record", fence, S1),  # the fence covers S1's work so far...
        ("wait", S3, fence),  # ...which the new stream waits for (it may reuse S1's bytes)
    ]
    assert hp.alloc(4096, S2) is not None  # S2 owed S1: it now owes the fence, once
    assert driver.take() == [("wait", S2, fence)]
    assert hp.alloc(4096, S2) is not None
    assert driver.take() == []
    s = hp.stats()
    assert (s.streams, s.streams_recycled, s.untracked_stream, s.stream_errors) == (16, 1, 0, 0)

    hp.free(n)  # S3 now names no live block
    m = hp.alloc(4096, 0x5400)  # a second leaver: it first waits for the fence's last record
    assert m is not None
    calls = driver.take()
    assert calls[:2] == [("wait", S3, fence), ("record", fence, S3)]
    assert ("wait", 0x5400, fence) in calls[2:]  # the new stream owes the fence
    assert not any(c[0] == "record" and c[2] == S1 for c in calls)  # S1 is gone from the table
    assert hp.alloc(4096, S2) is not None  # the fence moved on: S2 waits on it again
    assert driver.take()[-1] == ("wait", S2, fence)
    assert hp.stats().streams_recycled == 2


def test_a_slot_whose_stream_the_driver_refuses_is_passed_over(driver: FakeDriver) -> None:
    hp = HotPath(DEVICE)
    for stream in (S1, S2):  # slots 0 and 1 name no live block
        a = hp.alloc(256, stream)
        assert a is not None
        hp.free(a)
    _fill(hp, 0x9000, 14)
    driver.gone.add(S1)  # destroyed: the fence cannot be recorded there
    driver.take()
    assert hp.alloc(256, S3) is not None
    calls = driver.take()
    fence = calls[0][1]
    assert calls[:4] == [
        ("create", fence, 0x2),
        ("record", fence, S1),  # refused: S1 keeps its slot
        ("wait", S2, fence),  # S2 leaves instead
        ("record", fence, S2),
    ]
    s = hp.stats()
    # Errors: the fence on S1, then S3's wait for S1's frees (still owed, tried again later).
    assert (s.streams_recycled, s.untracked_stream, s.stream_errors) == (1, 0, 2)


def test_a_stream_recorded_on_a_live_block_keeps_its_slot(driver: FakeDriver) -> None:
    hp = HotPath(DEVICE)
    kept = _fill(hp, 0x9000, 15)  # slots 0..14
    r = hp.alloc(256, S1)  # slot 15
    assert r is not None
    hp.free(r)  # S1 names no block of its own...
    hp.record_stream(kept[0], S1)  # ...but reads one of 0x9000's
    assert hp.alloc(256, S2) is not None  # no slot can go: S2 is untracked
    assert (hp.stats().untracked_stream, hp.stats().streams_recycled) == (1, 0)
    hp.free(kept[0])  # 0x9000 and S1 now name nothing
    assert hp.alloc(256, S3) is not None
    s = hp.stats()
    assert (s.untracked_stream, s.streams_recycled) == (1, 1)


def test_a_stream_slot_is_recycled_without_driver_functions_too() -> None:
    order_streams(None)
    hp = HotPath(DEVICE)
    hp.configure(BASE, 1 << 20)
    try:
        for k in range(40):  # a new stream each step, as with torch.cuda.Stream() in a loop
            a = hp.alloc(4096, 0x9000 + k)
            assert a is not None
            hp.free(a)
        s = hp.stats()
        assert (s.streams, s.streams_recycled, s.untracked_stream) == (16, 24, 0)
    finally:
        hp.reset()


def test_reset_destroys_the_fence_too(driver: FakeDriver) -> None:
    hp = HotPath(DEVICE)
    for k in range(17):
        a = hp.alloc(256, 0x9000 + k)
        assert a is not None
        hp.free(a)
    created = {c[1] for c in driver.take() if c[0] == "create"}
    assert len(created) == 17  # an event for each of the 16 freers, and the fence
    hp.reset()
    assert {c[1] for c in driver.take() if c[0] == "destroy"} == created


def test_order_streams_refuses_what_is_not_four_addresses() -> None:
    with pytest.raises(ValueError, match="four function addresses"):
        order_streams((1, 2, 3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="four function addresses"):
        order_streams((1, 2, 3, 0))


# -- record_stream: a block used by a second stream ------------------------------------------


def test_a_block_recorded_on_a_stream_makes_its_own_stream_wait_for_that_stream(
    driver: FakeDriver,
) -> None:
    hp = HotPath(DEVICE)
    a = hp.alloc(4096, S1)
    assert a is not None
    hp.record_stream(a, S2)  # S2's queued work reads the block too
    hp.free(a)
    b = hp.alloc(4096, S1)  # same stream as the block's own: without the record, no wait
    assert b == a
    ((_, event, _), *rest) = driver.take()
    assert rest == [("record", event, S2), ("wait", S1, event)]
    s = hp.stats()
    assert (s.stream_records, s.cross_stream, s.stream_waits) == (1, 1, 1)


def test_a_block_recorded_on_several_streams_makes_a_third_wait_for_all_of_them(
    driver: FakeDriver,
) -> None:
    hp = HotPath(DEVICE)
    a = hp.alloc(4096, S1)
    assert a is not None
    hp.record_stream(a, S2)
    hp.record_stream(a, S2)  # twice: one wait
    hp.record_stream(a, S1)  # its own stream: nothing more
    hp.free(a)
    assert hp.alloc(4096, S3) is not None
    calls = driver.take()
    waited = {c[2] for c in calls if c[0] == "record"}
    assert waited == {S1, S2}
    assert [c[1] for c in calls if c[0] == "wait"] == [S3, S3]
    assert hp.stats().stream_records == 3


def test_a_recorded_stream_does_not_wait_for_its_own_use(driver: FakeDriver) -> None:
    hp = HotPath(DEVICE)
    a = hp.alloc(4096, S1)
    assert a is not None
    hp.record_stream(a, S2)
    hp.free(a)
    assert hp.alloc(4096, S2) is not None  # S2 waits for S1 (its free), not for itself
    ((_, event, _), *rest) = driver.take()
    assert rest == [("record", event, S1), ("wait", S2, event)]


def test_the_record_is_forgotten_with_the_block(driver: FakeDriver) -> None:
    hp = HotPath(DEVICE)
    a = hp.alloc(4096, S1)
    assert a is not None
    hp.record_stream(a, S2)
    hp.free(a)
    assert hp.alloc(4096, S1) == a  # waits for S2 once
    driver.take()
    hp.free(a)
    assert hp.alloc(4096, S1) == a  # the new block was not recorded: no wait
    assert driver.take() == []


def test_recording_a_pointer_that_is_not_a_live_block_is_refused_and_counted(
    driver: FakeDriver,
) -> None:
    hp = HotPath(DEVICE)
    a = hp.alloc(4096, S1)
    assert a is not None
    with pytest.raises(InvalidBlock):
        hp.record_stream(a + 256, S2)  # inside the block, not its first byte
    hp.free(a)
    with pytest.raises(InvalidBlock):
        hp.record_stream(a, S2)  # freed
    with pytest.raises(InvalidBlock):
        hp.record_stream(BASE + (4 << 20), S2)  # outside the lease
    s = hp.stats()
    assert (s.stream_records, s.bad_frees, s.streams) == (0, 3, 1)
    hp.reset()
    with pytest.raises(NativeError, match="has no lease"):
        hp.record_stream(a, S2)
    hp.configure(BASE, 1 << 20)


def test_the_pytorch_entry_point_finds_the_device_by_the_pointer(driver: FakeDriver) -> None:
    other = HotPath(DEVICE + 1)
    other.configure(BASE + (1 << 30), 1 << 20)
    try:
        hp = HotPath(DEVICE)
        a = other.alloc(4096, S1)
        assert a is not None
        record = load().tidalpool_record_stream
        strays = stray_calls()
        record(a, S2)
        assert (other.stats().stream_records, hp.stats().stream_records) == (1, 0)
        record(BASE + (1 << 40), S2)  # in no lease
        assert stray_calls() == strays + 1
        other.free(a)
        assert other.alloc(4096, S1) == a
        assert [c[0] for c in driver.take()] == ["create", "record", "wait"]
    finally:
        other.reset()


def test_the_stream_functions_come_from_the_loaded_cuda_runtime(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 08:01 13 /opt/x/lib/libcudart.so.13\n"
    )
    assert loaded_cuda_runtime(str(maps)) == "/opt/x/lib/libcudart.so.13"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n")
    assert loaded_cuda_runtime(str(maps)) is None
    assert loaded_cuda_runtime(str(tmp_path / "absent")) is None


def test_with_pytorchs_runtime_loaded_its_functions_are_used() -> None:
    torch = pytest.importorskip("torch")
    runtime = loaded_cuda_runtime()
    if runtime is None or torch.version.cuda is None:
        pytest.skip("this PyTorch has no CUDA runtime")
    lib = ctypes.CDLL(runtime)
    names = ("cudaEventCreateWithFlags", "cudaEventRecord", "cudaStreamWaitEvent")
    expected = [ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names]
    assert list(cuda_stream_functions()[:3]) == expected
