"""CuPy arrays in a tidalpool lease: `tidalpool.cupy.use(session)`.

After `use(session)`, CuPy allocates every device array from the session's device lease
(`cupy.cuda.set_allocator`) and every pinned host array from its host lease
(`cupy.cuda.set_pinned_memory_allocator`). Each allocation is a block of the session wrapped
as `UnownedMemory` whose owner frees the block once CuPy drops it, so CuPy's own memory pool
is bypassed: the session sees every malloc and free, as the planner needs.

A CuPy array holds an address, so its block is pinned (never swapped out). `op(session,
reads, writes)` records an access to CuPy arrays as `Session.op` does for session arrays, and
`session.step()` marks iterations as usual.

A lease that is full is logged and becomes CuPy's own `OutOfMemoryError`, so CuPy's
out-of-memory path speaks; a session that is over (closed, or its daemon gone) raises
`SessionClosed`, which says why, since freeing memory or a retry could not help. The arrays
the job holds keep their bytes either way (read them back with `.get()`). Importing this module
does not import CuPy; `use` does.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from tidalclient.devices.lease import CudaLease, DeviceLease, HostLease
from tidalclient.errors import InvalidBlock, SessionClosed, TidalpoolError
from tidalclient.executors.base import Block, Executor, Residency
from tidalclient.executors.bestfit import BestFit
from tidalclient.numpy import Tensor


class CupySession(Protocol):
    """What CuPy's allocators need of the session they allocate from (a `Session`)."""

    @property
    def executor(self) -> Executor: ...

    @property
    def residency(self) -> Residency | None: ...

    @property
    def device(self) -> DeviceLease: ...

    @property
    def host(self) -> HostLease: ...

    @property
    def cuda(self) -> CudaLease | None: ...

    def malloc(self, nbytes: int) -> Block: ...

    def free(self, block: Block) -> None: ...

    def address(self, block: Block) -> int: ...

    def op(
        self, reads: Sequence[Any] = (), writes: Sequence[Any] = (), name: str = "op"
    ) -> contextlib.AbstractContextManager[tuple[Any, ...]]: ...


log = logging.getLogger("tidalpool.cupy")


class _Owner:
    """Holds one device block for the CuPy memory built on it; frees it when garbage."""

    __slots__ = ("__weakref__", "block")

    def __init__(self, allocator: Allocator, block: Block) -> None:
        self.block = block
        weakref.finalize(self, allocator._dead.append, block)


class _PinnedOwner:
    """A host-lease range as CuPy's `PinnedMemoryPointer` wants it (`ptr`, `size`)."""

    __slots__ = ("__weakref__", "offset", "ptr", "size")

    def __init__(self, allocator: Allocator, offset: int, ptr: int, size: int) -> None:
        self.offset = offset
        self.ptr = ptr
        self.size = size
        weakref.finalize(self, allocator._dead_host.append, offset)


class Allocator:
    """The device and pinned-host allocators of one session, for CuPy.

    Frees are queued by finalizers (which may run on any thread, in the middle of anything)
    and done on the next allocation or `op`, on the calling thread.
    """

    def __init__(self, session: CupySession, cupy: Any, device: int, pinned: bool) -> None:
        self.session = session
        self._cupy = cupy
        self.device = device
        self._dead: deque[Block] = deque()
        self._dead_host: deque[int] = deque()
        self._by_pointer: weakref.WeakValueDictionary[int, _Owner] = weakref.WeakValueDictionary()
        self._pinned: weakref.WeakSet[_PinnedOwner] = weakref.WeakSet()
        self._host: BestFit | None = None
        if pinned:
            if session.executor.stats().swap is not None:
                raise ValueError(
                    "pinned host arrays come from the host lease, which a swapping session"
                    " (swap_limit=) uses for swapped-out blocks: use(session, pinned=False)"
                )
            self._host = BestFit(session.host.length)

    # -- device ---------------------------------------------------------------------------
    def malloc(self, size: int) -> Any:
        """CuPy's allocator: a `MemoryPointer` to `size` bytes of the device lease."""
        self.collect()
        cp = self._cupy.cuda
        try:
            block = self.session.malloc(max(size, 1))
            if self.session.residency is not None:  # CuPy holds its address: it stays
                self.session.residency.pin(block)
        except SessionClosed:
            raise  # not out of memory: no allocation can succeed, and CuPy says why
        except (TidalpoolError, ValueError) as e:
            log.warning("tidalpool.cupy: cannot allocate %d bytes: %s", size, e)
            lease = self.session.device.length
            used = self.session.executor.used_bytes
            raise cp.memory.OutOfMemoryError(size, used, lease) from e
        owner = _Owner(self, block)
        address = self.session.address(block)
        self._by_pointer[address] = owner
        memory = cp.UnownedMemory(address, block.size, owner, self.device)
        return cp.MemoryPointer(memory, 0)

    def collect(self) -> None:
        """Free the blocks of garbage arrays (on this thread)."""
        while self._dead:
            block = self._dead.popleft()
            with contextlib.suppress(InvalidBlock):  # the session ended, or freed it already
                self.session.free(block)
        while self._dead_host:
            assert self._host is not None
            self._host.release(self._dead_host.popleft())

    # -- pinned host ----------------------------------------------------------------------
    def malloc_pinned(self, size: int) -> Any:
        """CuPy's pinned-memory allocator: `size` bytes of the host lease (page-locked)."""
        self.collect()
        cp = self._cupy.cuda
        offset = None if self._host is None else self._host.allocate(max(size, 1))
        if offset is None:
            lease = self.session.host.length
            log.warning("tidalpool.cupy: the host lease of %d bytes has no %d bytes", lease, size)
            used = 0 if self._host is None else self._host.used_bytes
            raise cp.memory.OutOfMemoryError(size, used, lease)
        owner = _PinnedOwner(self, offset, self.session.host.address + offset, max(size, 1))
        self._pinned.add(owner)
        return cp.PinnedMemoryPointer(owner, 0)

    def held(self) -> tuple[list[Block], list[tuple[int, int]]]:
        """What the job still holds: the blocks under live device arrays, and the (offset,
        bytes) ranges of the host lease under live pinned arrays."""
        return (
            [owner.block for owner in list(self._by_pointer.values())],
            [(owner.offset, owner.size) for owner in list(self._pinned)],
        )

    # -- arrays -> blocks -----------------------------------------------------------------
    def block_of(self, array: Any) -> Block:
        """The block under a CuPy array allocated here, or a view of one (InvalidBlock for
        any other array)."""
        memory = getattr(getattr(array, "data", None), "mem", None)
        owner = self._by_pointer.get(int(getattr(memory, "ptr", -1)))
        if owner is None:
            raise InvalidBlock(f"{type(array).__name__} is not a CuPy array of this session")
        return owner.block


_current: Allocator | None = None
_previous: Any = None  # CuPy's device allocator before the first use()


def use(session: CupySession, *, pinned: bool = True, device: int | None = None) -> Allocator:
    """Make CuPy allocate from `session` (device arrays; pinned host arrays too unless
    `pinned=False`) until `stop()`. `device` is the CUDA ordinal of the lease (default: the
    session's GPU on the cuda backend, else CuPy's current device)."""
    global _current, _previous
    cupy: Any = importlib.import_module("cupy")
    cuda = session.cuda
    if device is None:
        device = int(cupy.cuda.Device().id) if cuda is None else cuda.ordinal
    ordinal = device
    allocator = Allocator(session, cupy, ordinal, pinned)
    if _current is None:
        _previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(allocator.malloc)
    if pinned:
        cupy.cuda.set_pinned_memory_allocator(allocator.malloc_pinned)
    _current = allocator
    return allocator


def stop() -> None:
    """Give CuPy its own allocators back (arrays made meanwhile keep their blocks)."""
    global _current, _previous
    if _current is None:
        return
    cupy: Any = importlib.import_module("cupy")
    cupy.cuda.set_allocator(_previous)
    cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)
    _current, _previous = None, None


def held_by(session: object) -> tuple[list[Block], list[tuple[int, int]]]:
    """`Allocator.held` of the allocator CuPy uses, when it allocates from `session`; else
    nothing."""
    if _current is None or _current.session is not session:
        return [], []
    return _current.held()


def current() -> Allocator:
    if _current is None:
        raise RuntimeError("tidalpool.cupy.use(session) has not been called")
    return _current


@contextlib.contextmanager
def op(
    session: CupySession, reads: Sequence[Any] = (), writes: Sequence[Any] = (), name: str = "op"
) -> Iterator[tuple[Any, ...]]:
    """`Session.op` for CuPy arrays of the session: records the reads and writes and the op's
    time, and yields the arrays themselves (they are pinned, so they never move)."""
    blocks_r, blocks_w = blocks_of(session, reads), blocks_of(session, writes)
    with session.op(blocks_r, blocks_w, name):
        yield (*reads, *writes)


def blocks_of(session: CupySession, items: Sequence[Any]) -> list[Block]:
    """The blocks under `items`: tensors of `session`, CuPy arrays of it (allocated after
    `use(session)`) or blocks themselves; InvalidBlock for anything else."""
    blocks = []
    allocator = None
    for item in items:
        if isinstance(item, Block):
            blocks.append(item)
        elif isinstance(item, Tensor):
            blocks.append(item.block)
        else:
            if allocator is None:
                allocator = current()
                if allocator.session is not session:
                    raise InvalidBlock("tidalpool.cupy.use() was called for another session")
                allocator.collect()
            blocks.append(allocator.block_of(item))
    return blocks


def device_view(address: int, shape: tuple[int, ...], dtype: Any, lease: CudaLease) -> Any:
    """A CuPy array over `shape` x `dtype` at a device address of the lease; it owns nothing,
    and is valid as long as the bytes stay there (a tensor's: until its op ends)."""
    cp = importlib.import_module("cupy").cuda
    nbytes = max(math.prod(shape) * dtype.itemsize, 1)
    memory = cp.UnownedMemory(address, nbytes, None, lease.ordinal)
    return importlib.import_module("cupy").ndarray(shape, dtype, cp.MemoryPointer(memory, 0))
