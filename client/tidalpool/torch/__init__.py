"""PyTorch integration.

- `attach(socket_dir, mode="pool" | "planned", optimizer=...)`: PyTorch's CUDA memory comes from
  a tidalpool lease, through PyTorch's caching allocator ("pool") or replacing it with the
  native planned allocator ("planned"); see `tidalpool.torch.allocator`.
- `record(model, example_batch, loss_fn, optimizer, iterations=3, path=...)`: a trace CSV v1
  of real training iterations run on the meta device (no memory, no GPU), for `tidalpool plan`
  and `tidalpool simulate`.
- `recompute(blocks)`: those blocks of the model rebuild what they save for backward instead
  of keeping it; `plan_recompute(model, ..., blocks=, limit=)` chooses the blocks that make a
  step fit `limit` soonest, with swapping for the rest (on the meta device, without a GPU).
- `Roofline`: the GPU whose op durations a recorded trace estimates (default: an H100 SXM).
- `SavedTensors(session, optimizer)`: while active, the tensors autograd saves for backward
  live in the session (CPU tensors on sim, CUDA tensors on cuda), where the swap engine moves
  them to the host lease under the session's swap limit; `step()` marks an iteration boundary.

Needs PyTorch: `pip install 'tidalpool[torch]'`.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tidalpool.torch needs PyTorch: pip install 'tidalpool[torch]'") from e

from tidalpool.torch.allocator import (
    TorchAttachError,
    TorchSession,
    TorchStats,
    attach,
    current,
    saves_lease,
)
from tidalpool.torch.oom import torch_check_fail
from tidalpool.torch.recompute import (
    Recomputed,
    RecomputeError,
    RecomputePlan,
    plan_recompute,
    recompute,
)
from tidalpool.torch.record import OptimizerFactory, RecordError, record
from tidalpool.torch.roofline import Roofline
from tidalpool.torch.saved import (
    COMPUTE_OP,
    ComputeGaps,
    Saved,
    SavedStats,
    SavedTensors,
    SaveOrder,
    step,
)

__all__ = [
    "COMPUTE_OP",
    "ComputeGaps",
    "OptimizerFactory",
    "RecomputeError",
    "RecomputePlan",
    "Recomputed",
    "RecordError",
    "Roofline",
    "SaveOrder",
    "Saved",
    "SavedStats",
    "SavedTensors",
    "TorchAttachError",
    "TorchSession",
    "TorchStats",
    "attach",
    "current",
    "plan_recompute",
    "recompute",
    "record",
    "saves_lease",
    "step",
    "torch_check_fail",
]
