"""The planner: pure functions from a learned iteration to a plan.

No gRPC, no CUDA, no clock, no global state (STYLE.md 1): every function here is
deterministic and testable on a CPU, and the CLI (`tidalpool plan`) and the
daemon call the same code.
"""
