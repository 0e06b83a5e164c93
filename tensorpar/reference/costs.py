"""Cost formulas of tensor parallelism: weight bytes per device and ring-collective bytes per device.

``N`` is the full tensor's bytes (the all-reduced tensor, the gathered result, the reduce-scatter
input) and ``p`` the number of devices. Under the ring algorithm every rank sends

- all-reduce:      ``2 (p-1)/p * N``  (a reduce-scatter then an all-gather; Patarasuk & Yuan,
  "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 69(2), 2009),
- all-gather:      ``(p-1)/p * N``    (Thakur, Rabenseifner & Gropp, "Optimization of collective
  communication operations in MPICH", IJHPCA 19(1), 2005, ring algorithm),
- reduce-scatter:  ``(p-1)/p * N``    (same source),

which are also the "bus bandwidth" factors of NCCL's nccl-tests (doc/PERFORMANCE.md).

Results are exact: an ``int`` when the formula gives a whole number of bytes, else a ``float``.
"""
from __future__ import annotations

from fractions import Fraction

from .validation import check_byte_count, check_p, check_rank


def _number(value: Fraction) -> int | float:
    return int(value) if value.denominator == 1 else float(value)


def shard_bytes(total_bytes, p) -> int | float:
    """Weight bytes each of ``p`` devices holds when ``total_bytes`` of weights are split evenly.

    ``total_bytes / p``: a 14 GB model split 4 ways holds 3.5 GB per device.
    """
    total_bytes = check_byte_count(total_bytes, "total_bytes")
    p = check_p(p)
    return _number(Fraction(total_bytes, p))


def ring_allreduce_bytes(n_bytes, p) -> int | float:
    """Bytes each device sends in a ring all-reduce of an ``n_bytes`` tensor: ``2 (p-1)/p * n_bytes``.

    16,384 bytes over 4 devices: each sends 2 * 3/4 * 16384 = 24,576 bytes.
    """
    n_bytes = check_byte_count(n_bytes)
    p = check_p(p)
    return _number(Fraction(2 * (p - 1) * n_bytes, p))


def ring_allgather_bytes(n_bytes, p) -> int | float:
    """Bytes each device sends in a ring all-gather of an ``n_bytes`` result: ``(p-1)/p * n_bytes``."""
    n_bytes = check_byte_count(n_bytes)
    p = check_p(p)
    return _number(Fraction((p - 1) * n_bytes, p))


def ring_reduce_scatter_bytes(n_bytes, p) -> int | float:
    """Bytes each device sends in a ring reduce-scatter of an ``n_bytes`` input: ``(p-1)/p * n_bytes``."""
    n_bytes = check_byte_count(n_bytes)
    p = check_p(p)
    return _number(Fraction((p - 1) * n_bytes, p))


def ring_broadcast_bytes(n_bytes, p, src: int = 0) -> list[int]:
    """Bytes each rank sends when ``src`` broadcasts ``n_bytes`` along the ring ``src -> src+1 -> ...``.

    Every rank but the last in the chain forwards the whole tensor once, so ``p - 1`` ranks send
    ``n_bytes`` and rank ``(src - 1) mod p`` sends nothing (a pipelined chain broadcast, as in NCCL,
    whose nccl-tests bus-bandwidth factor for broadcast is 1).
    """
    n_bytes = check_byte_count(n_bytes)
    p = check_p(p)
    src = check_rank(src, p, "src")
    last = (src - 1) % p
    return [0 if r == last else n_bytes for r in range(p)]

