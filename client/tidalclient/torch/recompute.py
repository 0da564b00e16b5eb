"""Recomputing blocks in backward: `recompute(blocks)`.

    import tidalpool.torch

    handle = tidalpool.torch.recompute([model.layer3, model.layer4])
    ...                           # those blocks now recompute in backward
    handle.remove()               # back as they were

`recompute(blocks)` runs each block's forward under `torch.utils.checkpoint`
(non-reentrant): of what the block saves for backward, autograd keeps only the block's inputs;
the rest goes at the end of the block's forward and is rebuilt, by running the block's forward
once more (with the RNG state it had, so dropout draws the same mask), when backward reaches
the block. A step holds fewer bytes and computes more. `Recomputed.remove()` puts the blocks
back as they were. Which blocks to recompute for a memory limit is chosen offline
(`tidaloffline.torch.plan_recompute`, also `tidalpool.torch.plan_recompute`).

`torch.utils.checkpoint` restores `torch.autocast`'s state for a recomputation; a context of
another kind that must be re-entered there (the meta-device autocast of the offline recorder)
registers itself with `reenter_in_recomputation`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Recomputed", "is_recomputed", "names_of", "recompute", "reenter_in_recomputation"]

Reentry = Callable[[], contextlib.AbstractContextManager[object]]
"""Makes a fresh context manager to enter around one recomputation."""

_reentries: list[Callable[[], Reentry | None]] = []


def reenter_in_recomputation(when: Callable[[], Reentry | None]) -> None:
    """Have recomputations re-enter a context: `when()` is asked as a recomputed block's
    forward runs; where it returns a factory, the block's recomputation in backward runs inside
    a context that factory makes. Registered once per process (the same `when` again: nothing)."""
    if when not in _reentries:
        _reentries.append(when)


class _Checkpointed:
    """A block's forward, run under torch.utils.checkpoint (non-reentrant)."""

    def __init__(self, forward: Callable[..., Any], own: bool) -> None:
        self.forward = forward  # what block.forward was
        self.own = own  # whether the block had a forward of its own (an instance attribute)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        factories = [f for when in _reentries if (f := when()) is not None]
        if not factories:
            return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)

        def contexts() -> tuple[Any, Any]:
            return contextlib.nullcontext(), _entered(factories)

        return checkpoint(self.forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


@contextlib.contextmanager
def _entered(factories: Sequence[Reentry]) -> Iterator[None]:
    """Inside a fresh context of each factory."""
    with contextlib.ExitStack() as stack:
        for make in factories:
            stack.enter_context(make())
        yield


def is_recomputed(block: nn.Module) -> bool:
    """Whether `recompute` has wrapped this block (and it has not been removed)."""
    return isinstance(block.__dict__.get("forward"), _Checkpointed)


class Recomputed:
    """The blocks `recompute` wrapped; `remove()` (or leaving the `with`) unwraps them."""

    def __init__(self, blocks: tuple[nn.Module, ...]) -> None:
        self.blocks = blocks

    def remove(self) -> None:
        """Put the blocks' forwards back as they were (again: nothing)."""
        for block in self.blocks:
            wrapper = block.__dict__.get("forward")
            if not isinstance(wrapper, _Checkpointed):
                continue
            if wrapper.own:
                block.forward = wrapper.forward
            else:
                del block.forward
        self.blocks = ()

    def __enter__(self) -> Recomputed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def recompute(blocks: Iterable[nn.Module]) -> Recomputed:
    """Recompute each block in backward instead of keeping what it saves (see the module).

    Call it before the forward runs; the blocks must be modules (TypeError otherwise), each
    given once and not already recomputed (ValueError). A block inside another recomputed block
    is recomputed again within the outer one's recomputation."""
    chosen = tuple(blocks)
    _distinct_modules(chosen, "recompute")
    for k, block in enumerate(chosen):
        if is_recomputed(block):
            raise ValueError(
                f"recompute: block {k} ({type(block).__name__}) is already recomputed"
                " (remove() the earlier handle first)"
            )
    for block in chosen:
        own = "forward" in block.__dict__
        block.forward = _Checkpointed(block.forward, own)
    return Recomputed(chosen)


def _distinct_modules(blocks: Sequence[object], who: str) -> None:
    """TypeError for a block that is not a module, ValueError for one given twice."""
    seen: set[int] = set()
    for k, block in enumerate(blocks):
        if not isinstance(block, nn.Module):
            raise TypeError(f"{who}: block {k} is a {type(block).__name__}, not a nn.Module")
        if id(block) in seen:
            raise ValueError(f"{who}: block {k} ({type(block).__name__}) is given twice")
        seen.add(id(block))


def names_of(model: nn.Module, blocks: Sequence[nn.Module], who: str) -> list[str]:
    """The qualified names of `blocks` in `model`: each a submodule (not the model itself),
    given once, none inside another (ValueError naming the block otherwise)."""
    _distinct_modules(blocks, who)
    name_of = {id(m): name for name, m in model.named_modules(remove_duplicate=False) if name}
    names: list[str] = []
    for k, block in enumerate(blocks):
        name = name_of.get(id(block))
        if name is None:
            raise ValueError(
                f"{who}: block {k} ({type(block).__name__}) is not a submodule of the model"
            )
        names.append(name)
    for name in names:
        for other in names:
            if other != name and name.startswith(other + "."):
                raise ValueError(f"{who}: block {name} is inside block {other}")
    return names
