"""Bytes a collective moves, and the least time it can take.

``N`` is the full tensor's bytes (the all-reduced tensor, the all-gather's result, the
reduce-scatter's input; NCCL's "S"), ``p`` the group size.

Two byte counts are kept apart:

- **ring bytes sent per device** (what the ledger records and what NCCL's ring moves;
  Patarasuk & Yuan 2009; NVIDIA/nccl-tests doc/PERFORMANCE.md "bus bandwidth" factors):
  all-reduce ``2 (p-1)/p N``, all-gather and reduce-scatter ``(p-1)/p N``, broadcast ``N``.
- **unavoidable bytes per device**, which no algorithm can go below, used for the lower bounds.
  In-network reduction (NVLink SHARP, InfiniBand SHARP) beats the ring: NVIDIA reports ~480 GB/s
  all-reduce bus bandwidth on H100, above the 450 GB/s NVLink line rate (nccl-tests issue #212),
  so ring bytes over line rate is *not* a bound. What is: every output element of an all-reduce
  depends on other devices' inputs, so each device must receive at least ``N`` bytes (and send
  ``N``); an all-gather must bring in the ``(p-1)/p N`` bytes a device lacks; a reduce-scatter
  must ship out the ``(p-1)/p N`` bytes of contributions to other devices' shards. Assumes no
  compression of the payload.
"""
from __future__ import annotations

from tensorpar.architecture import ring
from tensorpar.architecture.ring import bus_bandwidth_factor

from .layout import ZERO_STAGES, check_choice, check_size

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send")


def _check(op: str, p: int) -> None:
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; valid: {', '.join(OPS)}")
    check_size("group size", p)


def ring_bytes_sent(op: str, payload_bytes: float, p: int) -> float:
    """Bytes each device sends under the ring algorithm (the runtime ledger's ``bytes_sent``):
    all-reduce ``2(p-1)/p N``, all-gather / reduce-scatter ``(p-1)/p N``, broadcast and
    point-to-point send ``N`` (0 when p = 1). The ledger's own formula
    (:func:`tensorpar.architecture.ring.ring_bytes_sent`), so predictions equal records bit for bit."""
    _check(op, p)
    if op == "send":
        return int(payload_bytes) if float(payload_bytes).is_integer() else payload_bytes
    return ring.ring_bytes_sent(op, payload_bytes, p)


BROADCAST_ALGORITHMS = ("chain", "tree")


def broadcast_bytes_sent(payload_bytes: int, p: int, rank: int, src: int = 0, algorithm: str = "chain") -> int:
    """Bytes group rank ``rank`` sends in a broadcast of ``payload_bytes`` (N) from ``src``.

    Every rank but the source receives N once, so the group sends ``(p - 1) N`` in all; how that
    splits over ranks depends on the algorithm (v = (rank - src) mod p, the distance from src):

    - ``"chain"`` (NCCL's pipelined ring broadcast): src -> src+1 -> ...; every member forwards
      N except the chain's last, v = p - 1, which sends nothing.
    - ``"tree"`` (gloo's binomial tree, gloo/broadcast.cc): the rank at v sends N to v + 2^k for
      every k >= bit_length(v) with v + 2^k < p; the source sends ceil(log2 p) times.
    """
    _check("broadcast", p)
    if algorithm not in BROADCAST_ALGORITHMS:
        raise ValueError(f"broadcast algorithm ({algorithm!r}) must be one of: {', '.join(BROADCAST_ALGORITHMS)}")
    if not 0 <= rank < p or not 0 <= src < p:
        raise ValueError(f"rank ({rank}) and src ({src}) must lie in [0, {p}) for a group of {p}")
    return ring.broadcast_sends(p, (rank - src) % p, algorithm) * payload_bytes


def unavoidable_device_bytes(op: str, payload_bytes: float, p: int) -> float:
    """Least bytes one device must receive (all-reduce, all-gather, broadcast, send) or send
    (reduce-scatter), whatever the algorithm: all-reduce ``N``, all-gather and reduce-scatter
    ``(p-1)/p N``, broadcast and send ``N``."""
    _check(op, p)
    if p == 1 and op != "send":
        return 0.0
    if op in ("all_gather", "reduce_scatter"):
        return (p - 1) / p * payload_bytes
    return float(payload_bytes)


def unavoidable_node_bytes(op: str, payload_bytes: float, p: int, per_node: int) -> float:
    """Least bytes that must cross into (or out of) one node when a group of ``p`` spans nodes with
    ``per_node`` members each. Devices in a node may first combine locally, so an all-reduce still
    needs ``N`` in (every element needs the other nodes' partial sums), an all-gather
    ``(p - m)/p N`` (the shards held elsewhere), a reduce-scatter ``(p - m)/p N`` out."""
    _check(op, p)
    if per_node >= p:
        return 0.0
    if op in ("all_gather", "reduce_scatter"):
        return (p - per_node) / p * payload_bytes
    return float(payload_bytes)


def collective_time_lower_bound(op: str, payload_bytes: float, p: int, *, per_node: int,
                                intra_bytes_per_s: float, inter_bytes_per_s: float) -> float:
    """Least seconds for one collective: unavoidable bytes over peak per-direction bandwidth.
    Within a node, ``unavoidable_device_bytes / intra``; across nodes, the node's unavoidable
    bytes over its ``per_node`` NICs, ``unavoidable_node_bytes / (m * inter)``. Latency is taken
    as zero, so the bound is true for any message size."""
    if p == 1:
        return 0.0
    if per_node >= p:
        return unavoidable_device_bytes(op, payload_bytes, p) / intra_bytes_per_s
    return unavoidable_node_bytes(op, payload_bytes, p, per_node) / (per_node * inter_bytes_per_s)


def ring_time_estimate(op: str, payload_bytes: float, p: int, *, bytes_per_s: float,
                       latency_s: float = 0.0) -> float:
    """An estimate, not a bound: ring bytes sent over the link's bus bandwidth plus a fixed
    latency (the alpha-beta model, Hockney 1994; nccl-tests: ``t = S * factor / busbw``)."""
    if p == 1 and op != "send":
        return 0.0
    return latency_s + ring_bytes_sent(op, payload_bytes, p) / bytes_per_s


def algorithm_bandwidth(payload_bytes: float, seconds: float) -> float:
    """nccl-tests ``algbw = S / t`` (NVIDIA/nccl-tests doc/PERFORMANCE.md)."""
    return payload_bytes / seconds


def bus_bandwidth(op: str, payload_bytes: float, seconds: float, p: int) -> float:
    """nccl-tests ``busbw = algbw * factor``, comparable with the link's per-direction speed."""
    return algorithm_bandwidth(payload_bytes, seconds) * bus_bandwidth_factor(op, p)


def zero_dp_comm_elements(params: float, zero_stage: int) -> float:
    """Data-parallel traffic per device per step in elements, Rajbhandari et al. 2020, Sec. 7, in
    their large-N_d form: 2 Psi for plain DP and ZeRO stages 1-2 (reduce-scatter + all-gather),
    3 Psi for stage 3 (parameters all-gathered in forward and backward). The exact ring volume is
    ``(N_d - 1)/N_d`` of these."""
    check_choice("zero_stage", zero_stage, ZERO_STAGES)
    return (3.0 if zero_stage == 3 else 2.0) * params


def pp_p2p_bytes(micro_batch: int, seq: int, hidden: int, bytes_per_elem: int, *, tp: int = 1,
                 scatter_gather: bool = False) -> float:
    """Bytes one stage boundary moves per micro-batch in one direction: ``b s h e``; with the
    scatter/gather optimisation each of the t ranks sends ``b s h e / t`` (Narayanan et al. 2021,
    Sec. 4.1)."""
    n = micro_batch * seq * hidden * bytes_per_elem
    return n / tp if scatter_gather else n


def link_transfer_time(n_bytes: float, bytes_per_s: float) -> float:
    """Least seconds to move ``n_bytes`` over one link at its peak per-direction rate (for
    instance a KV cache between prefill and decode devices)."""
    if not bytes_per_s > 0:
        raise ValueError(f"link bandwidth ({bytes_per_s!r}) must be a positive number of bytes/s")
    return n_bytes / bytes_per_s
