"""The PyTorch integration at run time (its public face is `tidalpool.torch`).

- `allocator`: `attach(socket_dir, mode="pool" | "planned", optimizer=...)`: PyTorch's CUDA
  memory comes from a tidalpool lease, through PyTorch's caching allocator ("pool") or
  replacing it with the native planned allocator ("planned"); `step()` marks an iteration.
- `saved`: `SavedTensors(session, optimizer)`: while active, the tensors autograd saves for
  backward live in the session (CPU tensors on sim, CUDA tensors on cuda), where the swap
  engine moves them to the host lease under the session's swap limit.
- `inplace`: `InPlace(session, model, optimizer)`: on a paged sim session, the model's
  parameters, buffers and gradients, the optimizer's state and autograd's saves live in the
  session at one address each, and any of them may leave between the ops that use them.
- `aten`: what an ATen op touches (shared with the meta-device recorder).
- `recompute`: `recompute(blocks)`: those blocks of the model rebuild what they save for
  backward instead of keeping it.
- `oom`: PyTorch's out-of-memory path for the native allocator.
- `microbatch`: ops run in parts over the batch, results and gradients those of the whole op:
  `MicroBatchConv2d` (μ-cuDNN's micro-batched convolution), `LinearCrossEntropy` (an output
  head and its cross-entropy, never holding the whole logits), `BatchSplit` (any module
  independent per sample).

Recording a step on the meta device and choosing blocks to recompute are offline work:
`tidaloffline.torch`.

Needs PyTorch: `pip install 'tidalpool[torch]'`.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tidalpool.torch needs PyTorch: pip install 'tidalpool[torch]'") from e
