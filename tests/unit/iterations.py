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


# Two layers forward, a loss, two backward. Blocks in allocation order: 0 X, 1 A, 2 B, 3 L,
# 4 GB, 5 GA; W persistent. The peak, 13,110 bytes, is at ticks 7 and 8 (X A B L GB and W).
TWO_LAYERS = [
    "a X 1000",  # 0
    "a A 4000",  # 1
    "o fwd1 1000 X W >A",  # 2   A's writer
    "a B 4000",  # 3
    "o fwd2 2000 A >B",  # 4   A's last access before backward
    "a L 10",  # 5
    "o loss 100 B >L",  # 6
    "a GB 4000",  # 7
    "o bwd2 2000 B L >GB",  # 8
    "f B",  # 9
    "f L",  # 10
    "a GA 4000",  # 11
    "o bwd1 1000 A GB >GA",  # 12  A needed again
    "f GB",  # 13
    "f A",  # 14
    "f GA",  # 15
    "f X",  # 16
]


def paged_pair(scale: int = 1) -> Iteration:
    """An iteration for pages of 1024 × `scale` bytes: W (persistent, 4 pages) and V
    (persistent, small); A (2 pages) over [0, 4), C (3000 × scale bytes: 3 pages wasting 2.4%)
    over [5, 9), B (1000 × scale bytes, under a page) over [1, 7):

        t0 a A  t1 a B  t2 f1 W A >B  t3 o  t4 f A  t5 a C  t6 f2 B >C  t7 f B  t8 f3 W C V  t9 f C
    """
    n = scale
    return build(
        [
            f"a A {2048 * n}",
            f"a B {1000 * n}",
            "o f1 100 W A >B",
            "o g 100",
            "f A",
            f"a C {3000 * n}",
            "o f2 100 B >C",
            "f B",
            "o f3 100 W C V",
            "f C",
        ],
        {"W": 4096 * n, "V": 100 * n},
    )
