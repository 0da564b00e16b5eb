"""The planner: pure functions from a learned iteration to a plan.

It imports only the shared core (`tidalcore`) and numeric libraries, does no I/O (no files,
streams, processes, sockets, RPC, command lines, logs or plots) and changes no process-wide
state; import-linter's contracts and tests/unit/test_planner_purity.py hold it to that. Given
the same inputs and a search budget that is not reached, it gives the same plan, on a CPU; the
daemon and the offline tools (`tidalpool plan`, `tidalpool simulate`) call the same code.
"""
