"""attach() against a cuda daemon, with the fake driver on both sides.

The daemon runs in this process on a `CudaBackend` over one `FakeDriver`; the client maps its
lease with another `FakeDriver(peer=...)`, the driver of "another process": it imports the
daemon's exports from the fds it receives on the handles socket and opens its IPC handle,
with its own address space, context and streams.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tidalpool
from tidalclient.devices.cuda import CudaDeviceMapping, CudaStream
from tidalclient.devices.lease import map_grant
from tidalclient.errors import AttachError, InvalidBlock, NotHostMemory
from tidalclient.executors.swapping import Swapping
from tidalclient.handles import Grant, request_lease
from tidalcore.chunks import PinnedChunkMapping
from tidalcore.events import OP
from tidalcore.units import Bytes
from tidalpoold import server
from tidalpoold.backends.cuda import CudaBackend
from tidalpoold.server import Daemon, build_daemon
from tidalpoold.settings import Settings

from tests.unit.fake_cuda import FakeDriver, FakeNvml, Phys
from tests.unit.test_cuda_mapping import Array, MemoryPointer, fake_cupy

KiB = 1024
GRAN = 64 * KiB
C = 4 * GRAN  # the chunk: 256 KiB
BUS = "0000:3B:00.0"


class CudaDaemon:
    def __init__(self, daemon: Daemon, driver: FakeDriver) -> None:
        self.daemon, self.driver = daemon, driver
        self.socket_dir = daemon.settings.socket_dir
        backend = daemon.backend
        assert isinstance(backend, CudaBackend)
        self.backend = backend

    def chunk_phys(self, index: int) -> Phys:
        """The physical allocation behind device chunk `index` (vmm mode)."""
        base = self.backend._device_base + index * C
        return self.driver.mappings[base].phys

    def client(self, **kwargs: object) -> FakeDriver:
        return FakeDriver(granularity=GRAN, peer=self.driver, **kwargs)  # type: ignore[arg-type]


def start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> CudaDaemon:
    fake = FakeDriver(granularity=GRAN)

    def open_backend(
        name: str, device: int, host: int, chunk: int, gpu: int = 0, cuda_mode: str = "auto"
    ) -> CudaBackend:
        assert name == "cuda"
        return CudaBackend(
            device, host, chunk, gpu, mode=cuda_mode, probe_bytes=0, driver=fake, nvml=FakeNvml()
        )

    monkeypatch.setattr(server, "open_backend", open_backend)
    monkeypatch.setattr(server, "make_undumpable", lambda: None)  # this process is the client too
    settings = Settings(
        backend="cuda",
        cuda_mode=mode,
        device_pool=Bytes(8 * C),
        host_pool=Bytes(8 * C),
        default_device_lease=Bytes(2 * C),
        default_host_lease=Bytes(2 * C),
        lease_alignment=Bytes(C),
        chunk_size=Bytes(C),
        socket_dir=tmp_path / "run",
        plan_cache_dir=tmp_path / "plans",
        metrics_address="",
        plan_after_iterations=0,
    )
    return CudaDaemon(build_daemon(settings), fake)


@pytest.fixture
def vmm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[CudaDaemon]:
    d = start(tmp_path, monkeypatch, "vmm")
    yield d
    d.daemon.shutdown()


@pytest.fixture
def ipc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[CudaDaemon]:
    d = start(tmp_path, monkeypatch, "ipc")
    yield d
    d.daemon.shutdown()


def open_fds() -> int:
    """Open fds of memfds (chunks, in this process the daemon's own too; gRPC makes none)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own fd
            count += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:")
    return count


# -- vmm ----------------------------------------------------------------------------------------


def test_a_vmm_lease_maps_the_sessions_own_chunks_on_the_daemons_gpu(vmm: CudaDaemon) -> None:
    other = tidalpool.attach(vmm.socket_dir, device_limit=C, host_limit=C, driver=vmm.client())
    client = vmm.client()
    fds_before = open_fds()
    s = tidalpool.attach(vmm.socket_dir, device_limit=2 * C, host_limit=C, driver=client)
    try:
        assert open_fds() == fds_before  # every chunk fd received was closed once mapped
        assert s.cuda is not None
        assert (s.cuda.mode, s.cuda.ordinal, s.cuda.pci_bus_id) == ("vmm", 0, BUS)
        assert client.calls[:2] == [("device_by_pci_bus_id", BUS), ("open_device", 0)]
        assert isinstance(s.device, CudaDeviceMapping) and isinstance(s.host, PinnedChunkMapping)
        assert (s.device.length, s.host.length) == (2 * C, C)
        # The range reaches exactly the session's chunks (1 and 2: `other` holds 0), in order.
        mine = [vmm.chunk_phys(1), vmm.chunk_phys(2)]
        reached = [m.phys for base, m in sorted(client.mappings.items())]
        assert [id(p) for p in reached] == [id(p) for p in mine]
        block = s.malloc(2 * C)
        s.device.write(C - 2, b"abcd")  # across the two chunks
        assert bytes(mine[0].data[C - 2 :]) == b"ab" and bytes(mine[1].data[:2]) == b"cd"
        assert client.registered == {s.host.address: C}  # the host lease is page-locked
        s.host.buffer(0, 3)[:] = b"xyz"
        host_chunk = vmm.backend.host.chunks[s_host_chunk(vmm, s.id)]
        assert os.pread(host_chunk.fd, 3, 0) == b"xyz"
        s.free(block)
    finally:
        s.close()
        other.close()
    assert s.device.retired and s.host.retired
    assert not client.registered and not client.handles.keys() - {s.device._scratch}


def s_host_chunk(d: CudaDaemon, session_id: str) -> int:
    (chunk,) = d.daemon.registry.get(session_id).host.chunks
    return chunk


def test_the_gpu_is_found_by_bus_id_whatever_this_process_numbers_it(vmm: CudaDaemon) -> None:
    client = vmm.client(buses={"0000:AF:00.0": 0, BUS: 1})  # CUDA_VISIBLE_DEVICES=1,0 or so
    with tidalpool.attach(vmm.socket_dir, device_limit=C, driver=client) as s:
        assert s.cuda is not None and s.cuda.ordinal == 1
        assert ("open_device", 1) in client.calls
        assert client.pci_bus_id() == BUS


def test_a_gpu_hidden_from_this_process_is_an_attach_error(vmm: CudaDaemon) -> None:
    client = vmm.client(buses={"0000:AF:00.0": 0})
    fds_before = open_fds()
    with pytest.raises(AttachError, match=rf"GPU {BUS} is not visible .*CUDA_VISIBLE_DEVICES"):
        tidalpool.attach(vmm.socket_dir, device_limit=C, driver=client)
    assert open_fds() == fds_before  # the received fds were closed
    assert client.ordinal is None and client.live()["handles"] == 0


def test_a_failed_host_mapping_undoes_the_device_mapping(vmm: CudaDaemon) -> None:
    client = vmm.client()
    grant = request_lease(vmm.socket_dir / "handles.sock", 2 * C, C, "job")
    try:
        bad = Grant(grant.response, grant.device_fds, (-1,))
        with pytest.raises(AttachError, match=r"cannot map the cuda lease on GPU .* \(vmm\)"):
            map_grant(bad, client)
    finally:
        grant.close()
    assert client.live() == dict.fromkeys(client.live(), 0)  # context released too


def test_numpy_views_are_refused_on_cuda(vmm: CudaDaemon) -> None:
    with tidalpool.attach(vmm.socket_dir, device_limit=C, driver=vmm.client()) as s:
        block = s.malloc(64)
        for call in (lambda: s.array(4), lambda: s.buffer(block)):
            with pytest.raises(NotHostMemory, match=r"GPU memory .*tidalpool\.cupy"):
                call()
        assert s.executor.stats().live_blocks == 1  # nothing was allocated by the refusals


def test_a_tensors_view_on_cuda_is_a_cupy_array_over_its_device_bytes(
    vmm: CudaDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    with tidalpool.attach(vmm.socket_dir, device_limit=C, driver=vmm.client()) as s:
        s.malloc(64)  # so the tensor's block is not at offset 0
        t = s.tensor((3, 5), "float64")
        with s.op([], [t], name="init") as (view,):
            assert (view.shape, view.dtype) == ((3, 5), np.dtype("float64"))
            assert view.data.ptr == s.device.address + t.block.offset
            assert view.data.mem.size == 3 * 5 * 8
            assert view.data.mem.device_id == 0
            assert view.data.mem._owner is None  # owns nothing: the session frees the block


def test_op_on_cuda_takes_cupy_arrays_and_blocks(
    vmm: CudaDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tidalclient.cupy as tpc

    cupy = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    with tidalpool.attach(vmm.socket_dir, device_limit=2 * C, driver=vmm.client()) as s:
        try:
            allocator = tpc.use(s, pinned=False)
            assert allocator.device == 0  # the session's GPU, as this process numbers it
            x = Array(allocator.malloc(1024))
            raw = s.malloc(512)
            with s.op([x], [raw], name="scale") as (xv, rv):
                assert xv is x
                assert rv == s.device.address + raw.offset
            with tpc.op(s, [x], [], name="read") as (xv2,):
                assert xv2 is x
            stranger = Array(MemoryPointer(types.SimpleNamespace(ptr=12345), 0))
            with (
                pytest.raises(InvalidBlock, match="not a CuPy array of this session"),
                s.op([stranger]),
            ):
                pass
        finally:
            tpc.stop()


def test_cupy_arrays_keep_their_bytes_after_the_session_ends(
    vmm: CudaDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job may still hold arrays when its session ends (a checkpoint saved after the daemon
    died): device and pinned arrays keep their bytes at their addresses, never zeros."""
    import ctypes

    import tidalclient.cupy as tpc

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    client = vmm.client()
    s = tidalpool.attach(vmm.socket_dir, device_limit=2 * C, host_limit=2 * C, driver=client)
    try:
        allocator = tpc.use(s)
        x = Array(allocator.malloc(GRAN + 100))  # over two granules
        address = int(x.data.mem.ptr)
        payload = bytes(range(251)) * ((GRAN + 100) // 251) + b"!" * ((GRAN + 100) % 251)
        client.write(address, payload)
        pinned = allocator.malloc_pinned(64)
        ctypes.memmove(pinned.mem.ptr, b"pinned bytes", 12)
        dropped = Array(allocator.malloc(512))  # let go before the end: not kept
        del dropped
        s.close()
        assert client.read(address, len(payload)) == payload
        assert ctypes.string_at(pinned.mem.ptr, 12) == b"pinned bytes"
    finally:
        tpc.stop()
        s.close()


# -- ipc ----------------------------------------------------------------------------------------


def test_ipc_leases_are_consecutive_chunks_at_their_offset(ipc: CudaDaemon) -> None:
    a = tidalpool.attach(ipc.socket_dir, device_limit=C, driver=ipc.client())
    b_client = ipc.client()
    b = tidalpool.attach(ipc.socket_dir, device_limit=3 * C, driver=b_client)
    try:
        assert b.cuda is not None and b.cuda.mode == "ipc"
        lease = ipc.daemon.registry.get(b.id).device
        assert lease.chunks == (1, 2, 3)
        (opened,) = b_client.ipc_opened
        assert (b.device.address, b.device.length) == (opened + 1 * C, 3 * C)
        b_client.write(b.device.address, b"ipc")
        pool = ipc.driver.allocs[ipc.backend._device_base]
        assert bytes(pool.data[C : C + 3]) == b"ipc"
    finally:
        a.close()
        b.close()
    assert not b_client.ipc_opened  # retired: the handle is closed


# -- the swap engine on cuda ----------------------------------------------------------------------


def test_swaps_on_cuda_copy_on_cuda_streams_ordered_against_compute(vmm: CudaDaemon) -> None:
    client = vmm.client()
    with tidalpool.attach(
        vmm.socket_dir, device_limit=2 * C, host_limit=2 * C, swap_limit=C, driver=client
    ) as s:
        ex = s.executor
        assert isinstance(ex, Swapping)
        assert all(isinstance(st, CudaStream) for st in (ex._out, ex._in))
        out, into = ex._out.handle, ex._in.handle  # type: ignore[attr-defined]
        a = s.malloc(C // 2)
        assert isinstance(s.device, CudaDeviceMapping)
        s.device.write(a.offset, b"A" * 16)
        b = s.malloc(C // 2 + 1)  # over the limit with a: a goes out
        assert ex.where(a) == "host"  # the fake runs copies at once
        with s.op([a]) as (address_a,):  # a comes back, b goes out to make room
            assert address_a == s.device.address + ex.offset(a)
        assert ex.where(b) == "host"
        ex.synchronize()
        assert s.device.read(ex.offset(a), 16) == b"A" * 16  # the round trip kept the bytes
        copies = [c for c in client.calls if c[0] in ("dtoh", "htod")]
        assert copies and {c[4] for c in copies if c[0] == "dtoh"} == {out}
        assert {c[4] for c in copies if c[0] == "htod"} == {into}
        # Before each copy, its stream waits for an event recorded on the compute stream (0)
        # (which may be destroyed once the wait is enqueued, as CUDA allows).
        calls = [c for c in client.calls if c[0] != "event_destroy"]
        for k, call in enumerate(calls):
            if call[0] in ("dtoh", "htod"):
                stream = call[4]
                wait = calls[k - 1]
                assert wait[0] == "stream_wait_event" and wait[1] == stream
                record = next(c for c in calls[:k] if c[:2] == ("event_record", wait[2]))
                assert record[2] == 0
        # The op waited on the swap-in on the compute stream, not on this thread.
        in_events = {c[1] for c in client.calls if c[0] == "event_record" and c[2] == into}
        assert any(
            c[0] == "stream_wait_event" and c[1] == 0 and c[2] in in_events for c in client.calls
        )


@pytest.mark.parametrize("swap_limit", [None, C], ids=["no limit", "limit"])
def test_an_op_on_cuda_is_timed_by_events_on_the_compute_stream(
    vmm: CudaDaemon, swap_limit: int | None
) -> None:
    """The op's kernels run after its body returns: its time is the GPU's between timing
    events recorded on the compute stream (0) as the body begins and ends, whatever the host
    spent in the body, with a limit or without."""
    client = vmm.client()
    with tidalpool.attach(
        vmm.socket_dir, device_limit=2 * C, host_limit=2 * C, swap_limit=swap_limit, driver=client
    ) as s:
        a = s.malloc(1024)
        sent: list[tuple[int, ...]] = []
        record = s.recorder.record
        s.recorder.record = lambda *e: (sent.append(e), record(*e))  # type: ignore[method-assign]
        with s.op([a], name="scale"):
            client.now_ns += 3_000_000  # the GPU's clock when the op's kernels have run
        *_, (kind, _, _, took, _) = sent
        assert kind == OP and not isinstance(took, int) and took.ns() == 3_000_000
        timed = [c for c in client.calls if c[0] == "event_record"][-2:]
        assert [c[2] for c in timed] == [0, 0]
        assert all(client.events[c[1]].timing for c in timed)


def test_a_paged_session_on_cuda_maps_whole_chunks_and_refuses_smaller_pages(
    vmm: CudaDaemon,
) -> None:
    """CUDA maps a VMM handle only from its first byte, so a page on cuda is a daemon's chunk;
    a smaller page is refused at attach, naming the page that would work."""
    with pytest.raises(AttachError, match=f"a whole chunk .* give page_bytes={C}"):
        tidalpool.attach(
            vmm.socket_dir, device_limit=2 * C, swap_limit=C, page_bytes=GRAN, driver=vmm.client()
        )
    client = vmm.client()
    with tidalpool.attach(
        vmm.socket_dir, device_limit=2 * C, swap_limit=C, page_bytes=C, driver=client
    ) as s:
        assert s.page_bytes == C
        client.calls.clear()
        a = s.malloc(C)
        with s.op([a]) as (address,):
            pass
        maps = [c for c in client.calls if c[0] == "mem_map"]
        assert maps and all(c[2] == C for c in maps)  # each a whole chunk
        assert address in {c[1] for c in maps}
