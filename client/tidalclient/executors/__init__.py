"""Executors: what allocates a session's blocks in its lease (`base.Executor`, one interface).

- `python`: blocks placed in Python, by best-fit (`bestfit`) or a plan's arena (`arena`).
- `swapping`: an adaptor over any executor that keeps the device bytes under a limit by moving
  blocks to the host lease and back.
- `native`: blocks placed by the C hot path that a framework's allocator calls.
"""
