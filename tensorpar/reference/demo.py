"""A transformer MLP split over simulated devices, checked against the unsplit one.

``relu(X W1 + b1) W2 + b2`` with ``X: (batch, tokens, hidden)``, ``W1: (hidden, ffn)``,
``W2: (ffn, hidden)``, ``ffn = ffn_mult * hidden``, all float64 from one seed. ``W1`` is split by
columns and ``W2`` by rows over ``p`` devices (``mlp_tensor_parallel``); the result is compared
elementwise with the dense computation under the rounding bound of
``tensorpar.reference.bounds.mlp_error_bound``, and the byte log is compared with the ring
all-reduce formula. The defaults make ``Y`` 2 x 16 x 64 x 8 = 16,384 bytes, the source
exercise's all-reduce, so each of 4 devices sends 24,576 bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .advice import AxisAdvice, advise_mlp
from .bounds import mlp_error_bound
from .collectives import CommLog, CommRecord
from .costs import ring_allreduce_bytes, shard_bytes
from .seed import mlp_tensor_parallel
from .validation import check_p


@dataclass(frozen=True)
class MLPDemoResult:
    """What the demo computed, compared and communicated (``to_dict`` is JSON-serialisable)."""
    p: int
    seed: int
    dtype: str
    x_shape: tuple[int, ...]
    w1_shape: tuple[int, ...]
    w2_shape: tuple[int, ...]
    w1_shard_shape: tuple[int, ...]
    w2_shard_shape: tuple[int, ...]
    equal: bool                  # every element within its rounding bound
    max_abs_diff: float
    max_error_bound: float
    weight_bytes: int
    weight_bytes_per_device: int | float
    collectives: tuple[CommRecord, ...]
    bytes_sent_per_rank: tuple[int | float, ...]
    expected_bytes_per_rank: int | float   # ring all-reduce formula 2(p-1)/p * nbytes(Y)
    advice: AxisAdvice

    @property
    def log_matches_formula(self) -> bool:
        return (len(self.collectives) == 1 and self.collectives[0].op == "all_reduce"
                and all(b == self.expected_bytes_per_rank for b in self.bytes_sent_per_rank))

    def to_dict(self) -> dict:
        d = {name: getattr(self, name) for name in self.__dataclass_fields__}
        d.update(collectives=[c.to_dict() for c in self.collectives], advice=self.advice.to_dict(),
                 bytes_sent_per_rank=list(self.bytes_sent_per_rank),
                 log_matches_formula=self.log_matches_formula)
        for key in ("x_shape", "w1_shape", "w2_shape", "w1_shard_shape", "w2_shard_shape"):
            d[key] = list(d[key])
        return d


def run_mlp_demo(p=4, *, batch=2, tokens=16, hidden=64, ffn_mult=4, seed=0) -> MLPDemoResult:
    """Split the MLP over ``p`` simulated devices and compare it with the unsplit MLP."""
    p = check_p(p)
    batch, tokens, hidden, ffn_mult = (check_p(v, name) for v, name in
                                       ((batch, "batch"), (tokens, "tokens"), (hidden, "hidden"),
                                        (ffn_mult, "ffn_mult")))
    seed = _check_seed(seed)
    ffn = ffn_mult * hidden
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((batch, tokens, hidden))                 # (B, T, H)
    W1 = rng.standard_normal((hidden, ffn)) / np.sqrt(hidden)        # (H, F)
    b1 = rng.standard_normal(ffn) * 0.1                              # (F,)
    W2 = rng.standard_normal((ffn, hidden)) / np.sqrt(ffn)           # (F, H)
    b2 = rng.standard_normal(hidden) * 0.1                           # (H,)
    log = CommLog()
    y_split = mlp_tensor_parallel(X, W1, W2, p, b1=b1, b2=b2, log=log)  # (B, T, H)
    y_dense = np.maximum(X @ W1 + b1, 0) @ W2 + b2                      # (B, T, H)
    diff = np.abs(y_split - y_dense)
    bound = mlp_error_bound(X, W1, W2, b1, b2)
    weight_bytes = W1.nbytes + W2.nbytes
    return MLPDemoResult(
        p=p, seed=seed, dtype=str(X.dtype), x_shape=X.shape, w1_shape=W1.shape, w2_shape=W2.shape,
        w1_shard_shape=(hidden, ffn // p), w2_shard_shape=(ffn // p, hidden),
        equal=bool(np.all(diff <= bound)), max_abs_diff=float(diff.max()),
        max_error_bound=float(bound.max()), weight_bytes=weight_bytes,
        weight_bytes_per_device=shard_bytes(weight_bytes, p), collectives=tuple(log.records),
        bytes_sent_per_rank=tuple(log.bytes_sent_per_rank()),
        expected_bytes_per_rank=ring_allreduce_bytes(y_dense.nbytes, p),
        advice=advise_mlp(X.shape, W1.shape, W2.shape, p, itemsize=X.itemsize))


def _check_seed(seed) -> int:
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)
