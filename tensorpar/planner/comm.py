"""The collectives a layout issues, item by item: tensor-parallel, pipeline and data-parallel.

Tensor-parallel items are exactly those docs/architecture.md lists for tensorpar's runtime, per
micro-batch of shape (b, s) with ``N = b s h e``:

    embedding          forward all_reduce N                (SP: reduce_scatter N; bwd all_gather N)
    each layer         attention and MLP: forward all_reduce N each, backward all_reduce N each
                       (SP: all_gather N before, reduce_scatter N after, mirrored in backward)
    LM head            backward all_reduce N of dX         (SP: forward all_gather N, bwd reduce_scatter N)
                       gathered logits (an ordinary forward): forward all_gather of b s ceil(V/t) t e
    cross-entropy      three forward all_reduces of b s e_loss (max, target logit, sum of exp)

Under sequence parallelism the gradients of replicated parameters that see only a sequence shard
are all-reduced in backward: each norm's weight (and LayerNorm bias), the biases of the
row-parallel outputs (gpt), the learned position table (gpt, assuming it is added to the sequence
shard). Qwen3's q/k norm weights are shared by the heads of every rank, so their gradients are
all-reduced in training whatever the sequence split. Full recomputation re-issues each layer's
forward collectives during backward (``recomputed=True``; a ledger records them as forward).
Megatron-LM counts: Shoeybi et al. 2019, Sec. 3 (two all-reduces per layer forward, two
backward); Korthikanti et al. 2022, Sec. 4.2.2 (sequence parallelism moves the same bytes).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .collectives import pp_p2p_bytes, ring_bytes_sent
from .layout import Layout
from .models import ModelSpec
from .params import layers_per_stage, padded, position_params


@dataclass(frozen=True)
class CommItem:
    """One kind of collective: ``count`` of them, each of ``payload_bytes`` (N), each making a
    device send ``bytes_sent_per_device`` under the ring algorithm."""

    op: str
    where: str
    phase: str
    group: str
    group_size: int
    payload_bytes: float
    bytes_sent_per_device: float
    count: int = 1
    recomputed: bool = False
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def total_bytes_sent(self) -> float:
        return self.bytes_sent_per_device * self.count


def item(op, where, phase, group, p, payload, *, count=1, recomputed=False, note="") -> CommItem:
    return CommItem(op, where, phase, group, p, payload, ring_bytes_sent(op, payload, p), count,
                    recomputed, note)


def tp_layer_collectives(model: ModelSpec, layout: Layout, *, phase: str | None = None,
                         seq: int | None = None) -> list[CommItem]:
    """Tensor-parallel collectives of one layer for one micro-batch (counts per layer).

    ``phase``: ``"training"`` (forward + backward) or ``"inference"`` (forward only); by default
    from ``layout.workload``. Empty when tp = 1.
    """
    phase = _phase(layout, phase)
    p, s = layout.tp, model.seq if seq is None else seq
    if p == 1:
        return []
    e = layout.bytes_per_elem
    n = layout.micro_batch * s * model.hidden * e
    items = []
    for where, enter, leave in (("layer.attention", "q/k/v", "o_proj"), ("layer.mlp", "up/gate", "down")):
        items += _block_items(where, enter, leave, n, p, layout, phase)
    if phase == "training" and p > model.kv_heads:
        kv = model.kv_heads * model.head_dim  # rows of K, and of V
        if model.family == "gpt":  # one fused q/k/v projection (GPT-BigCode): its weight's KV rows, then its bias's
            items.append(item("all_reduce", "layer.attention.kv_replicas", "backward", "tp", p, 2 * kv * model.hidden * e,
                              note="the fused projection's k and v weight rows of replicated kv heads, (2 g d, h)"))
            items.append(item("all_reduce", "layer.attention.kv_replicas", "backward", "tp", p, 2 * kv * e,
                              note="the fused projection's k and v bias rows of replicated kv heads, 2 g d"))
        else:
            rows = kv * (model.hidden + (1 if model.qkv_bias else 0)) * e
            items.append(item("all_reduce", "layer.attention.kv_replicas", "backward", "tp", p, rows, count=2,
                              note="k and v weight gradients of replicated kv heads, (g, d, h[+1]) slots"))
    if phase == "training" and model.qk_norm:
        items.append(item("all_reduce", "layer.attention.qk_norm", "backward", "tp", p, model.head_dim * e, count=2,
                          note="q_norm and k_norm weight gradients: each rank's heads give a partial sum"))
    if phase == "training" and layout.sequence_parallel:
        items.append(item("all_reduce", "layer.norms", "backward", "tp", p, model.hidden * e,
                          count=2 * _vectors_per_norm(model),
                          note="gradients of the two norms' parameters (sequence-sharded inputs)"))
        if model.biases:
            items.append(item("all_reduce", "layer.row_biases", "backward", "tp", p, model.hidden * e, count=2,
                              note="gradients of the o_proj and down biases (added to sequence shards)"))
    return items


def _vectors_per_norm(model: ModelSpec) -> int:
    """h-vectors in one norm, each all-reduced on its own: LayerNorm weight and bias, RMSNorm weight."""
    return model.norm_params // model.hidden


def _block_items(where, enter, leave, n, p, layout, phase) -> list[CommItem]:
    sp = layout.sequence_parallel
    if sp:
        fwd = [item("all_gather", where, "forward", "tp", p, n, note=f"sequence gather before {enter}"),
               item("reduce_scatter", where, "forward", "tp", p, n, note=f"after {leave}")]
        bwd = [item("all_gather", where, "backward", "tp", p, n, note=f"dY of the reduce-scatter after {leave}"),
               item("reduce_scatter", where, "backward", "tp", p, n, note=f"dX of the gather before {enter}")]
    else:
        fwd = [item("all_reduce", where, "forward", "tp", p, n, note=f"partial sums after {leave}")]
        bwd = [item("all_reduce", where, "backward", "tp", p, n, note=f"dX before {enter}")]
    if phase != "training":
        return fwd
    again = [replace(i, recomputed=True, note=i.note + " (recomputed forward)") for i in fwd]
    return fwd + (again if layout.recompute == "full" else []) + bwd


HEADS = ("sharded", "gathered", "none")


def tp_collectives(model: ModelSpec, layout: Layout, *, phase: str | None = None, seq: int | None = None,
                   stage: str = "all", with_loss: bool | None = None, loss_bytes: int | None = None,
                   head: str = "sharded", loss_tokens: int | None = None) -> dict:
    """Every tensor-parallel collective of one micro-batch on one device.

    Returns ``{"per_layer": [...], "per_micro_batch": [...]}``; in ``per_micro_batch`` the
    per-layer items are multiplied by the layers of the stage. ``stage``: ``"all"`` (pp = 1),
    ``"first"`` (embedding), ``"middle"``, ``"last"`` (final norm, LM head, loss).
    ``head``: ``"sharded"`` (logits stay split by vocabulary, Megatron-LM), ``"gathered"``
    (the LM head all-gathers the logits, as an ordinary forward of tensorpar's runtime does),
    ``"none"`` (a bare model without output head). ``with_loss`` (default: training) adds the
    vocab-parallel cross-entropy over ``loss_tokens`` tokens (default b s), whose all-reduces
    carry ``loss_bytes`` per token (default the layout's element size: the logits' dtype).
    """
    phase = _phase(layout, phase)
    if stage not in ("all", "first", "middle", "last"):
        raise ValueError(f"stage ({stage!r}) must be one of: all, first, middle, last")
    if head not in HEADS:
        raise ValueError(f"head ({head!r}) must be one of: {', '.join(HEADS)}")
    if layout.tp == 1:
        return {"per_layer": [], "per_micro_batch": []}
    s = model.seq if seq is None else seq
    per_layer = tp_layer_collectives(model, layout, phase=phase, seq=s)
    body = scale(per_layer, layers_per_stage(model, layout.pp))
    first = []
    if stage in ("all", "first"):
        first += _embedding_items(model, layout, phase, s)
    if stage in ("all", "last"):
        loss = phase == "training" if with_loss is None else with_loss
        tokens = layout.micro_batch * s if loss_tokens is None else loss_tokens
        if head != "none":
            body += _lm_head_items(model, layout, phase, s, head == "gathered")
        if loss:
            body.append(_loss_item(layout, tokens, loss_bytes or layout.bytes_per_elem))
    return {"per_layer": per_layer, "per_micro_batch": first + body}


def _embedding_items(model, layout, phase, s) -> list[CommItem]:
    p, e = layout.tp, layout.bytes_per_elem
    n = layout.micro_batch * s * model.hidden * e
    if not layout.sequence_parallel:
        return [item("all_reduce", "embedding", "forward", "tp", p, n, note="partial lookups of vocab shards")]
    items = [item("reduce_scatter", "embedding", "forward", "tp", p, n, note="partial lookups into sequence shards")]
    if phase == "training":
        items.append(item("all_gather", "embedding", "backward", "tp", p, n, note="dY of the reduce-scatter"))
        if model.family == "gpt":
            items.append(item("all_reduce", "position_embedding", "backward", "tp", p, position_params(model) * e,
                              note="position-table gradient (added to sequence shards)"))
    return items


def _lm_head_items(model, layout, phase, s, gathered) -> list[CommItem]:
    p, e, b = layout.tp, layout.bytes_per_elem, layout.micro_batch
    n = b * s * model.hidden * e
    training = phase == "training"
    items = []
    if gathered:
        logits = b * s * padded(model.vocab, p) * e  # (B, T, ceil(V/t) t): padded columns travel too
        items.append(item("all_gather", "lm_head", "forward", "tp", p, logits,
                          note="logits gathered over the vocabulary (its backward keeps the own slice)"))
    if layout.sequence_parallel:
        items.append(item("all_gather", "lm_head", "forward", "tp", p, n, note="sequence gather before the LM head"))
        if training:
            items.append(item("all_reduce", "final_norm", "backward", "tp", p, model.hidden * e,
                              count=_vectors_per_norm(model),
                              note="final norm gradients (sequence-sharded inputs)"))
            items.append(item("reduce_scatter", "lm_head", "backward", "tp", p, n, note="dX of the gather"))
    elif training:
        items.append(item("all_reduce", "lm_head", "backward", "tp", p, n, note="dX of the column-parallel LM head"))
    return items


def _loss_item(layout, tokens, loss_bytes) -> CommItem:
    return item("all_reduce", "cross_entropy", "forward", "tp", layout.tp, tokens * loss_bytes, count=3,
                note="max, target logit and sum of exp per token (logits stay sharded)")


def pp_collectives(model: ModelSpec, layout: Layout, *, stage: str, seq: int | None = None,
                   phase: str | None = None) -> list[CommItem]:
    """Point-to-point traffic of one pipeline stage per micro-batch (counts per micro-batch):
    :func:`pp_p2p_items` of the model's hidden size."""
    return pp_p2p_items(model.hidden, model.seq if seq is None else seq, layout, stage=stage, phase=phase)


def pp_p2p_items(hidden: int, seq: int, layout: Layout, *, stage: str, phase: str | None = None) -> list[CommItem]:
    """Point-to-point traffic of one pipeline stage per micro-batch (counts per micro-batch).

    Activations go forward, their gradients backward, ``b s h e`` each. With tp > 1 each rank
    sends only its ``1/t`` (the scatter/gather optimisation, Narayanan et al. 2021, Sec. 4.1;
    under sequence parallelism the activation is already sharded) and, without sequence
    parallelism, the receiver all-gathers it.
    """
    if layout.pp == 1:
        return []
    phase = _phase(layout, phase)
    t, e = layout.tp, layout.bytes_per_elem
    n = pp_p2p_bytes(layout.micro_batch, seq, hidden, e)
    shard = pp_p2p_bytes(layout.micro_batch, seq, hidden, e, tp=t, scatter_gather=True)
    items = []
    directions = [("forward", stage != "last", stage != "first")]
    if phase == "training":
        directions.append(("backward", stage != "first", stage != "last"))
    for direction, sends, receives in directions:
        what = "activation" if direction == "forward" else "activation_grad"
        if sends:
            items.append(CommItem("send", f"pipeline.{what}", direction, "pp", 2, n, shard, 1,
                                  note="payload N; each tp rank sends N / t" if t > 1 else "payload N"))
        if receives and t > 1 and not layout.sequence_parallel:
            items.append(item("all_gather", f"pipeline.{what}", direction, "tp", t, n,
                              note="reassemble the scattered activation"))
    return items


def dp_collectives(param_count: int, layout: Layout) -> list[CommItem]:
    """Data-parallel traffic per step (counts per step; gradients reduced in the training dtype).

    Plain DP: one all-reduce of the gradients. ZeRO (Rajbhandari et al. 2020, Sec. 7): stage 1 a
    reduce-scatter of gradients and an all-gather of updated parameters per step; stage 2 the
    reduce-scatter per micro-batch (full gradients are never held); stage 3 also all-gathers the
    parameters in every forward and backward.
    """
    p, m = layout.dp, layout.num_micro_batches
    if p == 1 or layout.workload != "train":
        return []
    size = param_count * layout.bytes_per_elem
    z = layout.zero_stage
    if z == 0:
        return [item("all_reduce", "gradients", "step", "dp", p, size)]
    gather = [item("all_gather", "parameters", "step", "dp", p, size, note="updated shards")]
    rs_count = 1 if z == 1 else m
    rs = [item("reduce_scatter", "gradients", "backward" if z >= 2 else "step", "dp", p, size, count=rs_count)]
    if z < 3:
        return rs + gather
    return rs + [item("all_gather", "parameters", "forward", "dp", p, size, count=m),
                 item("all_gather", "parameters", "backward", "dp", p, size, count=m)]


def scale(items: list[CommItem], factor: int) -> list[CommItem]:
    """The same items repeated ``factor`` times (per micro-batch -> per step)."""
    return [replace(i, count=i.count * factor) for i in items]


def bytes_sent(items: list[CommItem]) -> float:
    return sum(i.total_bytes_sent for i in items)


def _phase(layout: Layout, phase: str | None) -> str:
    phase = phase or ("training" if layout.workload == "train" else "inference")
    if phase not in ("training", "inference"):
        raise ValueError(f"phase ({phase!r}) must be one of: training, inference")
    return phase

