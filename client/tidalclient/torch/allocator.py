"""`tidalpool.torch.attach()`: PyTorch's CUDA memory from a tidalpool lease, in two modes.

    import tidalpool.torch
    tp = tidalpool.torch.attach(optimizer=opt)   # before the model touches the GPU

**pool** (the default, the most compatible): PyTorch's caching allocator keeps working; its
segments come from the lease. A `torch.cuda.MemPool` on a `CUDAPluggableAllocator` over the
native hot path receives every allocation of the device, from every thread (autograd's
backward thread too), until `close()`. Memory stats, snapshots and `cudnn.benchmark` work as
usual. While the pool receives allocations, PyTorch's caching allocator runs as it does during
a CUDA graph capture: a segment that does not fit in the lease raises `torch.OutOfMemoryError`
without the cache being released first (cached free blocks of the pool serve later requests
they fit, but are not returned to the lease before `close()`; `empty_cache()` does not return
them either), and a block freed after `Tensor.record_stream` is not reused before `close()`
(a job that records streams every iteration, as NCCL collectives and prefetchers do, grows:
use planned mode, or `TORCH_NCCL_AVOID_RECORD_STREAMS=1`).

**planned**: the pluggable allocator *replaces* PyTorch's allocator (possible only before the
first CUDA allocation of the process), so every tensor allocation goes through the native hot
path: online best-fit while the daemon learns the iteration, then the daemon's offline
placement (SmartPool). PyTorch's allocator features are gone in this mode: `memory_stats`,
`memory_snapshot`, `reset_peak_memory_stats` raise, tensors cannot be shared with other
processes (CUDA IPC), CUDA graphs cannot use private pools, and `cudnn.benchmark` fails (it
asks the allocator for `cacheInfo`). `TorchSession.stats()` gives tidalpool's counters
instead. A failed allocation raises `torch.OutOfMemoryError` with the lease's state (the
native failure handler throws it: `oom.py`), rather than handing PyTorch a NULL tensor.
Streams: bytes freed on one stream are reused on another only after that stream waits, on the
GPU, for the first one's work queued so far (the native allocator records an event and inserts
a stream wait through the CUDA driver); a tensor marked with `Tensor.record_stream(s)` counts as
freed on `s` too, so any allocation reusing its bytes on another stream first waits for `s`.

Iterations end at each step of the optimizer given (a step post-hook), or at each
`TorchSession.step()` / `tidalpool.torch.step()`.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Literal

import torch
from tidalcore.units import ALIGNMENT, parse_size
from torch.optim import Optimizer

from tidalclient.errors import TidalpoolError
from tidalclient.hotpath import (
    ALLOC_SYMBOL,
    FREE_SYMBOL,
    NativeStats,
    cuda_stream_functions,
    library_path,
    on_failure,
    order_streams,
    record_stream_address,
)
from tidalclient.session import Session, SessionStats
from tidalclient.session import attach as session_attach
from tidalclient.torch import oom
from tidalclient.torch.saved import SavedStats, SavedTensors, innermost

log = logging.getLogger("tidalpool")

Mode = Literal["pool", "planned"]


class TorchAttachError(TidalpoolError):
    """PyTorch cannot take memory from tidalpool in the mode asked (no GPU, too late, ...)."""


@dataclass(frozen=True, slots=True)
class TorchStats:
    mode: Mode
    session: SessionStats
    native: NativeStats  # the hot path's counters (in pool mode: segments, not tensors)
    saved: SavedStats | None = None  # with a swap limit: the saved tensors' session
    saves_session: SessionStats | None = None


_current: list[TorchSession] = []  # the attached session of this process (one at most)


def saves_lease(swap_limit: int) -> int:
    """Device bytes leased for saved tensors under `swap_limit`: the limit and a quarter more,
    room for fragmentation (resident bytes stay under the limit)."""
    return swap_limit + swap_limit // 4


def _check_device(session: Session, index: int) -> None:
    """Refuse a torch device that is not the daemon's GPU (compared by PCI domain, bus and
    device, the daemon's as "DDDD:BB:DD.F")."""
    assert session.cuda is not None
    if not 0 <= index < torch.cuda.device_count():
        raise TorchAttachError(f"torch has no CUDA device {index} ({torch.cuda.device_count()})")
    props = torch.cuda.get_device_properties(index)
    ours = tuple(getattr(props, f"pci_{n}_id", None) for n in ("domain", "bus", "device"))
    *domain, bus, rest = session.cuda.pci_bus_id.split(":")  # NVML's; the domain may be absent
    theirs = (int(domain[-1], 16) if domain else 0, int(bus, 16), int(rest.split(".")[0], 16))
    if any(a is not None and a != b for a, b in zip(ours, theirs, strict=True)):
        at = ":".join(f"{a:02x}" if a is not None else "?" for a in ours)
        raise TorchAttachError(
            f"torch device {index} is at PCI {at}, the daemon's GPU at"
            f" {session.cuda.pci_bus_id}: pass device= the index of the daemon's GPU"
        )


def attach(
    socket_dir: str | os.PathLike[str] | None = None,
    *,
    mode: Mode = "pool",
    optimizer: Optimizer | None = None,
    device: int | None = None,
    device_limit: int | str | None = None,
    host_limit: int | str | None = None,
    job_name: str | None = None,
    swap_limit: int | str | None = None,
) -> TorchSession:
    """Attach to the daemon and make PyTorch allocate the GPU's memory in the session's lease.

    Call before the model touches the GPU (planned mode refuses otherwise). `device`: the
    torch device index of the daemon's GPU (default: found from the lease). `swap_limit`: also
    keep the tensors autograd saves for backward in a second session, swapped to its host lease
    (`host_limit` bytes) so that they hold at most this many device bytes (`SavedTensors`);
    its iterations follow this session's. The sessions are closed by `close()`, by leaving a
    `with` block, or at interpreter exit.
    """
    if mode not in ("pool", "planned"):
        raise ValueError(f"mode must be 'pool' or 'planned', got {mode!r}")
    limit = parse_size(swap_limit) if swap_limit is not None else None
    if limit is not None and limit <= 0:
        raise ValueError(f"swap_limit must be positive, got {swap_limit!r}")
    if _current:
        raise TorchAttachError(
            f"this process is already attached (session {_current[0].session.id}): close it"
        )
    if not torch.cuda.is_available():
        raise TorchAttachError("tidalpool.torch.attach needs a CUDA GPU that PyTorch can use")
    session = session_attach(
        socket_dir,
        device_limit=device_limit,
        host_limit=ALIGNMENT,  # this session never uses host memory: the smallest lease
        job_name=job_name,
        allocator="native",
        native_device=device,
    )
    try:
        if session.cuda is None:
            raise TorchAttachError(
                "tidalpool.torch.attach needs a daemon on the cuda backend (this one is sim);"
                " for CPU tensors on sim see tidalpool.torch.SavedTensors"
            )
        index = device if device is not None else session.cuda.ordinal
        attached = TorchSession(session, mode, index, optimizer)
    except BaseException:
        session.close()
        raise
    if limit is not None:
        saves: Session | None = None
        try:
            saves = session_attach(
                socket_dir,
                device_limit=saves_lease(limit),
                host_limit=host_limit,
                job_name=f"{job_name or 'torch'}-saved",
                swap_limit=limit,
            )
            attached.keep_saves_in(saves)
        except BaseException:
            if saves is not None and attached.saved is None:
                saves.close()
            attached.close()
            raise
    return attached


class TorchSession:
    """A tidalpool session whose lease holds PyTorch's CUDA memory on one device."""

    def __init__(
        self, session: Session, mode: Mode, device: int, optimizer: Optimizer | None
    ) -> None:
        self.session = session
        self.mode: Mode = mode
        self.device = device
        self._pool: Any = None
        self._hook: Any = None
        self._closed = False
        self.saved: SavedTensors | None = None  # with a swap limit (keep_saves_in)
        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            str(library_path()), ALLOC_SYMBOL, FREE_SYMBOL
        )
        try:
            self._install(allocator, optimizer)
            self.session.step()  # iteration 1 starts now
        except BaseException:
            self._release()  # what was installed; the caller closes the session
            raise
        _current.append(self)
        atexit.register(self.close)

    def _install(self, allocator: Any, optimizer: Optimizer | None) -> None:
        session, device = self.session, self.device
        assert session.cuda is not None
        if self.mode == "planned":
            if device != session.cuda.ordinal:  # checked before anything is replaced
                raise TorchAttachError(
                    f"planned mode: torch device {device} is not the daemon's GPU, which this"
                    f" process numbers {session.cuda.ordinal}: pass device={session.cuda.ordinal}"
                    " or leave device out"
                )
            if torch.backends.cudnn.benchmark:
                raise TorchAttachError(
                    "planned mode cannot serve torch.backends.cudnn.benchmark (it asks the"
                    " allocator for cacheInfo, which a pluggable allocator lacks): turn it off,"
                    " or use mode='pool'"
                )
            handler = oom.handler()  # throws c10::OutOfMemoryError, as PyTorch's allocator does
            if handler is None:
                handler = oom.torch_check_fail()  # throws c10::Error: RuntimeError in Python
                log.warning(
                    "tidalpool: a failed allocation will raise RuntimeError, not"
                    " torch.OutOfMemoryError (cuDNN does not then retry a smaller workspace)"
                )
            if handler is None:
                log.warning(
                    "tidalpool: %s is not exported by this PyTorch: an allocation that does not"
                    " fit the lease hands PyTorch a NULL pointer",
                    oom.TORCH_CHECK_FAIL,
                )
            cxx = allocator.allocator()
            honour = getattr(cxx, "set_record_stream_fn", None)
            if honour is not None:
                honour(record_stream_address())  # Tensor.record_stream reaches the hot path
            else:
                log.warning(
                    "tidalpool: this PyTorch cannot pass record_stream to a pluggable allocator:"
                    " keep a tensor used on a second stream alive until that stream is done"
                )
            try:
                torch.cuda.memory.change_current_allocator(allocator)
            except RuntimeError as e:
                raise TorchAttachError(
                    "planned mode must replace PyTorch's CUDA allocator before PyTorch"
                    " initializes CUDA (a CUDA tensor, torch.cuda.get_device_properties, ...),"
                    " and it has: call tidalpool.torch.attach(mode='planned') first, or use"
                    " mode='pool'"
                ) from e
            on_failure(handler)
            order_streams(cuda_stream_functions())
            _check_device(session, device)  # only now: it initializes CUDA in PyTorch
        else:
            _check_device(session, device)
            on_failure(None)  # the caching allocator checks for NULL, retries, then raises OOM
            order_streams(None)  # and orders its own blocks across streams
            with torch.cuda.device(device):  # a MemPool belongs to the current device
                pool = torch.cuda.MemPool(allocator.allocator())
            torch._C._cuda_beginAllocateToPool(device, pool.id)
            self._pool = pool
        if optimizer is not None:
            self.watch(optimizer)

    def _release(self) -> None:
        """Undo `_install` as far as PyTorch allows: the step hook, and in pool mode the routing
        of allocations to the pool and the pool itself, whose cached segments go back to the
        lease while it is still configured (planned mode's allocator cannot be put back)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        pool, self._pool = self._pool, None
        if pool is not None:
            torch._C._cuda_endAllocateToPool(self.device, pool.id)
            torch._C._cuda_releasePool(self.device, pool.id)
            del pool  # its destructor empties the pool's cache into the lease, now

    def watch(self, optimizer: Optimizer) -> None:
        """End an iteration after each step of `optimizer` (in planned mode the optimizer is
        made after attach, with the model: pass it here)."""
        if self._hook is not None:
            self._hook.remove()
        self._hook = optimizer.register_step_post_hook(lambda *_: self.step())

    def keep_saves_in(self, session: Session) -> None:
        """Keep autograd's saved tensors in `session` (one with a swap limit) from now until
        `close()`, which closes that session too."""
        if self.saved is not None:
            raise TorchAttachError("saved tensors already go to a session")
        saved = SavedTensors(session, device=self.device)  # its iterations: this session's steps
        saved.__enter__()
        self.saved = saved

    def step(self, shape: str = "") -> None:
        """An iteration boundary (automatic after each step of a watched optimizer).
        `shape`: the shape of the iteration it begins, where iterations differ (`Session.step`):
        each shape gets its own plan. A watched optimizer's step cannot know the next
        iteration's shape: with several shapes, call this before each iteration instead."""
        self.session.step(shape)
        if self.saved is not None:
            self.saved.step(shape)

    def stats(self) -> TorchStats:
        saved = self.saved
        stats = self.session.stats()
        assert stats.native is not None  # a torch session allocates through the hot path
        return TorchStats(
            self.mode,
            stats,
            stats.native,
            saved.stats() if saved is not None else None,
            saved.session.stats() if saved is not None else None,
        )

    def close(self) -> None:
        """Wait for the GPU, stop allocating from the lease and end the session. Tensors still
        alive point into memory that is given back: free them first (or close at exit). In
        planned mode PyTorch's allocator cannot be put back: allocations fail afterwards."""
        if self._closed:
            return
        self._closed = True
        with suppress(RuntimeError):
            torch.cuda.synchronize(self.device)
        saved = self.saved
        steps = [self._release, self.session.close]  # each runs even if one before raised
        if saved is not None:
            steps[:0] = [lambda: saved.__exit__(None, None, None), saved.session.close]
        try:
            _run_all(steps)
        finally:
            atexit.unregister(self.close)
            with suppress(ValueError):
                _current.remove(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> TorchSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run_all(steps: Sequence[Callable[[], object]]) -> None:
    """Call every step in order; then raise the first exception any of them raised."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first


def current() -> TorchSession | None:
    """The attached session of this process, if any."""
    return _current[0] if _current else None


def step(shape: str = "") -> None:
    """Mark an iteration boundary for the innermost active `SavedTensors`, else for the session
    of `tidalpool.torch.attach` (call it after each optimizer step when no optimizer is
    watched; with iterations of several shapes, before each iteration, naming its `shape`, as
    `Session.step`). RuntimeError if there is neither."""
    saved = innermost()
    if saved is not None:
        saved.step(shape)
        return
    attached = current()
    if attached is None:
        raise RuntimeError(
            "tidalpool.torch.step(): no SavedTensors is active and no session is attached"
            " (tidalpool.torch.attach)"
        )
    attached.step(shape)
