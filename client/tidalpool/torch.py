"""PyTorch integration (`import tidalpool.torch`): the public names, from where they live.

At run time (`tidalclient.torch`):
- `attach(socket_dir, mode="pool" | "planned", optimizer=...)`: PyTorch's CUDA memory comes from
  a tidalpool lease, through PyTorch's caching allocator ("pool") or replacing it with the
  native planned allocator ("planned"); `step()` marks an iteration boundary.
- `SavedTensors(session, optimizer)`: while active, the tensors autograd saves for backward
  live in the session (CPU tensors on sim, CUDA tensors on cuda), where the swap engine moves
  them to the host lease under the session's swap limit.
- `InPlace(session, model, optimizer)`: on a paged sim session, the model's parameters,
  buffers, gradients, the optimizer's state and autograd's saves live in the session, each at
  one address for life, and any of them may leave between the ops that use it (every ATen op
  is watched, so every use is seen).
- `recompute(blocks)`: those blocks of the model rebuild what they save for backward instead
  of keeping it.
- `MicroBatchConv2d`, `micro_batch_convs`, `LinearCrossEntropy`, `BatchSplit`, `parts_of`: ops
  run in parts over the batch, so no part touches more than its share (results and gradients
  those of the whole op).

Offline, on the meta device (`tidaloffline.torch`):
- `record(model, example_batch, loss_fn, optimizer, iterations=3, path=...)`: a trace CSV v1
  of real training iterations run on the meta device (no memory, no GPU), for `tidalpool plan`
  and `tidalpool simulate`.
- `plan_recompute(model, ..., blocks=, limit=)`: the blocks to recompute so that a step fits
  `limit` soonest, with swapping for the rest; `Roofline`: the GPU whose op durations a
  recorded trace estimates (default: an H100 SXM).
- `plan_split(model, ..., limit=, head=)`: the ops that touch more than `limit` split over the
  batch in the model (the head and cross-entropy as `LinearCrossEntropy`, convolutions as
  `MicroBatchConv2d`), with the op-wise bound before and after.

Needs PyTorch: `pip install 'tidalpool[torch]'`.
"""

from __future__ import annotations

from tidalclient.torch.allocator import (
    TorchAttachError,
    TorchSession,
    TorchStats,
    attach,
    current,
    saves_lease,
    step,
)
from tidalclient.torch.inplace import InPlace, InPlaceStats
from tidalclient.torch.microbatch import (
    BatchSplit,
    LinearCrossEntropy,
    MicroBatchConv2d,
    micro_batch_convs,
    parts_of,
)
from tidalclient.torch.oom import torch_check_fail
from tidalclient.torch.recompute import Recomputed, recompute
from tidalclient.torch.saved import (
    COMPUTE_OP,
    ComputeGaps,
    Saved,
    SavedStats,
    SavedTensors,
    SaveOrder,
)
from tidaloffline.torch.recompute_plan import RecomputeError, RecomputePlan, plan_recompute
from tidaloffline.torch.record import OptimizerFactory, RecordError, record
from tidaloffline.torch.roofline import Roofline
from tidaloffline.torch.split_plan import SplitError, SplitPlan, plan_split

__all__ = [
    "COMPUTE_OP",
    "BatchSplit",
    "ComputeGaps",
    "InPlace",
    "InPlaceStats",
    "LinearCrossEntropy",
    "MicroBatchConv2d",
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
    "SplitError",
    "SplitPlan",
    "TorchAttachError",
    "TorchSession",
    "TorchStats",
    "attach",
    "current",
    "micro_batch_convs",
    "parts_of",
    "plan_recompute",
    "plan_split",
    "recompute",
    "record",
    "saves_lease",
    "step",
    "torch_check_fail",
]
