"""The planner's HiGHS solvers: silent and single-threaded, so that each is deterministic.

HiGHS keeps one task scheduler per process, sized by the first solver that runs; a later
solver that asks for another number of threads runs on that one, and a branch-and-bound
stopped by a node limit can then end elsewhere. So a program's answer would depend on which
program ran first in the process. Every program of the planner runs on one thread.
"""

from __future__ import annotations

from highspy._core import _Highs


def solver(**options: bool | int | float | str) -> _Highs:
    """A HiGHS instance with no output, one thread, and `options` set."""
    made = _Highs()
    made.setOptionValue("output_flag", False)
    made.setOptionValue("threads", 1)
    for name, value in options.items():
        made.setOptionValue(name, value)
    return made
