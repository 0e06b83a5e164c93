"""The seed API of the source exercise, in the row-vector convention ``Y = X @ W``, ``W: (in, out)``.

Each function simulates ``p`` devices in one process: it slices the weights as the devices would
hold them, computes every device's local product, and combines them with the collective a real
run would issue (``tensorpar.reference.collectives``), which it records in ``log`` when a
``CommLog`` is passed. The return value is always the plain result (a numpy array).
``X`` may have leading batch axes: ``X: (..., in)``.
"""
from __future__ import annotations

import numpy as np

from .collectives import CommLog, all_gather, all_reduce, check_log
from .partition import partition
from .validation import as_numeric, check_chain, check_divides, check_matmul, check_ndim


def column_parallel(X, W, p, *, log: CommLog | None = None) -> np.ndarray:
    """``Y = X W`` with ``W = [W_1 ... W_p]`` split along its columns (``out``).

    Rank ``r`` holds ``W_r: (in, out/p)`` and computes ``Y_r = X W_r: (..., out/p)``, a slice of
    ``Y`` (no communication). One all-gather concatenates the slices along the last axis; each
    rank sends ``(p-1)/p * nbytes(Y)``. Returns ``Y: (..., out)``.
    """
    X, W, p = check_matmul(X, W, p, "column_parallel")
    check_divides(W.shape[1], p, "column_parallel: the column axis of W (out)")
    check_log(log)
    w_shards = partition(W, p, axis=1)                 # p x (in, out/p)
    y_shards = [X @ w_shard for w_shard in w_shards]   # p x (..., out/p)
    return all_gather(y_shards, axis=-1, log=log)[0]   # (..., out)


def row_parallel(X, W, p, *, log: CommLog | None = None) -> np.ndarray:
    """``Y = X W`` with ``W`` split along its rows (``in``) and ``X`` along its last axis.

    ``X = [X_1 ... X_p]``, ``W = [W_1; ...; W_p]``; rank ``r`` computes the partial sum
    ``Y_r = X_r W_r: (..., out)`` and one all-reduce adds them, ``Y = sum_r Y_r``; each rank sends
    ``2 (p-1)/p * nbytes(Y)``. Slicing a replicated ``X`` is local (no bytes move).
    """
    X, W, p = check_matmul(X, W, p, "row_parallel")
    check_divides(W.shape[0], p, "row_parallel: the row axis of W (in)")
    check_log(log)
    x_shards = partition(X, p, axis=-1)                                 # p x (..., in/p)
    w_shards = partition(W, p, axis=0)                                  # p x (in/p, out)
    y_partials = [x @ w for x, w in zip(x_shards, w_shards)]            # p x (..., out)
    return all_reduce(y_partials, log=log)[0]                           # (..., out)


def mlp_tensor_parallel(X, W1, W2, p, *, b1=None, b2=None, log: CommLog | None = None) -> np.ndarray:
    """``relu(X W1 + b1) W2 + b2`` with ``W1`` split by columns and ``W2`` by rows (Megatron-LM MLP).

    Rank ``r`` holds ``W1_r: (in, ffn/p)``, ``b1_r: (ffn/p,)`` and ``W2_r: (ffn/p, out)`` and
    computes ``H_r = relu(X W1_r + b1_r)`` (relu is elementwise, so it applies to each slice) and
    the partial sum ``Y_r = H_r W2_r``. Exactly one all-reduce, ``Y = sum_r Y_r``, then ``b2``
    once. Shoeybi et al., "Megatron-LM", arXiv:1909.08053, section 3, Fig. 3a.
    """
    X, W1, p = check_matmul(X, W1, p, "mlp_tensor_parallel", real=True)
    W2 = as_numeric(W2, "mlp_tensor_parallel: W2", real=True)
    check_ndim(W2, "mlp_tensor_parallel: W2", exact=2)
    check_chain(W1.shape[1], W2.shape[0], f"mlp_tensor_parallel: W1's columns (shape {W1.shape})",
                f"W2's rows (shape {W2.shape})")
    check_divides(W1.shape[1], p, "mlp_tensor_parallel: the hidden axis (W1's columns, W2's rows)")
    b1 = _check_bias(b1, W1.shape[1], "b1")
    b2 = _check_bias(b2, W2.shape[1], "b2")
    check_log(log)
    w1_shards = partition(W1, p, axis=1)                                # p x (in, ffn/p)
    b1_shards = [0] * p if b1 is None else partition(b1, p, axis=0)     # p x (ffn/p,)
    w2_shards = partition(W2, p, axis=0)                                # p x (ffn/p, out)
    h_shards = [np.maximum(X @ w1 + b, 0) for w1, b in zip(w1_shards, b1_shards)]  # p x (..., ffn/p)
    y_partials = [h @ w2 for h, w2 in zip(h_shards, w2_shards)]        # p x (..., out)
    y = all_reduce(y_partials, log=log)[0]                              # (..., out)
    return y if b2 is None else y + b2


def _check_bias(b, size: int, name: str) -> np.ndarray | None:
    """A bias of shape ``(size,)``, or ``None`` (no bias)."""
    if b is None:
        return None
    b = as_numeric(b, f"mlp_tensor_parallel: {name}", real=True)
    if b.shape != (size,):
        raise ValueError(f"mlp_tensor_parallel: {name} must have shape ({size},), got {b.shape}")
    return b
