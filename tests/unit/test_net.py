"""The demo network learns, is bit-identical wherever its arrays lie, and uses Memory right."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from tidalclient.demo import net
from tidalclient.demo.net import Array, DType, PlainMemory, peak_live_bytes, persistent_bytes, train

ALIGN = 256
F, C = net.FEATURES, net.CLASSES


class ArenaMemory(PlainMemory):
    """A bump allocator over one big uint8 buffer filled with 0xFF (NaN as float32, so a read of
    memory never written shows in the loss); blocks `align`-aligned, starting `skew` bytes past a
    256-byte boundary. Nothing is reused: every iteration gets fresh addresses (20 take 24.4 MB)."""

    def __init__(self, size: int = 32 << 20, align: int = ALIGN, skew: int = 0) -> None:
        raw = np.full(size + 2 * ALIGN, 0xFF, dtype=np.uint8)
        start = (-raw.ctypes.data) % ALIGN + skew
        self.buf = raw[start : start + size]
        self.align = align
        self.top = 0

    def array(self, shape: tuple[int, ...], dtype: DType) -> Array:
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        offset = self.top
        self.top += -(-max(nbytes, 1) // self.align) * self.align
        if self.top > self.buf.size:
            raise MemoryError("arena exhausted")
        return self.buf[offset : offset + nbytes].view(dt).reshape(shape)


class RecordingMemory(PlainMemory):
    """Checks each call as it comes; arrays are known by identity (kept alive, so ids stay unique).

    Iteration -1 is model creation (before the first step)."""

    def __init__(self) -> None:
        self.arrays: dict[int, Array] = {}
        self.obtained_in: dict[int, int] = {}
        self.released_in: dict[int, int] = {}
        self.written: set[int] = set()
        self.iteration = -1
        self.live_at_step: list[int] = []
        self.in_op = False
        self.ops = 0

    def live(self) -> int:
        return len(self.arrays) - len(self.released_in)

    def array(self, shape: tuple[int, ...], dtype: DType) -> Array:
        arr = super().array(shape, dtype)
        self.arrays[id(arr)] = arr
        self.obtained_in[id(arr)] = self.iteration
        return arr

    def _check_live(self, arr: Array, what: str) -> None:
        assert self.arrays.get(id(arr)) is arr, f"{what}: an array this memory did not return"
        assert id(arr) not in self.released_in, f"{what}: array used after its release"

    def release(self, arr: Array) -> None:
        self._check_live(arr, "release")
        assert not self.in_op, "release inside an op"
        self.released_in[id(arr)] = self.iteration

    @contextlib.contextmanager
    def _op(
        self, name: str, reads: Sequence[Array], writes: Sequence[Array]
    ) -> Iterator[tuple[Array, ...]]:
        assert not self.in_op, f"{name}: nested op"
        for arr in reads:
            self._check_live(arr, f"{name} reads")
            assert id(arr) in self.written, f"{name} reads an array never written"
        for arr in writes:
            self._check_live(arr, f"{name} writes")
        self.in_op = True
        yield (*reads, *writes)
        self.in_op = False
        self.written.update(id(arr) for arr in writes)
        self.ops += 1

    def op(
        self, name: str, reads: Sequence[Array], writes: Sequence[Array]
    ) -> contextlib.AbstractContextManager[tuple[Array, ...]]:
        return self._op(name, reads, writes)

    def step(self) -> None:
        assert not self.in_op, "step inside an op"
        self.live_at_step.append(self.live())
        self.iteration += 1


@pytest.fixture(scope="module")
def plain_losses() -> list[float]:
    return train(PlainMemory())


def test_loss_falls(plain_losses: list[float]) -> None:
    # Measured (NumPy 2.4): 2.8578514986726 at iteration 0, 0.4678785127663745 at iteration 19.
    assert len(plain_losses) == 20
    assert 2.8 < plain_losses[0] < 2.9
    assert plain_losses[-1] < 0.5
    assert plain_losses[-1] < plain_losses[0] / 5


def test_on_iteration_gets_each_loss(plain_losses: list[float]) -> None:
    seen: list[tuple[int, float]] = []
    losses = train(PlainMemory(), iterations=3, on_iteration=lambda i, x: seen.append((i, x)))
    assert seen == list(enumerate(losses))
    assert losses == plain_losses[:3]


def test_two_plain_runs_are_equal(plain_losses: list[float]) -> None:
    assert train(PlainMemory()) == plain_losses


@pytest.mark.parametrize("skew", [0, 4, 64])
def test_arena_is_bit_identical_to_plain(plain_losses: list[float], skew: int) -> None:
    # skew 0: 256-byte-aligned blocks; 4 and 64: only 4- and 64-byte-aligned addresses.
    arena = ArenaMemory(skew=skew)
    assert train(arena) == plain_losses
    assert arena.top > 0


class MovingMemory(PlainMemory):
    """Handles that are not arrays; every op computes on fresh copies at new addresses, and only
    what it writes is copied back. A kernel that touched a handle, or wrote to an array it did not
    declare as written, would fail or change the losses."""

    class Handle:
        def __init__(self, shape: tuple[int, ...], dtype: DType) -> None:
            self.stored = np.empty(shape, dtype=dtype)
            self.shape = shape
            self.nbytes = self.stored.nbytes

    def __init__(self) -> None:
        self.ops = 0

    def array(self, shape: tuple[int, ...], dtype: DType) -> Handle:  # type: ignore[override]
        return MovingMemory.Handle(shape, dtype)

    def release(self, arr: Handle) -> None:  # type: ignore[override]
        arr.stored = None  # type: ignore[assignment]

    @contextlib.contextmanager
    def _op(self, reads: Sequence[Handle], writes: Sequence[Handle]) -> Iterator[tuple[Array, ...]]:
        views = tuple(h.stored.copy() for h in (*reads, *writes))
        yield views
        for h, v in zip(writes, views[len(reads) :], strict=True):
            h.stored[...] = v
        self.ops += 1

    def op(  # type: ignore[override]
        self, name: str, reads: Sequence[Handle], writes: Sequence[Handle]
    ) -> contextlib.AbstractContextManager[tuple[Array, ...]]:
        return self._op(reads, writes)


def test_kernels_compute_only_on_the_arrays_op_yields(plain_losses: list[float]) -> None:
    mem = MovingMemory()
    assert train(mem) == plain_losses
    assert mem.ops == 3 + 20 * 24


def test_deeper_networks_train_on_any_conforming_memory() -> None:
    # depth 4: 5 linear layers; each hidden layer adds 7 ops per iteration (linear forward,
    # ReLU forward, mask and backward, weight and data gradients, SGD) and 1 at creation.
    moving = MovingMemory()
    losses = train(moving, iterations=6, depth=4, width=64, batch=32)
    assert moving.ops == 5 + 6 * (24 + 2 * 7)
    assert train(ArenaMemory(skew=4), iterations=6, depth=4, width=64, batch=32) == losses
    assert losses[-1] < losses[0]
    # Two more hidden layers keep two more activations (and their weights) live at the peak.
    shallow = peak_live_bytes(width=64, batch=32)
    deep = peak_live_bytes(width=64, batch=32, depth=4)
    more_params = 2 * 2 * (64 * 64 + 64) * 4  # two layers' weights, biases and gradients
    assert deep >= shallow + more_params + 2 * 32 * 64 * 4


def test_a_network_needs_a_hidden_layer() -> None:
    with pytest.raises(ValueError, match="depth must be at least 1, not 0"):
        train(PlainMemory(), iterations=1, depth=0)


def test_loss_does_not_depend_on_thread_count(plain_losses: list[float]) -> None:
    # OpenBLAS 0.3.31 gives other bits with 1 thread than with 2 or more; the network must not
    # use it. Two fresh processes (1 and 4 threads) run concurrently and print their losses.
    # (With np.matmul even iteration 0 differs, so two iterations suffice.)
    code = "from tidalclient.demo.net import *; print(*(x.hex() for x in train(PlainMemory(), 2)))"
    runs = []
    for threads in ("1", "4"):
        env = dict(os.environ, PYTHONPATH=str(Path(net.__file__).parents[2]))
        env.update(dict.fromkeys(("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"), threads))
        runs.append(
            subprocess.Popen(
                [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    for run in runs:
        out, _ = run.communicate(timeout=60)
        assert run.returncode == 0
        assert out.split() == [x.hex() for x in plain_losses[:2]]


def test_memory_protocol_usage() -> None:
    mem = RecordingMemory()
    iterations = 3
    train(mem, iterations=iterations, width=32, batch=16)

    persistent = {i for i, it in mem.obtained_in.items() if it == -1}
    assert len(persistent) == 12  # weight, bias and their gradients for 3 layers
    assert not persistent & mem.released_in.keys()
    # Every other array is released exactly once (a second release fails in _check_live),
    # in the iteration that obtained it.
    temporaries = mem.arrays.keys() - persistent
    assert temporaries == mem.released_in.keys()
    assert all(mem.released_in[i] == mem.obtained_in[i] for i in temporaries)
    assert len(temporaries) == iterations * 21
    assert mem.iteration == iterations - 1  # step() once per iteration
    assert mem.live_at_step == [12] * iterations
    assert mem.live() == 12
    assert mem.ops == 3 + iterations * 24


def _persistent(width: int) -> int:
    params = F * width + width + width * width + width + width * C + C
    return 2 * 4 * params  # float32 parameters and their gradients


@pytest.mark.parametrize(("width", "batch"), [(256, 128), (64, 32)])
def test_peak_live_bytes_formula(width: int, batch: int) -> None:
    # The peak is in relu2's backward: x (B x F) and h1, dh2, dz2 (B x W) in float32 and the bool
    # mask (B x W) are live; h2 was released once the mask was made.
    activations = batch * (4 * (F + 3 * width) + width)
    assert persistent_bytes(width=width, batch=batch) == _persistent(width)
    assert peak_live_bytes(width=width, batch=batch) == _persistent(width) + activations


def test_peak_live_bytes_default() -> None:
    assert persistent_bytes() == 680_016
    assert peak_live_bytes() == 680_016 + 458_752 == 1_138_768
