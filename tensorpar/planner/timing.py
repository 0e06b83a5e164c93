"""Lower bounds on time, and the estimates used only to rank and explain.

A lower bound here is a time no real system can beat for the given model and layout:

- compute: the least matmul FLOPs (causal attention counting only unmasked pairs, recomputation
  as configured) over the dense peak FLOP/s of every device, perfectly balanced;
- memory: bytes that must be read from HBM over peak HBM bandwidth (the roofline of Williams et
  al. 2009; for decoding, the weight-streaming bound of Pope et al. 2022, Sec. 2);
- communication: unavoidable bytes over peak per-direction link bandwidth, zero latency
  (:mod:`tensorpar.planner.collectives`). Intra-node and inter-node links work in parallel, so
  the bound is the larger of the two sums, not their total;
- overlap: computation, memory traffic and communication may all overlap, so a step is bounded
  by their maximum (a real step usually takes longer than the sum).

Not counted, each of which only makes real systems slower: elementwise work, kernel launch and
collective latency, pipeline bubbles (zero-bubble schedules can remove them, Qi et al. 2023),
load imbalance, and the embedding lookup. Estimates (``*_estimate_s``) add those that a simple
model can name: ring bytes instead of unavoidable ones, a fixed latency per collective, no
overlap, the schedule's bubble (:mod:`.schedules`; 1F1B's is ``(p - 1)/(m + p - 1)`` of the step,
Narayanan et al. 2021, Sec. 2.2). They are not bounds.
"""
from __future__ import annotations

from .collectives import collective_time_lower_bound, ring_time_estimate
from .comm import CommItem


def compute_time_lower_bound(flops: float, n_devices: int, peak_flops: float) -> float:
    """``F / (n X_peak)``: every device at its dense peak, perfectly balanced (Narayanan et al.
    2021, Sec. 5.1, with the achieved X replaced by the peak)."""
    return flops / (n_devices * peak_flops)


def memory_time_lower_bound(n_bytes: float, hbm_bytes_per_s: float) -> float:
    """``bytes / HBM bandwidth``: the roofline memory term (Williams et al. 2009, CACM 52(4))."""
    return n_bytes / hbm_bytes_per_s


def steps_per_s_upper_bound(seconds_per_step: float) -> float:
    """The ceiling ``1 / t_min`` implied by a lower bound on the step time."""
    return float("inf") if seconds_per_step == 0 else 1.0 / seconds_per_step


def on_one_node(item: CommItem, placement: dict, pp: int) -> tuple[bool, int]:
    """Whether ``item``'s group fits in one node, and how many of its members share a node."""
    if item.group == "tp":
        return placement["tp"] >= item.group_size, placement["tp"]
    if item.group == "dp":
        return placement["dp"] >= item.group_size, placement["dp"]
    # pipeline sends go to the next stage; the tied-embedding group joins the first and last stage
    return placement["pp"] >= (pp if item.group == "embedding" else 2), 1


def item_time_lower_bound(item: CommItem, placement: dict, pp: int, intra: float, inter: float) -> float:
    """Least seconds for ``item.count`` collectives of this kind (see ``collectives``)."""
    local, per_node = on_one_node(item, placement, pp)
    if item.op == "send":
        # the t ranks of a stage each send their shard over their own link
        one = item.bytes_sent_per_device / (intra if local else inter)
    else:
        one = collective_time_lower_bound(item.op, item.payload_bytes, item.group_size,
                                          per_node=item.group_size if local else per_node,
                                          intra_bytes_per_s=intra, inter_bytes_per_s=inter)
    return item.count * one


def comm_time_lower_bound(items: list[CommItem], placement: dict, pp: int, intra: float, inter: float) -> dict:
    """Least communication seconds of one device: intra-node and inter-node sums, and their max."""
    per_link = {"intra_node_s": 0.0, "inter_node_s": 0.0}
    for it in items:
        local, _ = on_one_node(it, placement, pp)
        per_link["intra_node_s" if local else "inter_node_s"] += item_time_lower_bound(it, placement, pp, intra, inter)
    per_link["total_s"] = max(per_link.values())
    return per_link


def comm_time_estimate(items: list[CommItem], placement: dict, pp: int, intra: float, inter: float,
                       latency_s: float) -> float:
    """Estimate (not a bound): ring bytes over the link plus ``latency_s`` per collective, serial."""
    total = 0.0
    for it in items:
        local, _ = on_one_node(it, placement, pp)
        bw = intra if local else inter
        total += it.count * ring_time_estimate(it.op, it.payload_bytes, it.group_size, bytes_per_s=bw,
                                               latency_s=latency_s)
    return total


def decode_bytes_read_per_device(weight_bytes: float, kv_bytes: float) -> float:
    """Bytes a decode step must read on one device: its weights (every one takes part in every
    token) plus the cached K/V of the keys attended to: the whole context, or the window in
    sliding-window layers (Pope et al. 2022, Sec. 2; Kwon et al. 2023)."""
    return weight_bytes + kv_bytes
