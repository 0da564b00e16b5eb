"""bench/torch_train.py's "saved" configuration without a GPU: a small model's saved tensors
go to a session of a real sim daemon and are swapped under the swap limit the bench gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tidalclient.local import LocalDaemon

pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "torch_train.py"
MiB = 1 << 20


def test_saved_mode_swaps_the_saves_under_the_limit(daemon: LocalDaemon) -> None:
    limit = MiB // 4
    command = [sys.executable, str(BENCH), "child", "--model", "gpt2", "--mode", "saved"]
    command += ["--batch", "8", "--steps", "2", "--warmup", "1", "--tiny", "--device", "cpu"]
    command += ["--socket-dir", str(daemon.socket_dir), "--swap-limit", str(limit)]
    command += ["--host-lease", str(64 * MiB)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert "error" not in result, result
    swap = result["swap"]
    assert swap["limit"] == limit
    assert 0 < swap["peak_resident_bytes"] <= limit
    assert swap["out_bytes_per_step"] > 0  # the model saves more than the limit a step
    assert result["step_ms"] > 0
