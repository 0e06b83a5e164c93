"""Rounding-error bounds for comparing a split computation with the unsplit one.

An inner product of length ``n`` evaluated in floating point in *any* order (so also as a sum of
``p`` partial inner products, which is what a row split does) satisfies

    |fl(x^T y) - x^T y| <= gamma_n |x|^T |y|,   gamma_n = n u / (1 - n u),

with ``u`` the unit roundoff (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
2002, eq. (3.5)). The split and the unsplit results both lie within that distance of the exact
product, so they differ by at most ``2 gamma_n |X| |W|`` elementwise. Integer products are exact
(barring overflow), so their bound is zero. Two extra terms in ``n`` cover the rounding of the
bound's own evaluation and of a bias addition.
"""
from __future__ import annotations

import numpy as np


def gamma(n: int, dtype) -> float:
    """``gamma_n = n u / (1 - n u)`` for the unit roundoff ``u = eps / 2`` of a float ``dtype``."""
    u = float(np.finfo(dtype).eps) / 2
    if n * u >= 1:
        raise ValueError(f"gamma_n is undefined for n={n} with {np.dtype(dtype)} (n u >= 1)")
    return n * u / (1 - n * u)


def matmul_error_bound(X, W, n_terms: int | None = None) -> np.ndarray:
    """Elementwise bound on ``|split(X @ W) - X @ W|``: ``2 gamma_{n+2} |X| @ |W|``.

    ``n_terms`` is the contraction length, ``X.shape[-1]`` unless padding lengthened it.
    """
    X, W = np.asarray(X), np.asarray(W)
    dtype = np.result_type(X, W)
    if dtype.kind in "iu":
        return np.zeros(X.shape[:-1] + (W.shape[-1],))
    n = (X.shape[-1] if n_terms is None else n_terms) + 2
    return 2 * gamma(n, dtype) * (np.abs(X) @ np.abs(W))


def mlp_error_bound(X, W1, W2, b1=None, b2=None) -> np.ndarray:
    """Elementwise bound on ``|split(relu(X W1 + b1) W2 + b2) - relu(X W1 + b1) W2 + b2|``.

    With ``E_H = 2 gamma_{k+2} (|X| |W1| + |b1|)`` bounding the first layer's difference (relu is
    1-Lipschitz, so it carries over to ``H``), the second layer adds ``gamma_{f+2}`` rounding to
    each of the two results computed from ``H``s that differ by ``E_H``:
    ``(2 gamma_{f+2} (|H| + E_H) + E_H) |W2|``, plus ``2 gamma_{f+2} |b2|`` for the bias.
    """
    X, W1, W2 = np.asarray(X), np.asarray(W1), np.asarray(W2)
    dtype = np.result_type(X, W1, W2)
    b1 = np.zeros(W1.shape[1]) if b1 is None else np.asarray(b1)
    b2 = np.zeros(W2.shape[1]) if b2 is None else np.asarray(b2)
    if dtype.kind in "iu":
        return np.zeros(X.shape[:-1] + (W2.shape[1],))
    g1, g2 = gamma(X.shape[-1] + 2, dtype), gamma(W1.shape[1] + 2, dtype)
    e_h = 2 * g1 * (np.abs(X) @ np.abs(W1) + np.abs(b1))       # (..., ffn)
    h = np.maximum(X @ W1 + b1, 0)                              # (..., ffn)
    return (2 * g2 * (np.abs(h) + e_h) + e_h) @ np.abs(W2) + 2 * g2 * np.abs(b2)  # (..., out)
