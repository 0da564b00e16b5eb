"""Every allocation, free, access and kernel of PyTorch code run on the meta device.

A `Capture` is a TorchDispatchMode: it sees each ATen op below autograd (the forward's, the
backward's the autograd engine runs, the optimizer's) with its arguments and results, which on
the meta device have shapes, dtypes and storages but no bytes.

    op ──▶ frees since the last op ──▶ run ──▶ allocs of new storages, reads, writes, op

- A block is a storage: every tensor viewing it shares its bytes, and the allocator gives and
  takes storages. A storage first seen among an op's results is allocated by that op (one first
  seen among its arguments was made before the capture: allocated then, where it is first seen).
- Sizes are the storage's bytes rounded up to 512, as the CUDA caching allocator rounds every
  request (`round_size`, kMinBlockSize); a storage of 0 bytes is no allocation.
- A free is when a storage's bytes go, whoever held the last reference: Python, autograd's saved
  tensors, the optimizer's state. The capture holds a C++ weak reference to each live storage
  (the one `torch.multiprocessing` uses): it keeps the storage's address from being reused, not
  its bytes alive, and it expires exactly when the storage is freed. Expiry is checked before
  every op and at every iteration boundary, so a free comes before the allocations of the next
  op, as the allocator sees it. (Finalizers on tensors would not do: many tensors share one
  storage, and some are made in C++ where Python never sees them, such as the tensor autograd
  keeps for a saved output, a new TensorImpl over the output's storage.)
- Accesses: an op reads every storage among its arguments and writes each one it allocates and
  each argument its schema marks as written (in-place and `out=` ops). An op that writes nothing
  on the device (a view, `detach`, a metadata query, host-side work, `empty`) launches no kernel
  and is not recorded (its allocations are). Host tensors are not blocks; an op that reads one
  is a copy from the host.
- Durations: `Roofline.op_ns` of the op's FLOPs and bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from tidalclient.torch.aten import tensors_in, written
from tidalcore.events import ALLOC, FREE, ITER, OP, READ, WRITE, Events
from torch.utils._python_dispatch import TorchDispatchMode

from tidaloffline.torch.roofline import Roofline, flops, tensor_bytes

GRANULE = 512
"""The CUDA caching allocator rounds every request up to a multiple of 512 bytes."""


def round_size(nbytes: int) -> int:
    """Bytes the CUDA caching allocator hands out for a request of `nbytes` (> 0)."""
    return max(GRANULE, math.ceil(nbytes / GRANULE) * GRANULE)


@dataclass(slots=True)
class _Live:
    block: int
    nbytes: int  # the storage's bytes when allocated (a resize is a free and a new alloc)
    ref: int  # a C++ weak reference (torch.UntypedStorage._weak_ref)


_ALLOCATE_ONLY = frozenset(
    {
        torch.ops.aten.empty,
        torch.ops.aten.empty_like,
        torch.ops.aten.empty_strided,
        torch.ops.aten.new_empty,
        torch.ops.aten.new_empty_strided,
    }
)
"""Ops that allocate and launch no kernel: their results are allocated, not written."""


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's storage, None for tensors without one (sparse, nested)."""
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None


def _weak_ref(s: torch.UntypedStorage) -> int:
    """A C++ weak reference to the storage (an integer handle; free it with _free_weak_ref)."""
    return cast(int, s._weak_ref())


def _free_weak_ref(ref: int) -> None:
    torch.UntypedStorage._free_weak_ref(ref)  # type: ignore[no-untyped-call]  # unannotated


class Capture(TorchDispatchMode):  # type: ignore[no-untyped-call]  # unannotated in PyTorch
    """Records the events of the code run under it (`with capture:`); `events()` has them.

    `persistent` allocates blocks for tensors made before (parameters, buffers);
    `begin_iteration` marks where an iteration starts. Call `close` when done: it lets go of
    the weak references.
    """

    def __init__(self, roofline: Roofline) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.roofline = roofline
        self._live: dict[int, _Live] = {}  # StorageImpl address -> live block
        self._refs: dict[int, int] = {}  # StorageImpl address -> its weak reference
        self._blocks = 0
        self._ops = 0
        self._iterations = 0
        self._names: dict[str, int] = {}
        self._kinds: list[int] = []
        self._ids: list[int] = []
        self._sizes: list[int] = []
        self._ns: list[int] = []
        self._name_ids: list[int] = []
        self.compute_ns = 0
        """The estimated ns of every kernel recorded so far."""

    # -- what the caller marks --------------------------------------------------------------
    def persistent(self, tensors: Iterable[torch.Tensor]) -> None:
        """Allocate the blocks of tensors made before recording (once per storage)."""
        for t in tensors:
            if t.device.type == "meta" and (s := _storage(t)) is not None:
                self._block(s)

    def begin_iteration(self, shape: str = "") -> None:
        """Record the frees so far, then the start of the next iteration (numbered from 0),
        named by its shape (none for "")."""
        self.settle()
        name_id = self._names.setdefault(shape, len(self._names) + 1) if shape else 0
        self._event(ITER, self._iterations, 0, 0, name_id)
        self._iterations += 1

    def settle(self) -> None:
        """Record a free for every block whose storage has gone since the last look."""
        expired = torch.UntypedStorage._expired  # called for every live block before each op
        gone = [key for key, ref in self._refs.items() if expired(ref)]
        for key in gone:
            self._free(key)

    def events(self) -> Events:
        names = {i: name for name, i in self._names.items()}
        return Events(
            kinds=np.array(self._kinds, np.uint8),
            block_ids=np.array(self._ids, np.uint64),
            sizes=np.array(self._sizes, np.int64),
            durations_ns=np.array(self._ns, np.int64),
            name_ids=np.array(self._name_ids, np.uint32),
            names=names,
        )

    @property
    def allocated(self) -> int:
        """Blocks allocated so far (block ids are 0, 1, ... in allocation order)."""
        return self._blocks

    def block_of(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(block id, rounded bytes) of the live block a meta tensor views; None for others."""
        if t.device.type != "meta" or (s := _storage(t)) is None:
            return None
        live = self._live.get(cast(int, s._cdata))
        return None if live is None else (live.block, round_size(live.nbytes))

    def close(self) -> None:
        """Let go of every weak reference (the blocks still live stay live in the events)."""
        for live in self._live.values():
            _free_weak_ref(live.ref)
        self._live.clear()
        self._refs.clear()

    # -- the mode -------------------------------------------------------------------------------
    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        self.settle()
        out = func(*args, **kwargs)
        self._op(func, args, kwargs, out)
        return out

    def _op(
        self, func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any], out: Any
    ) -> None:
        reads: dict[int, None] = {}  # ordered sets of block ids
        writes: dict[int, None] = {}
        nbytes = 0
        from_host = False
        for t in tensors_in((args, kwargs)):
            nbytes += tensor_bytes(t)
            if t.device.type != "meta":
                from_host = from_host or t.device.type == "cpu"
            elif (s := _storage(t)) is not None and (block := self._block(s)) is not None:
                reads[block] = None
        for t in written(func, args, kwargs):
            if t.device.type == "meta" and (s := _storage(t)) is not None:
                block = self._block(s)
                if block is not None:
                    writes[block] = None
        dtype = None
        for t in tensors_in(out):
            nbytes += tensor_bytes(t)
            dtype = dtype or t.dtype
            if t.device.type != "meta" or (s := _storage(t)) is None:
                continue
            new = cast(int, s._cdata) not in self._live
            block = self._block(s)
            if new and block is not None and func.overloadpacket not in _ALLOCATE_ONLY:
                writes[block] = None
        if not writes:
            return
        for block in reads:
            self._event(READ, block)
        for block in writes:
            self._event(WRITE, block)
        for t in tensors_in((args, kwargs)):
            dtype = dtype or t.dtype
        work = flops(func, args, kwargs, out)
        ns = self.roofline.op_ns(work, nbytes, dtype, from_host)
        name = str(func)
        name_id = self._names.setdefault(name, len(self._names) + 1)
        self._event(OP, self._ops, 0, ns, name_id)
        self._ops += 1
        self.compute_ns += ns

    # -- blocks -----------------------------------------------------------------------------------
    def _block(self, s: torch.UntypedStorage) -> int | None:
        """The block of a storage, allocated now if it is new (or resized); None for 0 bytes."""
        key = cast(int, s._cdata)
        nbytes = s.nbytes()
        live = self._live.get(key)
        if live is not None:
            if live.nbytes == nbytes:
                return live.block
            self._free(key)
        if nbytes == 0:
            return None
        block = self._blocks
        self._blocks += 1
        ref = _weak_ref(s)
        self._live[key] = _Live(block, nbytes, ref)
        self._refs[key] = ref
        self._event(ALLOC, block, round_size(nbytes))
        return block

    def _free(self, key: int) -> None:
        live = self._live.pop(key)
        del self._refs[key]
        _free_weak_ref(live.ref)
        self._event(FREE, live.block, round_size(live.nbytes))

    def _event(self, kind: int, ident: int, size: int = 0, ns: int = 0, name_id: int = 0) -> None:
        self._kinds.append(kind)
        self._ids.append(ident)
        self._sizes.append(size)
        self._ns.append(ns)
        self._name_ids.append(name_id)
