"""``plan(model, layout, hardware)``: every figure of one layout, as a JSON-serialisable report."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace

from . import flops as F
from . import memory as M
from .collectives import link_transfer_time, pp_p2p_bytes
from .comm import CommItem, bytes_sent, dp_collectives, item, pp_collectives, scale, tp_collectives
from .feasibility import divisibility, memory_reasons, placement_warnings, valid_tp_sizes
from .hardware import Hardware
from .layout import Layout, group_placement
from .models import ModelSpec
from .params import (ceil_div, count_params, embedding_params, layer_params, layers_per_stage,
                     stage_params_per_device)
from .timing import (comm_time_estimate, comm_time_lower_bound, compute_time_lower_bound, decode_bytes_read_per_device,
                     memory_time_lower_bound, pipeline_bubble_fraction, steps_per_s_upper_bound)

ASSUMPTIONS = [
    "lower bounds use vendor peak dense FLOP/s, peak HBM bandwidth and peak per-direction link "
    "bandwidth, zero latency, and let compute, memory traffic and communication overlap fully",
    "compute bounds count matmul FLOPs only, with causal attention over unmasked pairs only (at most "
    "the sliding window per query where the model has one); decode reads the K/V of the attended keys",
    "communication bounds count unavoidable bytes (an all-reduce must bring N bytes into each "
    "device even with in-network reduction), not ring bytes; ring bytes are listed per item",
    "memory: mixed-precision Adam (16 bytes/parameter at 16-bit), activations per Korthikanti et "
    "al. 2022 without FlashAttention, 1F1B keeps min(pp, micro-batches) in flight on stage 0",
    "estimates (not bounds) add ring bytes, a fixed latency per collective, no overlap, the 1F1B bubble",
]


@dataclass
class PlanReport:
    """Everything ``tensorpar plan --json`` prints. Bytes, FLOPs, seconds; ``None`` where the split
    itself is invalid (tp not dividing heads or kv heads)."""

    model: dict
    layout: dict
    hardware: dict
    params: int
    flops_per_iteration: float
    hardware_flops_per_iteration: float
    flops_lower_bound_per_iteration: float
    feasible: bool
    reasons: list
    fixes: list
    warnings: list
    valid_tp_sizes: list
    params_per_device: int | None = None
    params_per_stage: list | None = None
    activation_bytes_per_layer: float | None = None
    kv_cache_bytes_per_token: dict | None = None
    memory_per_device: dict | None = None
    comm: dict | None = None
    compute_time_lower_bound_s: float | None = None
    comm_time_lower_bound_s: float | None = None
    comm_time_lower_bound_by_link: dict | None = None
    step_time_lower_bound_s: float | None = None
    decode_time_per_token_lower_bound_s: float | None = None
    decode_steps_per_s_upper_bound: float | None = None
    decode_bound_terms: dict | None = None
    prefill_time_lower_bound_s: float | None = None
    kv_transfer: dict | None = None
    kv_transfer_time_lower_bound_s: float | None = None
    inference_flops: dict | None = None
    estimates: dict | None = None
    assumptions: list = field(default_factory=lambda: list(ASSUMPTIONS))

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)


@dataclass(frozen=True)
class _Ctx:
    model: ModelSpec
    layout: Layout
    hw: Hardware
    placement: dict
    intra: float
    inter: float
    peak: float
    latency_s: float


def plan(model: ModelSpec, layout: Layout, hardware: Hardware, *, kv_link: str | float = "inter-node",
         kv_tokens: int | None = None, latency_s: float = 10e-6) -> PlanReport:
    """Plan ``model`` under ``layout`` on ``hardware`` (devices per node from the hardware).

    ``kv_link``: where a KV cache would move (``"inter-node"``, ``"intra-node"``, a link name of the
    hardware, or bytes/s). ``kv_tokens``: its size in tokens (default micro_batch x seq).
    ``latency_s``: per-collective latency used by the estimates only, never by the bounds.
    """
    reasons, fixes = divisibility(model, layout)
    g = layout.global_batch
    report = PlanReport(
        model=model.to_dict(), layout=layout.to_dict(), hardware=hardware.to_dict(),
        params=count_params(model), flops_per_iteration=F.flops_per_iteration(model, g),
        hardware_flops_per_iteration=F.hardware_flops_per_iteration(model, g, layout.recompute),
        flops_lower_bound_per_iteration=F.causal_flops_per_iteration(model, g, layout.recompute),
        feasible=False, reasons=reasons, fixes=fixes,
        warnings=placement_warnings(layout, hardware.devices_per_node), valid_tp_sizes=valid_tp_sizes(model))
    if layout.tp not in report.valid_tp_sizes:
        return report  # per-device figures do not exist for this split
    ctx = _Ctx(model, layout, hardware, group_placement(layout, hardware.devices_per_node),
               hardware.intra_node_bytes_per_s, hardware.inter_node_bytes_per_s,
               hardware.peak_flops(layout.dtype), latency_s)
    _fill_memory(report, ctx)
    _fill_step(report, ctx)
    _fill_inference(report, ctx, kv_link, kv_tokens)
    report.reasons += memory_reasons(report.memory_per_device, hardware.mem_bytes, layout)
    report.feasible = not report.reasons
    return report


def _stages(pp: int) -> list[int]:
    return sorted({0, pp - 1} | ({1} if pp > 2 else set()))


def _stage_name(stage: int, pp: int) -> str:
    return "all" if pp == 1 else "first" if stage == 0 else "last" if stage == pp - 1 else "middle"


def _fill_memory(report: PlanReport, c: _Ctx) -> None:
    m, lay, e = c.model, c.layout, c.layout.bytes_per_elem
    per_layer = M.activation_bytes_per_layer(
        m, seq=m.seq, micro_batch=lay.micro_batch, tp=lay.tp, sequence_parallel=lay.sequence_parallel,
        recompute=lay.recompute if lay.workload == "train" else "none", bytes_per_elem=e)
    kv = M.kv_cache_bytes_per_token(m, tp=lay.tp, pp=lay.pp, bytes_per_elem=e)
    stage_params = [stage_params_per_device(m, lay.tp, lay.pp, s) for s in range(lay.pp)]
    per_stage = [_stage_memory(c, s, stage_params[s], per_layer, kv["per_device"]) for s in _stages(lay.pp)]
    report.params_per_stage = stage_params
    report.params_per_device = max(stage_params)
    report.activation_bytes_per_layer = per_layer
    report.kv_cache_bytes_per_token = kv
    report.memory_per_device = max(per_stage, key=lambda d: d["total"])


def _stage_memory(c: _Ctx, stage: int, params: int, per_layer: float, kv_per_token: float) -> dict:
    m, lay, e = c.model, c.layout, c.layout.bytes_per_elem
    kw = dict(seq=m.seq, micro_batch=lay.micro_batch, tp=lay.tp, sequence_parallel=lay.sequence_parallel)
    if lay.workload == "train":
        states = M.model_state_bytes(params, dp=lay.dp, zero_stage=lay.zero_stage, bytes_per_elem=e)
        in_flight = min(lay.pp - stage, lay.num_micro_batches)  # 1F1B: stage s holds pp - s
        acts = per_layer * layers_per_stage(m, lay.pp) * in_flight
        if stage == 0:
            acts += M.embedding_activation_bytes(m, in_flight=in_flight, **kw)
        if stage == lay.pp - 1:
            acts += M.output_activation_bytes(m, bytes_per_elem=e, **kw)
        kv_cache = 0.0
    else:
        states = {"weights": params * e, "gradients": 0.0, "optimizer": 0.0}
        acts = per_layer  # one layer's forward at a time
        kv_cache = lay.micro_batch * m.seq * kv_per_token
    out = {**states, "activations": acts, "kv_cache": kv_cache}
    out["total"] = sum(out.values())
    return {**out, "capacity": c.hw.mem_bytes, "stage": stage}


def _stage_comm(c: _Ctx, stage: int) -> list[CommItem]:
    """Every collective one device of ``stage`` takes part in during one step."""
    m, lay = c.model, c.layout
    name = _stage_name(stage, lay.pp)
    tp = tp_collectives(m, lay, stage=name)["per_micro_batch"]
    pp = pp_collectives(m, lay, stage=name)
    params = stage_params_per_device(m, lay.tp, lay.pp, stage)
    items = scale(tp + pp, lay.num_micro_batches) + dp_collectives(params, lay)
    if m.tied_embeddings and lay.pp > 1 and name in ("first", "last") and lay.workload == "train":
        items.append(item("all_reduce", "tied_embedding", "step", "embedding", 2,
                          embedding_params(m, lay.tp) * lay.bytes_per_elem,
                          note="keeps the first stage's embedding and the last stage's copy equal"))
    return items


def _fill_step(report: PlanReport, c: _Ctx) -> None:
    m, lay = c.model, c.layout
    per_stage = {s: _stage_comm(c, s) for s in _stages(lay.pp)}
    bounds = {s: comm_time_lower_bound(items, c.placement, lay.pp, c.intra, c.inter) for s, items in per_stage.items()}
    worst = max(bounds, key=lambda s: (bounds[s]["total_s"], bytes_sent(per_stage[s])))
    items = per_stage[worst]
    if lay.workload == "train":
        flops = report.flops_lower_bound_per_iteration
    else:  # one step = a forward (prefill) of the global batch
        flops = F.prefill_flops(m, lay.global_batch, m.seq)
    compute = compute_time_lower_bound(flops, lay.devices, c.peak)
    comm = bounds[worst]["total_s"]
    report.comm = {
        "per_layer": [i.to_dict() for i in tp_collectives(m, lay)["per_layer"]],
        "per_step": [i.to_dict() for i in items], "stage": worst,
        "bytes_sent_per_device_per_step": {
            g: bytes_sent([i for i in items if i.group == g]) for g in ("tp", "pp", "dp", "embedding")}
        | {"total": bytes_sent(items)},
    }
    report.compute_time_lower_bound_s = compute
    report.comm_time_lower_bound_s = comm
    report.comm_time_lower_bound_by_link = bounds[worst]
    report.step_time_lower_bound_s = max(compute, comm)
    bubble = pipeline_bubble_fraction(lay.pp, lay.num_micro_batches)
    comm_est = comm_time_estimate(items, c.placement, lay.pp, c.intra, c.inter, c.latency_s)
    report.estimates = {"pipeline_bubble_fraction": bubble, "comm_time_s": comm_est,
                        "step_time_s": compute * (1 + bubble) + comm_est,
                        "latency_per_collective_s": c.latency_s}


def _decode_items(c: _Ctx) -> list[CommItem]:
    """One decode step: every layer's forward collectives (all stages in turn) and the stage hops."""
    m, lay = c.model, c.layout
    one = replace(lay, pp=1, sequence_parallel=False, workload="inference")
    items = tp_collectives(m, one, seq=1, phase="inference")["per_micro_batch"]
    if lay.pp > 1:  # one token per sequence crosses each stage boundary
        n = pp_p2p_bytes(lay.micro_batch, 1, m.hidden, lay.bytes_per_elem)
        shard = pp_p2p_bytes(lay.micro_batch, 1, m.hidden, lay.bytes_per_elem, tp=lay.tp, scatter_gather=True)
        items.append(CommItem("send", "pipeline.activation", "forward", "pp", 2, n, shard, lay.pp - 1))
    return items


def _fill_inference(report: PlanReport, c: _Ctx, kv_link, kv_tokens) -> None:
    m, lay, e, b = c.model, c.layout, c.layout.bytes_per_elem, c.layout.micro_batch
    # a decode step reads every layer's weights and the LM head matrix (the embedding is a lookup),
    # and the cached K/V of the keys each layer attends to (at most the window in windowed layers)
    weights = e * (m.layers * layer_params(m, lay.tp) + m.norm_params + ceil_div(m.vocab, lay.tp) * m.hidden)
    kv_read = b * m.attended_keys(m.seq) * report.kv_cache_bytes_per_token["per_device"] * lay.pp
    decode_flops = F.decode_flops_per_token(m, b, m.seq)
    decode_items = _decode_items(c)
    report.inference_flops = {"decode_step": decode_flops,
                              "prefill_micro_batch": F.prefill_flops(m, b, m.seq),
                              "prefill_global_batch": F.prefill_flops(m, lay.global_batch, m.seq)}
    terms = {"hbm_s": memory_time_lower_bound(decode_bytes_read_per_device(weights, kv_read), c.hw.hbm_bytes_per_s),
             "compute_s": compute_time_lower_bound(decode_flops, lay.tp, c.peak),
             "comm_s": comm_time_lower_bound(decode_items, c.placement, lay.pp, c.intra, c.inter)["total_s"],
             "weight_bytes_read_per_device": weights, "kv_bytes_read_per_device": kv_read}
    decode = max(terms["hbm_s"], terms["compute_s"], terms["comm_s"])
    report.decode_bound_terms = terms
    report.decode_time_per_token_lower_bound_s = decode
    report.decode_steps_per_s_upper_bound = None if decode == 0 else steps_per_s_upper_bound(decode)
    report.comm["decode_per_token"] = [i.to_dict() for i in decode_items]
    report.prefill_time_lower_bound_s = _prefill_bound(report, c)
    report.estimates["decode_time_per_token_s"] = terms["hbm_s"] + comm_time_estimate(
        decode_items, c.placement, lay.pp, c.intra, c.inter, c.latency_s)
    report.kv_transfer = _kv_transfer(report, c, kv_link, kv_tokens)
    report.kv_transfer_time_lower_bound_s = report.kv_transfer["time_lower_bound_s"]


def _prefill_bound(report: PlanReport, c: _Ctx) -> float:
    """A prompt of ``seq`` tokens per sequence, micro_batch sequences: chunks may be pipelined
    across stages, so FLOPs are shared by all tp x pp devices; each device reads its weights once."""
    m, lay = c.model, c.layout
    compute = compute_time_lower_bound(report.inference_flops["prefill_micro_batch"], lay.tp * lay.pp, c.peak)
    hbm = memory_time_lower_bound(report.params_per_device * lay.bytes_per_elem, c.hw.hbm_bytes_per_s)
    one = replace(lay, workload="inference", global_batch=None, dp=1)
    stage = "all" if lay.pp == 1 else "first"
    items = tp_collectives(m, one, stage=stage, phase="inference")["per_micro_batch"]
    comm = comm_time_lower_bound(items, c.placement, lay.pp, c.intra, c.inter)["total_s"]
    return max(compute, hbm, comm)


def _kv_transfer(report: PlanReport, c: _Ctx, kv_link, kv_tokens) -> dict:
    """Moving the KV cache of ``kv_tokens`` tokens: each device sends its own shard over its own
    link, in parallel, so the time is the per-device bytes over one link's per-direction rate."""
    tokens = c.layout.micro_batch * c.model.seq if kv_tokens is None else kv_tokens
    if isinstance(kv_tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"kv_tokens ({kv_tokens!r}) must be a positive integer")
    name, bw = _link(c.hw, kv_link)
    per_device = tokens * report.kv_cache_bytes_per_token["per_device"]
    return {"tokens": tokens, "bytes_per_device": per_device,
            "bytes_total": tokens * report.kv_cache_bytes_per_token["total"], "link": name,
            "link_bytes_per_s": bw, "time_lower_bound_s": link_transfer_time(per_device, bw)}


def _link(hw: Hardware, kv_link) -> tuple[str, float]:
    if isinstance(kv_link, (int, float)) and not isinstance(kv_link, bool):
        if not kv_link > 0 or math.isinf(kv_link):
            raise ValueError(f"kv_link ({kv_link!r}) must be a positive finite bytes/s")
        return "custom", float(kv_link)
    if kv_link == "inter-node":
        return kv_link, hw.inter_node_bytes_per_s
    if kv_link == "intra-node":
        return f"intra-node ({hw.intra_node_link})", hw.intra_node_bytes_per_s
    if kv_link in hw.links:
        return kv_link, hw.links[kv_link] / 2
    raise ValueError(f"kv_link ({kv_link!r}) must be one of: inter-node, intra-node, "
                     f"{', '.join(hw.links)}, or a number of bytes/s")
