"""The offline wing of tidalpool: work on traces away from a training job.

- `plan_command`, `simulate_command`: `tidalpool plan` and `tidalpool simulate`.
- `replay`: `tidalpool replay`, a trace's iteration run in a live session under the daemon's
  plan, measured beside the simulator's prediction.
- `formats`: trace CSV v1, MiniMalloc placement CSVs and their solutions, PyTorch memory
  snapshots; `plot`: pictures of placements and swap simulations.
- `torch`: recording training steps on PyTorch's meta device (`record`), and choosing blocks
  to recompute for a memory limit (`plan_recompute`).

The one layer that may import both the client (`tidalclient`) and the planner (`tidalplan`).
"""
