"""A CPU model's tensors in a paged session: any of them may leave the device between the ops
that use it and come back at the same address.

    with tidalpool.attach(..., swap_limit=L, page_bytes="64KiB") as session, \\
            tidalpool.torch.InPlace(session, model, optimizer):
        for x, y in batches:
            loss_fn(model(x), y).backward()
            optimizer.step()  # a step post-hook marks the iteration boundary
            optimizer.zero_grad()

What lives in the session, each tensor a block that keeps one address for its life (a paged
session: its pages move beneath it, its address does not, so PyTorch's pointers stay valid):

- parameters and buffers: at `__enter__` their bytes are copied in and `.data` points there;
- gradients: where PyTorch made a new one (the first backward, or after `zero_grad()` set it
  to None), a post-accumulate-grad hook copies it into the parameter's gradient block and sets
  `.grad` to it; where `.grad` is already that block, backward accumulates into it in place;
- the optimizer's state: after each step, state tensors it made are copied in;
- the tensors autograd saves for backward (with `saves`): a pack hook copies each into a new
  block (its span of storage, so its strides come back as they were); unpack hands that
  block's tensor to backward as it is, with no copy; the block is freed once autograd lets go.

How the uses are seen: a TorchDispatchMode watches every ATen op this thread runs while the
`InPlace` is active (the forward, the backward the autograd engine runs, the optimizer's step,
`zero_grad`, anything else). An op whose arguments view session tensors (views and metadata
aside) runs as a session op over their blocks (`Session.op`): those that are out come back and
are waited for, all stay on the device while the op runs, and those the op's schema writes
(in-place and `out=` ops) are recorded as written. So the daemon learns the whole iteration
(parameters, gradients, optimizer state and saves, each use an access at its op) and its plan
may swap any of these blocks between uses. Ops that view no session tensor are the model's
other compute: where some ran, the thread's time since the last session op ended (those ops,
and the Python around them: on the CPU the thread is the device) reaches the daemon as one op
(`tidalpool.torch.compute`) before the next session op, so its schedule can hide copies
behind it.

What is not seen: bytes read outside ATen ops (`.numpy()`, `data_ptr()` handed to other code)
and ops on another thread. A block that is out then is unmapped, and reading it faults
(SIGSEGV) instead of reading stale bytes. PyTorch's own working tensors (activations before
autograd saves them, temporaries) stay in its CPU memory, outside the session and its limit.

Costs: a Python call per ATen op (the mode), a copy per save, and a copy per gradient when
`zero_grad()` sets gradients to None (`zero_grad(set_to_none=False)` accumulates in place).
An optimizer whose step updates every parameter in one op (`foreach=True`) needs all of them,
their gradients and state on the device at once: that is then the least limit a plan can
have; per-parameter steps (`foreach=False`, PyTorch's default on the CPU) let them take turns.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils._python_dispatch import TorchDispatchMode

from tidalclient.errors import LeaseExceeded
from tidalclient.executors.base import Block, size_text
from tidalclient.numpy import view as numpy_view
from tidalclient.session import Session
from tidalclient.torch.aten import span, tensors_in, written
from tidalclient.torch.saved import COMPUTE_OP

log = logging.getLogger("tidalpool")

_BYTE = np.dtype(np.uint8)


@dataclass(frozen=True, slots=True)
class InPlaceStats:
    """What an `InPlace` holds in its session and what it has seen."""

    tensors: int  # parameters, buffers, gradients and optimizer state in the session now
    tensor_bytes: int
    saves: int  # tensors autograd saved, copied into the session so far
    save_bytes: int
    kept: int  # saves kept where they were (see `InPlace`)
    ops: int  # ATen ops run as session ops so far
    iterations: int


class _Watch(TorchDispatchMode):  # type: ignore[no-untyped-call]  # unannotated in PyTorch
    """Runs each ATen op on session tensors as a session op (see the module doc)."""

    def __init__(self, owner: InPlace) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.owner = owner

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func.is_view:  # no bytes touched
            return func(*args, **kwargs)
        return self.owner._run(func, args, kwargs)


class InPlace:
    """Keeps `model`'s tensors (and `optimizer`'s state, and with `saves` what autograd saves)
    in a paged sim `session` while active (`with InPlace(...)`); see the module doc.

    It marks the session's iterations (do not also call `session.step()`): one at
    `__enter__`, then one after each step of `optimizer`, or at each `step()` without one.
    `min_bytes`: saves and optimizer state tensors under it stay where they are. On leaving,
    every tensor it moved is copied back into PyTorch's memory, so the model and optimizer go
    on without the session; leave it before the session ends (a session that ended first took
    their bytes with it).
    """

    def __init__(
        self,
        session: Session,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        *,
        saves: bool = True,
        min_bytes: int = 0,
    ) -> None:
        if session.page_bytes == 0:
            raise ValueError(
                "InPlace needs a paged session (tidalpool.attach(..., swap_limit=...,"
                " page_bytes=...)): a tensor's block must keep its address while its pages move"
            )
        if session.cuda is not None:
            raise ValueError(
                "InPlace keeps CPU tensors of a sim session; on a cuda daemon use"
                " tidalpool.torch.attach(mode='planned')"
            )
        if min_bytes < 0:
            raise ValueError(f"min_bytes must not be negative, got {min_bytes}")
        self.session = session
        self.model = model
        self.optimizer = optimizer
        self.saves = saves
        self.min_bytes = min_bytes
        self._blocks: dict[int, Block] = {}  # storage address -> block of a live session tensor
        self._held: list[Block] = []  # the blocks of what it keeps until `__exit__`
        self._grads: dict[int, torch.Tensor] = {}  # id(parameter) -> its gradient's block
        self._by_tensor: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}
        self._thread: int | None = None
        self._undo: list[Callable[[], None]] = []
        self._since = time.perf_counter_ns()  # the end of the last session op (or step)
        self._gap_ops = 0  # ops on no session tensor since then
        self._closed = True
        self._warned = False
        self._ops = self._saved = self._saved_bytes = self._kept = self._iterations = 0

    # -- the context --------------------------------------------------------------------------
    def __enter__(self) -> InPlace:
        if not self._closed:
            raise RuntimeError("this InPlace is already active")
        self._closed = False
        self._thread = threading.get_ident()
        try:
            mode = _Watch(self)
            mode.__enter__()  # type: ignore[no-untyped-call]  # unannotated in PyTorch
            self._undo.append(lambda: mode.__exit__(None, None, None))  # type: ignore[no-untyped-call]
            self._take_model()
            if self.saves:
                hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                hooks.__enter__()
                self._undo.append(lambda: hooks.__exit__(None, None, None))
            if self.optimizer is not None:
                handle = self.optimizer.register_step_post_hook(lambda *_: self._after_step())
                self._undo.append(handle.remove)
                self._take_state()
            self.step()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop: the hooks and the mode come off (on the thread that entered), and every
        tensor moved into the session is copied back into PyTorch's memory and its block
        freed."""
        if self._closed:
            return
        if threading.get_ident() != self._thread:
            raise RuntimeError("leave an InPlace on the thread that entered it")
        self._closed = True
        try:
            while self._undo:  # the mode first in, last out
                self._undo.pop()()
        finally:
            self._give_back()

    def step(self, shape: str = "") -> None:
        """An iteration boundary, the session's (`Session.step(shape)`)."""
        self._flush_gap()
        self._by_tensor = {}  # the saves autograd let go of are garbage now, before the mark
        self.session.step(shape)
        self._iterations += 1
        self._since = time.perf_counter_ns()

    def block_of(self, t: torch.Tensor) -> Block:
        """The session block under a tensor this `InPlace` holds (a parameter, buffer,
        gradient, optimizer state or save, or a view of one): to pin it, prefetch it or swap
        it out through `session.residency`. KeyError for any other tensor."""
        block = self._block(t)
        if block is None:
            raise KeyError("this tensor is not in the session")
        return block

    def stats(self) -> InPlaceStats:
        return InPlaceStats(
            tensors=len(self._held),
            tensor_bytes=sum(block.size for block in self._held),
            saves=self._saved,
            save_bytes=self._saved_bytes,
            kept=self._kept,
            ops=self._ops,
            iterations=self._iterations,
        )

    # -- the mode's work -------------------------------------------------------------------------
    def _run(self, func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        reads: dict[int, Block] = {}
        for t in tensors_in((args, kwargs)):
            if (block := self._block(t)) is not None:
                reads[block.id] = block
        if not reads:  # the model's other compute
            self._gap_ops += 1
            return func(*args, **kwargs)
        writes: dict[int, Block] = {}
        for t in written(func, args, kwargs):
            if (block := self._block(t)) is not None and block.id in reads:
                writes[block.id] = reads.pop(block.id)
        self._flush_gap()
        self._ops += 1
        try:
            with self.session.op(list(reads.values()), list(writes.values()), name=str(func)):
                return func(*args, **kwargs)
        except LeaseExceeded as e:  # its blocks cannot all be on the device at once
            need = sum(b.size for b in (*reads.values(), *writes.values()))
            raise LeaseExceeded(
                f"{func} needs {size_text(need)} of session tensors on the device at once"
                f" ({len(reads) + len(writes)} blocks): {e}. Raise the swap limit, or make the"
                " op touch less (an optimizer with foreach=False steps a parameter at a time)"
            ) from e
        finally:
            self._since = time.perf_counter_ns()

    def _flush_gap(self) -> None:
        """Tell the daemon how long this thread computed since the last session op ended, where
        it ran ops on no session tensor: on the CPU the thread is the device, so its time
        between session ops (those ops, the mode's and the program's Python) is compute."""
        if self._gap_ops:
            self.session.record_op(COMPUTE_OP, time.perf_counter_ns() - self._since)
            self._gap_ops = 0

    # -- session tensors --------------------------------------------------------------------------
    def _new(self, like: torch.Tensor, keep: bool) -> torch.Tensor:
        """A session tensor with `like`'s dtype, shape and strides, holding its bytes (copied
        by a session op). `keep`: held until `__exit__`; else its block goes back once PyTorch
        lets go of its storage. LeaseExceeded when it cannot have a block."""
        elements = span(like)
        nbytes = elements * like.element_size()
        block = self.session.malloc(nbytes)
        address = self.session.address(block)  # a paged session's block: its address for life
        array = numpy_view(address, (nbytes,), _BYTE)
        flat = torch.from_numpy(array)
        self._blocks[address] = block
        if keep:
            self._held.append(block)
        else:
            weakref.finalize(array, self._gone, address)  # the storage holds the array
        source = like.detach().as_strided((elements,), (1,), like.storage_offset())
        flat.copy_(source.view(torch.uint8))  # the mode runs it as a session op
        return flat.view(like.dtype).as_strided(like.shape, like.stride())

    def _gone(self, address: int) -> None:
        """PyTorch let go of a save's storage: its block goes back at the session's next op."""
        block = self._blocks.pop(address, None)
        if block is not None and not self._closed:
            self.session.bury(block)

    def _block(self, t: torch.Tensor) -> Block | None:
        """The block of a session tensor this `InPlace` made (or a view of one); None for any
        other tensor."""
        try:
            address = t.untyped_storage().data_ptr()
        except (NotImplementedError, RuntimeError):  # no storage (sparse, nested)
            return None
        return self._blocks.get(address)

    def _fits(self, t: torch.Tensor) -> bool:
        """A dense CPU tensor with bytes, which the session can hold."""
        return (
            t.device.type == "cpu"
            and t.layout == torch.strided
            and t.numel() > 0
            and not (t.is_quantized or t.is_conj() or t.is_neg())
        )

    def _take_model(self) -> None:
        for name, p in self.model.named_parameters():
            if not self._fits(p):
                raise ValueError(
                    f"parameter {name} is not a dense CPU tensor: InPlace cannot hold it"
                )
            try:
                p.data = self._new(p.data, keep=True)
            except LeaseExceeded as e:
                raise LeaseExceeded(f"parameter {name}: {e}") from e
            if p.grad is not None:
                self._take_grad(p)
            if p.requires_grad:
                handle = p.register_post_accumulate_grad_hook(self._take_grad)  # type: ignore[no-untyped-call]
                self._undo.append(handle.remove)
        for module in self.model.modules():
            for name, b in list(module._buffers.items()):
                if b is not None and self._fits(b):
                    module._buffers[name] = self._new(b, keep=True)

    def _take_grad(self, p: torch.Tensor) -> None:
        """After accumulation: a gradient PyTorch made goes into the parameter's block."""
        g = p.grad
        if g is None or self._block(g) is not None:
            return
        mine = self._grads.get(id(p))
        if mine is None or mine.shape != g.shape or mine.stride() != g.stride():
            mine = self._grads[id(p)] = self._new(g, keep=True)
        else:
            mine.copy_(g)  # a session op
        p.grad = mine

    def _take_state(self) -> None:
        """Optimizer state tensors not in the session yet (made by a step) go in."""
        assert self.optimizer is not None
        for state in self.optimizer.state.values():
            for key, value in list(state.items()):
                if (
                    isinstance(value, torch.Tensor)
                    and self._fits(value)
                    and self._block(value) is None
                    and value.numel() * value.element_size() >= self.min_bytes
                ):
                    state[key] = self._new(value, keep=True)

    def _after_step(self) -> None:
        self._take_state()
        self.step()

    # -- autograd's saves -------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """The pack hook: `t` copied into a new block, or `t` itself where it is in the
        session already (a parameter) or is not kept there."""
        if self._closed or not self._fits(t) or self._block(t) is not None:
            return t
        nbytes = span(t) * t.element_size()
        if nbytes < self.min_bytes:
            self._kept += 1
            return t
        earlier = self._by_tensor.get(id(t))
        if earlier is not None:
            ref, version, saved = earlier
            if ref() is t and version == t._version:
                return saved  # saved twice, unchanged (a ReLU's output, by it and the next op)
        try:
            saved = self._new(t, keep=False)
        except LeaseExceeded as e:  # larger than the swap limit, or the lease is full
            self._kept += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "tidalpool: a saved tensor of %d bytes stays where it is: %s", nbytes, e
                )
            return t
        self._by_tensor[id(t)] = (weakref.ref(t), t._version, saved)
        self._saved += 1
        self._saved_bytes += nbytes
        return saved

    @staticmethod
    def _unpack(saved: torch.Tensor) -> torch.Tensor:
        """The unpack hook: the save's tensor as it is (the ops that use it bring it in)."""
        return saved

    # -- leaving ----------------------------------------------------------------------------------
    def _give_back(self) -> None:
        """Every held tensor's bytes back in PyTorch's memory, its block freed."""
        moved: dict[int, torch.Tensor] = {}  # block id -> a plain copy of its bytes

        def plain(t: torch.Tensor) -> torch.Tensor:
            block = self._block(t)
            if block is None:
                return t
            if block.id not in moved:
                with self.session.op(reads=[block], name="tidalpool.torch.give_back") as (src,):
                    moved[block.id] = torch.from_numpy(np.array(src, copy=True))
            flat = moved[block.id]
            return flat.view(t.dtype).as_strided(t.shape, t.stride(), 0)

        if self.session.closed and self._held:
            log.warning(
                "tidalpool: the session ended before InPlace was left: the %d tensors it held"
                " in it (the model's parameters among them) lost their bytes",
                len(self._held),
            )
        if not self.session.closed:
            for p in self.model.parameters():
                p.data = plain(p.data)
                if p.grad is not None:
                    p.grad = plain(p.grad)
            for module in self.model.modules():
                for name, b in list(module._buffers.items()):
                    if b is not None:
                        module._buffers[name] = plain(b)
            if self.optimizer is not None:
                for state in self.optimizer.state.values():
                    for key, value in list(state.items()):
                        if isinstance(value, torch.Tensor):
                            state[key] = plain(value)
            for block in self._held:
                self._blocks.pop(self.session.address(block), None)
                self.session.free(block)
        self._held.clear()
        self._grads.clear()
        self._by_tensor = {}
