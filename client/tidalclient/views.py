"""What an op sees of its blocks: NumPy arrays over a sim lease, CuPy arrays on a GPU.

    Session.op(reads, writes) ──blocks_of──▶ blocks ──residency.begin_op──▶ offsets
                              ◀──view(item, block, address)── one array (or address) per item

`HostViews` (sim: the device lease is host memory) yields NumPy arrays: a session array as it
is, a tensor's bytes as its shape and dtype, a raw block as uint8. `CudaViews` (the device lease
is GPU memory) yields CuPy arrays over a tensor's bytes, a raw block's device address, and the
session's own CuPy arrays as they are; it refuses NumPy views of the lease.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn, Protocol

from tidalcore.chunks import ChunkMapping

from tidalclient import cupy, numpy
from tidalclient.devices.lease import CudaLease
from tidalclient.devices.pages import SimPageSpace
from tidalclient.errors import NotHostMemory
from tidalclient.executors.base import Block


class Views(Protocol):
    """How a session's blocks look to the code that computes on them."""

    def need_host_memory(self, what: str) -> None:
        """NotHostMemory when `what` (a NumPy view of the lease) cannot be had here."""
        ...

    def blocks_of(self, items: Sequence[Any]) -> list[Block]:
        """The blocks under an op's items (InvalidBlock for an item that is none of them)."""
        ...

    def view(self, item: Any, block: Block, address: int) -> Any:
        """What an op yields for `item`, whose `block` is at `address` now."""
        ...

    def buffer(self, block: Block, offset: int) -> memoryview:
        """The block's bytes at `offset` (sim only): in the lease, or in a paged session's
        range."""
        ...


class HostViews:
    """NumPy arrays over a lease mapped in this process's memory (the sim backend)."""

    def __init__(self, device: ChunkMapping | SimPageSpace) -> None:
        self._device = device  # the lease as one mapping, or a paged session's range

    def need_host_memory(self, what: str) -> None:
        """The lease is host memory: nothing to refuse."""

    def blocks_of(self, items: Sequence[Any]) -> list[Block]:
        return [item if isinstance(item, Block) else numpy.block_of(item) for item in items]

    def view(self, item: Any, block: Block, address: int) -> Any:
        if item is block:
            return numpy.view(address, (block.size,), numpy.BYTE)
        if isinstance(item, numpy.Tensor):
            return numpy.view(address, item.shape, item.dtype)
        return item  # a session array: pinned, it is where it always was

    def buffer(self, block: Block, offset: int) -> memoryview:
        return self._device.buffer(offset, block.size)


class CudaViews:
    """CuPy arrays over a lease of GPU memory (the cuda backend)."""

    def __init__(self, session: cupy.CupySession, lease: CudaLease) -> None:
        self._session = session
        self._lease = lease

    def need_host_memory(self, what: str) -> NoReturn:
        raise NotHostMemory(
            f"Session.{what}() views the lease with NumPy, but this session's device lease"
            f" is GPU memory (cuda backend, GPU {self._lease.pci_bus_id}): use"
            " tidalpool.cupy.use(session) and CuPy arrays, and tidalpool.cupy.op()"
        )

    def blocks_of(self, items: Sequence[Any]) -> list[Block]:
        return cupy.blocks_of(self._session, items)

    def view(self, item: Any, block: Block, address: int) -> Any:
        if isinstance(item, numpy.Tensor):
            return cupy.device_view(address, item.shape, item.dtype, self._lease)
        return address if item is block else item  # a CuPy array of the session: as it is

    def buffer(self, block: Block, offset: int) -> NoReturn:
        self.need_host_memory("buffer")
