"""Bytes each rank sends in a collective: the ring formulas, in one place.

Under the ring algorithms (Patarasuk & Yuan 2009; NCCL's docs, "PERFORMANCE.md"), with ``N`` the
full tensor's bytes (the all-reduced tensor, the all-gather's result, the reduce-scatter's input)
and ``p`` ranks, each rank sends::

    all-reduce                  2 (p - 1) / p * N
    all-gather, reduce-scatter      (p - 1) / p * N
    broadcast                   by the backend's algorithm: NCCL's pipelined chain src -> src+1 -> ...
                                (N each, the chain's last rank 0), gloo's binomial tree
                                (gloo/broadcast.cc: N per child, ceil(log2 p) at src), shared
                                memory (the source writes N once, every peer reads it)

The runtime's ledger records these (``tensorpar.distributed.ledger``) and the planner predicts with
them: one float expression, so a prediction equals a record bit for bit. The exact fractions
live apart in ``tensorpar.reference.costs`` (the oracle, which shares no code with this).
"""
from __future__ import annotations

RING_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
P2P_OPS = ("send", "recv")  # pipeline stages' point-to-point transfers
BROADCAST_ALGORITHMS = ("chain", "tree", "shared")


def ring_bytes_sent(op: str, payload_bytes, group_size: int, *, rank: int = 0, src: int = 0,
                    broadcast_algorithm: str = "chain"):
    """Bytes group rank ``rank`` sends for ``op`` on ``payload_bytes`` over ``group_size`` ranks
    (an int where the product is whole). ``src`` and ``broadcast_algorithm`` matter for broadcast
    only."""
    p = group_size
    if op not in RING_OPS + P2P_OPS:
        raise ValueError(f"unknown collective {op!r}; valid: {', '.join(RING_OPS + P2P_OPS)}")
    factors = {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p}
    factors.update(send=1, recv=0)  # point-to-point: the sender sends the tensor once, the receiver nothing
    factor = factors[op] if op in factors else broadcast_sends(p, (rank - src) % p, broadcast_algorithm)
    sent = factor * payload_bytes
    return int(sent) if float(sent).is_integer() else sent


def broadcast_sends(p: int, v: int, algorithm: str) -> int:
    """How many times the rank at distance ``v`` from a broadcast's source sends the whole tensor."""
    if algorithm == "chain":
        return 0 if p == 1 or v == p - 1 else 1
    if algorithm == "shared":
        return 1 if v == 0 and p > 1 else 0
    if algorithm == "tree":
        # binomial tree: the rank at v sends to v + 2^k for every k >= bit_length(v) within the group
        return sum(1 for k in range(v.bit_length(), max(p - 1, 1).bit_length()) if v + (1 << k) < p)
    raise ValueError(f"broadcast_algorithm {algorithm!r}; valid: {', '.join(BROADCAST_ALGORITHMS)}")


def bus_bandwidth_factor(op: str, p: int) -> float:
    """nccl-tests' busbw / algbw factor (NVIDIA/nccl-tests doc/PERFORMANCE.md): all-reduce
    ``2(p-1)/p``; reduce-scatter, all-gather, all-to-all ``(p-1)/p``; broadcast, reduce 1."""
    factors = {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p,
               "all_to_all": (p - 1) / p, "broadcast": 1.0, "reduce": 1.0}
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}; valid: {', '.join(factors)}")
    return factors[op]
