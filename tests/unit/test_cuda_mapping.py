"""The cuda backend's client half against the fake driver: mapping a lease, streams and events,
and the CuPy allocator (with a stand-in CuPy module)."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from tidalclient.devices.cuda import (
    CudaDeviceMapping,
    CudaStream,
    IpcDeviceMapping,
    swap_streams,
)
from tidalclient.devices.streams import StreamError
from tidalclient.errors import InvalidBlock, SessionClosed
from tidalclient.executors.base import Block, ExecutorStats, SwapStats
from tidalclient.executors.python import PythonExecutor
from tidalcore.chunks import PinnedChunkMapping
from tidalcore.cuda_driver import CudaError, DevicePtr, MemHandle

from tests.unit.fake_cuda import FakeDriver

KiB = 1024
GRAN = 64 * KiB
C = 2 * GRAN


def pool(fake: FakeDriver, n: int) -> list[tuple[MemHandle, int]]:
    """What the daemon holds: n exportable chunks, each filled with its index + 1."""
    fake.open_device(0)
    chunks = []
    for k in range(n):
        handle = fake.mem_create(C, exportable=True)
        fake.handles[handle].data[:] = bytes([k + 1]) * C
        chunks.append((handle, fake.mem_export_fd(handle)))
    return chunks


def host_buffer(n: int) -> tuple[Any, int]:
    buf = ctypes.create_string_buffer(n)
    return buf, ctypes.addressof(buf)


# -- vmm device mapping ---------------------------------------------------------------------


def test_lease_chunks_are_mapped_contiguously_in_lease_order() -> None:
    fake = FakeDriver(granularity=GRAN)
    chunks = pool(fake, 4)
    fake.calls.clear()
    lease = [chunks[3][1], chunks[1][1]]
    m = CudaDeviceMapping(fake, lease, C, GRAN)
    assert m.length == 2 * C
    names = fake.names()
    assert names == ["address_reserve", "mem_import_fd", "mem_map"] * 1 + [
        "mem_import_fd",
        "mem_map",
        "set_access",
    ]
    maps = [c for c in fake.calls if c[0] == "mem_map"]
    assert [c[1] for c in maps] == [m.address, m.address + C]
    assert fake.calls[-1] == ("set_access", m.address, 2 * C)
    assert m.read(0, 3) == b"\x04\x04\x04" and m.read(C, 3) == b"\x02\x02\x02"
    m.write(C + 5, b"hi")
    assert bytes(fake.handles[chunks[1][0]].data[5:7]) == b"hi"
    # the range reaches the lease's chunks and nothing else
    reachable = {id(mp.phys) for base, mp in fake.mappings.items() if base >= m.address}
    assert reachable == {id(fake.handles[chunks[3][0]]), id(fake.handles[chunks[1][0]])}
    with pytest.raises(ValueError, match="outside the lease"):
        m.read(2 * C - 1, 2)


def test_retire_releases_the_chunks_and_leaves_a_harmless_range() -> None:
    fake = FakeDriver(granularity=GRAN)
    chunks = pool(fake, 2)
    m = CudaDeviceMapping(fake, [chunks[0][1], chunks[1][1]], C, GRAN)
    imported = {c[2] for c in fake.calls if c[0] == "mem_import_fd"}
    fake.calls.clear()
    m.retire()
    names = fake.names()
    assert names[:4] == ["mem_unmap", "mem_unmap", "mem_release", "mem_release"]
    assert [c[1] for c in fake.calls[:2]] == [m.address + C, m.address]  # last chunk first
    assert len(imported) == 2 and not imported & set(fake.handles)  # the imports are gone
    assert fake.names()[4] == "mem_create"  # one scratch granule, mapped over the whole range
    assert fake.names().count("mem_map") == 2 * C // GRAN
    # a stale pointer reads zeros and writes reach only the scratch allocation
    assert fake.read(m.address, 2 * C) == bytes(2 * C)
    fake.write(m.address + 10, b"stale")
    assert bytes(fake.handles[chunks[0][0]].data[10:15]) == b"\x01" * 5
    m.retire()  # idempotent
    m.close()
    assert not fake.reserved and len(fake.handles) == 2
    assert not any(base >= m.address for base in fake.mappings)


def test_retire_keeps_what_the_job_holds_at_its_address_in_private_memory() -> None:
    """Arrays the job still holds when its session ends (a checkpoint written after the
    daemon died): their bytes stay at their addresses, in granules of this process's own,
    and every other granule is the zeroed scratch."""
    fake = FakeDriver(granularity=GRAN)
    chunks = pool(fake, 2)
    m = CudaDeviceMapping(fake, [chunks[0][1], chunks[1][1]], C, GRAN)
    data = bytes(range(256)) * (GRAN // 128)  # 2 GRAN bytes
    m.write(GRAN + 5, data[:GRAN])  # one array over granules 1 and 2
    m.retire(keep=[(GRAN + 5, m.read(GRAN + 5, GRAN)), (0, b"")])
    assert fake.read(m.address + GRAN + 5, GRAN) == data[:GRAN]  # kept, not zeros
    assert fake.read(m.address + GRAN, 5) == bytes(5)  # the rest of its granules: zeros
    assert fake.read(m.address, GRAN) == bytes(GRAN)  # the scratch
    assert fake.read(m.address + 3 * GRAN, GRAN) == bytes(GRAN)
    fake.write(m.address + 3, b"stale")  # a stale write lands in the scratch, not the array
    assert fake.read(m.address + GRAN + 5, GRAN) == data[:GRAN]
    assert fake.names().count("mem_create") - 2 == 1 + 2  # the pool's two, scratch, two own
    pool_memory = {id(fake.handles[c[0]]) for c in chunks}
    assert not pool_memory & {id(mapping.phys) for mapping in fake.mappings.values()}
    m.close()
    assert set(fake.handles) == {c[0] for c in chunks}  # what retire made is released
    assert not fake.reserved


def test_an_ipc_lease_cannot_keep_arrays_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeDriver(granularity=GRAN)
    fake.open_device(0)
    handle = fake.ipc_get_handle(fake.mem_alloc(4 * C))
    client = FakeDriver(granularity=GRAN, peer=fake)
    client.open_device(0)
    m = IpcDeviceMapping(client, handle, C, C)
    with caplog.at_level("WARNING", logger="tidalpool"):
        m.retire(keep=[(0, m.read(0, 100)), (200, m.read(200, 28))])
    assert "2 arrays of 128 bytes in all are still alive" in caplog.text
    assert "ipc" in caplog.text and "faults" in caplog.text


def test_a_failed_import_leaves_nothing_behind() -> None:
    fake = FakeDriver(granularity=GRAN)
    chunks = pool(fake, 2)
    reserved, handles = dict(fake.reserved), set(fake.handles)
    closed = chunks[1][1]
    os.close(closed)
    with pytest.raises(CudaError, match="cuMemImportFromShareableHandle failed"):
        CudaDeviceMapping(fake, [chunks[0][1], closed], C, GRAN)
    assert fake.reserved == reserved and set(fake.handles) == handles
    assert fake.names()[-3:] == ["mem_unmap", "mem_release", "address_free"]


def test_chunk_must_be_whole_granules() -> None:
    with pytest.raises(ValueError, match="not a multiple of 65536"):
        CudaDeviceMapping(FakeDriver(granularity=GRAN), [3], 96 * KiB, GRAN)


def test_the_fake_refuses_wrong_call_orders() -> None:
    fake = FakeDriver(granularity=GRAN)
    fake.open_device(0)
    handle = fake.mem_create(C, exportable=True)
    with pytest.raises(CudaError, match="cuMemMap failed: CUDA_ERROR_INVALID_VALUE"):
        fake.mem_map(DevicePtr(1 << 40), C, handle)  # nothing reserved there
    base = fake.address_reserve(2 * C, GRAN)
    with pytest.raises(CudaError, match="cuMemSetAccess failed"):
        fake.set_access(base, C)  # not mapped yet
    fake.mem_map(base, C, handle)
    with pytest.raises(CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        fake.read(base, 1)  # mapped, no access
    with pytest.raises(CudaError, match="cuMemSetAccess failed"):
        fake.set_access(base, 2 * C)  # half of it unmapped
    with pytest.raises(CudaError, match="cuMemAddressFree failed"):
        fake.address_free(base, 2 * C)  # still mapped
    fake.mem_unmap(base, C)
    fake.address_free(base, 2 * C)
    fake.mem_release(handle)
    with pytest.raises(CudaError, match="cuMemRelease failed"):
        fake.mem_release(handle)


# -- ipc device mapping ---------------------------------------------------------------------


def test_ipc_lease_is_the_pool_at_an_offset() -> None:
    fake = FakeDriver(granularity=GRAN)
    fake.open_device(0)
    base = fake.mem_alloc(4 * C)
    handle = fake.ipc_get_handle(base)
    with pytest.raises(CudaError, match="INVALID_HANDLE"):
        fake.ipc_open_handle(handle)  # as CUDA: not in the process that made it
    client = FakeDriver(granularity=GRAN, peer=fake)
    client.open_device(0)
    m = IpcDeviceMapping.for_chunks(client, handle, [2, 3], C)
    (opened,) = client.ipc_opened
    assert (m.address, m.length) == (opened + 2 * C, 2 * C)
    client.write(m.address, b"lease")
    assert bytes(fake.allocs[base].data[2 * C : 2 * C + 5]) == b"lease"
    m.retire()
    m.retire()
    assert not client.ipc_opened and client.names().count("ipc_close_handle") == 1
    with pytest.raises(ValueError, match=r"consecutive chunks, got \[1, 3\]"):
        IpcDeviceMapping.for_chunks(client, handle, [1, 3], C)


# -- host mapping ---------------------------------------------------------------------------


def memfd(content: bytes) -> int:
    fd = os.memfd_create("test-host", os.MFD_CLOEXEC)
    os.ftruncate(fd, C)
    os.pwrite(fd, content, 0)
    return fd


def test_host_lease_is_its_memfd_chunks_in_order_and_pinned() -> None:
    fake = FakeDriver(granularity=GRAN)
    a, b = memfd(b"a" * C), memfd(b"b" * C)
    m = PinnedChunkMapping(fake, [b, a], C)
    assert fake.registered == {m.address: 2 * C}
    assert bytes(m.buffer(0, 2)) == b"bb" and bytes(m.buffer(C, 2)) == b"aa"
    m.buffer(C, 3)[:] = b"xyz"
    assert os.pread(a, 3, 0) == b"xyz"  # shared with the daemon's memfd
    m.zero(0, C)
    assert os.pread(b, 4, 0) == bytes(4)
    m.retire()
    assert not fake.registered
    assert bytes(m.buffer(C, 3)) == bytes(3)  # private zero pages now
    m.buffer(C, 1)[:] = b"!"
    assert os.pread(a, 3, 0) == b"xyz"  # a stale write reaches nothing shared
    m.close()
    os.close(a)
    os.close(b)


def test_host_chunks_must_be_whole_pages() -> None:
    with pytest.raises(ValueError, match="page size"):
        PinnedChunkMapping(None, [0], 1000)


# -- streams and events ---------------------------------------------------------------------


def device_with(fake: FakeDriver, data: bytes) -> DevicePtr:
    fake.open_device(0)
    ptr = fake.mem_alloc(C)
    fake.write(ptr, data)
    return ptr


def test_swap_out_and_back_in_round_trip() -> None:
    fake = FakeDriver(granularity=GRAN)
    ptr = device_with(fake, b"payload!" + bytes(C - 8))
    out, into = swap_streams(fake)
    assert (out.name, out.direction, into.name, into.direction) == (
        "swap-out",
        "d2h",
        "swap-in",
        "h2d",
    )
    buf, host = host_buffer(C)
    out.copy(host, ptr, C)
    out.synchronize()
    assert buf.raw[:8] == b"payload!"
    fake.write(ptr, bytes(C))
    into.copy(ptr, host, C)
    into.synchronize()
    assert fake.read(ptr, 8) == b"payload!"
    assert (out.bytes_copied, into.bytes_copied) == (C, C)
    copies = [c for c in fake.calls if c[0] in ("dtoh", "htod")]
    assert [(c[0], c[4]) for c in copies] == [("dtoh", out.handle), ("htod", into.handle)]
    out.close()
    into.close()
    assert set(fake.streams) == {0}
    with pytest.raises(RuntimeError, match="stream swap-out is closed"):
        out.copy(host, ptr, 1)


def test_an_event_orders_the_in_stream_after_the_out_stream() -> None:
    fake = FakeDriver(granularity=GRAN, eager=False)
    ptr = device_with(fake, b"A" * C)
    out, into = swap_streams(fake)
    _buf, host = host_buffer(C)
    _buf2, host2 = host_buffer(C)
    out.copy(host, ptr, C)
    left = out.record()
    into.wait_event(left)
    into.copy(ptr, host2, C)  # would overwrite the device bytes with zeros
    arrived = into.record()
    assert not left.query() and not arrived.query()
    assert not fake.run(into.handle)  # blocked on the out stream's event
    assert not arrived.query() and not arrived.wait(timeout=0.001)
    assert fake.run(out.handle) and left.query()
    assert _buf.raw == b"A" * C  # the copy out read the bytes before the copy in replaced them
    assert fake.run(into.handle) and arrived.wait()
    assert fake.read(ptr, C) == bytes(C)


def test_the_compute_stream_waits_for_a_swap_in() -> None:
    fake = FakeDriver(granularity=GRAN, eager=False)
    device_with(fake, bytes(C))
    compute = CudaStream.wrap(fake, 0)
    _out, into = swap_streams(fake)
    arrived = into.record()
    compute.wait_event(arrived)
    assert fake.calls[-1] == ("stream_wait_event", 0, arrived.handle)
    compute.close()  # not ours: not destroyed
    assert 0 in fake.streams and "stream_destroy" not in fake.names()


def test_copy_needs_a_direction() -> None:
    fake = FakeDriver(granularity=GRAN)
    fake.open_device(0)
    with pytest.raises(ValueError, match="no copy direction"):
        CudaStream(fake, "plain").copy(1, 2, 3)
    with pytest.raises(ValueError, match="copy direction must be"):
        CudaStream(fake, "odd", "d2d")


def test_host_functions_run_in_order_and_failures_reach_the_next_event() -> None:
    fake = FakeDriver(granularity=GRAN, eager=False)
    fake.open_device(0)
    s = CudaStream(fake, "s")
    ran: list[int] = []
    s.launch(lambda: ran.append(1))
    s.launch(lambda: 1 // 0)
    first = s.record()
    s.launch(lambda: ran.append(2))
    second = s.record()
    assert ran == []
    fake.run_all()
    assert ran == [1, 2]
    with pytest.raises(StreamError, match="ZeroDivisionError"):
        first.wait()
    assert second.wait()


def test_events_are_destroyed_when_garbage() -> None:
    fake = FakeDriver(granularity=GRAN)
    fake.open_device(0)
    s = CudaStream(fake, "s")
    event = s.record()
    handle = event.handle
    assert handle in fake.events
    del event
    gc.collect()
    assert handle not in fake.events


def test_a_failed_copy_is_a_cuda_error_naming_the_call() -> None:
    fake = FakeDriver(granularity=GRAN)
    fake.open_device(0)
    s = CudaStream(fake, "s", "h2d")
    with pytest.raises(CudaError, match=r"^cuMemcpyHtoDAsync failed: CUDA_ERROR_ILLEGAL_ADDRESS"):
        s.copy(12345, 0, 8)


# -- the CuPy allocator (a stand-in CuPy module) ------------------------------------------------


class OutOfMemoryError(MemoryError):
    def __init__(self, size: int, total: int, limit: int = 0) -> None:
        super().__init__(size, total, limit)
        self.args3 = (size, total, limit)


class UnownedMemory:
    def __init__(self, ptr: int, size: int, owner: object, device_id: int) -> None:
        self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id


class MemoryPointer:
    def __init__(self, mem: Any, offset: int) -> None:
        self.mem, self.ptr = mem, mem.ptr + offset


class PinnedMemoryPointer(MemoryPointer):
    pass


class Array:
    """What tidalpool.cupy looks at on a CuPy array: `.data.mem.ptr`."""

    def __init__(self, data: MemoryPointer) -> None:
        self.data = data


class NdArray(Array):
    """`cupy.ndarray(shape, dtype, memptr)`: an array over memory it was given."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, memptr: MemoryPointer) -> None:
        super().__init__(memptr)
        self.shape, self.dtype = shape, dtype


def fake_cupy() -> types.SimpleNamespace:
    state: dict[str, Any] = {"allocator": "cupy-pool", "pinned": "cupy-pinned"}
    cuda = types.SimpleNamespace(
        UnownedMemory=UnownedMemory,
        MemoryPointer=MemoryPointer,
        PinnedMemoryPointer=PinnedMemoryPointer,
        memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
        Device=lambda: types.SimpleNamespace(id=0),
        get_allocator=lambda: state["allocator"],
        set_allocator=lambda f: state.__setitem__("allocator", f),
        set_pinned_memory_allocator=lambda f: state.__setitem__("pinned", f),
        get_current_stream=lambda: types.SimpleNamespace(ptr=0),  # the legacy default stream
    )
    pool = types.SimpleNamespace(malloc="cupy-pinned")
    return types.SimpleNamespace(
        cuda=cuda, state=state, ndarray=NdArray, get_default_pinned_memory_pool=lambda: pool
    )


class Lease:
    def __init__(self, address: int, length: int) -> None:
        self.address, self.length = address, length


class PinRecorder(PythonExecutor):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.pinned: list[int] = []

    def pin(self, block: Block) -> None:
        self.pinned.append(block.id)


class SwappingStandIn(PinRecorder):
    def stats(self) -> ExecutorStats:
        swap = SwapStats(self.capacity, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        return dataclasses.replace(super().stats(), swap=swap)


class FakeSession:
    """The parts of a Session the allocator uses, on a real PythonExecutor."""

    def __init__(self, device_bytes: int, host_bytes: int, swapping: bool = False) -> None:
        kind = SwappingStandIn if swapping else PinRecorder
        self.executor = kind(device_bytes)
        self.residency = self.executor  # records the pins a session's residency gets
        self.device = Lease(1 << 40, device_bytes)
        self.host = Lease(1 << 30, host_bytes)
        self.cuda = None  # a session of the sim backend
        self.ops: list[tuple[list[int], list[int], str]] = []

    def malloc(self, nbytes: int) -> Block:
        return self.executor.malloc(nbytes)

    def free(self, block: Block) -> None:
        self.executor.free(block)

    def address(self, block: Block) -> int:
        return self.device.address + block.offset

    @contextmanager
    def op(self, reads: list[Block], writes: list[Block], name: str) -> Iterator[None]:
        self.ops.append(([b.id for b in reads], [b.id for b in writes], name))
        yield


@pytest.fixture
def cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.SimpleNamespace]:
    import tidalclient.cupy as tpc

    module = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", module)
    yield module
    tpc.stop()


def test_use_routes_cupy_allocations_to_the_lease(cupy: types.SimpleNamespace) -> None:
    import tidalclient.cupy as tpc

    session = FakeSession(1 << 20, 1 << 16)
    allocator = tpc.use(session, device=3)  # type: ignore[arg-type]
    assert cupy.state["allocator"] == allocator.malloc
    assert cupy.state["pinned"] == allocator.malloc_pinned
    a = cupy.state["allocator"](1000)
    b = cupy.state["allocator"](0)
    assert isinstance(a, MemoryPointer) and isinstance(a.mem, UnownedMemory)
    assert (a.ptr, a.mem.size, a.mem.device_id) == (1 << 40, 1000, 3)
    assert b.ptr == (1 << 40) + 1024 and b.mem.size == 1  # 256-byte alignment, size 0 → 1
    assert session.executor.pinned == [1, 2] and session.executor.live_blocks == 2
    assert allocator.block_of(Array(a)).id == 1
    with pytest.raises(InvalidBlock, match="not a CuPy array of this session"):
        allocator.block_of(Array(MemoryPointer(UnownedMemory(5, 5, None, 0), 0)))
    tpc.stop()
    assert cupy.state == {"allocator": "cupy-pool", "pinned": "cupy-pinned"}


def test_freed_when_cupy_drops_the_memory(cupy: types.SimpleNamespace) -> None:
    import tidalclient.cupy as tpc

    session = FakeSession(4096, 0)
    allocator = tpc.use(session, pinned=False, device=0)  # type: ignore[arg-type]
    first = allocator.malloc(4096)
    del first
    gc.collect()
    assert session.executor.live_blocks == 1  # queued, freed on this thread at the next malloc
    second = allocator.malloc(4096)  # fits only because the first was freed
    assert second.ptr == 1 << 40 and session.executor.live_blocks == 1


def test_a_full_lease_is_cupys_out_of_memory(cupy: types.SimpleNamespace) -> None:
    import tidalclient.cupy as tpc

    session = FakeSession(4096, 512)
    allocator = tpc.use(session, device=0)  # type: ignore[arg-type]
    keep = allocator.malloc(4096)
    with pytest.raises(OutOfMemoryError) as err:
        allocator.malloc(1)
    assert err.value.args3 == (1, 4096, 4096)
    with pytest.raises(OutOfMemoryError):
        allocator.malloc_pinned(1024)
    del keep


def test_pinned_arrays_come_from_the_host_lease(cupy: types.SimpleNamespace) -> None:
    import tidalclient.cupy as tpc

    session = FakeSession(4096, 1024)
    allocator = tpc.use(session, device=0)  # type: ignore[arg-type]
    p = allocator.malloc_pinned(512)
    q = allocator.malloc_pinned(512)
    assert isinstance(p, PinnedMemoryPointer)
    assert (p.ptr, q.ptr, p.mem.size) == (1 << 30, (1 << 30) + 512, 512)
    del p
    gc.collect()
    r = allocator.malloc_pinned(512)  # the first range came back
    assert r.ptr == 1 << 30
    del q, r


def test_pinned_arrays_are_refused_for_a_swapping_session(cupy: types.SimpleNamespace) -> None:
    import tidalclient.cupy as tpc

    with pytest.raises(ValueError, match="pinned=False"):
        tpc.use(FakeSession(4096, 4096, swapping=True), device=0)  # type: ignore[arg-type]


def test_op_records_the_blocks_of_cupy_arrays(cupy: types.SimpleNamespace) -> None:
    import tidalclient.cupy as tpc

    session = FakeSession(1 << 16, 0)
    allocator = tpc.use(session, pinned=False, device=0)  # type: ignore[arg-type]
    x, y = Array(allocator.malloc(256)), Array(allocator.malloc(256))
    with tpc.op(session, [x], [y], name="relu") as arrays:  # type: ignore[arg-type]
        assert arrays == (x, y)
    assert session.ops == [([1], [2], "relu")]
    with (
        pytest.raises(InvalidBlock, match="another session"),
        tpc.op(FakeSession(256, 0), [x]),  # type: ignore[arg-type]
    ):
        pass


def test_a_stream_whose_host_function_failed_is_still_destroyed_on_close() -> None:
    fake = FakeDriver(granularity=GRAN)
    fake.open_device(0)
    s = CudaStream(fake, "s")
    s.launch(lambda: 1 // 0)
    with pytest.raises(StreamError, match="ZeroDivisionError"):
        s.close()
    assert set(fake.streams) == {0}
    s.close()  # idempotent


def test_a_closed_sessions_allocation_says_so_instead_of_out_of_memory(
    cupy: types.SimpleNamespace,
) -> None:
    """The session is over (closed, or its daemon died): CuPy gets SessionClosed, which says
    why, not an out-of-memory error a retry or a smaller batch could never cure."""
    import tidalclient.cupy as tpc

    session = FakeSession(4096, 512)
    allocator = tpc.use(session, device=0)  # type: ignore[arg-type]

    def over(nbytes: int) -> Block:
        raise SessionClosed("session s-1 is over: the daemon went away")

    session.malloc = over  # type: ignore[method-assign]
    with pytest.raises(SessionClosed, match="daemon went away"):
        allocator.malloc(64)
