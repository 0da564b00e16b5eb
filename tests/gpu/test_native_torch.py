"""PyTorch on the native hot path: CUDAPluggableAllocator loads the library, an MLP trains in a
driver-allocated lease with the losses of PyTorch's own allocator, and a plan learned from the
drained events serves every planned iteration without falling back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

CHILD = Path(__file__).with_name("native_torch_child.py")


def run(mode: str) -> dict[str, Any]:
    """The child in `mode`, with the package as installed and the environment as it is."""
    done = subprocess.run(
        [sys.executable, str(CHILD), mode], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_an_mlp_trains_planned_in_the_lease_with_pytorchs_losses() -> None:
    pytest.importorskip("torch")
    reference, native = run("default"), run("native")
    assert native["losses"] == reference["losses"]  # the same kernels on the same data
    assert native["inside"]  # parameters and inputs live in the lease
    s = native["stats"]
    assert (s["failures"], s["overflow"], s["fallbacks"]) == (0, 0, 0)
    assert native["planned"]
    planned_iterations = 10 - 4 - 1  # STEPS, LEARN_AT, and the step at which the plan waits
    assert s["hits"] + s["misses"] == planned_iterations * native["slots"]
    assert s["hits"] > s["misses"]
