"""``plan(model, layout, hardware)``: every figure of one layout, as a JSON-serialisable report.

One implementation for every model: ``model`` is a :class:`~tensorpar.planner.models.ModelSpec`
(a preset or shapes, through its template) or a model source (``tensorpar.sharding.inventory.
MetaSource``: any ``config.json``), and every figure is read from the
:class:`~tensorpar.architecture.split_model.SplitModel` at the layout's tp: parameters per stage
and rank (:mod:`.stages`), activations, KV cache and model states (:mod:`.split_memory`), every
collective of a step and of a decode step (:mod:`.traffic`), FLOPs (:mod:`.split_flops`), bounds
(:mod:`.timing`), estimates from a hardware profile (:mod:`.estimate`, :mod:`.profile`),
feasibility (:mod:`.feasibility`).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace

from tensorpar.architecture.split_model import SplitModel

from . import split_flops, split_memory
from .collectives import link_transfer_time
from .comm import bytes_sent
from . import estimate as est
from .profile import Profile, published, with_latency
from .feasibility import fixes, memory_reasons, placement_warnings, sequence_reasons
from .hardware import Hardware
from .layout import Layout, check_size, group_placement
from .pipeline_report import pipeline_section, rank_activation_bytes, stage_bytes_per_microbatch
from .schedules import check_schedule
from .source import ModelSource, source_of
from tensorpar.architecture.pipeline import stages_of_rank

from .stages import Stages, blocks, layers_of, params_per_stage, stages, why_not
from .timing import (comm_time_lower_bound, compute_time_lower_bound, decode_bytes_read_per_device,
                     memory_time_lower_bound, steps_per_s_upper_bound)
from .traffic import decode_items, prefill_items, rank_step

ASSUMPTIONS = [
    "the model split as tensorpar's runtime splits it (its plan, shards and collectives at this tp), stages "
    "cut as the runtime cuts them (L // stages blocks each, the remainder to the first), rank order tp, dp, pp",
    "lower bounds use vendor peak dense FLOP/s, peak HBM bandwidth and peak per-direction link "
    "bandwidth, zero latency, and let compute, memory traffic and communication overlap fully",
    "compute bounds count matmul FLOPs only, with causal attention over unmasked pairs only (at most "
    "the sliding window per query where the model has one); decode reads the K/V of the attended keys",
    "communication bounds count unavoidable bytes (an all-reduce must bring N bytes into each "
    "device even with in-network reduction), not ring bytes; ring bytes are listed per item",
    "memory: the optimizer's state per parameter as the layout names it (adam-mixed: 16 bytes/parameter at "
    "16-bit), activations per Korthikanti et al. 2022 without FlashAttention (each block's norms, split "
    "projections, scores and dropout masks), each pipeline rank keeping its schedule's peak of microbatches "
    "alive (1F1B: min(pp - s, micro-batches) on stage s)",
    "estimates (not bounds) come from a hardware profile (achieved GEMM rate by shape, memory bandwidth, fixed "
    "cost per block, alpha + n beta per collective; tensorpar calibrate measures one, presets use public "
    "figures), term by term: matmuls, attention, elementwise work, fixed costs, collectives, the schedule's "
    "bubble, the optimizer (docs/planner.md, 'Time estimates')",
]


@dataclass
class PlanReport:
    """Everything ``tensorpar plan --json`` prints. Bytes, FLOPs, seconds; ``None`` where the split
    itself is invalid (tp not splitting the model, pp not dividing its blocks) or, for an encoder,
    where a figure needs a KV cache (decoding)."""

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
    params_per_rank: list | None = None
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
    pipeline: dict | None = None
    whole: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    assumptions: list = field(default_factory=lambda: list(ASSUMPTIONS))

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)


@dataclass(frozen=True)
class _Ctx:
    split: SplitModel
    st: Stages
    layout: Layout
    hw: Hardware
    seq: int
    placement: dict
    intra: float
    inter: float
    peak: float
    profile: Profile
    runtime: est.Runtime


def plan(model, layout: Layout, hardware: Hardware, *, kv_link: str | float = "inter-node",
         kv_tokens: int | None = None, latency_s: float | None = None, seq: int | None = None,
         profile: Profile | None = None, runtime: est.Runtime | None = None) -> PlanReport:
    """Plan ``model`` (a ModelSpec or a model source) under ``layout`` on ``hardware`` (devices
    per node from the hardware).

    ``kv_link``: where a KV cache would move (``"inter-node"``, ``"intra-node"``, a link name of the
    hardware, or bytes/s). ``kv_tokens``: its size in tokens (default micro_batch x seq).
    ``seq``: the sequence planned for (default: the model's).
    ``profile``: the achieved rates the estimates use (default: the hardware's published figures,
    :func:`.profile.published`); ``latency_s`` replaces its per-collective latency; ``runtime``:
    what overlaps and which kernels run (:mod:`.estimate`; default tensorpar's on that device).
    Estimates never enter the bounds.
    """
    src = source_of(model)
    if seq is not None:
        check_size("seq", seq)
    seq = src.seq if seq is None else seq
    report = _report(src, layout, hardware, seq)
    split = _split_at(src, layout.tp, report)
    if split is None:
        return report  # per-device figures do not exist for this split
    pp_reason = why_not(split, layout.pp, layout.virtual_stages)
    report.warnings += _schedule_warnings(split, layout)
    report.reasons += ([pp_reason] if pp_reason else []) + sequence_reasons(seq, layout)
    if pp_reason:
        return report
    profile = profile or published(hardware)
    if latency_s is not None:
        profile = with_latency(profile, latency_s)
    report.warnings += profile.warnings()
    ctx = _Ctx(split, stages(split, layout.pp * layout.virtual_stages), layout, hardware, seq,
               group_placement(layout, hardware.devices_per_node), hardware.intra_node_bytes_per_s,
               hardware.inter_node_bytes_per_s, hardware.peak_flops(layout.dtype), profile,
               runtime or est.default_runtime(profile))
    _fill_memory(report, ctx)
    _fill_step(report, ctx)
    _fill_inference(report, ctx, kv_link, kv_tokens)
    report.pipeline = pipeline_section(split, ctx.st, layout, seq)
    report.fixes = fixes(split, layout.bytes_per_elem, split_flops.forward_flops_per_token(split, seq))
    report.reasons += memory_reasons(report.memory_per_device, hardware.mem_bytes, layout)
    report.feasible = not report.reasons
    return report


def _report(src: ModelSource, layout: Layout, hw: Hardware, seq: int) -> PlanReport:
    """The figures that need no split: the dense model's parameters and FLOPs."""
    dense, g = src.at(1), layout.global_batch
    described = src.describe()
    model = {**described, "seq": seq, "seq_source": described.get("seq_source", src.seq_source)
             if seq == src.seq else "given"}
    return PlanReport(
        model=model, layout=layout.to_dict(), hardware=hw.to_dict(), params=dense.params_total,
        flops_per_iteration=split_flops.flops_per_iteration(dense, g, seq),
        hardware_flops_per_iteration=split_flops.hardware_flops_per_iteration(dense, g, seq, layout.recompute),
        flops_lower_bound_per_iteration=split_flops.causal_flops_per_iteration(dense, g, seq, layout.recompute),
        feasible=False, reasons=[], fixes=[], warnings=placement_warnings(layout, hw.devices_per_node),
        valid_tp_sizes=list(src.valid_tp_sizes()), whole=dict(dense.whole), notes=list(dense.notes))


def _split_at(src: ModelSource, tp: int, report: PlanReport) -> SplitModel | None:
    """The model split at ``tp``, or None with the runtime's reason in ``report``."""
    try:
        return src.at(tp)
    except ValueError as exc:
        if tp == 1:
            raise
        report.reasons.append(str(exc))
        return None


def _schedule_warnings(split: SplitModel, layout: Layout) -> list[str]:
    """Why ``tensorpar train`` (PyTorch's schedule, tensorpar's checks) would refuse the layout's
    pipeline: a warning, as the plan's figures hold for any pipeline runtime."""
    if layout.pp == 1 or layout.workload != "train" or len(blocks(split)) < layout.pp * layout.virtual_stages:
        return []
    try:
        check_schedule(pp=layout.pp, blocks=len(blocks(split)), schedule=layout.schedule,
                       microbatches=layout.num_micro_batches, virtual=layout.virtual_stages)
    except ValueError as exc:
        return [f"tensorpar train refuses this pipeline: {exc}"]
    return []


def _stage_ids(pp: int) -> list[int]:
    """The pipeline ranks planned one by one: the first, the second and the last (the middle
    ones repeat the second) under a single-stage schedule."""
    return sorted({0, pp - 1} | ({1} if pp > 2 else set()))


def _rank_ids(lay: Layout) -> list[int]:
    return _stage_ids(lay.pp) if lay.virtual_stages == 1 else list(range(lay.pp))


def _fill_memory(report: PlanReport, c: _Ctx) -> None:
    split, lay, e = c.split, c.layout, c.layout.bytes_per_elem
    recompute = lay.recompute if lay.workload == "train" else "none"
    per_layer = max((max(split_memory.layer_bytes(split, lay, c.seq, r, recompute).values(), default=0.0)
                     for r in range(split.tp)), default=0.0)
    stage_params = [max(params_per_stage(split, c.st, r)[s] for r in range(split.tp)) for s in range(c.st.pp)]
    acts = [stage_bytes_per_microbatch(split, c.st, lay, c.seq, r) for r in range(split.tp)] \
        if lay.workload == "train" else None
    per_stage = [_stage_memory(c, s, acts) for s in _rank_ids(lay)]
    report.params_per_stage = stage_params
    report.params_per_device = max(_rank_params(c, p, r) for p in _rank_ids(lay) for r in range(split.tp))
    report.params_per_rank = split.params_per_rank()
    report.activation_bytes_per_layer = per_layer
    report.kv_cache_bytes_per_token = split_memory.kv_summary(split, c.st, e)
    report.memory_per_device = max(per_stage, key=lambda d: d["total"])


def _stage_memory(c: _Ctx, pp_rank: int, acts: list | None) -> dict:
    """The busiest tp rank of pipeline rank ``pp_rank``: model states, activations, KV cache, their total."""
    return max((_rank_memory(c, pp_rank, r, acts) for r in range(c.split.tp)), key=lambda d: d["total"])


def _held_by_rank(c: _Ctx, pp_rank: int) -> list:
    """The parameters pipeline rank ``pp_rank`` holds over its stages (a tensor two of them share, once)."""
    mine = stages_of_rank(pp_rank, c.layout.pp, c.layout.virtual_stages, c.layout.schedule)
    return [p for p in c.split.params if any(s in c.st.homes[p.name] for s in mine)]


def _rank_params(c: _Ctx, pp_rank: int, rank: int) -> int:
    return sum(p.ranks[rank].numel for p in _held_by_rank(c, pp_rank))


def _rank_memory(c: _Ctx, pp_rank: int, rank: int, acts: list | None) -> dict:
    split, lay, e = c.split, c.layout, c.layout.bytes_per_elem
    mine = _held_by_rank(c, pp_rank)
    params = sum(p.ranks[rank].numel for p in mine)
    stage_ids = stages_of_rank(pp_rank, lay.pp, lay.virtual_stages, lay.schedule)
    if lay.workload == "train":
        states = split_memory.model_states(params, [p.ranks[rank].shape for p in mine], lay)
        activations = rank_activation_bytes(acts[rank], lay, pp_rank)
        kv_cache = 0.0
    else:
        states = {"weights": params * e, "gradients": 0.0, "optimizer": 0.0}
        layers = split_memory.layer_bytes(split, lay, c.seq, rank, "none")
        activations = max((layers.get(b, 0.0) for s in stage_ids for b in layers_of(c.st, s)),
                          default=0.0)  # one block at a time
        kv_cache = sum(split_memory.kv_cache_bytes(split, c.st, s, rank, lay.micro_batch, c.seq, e) for s in stage_ids)
    out = {**states, "activations": activations, "kv_cache": kv_cache}
    out["total"] = sum(out.values())
    return {**out, "capacity": c.hw.mem_bytes, "stage": pp_rank}


def _fill_step(report: PlanReport, c: _Ctx) -> None:
    lay = c.layout
    per_stage = {s: rank_step(c.split, c.st, s, lay, c.seq) for s in _rank_ids(lay)}
    bounds = {s: comm_time_lower_bound(items, c.placement, lay.pp, c.intra, c.inter)
              for s, (items, _) in per_stage.items()}
    worst = max(bounds, key=lambda s: (bounds[s]["total_s"], bytes_sent(per_stage[s][0])))
    items = per_stage[worst][0]
    if lay.workload == "train":
        flops = report.flops_lower_bound_per_iteration
    else:  # one step = a forward (prefill) of the global batch
        flops = split_flops.prefill_flops(c.split, lay.global_batch, c.seq)
    compute = compute_time_lower_bound(flops, lay.devices, c.peak)
    comm = bounds[worst]["total_s"]
    report.comm = {
        "per_layer": [i.to_dict() for i in per_stage[0][1]],
        "per_step": [i.to_dict() for i in items], "stage": worst,
        "bytes_sent_per_device_per_step": {
            g: bytes_sent([i for i in items if i.group == g]) for g in ("tp", "pp", "dp", "embedding")}
        | {"total": bytes_sent(items)},
    }
    report.compute_time_lower_bound_s = compute
    report.comm_time_lower_bound_s = comm
    report.comm_time_lower_bound_by_link = bounds[worst]
    report.step_time_lower_bound_s = max(compute, comm)
    stage_s = est.stage_micro_seconds(c.split, c.st, lay, c.seq, c.profile, c.runtime) \
        if lay.workload == "train" and lay.pp > 1 else None
    steps = {s: est.training_step(c.split, c.st, lay, c.seq, items_, c.placement, c.profile, c.runtime, pp_rank=s,
                                  stage_seconds=stage_s)
             for s, (items_, _) in per_stage.items()} if lay.workload == "train" else {}
    step = max(steps.values(), key=lambda x: x["seconds"]) if steps else est.prefill(
        c.split, _whole_batch(lay), c.seq, prefill_items(c.split, c.st, _whole_batch(lay), c.seq), c.placement,
        c.profile, c.runtime)
    terms = step["terms"]
    report.estimates = {
        "profile": c.profile.name, "runtime": c.runtime.name,
        "step_time_s": step["seconds"], "tokens_per_s": lay.global_batch * c.seq / step["seconds"],
        "step": step, "comm_time_s": sum(terms.get(k, 0.0) for k in ("tp_comm_s", "tp_wait_s", "pp_comm_s", "dp_comm_s")),
        "pipeline_bubble_fraction": step.get("bubble_fraction", 0.0),
        "decode_time_per_token_s": None, "decode_tokens_per_s": None, "decode": None,
        "prefill_time_s": None, "prefill": None,
        "lower_bounds": {"step_time_s": report.step_time_lower_bound_s}}


def _whole_batch(lay: Layout) -> Layout:
    """A layout whose micro-batch is the global batch (a step of an inference plan: its prefill)."""
    return replace(lay, micro_batch=lay.global_batch, dp=1, global_batch=lay.global_batch)


def _busiest(fn, tp: int) -> float:
    return max(fn(r) for r in range(tp))


def _fill_inference(report: PlanReport, c: _Ctx, kv_link, kv_tokens) -> None:
    split, lay, b = c.split, c.layout, c.layout.micro_batch
    report.inference_flops = {"decode_step": split_flops.decode_flops_per_token(split, b, c.seq) if split.causal else None,
                              "prefill_micro_batch": split_flops.prefill_flops(split, b, c.seq),
                              "prefill_global_batch": split_flops.prefill_flops(split, lay.global_batch, c.seq)}
    report.prefill_time_lower_bound_s = _prefill_bound(report, c)
    pre = est.prefill(split, lay, c.seq, prefill_items(split, c.st, lay, c.seq), c.placement, c.profile, c.runtime)
    report.estimates.update(prefill=pre, prefill_time_s=pre["seconds"])
    report.estimates["lower_bounds"]["prefill_time_s"] = report.prefill_time_lower_bound_s
    report.comm["decode_per_token"] = []
    if split.causal:
        _fill_decode(report, c)
    report.kv_transfer = _kv_transfer(report, c, kv_link, kv_tokens)
    report.kv_transfer_time_lower_bound_s = report.kv_transfer["time_lower_bound_s"]


def _fill_decode(report: PlanReport, c: _Ctx) -> None:
    """A decode step reads every stage's weights (an embedding is a lookup) and the cached K/V of
    the keys each layer attends to (at most the window), runs its FLOPs and its collectives."""
    split, lay, e, b = c.split, c.layout, c.layout.bytes_per_elem, c.layout.micro_batch
    weights = e * _busiest(lambda r: split_memory.decode_weight_elems(split, r), split.tp)
    kv_read = b * e * _busiest(lambda r: split_memory.kv_read_elems(split, r, c.seq), split.tp)
    items = decode_items(split, lay)
    terms = {"hbm_s": memory_time_lower_bound(decode_bytes_read_per_device(weights, kv_read), c.hw.hbm_bytes_per_s),
             "compute_s": compute_time_lower_bound(report.inference_flops["decode_step"], lay.tp, c.peak),
             "comm_s": comm_time_lower_bound(items, c.placement, lay.pp, c.intra, c.inter)["total_s"],
             "weight_bytes_read_per_device": weights, "kv_bytes_read_per_device": kv_read}
    decode = max(terms["hbm_s"], terms["compute_s"], terms["comm_s"])
    report.decode_bound_terms = terms
    report.decode_time_per_token_lower_bound_s = decode
    report.decode_steps_per_s_upper_bound = None if decode == 0 else steps_per_s_upper_bound(decode)
    report.comm["decode_per_token"] = [i.to_dict() for i in items]
    decode = est.decode_step(split, lay, c.seq, items, c.placement, c.profile, c.runtime)
    report.estimates.update(decode=decode, decode_time_per_token_s=decode["seconds"],
                            decode_tokens_per_s=decode["tokens_per_s"])
    report.estimates["lower_bounds"]["decode_time_per_token_s"] = report.decode_time_per_token_lower_bound_s


def _prefill_bound(report: PlanReport, c: _Ctx) -> float:
    """A prompt of ``seq`` tokens per sequence, micro_batch sequences: chunks may be pipelined
    across stages, so FLOPs are shared by all tp x pp devices; each device reads its weights once."""
    lay = c.layout
    compute = compute_time_lower_bound(report.inference_flops["prefill_micro_batch"], lay.tp * lay.pp, c.peak)
    hbm = memory_time_lower_bound(report.params_per_device * lay.bytes_per_elem, c.hw.hbm_bytes_per_s)
    items = prefill_items(c.split, c.st, lay, c.seq)
    comm = comm_time_lower_bound(items, c.placement, lay.pp, c.intra, c.inter)["total_s"]
    return max(compute, hbm, comm)


def _kv_transfer(report: PlanReport, c: _Ctx, kv_link, kv_tokens) -> dict:
    """Moving the KV cache of ``kv_tokens`` tokens: each device sends its own shard over its own
    link, in parallel, so the time is the per-device bytes over one link's per-direction rate."""
    tokens = c.layout.micro_batch * c.seq if kv_tokens is None else kv_tokens
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
