"""NumPy arrays over lease memory (the sim backend's device memory is host memory).

Each array stands on a small owner object that holds its block and exposes the
block through `__array_interface__`; the block is freed when the owner dies,
that is, when the array and every view of it are gone (or at once by
`Session.release`).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from tidalpool.errors import InvalidBlock
from tidalpool.executor import Block

if TYPE_CHECKING:
    from tidalpool.session import Session


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
    """An uninitialized array of `shape` and `dtype` in the session's lease."""
    dims = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimension in shape {dims}")
    kind = np.dtype(dtype)
    if kind.hasobject:
        raise TypeError(f"dtype {kind} holds Python objects; lease memory holds plain data only")
    nbytes = max(math.prod(dims) * kind.itemsize, 1)
    block = session.malloc(nbytes)
    return np.asarray(_Owner(session, block, dims, kind))


def _owner_of(arr: np.ndarray[Any, Any]) -> _Owner | None:
    base: Any = arr
    while base is not None:
        if isinstance(base, _Owner):
            return base
        base = getattr(base, "base", None)
    return None


def block_of(arr: Any) -> Block:
    """The block under a session array (InvalidBlock for any other object)."""
    owner = _owner_of(arr) if isinstance(arr, np.ndarray) else None
    if owner is None:
        raise InvalidBlock(f"{type(arr).__name__} is not an array of a tidalpool session")
    return owner.block


def release(session: Session, arr: np.ndarray[Any, Any]) -> None:
    """Free the array's block now; the array must not be used afterwards."""
    owner = _owner_of(arr)
    if owner is None:
        raise InvalidBlock("this array is not an array of a tidalpool session")
    if owner.session is not session:
        raise InvalidBlock(f"block {owner.block.id} belongs to another session")
    owner.finalizer.detach()
    session.free(owner.block)
