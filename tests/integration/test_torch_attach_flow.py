"""tidalpool.torch.attach's wiring without a GPU: a real sim daemon and real native sessions,
with PyTorch's CUDA entry points replaced by recorders (they need a GPU). What is checked: which
PyTorch calls each mode makes and with what, that the optimizer hook steps the sessions, that a
swap limit sends autograd's saved tensors (CPU tensors here) through a second session under that
limit with bit-identical losses, that close undoes all of it, and the refusals."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

torch = pytest.importorskip("torch")

import tidalpool  # noqa: E402
import tidalpool.torch as tt  # noqa: E402
from tidalclient.hotpath import (  # noqa: E402
    ALLOC_SYMBOL,
    FREE_SYMBOL,
    HotPath,
    library_path,
    record_stream_address,
)
from tidalclient.local import LocalDaemon  # noqa: E402
from tidalclient.status import fetch  # noqa: E402
from tidalclient.torch import allocator, oom  # noqa: E402

from ..conftest import StartDaemon  # noqa: E402

BUS = "00000000:18:00.0"
nn = torch.nn


@dataclass
class FakeLease:  # what attach reads of a cuda session's lease
    ordinal: int = 0
    pci_bus_id: str = BUS


class FakeCxxAllocator:  # torch._C._CUDAPluggableAllocator
    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls

    def set_record_stream_fn(self, address: int) -> None:
        self.calls.append(("set_record_stream_fn", address))


class FakePluggable:
    calls: ClassVar[list[tuple[Any, ...]]] = []  # FakeCuda points it at its own log

    def __init__(self, path: str, alloc: str, free: str) -> None:
        self.args = (path, alloc, free)
        self.cxx = FakeCxxAllocator(self.calls)

    def allocator(self) -> FakeCxxAllocator:
        return self.cxx


class FakePool:
    calls: ClassVar[list[tuple[Any, ...]]] = []  # FakeCuda points it at its own log

    def __init__(self, cxx_allocator: FakeCxxAllocator) -> None:
        self.cxx_allocator = cxx_allocator
        self.id = (7, 8)

    def __del__(self) -> None:  # PyTorch's empties the pool's cache: into a configured lease?
        self.calls.append(("pool_deleted", HotPath(0).stats().iteration))


class FakeCuda:
    """PyTorch's CUDA entry points attach uses, recording each call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.initialized = False
        self.pci = (0, 0x18, 0)  # domain, bus, device
        calls = self.calls

        def change(a: FakePluggable) -> None:
            if self.initialized:
                raise RuntimeError("Can't swap an already initialized allocator")
            calls.append(("change_current_allocator", a.args))

        def properties(index: int) -> Any:
            names = ("pci_domain_id", "pci_bus_id", "pci_device_id")
            return type("Props", (), dict(zip(names, self.pci, strict=True)))()

        m = monkeypatch
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "device_count", lambda: 1)
        m.setattr(torch.cuda, "get_device_properties", properties)
        m.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", device)))
        m.setattr(FakePluggable, "calls", calls)
        m.setattr(torch.cuda.memory, "CUDAPluggableAllocator", FakePluggable)
        m.setattr(torch.cuda.memory, "change_current_allocator", change)
        m.setattr(torch.cuda, "MemPool", FakePool)
        m.setattr(FakePool, "calls", calls)
        m.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
        for name in ("_cuda_beginAllocateToPool", "_cuda_endAllocateToPool", "_cuda_releasePool"):
            m.setattr(torch._C, name, lambda d, i, name=name: calls.append((name, d, i)))
        m.setattr(allocator, "on_failure", lambda h: calls.append(("on_failure", h)))
        m.setattr(allocator, "order_streams", lambda f: calls.append(("order_streams", f)))
        m.setattr(allocator, "cuda_stream_functions", lambda: (11, 12, 13, 14))
        real_attach = allocator.session_attach

        def attach(*args: Any, **kwargs: Any) -> tidalpool.Session:
            session = real_attach(*args, **kwargs)
            if kwargs.get("allocator") == "native":
                session.cuda = FakeLease()  # type: ignore[assignment]
            return session

        m.setattr(allocator, "session_attach", attach)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[FakeCuda]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # where planned mode builds its shim
    fake = FakeCuda(monkeypatch)
    yield fake
    attached = tt.current()
    if attached is not None:
        attached.close()


@pytest.fixture
def daemon(start_daemon: StartDaemon) -> LocalDaemon:
    return start_daemon()


def model_and_data() -> tuple[Any, Any, Any, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt, torch.randn(32, 64), torch.randint(0, 10, (32,))


def train(model: Any, opt: Any, x: Any, y: Any, steps: int = 4) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_planned_mode_replaces_the_allocator_and_swaps_saves_under_the_limit(
    cuda: FakeCuda, daemon: LocalDaemon
) -> None:
    reference = train(*model_and_data())
    model, opt, x, y = model_and_data()
    tp = tt.attach(
        daemon.socket_dir, mode="planned", optimizer=opt, swap_limit="40KiB", host_limit="1MiB"
    )
    assert tt.current() is tp
    assert cuda.calls[:4] == [
        ("set_record_stream_fn", record_stream_address()),  # Tensor.record_stream honoured
        ("change_current_allocator", (str(library_path()), ALLOC_SYMBOL, FREE_SYMBOL)),
        ("on_failure", oom.handler()),  # c10::OutOfMemoryError from the cached shim
        ("order_streams", (11, 12, 13, 14)),
    ]
    losses = train(model, opt, x, y)
    stats = tp.stats()
    assert losses == reference  # the saves went out to the host lease and came back exact
    assert stats.mode == "planned"
    assert stats.native.iteration == 1 + 4  # attach, then each optimizer step
    assert stats.saved is not None and stats.saved.iterations == 1 + 4
    assert stats.saves_session is not None and stats.saves_session.swap is not None
    swap = stats.saves_session.swap
    assert swap.limit == 40 * 1024 and swap.peak_resident_bytes <= swap.limit
    assert swap.swapped_out_bytes > 0 and swap.swapped_in_bytes > 0
    tp.close()
    assert ("sync", 0) in cuda.calls
    assert tt.current() is None
    opt.step()  # the hook is gone: nothing steps a closed session
    assert HotPath(0).alloc(256) is None  # the native device forgot the lease
    assert not fetch(daemon.socket_dir)[1].sessions  # both sessions detached


def test_pool_mode_routes_the_device_to_a_pool_over_the_library_until_close(
    cuda: FakeCuda, daemon: LocalDaemon
) -> None:
    tp = tt.attach(daemon.socket_dir, mode="pool")
    assert cuda.calls == [
        ("on_failure", None),  # the caching allocator checks NULL itself
        ("order_streams", None),
        ("_cuda_beginAllocateToPool", 0, (7, 8)),
    ]
    assert tp.stats().saved is None
    tp.step()
    assert tp.stats().native.iteration == 2
    tp.close()
    assert cuda.names()[-4:] == [
        "sync",
        "_cuda_endAllocateToPool",
        "_cuda_releasePool",
        "pool_deleted",
    ]
    assert cuda.calls[-1] == ("pool_deleted", 2)  # dropped while the lease was still configured


def test_a_step_names_the_shape_of_the_iteration_it_begins(
    cuda: FakeCuda, daemon: LocalDaemon
) -> None:
    tp = tt.attach(daemon.socket_dir, mode="pool")
    seen: list[str] = []
    stepped = tp.session.step

    def step(shape: str = "") -> None:
        seen.append(shape)
        stepped(shape)

    tp.session.step = step  # type: ignore[method-assign]
    tp.step("4x128")
    tt.step("8x128")  # the attached session's, as tp.step
    tp.step()
    assert seen == ["4x128", "8x128", ""]
    assert tp.stats().native.iteration == 4
    tp.close()


def test_planned_mode_after_cuda_init_is_refused_and_leaves_no_session(
    cuda: FakeCuda, daemon: LocalDaemon
) -> None:
    cuda.initialized = True
    with pytest.raises(tt.TorchAttachError, match="before PyTorch initializes CUDA"):
        tt.attach(daemon.socket_dir, mode="planned")
    assert tt.current() is None
    assert not fetch(daemon.socket_dir)[1].sessions
    HotPath(0).configure(1 << 30, 4096)  # the native device is free again
    HotPath(0).reset()


def test_planned_mode_refuses_cudnn_benchmark(
    cuda: FakeCuda, daemon: LocalDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    with pytest.raises(
        tt.TorchAttachError, match=r"cannot serve torch\.backends\.cudnn\.benchmark"
    ):
        tt.attach(daemon.socket_dir, mode="planned")
    assert cuda.calls == []  # refused before PyTorch's allocator was touched
    assert not fetch(daemon.socket_dir)[1].sessions
    tt.attach(daemon.socket_dir, mode="pool").close()  # pool mode serves it


def test_another_gpu_and_a_second_attach_are_refused(cuda: FakeCuda, daemon: LocalDaemon) -> None:
    cuda.pci = (0, 0x3B, 0)
    with pytest.raises(tt.TorchAttachError, match="at PCI 00:3b:00, the daemon's GPU at"):
        tt.attach(daemon.socket_dir, mode="pool")
    cuda.pci = (0, 0x18, 1)  # same bus, another device on it
    with pytest.raises(tt.TorchAttachError, match="at PCI 00:18:01, the daemon's GPU at"):
        tt.attach(daemon.socket_dir, mode="pool")
    cuda.pci = (1, 0x18, 0)  # another PCI domain
    with pytest.raises(tt.TorchAttachError, match="at PCI 01:18:00"):
        tt.attach(daemon.socket_dir, mode="pool")
    cuda.pci = (0, 0x18, 0)
    tp = tt.attach(daemon.socket_dir, mode="pool")
    with pytest.raises(tt.TorchAttachError, match="already attached"):
        tt.attach(daemon.socket_dir, mode="pool")
    with pytest.raises(ValueError, match="swap_limit must be positive"):
        tt.attach(daemon.socket_dir, swap_limit=0)
    tp.close()


def test_planned_mode_refuses_another_device_before_replacing_the_allocator(
    cuda: FakeCuda, daemon: LocalDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(tt.TorchAttachError, match="torch device 1 is not the daemon's GPU"):
        tt.attach(daemon.socket_dir, mode="planned", device=1)
    assert "change_current_allocator" not in cuda.names()  # PyTorch's allocator untouched
    assert tt.current() is None and not fetch(daemon.socket_dir)[1].sessions
    tt.attach(daemon.socket_dir, mode="planned", device=0).close()


def test_a_failure_while_attaching_undoes_the_pool_and_leaves_no_session(
    cuda: FakeCuda, daemon: LocalDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: tidalpool.Session) -> None:
        raise RuntimeError("step failed")

    _, opt, _, _ = model_and_data()
    with monkeypatch.context() as m:
        m.setattr(tidalpool.Session, "step", broken)
        with pytest.raises(RuntimeError, match="step failed"):
            tt.attach(daemon.socket_dir, mode="pool", optimizer=opt)
    assert cuda.names()[-3:] == ["_cuda_endAllocateToPool", "_cuda_releasePool", "pool_deleted"]
    assert tt.current() is None and not fetch(daemon.socket_dir)[1].sessions
    assert not opt._optimizer_step_post_hooks  # the step hook is gone too
    tt.attach(daemon.socket_dir, mode="pool").close()  # nothing is left in the way


def test_a_failure_keeping_the_saves_closes_both_sessions(
    cuda: FakeCuda, daemon: LocalDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: tt.SavedTensors) -> tt.SavedTensors:
        raise RuntimeError("enter failed")

    monkeypatch.setattr(tt.SavedTensors, "__enter__", broken)
    with pytest.raises(RuntimeError, match="enter failed"):
        tt.attach(daemon.socket_dir, mode="pool", swap_limit="40KiB", host_limit="1MiB")
    assert tt.current() is None and not fetch(daemon.socket_dir)[1].sessions


def test_closing_from_another_thread_closes_everything(cuda: FakeCuda, daemon: LocalDaemon) -> None:
    reference = train(*model_and_data())
    model, opt, x, y = model_and_data()
    tp = tt.attach(
        daemon.socket_dir, mode="pool", optimizer=opt, swap_limit="40KiB", host_limit="1MiB"
    )
    losses = train(model, opt, x, y, steps=2)
    errors: list[BaseException] = []

    def close() -> None:
        try:
            tp.close()
        except BaseException as e:
            errors.append(e)

    worker = threading.Thread(target=close)
    worker.start()
    worker.join()
    assert errors == []
    assert tt.current() is None and not fetch(daemon.socket_dir)[1].sessions
    assert tp.saved is not None
    saves = tp.saved.stats().saved
    losses += train(model, opt, x, y, steps=2)  # this thread's hooks now keep every tensor
    assert losses == reference
    assert tp.saved.stats().saved == saves
    with pytest.raises(RuntimeError, match="no SavedTensors is active"):
        tt.step()  # the closed one is not stepped
    torch._C._autograd._pop_saved_tensors_default_hooks()  # what only this thread can remove
