"""NumPy arrays over lease memory (the sim backend's device memory is host memory).

Each array stands on a small owner object that holds its block and exposes the
block through `__array_interface__`; the block is freed when the owner dies,
that is, when the array and every view of it are gone (or at once by
`Session.release`). An array holds an address, so its block is pinned: it is
never swapped out.

A `Tensor` holds no address: its block may wait in the host lease between ops
and come back elsewhere. Code computes on the views `Session.op` yields, valid
until the op ends.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from tidalclient.errors import InvalidBlock
from tidalclient.executors.base import Block, Executor, Residency


class Session(Protocol):
    """What arrays and tensors need of the session whose lease holds them (a `Session`)."""

    @property
    def executor(self) -> Executor: ...

    @property
    def residency(self) -> Residency | None: ...

    def malloc(self, nbytes: int) -> Block: ...

    def free(self, block: Block) -> None: ...

    def address(self, block: Block) -> int: ...

    def bury(self, block: Block) -> None: ...


class _Owner:
    """Keeps a block alive for the arrays built on it."""

    __slots__ = ("__array_interface__", "__weakref__", "block", "finalizer", "session")

    def __init__(
        self, session: Session, block: Block, shape: tuple[int, ...], dtype: np.dtype[Any]
    ) -> None:
        self.session = session
        self.block = block
        self.__array_interface__ = {
            "shape": shape,
            "typestr": dtype.str,
            "descr": dtype.descr,
            "data": (session.address(block), False),
            "version": 3,
        }
        self.finalizer = weakref.finalize(self, _free_quietly, session, block)


def _free_quietly(session: Session, block: Block) -> None:
    with contextlib.suppress(InvalidBlock):  # released explicitly before the array died
        session.free(block)


def array(
    session: Session, shape: int | Sequence[int], dtype: npt.DTypeLike = "float32"
) -> np.ndarray[Any, Any]:
    """An uninitialized array of `shape` and `dtype` in the session's lease (pinned)."""
    dims, kind, nbytes = _layout(shape, dtype)
    block = session.malloc(nbytes)
    if session.residency is not None:  # it holds an address: never swapped out
        session.residency.pin(block)
    return np.asarray(_Owner(session, block, dims, kind))


BYTE = np.dtype(np.uint8)


class _View:
    """Exposes `shape` and `dtype` at `address` to NumPy; holds nothing alive."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self.__array_interface__ = {
            "shape": shape,
            "typestr": dtype.str,
            "data": (address, False),
            "version": 3,
        }
        if dtype.fields is not None:  # a record: its fields (building them costs microseconds)
            self.__array_interface__["descr"] = dtype.descr


def view(address: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """An array over the bytes at `address` (valid while they stay there)."""
    return np.asarray(_View(address, shape, dtype))


class Tensor:
    """An array of a session whose bytes may move: its shape, dtype and block.

    Freed when the tensor is garbage (at the session's next op, tensor or step) or by
    `Session.release`. Compute on the views `Session.op` yields.
    """

    __slots__ = ("__weakref__", "block", "dtype", "finalizer", "nbytes", "shape")

    def __init__(self, session: Session, shape: int | Sequence[int], dtype: npt.DTypeLike) -> None:
        dims, kind, nbytes = _layout(shape, dtype)
        self.shape = dims
        self.dtype = kind
        self.nbytes = math.prod(dims) * kind.itemsize
        self.block = session.malloc(nbytes)
        self.finalizer = weakref.finalize(self, session.bury, self.block)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, block={self.block.id})"


def _layout(
    shape: int | Sequence[int], dtype: npt.DTypeLike
) -> tuple[tuple[int, ...], np.dtype[Any], int]:
    """Dimensions, dtype and block bytes (at least 1) of an array; errors for bad ones."""
    dims = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimension in shape {dims}")
    kind = np.dtype(dtype)
    if kind.hasobject:
        raise TypeError(f"dtype {kind} holds Python objects; lease memory holds plain data only")
    return dims, kind, max(math.prod(dims) * kind.itemsize, 1)


def _owner_of(arr: np.ndarray[Any, Any]) -> _Owner | None:
    base: Any = arr
    while base is not None:
        if isinstance(base, _Owner):
            return base
        base = getattr(base, "base", None)
    return None


def block_of(arr: Any) -> Block:
    """The block under a session array or tensor (InvalidBlock for any other object)."""
    if isinstance(arr, Tensor):
        return arr.block
    owner = _owner_of(arr) if isinstance(arr, np.ndarray) else None
    if owner is None:
        raise InvalidBlock(f"{type(arr).__name__} is not an array of a tidalpool session")
    return owner.block


def release(session: Session, arr: np.ndarray[Any, Any] | Tensor) -> None:
    """Free the array's or tensor's block now; it must not be used afterwards."""
    if isinstance(arr, Tensor):
        if arr.block.session != session.executor.session:
            raise InvalidBlock(f"block {arr.block.id} belongs to another session")
        arr.finalizer.detach()
        session.free(arr.block)
        return
    owner = _owner_of(arr)
    if owner is None:
        raise InvalidBlock("this array is not an array of a tidalpool session")
    if owner.session is not session:
        raise InvalidBlock(f"block {owner.block.id} belongs to another session")
    owner.finalizer.detach()
    session.free(owner.block)
