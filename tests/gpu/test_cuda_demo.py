"""`tidalpool demo --backend cuda`: the demo network trained with CuPy arrays in a lease on the
GPU gives the same losses, bit for bit, as plain CuPy; also under a swap limit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("cupy")
    pytest.importorskip("cuda.bindings")
    command = [sys.executable, "-m", "tidalpool", "--socket-dir", str(tmp_path / "none")]
    return subprocess.run(
        [*command, "demo", "--backend", "cuda", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_the_cuda_demo_matches_plain_cupy(tmp_path: Path) -> None:
    done = demo(tmp_path, "--iterations", "12")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "starting a cuda daemon" in done.stdout
    assert "losses bit-identical to plain CuPy over 12 iterations" in done.stdout
    assert "switched to the daemon's plan" in done.stdout  # planned, not only learning


def test_the_cuda_demo_under_half_its_peak_swaps_and_matches(tmp_path: Path) -> None:
    done = demo(tmp_path, "--limit", "0.5", "--iterations", "16")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "losses bit-identical to plain CuPy over 16 iterations" in done.stdout
    assert "swapping under" in done.stdout
