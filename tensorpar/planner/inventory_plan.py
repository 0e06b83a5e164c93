"""``plan_inventory``: memory, collectives, FLOPs, KV cache and time bounds of any architecture,
from its :class:`~tensorpar.planner.inventory.ModelInventory` (tp only: no pp, dp or sequence
parallelism, which the formula path of :mod:`.report` plans for its two families).

What it counts, per rank (the busiest where ranks differ), with ``e`` bytes per element:

- weights: the rank's parameters (``ModelInventory.params_per_rank``) times e; training adds
  gradients and Adam state (:func:`.memory.model_state_bytes`, Rajbhandari et al. 2020); inference
  a KV cache of ``batch x seq`` tokens. Activations are not counted (no per-architecture formula;
  Korthikanti et al. 2022 covers the gpt / llama layers of the formula path only);
- collectives: :func:`.runtime.predict_from_inventory` of the step (``train``: one
  causal_lm_loss forward + backward; ``inference``: a prefill with gathered logits) and, for a
  decoder, of one decode step;
- FLOPs: model FLOPs as the papers count them (every query against all ``seq`` keys, backward
  twice the forward; Narayanan et al. 2021, Sec. 5.1) and the least a rank must run for the
  bounds (causal pairs only, ``(s + 1) / 2`` keys per query in a decoder, at most the window);
- bounds (:mod:`.timing`): compute, the busiest rank's least FLOPs at peak; communication, the
  unavoidable bytes of every collective (:func:`.collectives.collective_time_lower_bound`);
  a step is at least the larger; a decode step at least the largest of reading the rank's
  weights (an expert tensor ``top_k / n_experts`` of it, lookup tables not at all) and its
  cached K/V from HBM, its FLOPs, and its collectives (Pope et al. 2022, Sec. 2).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .collectives import collective_time_lower_bound
from .hardware import Hardware
from .inventory import ModelInventory
from .layout import DTYPE_BYTES, check_choice, check_size
from . import mesh
from .memory import model_state_bytes
from .runtime import predict_from_inventory
from .timing import compute_time_lower_bound, memory_time_lower_bound, steps_per_s_upper_bound

WORKLOADS = ("train", "inference")
ASSUMPTIONS = [
    "tensor parallelism only (pp = dp = 1), as tensorpar's runtime splits the model: the inventory's own "
    "plan, shards and collectives",
    "lower bounds use vendor peak dense FLOP/s, peak HBM and per-direction link bandwidth, zero latency, "
    "full overlap of compute, memory traffic and communication",
    "compute bounds count matmul FLOPs only, causal attention over unmasked pairs; model FLOPs count every "
    "query against all keys",
    "memory: weights (training: + gradients + Adam state, 16 bytes/parameter at 16-bit), inference KV cache; "
    "activations are not counted",
]


@dataclass
class InventoryPlanReport:
    """Everything ``tensorpar plan --model DIR`` prints for a model planned from its inventory."""
    model: dict
    tp: int
    dtype: str
    batch: int
    seq: int
    workload: str
    hardware: dict
    params: int
    params_per_rank: list
    param_bytes_per_rank: list
    valid_tp_sizes: list
    fixes: list
    whole: dict
    flops: dict
    kv_cache: dict
    memory_per_device: dict
    comm: dict
    bounds: dict
    feasible: bool
    reasons: list
    notes: list
    assumptions: list = field(default_factory=lambda: list(ASSUMPTIONS))

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)


def plan_inventory(inv: ModelInventory, hardware: Hardware, *, batch: int = 1, seq: int = 2048,
                   dtype: str = "bf16", workload: str = "inference", dp: int = 1, zero_stage: int = 0,
                   sequence_parallel: bool = False) -> InventoryPlanReport:
    """Plan ``inv`` (built with its output head) for ``batch`` sequences of ``seq`` tokens.

    Training on a ``dp x tp`` mesh (``dp``, ``zero_stage`` 0: DDP, 3: FSDP2, ``sequence_parallel``;
    ``batch`` is then the global batch, ``batch / dp`` per dp rank) is planned by
    :func:`.mesh.mesh_step` and :func:`.mesh.state_bytes`: ``comm["mesh_step"]`` holds its tensor- and
    data-parallel collectives, and the model states per device are what such a run holds (AdamW's
    moments in the model's dtype, no master copy)."""
    check_size("batch", batch)
    check_size("seq", seq)
    check_size("dp", dp)
    check_choice("dtype", dtype, tuple(DTYPE_BYTES))
    check_choice("workload", workload, WORKLOADS)
    if zero_stage not in (0, 3):
        raise ValueError(f"zero_stage ({zero_stage!r}) must be one of: 0 (DDP), 3 (FSDP2): the data-parallel "
                         f"engines tensorpar runs on a mesh")
    if not inv.head:
        raise ValueError("plan_inventory needs the inventory of the model with its output head (head=True)")
    on_mesh = dp > 1 or zero_stage or sequence_parallel
    if on_mesh and workload != "train":
        raise ValueError("dp, zero_stage and sequence_parallel plan a training step: use workload='train'")
    e = DTYPE_BYTES[dtype]
    step = predict_from_inventory(inv, batch // dp if batch % dp == 0 else batch, seq, e,
                                  "train" if workload == "train" else "logits")
    decode = predict_from_inventory(inv, batch, seq, e, "decode") if inv.causal else None
    params = inv.params_per_rank()
    mem = _memory(inv, params, e, batch, seq, workload)
    mesh_step = None
    if on_mesh:
        kind = "fsdp" if zero_stage == 3 else "ddp"
        ranks = [mesh.mesh_step(inv, dp=dp, data_parallel=kind, sequence_parallel=sequence_parallel, batch=batch,
                                seq=seq, e=e, tp_rank=r) for r in range(inv.tp)]
        mesh_step = {"dp": dp, "tp": inv.tp, "data_parallel": kind, "sequence_parallel": sequence_parallel,
                     "tp_items": [i.to_dict() for i in ranks[0]["tp"]],
                     "dp_items": [i.to_dict() for i in ranks[0]["dp"]],
                     "dp_bytes_sent_per_tp_rank": [sum(i.total_bytes_sent_per_rank[0] for i in r["dp"]) for r in ranks]}
        states = max((mesh.state_bytes(inv, dp=dp, data_parallel=kind, e=e, tp_rank=r) for r in range(inv.tp)),
                     key=lambda s: s["total"])
        mem = {"weights": states["params"], "gradients": states["grads"], "optimizer": states["optimizer"],
               "activations": None, "kv_cache": 0}
        mem["total"] = sum(v for v in mem.values() if v is not None)
    flops = _flops(inv, batch, seq, workload)
    bounds = _bounds(inv, hardware, dtype, e, batch, seq, flops, step, decode)
    reasons = _memory_reasons(mem, hardware)
    return InventoryPlanReport(
        model=_model(inv), tp=inv.tp, dtype=dtype, batch=batch, seq=seq, workload=workload,
        hardware=hardware.to_dict(), params=inv.params_total, params_per_rank=params,
        param_bytes_per_rank=[n * e for n in params], valid_tp_sizes=list(inv.valid_tp_sizes),
        fixes=list(inv.fixes), whole=dict(inv.whole), flops=flops, kv_cache=_kv(inv, e, batch, seq),
        memory_per_device=mem, comm={"step": step.to_dict(), "decode_step": decode and decode.to_dict(),
                                     "mesh_step": mesh_step},
        bounds=bounds, feasible=not reasons, reasons=reasons, notes=list(inv.notes) + step.notes)


def _model(inv: ModelInventory) -> dict:
    return {"name": inv.name, "model_type": inv.model_type, "model_class": inv.model_class,
            "plan_source": inv.plan_source, "layers": inv.layers, "hidden": inv.hidden, "vocab": inv.vocab,
            "causal": inv.causal, "n_experts": inv.n_experts, "top_k": inv.top_k}


def _busiest(values: list) -> float:
    return max(values) if values else 0.0


def _memory(inv, params, e, batch, seq, workload) -> dict:
    """Bytes on the busiest rank: model states, and in inference the KV cache of the batch."""
    most = _busiest(params)
    if workload == "train":
        states = model_state_bytes(most, bytes_per_elem=e)
        kv = 0
    else:
        states = {"weights": most * e, "gradients": 0, "optimizer": 0}
        kv = batch * _busiest([inv.kv_cache_elems(seq, r) for r in range(inv.tp)]) * e
    out = {**states, "activations": None, "kv_cache": kv}
    out["total"] = sum(v for v in out.values() if v is not None)
    return out


def _mean_causal_keys(layer, seq: int) -> float:
    """Keys one query attends to on average in a causal layer of ``seq`` tokens: ``(s + 1) / 2``,
    or with a window of W keys ``(W (W + 1) / 2 + (s - W) W) / s`` when s > W."""
    if not layer.window or seq <= layer.window:
        return (seq + 1) / 2
    w = layer.window
    return (w * (w + 1) / 2 + (seq - w) * w) / seq


def _least_forward_flops(inv, rank, seq) -> float:
    """The least forward FLOPs per token on ``rank``: matmuls, and attention over causal pairs
    (every key for an encoder)."""
    attn = sum(a.core_flops_per_token(_mean_causal_keys(a, seq) if inv.causal else seq, rank) for a in inv.attention)
    return inv.matmul_flops_per_token(rank) + attn


def _flops(inv, batch, seq, workload) -> dict:
    passes = 3 if workload == "train" else 1  # backward costs twice the forward
    tokens = batch * seq
    per_rank = [passes * tokens * _least_forward_flops(inv, r, seq) for r in range(inv.tp)]
    return {"forward_per_token": inv.forward_flops_per_token(seq),
            "forward_per_token_per_rank": [inv.forward_flops_per_token(seq, r) for r in range(inv.tp)],
            "matmul_per_token": inv.matmul_flops_per_token(),
            "attention_per_token": inv.attention_flops_per_token(seq),
            "model_flops_per_step": passes * tokens * inv.forward_flops_per_token(seq),
            "least_flops_per_step_per_rank": per_rank,
            "decode_step_per_rank": [batch * inv.forward_flops_per_token(seq, r) for r in range(inv.tp)]}


def _kv(inv, e, batch, seq) -> dict:
    return {"bytes_per_token": inv.kv_elems_per_token() * e,
            "bytes_per_token_per_rank": [inv.kv_elems_per_token(r) * e for r in range(inv.tp)],
            "bytes_per_rank_for_batch": [batch * inv.kv_cache_elems(seq, r) * e for r in range(inv.tp)],
            "cached_layers": len(inv.attention) if inv.causal else 0,
            "windowed_layers": sum(1 for a in inv.attention if a.window) if inv.causal else 0}


def _comm_bound(pred, hardware: Hardware) -> float:
    """Least seconds of every collective of a prediction (its tp group packed into nodes)."""
    per_node = min(pred.tp, hardware.devices_per_node)
    return sum(i.count * collective_time_lower_bound(
        i.op, i.payload_bytes, i.group_size, per_node=per_node, intra_bytes_per_s=hardware.intra_node_bytes_per_s,
        inter_bytes_per_s=hardware.inter_node_bytes_per_s) for i in pred.items)


def decode_weight_elems(inv: ModelInventory, rank: int) -> float:
    """Parameter elements one decode step must read on ``rank``: every tensor, an expert tensor
    ``top_k / n_experts`` of it (each token visits top_k experts, so at least that share is read),
    a lookup table (a 2-D weight no matmul uses: embeddings, position tables) none."""
    kinds = {m.name: m.kind for m in inv.matmuls}
    share = inv.top_k / inv.n_experts if inv.n_experts and inv.top_k else 1.0
    total = 0.0
    for p in inv.params:
        kind = next((kinds[n] for n in (p.name, *p.tied) if n in kinds), None)
        n = p.ranks[rank].numel
        if kind == "experts" or (kind is None and inv.n_experts and p.shape[0] == inv.n_experts and len(p.shape) > 1):
            total += n * share
        elif kind is not None or not (len(p.shape) == 2 and p.name.endswith("weight")):
            total += n
    return total


def _bounds(inv, hw, dtype, e, batch, seq, flops, step, decode) -> dict:
    peak = hw.peak_flops(dtype)
    compute = compute_time_lower_bound(_busiest(flops["least_flops_per_step_per_rank"]), 1, peak)
    comm = _comm_bound(step, hw)
    out = {"step_compute_s": compute, "step_comm_s": comm, "step_s": max(compute, comm)}
    if decode is None:
        return out
    reads = [(decode_weight_elems(inv, r) + batch * inv.kv_cache_elems(seq, r)) * e for r in range(inv.tp)]
    terms = {"decode_hbm_s": memory_time_lower_bound(_busiest(reads), hw.hbm_bytes_per_s),
             "decode_compute_s": compute_time_lower_bound(_busiest(flops["decode_step_per_rank"]), 1, peak),
             "decode_comm_s": _comm_bound(decode, hw)}
    per_token = max(terms.values())
    return {**out, **terms, "decode_bytes_read_per_rank": reads, "decode_per_token_s": per_token,
            "decode_steps_per_s_upper_bound": steps_per_s_upper_bound(per_token)}


def _memory_reasons(mem: dict, hw: Hardware) -> list:
    if mem["total"] <= hw.mem_bytes:
        return []
    return [f"memory per device {mem['total'] / 1e9:.2f} GB exceeds capacity {hw.mem_bytes / 1e9:.2f} GB "
            f"(weights {mem['weights'] / 1e9:.2f}, gradients {mem['gradients'] / 1e9:.2f}, optimizer "
            f"{mem['optimizer'] / 1e9:.2f}, kv cache {mem['kv_cache'] / 1e9:.2f} GB; activations not counted); "
            f"try: a larger tp, a device with more memory"]
