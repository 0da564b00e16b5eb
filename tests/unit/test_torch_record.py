"""`tidalpool.torch.record`: the exact events of a small model's training on the meta device,
the file `tidalpool plan` and `simulate` read, the caller's objects untouched, clear refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tidalcore.events import ALLOC, FREE, ITER, OP, READ, WRITE, Events  # noqa: E402
from tidaloffline.formats import read_trace_csv  # noqa: E402
from tidaloffline.torch.capture import Capture, round_size  # noqa: E402
from tidalplan import learn  # noqa: E402
from tidalpool.cli import main  # noqa: E402
from tidalpool.torch import RecordError, Roofline, record  # noqa: E402

from .docs_examples import run_example  # noqa: E402

nn = torch.nn


def render(events: Events) -> list[str]:
    """One line per op: the frees and allocs before it (`-B`, `+B:BYTES`), its name without
    `aten.` and `.default`, and the blocks it reads `>` writes; `iter N` lines as they are."""
    lines: list[str] = []
    parts: list[str] = []
    reads: list[str] = []
    writes: list[str] = []
    columns = zip(
        events.kinds.tolist(),
        events.block_ids.tolist(),
        events.sizes.tolist(),
        events.name_ids.tolist(),
        strict=True,
    )
    for kind, block, size, name_id in columns:
        if kind == ALLOC:
            parts.append(f"+{block}:{size}")
        elif kind == FREE:
            parts.append(f"-{block}")
        elif kind == READ:
            reads.append(str(block))
        elif kind == WRITE:
            writes.append(str(block))
        elif kind == OP:
            name = events.names[name_id].removeprefix("aten.").removesuffix(".default")
            lines.append(" ".join([*parts, f"{name} {','.join(reads)}>{','.join(writes)}"]))
            parts, reads, writes = [], [], []
        elif kind == ITER:
            if parts:
                lines.append(" ".join(parts))
                parts = []
            lines.append(f"iter {block}")
    if parts:
        lines.append(" ".join(parts))
    return lines


# Linear(16, 48) - ReLU - Linear(48, 8), batch 4, float32, MSE loss, SGD with momentum 0.9.
# Bytes (rounded up to 512): W1 48x16 = 3072, b1 192 -> 512, W2 8x48 = 1536, b2 32 -> 512;
# x 4x16 = 256 -> 512, y and the output 4x8 = 128 -> 512, the hidden layer 4x48 = 768 -> 1024,
# the loss 4 -> 512.
SETUP = ["+0:3072 +1:512 +2:1536 +3:512"]  # the parameters W1 b1 W2 b2: persistent
ITERATION_0 = [
    "iter 0",
    # zero_grad: no gradients yet. The batch is copied to the device.
    "+4:512 _to_copy >4",  # x
    "+5:512 _to_copy >5",  # y
    # Forward: addmm(b1, x, W1^T) (W1^T is a view: no op, no block).
    "+6:1024 addmm 1,4,0>6",
    "+7:1024 relu 6>7",  # relu saves its output for backward: 7 lives until then
    "-6 +8:512 addmm 3,7,2>8",  # nothing saved the first addmm's output: freed; addmm saves 7
    "+9:512 mse_loss 8,5>9",
    # Backward. The engine starts from ones_like(loss), which lives until backward returns.
    "+10:512 ones_like 9>10",
    "+11:512 mse_loss_backward 10,8,5>11",  # d output
    "+12:1024 mm 11,2>12",  # d hidden = d output . W2
    "+13:1536 mm 11,7>13",  # d W2 = d output^T . relu output: becomes W2.grad (persistent)
    "+14:512 sum.dim_IntList 11>14",  # d b2: becomes b2.grad
    "-11 +15:1024 threshold_backward 12,7>15",  # the ReLU's backward: its saved output's use
    "-7 -12 +16:3072 mm 15,4>16",  # d W1 = d hidden^T . x: W1.grad; relu output 7 freed above
    "+17:512 sum.dim_IntList 15>17",  # d b1: b1.grad
    # The step (foreach, as on a GPU): momentum buffers start as clones of the gradients
    # (optimizer state: persistent), then parameters += -lr * buffers.
    "-15 -10 +18:3072 clone 16>18",
    "+19:512 clone 17>19",
    "+20:1536 clone 13>20",
    "+21:512 clone 14>21",
    "_foreach_add_.List 0,1,2,3,18,19,20,21>0,1,2,3",
    "-4 -5 -8 -9",  # the step returns: batch, output and loss freed
]
ITERATION_1 = [
    "iter 1",
    # zero_grad(set_to_none=False): the gradients are zeroed in place (one kernel each).
    "zero_ 16>16",
    "zero_ 17>17",
    "zero_ 13>13",
    "zero_ 14>14",
    "+22:512 _to_copy >22",
    "+23:512 _to_copy >23",
    "+24:1024 addmm 1,22,0>24",
    "+25:1024 relu 24>25",
    "-24 +26:512 addmm 3,25,2>26",
    "+27:512 mse_loss 26,23>27",
    "+28:512 ones_like 27>28",
    "+29:512 mse_loss_backward 28,26,23>29",
    "+30:1024 mm 29,2>30",
    "+31:1536 mm 29,25>31",
    "+32:512 sum.dim_IntList 29>32",
    # Now the gradients exist: each new one is added into .grad and freed.
    "-29 add_.Tensor 14,32>14",
    "-32 add_.Tensor 13,31>13",
    "-31 +33:1024 threshold_backward 30,25>33",
    "-25 -30 +34:3072 mm 33,22>34",
    "+35:512 sum.dim_IntList 33>35",
    "-33 add_.Tensor 17,35>17",
    "-35 add_.Tensor 16,34>16",
    # buffers = momentum * buffers + grads; parameters += -lr * buffers.
    "-28 -34 _foreach_mul_.Scalar 18,19,20,21>18,19,20,21",
    "_foreach_add_.List 18,19,20,21,16,17,13,14>18,19,20,21",
    "_foreach_add_.List 0,1,2,3,18,19,20,21>0,1,2,3",
    "-22 -23 -26 -27",
]


def shifted(lines: list[str], first: int, by: int) -> list[str]:
    """The lines with every block id >= first raised by `by`, and `iter N` by one."""

    def block(text: str) -> str:
        n = int(text)
        return str(n + by if n >= first else n)

    out = []
    for line in lines:
        if line.startswith("iter "):
            out.append(f"iter {int(line[5:]) + 1}")
            continue
        words = []
        for word in line.split(" "):
            if word[0] in "+-":
                ident, _, size = word[1:].partition(":")
                words.append(word[0] + block(ident) + (f":{size}" if size else ""))
            elif ">" in word:
                reads, writes = word.split(">")
                words.append(
                    ">".join(",".join(block(b) for b in s.split(",") if b) for s in (reads, writes))
                )
            else:
                words.append(word)
        out.append(" ".join(words))
    return out


def small_model() -> tuple[Any, tuple[Any, Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 8))
    return model, (torch.randn(4, 16), torch.randn(4, 8))


def sgd(model: Any) -> Any:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_small_model_events_exact(tmp_path: Path) -> None:
    model, batch = small_model()
    path = tmp_path / "mlp.trace.csv"
    events = record(model, batch, nn.MSELoss(), sgd(model), path=path)
    lines = render(events)
    iteration_2 = shifted(ITERATION_1, first=22, by=14)  # the steady iteration repeats
    assert lines == SETUP + ITERATION_0 + ITERATION_1 + iteration_2
    ops = events.block_ids[events.kinds == OP].tolist()
    assert ops == list(range(len(ops)))  # ops numbered in program order
    # The file holds the same events.
    again = read_trace_csv(path)
    for column in ("kinds", "block_ids", "sizes", "durations_ns", "name_ids"):
        assert getattr(again, column).tolist() == getattr(events, column).tolist(), column
    assert again.names == events.names
    assert path.read_text().startswith(
        "# tidalpool trace v1; model=Sequential batch=(4, 16) float32, (4, 8) float32"
        " optimizer=SGD iters=3\n"
    )


def test_steady_iteration_has_parameters_gradients_and_state_persistent(tmp_path: Path) -> None:
    model, batch = small_model()
    events = record(model, batch, nn.MSELoss(), sgd(model), path=tmp_path / "t.csv")
    it = learn.extract(events, events.marks())
    assert it.index == 1
    persistent = dict(it.persistent)
    # Parameters 0-3, gradients 16 17 13 14, momentum buffers 18-21 (as in ITERATION_0).
    assert persistent == {
        0: 3072, 1: 512, 2: 1536, 3: 512,
        16: 3072, 17: 512, 13: 1536, 14: 512,
        18: 3072, 19: 512, 20: 1536, 21: 512,
    }  # fmt: skip
    assert sorted(b.id for b in it.blocks) == list(range(22, 36))
    assert not any(b.crosses for b in it.blocks)
    # The relu output (25) lives from the forward's relu to the backward's threshold_backward.
    relu_out = next(b for b in it.blocks if b.id == 25)
    names = {op.tick: op.name for op in it.ops}
    touched = sorted(a.tick for a in it.accesses if a.block == 25)
    assert [names[t] for t in touched] == [
        "aten.relu.default",  # written
        "aten.addmm.default",  # read by the second layer
        "aten.mm.default",  # d W2
        "aten.threshold_backward.default",  # the ReLU's backward
    ]
    assert relu_out.start == touched[0] - 1  # allocated just before relu runs
    assert relu_out.end == touched[-1] + 1  # freed right after its use in backward


def test_set_to_none_frees_gradients_each_iteration(tmp_path: Path) -> None:
    model, batch = small_model()
    events = record(
        model, batch, nn.MSELoss(), sgd(model), path=tmp_path / "t.csv", set_to_none=True
    )
    it = learn.extract(events, events.marks())
    # Only parameters and momentum buffers persist; the gradients of iteration 0 are freed by
    # iteration 1's zero_grad, and iteration 1's own cross into iteration 2.
    assert sorted(size for _, size in it.persistent) == sorted([3072, 512, 1536, 512] * 2)
    crossing = sorted(b.size for b in it.blocks if b.crosses)
    assert crossing == sorted([3072, 512, 1536, 512])


def test_dropping_the_output_frees_it_after_its_last_use_in_backward(tmp_path: Path) -> None:
    model, batch = small_model()
    kept = render(record(model, batch, nn.MSELoss(), sgd(model), path=tmp_path / "kept.csv"))
    dropped = render(
        record(model, batch, nn.MSELoss(), sgd(model), path=tmp_path / "t.csv", keep_output=False)
    )
    # The output (8 in iteration 0, 26 in iteration 1) is saved by mse_loss: autograd frees it
    # once mse_loss_backward has run, not when the step returns. Nothing else moves.
    assert kept[: len(SETUP)] == dropped[: len(SETUP)] == SETUP
    iteration_0 = list(ITERATION_0)
    iteration_0[iteration_0.index("+12:1024 mm 11,2>12")] = "-8 +12:1024 mm 11,2>12"
    iteration_0[-1] = "-4 -5 -9"
    iteration_1 = list(ITERATION_1)
    iteration_1[iteration_1.index("+30:1024 mm 29,2>30")] = "-26 +30:1024 mm 29,2>30"
    iteration_1[-1] = "-22 -23 -27"
    assert dropped == SETUP + iteration_0 + iteration_1 + shifted(iteration_1, first=22, by=14)
    assert kept == SETUP + ITERATION_0 + ITERATION_1 + shifted(ITERATION_1, first=22, by=14)


def test_durations_follow_the_roofline(tmp_path: Path) -> None:
    model, batch = small_model()
    # 1 FLOP or 1 device byte is 1 ns; a host byte 10 ns; no floor.
    roofline = Roofline(
        flops_per_s=1e9, tensor_flops_per_s=1e12, bytes_per_s=1e9, host_bytes_per_s=1e8, min_op_ns=0
    )
    events = record(
        model, batch, nn.MSELoss(), sgd(model), path=tmp_path / "t.csv", roofline=roofline
    )
    ns = events.durations_ns[events.kinds == OP].tolist()
    assert ns[:9] == [
        (256 + 256) * 10,  # x to the device: 256 B read from the host, 256 B written
        (128 + 128) * 10,  # y
        2 * 4 * 16 * 48,  # addmm: 6144 FLOPs > 192 + 256 + 3072 + 768 bytes
        768 + 768,  # relu: bytes
        2 * 4 * 48 * 8,  # addmm: 3072 FLOPs > 32 + 768 + 1536 + 128 bytes
        128 + 128 + 4,  # mse_loss
        4 + 4,  # ones_like
        4 + 128 + 128 + 128,  # mse_loss_backward
        2 * 4 * 8 * 48,  # mm: 3072 FLOPs > 128 + 1536 + 768 bytes
    ]
    # With the defaults every op of this small model takes the 4 µs floor.
    events = record(model, batch, nn.MSELoss(), sgd(model), path=tmp_path / "d.csv")
    assert set(events.durations_ns[events.kinds == OP].tolist()) == {4000}


def test_plan_and_simulate_read_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, batch = small_model()
    path = tmp_path / "mlp.trace.csv"
    record(model, batch, nn.MSELoss(), sgd(model), path=path)
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"input: {path} (trace CSV, iteration 1: 14 buffers, alignment 256)"
    assert out[1] == "steady: iteration 1 of 3 (iteration 2 repeats it)"
    # The most bytes live at once in iteration 1: at its second mm of backward, x, y, the relu
    # output, the output, the loss, its gradient, d output, d hidden and d W2: 7 KiB.
    assert out[2] == (
        "lower bound: 7168 B (7 KiB): the arena, the iteration's blocks at their most"
    )
    assert "optimal: yes" in out
    # At 0.85: a swapped weight stays in one piece across the iteration's boundary, and the
    # placement of pieces live across every cut of this small iteration costs more room.
    argv = ["simulate", str(path), "--limit", "0.85", "--policy", "tidalpool", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["policies"]
    assert row["feasible"] and row["peak_bytes"] <= report["limit_bytes"]


def test_the_callers_objects_are_untouched(tmp_path: Path) -> None:
    model, batch = small_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = sgd(model)
    loss = nn.MSELoss()
    record(model, batch, loss, optimizer, path=tmp_path / "t.csv")
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not optimizer.state
    assert optimizer.param_groups[0]["params"][0] is next(model.parameters())
    assert optimizer.param_groups[0]["foreach"] is None
    assert batch[0].device.type == "cpu"


def test_a_factory_gives_the_same_trace_as_an_optimizer(tmp_path: Path) -> None:
    model, batch = small_model()
    rebuilt = record(model, batch, nn.MSELoss(), sgd(model), path=tmp_path / "a.csv")
    made = record(model, batch, nn.MSELoss(), sgd, path=tmp_path / "b.csv")
    assert render(made) == render(rebuilt)


@pytest.mark.parametrize(
    "kind",
    ["SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop"],
)
def test_every_builtin_optimizer_is_rebuilt(tmp_path: Path, kind: str) -> None:
    model, batch = small_model()
    optimizer = getattr(torch.optim, kind)(model.parameters(), lr=0.01)
    path = tmp_path / "t.csv"
    events = record(model, batch, nn.MSELoss(), optimizer, path=path)
    assert f" optimizer={kind} iters=3" in path.read_text().splitlines()[0]
    # Its update writes every parameter in each iteration.
    writes = set(events.block_ids[events.kinds == WRITE].tolist())
    assert {0, 1, 2, 3} <= writes


def test_an_optimizer_that_reads_its_state_values_cannot_run_on_meta(tmp_path: Path) -> None:
    model, batch = small_model()
    asgd = torch.optim.ASGD(model.parameters(), lr=0.01)  # its step calls .item() on its state
    with pytest.raises(RecordError, match=r"optimizer step of iteration 0 .*Tensor.item\(\)"):
        record(model, batch, nn.MSELoss(), asgd, path=tmp_path / "t.csv")


def test_inputs_as_tuple_or_dict_and_a_tied_parameter(tmp_path: Path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8, bias=False)
            self.b = nn.Linear(8, 8, bias=False)
            self.b.weight = self.a.weight  # one parameter, used twice

        def forward(self, x: Any, scale: Any) -> Any:
            return self.b(self.a(x)) * scale

    model = Tied()
    x, scale, y = torch.randn(2, 8), torch.tensor(2.0), torch.randn(2, 8)
    as_tuple = record(model, ((x, scale), y), nn.MSELoss(), sgd(model), path=tmp_path / "t.csv")
    as_dict = record(
        model, ({"x": x, "scale": scale}, y), nn.MSELoss(), sgd(model), path=tmp_path / "d.csv"
    )
    assert render(as_dict) == render(as_tuple)
    assert render(as_tuple)[0] == "+0:512"  # one weight block (8x8 float32 = 256 -> 512)


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((nn.ReLU(), "sgd"), ValueError, r"the model \(ReLU\) has no parameters to train"),
        ((nn.Linear(2, 2).requires_grad_(False), "sgd"), ValueError, "no parameter of the model"),
        ((nn.Linear(2, 2), "stranger"), ValueError, r"tensor of shape \(3,\) that is not a param"),
        ((nn.Linear(2, 2), "needs-arg"), TypeError, r"cannot rebuild NeedsArg .* pass a factory"),
        ((nn.Linear(2, 2), "not-an-optimizer"), TypeError, "factory returned int, expected a"),
        ((nn.Linear(2, 2), 3), TypeError, "optimizer must be a torch.optim.Optimizer or a func"),
    ],
)
def test_bad_arguments_are_refused(
    tmp_path: Path, args: tuple[Any, Any], error: type[Exception], message: str
) -> None:
    class NeedsArg(torch.optim.SGD):  # type: ignore[misc]
        def __init__(self, params: Any, tag: str, **kwargs: Any) -> None:
            super().__init__(params, **kwargs)

    model, kind = args
    optimizer: Any = {
        "sgd": lambda: sgd,
        "stranger": lambda: torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1),
        "needs-arg": lambda: NeedsArg(model.parameters(), "tag", lr=0.1),
        "not-an-optimizer": lambda: lambda m: 3,
    }.get(kind, lambda: kind)()
    batch = (torch.randn(1, 2), torch.randn(1, 2))
    with pytest.raises(error, match=message):
        record(model, batch, nn.MSELoss(), optimizer, path=tmp_path / "t.csv")
    assert not (tmp_path / "t.csv").exists()


def test_bad_batches_losses_and_steps_are_refused(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    batch = (torch.randn(1, 2), torch.randn(1, 2))
    path = tmp_path / "t.csv"
    with pytest.raises(
        TypeError, match=r"must be a pair \(inputs, target\), got a tuple of length 1"
    ):
        record(model, (batch[0],), nn.MSELoss(), sgd(model), path=path)
    with pytest.raises(TypeError, match=r"must be a pair \(inputs, target\), got a Tensor"):
        record(model, batch[0], nn.MSELoss(), sgd(model), path=path)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="iterations must be at least 3, got 0"):
        record(model, batch, nn.MSELoss(), sgd(model), 0, path=path)
    with pytest.raises(TypeError, match=r"loss_fn returned a tensor of shape \(1, 2\)"):
        record(model, batch, lambda out, y: out - y, sgd(model), path=path)
    with pytest.raises(TypeError, match="loss_fn returned float, expected a scalar tensor"):
        record(model, batch, lambda out, y: 1.0, sgd(model), path=path)
    with pytest.raises(ValueError, match="the loss does not require grad"):
        record(model, batch, lambda out, y: y.sum(), sgd(model), path=path)

    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(2, 2)

        def forward(self, x: Any) -> Any:
            return self.w(x) * float(x.sum().item())  # needs the values

    reads = Reads()
    with pytest.raises(RecordError, match="the forward of iteration 0 cannot run on the meta"):
        record(reads, batch, nn.MSELoss(), sgd(reads), path=path)
    assert not path.exists()


def test_capture_blocks_are_storages_rounded_and_freed_before_the_next_op() -> None:
    assert [round_size(n) for n in (1, 511, 512, 513, 1024, 1025)] == [512] * 3 + [1024] * 2 + [
        1536
    ]
    capture = Capture(Roofline(min_op_ns=0))
    try:
        with capture:
            a = torch.empty(300, device="meta")  # allocated, no kernel
            v = a.view(30, 10)  # a view: the same block, no op
            b = v * 2  # reads a's block, writes a new one
            del a, v
            c = torch.zeros(1, device="meta")  # a is freed before this op's allocation
            empty = torch.ones(0, device="meta")  # 0 bytes: no block
        capture.settle()
    finally:
        capture.close()
    assert render(capture.events()) == ["+0:1536 +1:1536 mul.Tensor 0>1", "-0 +2:512 zeros >2"]
    assert b.shape == (30, 10) and c.shape == (1,) and empty.numel() == 0


def test_the_docs_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace = run_example("torch.md", "tidalpool.torch.record(")
    assert read_trace_csv(tmp_path / "mlp.trace.csv").marks() == namespace["events"].marks()
    assert main(["plan", "mlp.trace.csv", "--no-exact"]) == 0
