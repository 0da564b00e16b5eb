"""The planner's HiGHS solvers: silent and single-threaded, so that each is deterministic.

HiGHS keeps one task scheduler per process, sized by the first solver that runs; a later
solver that asks for another number of threads runs on that one, and a branch-and-bound
stopped by a node limit can then end elsewhere. So a program's answer would depend on which
program ran first in the process. Every program of the planner runs on one thread.
"""

from __future__ import annotations

import highspy
import numpy as np
import numpy.typing as npt
from highspy._core import _Highs
from scipy.sparse import csr_matrix

_FEASIBLE = 2  # HiGHS' primal_solution_status of a feasible solution


def solver(**options: bool | int | float | str) -> _Highs:
    """A HiGHS instance with no output, one thread, and `options` set.

    Silent through HiGHS' own option, set before any other call as HiGHS asks:
    `highspy._core._Highs` is the binding's solver itself (`highspy.Highs` calls a method while
    it is made, which writes HiGHS' banner before an option can be set)."""
    made = _Highs()
    made.setOptionValue("output_flag", False)
    made.setOptionValue("threads", 1)
    for name, value in options.items():
        made.setOptionValue(name, value)
    return made


def cover(
    cost: npt.NDArray[np.float64],
    rows: csr_matrix,
    lower: npt.NDArray[np.float64],
    binary: int,
    **options: bool | int | float | str,
) -> npt.NDArray[np.float64] | None:
    """min cost·x over x in [0, 1] with rows·x >= lower, the first `binary` columns of x
    integer, by `solver(**options)`; None when it found no feasible x within its limits."""
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = rows.shape[1], rows.shape[0]
    lp.col_cost_ = cost
    lp.col_lower_ = np.zeros(lp.num_col_)
    lp.col_upper_ = np.ones(lp.num_col_)
    lp.row_lower_ = lower
    lp.row_upper_ = np.full(lp.num_row_, highspy.kHighsInf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = rows.indptr
    lp.a_matrix_.index_ = rows.indices
    lp.a_matrix_.value_ = rows.data
    if binary:
        integer, real = highspy.HighsVarType.kInteger, highspy.HighsVarType.kContinuous
        lp.integrality_ = [integer] * binary + [real] * (lp.num_col_ - binary)
    made = solver(**options)
    made.passModel(lp)
    made.run()
    if made.getInfo().primal_solution_status != _FEASIBLE:
        return None
    return np.asarray(made.getSolution().col_value, dtype=np.float64)
