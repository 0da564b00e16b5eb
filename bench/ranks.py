"""Planning cost for the ranks of one job on one node: one solve for all, or one each.

N sim daemons, one per GPU of a node's layout (`<dir>/gpu<k>`), and N ranks started together,
each `tidalpool replay TRACE --socket-dir <dir>/gpu<k>` (the same iteration, the same limit and
page: the ranks of one job). "shared": the daemons share one plan cache, as the template units'
do, so the first to need the plan solves it and the others wait for it and take it from the
cache; "alone": each daemon has its own cache, so every rank's plan is solved, N solves at once
on the machine's cores. Copies are throttled to `--copy-gbps` (12): ranks on identical GPUs
plan at one bandwidth, where N sim daemons started at once on two cores each measure another
(and a plan made at a bandwidth more than `MEASURED_SPREAD` from a daemon's is not taken).
Reported per N and mode: the solves (the daemons' `plan.sent` lines not from the cache), each
daemon's planning seconds, and the seconds from the ranks' start to the first planned step of
every rank (each replay's switch iteration; the slowest rank's).

    .venv/bin/python bench/ranks.py [--ranks 2,4] [--trace traces/gpt2.b4.s128.trace.csv]
        [--limit 0.9] [--page 2MiB] [--copy-gbps 12] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run(n: int, shared: bool, args: argparse.Namespace) -> dict[str, Any]:
    """N daemons and N ranks; what the planning cost."""
    from tidalclient.local import LocalDaemon
    from tidaloffline.replay.session import CHUNK, LEARNING_ITERATIONS, lease_bytes
    from tidaloffline.simulate_command import load
    from tidalplan.autoswap import load as load_curve

    peak = int(load_curve(load(args.trace)).max(initial=0))
    pool = str(lease_bytes(peak))
    base = Path(tempfile.mkdtemp(prefix="tp-ranks-", dir="/tmp"))
    daemons = []
    try:
        for k in range(n):
            cache = base / ("plans" if shared else f"plans{k}")
            daemons.append(
                LocalDaemon.start(
                    base / f"gpu{k}",
                    device_pool=pool,
                    host_pool=pool,
                    default_lease=pool,
                    extra=(
                        "--plan-cache-dir",
                        str(cache),
                        "--plan-after-iterations",
                        str(LEARNING_ITERATIONS),
                    ),
                    chunk_size=str(CHUNK),
                )
            )
        started = time.monotonic()
        ranks = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tidalpool",
                    "replay",
                    str(args.trace),
                    "--socket-dir",
                    str(base / f"gpu{k}"),
                    "--limit",
                    args.limit,
                    "--page",
                    args.page,
                    "--iterations",
                    "5",
                    "--copy-gbps",
                    str(args.copy_gbps),
                    "--plan-timeout",
                    "600",
                    "--json",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for k in range(n)
        ]
        to_plan = []
        for rank in ranks:
            _, err = rank.communicate(timeout=1800)
            if rank.returncode != 0:
                raise SystemExit(f"a rank failed ({rank.returncode}):\n{err[-2000:]}")
            switch = re.search(r"\[\s*([0-9.]+) s\] iteration \d+ \(switch\)", err)
            to_plan.append(float(switch.group(1)) if switch else None)
        wall = time.monotonic() - started
        sent = []
        for k in range(n):
            log = (base / f"gpu{k}" / "tidalpoold.log").read_text()
            for line in log.splitlines():
                if "plan.sent" in line:
                    source = re.search(r"\bsource=(\S+)", line)
                    seconds = re.search(r"\bseconds=([0-9.]+)", line)
                    sent.append(
                        {
                            "gpu": k,
                            "source": source.group(1) if source else None,
                            "seconds": float(seconds.group(1)) if seconds else None,
                        }
                    )
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(base, ignore_errors=True)
    return {
        "ranks": n,
        "cache": "shared" if shared else "alone",
        "solves": sum(s["source"] != "cache" for s in sent),
        "plans_sent": sent,
        "seconds_to_first_planned_step": to_plan,
        "slowest_rank_s": max((t for t in to_plan if t is not None), default=None),
        "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--trace", type=Path, default=ROOT / "traces" / "gpt2.b4.s128.trace.csv")
    parser.add_argument("--limit", default="0.9")
    parser.add_argument("--page", default="2MiB")
    parser.add_argument("--copy-gbps", type=float, default=12.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for n in (int(x) for x in args.ranks.split(",")):
        for shared in (True, False):
            row = run(n, shared, args)
            rows.append(row)
            print(
                f"{n} ranks, cache {row['cache']}: {row['solves']} solves,"
                f" planning s {[s['seconds'] for s in row['plans_sent']]},"
                f" slowest rank's first planned step at {row['slowest_rank_s']} s"
                f" (all: {row['seconds_to_first_planned_step']})",
                flush=True,
            )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"trace": str(args.trace), "limit": args.limit, "page": args.page, "rows": rows},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
