"""`tidalpool.attach()` and the Session a training job holds, built from its parts.

    attach() ──handles socket──▶ token + its chunks' fds ──map──▶ leases (devices/lease.py)
             ──▶ Connection (connection.py): Attach, the Session stream and its threads
             ──▶ Recorder (recorder.py): the trace, in chunks on the stream
             ──▶ Executor (executors/): blocks in the lease; Swapping over it with a swap limit
             ──▶ Views (views.py): what ops see of blocks, NumPy on sim, CuPy on cuda
             ──▶ Session: the job's handle on all of them

The hot path (`malloc`, `free`, `op`) never leaves the process: the executor allocates inside
the mapped lease and the recorder appends an event. The daemon's plans reach the executor,
decoded once (plans.py), from the connection's listener.

Once the session is over (closed here, or ended by the daemon: its lease is scrubbed and leased
to others), everything that would touch the lease or the executor raises SessionClosed with the
reason, and freeing is a no-op: the blocks went with the lease.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidalcore.chunks import ChunkMapping
from tidalcore.events import OP, READ, WRITE
from tidalcore.units import parse_size
from tidalcore.unplanned import PlanUnavailable
from tidalcore.v1 import pool_pb2
from tidalcore.wire import HANDLES_SOCKET, MAX_SHAPE_BYTES

from tidalclient import cupy, node
from tidalclient.connection import Connection
from tidalclient.devices.lease import CudaLease, DeviceLease, HostLease, MappedLease, map_grant
from tidalclient.devices.pages import CudaPageSpace, Frames, PageSpace, SimPageSpace
from tidalclient.devices.streams import Elapsed, Stream, TimedStream
from tidalclient.elastic import ElasticLease
from tidalclient.errors import AttachError, InvalidBlock, SessionClosed
from tidalclient.executors.base import Block, Executor, Residency, SwapStats, Switches, check_size
from tidalclient.executors.native import NativeExecutor
from tidalclient.executors.paged import Paged, range_bytes
from tidalclient.executors.python import PythonExecutor
from tidalclient.executors.swapping import Swapping
from tidalclient.handles import Grant, give_back, request_lease
from tidalclient.hotpath import HotPath, NativeStats
from tidalclient.numpy import Tensor, array, release
from tidalclient.plans import Plan, PlanRejected, decode
from tidalclient.recorder import Duration, Recorder
from tidalclient.views import CudaViews, HostViews, Views

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from tidalcore.cuda_driver import Driver

log = logging.getLogger("tidalpool")


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
    native: NativeStats | None = None  # the native hot path's counters (allocator="native")
    # The daemon's word that it cannot plan this session (why, the lowest limit that could
    # work); None once a plan arrives, or while none has been refused.
    plan_unavailable: PlanUnavailable | None = None
    # Trace events not sent: the daemon stopped taking the stream, so the recorder stopped.
    events_dropped: int = 0


def socket_dir_from_env(socket_dir: str | os.PathLike[str] | None) -> Path:
    """The argument, else $TIDALPOOL_SOCKET_DIR, else, in a rank of a launcher (torchrun's
    LOCAL_RANK), its GPU's daemon in the node layout (/run/tidalpool/gpu<N>), else
    /run/tidalpool; `{gpu}` in either is this process's GPU index (`tidalclient.node`).
    AttachError when that index cannot be told."""
    try:
        return node.socket_dir(socket_dir, os.environ)
    except node.LayoutError as e:
        raise AttachError(f"which daemon: {e}") from None


def auto_shape(first: int | None) -> str:
    """The shape a session that recognises shapes (`attach(recognise_shapes=True)`) gives an
    iteration whose first allocation is of `first` bytes (None: it allocated nothing)."""
    return "auto-none" if first is None else f"auto-{first}"


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
    async_compute: bool = False,
    daemon_users: str | None = None,
    page_bytes: int | str | None = None,
    device_min: int | str | None = None,
    device_max: int | str | None = None,
    recognise_shapes: bool = False,
) -> Session:
    """Open a session with the daemon of `socket_dir` and map its lease.

    `device_limit`/`host_limit` are the lease sizes (bytes or "4GiB"); None asks
    for the daemon's default. `swap_limit` turns swapping on: the device bytes the
    session holds stay at or under it, blocks not in use waiting in the host
    lease; `copy_gbps` throttles the swap copies to that bandwidth on sim (on cuda
    the copies run at the link's speed and it only tells the daemon's planner).
    `driver` is the CUDA driver a cuda lease is mapped with (default: cuda-bindings).
    `allocator="native"`: the session's allocations come from the native hot path
    (`tidalclient.hotpath`), called by a framework such as PyTorch; `native_device` is the
    device index the framework passes it (default: the lease's GPU as this process numbers it,
    0 on sim). Python's `malloc`/`op` then refuse, and swapping is not available.
    `async_compute`: the ops' work runs on `Session.compute`, a stream, asynchronously to the
    calling thread (sim: a worker thread's `Stream`; cuda: the compute stream, CuPy's current
    one), and the swap engine orders its copies against that stream instead of waiting on
    this thread. An op's time is then its time on that stream (on cuda it always is), unless
    `op(..., duration_ns=)` gives it.
    `daemon_users`: the users the daemon may run as (comma-separated names or uids), checked
    before anything is sent to it; None: $TIDALPOOL_DAEMON_USERS, else this process's uid and
    the user "tidalpool" (see `handles.request_lease`).
    `page_bytes` (with `swap_limit`): virtual residency. Every block keeps one address for
    life in a range the session reserves, and pages of this size move beneath blocks as they
    are swapped, so a pointer taken once stays valid and the limit counts mapped pages; the
    daemon's plans for it are paged (executors/paged.py). A multiple of the OS page that divides
    the lease's chunks (sim); on cuda, the daemon's chunk size itself (CUDA maps a VMM handle
    only whole: a daemon with 2 MiB chunks gives 2 MiB pages).
    `device_min`/`device_max` (with `page_bytes`, instead of `device_limit`): an elastic
    lease. The floor `device_min` is guaranteed while the session lives (the attach waits, up
    to the daemon's quota_deadline_s, for chunks other jobs borrowed to come back; 0: the
    daemon's default_device_floor); above it the session borrows, up to `device_max` (0: the
    whole pool), what the daemon lends it by need, and gives chunks back when asked
    (`tidalclient.elastic`). Its swap limit holds within the chunks it has.
    `recognise_shapes`: a `step()` that names no shape has its iteration's shape recognised
    from its first allocation, by its size: iterations that begin with an allocation of the
    same size are one shape (`auto-<bytes>`; one of no allocation: `auto-none`), planned apart
    from the others and switched to at that allocation (see `Session.step`). Not with the
    native allocator, whose allocations the session does not see, nor with a swap limit
    without `page_bytes`.
    Raises AttachError when there is no daemon, it runs as a user not accepted, or it
    refuses (wrong uid, pool exhausted, its GPU not visible here).
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
    if allocator == "native" and async_compute:
        raise ValueError("async_compute orders Python ops: the native allocator has none")
    page = parse_size(page_bytes) if page_bytes is not None else 0
    if page_bytes is not None and (page < mmap.PAGESIZE or page & (page - 1)):
        raise ValueError(
            f"page_bytes {page_bytes!r} ({page} bytes): a power of two, at least the OS page"
            f" ({mmap.PAGESIZE} bytes)"
        )
    if page and swap_bytes is None:
        raise ValueError("page_bytes pages a session under a limit: give swap_limit too")
    if page and allocator == "native":
        raise ValueError("the native allocator does not page: drop page_bytes")
    if recognise_shapes and allocator == "native":
        raise ValueError(
            "recognise_shapes needs the session to see each allocation, which the native"
            " allocator's framework makes itself: name shapes with step(shape=) (tidalpool.torch"
            " names them from its inputs)"
        )
    if recognise_shapes and not page and (swap_bytes is not None or copy_gbps is not None):
        raise ValueError(
            "recognise_shapes switches plans at an iteration's first allocation, which a"
            " session that swaps does only when paged: give page_bytes too, or name shapes with"
            " step(shape=)"
        )
    elastic = device_min is not None or device_max is not None
    if elastic and not page:
        raise ValueError(
            "device_min and device_max make an elastic lease, which gives chunks back while the"
            " job runs: only a paged session can (give page_bytes and swap_limit)"
        )
    if elastic and device_limit is not None:
        raise ValueError(
            "device_limit is a fixed lease; device_min and device_max an elastic one: give one"
        )
    floor = parse_size(device_min) if device_min is not None else 0
    if elastic:
        device_bytes = parse_size(device_max) if device_max is not None else 0
    name = job_name or os.environ.get("TIDALPOOL_JOB_NAME") or Path(sys.argv[0] or "python").name
    grant = request_lease(
        directory / HANDLES_SOCKET,
        device_bytes,
        host_bytes,
        name,
        daemon_users=daemon_users,
        device_min=floor if elastic else None,
    )
    attached = False

    def unattached() -> None:
        """A lease whose Attach did not happen goes back now, not at attach_timeout_s."""
        if not attached:
            _give_back(directory, grant.response.token, daemon_users)

    try:
        mapped = map_lease(grant, driver)
        try:
            space = _page_space(grant, mapped, page, elastic) if page else None
            if elastic:  # its chunks are reached only through the pages, which can let go
                mapped.device.retire()
        except BaseException:
            mapped.device.retire()
            mapped.host.retire()
            raise
    except BaseException:
        unattached()
        raise
    finally:
        grant.close()  # the mappings keep the chunks; the fds are no longer needed
    undo: list[Callable[[], None]] = [unattached, mapped.device.retire, mapped.host.retire]
    if space is not None:
        undo.append(space.retire)
    try:
        native = None
        if allocator == "native":  # before Attach: a device already in use refuses here
            if native_device is None:
                native_device = mapped.cuda.ordinal if mapped.cuda is not None else 0
            native = NativeExecutor(
                HotPath(native_device), mapped.device.address, mapped.device.length
            )
            undo.append(native.close)
        connection = Connection(
            directory, grant.response.session_id, grant.response.token, grant.daemon_uid
        )
        undo.append(connection.close)
        reply = connection.attach(swap_bytes, copy_gbps, page)
        attached = True  # from here the session ends by Detach (`connection.close`)
        recorder = Recorder(
            connection.send,
            chunk_events=reply.trace_chunk_events or 4096,
            backlog=connection.backlog_events,
        )
        undo.append(recorder.close)
        executor: Executor
        residency: Residency | None = None  # only under a swap limit (or throttled copies)
        compute: Callable[[], Any] | None = None
        if async_compute:
            compute = _compute_stream(mapped)
            undo.append(lambda: _close_compute(compute))
        if native is not None:
            native.connect(recorder)
            executor = native
        elif space is not None:
            assert swap_bytes is not None
            executor = residency = _paged_executor(
                mapped, space, recorder, swap_bytes, copy_gbps, compute
            )
        else:
            executor = placed = PythonExecutor(mapped.device.length, trace=recorder)
            if swap_bytes is not None or copy_gbps is not None:
                executor = residency = _swapping(placed, mapped, swap_bytes, copy_gbps, compute)
    except BaseException:
        for step in reversed(undo):
            step()
        raise
    session = Session(
        grant.response.session_id,
        mapped,
        connection,
        recorder,
        executor,
        residency,
        compute,
        space,
        plan_shapes=reply.plan_shapes or 1,
        recognise_shapes=recognise_shapes,
    )
    if elastic:
        assert isinstance(executor, Paged) and swap_bytes is not None
        session.elastic = ElasticLease(
            executor,
            list(grant.response.lease.device.chunks),
            grant.response.lease.device.chunk_bytes,
            swap_bytes,
            connection.send,
            directory / HANDLES_SOCKET,
            grant.response.token,
            daemon_users,
            closed=lambda: session.closed,
        )
    connection.start(
        on_plan=session._receive_plan,
        on_unplanned=session._receive_unplanned,
        on_end=session._ended,
        heartbeat=session._heartbeat,
        interval_s=(reply.heartbeat_interval_ms or 1000) / 1000,
        on_quota=session.elastic.on_quota if session.elastic is not None else None,
    )
    return session


def _give_back(directory: Path, token: str, daemon_users: str | None) -> None:
    """Give a lease back on the handles socket; where that fails too, it goes back at the
    daemon's attach_timeout_s (said in the log, the attach's own error is the one raised)."""
    try:
        give_back(directory / HANDLES_SOCKET, token, daemon_users=daemon_users)
    except AttachError as e:
        log.info(
            "tidalpool: a lease not attached stays pending until the daemon reclaims it: %s", e
        )


def map_lease(grant: Grant, driver: Driver | None = None) -> MappedLease:
    """Map the granted chunks of both pools, each pool into one contiguous range, as the
    daemon's backend wants (devices/lease.py); `driver` maps a cuda lease (default: the
    real one)."""
    return map_grant(grant, driver)


def _page_space(grant: Grant, mapped: MappedLease, page: int, elastic: bool) -> PageSpace:
    """The virtual range of a paged session over its device lease's chunks (ValueError names
    a page the lease cannot be cut into); an `elastic` one's is as long as its ceiling asks."""
    chunk = grant.response.lease.device.chunk_bytes
    if chunk % page:
        raise AttachError(
            f"pages of {page} bytes do not divide the daemon's chunks of {chunk} bytes:"
            " give page_bytes a divisor of them"
        )
    lease = mapped.device.length
    if elastic:
        lease = max(lease, grant.response.device_ceiling_chunks * chunk)
    length = range_bytes(lease, page)
    if mapped.cuda is None:
        return SimPageSpace(grant.device_fds, chunk, page, length)
    if elastic:
        raise AttachError(
            "an elastic lease on cuda is not built yet: its pages would have to take and drop"
            " VMM handles while the job runs; attach with device_limit (a fixed lease)"
        )
    from tidalclient.devices.cuda import CudaDeviceMapping

    if not isinstance(mapped.device, CudaDeviceMapping):
        raise AttachError(
            f"the cuda daemon shares device memory by {mapped.cuda.mode!r}: paging needs its"
            " VMM handles (mode vmm)"
        )
    if page != chunk:
        raise AttachError(
            f"pages of {page} bytes on cuda: a page there is a whole chunk of the daemon's"
            f" ({chunk} bytes), because CUDA maps a VMM handle only from its first byte; give"
            f" page_bytes={chunk}, or run the daemon with chunk_size {page} for smaller pages"
        )
    return CudaPageSpace(mapped.cuda.driver, mapped.device.handles, chunk, page, length)


def _paged_executor(
    mapped: MappedLease,
    space: PageSpace,
    recorder: Recorder,
    swap_limit: int,
    copy_gbps: float | None,
    compute: Callable[[], Any] | None,
) -> Paged:
    """Blocks at addresses for life in `space`, at most `swap_limit` bytes of pages mapped."""
    return Paged(
        space,
        Frames(mapped.device.length // space.page),
        host_address=mapped.host.address,
        host_capacity=mapped.host.length,
        limit=swap_limit,
        trace=recorder,
        gbps=copy_gbps,
        **_copy_streams(mapped, compute),
    )


def _compute_stream(mapped: MappedLease) -> Callable[[], Any]:
    """The stream ops' work runs on, as a function giving it now: a sim `Stream` of its own,
    or the cuda compute stream (CuPy's current one)."""
    if mapped.cuda is not None:
        from tidalclient.devices.cuda import compute_stream

        return compute_stream(mapped.cuda.driver)
    stream = Stream("compute")
    return lambda: stream


def _op_stream(
    mapped: MappedLease, compute: Callable[[], Any] | None
) -> Callable[[], TimedStream] | None:
    """The stream the ops' work runs on, as a function giving it now, to time the ops on: the
    `async_compute` stream, else on cuda the compute stream (CuPy's current one: its kernels run
    after the op's body returns); None where the body does the work itself (sim)."""
    if compute is not None:
        return compute
    if mapped.cuda is None:
        return None
    from tidalclient.devices.cuda import compute_stream

    return compute_stream(mapped.cuda.driver)


def _timed(stream: TimedStream | None) -> Any:
    """A timing event recorded now on `stream`; None without one, or where it cannot record
    (its context failed: the op keeps the host's time, and whoever waits on the stream sees the
    failure)."""
    if stream is None:
        return None
    try:
        return stream.timed()
    except RuntimeError:
        return None


def _close_compute(compute: Callable[[], Any] | None) -> None:
    """Finish and stop a sim compute stream (a cuda one is not ours to close)."""
    stream = compute() if compute is not None else None
    if isinstance(stream, Stream):
        stream.close()


def _swapping(
    placed: PythonExecutor,
    mapped: MappedLease,
    swap_limit: int | None,
    copy_gbps: float | None,
    compute: Callable[[], Any] | None = None,
) -> Swapping:
    """`placed`'s blocks swapped under `swap_limit` (None: copies throttled to `copy_gbps`,
    no limit)."""
    return Swapping(
        placed,
        device_address=mapped.device.address,
        host_address=mapped.host.address,
        host_capacity=mapped.host.length,
        limit=swap_limit,
        gbps=copy_gbps,
        **_copy_streams(mapped, compute),
    )


def _copy_streams(mapped: MappedLease, compute: Callable[[], Any] | None) -> dict[str, Any]:
    """The stream arguments of an executor that copies blocks: sim `Stream`s (its default),
    ordered against `compute` when given; on cuda, two CUDA copy streams ordered against the
    compute stream."""
    if mapped.cuda is None:
        return {} if compute is None else {"compute": compute}
    from tidalclient.devices.cuda import compute_stream, swap_streams

    driver = mapped.cuda.driver
    return {
        "streams": lambda _gbps: swap_streams(driver),
        "compute": compute or compute_stream(driver),
    }


class Session:
    """A lease of device and host memory, and the executor that allocates in it."""

    def __init__(
        self,
        session_id: str,
        mapped: MappedLease,
        connection: Connection,
        recorder: Recorder,
        executor: Executor,
        residency: Residency | None = None,
        compute: Callable[[], Any] | None = None,
        space: PageSpace | None = None,
        plan_shapes: int = 1,
        recognise_shapes: bool = False,
    ) -> None:
        self.id = session_id
        self.device: DeviceLease = mapped.device
        self.host: HostLease = mapped.host
        self.cuda: CudaLease | None = mapped.cuda  # None on sim
        self.connection = connection
        self.recorder = recorder
        self.executor = executor
        # Where blocks are under a swap limit (the executor itself: Swapping, Paged); None
        # without one. NumPy, CuPy, torch and replay reach pins, swaps and ops through it.
        self.residency = residency
        # Where the executor's offsets count from: the lease, or a paged session's range.
        self._base = space.address if space is not None else mapped.device.address
        self._span = space.length if space is not None else mapped.device.length
        self.page_bytes = space.page if space is not None else 0  # 0: not paged
        self.views: Views
        if mapped.cuda is None:
            assert isinstance(mapped.device, ChunkMapping)  # a sim lease: memfd chunks
            if isinstance(space, SimPageSpace):
                self.views = HostViews(space)
            else:
                self.views = HostViews(mapped.device)
        else:
            self.views = CudaViews(self, mapped.cuda)
        self.plans_received = 0
        self.plans_rejected = 0
        self.plan: Plan | None = None  # the plan last received (executed from a step() on)
        # The iteration shapes stepped into most recently (at most `plan_shapes`, as the daemon
        # keeps them), least recent first, each with its plan once one came; `_shape` is the
        # current iteration's.
        self._shapes: OrderedDict[str, Plan | None] = OrderedDict()
        self._plan_shapes = plan_shapes
        self._shape = ""
        self._shapes_lock = threading.Lock()  # the training thread's step vs. plans arriving
        # A step naming no shape leaves it to the iteration's first allocation (`_recognise`);
        # `_unknown`: the iteration begun has not allocated yet, its shape is still to tell.
        if recognise_shapes and not isinstance(executor, Switches):
            raise ValueError(f"{type(executor).__name__} cannot switch plans within an iteration")
        self.recognise_shapes = recognise_shapes
        self._unknown = False
        # (allocations, plan misses) at the last step, while a session of one shape may still
        # be told that its iterations look like several (`_hint_shapes`); None once told.
        self._counts_at_step: tuple[int, int] | None = (0, 0)
        # Why the daemon sends no plan, as it last said; None once a plan arrives.
        self.plan_unavailable: PlanUnavailable | None = None
        self._compute = compute
        self._op_stream = _op_stream(mapped, compute)
        self._closed = False  # the session is over: closed here, or ended by the daemon
        self._released = False  # threads joined, channel closed, mappings retired
        self._dead: deque[Block] = deque()  # blocks of garbage tensors, freed at the next op
        self._arrays: weakref.WeakSet[Any] = weakref.WeakSet()  # owners of `array`s (sim)
        # An elastic lease's chunks and quota (attach's device_min/device_max); None: fixed.
        self.elastic: ElasticLease | None = None

    @property
    def errors(self) -> list[pool_pb2.SessionError]:
        """Messages of this session the daemon refused."""
        return self.connection.errors

    def _check_open(self) -> None:
        """SessionClosed, with the reason, once the session is over."""
        if self._closed:
            raise SessionClosed(self._why_closed())

    # -- allocation -------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        """`nbytes` of device memory in the lease (ValueError if <= 0, LeaseExceeded if no room)."""
        self._check_open()
        if self._unknown:
            self._recognise(auto_shape(check_size(nbytes)))
        return self.executor.malloc(nbytes)

    def free(self, block: Block) -> None:
        """Return a block (InvalidBlock if it is not live in this session). Once the session is
        over it does nothing: the whole lease has gone back, and cleanup code (a `finally`, an
        array's finalizer) must not raise a second error over the one that ended the job."""
        if self._closed:
            return
        self.executor.free(block)

    def address(self, block: Block) -> int:
        """The block's address in this process now (sim: host memory). With swapping it holds
        until the block's next swap-out: use `op` to access a block that is not pinned. Paged
        (`page_bytes`), it holds for the block's life, but its bytes are there only inside an
        op (or pinned)."""
        self._check_open()
        return self._base + self.executor.offset(block)

    @property
    def addresses(self) -> tuple[int, int]:
        """Where this session's blocks lie: (start, length) of the device lease's mapping, or
        of a paged session's range."""
        return self._base, self._span

    def buffer(self, block: Block) -> memoryview:
        """The block's bytes (sim backend), where they are now (see `address`)."""
        self._check_open()
        self.views.need_host_memory("buffer")
        return self.views.buffer(block, self.executor.offset(block))

    def array(
        self, shape: int | Sequence[int], dtype: npt.DTypeLike = "float32"
    ) -> np.ndarray[Any, Any]:
        """A NumPy array over lease memory, freed when it (and every view of it) is gone.
        It holds an address, so its block is pinned: never swapped out. Sim backend only
        (on cuda: CuPy arrays through `tidalpool.cupy`)."""
        self._check_open()
        self.views.need_host_memory("array")
        made = array(self, shape, dtype)
        self._arrays.add(made.base)  # its owner: what `close` keeps the bytes of
        return made

    def tensor(self, shape: int | Sequence[int], dtype: npt.DTypeLike = "float32") -> Tensor:
        """An array whose bytes may be swapped out between ops: compute on the views `op`
        yields (NumPy arrays on sim, CuPy arrays on cuda). Freed by `release` or once it is
        garbage."""
        self._check_open()
        if self._dead:
            self._free_dead()
        return Tensor(self, shape, dtype)

    def release(self, array: np.ndarray[Any, Any] | Tensor) -> None:
        """Free an array's or tensor's block now instead of when it is garbage (nothing to do
        once the session is over, as `free`)."""
        release(self, array)

    def bury(self, block: Block) -> None:
        """A garbage tensor's block, freed at the next `op`, `tensor` or `step` (a finalizer may
        run on any thread and in the middle of the executor's work, so it only queues)."""
        self._dead.append(block)

    def _free_dead(self) -> None:
        while self._dead:
            with suppress(InvalidBlock):  # freed by `free(tensor.block)` meanwhile
                self.executor.free(self._dead.popleft())

    # -- iteration structure ------------------------------------------------------------
    @property
    def compute(self) -> Any:
        """The stream the ops' work runs on (`attach(async_compute=True)`), else None: a sim
        `Stream` (`launch`, `record`, `synchronize`) or the cuda compute stream."""
        return self._compute() if self._compute is not None else None

    @contextmanager
    def op(
        self,
        reads: Sequence[Any] = (),
        writes: Sequence[Any] = (),
        name: str = "op",
        duration_ns: int | None = None,
    ) -> Iterator[tuple[Any, ...]]:
        """Around one computation on session arrays, tensors or blocks: records which it reads
        and writes and its time. Yields one array per item, reads then writes, to compute on:
        a session array itself, a view of a tensor's bytes, a uint8 view of a block's bytes.
        With swapping, they are all on the device and locked there until the op ends; views
        must not be used after it. On cuda a tensor's view is a CuPy array over its device
        bytes, a block is yielded as its device address, and CuPy arrays of the session (see
        `tidalpool.cupy`) are yielded as they are. The op's time is the `with` body's, on the
        stream its work runs on where there is one (cuda, `async_compute`: the body only
        enqueues it), else on this thread's clock; `duration_ns` gives it instead.
        SessionClosed once the session is over: on entry, and at the end of an op during which
        the daemon ended it (what the op computed may be lost); an error of the body wins."""
        if duration_ns is not None and duration_ns < 0:
            raise ValueError(f"an op cannot take negative time ({duration_ns} ns)")
        self._check_open()
        if self._dead:
            self._free_dead()
        items = (*reads, *writes)
        views = self.views
        blocks = views.blocks_of(items)
        residency = self.residency
        if residency is not None:
            offsets = residency.begin_op(blocks)
        else:
            offset_of = self.executor.offset
            offsets = [offset_of(b) for b in blocks]
        self._events_in_order()
        record = self.recorder.record
        base = self._base
        yielded: list[Any] = []
        for i, (item, block, offset) in enumerate(zip(items, blocks, offsets, strict=True)):
            record(READ if i < len(reads) else WRITE, block.id)
            yielded.append(views.view(item, block, base + offset))
        name_id = self.recorder.name_id(name)
        stream = self._op_stream() if self._op_stream is not None and duration_ns is None else None
        began = _timed(stream)  # after the waits for its blocks: a stall is not the op's
        start = time.perf_counter_ns()
        try:
            yield tuple(yielded)
        finally:
            host_ns = time.perf_counter_ns() - start
            took: Duration = host_ns if duration_ns is None else duration_ns
            if stream is not None and began is not None and (ended := _timed(stream)) is not None:
                took = Elapsed(stream, began, ended, host_ns)
            record(OP, 0, 0, took, name_id)
            if residency is not None:
                residency.end_op(blocks)
        self._check_open()  # the daemon ended the session while the op ran

    def record_op(self, name: str, duration_ns: int) -> None:
        """Tell the daemon about an op it cannot see (compute outside the session's ops) that
        took `duration_ns`, at this point of the iteration; it touches no block."""
        if duration_ns < 0:
            raise ValueError(f"an op cannot take negative time ({duration_ns} ns)")
        self._check_open()
        residency = self.residency
        if residency is not None:
            residency.begin_op(())  # an op of the iteration: a swap schedule counts it
        self._events_in_order()
        self.recorder.record(OP, 0, 0, duration_ns, self.recorder.name_id(name))
        if residency is not None:
            residency.end_op(())

    def _events_in_order(self) -> None:
        """Events kept elsewhere (the native ring: allocations of the framework and of this
        thread) go to the recorder first, so that those this thread records now follow them."""
        source = self.recorder.source
        if source is not None:
            source()

    def step(self, shape: str = "") -> None:
        """An iteration boundary: call it at the start of every training iteration.

        `shape` names the shape of the iteration it begins, where iterations differ (a batch
        size, a sequence length, "eval"): the daemon plans each shape apart, from its own
        iterations, and this session runs each shape's plan for the iterations of that shape;
        one of a shape with no plan yet is placed online and recorded, as the first iterations
        are. At most the daemon's `max_plan_shapes` shapes keep a plan (the least recently
        stepped into is forgotten, and planned again if it comes back). "": the session's one
        shape, or, in a session that recognises shapes (`attach(recognise_shapes=True)`), the
        shape its first allocation tells (`auto_shape`): the iteration runs under the plan of
        the iteration before until that allocation, then under the plan of its shape (or
        online, for a shape with none yet)."""
        self._check_open()
        if not isinstance(shape, str):
            raise TypeError(f"shape must be a str, not {type(shape).__name__}")
        if len(shape.encode()) > MAX_SHAPE_BYTES:
            raise ValueError(
                f"shape {shape[:32]!r}... is {len(shape.encode())} bytes, longer than"
                f" {MAX_SHAPE_BYTES}"
            )
        if self._dead:  # garbage tensors' blocks go before the boundary, not after it
            self._free_dead()
        if self._unknown:  # the iteration ending allocated nothing
            self._recognise(auto_shape(None))
        if not shape and not self.recognise_shapes and self._counts_at_step is not None:
            self._hint_shapes()
        if self.recognise_shapes and not shape:
            # Begun with the plan in use; its first allocation tells its shape (`malloc`).
            self.recorder.expect(None)
            self.executor.step()
            self._unknown = True
            return
        with self._shapes_lock:
            if shape != self._shape:
                self.executor.install_plan(self._shapes.get(shape))  # None: online from here
                self._shape = shape
            self._stepped(shape)
        self.recorder.expect(shape)
        self.executor.step()

    def _hint_shapes(self) -> None:
        """Once: where the iteration ending, of a session naming no shape, placed most of its
        allocations outside the plan it ran, say that iterations of several shapes can be
        named or recognised (a job cycling batch sizes otherwise runs one shape's plan)."""
        stats = self.executor.stats()
        before, self._counts_at_step = self._counts_at_step, (stats.mallocs, stats.plan_misses)
        if before is None or self.plan is None or stats.mode != "planned":
            return
        allocations, misses = stats.mallocs - before[0], stats.plan_misses - before[1]
        if misses >= 2 and 2 * misses > allocations:
            log.warning(
                "tidalpool: session %s: %d of the %d allocations of its last iteration missed its"
                " plan: if its iterations differ in shape (batch size, sequence length, an"
                " evaluation step), name each with step(shape=...), or attach with"
                " recognise_shapes=True, for a plan per shape",
                self.id,
                misses,
                allocations,
            )
            self._counts_at_step = None

    def _recognise(self, shape: str) -> None:
        """The iteration begun is of `shape`: its plan from here, before the first allocation
        (its ops so far ran under the plan of the iteration before)."""
        with self._shapes_lock:
            if shape != self._shape:
                assert isinstance(self.executor, Switches)
                self.executor.switch_plan(self._shapes.get(shape))
                self._shape = shape
            self._stepped(shape)
        self.recorder.decide(shape)
        self._unknown = False

    @property
    def shape(self) -> str:
        """The shape of the iteration running: as its `step` named it, or as its first
        allocation told it (`recognise_shapes`; that of the iteration before until then)."""
        return self._shape

    def _stepped(self, shape: str) -> None:
        """`shape` is the most recently stepped into: the least recent beyond `plan_shapes`
        lose their plans, as the daemon forgets them. Under the shapes lock."""
        self._shapes.setdefault(shape, None)
        self._shapes.move_to_end(shape)
        while len(self._shapes) > self._plan_shapes:
            self._shapes.popitem(last=False)

    @property
    def plans(self) -> dict[str, Plan]:
        """The plan of each iteration shape that has one (the shape "" for a session that
        names none), least recently stepped into first."""
        with self._shapes_lock:
            return {shape: plan for shape, plan in self._shapes.items() if plan is not None}

    def wait_for_plan(self, timeout_s: float) -> Plan | None:
        """Block until the daemon's plan has arrived (it runs from the next `step()`), the
        daemon has said it cannot make one (`plan_unavailable`), or `timeout_s` has passed;
        the plan, or None. The daemon plans once it has seen a few iterations (`step()`s)."""
        deadline = time.monotonic() + timeout_s
        while self.plan is None and self.plan_unavailable is None and not self._closed:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        return self.plan

    # -- views ------------------------------------------------------------------------
    def stats(self) -> SessionStats:
        received = -1
        if not self._closed:
            self.recorder.flush()
            received = self.connection.events_received()
        ex = self.executor.stats()
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
            swap=ex.swap,
            native=ex.native,
            plan_unavailable=self.plan_unavailable,
            events_dropped=self.recorder.events_dropped,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the end --------------------------------------------------------------------------
    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Send the rest of the trace and wait until the daemon has it (at most
        `flush_timeout_s`, then a warning says how many events it lacks), detach, and unmap the
        lease. Idempotent; also needed after the daemon ended the session (eviction, shutdown)
        to release local resources."""
        if self._released:
            return
        if self._unknown:  # the last iteration's tail: of the shape before
            self._recognise(self._shape)
        kept = self._arrays_bytes()  # before the detach: the daemon scrubs the lease then
        device_keep, host_keep = self._cupy_bytes()
        self.recorder.close()
        if not self.connection.ended:
            recorder = self.recorder
            self.connection.flush(recorder.events_sent, recorder.steps_sent, flush_timeout_s)
        if not self.connection.ended:
            self.connection.detach(self._heartbeat())
        self._closed = True
        self._released = True
        self.executor.close()  # copies in flight end before the mappings go
        _close_compute(self._compute)
        self.connection.close()
        self.device.retire(device_keep)
        self.host.retire(host_keep)
        for address, data in kept:  # private memory now: the pool's chunks are out of reach
            ctypes.memmove(address, data, len(data))

    def _arrays_bytes(self) -> list[tuple[int, bytes]]:
        """(address, bytes) of every array of this session still alive. The lease goes at
        `close`, but an array is the job's until it lets go of it (a checkpoint written after
        the daemon died, say): its bytes stay at its address, in private memory, never zeros
        read in place of its data."""
        kept = []
        for owner in list(self._arrays):
            address = owner.__array_interface__["data"][0]
            kept.append((address, ctypes.string_at(address, owner.block.size)))
        return kept

    def _cupy_bytes(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]:
        """(offset in the lease, bytes) under the CuPy arrays of this session still alive, of
        the device and the host lease: their leases put them back at `retire`. A paged
        session's blocks lie in its range, which its executor retires: they are lost, and a
        warning says so."""
        blocks, ranges = cupy.held_by(self)
        host = [(o, bytes(self.host.buffer(o, n))) for o, n in ranges]
        if not blocks:
            return [], host
        if self._base != self.device.address:  # paged: the blocks are not in the lease
            log.warning(
                "tidalpool: session %s ends with %d CuPy arrays alive; a paged session cannot"
                " keep their pages past its end: using them now faults",
                self.id,
                len(blocks),
            )
            return [], host
        offset = self.executor.offset
        read = getattr(self.device, "read", None)  # a cuda lease reads its device bytes
        device = [(offset(b), read(offset(b), b.size) if read is not None else b"") for b in blocks]
        return device, host

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _why_closed(self) -> str:
        goodbye = self.connection.goodbye
        if goodbye is not None:
            if goodbye.reason == pool_pb2.Goodbye.REASON_UNSPECIFIED:  # no Goodbye came
                return f"session {self.id} is over: {goodbye.message}"
            reason = pool_pb2.Goodbye.Reason.Name(goodbye.reason).removeprefix("REASON_").lower()
            return f"session {self.id} is over ({reason}: {goodbye.message})"
        return f"session {self.id} is closed"

    # -- from the connection's threads --------------------------------------------------
    def _ended(self) -> None:
        """The daemon ended the session: its lease is no longer this process's to use."""
        self._closed = True

    def _receive_plan(self, update: pool_pb2.PlanUpdate) -> None:
        """Ready a plan for the hot path here, off it; the executor switches at the next step()."""
        try:
            plan = decode(update)
            with self._shapes_lock:
                if plan.shape == self._shape:
                    self.executor.install_plan(plan)
                if plan.shape == self._shape or plan.shape in self._shapes:
                    self._shapes[plan.shape] = plan
        except PlanRejected as e:  # the native table also checks the plan against its lease
            self.plans_rejected += 1
            log.warning("tidalpool: ignoring a plan: %s", e)
            return
        self.plan = plan
        self.plan_unavailable = None  # a plan made after all
        self.plans_received += 1

    def _receive_unplanned(self, message: pool_pb2.PlanUnavailable) -> None:
        """The daemon cannot plan this session: kept for `stats()` and those waiting for a
        plan (the session goes on by its LRU cache), and said once in a warning."""
        told = PlanUnavailable.of(message)
        if told != self.plan_unavailable:
            log.warning("tidalpool: session %s: %s", self.id, told.line())
        self.plan_unavailable = told

    def _heartbeat(self) -> pool_pb2.Heartbeat:
        """The session as the daemon's metrics show it: bytes held now, counts since attach.
        Its device peak is what was resident at once; under a swap limit, its live blocks at
        their most (those swapped to the host included) go as the live peak."""
        ex = self.executor.stats()
        beat = pool_pb2.Heartbeat(
            device_used_bytes=ex.used_bytes,
            device_peak_bytes=ex.peak_live_bytes,
            live_peak_bytes=ex.peak_live_bytes,
            plan_misses=ex.plan_misses,
        )
        if ex.swap is not None:
            beat.device_peak_bytes = ex.swap.peak_resident_bytes
            beat.host_used_bytes = ex.swap.host_used_bytes
            beat.swapped_out_bytes = ex.swap.swapped_out_bytes
            beat.swapped_in_bytes = ex.swap.swapped_in_bytes
            beat.swap_stall_ns = ex.swap.stall_ns
            beat.on_demand_out_bytes = ex.swap.on_demand_out_bytes
            beat.on_demand_in_bytes = ex.swap.on_demand_in_bytes
        return beat
