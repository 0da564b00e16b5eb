"""SavedTensors on a cuda session: a model trains on the GPU with its saved activations copied
into the session's device lease and swapped to the pinned host lease under a swap limit, with
losses bit-identical to plain PyTorch on the same GPU."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from ..conftest import StartDaemon

torch = pytest.importorskip("torch")
pytest.importorskip("cuda.bindings")  # the cuda client; CuPy is not needed

import tidalpool  # noqa: E402
import tidalpool.torch as tt  # noqa: E402

ITERATIONS = 8


def train(saving: Any = None, stream: bool = False) -> list[float]:
    """`stream`: train on a side stream (PyTorch's non-blocking pool stream), not the default."""
    with torch.cuda.stream(torch.cuda.Stream()) if stream else contextlib.nullcontext():
        losses = _train(saving)
    torch.cuda.synchronize()
    return losses


def _train(saving: Any) -> list[float]:
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(
        nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10)
    ).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(512, 1024, device="cuda")
    y = torch.randint(0, 10, (512,), device="cuda")
    losses = []
    with saving(optimizer) if saving is not None else contextlib.nullcontext():
        for _ in range(ITERATIONS):
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize(("offload", "stream"), [("lru", False), ("all", False), ("all", True)])
def test_saved_cuda_tensors_swap_through_the_host_lease_bit_exactly(
    start_daemon: StartDaemon, offload: str, stream: bool
) -> None:
    """On a side stream too: the copies in and out of the lease are ordered against the stream
    the swap engine follows (PyTorch's default stream)."""
    reference = train()
    d = start_daemon(backend="cuda", device_pool="1GiB", host_pool="1GiB", chunk_size="2MiB")
    # one iteration saves 2 MiB (x) + 2 x 8 MiB (ReLU outputs) + the logits: limit at 8 MiB
    with tidalpool.attach(
        d.socket_dir, device_limit="256MiB", host_limit="256MiB", swap_limit="8MiB"
    ) as session:
        held: list[Any] = []

        def saving(optimizer: Any) -> Any:
            saved = tt.SavedTensors(session, optimizer, offload=offload)  # type: ignore[arg-type]
            held.append(saved)
            return saved

        losses = train(saving, stream)
        swap = session.stats().swap
        stats = held[0].stats()
    assert losses == reference
    assert stats.saved >= 3 * ITERATIONS and stats.unpacked >= stats.saved
    assert swap is not None and swap.swapped_out_bytes > 0 and swap.swapped_in_bytes > 0
    assert swap.peak_resident_bytes <= 8 << 20
