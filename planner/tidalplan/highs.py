"""The planner's HiGHS solvers: silent and single-threaded, so that each is deterministic.

HiGHS keeps one task scheduler per process, sized by the first solver that runs; a later
solver that asks for another number of threads runs on that one, and a branch-and-bound
stopped by a node limit can then end elsewhere. So a program's answer would depend on which
program ran first in the process. Every program of the planner runs on one thread.
"""

from __future__ import annotations

from typing import NamedTuple

import highspy
import numpy as np
import numpy.typing as npt
from highspy._core import _Highs
from scipy.sparse import csr_matrix, hstack, vstack

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


class Spans(NamedTuple):
    """Columns holding bytes over ranges of consecutive rows: column `col[k]` puts `value[k]`
    in every row of [first[k], last[k]) (an empty range puts none)."""

    col: npt.NDArray[np.int64]
    first: npt.NDArray[np.int64]
    last: npt.NDArray[np.int64]
    value: npt.NDArray[np.float64]


def cover(
    cost: npt.NDArray[np.float64],
    spans: Spans,
    need: npt.NDArray[np.float64],
    rows: csr_matrix,
    lower: npt.NDArray[np.float64],
    binary: int,
    **options: bool | int | float | str,
) -> npt.NDArray[np.float64] | None:
    """min cost·x over x in [0, 1] where, in every row k of `need`, the spans over it sum to at
    least need[k], and rows·x >= lower; the first `binary` columns of x integer; by
    `solver(**options)`; None when it found no feasible x within its limits.

    The span rows are passed differenced: with a surplus s_k >= 0 per row, the row
    A_k·x - s_k = need_k is the same as row 0 alone and, for k > 0,
    (A_k - A_{k-1})·x - s_k + s_{k-1} = need_k - need_{k-1}. The program is the same, and a
    span keeps two nonzeros, where it starts and past where it ends, however long it is."""
    n, band = rows.shape[1], len(need)
    used = spans.first < spans.last
    ends = used & (spans.last < band)
    diff = csr_matrix(
        (
            np.concatenate((spans.value[used], -spans.value[ends])),
            (
                np.concatenate((spans.first[used], spans.last[ends])),
                np.concatenate((spans.col[used], spans.col[ends])),
            ),
        ),
        shape=(band, n),
    )
    diff.eliminate_zeros()
    k = np.arange(band)
    surplus = csr_matrix(
        (
            np.concatenate((np.full(band, -1.0), np.ones(max(band - 1, 0)))),
            (np.concatenate((k, k[1:])), np.concatenate((k, k[:-1]))),
        ),
        shape=(band, band),
    )
    matrix = csr_matrix(
        vstack([hstack([diff, surplus]), hstack([rows, csr_matrix((rows.shape[0], band))])])
    )
    steps = np.diff(need, prepend=0.0)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n + band, matrix.shape[0]
    lp.col_cost_ = np.concatenate((cost, np.zeros(band)))
    lp.col_lower_ = np.zeros(lp.num_col_)
    lp.col_upper_ = np.concatenate((np.ones(n), np.full(band, highspy.kHighsInf)))
    lp.row_lower_ = np.concatenate((steps, lower))
    lp.row_upper_ = np.concatenate((steps, np.full(rows.shape[0], highspy.kHighsInf)))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = matrix.indptr
    lp.a_matrix_.index_ = matrix.indices
    lp.a_matrix_.value_ = matrix.data
    if binary:
        integer, real = highspy.HighsVarType.kInteger, highspy.HighsVarType.kContinuous
        lp.integrality_ = [integer] * binary + [real] * (lp.num_col_ - binary)
    made = solver(**options)
    made.passModel(lp)
    made.run()
    if made.getInfo().primal_solution_status != _FEASIBLE:
        return None
    return np.asarray(made.getSolution().col_value, dtype=np.float64)[:n]
