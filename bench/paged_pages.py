"""The paged executor's page bookkeeping alone: `Residency.place` and `drop` for every block of
one training iteration, in the trace's order, again and again, as a session running a plan does.

The blocks of the iteration (ResNet-18, batch 8, traces/ by default) get the same addresses in
every iteration, one after another in the range (a plan's addresses repeat too), so from the
second iteration on every block finds its pages still mapped, stale, with their frames free: the
steady path, which costs no system call and is all bookkeeping. Blocks that own whole pages
(`tidalcore.pages.owns_pages`) take theirs; the others are packed into shared pages. Each drop
names the compute work that last used the block (a completed event), as a session's frees do.
The time is the calling thread's CPU time per iteration, the median over the rounds, with the
pages touched: the bookkeeping costs per page, so small pages cost the most.

    .venv/bin/python bench/paged_pages.py [--trace FILE] [--page 64KiB] [--rounds 7] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from tidalclient.devices.pages import Frames, SimPageSpace
from tidalclient.devices.streams import Stream
from tidalclient.executors.residency import Residency
from tidalcore.pages import owns_pages
from tidalcore.units import align_up, parse_size
from tidaloffline.simulate_command import load

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 2 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=ROOT / "traces" / "resnet18.b8.trace.csv")
    parser.add_argument("--page", default="64KiB")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=20, help="per round")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    page = parse_size(args.page)
    it = load(args.trace)

    # Addresses: owning blocks from 0, packed ones after them, each block its own bytes.
    owning = [owns_pages(int(b.size), page) for b in it.blocks]
    offsets, at = [0] * len(it.blocks), 0
    for k, (b, own) in enumerate(zip(it.blocks, owning, strict=True)):
        if own:
            offsets[k] = at
            at += align_up(int(b.size), page)
    packed_base = at
    for k, (b, own) in enumerate(zip(it.blocks, owning, strict=True)):
        if not own:
            offsets[k] = at
            at += align_up(int(b.size), 256)
    length = align_up(at, 4 * CHUNK)
    pages = length // page
    events: list[tuple[int, int, bool]] = []  # (tick, block, alloc)
    for k, b in enumerate(it.blocks):
        events.append((int(b.start), k, True))
        events.append((min(int(b.end), it.ticks), k, False))  # crossing blocks: at the end
    events.sort()
    touched = sum(
        -(-int(b.size) // page) if own else (o + int(b.size) - 1) // page - o // page + 1
        for b, own, o in zip(it.blocks, owning, offsets, strict=True)
    )

    fds = []
    for _ in range(length // CHUNK):
        fd = os.memfd_create("tidalpool-bench")
        os.ftruncate(fd, CHUNK)
        fds.append(fd)
    space = SimPageSpace(fds, CHUNK, page, length)
    for fd in fds:
        os.close(fd)
    out, into = Stream("swap-out", None), Stream("swap-in", None)
    residency = Residency(space, Frames(pages), 0, 0, out, into)
    done = out.record()
    done.wait()

    def iteration(n: int) -> None:
        key = n * len(it.blocks)
        for _, k, alloc in events:
            if alloc:
                residency.place(key + k, offsets[k], int(it.blocks[k].size), owning[k])
            else:
                residency.drop(key + k, done)

    n = 0
    for _ in range(3):  # the first maps every page; then the steady path
        iteration(n)
        n += 1
    per_round = []
    gc.disable()
    for _ in range(args.rounds):
        start = time.thread_time_ns()
        for _ in range(args.iterations):
            iteration(n)
            n += 1
        per_round.append((time.thread_time_ns() - start) / args.iterations)
    gc.enable()
    residency.close()
    out.close()
    into.close()
    space.retire()
    space.close()

    result = {
        "trace": args.trace.name,
        "page_bytes": page,
        "blocks": len(it.blocks),
        "owning_blocks": sum(owning),
        "packed_base": packed_base,
        "pages_touched": touched,
        "us_per_iteration": round(statistics.median(per_round) / 1000, 1),
        "ns_per_page": round(statistics.median(per_round) / touched, 1),
        "rounds_us": [round(r / 1000, 1) for r in per_round],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['trace']}: {result['blocks']} blocks ({result['owning_blocks']} own whole"
            f" pages), {touched} pages of {args.page} touched an iteration:"
            f" {result['us_per_iteration']} us an iteration, {result['ns_per_page']} ns a page"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
