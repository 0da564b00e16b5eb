"""PyTorch offline: training steps recorded on the meta device, and recomputation planned.

- `record`: a trace CSV v1 of real training iterations run on the meta device (no memory,
  no GPU), for `tidalpool plan` and `tidalpool simulate`; `capture`, `attention` and
  `autocast` make the recording follow what a GPU would run; `roofline` estimates op times.
- `recompute_plan`: `measure` and `plan_recompute`, which blocks to recompute for a limit.

Needs PyTorch: `pip install 'tidalpool[torch]'`.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tidaloffline.torch needs PyTorch: pip install 'tidalpool[torch]'") from e
