"""Record the sample traces of this folder with `tidalpool.torch.record` (`make traces`).

    .venv/bin/python traces/record.py [NAME ...] [--out DIR]

Each model is built from torch.nn with random weights and trained for three iterations on
PyTorch's meta device (no GPU, no memory): `optimizer.zero_grad()` (gradients set to None, as
PyTorch does by default), `output = model(inputs)`, `loss = cross_entropy(output, target)`,
`loss.backward()`, `optimizer.step()`. Op times are the default roofline's (an H100 SXM).

    mlp       784-1024-1024-10 with ReLU, batch 64, SGD with momentum
    resnet18  ResNet-18 (torchvision's layout: basic blocks 2-2-2-2), 224x224 inputs,
              1,000 classes, batch 8, SGD with momentum
    gpt2      GPT-2 small: 12 pre-norm blocks of width 768, 12 heads, MLP 3072, vocabulary
              50,257 (tied head), causal, sequence 128, batch 4, AdamW

The same command writes the same bytes (tests/unit/test_sample_traces.py checks the MLP's).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench"))

from torch_train import gpt2  # noqa: E402  (the benchmarks' GPT-2, at sequence 128 here)


@dataclass(frozen=True)
class Sample:
    """One sample trace: how its model, batch and optimizer are made, and its file name."""

    file: str
    model: Callable[[], nn.Module]
    batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    )


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (1x1 where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet18() -> nn.Module:
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000)]
    return nn.Sequential(*layers)


GPT2_VOCAB, GPT2_SEQUENCE = 50257, 128


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


SAMPLES = {
    "mlp": Sample(
        "mlp.b64.trace.csv",
        mlp,
        lambda: (torch.zeros(64, 1, 28, 28), torch.zeros(64, dtype=torch.long)),
        sgd,
    ),
    "resnet18": Sample(
        "resnet18.b8.trace.csv",
        resnet18,
        lambda: (torch.zeros(8, 3, 224, 224), torch.zeros(8, dtype=torch.long)),
        sgd,
    ),
    "gpt2": Sample(
        "gpt2.b4.s128.trace.csv",
        lambda: gpt2(GPT2_VOCAB, GPT2_SEQUENCE),
        lambda: (
            torch.zeros(4, GPT2_SEQUENCE, dtype=torch.long),
            torch.zeros(4 * GPT2_SEQUENCE, dtype=torch.long),
        ),
        adamw,
    ),
}


def record(name: str, directory: Path) -> Path:
    """Record sample `name` into `directory`; the path of its trace."""
    import tidalpool.torch

    sample = SAMPLES[name]
    with torch.device("meta"):  # the weights' shapes are all record needs: no bytes to make
        model = sample.model()
    path = directory / sample.file
    loss: Any = F.cross_entropy
    tidalpool.torch.record(
        model, sample.batch(), loss, sample.optimizer, iterations=3, path=path, set_to_none=True
    )
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="traces/record.py", description="Record the sample traces of traces/."
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(SAMPLES)}")
    where = "where to write, made if missing (default traces/)"
    parser.add_argument("--out", type=Path, default=HERE, help=where)
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in SAMPLES]
    if unknown:
        parser.error(f"no sample named {', '.join(unknown)} (known: {', '.join(SAMPLES)})")
    try:
        args.out.mkdir(parents=True, exist_ok=True)  # a missing --out is made
    except OSError as e:
        parser.error(f"--out {args.out} cannot be a directory: {e.strerror}")
    for name in args.names or SAMPLES:
        started = time.perf_counter()
        path = record(name, args.out)
        took = time.perf_counter() - started
        print(f"{path}: {path.stat().st_size} bytes in {took:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
