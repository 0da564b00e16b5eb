"""Autograd's saved tensors kept in a session, where they can wait in the host lease.

PyTorch hands every tensor an op saves for backward to a pack hook, and gives what the hook
returned to the unpack hook when backward needs the tensor (`saved_tensors_hooks`). Here:

    forward    op saves t ──pack──▶ t's bytes copied into a session tensor; id = its place
                                    among this iteration's saves (0, 1, 2, ...)
    (between)  under the session's swap limit the swap engine moves those tensors out to the
               host lease, least recently used first (or each one right after its pack)
    backward   node needs t ──unpack──▶ the session tensor's bytes (brought in if out) copied
                                        into a new torch tensor, same dtype, shape and strides;
                                        the saves expected next are prefetched

A tensor saved twice (a ReLU's output is saved by the ReLU and by the layer after it) is copied
once, as long as it was not modified in between. Ids stay the same from one iteration to the
next, since a training step saves its tensors in the same order every time; the order backward
used them in the previous iteration says which to prefetch (before any iteration has been seen:
the reverse order of saving). Each pack and unpack is an op of the session and each saved
tensor a block, so the daemon learns this iteration like any other, and a swap schedule it
sends applies to these blocks.

On a cuda session the saves are CUDA tensors of the session's GPU: pack and unpack are
device-to-device copies between PyTorch's memory and the session's device lease (torch views of
the lease's bytes through `__cuda_array_interface__`; CuPy is not needed), and the swap engine
moves the session's copies to the pinned host lease and back on its own CUDA streams, ordered
against the compute stream (the default stream, which PyTorch's forward and backward use unless
told otherwise).

Before each pack and unpack, an op named `tidalpool.torch.compute` tells the daemon how long
the program computed since the previous one (`ComputeGaps`: wall time on the CPU, CUDA events on
a GPU), so that its swap schedule can hide copies behind that compute.

Kept as they are, not copied: parameters and views of them (they stay in memory anyway), tensors
on another device than the session's (CPU tensors on sim, CUDA tensors of its GPU on cuda),
non-strided, quantized, conjugate or negative-bit tensors, empty ones, those under
`min_bytes`, and those that do not fit (larger than the swap limit, or the lease is full: a
warning says so once). Iterations end at each step of the optimizer given (a step post-hook) or at
each `step()`. Iterations of several shapes (`step(shape)`, as `Session.step`) keep their save
orders and compute gaps apart, one set a shape, so each shape prefetches from its own last
iteration.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.optim import Optimizer

from tidalclient.errors import LeaseExceeded
from tidalclient.executors.base import HOST, LEAVING
from tidalclient.numpy import Tensor as SessionTensor
from tidalclient.session import Session
from tidalclient.torch.aten import span

log = logging.getLogger("tidalpool")

Offload = Literal["lru", "all"]


class SaveOrder:
    """Saves numbered by their order within an iteration, and the order backward used them.

    Pure bookkeeping: `save` numbers a save, `use` notes an unpack and names the saves
    expected next, `step` ends the iteration.
    """

    def __init__(self, lookahead: int) -> None:
        if lookahead < 0:
            raise ValueError(f"lookahead must not be negative, got {lookahead}")
        self.lookahead = lookahead
        self.saves = 0  # in this iteration
        self.uses: list[int] = []  # ids in the order this iteration unpacked them
        self.previous: list[int] = []  # the previous iteration's `uses`
        self._place: dict[int, int] = {}  # id -> its first place in `previous`

    def save(self) -> int:
        ident = self.saves
        self.saves += 1
        return ident

    def use(self, ident: int) -> list[int]:
        """Note that `ident` was unpacked; the ids that followed it last iteration (up to
        `lookahead` of them), or before one was seen, the `lookahead` saved before it."""
        self.uses.append(ident)
        place = self._place.get(ident)
        if place is not None:
            return self.previous[place + 1 : place + 1 + self.lookahead]
        if self.previous:
            return []  # a save the last iteration did not unpack: no guess
        return list(range(ident - 1, max(ident - 1 - self.lookahead, -1), -1))

    def step(self) -> None:
        self.previous, self.uses = self.uses, []
        self._place = {}
        for place, ident in enumerate(self.previous):
            self._place.setdefault(ident, place)
        self.saves = 0


COMPUTE_OP = "tidalpool.torch.compute"
"""The op a `SavedTensors` records before each of its packs and unpacks: the time since its
previous one, which is the model's own compute the session does not otherwise see."""


class ComputeGaps:
    """How long the program computed between consecutive saved-tensor hooks.

    On the CPU (sim) that is wall time, known at once. On a GPU the hooks run ahead of the
    kernels, so the time comes from CUDA events recorded on the current stream at each hook's
    end and the next one's start; they are read at a later iteration boundary, once done (never
    waited for), and the gap at position k of an iteration is reported from the latest
    iteration whose events are done (0 until one is).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._last_end: int | None = None  # sim: perf_counter_ns at the previous hook's end
        self._last_event: torch.cuda.Event | None = None  # cuda: recorded at that end
        Pair = tuple[int, torch.cuda.Event, torch.cuda.Event]  # position, previous end, start
        self._pairs: list[Pair] = []  # this iteration's
        self._pending: list[list[Pair]] = []  # earlier iterations', oldest first
        self._known: dict[int, int] = {}  # ns by position, from the latest finished iteration
        self._k = 0  # the next hook's position in the iteration

    def begin(self) -> int:
        """At a hook's start: the gap to report for it, in ns."""
        k, self._k = self._k, self._k + 1
        if not self.cuda:
            now = time.perf_counter_ns()
            return now - self._last_end if self._last_end is not None else 0
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        if self._last_event is not None:
            self._pairs.append((k, self._last_event, start))
        return self._known.get(k, 0)

    def end(self) -> None:
        """At a hook's end."""
        if not self.cuda:
            self._last_end = time.perf_counter_ns()
            return
        self._last_event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self._last_event.record()

    def step(self) -> None:
        """An iteration boundary (the gap across it, the optimizer's step, counts as the next
        iteration's first)."""
        self._k = 0
        if not self.cuda:
            return
        if self._pairs:
            self._pending.append(self._pairs)
            self._pairs = []
        while self._pending and all(_finished(start) for _, _, start in self._pending[0]):
            done = self._pending.pop(0)
            self._known = {k: round(a.elapsed_time(b) * 1e6) for k, a, b in done}
        del self._pending[:-2]  # at most two iterations in flight: older ones are dropped


def _finished(event: torch.cuda.Event) -> bool:
    """Whether the GPU has passed the event (no wait)."""
    return bool(event.query())  # type: ignore[no-untyped-call]


@dataclass(frozen=True, slots=True)
class SavedStats:
    saved: int  # tensors copied into the session
    saved_bytes: int  # their bytes (each a span of its storage: see `Saved`)
    shared: int  # saves of a tensor already saved (same object, unmodified): one copy serves
    kept: int  # tensors left as they were (parameters, small, not in host memory...)
    unpacked: int
    prefetches: int  # swap-ins started ahead of an unpack
    iterations: int  # boundaries marked (the first at `__enter__`)


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class Saved:
    """A saved tensor in the session: the bytes of its span of storage, from its first element
    to its last (so any strides come back as they were), and what rebuilds the view."""

    ident: int
    iteration: int
    tensor: SessionTensor
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    span: int  # elements


_active: ContextVar[tuple[SavedTensors, ...]] = ContextVar("tidalpool_saved", default=())


def innermost() -> SavedTensors | None:
    """The innermost `SavedTensors` active in this context (entered and not yet left)."""
    active = [saved for saved in _active.get() if saved._stack is not None]
    return active[-1] if active else None


class SavedTensors:
    """Keeps the tensors autograd saves in `session` while active (`with SavedTensors(...)`).

        with tidalpool.attach(..., swap_limit="256MiB") as session, SavedTensors(session, opt):
            for x, y in batches:
                loss_fn(model(x), y).backward()
                opt.step()  # marks the iteration boundary
                opt.zero_grad()

    It marks the session's iterations (do not also call `session.step()`): one at `__enter__`,
    then one after each step of `optimizer`, or at each `step()` without one. `offload`:
    "lru" leaves the swap limit to the session's LRU cache (the saves least recently used go
    out first: the earliest of the forward, which backward needs last); "all" also swaps out
    each save right after its pack (vDNN's offload-all). `lookahead`: saves prefetched at each
    unpack. `device`: PyTorch's index of the session's GPU (default: the lease's ordinal as
    this process numbers it). Without a swap limit nothing moves: the tensors just live in
    the lease.
    """

    def __init__(
        self,
        session: Session,
        optimizer: Optimizer | None = None,
        *,
        offload: Offload = "lru",
        lookahead: int = 2,
        min_bytes: int = 0,
        device: int | None = None,
    ) -> None:
        if offload not in ("lru", "all"):
            raise ValueError(f"offload must be 'lru' or 'all', got {offload!r}")
        if min_bytes < 0:
            raise ValueError(f"min_bytes must not be negative, got {min_bytes}")
        self.session = session
        # where the tensors it takes live: the CPU on sim, the session's GPU on cuda (PyTorch's
        # index for it: `device`, default the lease's ordinal in this process)
        if session.cuda is None:
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", session.cuda.ordinal if device is None else device)
        self.optimizer = optimizer
        self.gaps = ComputeGaps(self.device)
        self.offload = offload
        self.min_bytes = min_bytes
        self.order = SaveOrder(lookahead)
        self._shapes = {"": (self.order, self.gaps)}  # each shape's order and gaps
        self._current: dict[int, weakref.ref[Saved]] = {}  # this iteration's saves by id
        # id() of each tensor saved this iteration -> (the tensor, its version, its save)
        self._by_tensor: dict[int, tuple[weakref.ref[torch.Tensor], int, weakref.ref[Saved]]] = {}
        self._iteration = 0
        self._stack: ExitStack | None = None
        self._token: Token[tuple[SavedTensors, ...]] | None = None
        self._saved = self._saved_bytes = self._shared = self._kept = 0
        self._unpacked = self._prefetches = 0
        self._warned = False  # about a save that does not fit

    # -- the context --------------------------------------------------------------------------
    def __enter__(self) -> SavedTensors:
        if self._stack is not None:
            raise RuntimeError("this SavedTensors is already active")
        stack = ExitStack()
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        hooks.__enter__()  # per thread: only this thread can take them off (`__exit__`)
        thread = threading.get_ident()

        def unhook() -> None:
            if thread == threading.get_ident():
                hooks.__exit__(None, None, None)

        stack.callback(unhook)
        if self.optimizer is not None:
            stack.callback(self.optimizer.register_step_post_hook(lambda *_: self.step()).remove)
        self._token = _active.set((*_active.get(), self))
        self._stack = stack
        try:
            self.step()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop keeping saves. Left on another thread than the one that entered, that thread's
        hooks stay installed but keep every tensor as it is (saved_tensors_hooks are per
        thread, and only their own thread can remove them)."""
        stack, self._stack = self._stack, None
        token, self._token = self._token, None
        try:
            if token is not None:
                try:
                    _active.reset(token)
                except ValueError:  # left in another thread or context than entered
                    _active.set(tuple(x for x in _active.get() if x is not self))
        finally:
            if stack is not None:
                stack.close()

    def step(self, shape: str = "") -> None:
        """An iteration boundary: the session's, and where save ids start again from 0.
        `shape`: the shape of the iteration it begins (`Session.step`); its saves are ordered
        and timed against the last iteration of that shape."""
        self.session.step(shape)
        self.order.step()
        self.gaps.step()
        if shape not in self._shapes:
            self._shapes[shape] = (SaveOrder(self.order.lookahead), ComputeGaps(self.device))
        self.order, self.gaps = self._shapes[shape]
        self._current = {}
        self._by_tensor = {}
        self._iteration += 1

    def stats(self) -> SavedStats:
        return SavedStats(
            saved=self._saved,
            saved_bytes=self._saved_bytes,
            shared=self._shared,
            kept=self._kept,
            unpacked=self._unpacked,
            prefetches=self._prefetches,
            iterations=self._iteration,
        )

    # -- the hooks ------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Saved | torch.Tensor:
        """The pack hook: copy `t` into the session (or keep it: see the module doc)."""
        if self._stack is None or not self._offloadable(t):  # inactive: hooks left on a
            # thread that did not close it (saved_tensors_hooks are per thread) keep tensors
            self._kept += 1
            return t
        earlier = self._by_tensor.get(id(t))
        if earlier is not None:
            tensor_ref, version, saved_ref = earlier
            saved = saved_ref()
            if tensor_ref() is t and version == t._version and saved is not None:
                self._shared += 1  # e.g. a ReLU's output, saved by the ReLU and the next layer
                return saved
        self.session.record_op(COMPUTE_OP, self.gaps.begin())
        elements = span(t)
        nbytes = elements * t.element_size()
        try:
            held = self.session.tensor((nbytes,), "uint8")
        except LeaseExceeded as e:  # larger than the swap limit, or the lease is full
            self._kept += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "tidalpool: a saved tensor of %d bytes stays where it is: %s", nbytes, e
                )
            return t
        flat = t.detach().as_strided((elements,), (1,), t.storage_offset())
        with self.session.op(writes=[held.block], name="tidalpool.torch.pack") as (dst,):
            if self.device.type == "cuda":  # dst: the block's device address now
                with _on_compute_stream(self.device):
                    _device_bytes(dst, nbytes, self.device).copy_(flat.view(torch.uint8))
            else:  # a NumPy view of the block's bytes
                dst[:] = flat.view(torch.uint8).numpy()
        saved = Saved(
            self.order.save(), self._iteration, held, t.dtype, tuple(t.shape), t.stride(), elements
        )
        self._current[saved.ident] = weakref.ref(saved)
        self._by_tensor[id(t)] = (weakref.ref(t), t._version, weakref.ref(saved))
        self._saved += 1
        self._saved_bytes += nbytes
        residency = self.session.residency
        if self.offload == "all" and residency is not None:
            residency.swap_out(held.block)
        self.gaps.end()
        return saved

    def unpack(self, saved: Saved | torch.Tensor) -> torch.Tensor:
        """The unpack hook: the tensor back, bit for bit, with its strides; prefetches the
        saves expected next."""
        if isinstance(saved, torch.Tensor):
            return saved
        self._unpacked += 1
        self.session.record_op(COMPUTE_OP, self.gaps.begin())
        expected = self.order.use(saved.ident) if saved.iteration == self._iteration else []
        out = torch.empty(saved.span * saved.dtype.itemsize, dtype=torch.uint8, device=self.device)
        block = saved.tensor.block
        with self.session.op(reads=[block], name="tidalpool.torch.unpack") as (src,):
            self._prefetch(expected)  # while this one is locked on the device
            if self.device.type == "cuda":
                with _on_compute_stream(self.device):
                    out.copy_(_device_bytes(src, block.size, self.device))
            else:
                out.numpy()[:] = src
        self.gaps.end()
        return out.view(saved.dtype).as_strided(saved.shape, saved.stride)

    # -- helpers --------------------------------------------------------------------------------
    def _offloadable(self, t: torch.Tensor) -> bool:
        if t.device != self.device or t.layout != torch.strided or t.numel() == 0:
            return False
        if t.is_quantized or t.is_conj() or t.is_neg():
            return False
        base = t._base if t._base is not None else t
        if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad):
            return False  # a parameter (or a view of one): it stays in memory anyway
        return span(t) * t.element_size() >= self.min_bytes

    def _prefetch(self, idents: list[int]) -> None:
        residency = self.session.residency
        if residency is None:
            return  # every block stays on the device
        for ident in idents:
            ref = self._current.get(ident)
            saved = ref() if ref is not None else None
            if saved is None or residency.where(saved.tensor.block) not in (HOST, LEAVING):
                continue  # gone, or on the device
            try:
                residency.prefetch(saved.tensor.block)
            except LeaseExceeded:
                return  # no room now: it comes in when its unpack needs it
            self._prefetches += 1


class _CudaArray:
    """Device bytes as `__cuda_array_interface__` describes them (no CuPy needed). No stream:
    the session's op has ordered the swap engine's copies against the compute stream."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


@contextmanager
def _on_compute_stream(device: torch.device) -> Iterator[None]:
    """Order a copy between PyTorch's current stream and the session's bytes against the
    stream the swap engine orders its copies with (PyTorch's default stream): when the program
    runs on another stream, that stream first waits for the default one (a swap-in has landed)
    and the default one then waits for it (a swap-out reads the bytes written)."""
    current = torch.cuda.current_stream(device)
    default = torch.cuda.default_stream(device)
    if current == default:
        yield
        return
    current.wait_stream(default)
    yield
    default.wait_stream(current)


def _device_bytes(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over `nbytes` of device memory at `address` (it owns nothing)."""
    return torch.as_tensor(_CudaArray(address, nbytes), device=device)
