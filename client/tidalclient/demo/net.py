"""A small MLP whose every array comes from a `Memory`: the demo's training workload (NumPy, or
CuPy on a GPU).

The network (64 -> width -> width -> 10 by default, more hidden layers with `depth`; ReLU,
softmax cross-entropy, plain SGD, float32) is written out kernel by kernel so that the memory
holding it sees the tide of training: weights and gradients live for the whole run, activations
from forward until their use in backward, temporaries for one or two kernels. What `Memory.array`
returns is a handle: kernels compute only on the arrays `Memory.op` yields for it, so that a
memory may move its bytes between ops (swapping).

Determinism: every result depends only on the values and shapes of the inputs, never on where the
arrays lie nor on the thread count. Every kernel is one of NumPy's own single-threaded loops, which
sum in index order: element-wise ufuncs compute each element alone, float32 sums use pairwise
summation by index, the softmax max is exact in any order, the float64 loss only picks one exact
value per row, and the matrix products go through `np.einsum` rather than BLAS (see `_matmul`).
Hence `train(PlainMemory())` and `train(m)` for any other conforming `m` give equal losses.

On a GPU the views a memory yields are CuPy arrays: the same `np.*` calls run CuPy's kernels
(CuPy implements NumPy's `__array_ufunc__` and `__array_function__` protocols), host data is
copied in by `_upload`, and the products go through cuBLAS. CuPy's kernels depend on the values
and shapes too, not on the addresses, so `train(CupyMemory())` and a session's CuPy memory give
equal losses (not equal to NumPy's: cuBLAS sums in another order than einsum).
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt
from tidalcore.pages import owns_pages, pages_of

from tidalclient.executors.bestfit import BestFit

Array: TypeAlias = npt.NDArray[Any]
DType: TypeAlias = np.dtype[Any] | type[Any]
Handle: TypeAlias = Any
"""What `Memory.array` returns: an array (PlainMemory) or a handle of a memory that may move its
bytes (a session's Tensor). It has `.shape` and `.nbytes`; its data is reached only in an op."""

FEATURES = 64
CLASSES = 10
LEARNING_RATE = 0.1
N_BATCHES = 4  # fixed batches, cycled
NOISE = 2.0  # std of the blobs around their centres (N(0, 1) per feature), before scaling


class Memory(Protocol):
    """Where the training code gets every array, and what it tells about their use."""

    def array(self, shape: tuple[int, ...], dtype: DType) -> Handle:
        """An uninitialized C-contiguous array (like `np.empty`), or a handle of one."""
        ...

    def release(self, arr: Handle) -> None:
        """`arr` (what this memory returned) is no longer needed."""
        ...

    def op(
        self, name: str, reads: Sequence[Handle], writes: Sequence[Handle]
    ) -> contextlib.AbstractContextManager[tuple[Array, ...]]:
        """Wraps one computation (a kernel) that reads and writes these; yields the arrays to
        compute on, one per handle, reads then writes, valid until the op ends."""
        ...

    def step(self) -> None:
        """Iteration boundary: called at the start of every iteration."""
        ...


class PlainMemory:
    """Plain NumPy: `np.empty`, and nothing else to do."""

    def array(self, shape: tuple[int, ...], dtype: DType) -> Array:
        return np.empty(shape, dtype=dtype)

    def release(self, arr: Array) -> None:
        pass

    def op(
        self, name: str, reads: Sequence[Array], writes: Sequence[Array]
    ) -> contextlib.AbstractContextManager[tuple[Array, ...]]:
        return contextlib.nullcontext((*reads, *writes))

    def step(self) -> None:
        pass


class CupyMemory:
    """Plain CuPy (`cupy.empty` from CuPy's own memory pool): the baseline on a GPU."""

    def __init__(self) -> None:
        self._cp: Any = _cupy()

    def array(self, shape: tuple[int, ...], dtype: DType) -> Handle:
        return self._cp.empty(shape, dtype=dtype)

    def release(self, arr: Handle) -> None:
        pass

    def op(
        self, name: str, reads: Sequence[Array], writes: Sequence[Array]
    ) -> contextlib.AbstractContextManager[tuple[Array, ...]]:
        return contextlib.nullcontext((*reads, *writes))

    def step(self) -> None:
        pass


@dataclass(frozen=True)
class Dataset:
    """Unit-variance Gaussian blobs in host memory, the data loader's side."""

    inputs: Array  # (N_BATCHES, batch, FEATURES) float32
    targets: Array  # (N_BATCHES, batch, CLASSES) float32, one-hot


def make_dataset(seed: int, batch: int) -> Dataset:
    """`N_BATCHES` fixed batches of `CLASSES` Gaussian blobs, the same for the same seed."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0]))
    centres = rng.standard_normal((CLASSES, FEATURES))
    labels = rng.integers(0, CLASSES, size=(N_BATCHES, batch))
    noise = rng.standard_normal((N_BATCHES, batch, FEATURES))
    inputs = ((centres[labels] + NOISE * noise) / np.sqrt(1 + NOISE**2)).astype(np.float32)
    targets = np.zeros((N_BATCHES, batch, CLASSES), dtype=np.float32)
    np.put_along_axis(targets, labels[..., None], np.float32(1), axis=2)
    return Dataset(inputs, targets)


@dataclass(frozen=True)
class Linear:
    """A fully connected layer: weight (fan_in, fan_out), bias and their gradients."""

    name: str
    weight: Handle
    bias: Handle
    grad_weight: Handle
    grad_bias: Handle


def _linear_create(
    mem: Memory, name: str, fan_in: int, fan_out: int, gain: float, rng: np.random.Generator
) -> Linear:
    """Weights N(0, gain / fan_in) (He for gain 2), bias 0, gradients left uninitialized."""
    layer = Linear(
        name,
        mem.array((fan_in, fan_out), np.float32),
        mem.array((fan_out,), np.float32),
        mem.array((fan_in, fan_out), np.float32),
        mem.array((fan_out,), np.float32),
    )
    with mem.op(f"{name}.init", reads=[], writes=[layer.weight, layer.bias]) as (w, b):
        _upload(w, rng.standard_normal(w.shape, dtype=np.float32))
        np.multiply(w, np.float32(np.sqrt(gain / fan_in)), out=w)
        b.fill(0)
    return layer


def _matmul(a: Array, b: Array, out: Array) -> None:
    """out = a @ b. NumPy: in its own loop, bit-identical for any alignment and any thread count
    (OpenBLAS sgemm, np.matmul, is alignment-independent too, but measured with OpenBLAS 0.3.31 it
    gives other bits with 1 thread than with 2 or more; einsum costs ~1 ms per 128x256x256
    product). CuPy: cuBLAS, whose results depend on the shapes, not on where the arrays lie."""
    if isinstance(out, np.ndarray):
        np.einsum("ik,kj->ij", a, b, out=out)
    else:
        _cupy().matmul(a, b, out=out)


def _cupy() -> Any:
    return importlib.import_module("cupy")


def _upload(dst: Array, src: Array) -> None:
    """dst[...] = src from host memory (a copy to the GPU when dst is a CuPy array)."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        dst.set(src)


def _linear_forward(mem: Memory, layer: Linear, x: Handle) -> Handle:
    z = mem.array((x.shape[0], layer.weight.shape[1]), np.float32)
    with mem.op(f"{layer.name}.forward", reads=[x, layer.weight, layer.bias], writes=[z]) as (
        x_,
        w,
        b,
        z_,
    ):
        _matmul(x_, w, out=z_)
        np.add(z_, b, out=z_)
    return z


def _linear_backward_weight(mem: Memory, layer: Linear, x: Handle, dz: Handle) -> None:
    """Fills the layer's gradients from its input x and the gradient dz of its output."""
    grads = [layer.grad_weight, layer.grad_bias]
    with mem.op(f"{layer.name}.backward_weight", reads=[x, dz], writes=grads) as (x_, dz_, gw, gb):
        _matmul(x_.T, dz_, out=gw)
        np.sum(dz_, axis=0, out=gb)


def _linear_backward_data(mem: Memory, layer: Linear, dz: Handle) -> Handle:
    """The gradient of the layer's input."""
    dx = mem.array((dz.shape[0], layer.weight.shape[0]), np.float32)
    with mem.op(f"{layer.name}.backward_data", reads=[dz, layer.weight], writes=[dx]) as (
        dz_,
        w,
        dx_,
    ):
        _matmul(dz_, w.T, out=dx_)
    return dx


def _relu_forward(mem: Memory, name: str, z: Handle) -> Handle:
    """h = max(z, 0); z dies here (backward uses h > 0 as the mask)."""
    h = mem.array(z.shape, np.float32)
    with mem.op(f"{name}.forward", reads=[z], writes=[h]) as (z_, h_):
        np.maximum(z_, np.float32(0), out=h_)
    mem.release(z)
    return h


def _relu_backward(mem: Memory, name: str, h: Handle, dh: Handle) -> Handle:
    """dz = dh * (h > 0); h and dh die here."""
    mask = mem.array(h.shape, np.bool_)
    with mem.op(f"{name}.mask", reads=[h], writes=[mask]) as (h_, mask_):
        np.greater(h_, np.float32(0), out=mask_)
    mem.release(h)
    dz = mem.array(h.shape, np.float32)
    with mem.op(f"{name}.backward", reads=[dh, mask], writes=[dz]) as (dh_, mask_, dz_):
        np.multiply(dh_, mask_, out=dz_)
    mem.release(mask)
    mem.release(dh)
    return dz


def _softmax(mem: Memory, logits: Handle) -> Handle:
    """Row-wise softmax with the max subtracted; logits die here."""
    rows = (logits.shape[0], 1)
    peak = mem.array(rows, np.float32)
    with mem.op("softmax.max", reads=[logits], writes=[peak]) as (logits_, peak_):
        np.max(logits_, axis=1, keepdims=True, out=peak_)
    exps = mem.array(logits.shape, np.float32)
    with mem.op("softmax.exp", reads=[logits, peak], writes=[exps]) as (logits_, peak_, exps_):
        np.subtract(logits_, peak_, out=exps_)
        np.exp(exps_, out=exps_)
    mem.release(peak)
    mem.release(logits)
    total = mem.array(rows, np.float32)
    with mem.op("softmax.sum", reads=[exps], writes=[total]) as (exps_, total_):
        np.sum(exps_, axis=1, keepdims=True, out=total_)
    probs = mem.array(logits.shape, np.float32)
    with mem.op("softmax.normalize", reads=[exps, total], writes=[probs]) as (
        exps_,
        total_,
        probs_,
    ):
        np.divide(exps_, total_, out=probs_)
    mem.release(exps)
    mem.release(total)
    return probs


def _cross_entropy(mem: Memory, probs: Handle, targets: Handle) -> float:
    """Mean negative log-likelihood, in float64 from the float32 probabilities."""
    batch: int = probs.shape[0]
    picked = mem.array(probs.shape, np.float64)
    nll = mem.array((batch,), np.float64)
    total = mem.array((), np.float64)
    with mem.op("loss", reads=[probs, targets], writes=[picked, nll, total]) as (
        probs_,
        targets_,
        picked_,
        nll_,
        total_,
    ):
        np.multiply(probs_, targets_, out=picked_)  # exact: targets are 0 or 1
        np.sum(picked_, axis=1, out=nll_)  # exact: one non-zero per row
        np.maximum(nll_, np.finfo(np.float64).tiny, out=nll_)  # a probability of 0 costs 708
        np.log(nll_, out=nll_)
        np.sum(nll_, out=total_)
        loss = -float(total_[()]) / batch
    for arr in (picked, nll, total):
        mem.release(arr)
    return loss


class MLP:
    """64 -> width -> ... -> width -> 10 with `depth` hidden layers and ReLU; parameters and
    gradients live as long as it does."""

    def __init__(self, mem: Memory, width: int, seed: int, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, not {depth}")
        rng = np.random.default_rng(np.random.SeedSequence([seed, 1]))
        sizes = (FEATURES, *[width] * depth, CLASSES)
        self.layers = [
            _linear_create(
                mem, f"fc{i + 1}", fan_in, fan_out, 2.0 if fan_out != CLASSES else 1.0, rng
            )
            for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes))
        ]

    def train_step(self, mem: Memory, inputs: Array, targets: Array) -> float:
        """Forward, backward and SGD update on one host batch; returns the batch's loss."""
        *hidden, head = self.layers
        x = mem.array(inputs.shape, np.float32)
        t = mem.array(targets.shape, np.float32)
        with mem.op("load_batch", reads=[], writes=[x, t]) as (x_, t_):
            _upload(x_, inputs)
            _upload(t_, targets)

        acts = [x]  # acts[i]: the input of hidden layer i (x, then each ReLU's output)
        for i, layer in enumerate(hidden):
            acts.append(_relu_forward(mem, f"relu{i + 1}", _linear_forward(mem, layer, acts[i])))
        probs = _softmax(mem, _linear_forward(mem, head, acts[-1]))
        loss = _cross_entropy(mem, probs, t)

        dlogits = mem.array(probs.shape, np.float32)
        with mem.op("softmax_xent.backward", reads=[probs, t], writes=[dlogits]) as (
            probs_,
            t_,
            dlogits_,
        ):
            np.subtract(probs_, t_, out=dlogits_)
            np.multiply(dlogits_, np.float32(1.0 / probs.shape[0]), out=dlogits_)
        mem.release(probs)
        mem.release(t)

        _linear_backward_weight(mem, head, acts[-1], dlogits)
        dh = _linear_backward_data(mem, head, dlogits)
        mem.release(dlogits)
        for i in reversed(range(len(hidden))):
            dz = _relu_backward(mem, f"relu{i + 1}", acts[i + 1], dh)
            _linear_backward_weight(mem, hidden[i], acts[i], dz)
            if i > 0:
                dh = _linear_backward_data(mem, hidden[i], dz)
            mem.release(dz)  # no dx for the first layer: x is data
        mem.release(x)

        lr = np.float32(LEARNING_RATE)
        for layer in self.layers:
            params = [layer.weight, layer.bias, layer.grad_weight, layer.grad_bias]
            with mem.op(f"{layer.name}.sgd", reads=params, writes=params) as views:
                w, b, gw, gb = views[4:]  # the writes (the reads are the same four)
                for param, grad in ((w, gw), (b, gb)):
                    np.multiply(grad, lr, out=grad)
                    np.subtract(param, grad, out=param)
        return loss


def train(
    mem: Memory,
    iterations: int = 20,
    seed: int = 0,
    on_iteration: Callable[[int, float], None] | None = None,
    width: int = 256,
    batch: int = 128,
    depth: int = 2,
) -> list[float]:
    """Trains a fresh MLP for `iterations` steps; returns the loss of each (0-based) iteration.

    The model's parameters and gradients are obtained before the first `step()`; every other
    array is obtained and released within one iteration. `on_iteration(i, loss)` follows each.
    """
    data = make_dataset(seed, batch)
    model = MLP(mem, width, seed, depth)
    losses: list[float] = []
    for i in range(iterations):
        mem.step()
        k = i % N_BATCHES
        loss = model.train_step(mem, data.inputs[k], data.targets[k])
        losses.append(loss)
        if on_iteration is not None:
            on_iteration(i, loss)
    return losses


class _CountingMemory:
    """Another memory (PlainMemory by default) that counts the bytes of arrays obtained and not
    yet released."""

    def __init__(self, base: Memory | None = None) -> None:
        self.base: Memory = PlainMemory() if base is None else base
        self.live = 0
        self.peak = 0

    def array(self, shape: tuple[int, ...], dtype: DType) -> Handle:
        arr = self.base.array(shape, dtype)
        self.live += arr.nbytes
        self.peak = max(self.peak, self.live)
        return arr

    def release(self, arr: Handle) -> None:
        self.live -= arr.nbytes
        self.base.release(arr)

    def op(
        self, name: str, reads: Sequence[Handle], writes: Sequence[Handle]
    ) -> contextlib.AbstractContextManager[tuple[Array, ...]]:
        return self.base.op(name, reads, writes)

    def step(self) -> None:
        self.base.step()


def peak_live_bytes(
    iterations: int = 2,
    *,
    seed: int = 0,
    width: int = 256,
    batch: int = 128,
    depth: int = 2,
    base: Memory | None = None,
) -> int:
    """Peak bytes live at once (persistent parameters and gradients included) during `train`,
    run on `base` (PlainMemory by default; CupyMemory to measure it on a GPU)."""
    mem = _CountingMemory(base)
    train(mem, iterations, seed=seed, width=width, batch=batch, depth=depth)
    return mem.peak


def persistent_bytes(
    *, seed: int = 0, width: int = 256, batch: int = 128, depth: int = 2, base: Memory | None = None
) -> int:
    """Bytes of the parameters and gradients: what stays live between iterations."""
    mem = _CountingMemory(base)
    train(mem, 1, seed=seed, width=width, batch=batch, depth=depth)
    return mem.live


class _OpMemory(PlainMemory):
    """Plain NumPy that notes the op whose arrays take the most bytes at once."""

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.largest: tuple[str, int] = ("", 0)

    def op(
        self, name: str, reads: Sequence[Array], writes: Sequence[Array]
    ) -> contextlib.AbstractContextManager[tuple[Array, ...]]:
        sizes = {id(arr): arr.nbytes for arr in (*reads, *writes)}  # an array read and written
        nbytes = sum(-(-size // self.alignment) * self.alignment for size in sizes.values())
        if nbytes > self.largest[1]:
            self.largest = (name, nbytes)
        return super().op(name, reads, writes)


class _PagedOpMemory(PlainMemory):
    """Plain NumPy that notes the op needing the most pages at once in a paged session: its
    page-owning arrays' whole pages, and every page a live packed array lies on (packed arrays
    never leave the device), packed as the session places them online."""

    def __init__(self, page: int) -> None:
        self.page = page
        self._fit = BestFit(1 << 40)  # the session's online placement of packed blocks
        self._packed: dict[int, tuple[int, int]] = {}  # id(array) -> (offset, pages' range end)
        self._pages: collections.Counter[int] = collections.Counter()  # page -> packed arrays
        self.largest: tuple[str, int] = ("", 0)

    def array(self, shape: tuple[int, ...], dtype: DType) -> Array:
        arr = super().array(shape, dtype)
        if not owns_pages(arr.nbytes, self.page):
            offset = self._fit.allocate(arr.nbytes)
            assert offset is not None
            first, last = offset // self.page, (offset + arr.nbytes - 1) // self.page
            self._packed[id(arr)] = (offset, last + 1)
            self._pages.update(range(first, last + 1))
        return arr

    def release(self, arr: Array) -> None:
        found = self._packed.pop(id(arr), None)
        if found is not None:
            offset, end = found
            self._fit.release(offset)
            self._pages.subtract(range(offset // self.page, end))
            self._pages += collections.Counter()  # drop the pages no array is on

    def op(
        self, name: str, reads: Sequence[Array], writes: Sequence[Array]
    ) -> contextlib.AbstractContextManager[tuple[Array, ...]]:
        owning = {id(a): a.nbytes for a in (*reads, *writes) if owns_pages(a.nbytes, self.page)}
        nbytes = sum(pages_of(n, self.page) for n in owning.values())
        nbytes += len(self._pages) * self.page
        if nbytes > self.largest[1]:
            self.largest = (name, nbytes)
        return super().op(name, reads, writes)


def largest_op(
    *,
    alignment: int,
    seed: int = 0,
    width: int = 256,
    batch: int = 128,
    depth: int = 2,
    page: int | None = None,
) -> tuple[str, int]:
    """The op of `train` whose arrays take the most bytes at once, each rounded up to
    `alignment` as a session places it, and those bytes: an op's arrays are all on the device
    while it runs, so no swap limit below them lets the network train. With `page`, a paged
    session's: the op's page-owning arrays in whole pages and every page of the packed ones
    live then (they never leave)."""
    mem: _OpMemory | _PagedOpMemory = _OpMemory(alignment) if page is None else _PagedOpMemory(page)
    # Every op runs each step; a second one places the packed arrays among the first's.
    train(mem, 1 if page is None else 2, seed=seed, width=width, batch=batch, depth=depth)
    return mem.largest
