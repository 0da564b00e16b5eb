"""Hand-built iterations for planner tests, one tick per step:

    "a X 100"             allocates block X of 100 bytes
    "f X"                 frees X
    "o 1000 X Y"          an op of 1000 ns (named op<tick>) reading X and Y
    "o NAME 1000 X >Y"    op NAME of 1000 ns reading X and writing Y

Block ids are 1, 2, ... by first mention, persistent blocks first; `it.blocks` is in
allocation order.
"""

from __future__ import annotations

from tidalcore.units import Bytes, Tick
from tidalplan.model import Access, Iteration, IterBlock, Op


def build(steps: list[str], persistent: dict[str, int] | None = None) -> Iteration:
    ids: dict[str, int] = {name: k + 1 for k, name in enumerate(persistent or {})}
    starts: dict[str, tuple[int, int]] = {}
    ends: dict[str, int] = {}
    ops: list[Op] = []
    accesses: list[Access] = []
    for tick, step in enumerate(steps):
        kind, *args = step.split()
        if kind == "a":
            ids.setdefault(args[0], len(ids) + 1)
            starts[args[0]] = (tick, int(args[1]))
        elif kind == "f":
            ends[args[0]] = tick
        else:
            name = f"op{tick}" if args[0].isdigit() else args.pop(0)
            ops.append(Op(tick=Tick(tick), name=name, duration_ns=int(args[0])))
            for b in args[1:]:
                block = ids[b.lstrip(">")]
                accesses.append(Access(tick=Tick(tick), block=block, write=b.startswith(">")))
    blocks = tuple(
        IterBlock(id=ids[n], size=Bytes(size), start=Tick(start), end=Tick(ends[n]))
        for n, (start, size) in sorted(starts.items(), key=lambda kv: kv[1][0])
    )
    return Iteration(
        ticks=len(steps),
        blocks=blocks,
        ops=tuple(ops),
        accesses=tuple(accesses),
        persistent=tuple((ids[n], Bytes(s)) for n, s in (persistent or {}).items()),
    )
