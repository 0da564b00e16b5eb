"""tidalpool.torch.InPlace against a real sim daemon: a model's parameters, gradients, Adam's
state and autograd's saves in one paged session, planned and swapped under limits down to the
tightest the daemon plans, train to the same bits as plain PyTorch; an access PyTorch's ops
make is brought in, one they do not make faults instead of reading stale bytes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

import tidalpool  # noqa: E402
from tidalclient.errors import LeaseExceeded  # noqa: E402
from tidalclient.local import LocalDaemon  # noqa: E402
from tidalcore.unplanned import PlanUnavailable  # noqa: E402
from tidalpool.torch import InPlace  # noqa: E402
from torch import nn  # noqa: E402
from torch.optim import Optimizer  # noqa: E402

from ..conftest import StartDaemon  # noqa: E402

MiB = 1 << 20
BEFORE_PLAN, AFTER_PLAN = 8, 4  # iterations: learning, then once the plan is in


def _model() -> tuple[nn.Module, Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


BATCHES = [
    (
        torch.randn(64, 256, generator=torch.Generator().manual_seed(k)),
        torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(100 + k)),
    )
    for k in range(4)
]


def _train(model: nn.Module, optimizer: Optimizer, first: int, n: int) -> list[float]:
    losses = []
    for k in range(first, first + n):
        x, y = BATCHES[k % len(BATCHES)]
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


class Unplanned(Exception):
    """The daemon said it cannot plan the session's limit (`told`: why, and the lowest limit
    it knows could work)."""

    def __init__(self, told: PlanUnavailable) -> None:
        super().__init__(str(told))
        self.told = told


def _in_place(
    daemon: LocalDaemon, swap_limit: int, make: Callable[[], tuple[nn.Module, Optimizer]] = _model
) -> tuple[list[float], nn.Module, dict]:
    """Train in a paged session: BEFORE_PLAN iterations, wait for the daemon's plan, then
    AFTER_PLAN more; the losses, the model after `InPlace` gave its tensors back, and what
    the session did."""
    model, optimizer = make()
    with tidalpool.attach(
        daemon.socket_dir,
        device_limit="64MiB",
        host_limit="64MiB",
        swap_limit=swap_limit,
        page_bytes="64KiB",
    ) as session:
        with InPlace(session, model, optimizer) as ip:
            losses = _train(model, optimizer, 0, BEFORE_PLAN)
            deadline = time.monotonic() + 60
            while session.stats().plans_received == 0 and session.stats().plan_unavailable is None:
                assert time.monotonic() < deadline, "no plan in 60 s"
                time.sleep(0.02)
            if (told := session.stats().plan_unavailable) is not None:
                raise Unplanned(told)
            hits_before = session.stats().plan_hits
            losses += _train(model, optimizer, BEFORE_PLAN, AFTER_PLAN)
            stats = session.stats()
            seen = ip.stats()
        done = {
            "mode": stats.mode,
            "hits": stats.plan_hits - hits_before,
            "misses": stats.plan_misses,
            "swap": stats.swap,
            "in_place": seen,
            "peak": stats.swap.peak_resident_bytes if stats.swap else 0,
        }
    return losses, model, done


@pytest.fixture(scope="module")
def plain() -> tuple[list[float], nn.Module]:
    model, optimizer = _model()
    return _train(model, optimizer, 0, BEFORE_PLAN + AFTER_PLAN), model


@pytest.mark.parametrize("swap_limit", [64 * MiB, 14 * MiB, 12 * MiB])
def test_training_in_place_under_a_limit_matches_plain_pytorch_to_the_bit(
    start_daemon: StartDaemon, plain: tuple[list[float], nn.Module], swap_limit: int
) -> None:
    expected, plain_model = plain
    losses, model, done = _in_place(start_daemon(), swap_limit)
    assert losses == expected  # bit for bit, every iteration
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)  # given back into PyTorch's memory, the same bytes
    seen = done["in_place"]
    # 6 parameters (3 weights, 3 biases), their gradients and Adam's 3 state tensors of each
    # (its two averages and its step counter): 30; 3 saves an iteration at least (the two
    # ReLUs' outputs and the input).
    assert seen.tensors == 30 and seen.saves >= 3 * (BEFORE_PLAN + AFTER_PLAN)
    assert done["mode"] == "planned" and done["hits"] > 0
    assert done["peak"] <= swap_limit
    if swap_limit < 16 * MiB:  # under the model's 20 MiB: the plan moves blocks
        assert done["swap"].planned_out_bytes > 0
        assert done["swap"].planned_in_bytes > 0


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.relu(self.bn1(self.conv1(x)))
        return nn.functional.relu(self.bn2(self.conv2(y)) + x)


def _conv_net() -> tuple[nn.Module, Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        _Residual(),
        _Residual(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(256, 10),
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_a_conv_net_with_batch_norm_trains_to_the_same_bits_and_running_stats(
    start_daemon: StartDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    images = [
        (torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(k)), y)
        for k, (_, y) in enumerate(BATCHES)
    ]
    monkeypatch.setattr(sys.modules[__name__], "BATCHES", images)
    model, optimizer = _conv_net()
    expected = _train(model, optimizer, 0, BEFORE_PLAN + AFTER_PLAN)
    daemon = start_daemon()
    _, _, free = _in_place(daemon, 64 * MiB, _conv_net)
    limit = int(free["peak"] * 0.9)  # at 0.75 the daemon says swaps alone cannot reach it
    try:
        losses, held, done = _in_place(daemon, limit, _conv_net)
    except Unplanned as e:  # the peak measured unconstrained lies close to what swaps can reach
        lowest, peak = e.told.lowest_limit_bytes, free["peak"]
        assert e.told.kind == "no_schedule" and 0 < lowest < peak, e.told
        limit = (lowest + peak + 1) // 2
        losses, held, done = _in_place(daemon, limit, _conv_net)
    assert losses == expected
    # parameters, and the batch norms' running statistics (buffers written by the forward)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), held.state_dict().values(), strict=True)
    )
    assert done["mode"] == "planned" and done["peak"] <= limit
    assert done["swap"].planned_out_bytes > 0


# The child trains one step in place, then sends the first layer's weight out and waits for
# its pages to go: an op on it (its sum) brings it back; a read outside any op must fault.
FAULT_CHILD = textwrap.dedent(
    """
    import ctypes, sys
    import torch
    from torch import nn
    import tidalpool
    from tidalpool.torch import InPlace

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tidalpool.attach(sys.argv[1], device_limit="16MiB", host_limit="16MiB",
                          swap_limit="16MiB", page_bytes="64KiB") as session:
        with InPlace(session, model, opt) as ip:
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
            w = model[0].weight
            before = w.detach().clone()
            residency = session.residency
            block = ip.block_of(w)
            for attempt in ("op", "raw"):
                residency.synchronize()  # the block is back on the device, settled
                assert residency.swap_out(block)
                residency.synchronize()
                print(attempt, residency.where(block), flush=True)
                if attempt == "op":
                    print("equal", torch.equal(w.detach() + 0, before), flush=True)
                else:
                    ctypes.string_at(w.data_ptr(), 4)
                    print("read stale bytes", flush=True)
    """
)


def test_a_use_pytorch_runs_brings_a_block_back_and_a_raw_read_faults(
    daemon: LocalDaemon,
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    child = subprocess.run(
        [sys.executable, "-c", FAULT_CHILD, str(daemon.socket_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert child.stdout == "op host\nequal True\nraw host\n", child.stderr
    assert child.returncode == -signal.SIGSEGV, child.stderr


def test_the_compute_between_session_ops_is_the_threads_time(
    daemon: LocalDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On the CPU the thread is the device: its time between two ops on session tensors, ops on
    # none and the Python around them (here a 50 ms wait), is compute the daemon is told of.
    model = nn.Linear(8, 8)
    with tidalpool.attach(
        daemon.socket_dir, device_limit="16MiB", swap_limit="16MiB", page_bytes="64KiB"
    ) as session:
        told: list[tuple[str, int]] = []
        record_op = session.record_op
        monkeypatch.setattr(
            session, "record_op", lambda n, ns: (told.append((n, ns)), record_op(n, ns))
        )
        with InPlace(session, model):
            x = torch.ones(2, 8)
            model(x)  # a session op (the weights)
            y = x * 2  # an op on no session tensor
            time.sleep(0.05)
            model(y)
        computes = [ns for name, ns in told if name == "tidalpool.torch.compute"]
        assert computes and computes[-1] >= 50_000_000  # the one before the second forward


def test_a_session_that_ends_first_is_said_to_have_taken_the_tensors(
    daemon: LocalDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer = _model()
    session = tidalpool.attach(
        daemon.socket_dir, device_limit="64MiB", swap_limit="64MiB", page_bytes="64KiB"
    )
    held = InPlace(session, model, optimizer)
    held.__enter__()
    session.close()
    held.__exit__(None, None, None)
    assert "the session ended before InPlace was left" in caplog.text
    assert "6 tensors" in caplog.text  # the three layers' weights and biases


def test_an_op_over_the_limit_is_named_with_what_it_needs(daemon: LocalDaemon) -> None:
    # SGD with momentum updates a 4 MiB weight with its 4 MiB gradient: 8 MiB at once.
    torch.manual_seed(0)
    model = nn.Linear(1024, 1024)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with (
        tidalpool.attach(
            daemon.socket_dir, device_limit="32MiB", swap_limit="6MiB", page_bytes="64KiB"
        ) as session,
        InPlace(session, model, optimizer),
        pytest.raises(LeaseExceeded, match=r"aten\.\S+ needs 8 MiB .* Raise the swap limit"),
    ):
        for _ in range(3):
            model(torch.randn(4, 1024)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()


def test_an_unpaged_session_is_refused_with_the_reason(daemon: LocalDaemon) -> None:
    model, optimizer = _model()
    with (
        tidalpool.attach(daemon.socket_dir, device_limit="32MiB") as session,
        pytest.raises(ValueError, match="needs a paged session"),
    ):
        InPlace(session, model, optimizer)
