"""`tidalpool.torch.recompute`, `measure`, `record(recompute=)` and `plan_recompute`: blocks
recompute in backward with results bit-identical to plain training, their costs are measured
exactly, a step recorded with them holds fewer bytes, and the plan picks blocks only when the
limit needs them."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tidalclient.torch.recompute import is_recomputed  # noqa: E402
from tidaloffline.torch.recompute_plan import measure  # noqa: E402
from tidalplan import learn  # noqa: E402
from tidalplan.autoswap import durations, load  # noqa: E402
from tidalpool.torch import (  # noqa: E402
    RecomputeError,
    Roofline,
    plan_recompute,
    recompute,
    record,
)

from .docs_examples import run_example  # noqa: E402

nn = torch.nn


class Net(nn.Module):
    """`depth` blocks of Linear-GELU-Dropout-Linear between an input and an output layer."""

    def __init__(self, depth: int = 4, width: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.stem = nn.Linear(16, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Linear(width, hidden), nn.GELU(), nn.Dropout(0.25), nn.Linear(hidden, width)
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def batch(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def train(model: nn.Module, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(7)  # the dropout masks
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.grad.clone() for p in model.parameters()]


def fresh() -> Net:
    torch.manual_seed(0)
    return Net()


def test_recomputed_blocks_train_bit_identically_and_run_their_forward_again() -> None:
    plain_losses, plain_grads = train(fresh())
    model = fresh()
    calls = [0]
    inner = model.blocks[1][0]  # a layer inside the block: its hooks run on recomputation too
    inner.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    handle = recompute(model.blocks[1:3])
    losses, grads = train(model)
    assert losses == plain_losses  # dropout draws the same masks when recomputed
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    assert calls[0] == 6  # 3 steps: each forward once, and again in backward
    handle.remove()
    calls[0] = 0
    train(model, steps=1)
    assert calls[0] == 1


def test_remove_restores_each_forward_and_can_be_called_twice() -> None:
    model = fresh()
    own = model.blocks[2]
    own.forward = lambda x: x * 2  # a forward of its own (an instance attribute)
    with recompute([model.blocks[0], own]) as handle:
        assert is_recomputed(model.blocks[0]) and is_recomputed(own)
        assert "forward" in model.blocks[0].__dict__
    assert not is_recomputed(model.blocks[0]) and not is_recomputed(own)
    assert "forward" not in model.blocks[0].__dict__  # back to the class's method
    assert own(torch.ones(1)).item() == 2.0
    handle.remove()
    assert handle.blocks == ()


def test_recompute_refuses_what_it_cannot_wrap() -> None:
    model = fresh()
    with pytest.raises(TypeError, match=r"block 1 is a Tensor, not a nn\.Module"):
        recompute([model.blocks[0], torch.ones(1)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="block 1 \\(Sequential\\) is given twice"):
        recompute([model.blocks[0], model.blocks[0]])
    assert not is_recomputed(model.blocks[0])  # a refused call wraps nothing
    recompute([model.blocks[0]])
    with pytest.raises(ValueError, match="already recomputed"):
        recompute([model.blocks[0]])


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def test_measure_counts_what_the_block_saves_and_its_kernels() -> None:
    # Inside the block: addmm (saves its input, made outside, and the weight, a parameter),
    # relu (saves its 4x16 float output: 256 bytes, one 512-byte block), addmm (saves that
    # same output, and a weight). The second addmm's output is the block's: not counted.
    # Kernels: addmm, relu, addmm at the 4 us floor each (the transposes are views).
    model = Tiny()
    roofline = Roofline(min_op_ns=4000)
    (segment,) = measure(
        model,
        (torch.randn(4, 8), torch.randn(4, 8)),
        nn.functional.mse_loss,
        [model.block],
        roofline=roofline,
    )
    assert segment.name == "block"
    assert segment.freed == 512
    assert segment.recompute_ns == 3 * 4000
    assert segment.start_ns == 4000  # the batch's upload ran before it
    # In a deeper model each block starts after the one before it has run.
    net = fresh()
    segments = measure(net, batch(), nn.functional.cross_entropy, net.blocks, roofline=roofline)
    starts = [s.start_ns for s in segments]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    # Between two starts: the block, then its residual add.
    assert [b - a for a, b in itertools.pairwise(starts)] == [
        s.recompute_ns + 4000 for s in segments[:-1]
    ]


def test_measure_refuses_blocks_outside_the_model_or_nested() -> None:
    model = fresh()
    loss = nn.functional.cross_entropy
    with pytest.raises(ValueError, match="not a submodule of the model"):
        measure(model, batch(), loss, [nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"block blocks\.0\.0 is inside block blocks\.0"):
        measure(model, batch(), loss, [model.blocks[0], model.blocks[0][0]])


def steady(events: Any) -> Any:
    return learn.extract(events, events.marks())


def sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1)


def plain_and_every(model: Net, tmp_path: Path) -> tuple[Any, Any]:
    """The steady iterations recorded with no block recomputed and with every block."""
    loss = nn.functional.cross_entropy
    plain = steady(record(model, batch(512), loss, sgd, path=tmp_path / "plain.csv"))
    every = steady(
        record(model, batch(512), loss, sgd, path=tmp_path / "r.csv", recompute=model.blocks)
    )
    return plain, every


def test_a_step_recorded_with_recomputation_holds_less_and_computes_more(tmp_path: Path) -> None:
    model = fresh()
    plain, again = plain_and_every(model, tmp_path)
    assert not any(is_recomputed(b) for b in model.blocks)  # the caller's model is untouched
    # Each block's saved GELU input, GELU output and dropout mask and output are gone from the
    # forward's end; what is left is the residual stream.
    assert load(again).max() < load(plain).max() - 3 * 512 * 128 * 4
    assert len(again.ops) > len(plain.ops)
    assert durations(again).sum() > durations(plain).sum()


@pytest.mark.parametrize("set_to_none", [False, True])
def test_the_plan_recomputes_nothing_when_the_step_fits(tmp_path: Path, set_to_none: bool) -> None:
    model = fresh()
    loss = nn.functional.cross_entropy
    loop = {"set_to_none": set_to_none, "keep_output": not set_to_none}
    other = {k: not v for k, v in loop.items()}
    peak, other_peak = (
        int(load(steady(record(model, batch(512), loss, sgd, path=tmp_path / "p.csv", **f))).max())
        for f in (loop, other)
    )
    assert peak != other_peak  # the loop's flags matter, and the plan records with them
    plan = plan_recompute(model, batch(512), loss, sgd, model.blocks, limit=peak, **loop)
    assert plan.candidates[0].peak_bytes == peak
    assert plan.blocks == () and plan.chosen.chosen == ()
    assert plan.overhead == 0.0
    assert len(plan.candidates) == 1


def test_with_slow_copies_the_plan_recomputes_until_the_step_fits(tmp_path: Path) -> None:
    model = fresh()
    loss = nn.functional.cross_entropy
    plain, every = plain_and_every(model, tmp_path)
    low, high = int(load(every).max()), int(load(plain).max())
    limit = (low + high) // 2
    lines: list[str] = []
    plan = plan_recompute(
        model,
        batch(512),
        loss,
        sgd,
        model.blocks,
        limit=limit,
        bandwidth_gbps=0.001,
        progress=lines.append,
    )
    # Copies at 1 MB/s cost far more than recomputing a block: the winner swaps nothing, and
    # recomputes the fewest blocks that bring the peak under the limit.
    assert plan.chosen.peak_bytes <= limit
    assert plan.chosen.step_ns == plan.chosen.compute_ns
    fewer = [c for c in plan.candidates if len(c.chosen) < len(plan.chosen.chosen)]
    assert fewer and all(c.peak_bytes > limit for c in fewer)
    assert 0 < len(plan.blocks) < len(model.blocks)
    assert plan.overhead == plan.chosen.compute_ns / plan.plain_compute_ns - 1 > 0
    assert len(lines) == len(plan.candidates)
    with plan.apply():
        assert [is_recomputed(b) for b in model.blocks] == [b in plan.blocks for b in model.blocks]


def test_the_plan_says_when_nothing_fits() -> None:
    model = fresh()
    loss = nn.functional.cross_entropy
    with pytest.raises(RecomputeError, match="nothing fits 4096 bytes"):
        plan_recompute(model, batch(512), loss, sgd, model.blocks, limit=4096)
    with pytest.raises(ValueError, match="limit must be positive"):
        plan_recompute(model, batch(), loss, sgd, model.blocks, limit=0)


def test_the_docs_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    namespace = run_example("torch.md", "plan_recompute(")
    plan, blocks = namespace["plan"], namespace["blocks"]
    steps = [c.step_ns for c in plan.candidates if c.step_ns is not None]
    assert plan.chosen.step_ns == min(steps)
    computes = [c.compute_ns for c in plan.candidates]
    assert computes == sorted(computes) and len(set(computes)) == len(computes)
    assert [is_recomputed(b) for b in blocks] == [b in plan.blocks for b in blocks]
    assert plan.blocks and str(plan.names) in capsys.readouterr().out
