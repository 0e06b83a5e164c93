"""A matmul-like contraction ``Y = X @ W`` (``X: (..., in)``, ``W: (in, out)``) split along a chosen axis.

``axis`` names what is partitioned across the ``p`` devices:

``"out"``
    ``W``'s columns: each rank makes a slice of ``Y``; all-gather on the last axis (column-parallel).
``"in"``
    The contracted axis (``X``'s last, ``W``'s rows): each rank makes a partial sum of ``Y``;
    all-reduce (row-parallel).
``"batch"`` or an int ``d`` (``0 <= d < X.ndim - 1``)
    A leading axis of ``X`` (``"batch"`` is axis 0), ``W`` replicated: each rank makes a slice of
    ``Y``; all-gather on that axis (data parallelism).

``mode`` is a partition mode of ``tensorpar.reference.partition``. Under ``"pad"`` the padded
rows/columns are zeros: in ``"in"`` they add zero to every partial sum, in the gathering splits
the gathered result is trimmed back to ``Y``'s shape (the all-gather moves the padding too).
"""
from __future__ import annotations

import numpy as np

from .collectives import CommLog, all_gather, all_reduce, check_log
from .partition import MODES, partition
from .validation import check_choice, check_divides, check_matmul

AXES = ("out", "in", "batch")


def split_matmul(X, W, p, axis, *, mode: str = "even", log: CommLog | None = None) -> np.ndarray:
    """``X @ W`` computed on ``p`` simulated devices with ``axis`` partitioned; returns ``Y: (..., out)``."""
    X, W, p = check_matmul(X, W, p, "split_matmul")
    check_choice(mode, "mode", MODES)
    check_log(log)
    if axis == "out":
        return _split_out(X, W, p, mode, log)
    if axis == "in":
        return _split_in(X, W, p, mode, log)
    return _split_leading(X, W, p, _leading_axis(axis, X), mode, log)


def _split_out(X, W, p, mode, log):
    if mode == "even":
        check_divides(W.shape[1], p, "split_matmul: the column axis of W (out)")
    w_shards = partition(W, p, axis=1, mode=mode)          # p x (in, out_per_partition)
    y_shards = [X @ w for w in w_shards]                   # p x (..., out_per_partition)
    y = all_gather(y_shards, axis=-1, log=log)[0]          # (..., out, or padded out)
    return y[..., :W.shape[1]]                             # (..., out)


def _split_in(X, W, p, mode, log):
    if mode == "even":
        check_divides(W.shape[0], p, "split_matmul: the contracted axis (X's last, W's rows)")
    x_shards = partition(X, p, axis=-1, mode=mode)         # p x (..., in_per_partition)
    w_shards = partition(W, p, axis=0, mode=mode)          # p x (in_per_partition, out)
    y_partials = [x @ w for x, w in zip(x_shards, w_shards)]  # p x (..., out)
    return all_reduce(y_partials, log=log)[0]              # (..., out)


def _split_leading(X, W, p, d, mode, log):
    if mode == "even":
        check_divides(X.shape[d], p, f"split_matmul: axis {d} of X (shape {X.shape})")
    x_shards = partition(X, p, axis=d, mode=mode)          # p x X's shape with axis d per partition
    y_shards = [x @ W for x in x_shards]                   # p x (..., per partition on d, ..., out)
    y = all_gather(y_shards, axis=d, log=log)[0]           # Y, padded on axis d under "pad"
    return np.take(y, np.arange(X.shape[d]), axis=d)       # (..., out)


def _leading_axis(axis, X: np.ndarray) -> int:
    if axis == "batch":
        axis = 0
    leading = range(X.ndim - 1)
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)) or axis not in leading:
        valid = ["out", "in"] + (["batch"] if X.ndim > 1 else []) + list(leading)
        raise ValueError(f"split_matmul: axis must be one of {valid} for X of shape {X.shape}, got {axis!r}")
    return int(axis)
