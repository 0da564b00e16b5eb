"""What an ATen op touches: the tensors among its arguments, and those its schema writes.

Shared by what watches ops as they run (`inplace`) and what records them on the meta device
(`tidaloffline.torch.capture`), so both see the same accesses.
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
