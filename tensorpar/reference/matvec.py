"""The column-vector convention of the sources, ``y = W x`` with ``W: (m, n)``, ``x: (n,)`` or ``(n, k)``.

Here the names of the row-vector convention swap (``W_cv = W_rv.T``):

- ``rowwise_matvec``: ``W`` partitioned by rows gives slices of ``y``, joined by all-gather.
  Equals ``column_parallel(x.T, W.T, p).T``.
- ``colwise_matvec``: ``W`` partitioned by columns (and ``x`` by rows) gives partial sums of ``y``,
  added by all-reduce. Equals ``row_parallel(x.T, W.T, p).T``.
"""
from __future__ import annotations

import numpy as np

from .collectives import CommLog, all_gather, all_reduce, check_log
from .partition import partition
from .validation import as_numeric, check_chain, check_divides, check_ndim, check_p


def rowwise_matvec(W, x, p, *, log: CommLog | None = None) -> np.ndarray:
    """``y = W x`` with ``W = [W_1; ...; W_p]`` split by rows, ``W_r: (m/p, n)``.

    Rank ``r`` computes ``y_r = W_r x: (m/p,)`` (or ``(m/p, k)``), a slice of ``y``; one all-gather
    along axis 0 joins them, each rank sending ``(p-1)/p * nbytes(y)``.
    """
    W, x, p = _check_matvec(W, x, p, "rowwise_matvec")
    check_divides(W.shape[0], p, "rowwise_matvec: the row axis of W (m)")
    check_log(log)
    w_shards = partition(W, p, axis=0)                # p x (m/p, n)
    y_shards = [w @ x for w in w_shards]              # p x (m/p,) or (m/p, k)
    return all_gather(y_shards, axis=0, log=log)[0]   # (m,) or (m, k)


def colwise_matvec(W, x, p, *, log: CommLog | None = None) -> np.ndarray:
    """``y = W x`` with ``W = [W_1 ... W_p]`` split by columns and ``x = [x_1; ...; x_p]`` by rows.

    Rank ``r`` computes the partial sum ``y_r = W_r x_r: (m,)`` (or ``(m, k)``); one all-reduce
    adds them, ``y = sum_r y_r``, each rank sending ``2 (p-1)/p * nbytes(y)``.
    """
    W, x, p = _check_matvec(W, x, p, "colwise_matvec")
    check_divides(W.shape[1], p, "colwise_matvec: the column axis of W (n)")
    check_log(log)
    w_shards = partition(W, p, axis=1)                       # p x (m, n/p)
    x_shards = partition(x, p, axis=0)                       # p x (n/p,) or (n/p, k)
    y_partials = [w @ xs for w, xs in zip(w_shards, x_shards)]  # p x (m,) or (m, k)
    return all_reduce(y_partials, log=log)[0]                # (m,) or (m, k)


def _check_matvec(W, x, p, fn: str):
    p = check_p(p)
    W = as_numeric(W, f"{fn}: W")
    x = as_numeric(x, f"{fn}: x")
    check_ndim(W, f"{fn}: W", exact=2)
    if x.ndim not in (1, 2):
        raise ValueError(f"{fn}: x must be 1-D (n,) or 2-D (n, k), got shape {x.shape}")
    check_chain(W.shape[1], x.shape[0], f"{fn}: W's columns (shape {W.shape})",
                f"x's rows (shape {x.shape})")
    return W, x, p
