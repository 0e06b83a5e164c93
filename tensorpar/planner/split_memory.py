"""Bytes per device of a split model: activations, KV cache, model states (:mod:`.memory` holds the
papers' closed forms; for the gpt and llama templates the two agree).

- Activations: each block's :class:`~tensorpar.architecture.split_model.LayerActivations`
  (Korthikanti et al. 2022, Sec. 4.1, tensor by tensor, no FlashAttention) over the micro-batch's
  tokens; full recomputation keeps only each block's input (``rep(h e)``). Training holds the
  blocks of a stage for as many micro-batches as its schedule keeps alive
  (:mod:`.schedules`; ``min(pp - s, m)`` under 1F1B, Sec. 4.2.3); the first stage adds the
  embedding's dropout mask, the last the final norm's and the head's inputs and the float32
  logits of the rank's vocabulary shard (Sec. 4.3), per micro-batch alive.
- KV cache: each attention layer's K/V elements per token on the rank, for the tokens it keeps
  (a sliding-window layer its last ``W - 1``; Kwon et al. 2023, Sec. 3).
- Model states: weights, gradients and the optimizer's state per parameter, ZeRO stages over dp
  (Rajbhandari et al. 2020, Table 1); stage 3 as FSDP2 shards it, each tensor's
  ``ceil(rows / dp)`` rows on the first dp rank (the busiest).
"""
from __future__ import annotations

from tensorpar.architecture.split_model import SplitModel

from .layout import Layout
from .memory import optimizer_bytes_per_param
from .stages import Stages, layers_of


def _rep(x: float, layout: Layout) -> float:
    return x / layout.tp if layout.sequence_parallel else float(x)


def layer_bytes(split: SplitModel, layout: Layout, seq: int, rank: int, recompute: str) -> dict:
    """``{block: bytes}`` each block keeps for backward on ``rank`` for one micro-batch."""
    tokens, e = seq * layout.micro_batch, layout.bytes_per_elem
    if recompute == "full":
        return {a.index: tokens * _rep(split.hidden * e, layout) for a in split.activations}
    return {a.index: tokens * a.bytes_per_token(rank, seq, e, tp=layout.tp, sequence_parallel=layout.sequence_parallel,
                                                recompute=recompute)
            for a in split.activations}


def head_rows(split: SplitModel, rank: int) -> int:
    """Vocabulary rows of the output head on ``rank`` (0 without a head)."""
    heads = [m for m in split.matmuls if m.head]
    return sum(m.ranks[rank] for m in heads) // (2 * split.hidden) if heads and split.hidden else 0


def stage_activation_bytes(split: SplitModel, st: Stages, stage: int, layout: Layout, seq: int, rank: int,
                           in_flight: int, per_layer: dict | None = None) -> float:
    """Activations one device of ``stage`` holds with ``in_flight`` microbatches alive (the last
    stage's head inputs and logits too: the schedule's loss keeps them until its backward)."""
    per_layer = layer_bytes(split, layout, seq, rank, layout.recompute) if per_layer is None else per_layer
    tokens, e = seq * layout.micro_batch, layout.bytes_per_elem
    out = sum(per_layer.get(b, 0.0) for b in layers_of(st, stage))
    if stage == 0 and split.dropout:  # the embedding's dropout mask, one byte per element
        out += _rep(tokens * split.hidden, layout)
    if stage == st.pp - 1 and head_rows(split, rank):
        out += _rep(2 * tokens * split.hidden * e, layout) + 4 * tokens * head_rows(split, rank)
    return in_flight * out


def kv_elems_per_token(split: SplitModel, st: Stages, stage: int, rank: int) -> int:
    layers = set(layers_of(st, stage))
    return sum(a.kv[rank] for a in split.attention if a.index in layers) if split.causal else 0


def kv_cache_bytes(split: SplitModel, st: Stages, stage: int, rank: int, batch: int, context: int, e: int) -> int:
    """KV cache of ``batch`` sequences after ``context`` tokens (windows keep fewer)."""
    if not split.causal:
        return 0
    layers = set(layers_of(st, stage))
    return batch * e * sum(a.cached_tokens(context) * a.kv[rank] for a in split.attention if a.index in layers)


def kv_summary(split: SplitModel, st: Stages, e: int) -> dict:
    """KV cache bytes per token: the unsplit model's, the busiest device's (one stage), one
    replica's over its tp ranks, and how many ranks hold each KV head."""
    total = split.kv_elems_per_token() * e
    per_device = max(kv_elems_per_token(split, st, s, r) for s in range(st.pp) for r in range(split.tp)) * e
    replicated = sum(split.kv_elems_per_token(r) for r in range(split.tp)) * e
    return {"total": total, "per_device": per_device, "replicated_total": replicated,
            "replication": max(1, round(replicated / total)) if total else 1}


def fsdp_elems(shapes: list, dp: int) -> int:
    """Elements the first dp rank holds of FSDP2 shards: ``ceil(rows / dp)`` rows of each."""
    out = 0
    for shape in shapes:
        rest = 1
        for d in shape[1:]:
            rest *= d
        out += (-(-shape[0] // dp) * rest) if shape else 1
    return out


def model_states(params: int, shapes: list, layout: Layout) -> dict:
    """Weights, gradients and optimizer state of ``params`` parameters (``shapes``: their local
    shapes, for FSDP2's rows) under the layout's ZeRO stage and optimizer."""
    e, z, dp = layout.bytes_per_elem, layout.zero_stage, layout.dp
    k = optimizer_bytes_per_param(e, layout.optimizer)
    if z == 3 and dp > 1:
        n = fsdp_elems(shapes, dp)
        return {"weights": n * e, "gradients": n * e, "optimizer": n * k}
    return {"weights": params * e, "gradients": params * e / (dp if z >= 2 else 1),
            "optimizer": params * k / (dp if z >= 1 else 1)}


def decode_weight_elems(split: SplitModel, rank: int) -> float:
    """Parameter elements one decode step must read on ``rank``: every tensor, an expert tensor
    ``top_k / n_experts`` of it (each token visits top_k experts, so at least that share is read),
    a lookup table (a 2-D weight no matmul uses: embeddings, position tables) none."""
    kinds = {m.name: m.kind for m in split.matmuls}
    share = split.top_k / split.n_experts if split.n_experts and split.top_k else 1.0
    total = 0.0
    for p in split.params:
        kind = next((kinds[n] for n in (p.name, *p.tied) if n in kinds), None)
        n = p.ranks[rank].numel
        if kind == "experts" or (kind is None and split.n_experts and p.shape[0] == split.n_experts and len(p.shape) > 1):
            total += n * share
        elif kind is not None or not (len(p.shape) == 2 and p.name.endswith("weight")):
            total += n
    return total


def kv_read_elems(split: SplitModel, rank: int, context: int) -> int:
    """K/V elements one decode step reads per sequence on ``rank``: the attended keys of every
    layer (at most the window)."""
    if not split.causal:
        return 0
    return sum(min(context, a.window) * a.kv[rank] if a.window else context * a.kv[rank] for a in split.attention)
