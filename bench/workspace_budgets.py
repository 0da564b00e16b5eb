"""What SuperNeurons' dynamic workspace (§3.5) would hand each convolution under a placed plan.

    .venv/bin/python bench/workspace_budgets.py [--traces resnet50.b32,vgg16.b32,...]
        [--fractions 0.9,0.7,0.5] [--gbps 25] [--json PATH]

For each model trace of ../shared/traces/models and each limit (a fraction of its peak), the
daemon's plan is made as the daemon makes it (`combined.fit` of the swaps-only search, placed
and fitted), then `tidalplan.workspace.budgets` gives, at every op, the largest free range of
the placed arena (what one workspace allocation can really get) and the free bytes in all
(the limit less what is live). Printed for the convolution ops (forward and backward): the
smallest, median and largest contiguous budget, the same for the free sum, and how many
convolutions would get less contiguous room than the free sum promises.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / p) for p in ("core", "planner", "client", "offline")]

from tidaloffline.formats import read_trace_csv  # noqa: E402
from tidalplan.autoswap import load  # noqa: E402
from tidalplan.combined import fit  # noqa: E402
from tidalplan.learn import extract  # noqa: E402
from tidalplan.policies import swaps_only  # noqa: E402
from tidalplan.split import kind_of  # noqa: E402
from tidalplan.workspace import budgets  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces" / "models"
MiB = 1 << 20


def case(name: str, fraction: float, gbps: float) -> dict[str, Any]:
    events = read_trace_csv(TRACES / f"{name}.trace.csv")
    it = extract(events, events.marks())
    peak = int(load(it).max())
    limit = int(peak * fraction)
    started = time.perf_counter()
    plan = fit(it, swaps_only, limit, gbps, gbps)
    out: dict[str, Any] = {"trace": name, "fraction": fraction, "limit_bytes": limit}
    if not plan.fits or plan.combined is None:
        out["fits"] = False
        return out
    found = [b for b in budgets(plan.combined, limit) if kind_of(b.op) == "convolution"]
    contiguous = [int(b.contiguous) for b in found]
    free = [int(b.free) for b in found]
    out.update(
        fits=True,
        footprint_bytes=int(plan.combined.footprint),
        convolutions=len(found),
        contiguous=[min(contiguous), int(statistics.median(contiguous)), max(contiguous)],
        free=[min(free), int(statistics.median(free)), max(free)],
        short=sum(c < f for c, f in zip(contiguous, free, strict=True)),
        plan_s=round(time.perf_counter() - started, 1),
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default="resnet50.b32,vgg16.b32,densenet121.b32")
    parser.add_argument("--fractions", default="0.9,0.7,0.5")
    parser.add_argument("--gbps", type=float, default=25.0)
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    if not TRACES.is_dir():
        raise SystemExit(f"workspace_budgets: no model traces at {TRACES}")
    results = []
    print(
        "trace               limit  convs  contiguous MiB (min/med/max)"
        "  free MiB (min/med/max)  short"
    )
    for name in a.traces.split(","):
        for fraction in (float(f) for f in a.fractions.split(",")):
            r = case(name, fraction, a.gbps)
            results.append(r)
            if not r["fits"]:
                print(f"{name:18s}  {fraction:4.2f}  no placed plan fits")
                continue
            c = "/".join(f"{v / MiB:.0f}" for v in r["contiguous"])
            f = "/".join(f"{v / MiB:.0f}" for v in r["free"])
            print(
                f"{name:18s}  {fraction:4.2f}  {r['convolutions']:5d}  {c:>28s}  {f:>22s}"
                f"  {r['short']:5d}",
                flush=True,
            )
    if a.json:
        a.json.write_text(json.dumps({"gbps": a.gbps, "cases": results}, indent=2))


if __name__ == "__main__":
    main()
