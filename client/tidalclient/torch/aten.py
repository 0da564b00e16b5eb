"""What an ATen op touches: the tensors among its arguments, those its schema writes, and the
storage a tensor spans.

Shared by what watches ops as they run (`inplace`), what keeps saves (`saved`) and what records
ops on the meta device (`tidaloffline.torch.capture`), so all see the same accesses.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a value, recursing into tuples, lists and dict values."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


def written(
    func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]
) -> Iterator[torch.Tensor]:
    """The arguments the op's schema marks as written (`Tensor(a!)`, `Tensor(a!)[]`)."""
    for i, argument in enumerate(func._schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        yield from tensors_in(value)


def span(t: torch.Tensor) -> int:
    """Elements of storage from the tensor's first element to its last (numel() > 0): what a
    copy must hold for the same strides to view it."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
