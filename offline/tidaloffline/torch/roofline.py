"""How long a kernel would run on a GPU, estimated from its FLOPs and bytes (a roofline).

    ns = max(min_op_ns, flops / peak FLOP/s of its dtype, bytes / memory bandwidth)

FLOPs come from PyTorch's own formulas (`torch.utils.flop_counter`: matrix products,
convolutions, attention, their backward); every other kernel counts none and is bound by
memory. Bytes are those of every tensor the kernel reads and every tensor it returns (element
count times element size, as the kernel sees them, not the allocator's rounding); an in-place
kernel reads and writes its tensor. A kernel that reads host memory (the batch's upload) is a
copy over the host link instead.

The defaults are an H100 SXM: 3.35 TB/s of HBM3; 67 TFLOP/s for 32- and 64-bit floats (no
TF32, as PyTorch multiplies float32 matrices by default); 989 TFLOP/s dense for 16- and 8-bit
types on the tensor cores; 50 GB/s from host memory (PCIe 5.0 x16); and at least 4 µs per
kernel, eager PyTorch's launch overhead for small kernels (the traces in shared/traces use the
same floor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

_TENSOR_CORE_DTYPES = frozenset(
    {torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8}
)


@dataclass(frozen=True, slots=True)
class Roofline:
    """The GPU a trace's op durations are estimated for (defaults: an H100 SXM)."""

    flops_per_s: float = 67e12
    """Peak FLOP/s of kernels on 32- and 64-bit types (and any type not listed below)."""
    tensor_flops_per_s: float = 989e12
    """Peak FLOP/s of kernels on float16, bfloat16, float8 and int8 (tensor cores, dense)."""
    bytes_per_s: float = 3.35e12
    """Device memory bandwidth."""
    host_bytes_per_s: float = 50e9
    """Bandwidth of a kernel that reads host memory (copies from the host)."""
    min_op_ns: int = 4000
    """The shortest a kernel takes."""

    def __post_init__(self) -> None:
        for name in ("flops_per_s", "tensor_flops_per_s", "bytes_per_s", "host_bytes_per_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"Roofline.{name} must be positive, got {value}")
        if self.min_op_ns < 0:
            raise ValueError(f"Roofline.min_op_ns must not be negative, got {self.min_op_ns}")

    def op_ns(self, flops: int, nbytes: int, dtype: torch.dtype | None, from_host: bool) -> int:
        """Nanoseconds of a kernel doing `flops` on `dtype` and moving `nbytes`."""
        peak = self.tensor_flops_per_s if dtype in _TENSOR_CORE_DTYPES else self.flops_per_s
        bandwidth = self.host_bytes_per_s if from_host else self.bytes_per_s
        compute = math.ceil(flops * 1e9 / peak)
        memory = math.ceil(nbytes * 1e9 / bandwidth)
        return max(self.min_op_ns, compute, memory)


def flops(
    func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any], out: Any
) -> int:
    """The kernel's FLOPs by PyTorch's formulas; 0 for a kernel that has none."""
    formula = flop_registry.get(func.overloadpacket)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements a kernel sees (a view's, not its storage's)."""
    return t.numel() * t.element_size()
