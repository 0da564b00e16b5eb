"""`tidalpool replay TRACE --limit L`: a trace's steady iteration run against a live daemon.

The iteration's allocations, frees and ops run in a session as a training job would run them:
each op's compute is a timed wait of its traced duration (times `--compute-scale`) on the
session's compute stream, asynchronous to this thread, and the swap engine moves the blocks
under the limit. Once the daemon's plan is in use, the measured iterations are put beside the
simulator's prediction for the same plan (`Plan.prediction`).

    trace ──load──▶ Iteration ──script──▶ per tick: alloc i | free | op k (its block refs)
                                              │
    session (swap_limit = L, async compute) ◀─┘ malloc · free · op(duration_ns) · step
      compute stream:  [wait d·K]─[check stamps read]─[stamp blocks written]─ ... per op
    stats per iteration (differences) + plan.prediction ──▶ table or JSON

- `command`: the command line and the rule of its iterations (`add_parser`, `run`).
- `replayer`: the iteration as a script of ticks, run in a session (`script`, `Replayer`).
- `compute`: the compute stream, its timed waits and the blocks' stamps (`SimCompute`,
  `CudaCompute`).
- `report`: what was measured beside the prediction (`Report`, `render`).
- `errors`: `ReplayError`, the failure that becomes the command's exit status.
"""

from __future__ import annotations

from tidaloffline.replay.command import add_parser, run

__all__ = ["add_parser", "run"]
