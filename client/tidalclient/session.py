"""`tidalpool.attach()` and the Session a training job holds.

    attach() ──handles socket──▶ token + its chunks' fds ──map──▶ Attach (gRPC)
             ──▶ Session stream (heartbeats, trace chunks, step marks ▲ goodbye, plans)

The hot path (`malloc`, `free`, `op`) never leaves the process: the executor
allocates inside the mapped lease and the recorder appends an event. With a
`swap_limit`, the executor is the swap engine (swap.py): blocks not in use wait
in the host lease while the device bytes held stay under the limit.

On the cuda backend the device lease is GPU memory: NumPy cannot view it, so
`array` and `buffer` refuse, and arrays come from `tidalpool.cupy` (CuPy
allocates from the lease); `op` takes CuPy arrays, raw blocks and tensors (whose
views are then CuPy arrays).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from tidalcore import __version__
from tidalcore.chunks import ChunkMapping
from tidalcore.events import OP, READ, WRITE
from tidalcore.units import ALIGNMENT, parse_size
from tidalcore.v1 import pool_pb2, pool_pb2_grpc
from tidalcore.wire import GRPC_SOCKET, HANDLES_SOCKET, STREAM_OPEN_KEY, TOKEN_KEY

from tidalclient.devices.lease import CudaLease, DeviceLease, HostLease, MappedLease, map_grant
from tidalclient.errors import AttachError, InvalidBlock, NotHostMemory, SessionClosed
from tidalclient.executor import Block, Executor
from tidalclient.handles import Grant, request_lease
from tidalclient.native import HotPath
from tidalclient.native_executor import NativeExecutor
from tidalclient.planned import PlanRejected, PlanTable
from tidalclient.recorder import Recorder
from tidalclient.swap import ScheduledSwap, SwappingExecutor, SwapStats

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from tidalcore.cuda_driver import Driver

    from tidalclient.numpy import Tensor

log = logging.getLogger("tidalpool")

DEFAULT_SOCKET_DIR = Path("/run/tidalpool")


@dataclass(frozen=True, slots=True)
class SessionStats:
    """What a session has done, as this process and the daemon see it."""

    session_id: str
    device_lease_bytes: int
    host_lease_bytes: int
    live_bytes: int  # requested bytes of live blocks
    peak_live_bytes: int
    used_bytes: int  # live bytes rounded to the alignment
    live_blocks: int
    mallocs: int
    frees: int
    events_recorded: int
    events_sent: int
    events_received: int  # by the daemon (-1 once the session is over)
    mode: str  # "learning" or "planned"
    plans_received: int
    plan_hits: int  # allocations served by a plan
    plan_misses: int  # allocations a plan could not serve (placed online)
    footprint_bytes: int  # highest lease byte used in the current iteration so far
    swap: SwapStats | None  # bytes swapped, stall time...; None for a session without swapping


def socket_dir_from_env(socket_dir: str | os.PathLike[str] | None) -> Path:
    """The argument, else $TIDALPOOL_SOCKET_DIR, else /run/tidalpool."""
    if socket_dir is not None:
        return Path(socket_dir)
    return Path(os.environ.get("TIDALPOOL_SOCKET_DIR") or DEFAULT_SOCKET_DIR)


def attach(
    socket_dir: str | os.PathLike[str] | None = None,
    device_limit: int | str | None = None,
    host_limit: int | str | None = None,
    job_name: str | None = None,
    swap_limit: int | str | None = None,
    copy_gbps: float | None = None,
    driver: Driver | None = None,
    allocator: str = "python",
    native_device: int | None = None,
) -> Session:
    """Open a session with the daemon of `socket_dir` and map its lease.

    `device_limit`/`host_limit` are the lease sizes (bytes or "4GiB"); None asks
    for the daemon's default. `swap_limit` turns swapping on: the device bytes the
    session holds stay at or under it, blocks not in use waiting in the host
    lease; `copy_gbps` throttles the swap copies to that bandwidth on sim (on cuda
    the copies run at the link's speed and it only tells the daemon's planner).
    `driver` is the CUDA driver a cuda lease is mapped with (default: cuda-bindings).
    `allocator="native"`: the session's allocations come from the native hot path
    (`tidalclient.native`), called by a framework such as PyTorch; `native_device` is the device
    index the framework passes it (default: the lease's GPU as this process numbers it, 0 on
    sim). Python's `malloc`/`op` then refuse, and swapping is not available.
    Raises AttachError when there is no daemon or it refuses (wrong uid, pool
    exhausted, its GPU not visible here).
    """
    directory = socket_dir_from_env(socket_dir)
    device_bytes = parse_size(device_limit) if device_limit is not None else 0
    host_bytes = parse_size(host_limit) if host_limit is not None else 0
    swap_bytes = parse_size(swap_limit) if swap_limit is not None else None
    if copy_gbps is not None and copy_gbps <= 0:
        raise ValueError(f"copy_gbps must be positive, got {copy_gbps}")
    if allocator not in ("python", "native"):
        raise ValueError(f"allocator must be 'python' or 'native', got {allocator!r}")
    if allocator == "native" and (swap_bytes is not None or copy_gbps is not None):
        raise ValueError("the native allocator does not swap: drop swap_limit and copy_gbps")
    name = job_name or os.environ.get("TIDALPOOL_JOB_NAME") or Path(sys.argv[0] or "python").name
    grant = request_lease(directory / HANDLES_SOCKET, device_bytes, host_bytes, name)
    try:
        mapped = map_lease(grant, driver)
    finally:
        grant.close()  # the mappings keep the chunks; the fds are no longer needed
    return Session(
        directory,
        grant.response.session_id,
        grant.response.token,
        mapped.device,
        mapped.host,
        swap_limit=swap_bytes,
        copy_gbps=copy_gbps,
        cuda=mapped.cuda,
        allocator=allocator,
        native_device=native_device,
    )


def map_lease(grant: Grant, driver: Driver | None = None) -> MappedLease:
    """Map the granted chunks of both pools, each pool into one contiguous range, as the
    daemon's backend wants (devices/lease.py); `driver` maps a cuda lease (default: the
    real one)."""
    return map_grant(grant, driver)


class Session:
    """A lease of device and host memory, and the executor that allocates in it."""

    def __init__(
        self,
        socket_dir: Path,
        session_id: str,
        token: str,
        device: DeviceLease,
        host: HostLease,
        swap_limit: int | None = None,
        copy_gbps: float | None = None,
        cuda: CudaLease | None = None,
        allocator: str = "python",
        native_device: int | None = None,
    ) -> None:
        self.id = session_id
        self.device = device
        self.host = host
        self.cuda = cuda  # None on sim
        self._metadata = ((TOKEN_KEY, token),)
        self._channel = grpc.insecure_channel(f"unix:{socket_dir / GRPC_SOCKET}")
        self._stub = pool_pb2_grpc.PoolStub(self._channel)
        self._closed = False  # the session is over: closed here, or ended by the daemon
        self._released = False  # threads joined, channel closed, mappings retired
        self._goodbye: pool_pb2.Goodbye | None = None
        self.errors: list[pool_pb2.SessionError] = []  # refusals the daemon reported
        self.plans_received = 0
        self.plans_rejected = 0
        self._iteration = 0
        native = None
        if allocator == "native":  # before Attach: a device already in use refuses here
            if native_device is None:
                native_device = cuda.ordinal if cuda is not None else 0
            try:
                native = NativeExecutor(HotPath(native_device), device.address, device.length)
            except BaseException:
                self._channel.close()
                device.retire()
                host.retire()
                raise
        try:
            reply = self._stub.Attach(
                pool_pb2.AttachRequest(
                    client_version=__version__,
                    pid=os.getpid(),
                    swap_limit_bytes=swap_limit or 0,
                    copy_gbps=copy_gbps or 0.0,
                ),
                metadata=self._metadata,
                timeout=10,
            )
        except grpc.RpcError as e:
            if native is not None:
                native.close()
            self._channel.close()
            device.retire()
            host.retire()
            raise AttachError(f"Attach failed ({e.code().name}): {e.details()}") from e
        self._outbox: queue.SimpleQueue[pool_pb2.ClientMessage | None] = queue.SimpleQueue()
        self._responses = self._stub.Session(self._outgoing(), metadata=self._metadata)
        # The daemon sends headers once the stream is the session's: from then on every end of
        # the session (a shutdown included) reaches this client as a Goodbye on it.
        if (STREAM_OPEN_KEY, "1") not in (self._responses.initial_metadata() or ()):
            code, details = self._responses.code(), self._responses.details()
            if native is not None:
                native.close()
            self._channel.close()
            device.retire()
            host.retire()
            raise AttachError(f"session stream refused ({code.name}): {details}")
        self.recorder = Recorder(self._outbox.put, chunk_events=reply.trace_chunk_events or 4096)
        self.executor: Executor | NativeExecutor
        if native is not None:
            native.connect(self.recorder)
            self.executor = native
        elif swap_limit is None and copy_gbps is None:
            self.executor = Executor(device.length, record=self.recorder.record)
        else:
            self.executor = SwappingExecutor(
                device.length,
                device_address=device.address,
                host_address=host.address,
                host_capacity=host.length,
                limit=swap_limit,
                gbps=copy_gbps,
                record=self.recorder.record,
                **_cuda_streams(cuda),
            )
        self._dead: deque[Block] = deque()  # blocks of garbage tensors, freed at the next op
        self._heartbeat_s = (reply.heartbeat_interval_ms or 1000) / 1000
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._listen, name="tidalpool-listen", daemon=True),
            threading.Thread(target=self._beat, name="tidalpool-heartbeat", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- allocation -------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        """`nbytes` of device memory in the lease (ValueError if <= 0, LeaseExceeded if no room)."""
        if self._closed:
            raise SessionClosed(self._why_closed())
        return self.executor.malloc(nbytes)

    def free(self, block: Block) -> None:
        """Return a block (InvalidBlock if it is not live in this session)."""
        self.executor.free(block)

    def address(self, block: Block) -> int:
        """The block's address in this process now (sim: host memory). With swapping it holds
        until the block's next swap-out: use `op` to access a block that is not pinned."""
        return self.device.address + self._offset(block)

    def buffer(self, block: Block) -> memoryview:
        """The block's bytes (sim backend), where they are now (see `address`)."""
        self._need_host_memory("buffer")
        assert isinstance(self.device, ChunkMapping)
        return self.device.buffer(self._offset(block), block.size)

    def _need_host_memory(self, what: str) -> None:
        if self.cuda is not None:
            raise NotHostMemory(
                f"Session.{what}() views the lease with NumPy, but this session's device lease"
                f" is GPU memory (cuda backend, GPU {self.cuda.pci_bus_id}): use"
                " tidalpool.cupy.use(session) and CuPy arrays, and tidalpool.cupy.op()"
            )

    def _offset(self, block: Block) -> int:
        ex = self.executor
        return ex.offset(block) if isinstance(ex, SwappingExecutor) else block.offset

    def array(
        self, shape: int | Sequence[int], dtype: npt.DTypeLike = "float32"
    ) -> np.ndarray[Any, Any]:
        """A NumPy array over lease memory, freed when it (and every view of it) is gone.
        It holds an address, so its block is pinned: never swapped out. Sim backend only
        (on cuda: CuPy arrays through `tidalpool.cupy`)."""
        from tidalclient.numpy import array

        self._need_host_memory("array")
        return array(self, shape, dtype)

    def tensor(self, shape: int | Sequence[int], dtype: npt.DTypeLike = "float32") -> Tensor:
        """An array whose bytes may be swapped out between ops: compute on the views `op`
        yields (NumPy arrays on sim, CuPy arrays on cuda). Freed by `release` or once it is
        garbage."""
        from tidalclient.numpy import Tensor

        if self._dead:
            self._free_dead()
        return Tensor(self, shape, dtype)

    def release(self, array: np.ndarray[Any, Any] | Tensor) -> None:
        """Free an array's or tensor's block now instead of when it is garbage."""
        from tidalclient.numpy import release

        release(self, array)

    def bury(self, block: Block) -> None:
        """A garbage tensor's block, freed at the next `op` or `tensor` (a finalizer may run on
        any thread and in the middle of the executor's work, so it only queues)."""
        self._dead.append(block)

    def _free_dead(self) -> None:
        while self._dead:
            with suppress(InvalidBlock):  # freed by `free(tensor.block)` meanwhile
                self.executor.free(self._dead.popleft())

    # -- iteration structure ------------------------------------------------------------
    @contextmanager
    def op(
        self, reads: Sequence[Any] = (), writes: Sequence[Any] = (), name: str = "op"
    ) -> Iterator[tuple[Any, ...]]:
        """Around one computation on session arrays, tensors or blocks: records which it reads
        and writes and its time. Yields one array per item, reads then writes, to compute on:
        a session array itself, a view of a tensor's bytes, a uint8 view of a block's bytes.
        With swapping, they are all on the device and locked there until the op ends; views
        must not be used after it. On cuda a tensor's view is a CuPy array over its device
        bytes, a block is yielded as its device address, and CuPy arrays of the session (see
        `tidalpool.cupy`) are yielded as they are."""
        from tidalclient.numpy import BYTE, Tensor, block_of, view

        if self._released:
            raise SessionClosed(self._why_closed())
        if self._dead:
            self._free_dead()
        items = (*reads, *writes)
        if self.cuda is not None:
            from tidalclient.cupy import blocks_of, device_view

            blocks = blocks_of(self, items)
        else:
            blocks = [item if isinstance(item, Block) else block_of(item) for item in items]
        offsets = self.executor.begin_op(blocks)
        record = self.recorder.record
        base = self.device.address
        views: list[Any] = []
        for i, (item, block, offset) in enumerate(zip(items, blocks, offsets, strict=True)):
            record(READ if i < len(reads) else WRITE, block.id)
            if self.cuda is not None:
                if isinstance(item, Tensor):
                    views.append(device_view(base + offset, item.shape, item.dtype, self.cuda))
                else:
                    views.append(base + offset if item is block else item)
            elif item is block:
                views.append(view(base + offset, (block.size,), BYTE))
            elif isinstance(item, Tensor):
                views.append(view(base + offset, item.shape, item.dtype))
            else:  # a pinned array
                views.append(item)
        name_id = self.recorder.name_id(name)
        start = time.perf_counter_ns()
        try:
            yield tuple(views)
        finally:
            record(OP, 0, 0, time.perf_counter_ns() - start, name_id)
            self.executor.end_op(blocks)

    def record_op(self, name: str, duration_ns: int) -> None:
        """Tell the daemon about an op it cannot see (compute outside the session's ops) that
        took `duration_ns`, at this point of the iteration; it touches no block."""
        if duration_ns < 0:
            raise ValueError(f"an op cannot take negative time ({duration_ns} ns)")
        if self._released:
            raise SessionClosed(self._why_closed())
        native = isinstance(self.executor, NativeExecutor)
        if not native:  # an op of the iteration: a swap schedule counts it (and acts around it)
            self.executor.begin_op([])
        self.recorder.record(OP, 0, 0, duration_ns, self.recorder.name_id(name))
        if not native:
            self.executor.end_op([])

    def step(self) -> None:
        """An iteration boundary: call it at the start of every training iteration."""
        if isinstance(self.executor, NativeExecutor):  # its ITER event comes through the ring
            self._iteration = self.executor.step()
            return
        self._iteration += 1
        self.executor.begin_iteration()  # where a received plan takes over
        self.recorder.step(self._iteration)

    # -- views ------------------------------------------------------------------------
    def stats(self) -> SessionStats:
        received = -1
        if not self._closed:
            try:
                self.recorder.flush()
                reply = self._stub.Stats(
                    pool_pb2.StatsRequest(), metadata=self._metadata, timeout=10
                )
                received = reply.session.events_received
            except grpc.RpcError:
                pass
        ex = self.executor
        return SessionStats(
            session_id=self.id,
            device_lease_bytes=self.device.length,
            host_lease_bytes=self.host.length,
            live_bytes=ex.live_bytes,
            peak_live_bytes=ex.peak_live_bytes,
            used_bytes=ex.used_bytes,
            live_blocks=ex.live_blocks,
            mallocs=ex.mallocs,
            frees=ex.frees,
            events_recorded=self.recorder.events_recorded,
            events_sent=self.recorder.events_sent,
            events_received=received,
            mode=ex.mode,
            plans_received=self.plans_received,
            plan_hits=ex.plan_hits,
            plan_misses=ex.plan_misses,
            footprint_bytes=ex.high_water,
            swap=ex.swap_stats() if isinstance(ex, SwappingExecutor) else None,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the end --------------------------------------------------------------------------
    def close(self) -> None:
        """Send the rest of the trace, detach, and unmap the lease. Idempotent; also needed
        after the daemon ended the session (eviction, shutdown) to release local resources."""
        if self._released:
            return
        self.recorder.close()
        if self._goodbye is None:
            try:
                last = self._heartbeat()
                request = pool_pb2.DetachRequest(last=last)
                self._stub.Detach(request, metadata=self._metadata, timeout=10)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAUTHENTICATED:  # already ended daemon-side
                    log.warning("tidalpool: Detach failed: %s", e.details())
        self._finish()

    def _finish(self) -> None:
        self._closed = True
        self._released = True
        self.executor.close()  # copies in flight end before the mappings go
        self._stop.set()
        self._outbox.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        self._channel.close()
        self.device.retire()
        self.host.retire()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _why_closed(self) -> str:
        if self._goodbye is not None:
            reason = (
                pool_pb2.Goodbye.Reason.Name(self._goodbye.reason).removeprefix("REASON_").lower()
            )
            return f"session {self.id} is over ({reason}: {self._goodbye.message})"
        return f"session {self.id} is closed"

    # -- background -----------------------------------------------------------------------
    def _outgoing(self) -> Iterator[pool_pb2.ClientMessage]:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            yield msg

    def _listen(self) -> None:
        try:
            for msg in self._responses:
                body = msg.WhichOneof("body")
                if body == "goodbye":
                    self._goodbye = msg.goodbye
                    self._closed = True  # malloc refuses from now on
                elif body == "plan":
                    self._receive_plan(msg.plan)
                elif body == "error":
                    self.errors.append(msg.error)
                    log.warning(
                        "tidalpool: daemon refused a message: %s %s",
                        msg.error.code,
                        msg.error.message,
                    )
        except grpc.RpcError as e:
            if not self._stop.is_set() and self._goodbye is None:
                self._goodbye = pool_pb2.Goodbye(message=f"session stream failed: {e.code().name}")
                self._closed = True

    def _receive_plan(self, plan: pool_pb2.PlanUpdate) -> None:
        """Ready a plan for the hot path here, off it; the executor switches at the next step()."""
        try:
            table = PlanTable.build(
                plan.plan_id, list(plan.sizes), list(plan.offsets), plan.height_bytes, ALIGNMENT
            )
        except PlanRejected as e:
            self.plans_rejected += 1
            log.warning("tidalpool: ignoring a plan: %s", e)
            return
        try:
            self.executor.install_plan(table)
        except PlanRejected as e:  # the native table checks the plan against its lease
            self.plans_rejected += 1
            log.warning("tidalpool: ignoring a plan: %s", e)
            return
        self.plans_received += 1
        if plan.swap_blocks and isinstance(self.executor, SwappingExecutor):
            columns = (
                plan.swap_blocks,
                plan.swap_persistent,
                plan.swap_out_after,
                plan.swap_in_at,
                plan.swap_in_before,
            )
            try:  # ValueError: columns of unequal lengths, or a malformed swap
                swaps = [
                    ScheduledSwap(block, out_after, in_before, in_at, persistent)
                    for block, persistent, out_after, in_at, in_before in zip(*columns, strict=True)
                ]
                self.executor.install_schedule(swaps)
            except ValueError as e:
                log.warning("tidalpool: ignoring the swap schedule of plan %d: %s", plan.plan_id, e)

    def _beat(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            self._outbox.put(pool_pb2.ClientMessage(heartbeat=self._heartbeat()))

    def _heartbeat(self) -> pool_pb2.Heartbeat:
        """The session as the daemon's metrics show it: bytes held now, counts since attach."""
        ex = self.executor
        beat = pool_pb2.Heartbeat(
            device_used_bytes=ex.used_bytes,
            device_peak_bytes=ex.peak_live_bytes,
            plan_misses=ex.plan_misses,
        )
        if isinstance(ex, SwappingExecutor):
            beat.host_used_bytes = ex.host_used_bytes
            beat.swapped_out_bytes = ex.swapped_out_bytes
            beat.swapped_in_bytes = ex.swapped_in_bytes
            beat.swap_stall_ns = ex.stall_ns
        return beat


def _cuda_streams(cuda: CudaLease | None) -> dict[str, Any]:
    """The swap engine's streams on cuda: two CUDA copy streams, ordered against the compute
    stream (CuPy's current stream, else the legacy default stream). Nothing on sim."""
    if cuda is None:
        return {}
    from tidalclient.devices.cuda import compute_stream, swap_streams

    driver = cuda.driver
    return {"streams": lambda _gbps: swap_streams(driver), "compute": compute_stream(driver)}
