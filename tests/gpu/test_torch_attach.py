"""tidalpool.torch.attach on a GPU: an MLP trains in a lease of a real cuda daemon, in pool and
planned mode, with the losses of PyTorch's own allocator bit for bit; a request larger than the
lease raises torch.OutOfMemoryError in Python (pool: from the caching allocator; planned: from
the native failure handler) and the job goes on. With a swap limit the saved tensors swap
through a second session, and the losses stay PyTorch's. A tensor marked with record_stream is
not overwritten while a second stream still has to read it, in every mode."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ..conftest import StartDaemon

CHILD = Path(__file__).with_name("torch_attach_child.py")
LEASE = 1 << 30


def run(mode: str, socket_dir: Path) -> dict[str, Any]:
    """The child in `mode`, with the package as installed and the environment as it is."""
    done = subprocess.run(
        [sys.executable, str(CHILD), mode, str(socket_dir), str(LEASE)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("torch")
    result = run("default", tmp_path_factory.mktemp("none"))
    assert result["second_stream"]["read_ok"]
    return result


def test_pool_mode_trains_with_pytorchs_losses_and_its_memory_stats(
    start_daemon: StartDaemon, reference: dict[str, Any]
) -> None:
    d = start_daemon(backend="cuda", device_pool="3GiB", host_pool="256MiB", chunk_size="2MiB")
    result = run("pool", d.socket_dir)
    assert result["losses"] == reference["losses"]
    assert result["second_stream"]["read_ok"]  # the caching allocator's own record_stream
    assert result["inside"]  # the caching allocator's segments come from the lease
    assert result["allocated"] > 0  # torch.cuda.memory_stats still works
    assert result["oom"].startswith("OutOfMemoryError")
    assert math.isfinite(result["after"])  # a forward pass after the refusal
    assert result["native"]["fallbacks"] == 0


def test_planned_mode_trains_on_the_daemons_plan_with_pytorchs_losses(
    start_daemon: StartDaemon, reference: dict[str, Any]
) -> None:
    d = start_daemon(backend="cuda", device_pool="3GiB", host_pool="256MiB", chunk_size="2MiB")
    result = run("planned", d.socket_dir)
    assert result["losses"] == reference["losses"]
    assert result["inside"]
    assert result["mode"] == "planned", result["native"]
    assert result["native"]["hits"] > 0
    assert result["native"]["fallbacks"] == 0
    # torch.OutOfMemoryError from the C++ shim (built with the system's compiler), else the
    # RuntimeError of torchCheckFail
    raised = "OutOfMemoryError" if shutil.which("c++") or shutil.which("g++") else "RuntimeError"
    assert result["oom"].startswith(f"{raised}: tidalpool: out of memory in the lease")
    assert result["native"]["failures"] == 0  # counted before the oversized request
    assert result["second_stream"]["read_ok"], result["second_stream"]
    assert result["native"]["stream_records"] >= 1  # Tensor.record_stream reached the hot path
    if result["second_stream"]["reused"]:
        assert result["native"]["stream_waits"] >= 1
    assert math.isfinite(result["after"])


@pytest.mark.parametrize("mode", ["pool+swap", "planned+swap"])
def test_with_a_swap_limit_saved_tensors_swap_and_the_losses_stay_pytorchs(
    start_daemon: StartDaemon, reference: dict[str, Any], mode: str
) -> None:
    d = start_daemon(backend="cuda", device_pool="3GiB", host_pool="512MiB", chunk_size="2MiB")
    result = run(mode, d.socket_dir)
    assert result["losses"] == reference["losses"]
    swap = result["swap"]
    assert swap["out"] > 0 and swap["in"] > 0
    assert swap["peak"] <= 8 << 20


def test_recomputed_blocks_in_planned_mode_keep_pytorchs_losses(
    start_daemon: StartDaemon, reference: dict[str, Any]
) -> None:
    d = start_daemon(backend="cuda", device_pool="3GiB", host_pool="256MiB", chunk_size="2MiB")
    result = run("planned+recompute", d.socket_dir)
    assert result["recomputed"] == 2
    assert result["losses"] == reference["losses"]
    assert result["mode"] == "planned", result["native"]  # the plan serves the recomputation
    assert result["native"]["fallbacks"] == 0
