"""Saved tensors in a session (sim backend, a real daemon): a small CPU model trains with its
saved activations swapped out and in under a swap limit, with losses bit-identical to plain
PyTorch."""

from __future__ import annotations

from typing import Any, cast

import pytest

torch = pytest.importorskip("torch")

import tidalpool  # noqa: E402
import tidalpool.torch as tt  # noqa: E402
from tidalclient.executors.base import DEVICE, HOST  # noqa: E402
from tidalclient.executors.swapping import Swapping  # noqa: E402
from tidalclient.local import LocalDaemon  # noqa: E402
from tidalclient.session import Session  # noqa: E402

nn = torch.nn
KiB = 1024
ITERATIONS = 6


def setup() -> tuple[Any, Any, list[tuple[Any, Any]]]:
    """64 -> 256 -> 256 -> 10 with ReLUs, SGD with momentum, four fixed batches of 32."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g))
        for _ in range(4)
    ]
    return model, optimizer, batches


def train(model: Any, optimizer: Any, batches: list[tuple[Any, Any]]) -> list[float]:
    losses = []
    for i in range(ITERATIONS):
        x, y = batches[i % len(batches)]
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# What one iteration saves, in order (float32 unless said): the input x of the first Linear
# (32x64: 8 KiB; its weight's transpose is not needed, x needing no gradient); the first
# ReLU's output (32x256: 32 KiB), saved by the ReLU and again by the second Linear with the
# second weight's transpose (a parameter: kept); the same for the second ReLU and the third
# Linear; the log-softmax's output (32x10: 1280 B), saved by it and by the NLL loss with the
# target (32 int64: 256 B) and the total weight (a scalar: 4 B).
SAVED_PER_ITERATION = 6
SAVED_BYTES = 8192 + 32768 + 32768 + 1280 + 256 + 4
SHARED_PER_ITERATION = 3  # the second saves of the two ReLU outputs and the log-softmax output
KEPT_PER_ITERATION = 2  # the transposes of the second and third weights
# Backward uses them: NLL loss (log-softmax output 3, target 4, total weight 5), log-softmax
# (3), third Linear (ReLU output 2), second ReLU (2), second Linear (1), first ReLU (1), first
# Linear (x: 0).
USE_ORDER = [3, 4, 5, 3, 2, 2, 1, 1, 0]


def test_training_with_saved_tensors_in_a_session_matches_plain_pytorch(
    daemon: LocalDaemon,
) -> None:
    model, optimizer, batches = setup()
    plain = train(model, optimizer, batches)

    hooked_model, hooked_optimizer, _ = setup()
    limit = 64 * KiB  # below one iteration's saved bytes (75520 B in 256-byte blocks)
    with (
        tidalpool.attach(
            daemon.socket_dir, device_limit="1MiB", host_limit="1MiB", swap_limit=limit
        ) as session,
        tt.SavedTensors(session, hooked_optimizer) as saved,
    ):
        hooked = train(hooked_model, hooked_optimizer, batches)
        assert saved.order.previous == USE_ORDER  # the last iteration's, by stable ids
        stats = saved.stats()
        swap = session.stats().swap
        live_blocks = session.stats().live_blocks

    assert hooked == plain  # bit-identical losses
    for a, b in zip(model.parameters(), hooked_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert stats == tt.SavedStats(
        saved=SAVED_PER_ITERATION * ITERATIONS,
        saved_bytes=SAVED_BYTES * ITERATIONS,
        shared=SHARED_PER_ITERATION * ITERATIONS,
        kept=KEPT_PER_ITERATION * ITERATIONS,
        unpacked=len(USE_ORDER) * ITERATIONS,
        prefetches=stats.prefetches,
        iterations=ITERATIONS + 1,  # one at the start, one after each optimizer step
    )
    assert swap is not None and swap.limit == limit
    assert swap.peak_resident_bytes <= limit
    assert swap.swap_outs >= ITERATIONS and swap.swap_ins >= ITERATIONS
    # Everything out came back in, but for one block the switch to the plan may have moved out
    # of the arena's way: a previous iteration's input x (8 KiB), still allocated at the switch
    # and freed on the host at the next op.
    assert swap.swapped_out_bytes - swap.swapped_in_bytes in (0, 8192)
    assert stats.prefetches >= 1  # some swap-ins started ahead of their unpack
    # Saves are freed once backward is done with them, at the session's next op, tensor or step:
    # the last one unpacked (x) at the step the optimizer's post-hook takes.
    assert live_blocks == 0


def test_a_save_swapped_out_comes_back_bit_exact_with_its_strides(daemon: LocalDaemon) -> None:
    with (
        tidalpool.attach(daemon.socket_dir, swap_limit="64KiB", host_limit="1MiB") as session,
        tt.SavedTensors(session) as saved,
    ):
        executor = session.executor
        assert isinstance(executor, Swapping)
        g = torch.Generator().manual_seed(2)
        base = torch.randn(6, 10, dtype=torch.float64, generator=g)
        tensors = [
            base[1:5, 2:9].t(),  # offset 12, strides (1, 10)
            torch.randn(3, 4, generator=g).to(torch.bfloat16),
            torch.rand(5, generator=g) > 0.5,
            torch.randint(-(2**62), 2**62, (2, 3, 4), generator=g).permute(2, 0, 1),
            torch.randn(1, 8, generator=g).expand(3, 8),  # stride 0
        ]
        packed = [saved.pack(t) for t in tensors]
        for p in packed:
            assert isinstance(p, tt.Saved)
            assert executor.swap_out(p.tensor.block)
        executor.synchronize()
        assert [executor.where(p.tensor.block) for p in packed] == [HOST] * len(packed)
        for t, p in zip(tensors, packed, strict=True):
            back = saved.unpack(p)
            assert back.dtype == t.dtype and back.shape == t.shape and back.stride() == t.stride()
            assert torch.equal(back, t)
            assert executor.where(p.tensor.block) == DEVICE
        assert [p.ident for p in packed] == [0, 1, 2, 3, 4]
        assert saved.stats().saved_bytes == (
            (1 + 6 * 1 + 3 * 10) * 8  # the transposed 4x7 slice spans 37 float64 of base
            + 12 * 2
            + 5
            + (1 + 3 * 1 + 1 * 12 + 2 * 4) * 8  # the permuted tensor covers all 24 int64
            + 8 * 4  # the expanded row is stored once
        )


def test_offload_all_swaps_out_each_save_and_prefetches_the_next(daemon: LocalDaemon) -> None:
    model, optimizer, batches = setup()
    plain = train(model, optimizer, batches)
    hooked_model, hooked_optimizer, _ = setup()
    with (
        tidalpool.attach(daemon.socket_dir, swap_limit="1MiB", host_limit="1MiB") as session,
        tt.SavedTensors(session, hooked_optimizer, offload="all") as saved,
    ):
        hooked = train(hooked_model, hooked_optimizer, batches)
        swap = session.stats().swap
        stats = saved.stats()
    assert hooked == plain
    assert swap is not None
    assert swap.swap_outs == stats.saved == SAVED_PER_ITERATION * ITERATIONS
    assert swap.swapped_out_bytes == stats.saved_bytes
    assert stats.prefetches >= ITERATIONS  # each iteration brings some saves in ahead of use


def test_step_marks_iterations_and_restarts_the_ids(daemon: LocalDaemon) -> None:
    with pytest.raises(RuntimeError, match="no SavedTensors is active and no session"):
        tt.step()
    with tidalpool.attach(daemon.socket_dir) as session:  # no swap limit: nothing moves
        with tt.SavedTensors(session, min_bytes=64) as saved:
            x = torch.randn(16, requires_grad=True)
            first = saved.pack(x.exp())
            small = saved.pack(torch.ones(2))  # 8 bytes < min_bytes: kept
            tt.step()
            again = saved.pack(x.exp())
            assert isinstance(first, tt.Saved) and isinstance(again, tt.Saved)
            assert (first.ident, first.iteration, again.ident, again.iteration) == (0, 1, 0, 2)
            assert isinstance(small, torch.Tensor)
            assert saved.stats().iterations == 2
            assert session.stats().swap is None
        with pytest.raises(RuntimeError, match="no SavedTensors is active and no session"):
            tt.step()


def test_a_cuda_session_keeps_cpu_tensors_and_an_unknown_policy_is_refused() -> None:
    class Lease:
        ordinal = 3

    class Stand:  # what SavedTensors looks at of a cuda session before it uses it
        cuda = Lease()

    saved = tt.SavedTensors(cast(Session, Stand()))
    assert saved.device == torch.device("cuda", 3)
    cpu = torch.randn(64)
    assert saved.pack(cpu) is cpu  # not on the session's GPU: kept as it is
    assert saved.stats().kept == 1 and saved.stats().saved == 0
    with pytest.raises(ValueError, match="offload must be 'lru' or 'all', got 'some'"):
        sim = cast(Session, type("Sim", (), {"cuda": None})())
        tt.SavedTensors(sim, offload="some")  # type: ignore[arg-type]


def test_each_pack_and_unpack_tells_the_daemon_the_compute_since_the_last(
    daemon: LocalDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer, batches = setup()
    with (
        tidalpool.attach(daemon.socket_dir, device_limit="1MiB", host_limit="1MiB") as session,
        tt.SavedTensors(session, optimizer) as saved,
    ):
        ops: list[tuple[str, int]] = []
        record = session.record_op
        monkeypatch.setattr(
            session, "record_op", lambda name, ns: (ops.append((name, ns)), record(name, ns))
        )
        train(model, optimizer, batches)
        stats = saved.stats()
    # one compute op before every pack that copies and every unpack of a copy, none for kept
    # and shared saves, always recorded (0 at the very first), so iterations repeat exactly
    assert len(ops) == stats.saved + stats.unpacked == (6 + 9) * ITERATIONS
    assert {name for name, _ in ops} == {tt.COMPUTE_OP}
    assert ops[0][1] == 0
    assert all(ns > 0 for _, ns in ops[1:])  # wall time between hooks on the CPU


def test_compute_gaps_on_the_cpu_are_the_wall_time_between_hooks() -> None:
    import time

    gaps = tt.ComputeGaps(torch.device("cpu"))
    assert gaps.begin() == 0  # nothing before the first hook
    gaps.end()
    time.sleep(0.02)
    assert gaps.begin() >= 20_000_000
    gaps.end()
    gaps.step()  # the time across a boundary (the optimizer's step) counts too
    time.sleep(0.01)
    assert 10_000_000 <= gaps.begin() < 10_000_000_000


def test_a_save_larger_than_the_swap_limit_stays_where_it_is(
    daemon: LocalDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer, batches = setup()
    plain = train(model, optimizer, batches)
    hooked_model, hooked_optimizer, _ = setup()
    with (
        tidalpool.attach(daemon.socket_dir, host_limit="1MiB", swap_limit="16KiB") as session,
        tt.SavedTensors(session, hooked_optimizer) as saved,
    ):
        hooked = train(hooked_model, hooked_optimizer, batches)
        stats = saved.stats()
    assert hooked == plain
    # the two 32 KiB ReLU outputs of each iteration stay in PyTorch's memory, each saved twice
    # (by the ReLU and by the next Linear): four more kept, two fewer saved and shared
    assert stats.saved == (SAVED_PER_ITERATION - 2) * ITERATIONS
    assert stats.kept == (KEPT_PER_ITERATION + 4) * ITERATIONS
    assert stats.shared == (SHARED_PER_ITERATION - 2) * ITERATIONS
    warnings = [r.getMessage() for r in caplog.records if "stays where it is" in r.getMessage()]
    assert len(warnings) == 1 and "exceed the swap limit of 16 KiB" in warnings[0]


def test_each_shape_orders_its_saves_against_its_own_last_iteration(daemon: LocalDaemon) -> None:
    """Iterations of two shapes, alternating: each shape's saves are expected in the order its
    own last iteration used them, and the session is told each iteration's shape."""
    with tidalpool.attach(daemon.socket_dir) as session:
        shapes: list[str] = []
        stepped = session.step

        def step(shape: str = "") -> None:
            shapes.append(shape)
            stepped(shape)

        session.step = step  # type: ignore[method-assign]
        with tt.SavedTensors(session, min_bytes=64) as saved:
            x = torch.randn(16)  # no autograd: its products save nothing themselves
            for shape, n in [("a", 2), ("b", 3), ("a", 2), ("b", 3)]:
                tt.step(shape)
                packs = [saved.pack(x * (k + 1)) for k in range(n)]
                for p in reversed(packs):
                    saved.unpack(p)
            tt.step("a")
            assert saved.order.previous == [1, 0]  # a's last iteration, not b's [2, 1, 0]
            assert saved.order.use(1) == [0]  # so unpacking save 1 expects save 0 next
            tt.step("b")
            assert saved.order.previous == [2, 1, 0]
        assert shapes == ["", "a", "b", "a", "b", "a", "b"]
