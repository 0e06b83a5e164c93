"""Collectives over simulated ranks, with a byte log.

A list holds one array per rank (``shards[r]`` lives on device ``r``). Each collective returns the
list of per-rank results (copies: no two ranks share memory) and, when given a ``CommLog``,
appends one ``CommRecord`` with the bytes every rank sends under the ring algorithm, rank ``r``
sending to rank ``(r + 1) mod p`` (formulas and sources in ``tensorpar.reference.costs``):

============== ====================================== ===========================
collective     result on every rank                   bytes rank r sends
============== ====================================== ===========================
all_reduce     sum of all shards (rank order)         ``2 (p-1)/p * N``
all_gather     concatenation along ``axis``           ``N - nbytes(shards[(r+1) % p])``,
                                                      ``(p-1)/p * N`` for equal shards
reduce_scatter chunk ``r`` of the sum along ``axis``  ``(p-1)/p * N``
broadcast      ``shards[src]``                        ``N``, except rank ``(src-1) % p``: 0
============== ====================================== ===========================

``N`` is the full tensor's bytes: the all-reduced tensor, the gathered result, the reduce-scatter
input, the broadcast tensor. The sums are plain rank-order sums (a real ring adds chunks in a
rotated order; in exact arithmetic the results agree).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .costs import ring_allreduce_bytes, ring_broadcast_bytes, ring_reduce_scatter_bytes
from .validation import as_numeric, check_divides, check_rank, normalize_axis

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


@dataclass(frozen=True)
class CommRecord:
    """One collective: its op, the full tensor (shape, dtype, ``payload_bytes`` = N) and bytes per rank."""
    op: str
    shape: tuple[int, ...]
    dtype: str
    p: int
    payload_bytes: int
    bytes_sent: tuple[int | float, ...]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"], d["bytes_sent"] = list(self.shape), list(self.bytes_sent)
        return d


@dataclass
class CommLog:
    """The collectives a simulated computation issued, in order."""
    records: list[CommRecord] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.records)

    def count(self, op: str | None = None) -> int:
        return sum(1 for r in self.records if op is None or r.op == op)

    def ops(self) -> list[str]:
        return [r.op for r in self.records]

    def bytes_sent_per_rank(self) -> list[int | float]:
        """Bytes each rank sent over all records (records with fewer ranks count 0 for the rest)."""
        p = max((r.p for r in self.records), default=0)
        return [sum(rec.bytes_sent[r] for rec in self.records if r < rec.p) for r in range(p)]

    def total_bytes_sent(self) -> int | float:
        return sum(self.bytes_sent_per_rank())

    def by_op(self) -> dict[str, int | float]:
        """Total bytes sent (all ranks) per collective op."""
        totals: dict[str, int | float] = {}
        for rec in self.records:
            totals[rec.op] = totals.get(rec.op, 0) + sum(rec.bytes_sent)
        return totals

    def to_dict(self) -> dict:
        return {"records": [r.to_dict() for r in self.records],
                "bytes_sent_per_rank": self.bytes_sent_per_rank(),
                "total_bytes_sent": self.total_bytes_sent()}


def all_reduce(shards, *, log: CommLog | None = None) -> list[np.ndarray]:
    """Every rank gets the elementwise sum of all ranks' arrays (equal shapes and dtypes)."""
    shards = _check_shards(shards, "all_reduce", log)
    _check_same_shape(shards, "all_reduce")
    total = _rank_order_sum(shards)
    p = len(shards)
    _record(log, "all_reduce", total, [ring_allreduce_bytes(total.nbytes, p)] * p)
    return [total.copy() for _ in range(p)]


def all_gather(shards, axis: int = -1, *, log: CommLog | None = None) -> list[np.ndarray]:
    """Every rank gets the shards concatenated along ``axis`` (shapes may differ only on ``axis``)."""
    shards = _check_shards(shards, "all_gather", log)
    axis = normalize_axis(axis, shards[0].ndim, "shards[0]")
    _check_same_shape(shards, "all_gather", except_axis=axis)
    full = np.concatenate(shards, axis=axis)  # (..., sum of shard sizes on axis, ...)
    p = len(shards)
    _record(log, "all_gather", full, [full.nbytes - shards[(r + 1) % p].nbytes for r in range(p)])
    return [full.copy() for _ in range(p)]


def reduce_scatter(shards, axis: int = -1, *, log: CommLog | None = None) -> list[np.ndarray]:
    """Rank ``r`` gets chunk ``r`` (of ``p`` equal chunks along ``axis``) of the sum of all ranks' arrays."""
    shards = _check_shards(shards, "reduce_scatter", log)
    axis = normalize_axis(axis, shards[0].ndim, "shards[0]")
    _check_same_shape(shards, "reduce_scatter")
    p = len(shards)
    check_divides(shards[0].shape[axis], p, f"reduce_scatter: axis {axis} of shape {shards[0].shape}")
    total = _rank_order_sum(shards)
    _record(log, "reduce_scatter", total, [ring_reduce_scatter_bytes(total.nbytes, p)] * p)
    return [chunk.copy() for chunk in np.split(total, p, axis=axis)]  # each: axis size n / p


def broadcast(shards, src: int = 0, *, log: CommLog | None = None) -> list[np.ndarray]:
    """Every rank gets ``shards[src]``; the other entries are ignored (they may be ``None``)."""
    check_log(log)
    if not isinstance(shards, (list, tuple)) or not shards:
        raise ValueError(f"broadcast: shards must be a non-empty list of per-rank arrays, got {shards!r}")
    p = len(shards)
    src = check_rank(src, p, "src")
    value = as_numeric(shards[src], f"broadcast: shards[{src}]")
    _record(log, "broadcast", value, ring_broadcast_bytes(value.nbytes, p, src))
    return [value.copy() for _ in range(p)]


def check_log(log) -> None:
    """``log`` must be a ``CommLog`` or ``None`` (checked before anything is computed)."""
    if log is not None and not isinstance(log, CommLog):
        raise ValueError(f"log must be a CommLog or None, got {type(log).__name__}")


def _check_shards(shards, op: str, log) -> list[np.ndarray]:
    check_log(log)
    if not isinstance(shards, (list, tuple)) or not shards:
        raise ValueError(f"{op}: shards must be a non-empty list of per-rank arrays, got {shards!r}")
    arrays = [as_numeric(s, f"{op}: shards[{r}]") for r, s in enumerate(shards)]
    for r, a in enumerate(arrays):
        if a.dtype != arrays[0].dtype:
            raise ValueError(f"{op}: shards[{r}] has dtype {a.dtype} but shards[0] has {arrays[0].dtype}; "
                             f"all ranks must pass one dtype")
    return arrays


def _check_same_shape(shards: list[np.ndarray], op: str, except_axis: int | None = None):
    def key(shape):
        return tuple(d for i, d in enumerate(shape) if i != except_axis)
    for r, a in enumerate(shards):
        if a.ndim != shards[0].ndim or key(a.shape) != key(shards[0].shape):
            along = "" if except_axis is None else f" (except on axis {except_axis})"
            raise ValueError(f"{op}: shards[{r}] has shape {a.shape} but shards[0] has {shards[0].shape}; "
                             f"shapes must match{along}")


def _rank_order_sum(shards: list[np.ndarray]) -> np.ndarray:
    """``shards[0] + shards[1] + ...`` in rank order, into a new array (same shape as every shard)."""
    total = shards[0].copy()
    for shard in shards[1:]:
        total += shard
    return total


def _record(log: CommLog | None, op: str, full: np.ndarray, bytes_sent: list):
    if log is None:
        return
    log.records.append(CommRecord(op, tuple(full.shape), str(full.dtype), len(bytes_sent),
                                  int(full.nbytes), tuple(bytes_sent)))
