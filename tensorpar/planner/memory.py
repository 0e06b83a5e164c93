"""Bytes per device: activations (Korthikanti et al. 2022), KV cache, model states (ZeRO).

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv:2205.05198), Sec. 4 and Table 2: count every tensor a layer keeps for
its backward, activations of ``e`` bytes and dropout masks of 1 byte, no FlashAttention. Their
table (gpt, ffn = 4h, e = 2) is :func:`korthikanti_table2`; :func:`activation_bytes_per_layer`
counts the same tensors from shapes, so it also covers llama (SwiGLU, no dropout, GQA), any ffn
and any element size, and equals the table where the table applies.
"""
from __future__ import annotations

from .layout import OPTIMIZERS, RECOMPUTE, ZERO_STAGES, check_choice
from .models import ModelSpec
from .params import ceil_div, heads_per_device, kv_heads_per_device, kv_replication, layers_per_stage


def korthikanti_table2(s: int, b: int, h: int, a: int, t: int = 1, *, sequence_parallel: bool = False,
                       recompute: str = "none") -> float:
    """Activation bytes per layer, Korthikanti et al. 2022, Table 2 (16-bit activations):

    no parallelism              s b h (34 + 5 a s / h)
    tensor parallel             s b h (10 + 24 / t + 5 a s / (h t))
    tensor + sequence parallel  s b h / t (34 + 5 a s / h)
    tensor parallel, selective  s b h (10 + 24 / t)
    tensor + sequence, selective  34 s b h / t
    full recomputation          2 s b h
    """
    check_choice("recompute", recompute, RECOMPUTE)
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh
    scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh / t * (34 + scores)
    return sbh * (10 + 24 / t + scores / t)


def activation_bytes_per_layer(model: ModelSpec, *, seq: int, micro_batch: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               bytes_per_elem: int = 2) -> float:
    """Bytes one layer stores for backward, per device and micro-batch, counted tensor by tensor
    (Korthikanti et al. 2022, Sec. 4.1). Per token, with ``rep(x) = x / t`` under sequence
    parallelism and ``x`` otherwise (tensors the tp ranks would replicate):

    - norms: 2 inputs, ``rep(2 h e)``; attention and MLP inputs ``rep(2 h e)``
    - Q ``a_t d e``, K and V ``g_t d e`` each, o_proj input ``a_t d e`` (heads split)
    - scores: softmax output ``a_t s e``; gpt adds its dropout mask ``a_t s`` and output ``a_t s e``
    - Qwen3's q/k norms (``qk_norm``): their inputs ``(a_t + g_t) d e``
    - MLP: gpt GELU input and down input ``2 f_t e``; llama gate, up and down input ``3 f_t e``
    - gpt: two dropout masks ``rep(2 h)``

    Selective recomputation drops the score tensors; full recomputation keeps only the layer
    input ``rep(h e)`` (Korthikanti: 2 s b h at e = 2).
    """
    check_choice("recompute", recompute, RECOMPUTE)
    e, h, d, t = bytes_per_elem, model.hidden, model.head_dim, tp
    rep = (lambda x: x / t) if sequence_parallel else (lambda x: float(x))
    tokens = seq * micro_batch
    if recompute == "full":
        return tokens * rep(h * e)
    a_t, g_t, f_t = heads_per_device(model, t), kv_heads_per_device(model, t), ceil_div(model.ffn, t)
    dropout = model.family == "gpt"
    per_token = rep(4 * h * e) + (2 * a_t + 2 * g_t) * d * e
    per_token += model.mlp_matrices * f_t * e
    if model.qk_norm:
        per_token += (a_t + g_t) * d * e
    if dropout:
        per_token += rep(2 * h)
    if recompute == "none":
        per_token += a_t * seq * (2 * e + 1 if dropout else e)
    return tokens * per_token


def first_stage_activation_bytes(per_layer: float, layers: int, pp: int, num_micro_batches: int,
                                 interleave: int = 1) -> float:
    """Activations on the first pipeline stage under 1F1B: ``min(pp, m)`` micro-batches in flight
    times ``l / pp`` layers (Korthikanti et al. 2022, Eq. 5-6: ``L`` layers' worth when m >= pp);
    interleaved schedules (``interleave`` = v chunks) multiply by ``1 + (pp - 1) / (pp v)``."""
    in_flight = min(pp, num_micro_batches)
    factor = interleave_factor(pp, interleave) if interleave > 1 else 1.0
    return per_layer * ceil_div(layers, pp) * in_flight * factor


def interleave_factor(pp: int, interleave: int) -> float:
    """Korthikanti et al. 2022, Sec. 4.2.3: interleaved 1F1B stores ``1 + (p - 1)/(p m)`` times
    more on the first stage (m = model chunks per device)."""
    return 1.0 + (pp - 1) / (pp * interleave)


def kv_cache_bytes_per_token(model: ModelSpec, *, tp: int = 1, pp: int = 1, bytes_per_elem: int = 2) -> dict:
    """KV cache bytes per token: ``2 l g d e`` in total (K and V; Kwon et al. 2023, Sec. 3, and
    Pope et al. 2022, Sec. 2.1). Per device ``2 (l / pp) g_t d e`` with ``g_t`` kv heads per rank;
    when tp exceeds g each kv head is replicated ``t / g`` times, so the cached bytes of one model
    replica grow by that factor (``replicated_total``)."""
    g_t = kv_heads_per_device(model, tp)
    total = 2 * model.layers * model.kv_heads * model.head_dim * bytes_per_elem
    per_device = 2 * layers_per_stage(model, pp) * g_t * model.head_dim * bytes_per_elem
    replicated_total = 2 * model.layers * g_t * tp * model.head_dim * bytes_per_elem
    return {"total": total, "per_device": per_device, "replicated_total": replicated_total,
            "replication": kv_replication(model, tp)}


def optimizer_bytes_per_param(bytes_per_elem: int, optimizer: str = "adam-mixed") -> int:
    """Optimizer state per parameter. ``adam-mixed`` (Megatron-LM, DeepSpeed): with 16-bit weights
    an fp32 master copy, momentum and variance, K = 12 (Rajbhandari et al. 2020, Sec. 3.1);
    otherwise momentum and variance in the training dtype, ``2 e``. ``adamw``: PyTorch's AdamW on
    the model's own parameters, as ``tensorpar train`` runs it: momentum and variance in the
    model's dtype, ``2 e``."""
    check_choice("optimizer", optimizer, OPTIMIZERS)
    if optimizer == "adamw":
        return 2 * bytes_per_elem
    return 12 if bytes_per_elem < 4 else 2 * bytes_per_elem


def model_state_bytes(params: float, *, dp: int = 1, zero_stage: int = 0, bytes_per_elem: int = 2) -> dict:
    """Weights, gradients and Adam state per device, ZeRO stages over ``dp`` ranks (Rajbhandari et
    al. 2020, Sec. 5, Table 1; at e = 2: 16 Psi, stage 1 ``4 Psi + 12 Psi / N_d``, stage 2
    ``2 Psi + 14 Psi / N_d``, stage 3 ``16 Psi / N_d``)."""
    check_choice("zero_stage", zero_stage, ZERO_STAGES)
    e = bytes_per_elem
    weights, grads, opt = params * e, params * e, params * optimizer_bytes_per_param(e)
    return {"weights": weights / (dp if zero_stage >= 3 else 1),
            "gradients": grads / (dp if zero_stage >= 2 else 1),
            "optimizer": opt / (dp if zero_stage >= 1 else 1)}


def embedding_activation_bytes(model: ModelSpec, *, seq: int, micro_batch: int, tp: int,
                               sequence_parallel: bool, in_flight: int) -> float:
    """First stage extra: the embedding dropout mask (gpt), ``s b h p / t`` in Korthikanti et al.
    2022 (Sec. 4.3); none for llama (no dropout)."""
    if model.family != "gpt":
        return 0.0
    mask = seq * micro_batch * model.hidden
    return in_flight * (mask / tp if sequence_parallel else mask)


def output_activation_bytes(model: ModelSpec, *, seq: int, micro_batch: int, tp: int,
                            sequence_parallel: bool, bytes_per_elem: int) -> float:
    """Last stage extra (Korthikanti et al. 2022, Sec. 4.3, ``4 s b h / t (1 + v / h)``): the final
    norm and LM head inputs (``2 s b h e``, split under sequence parallelism) and the fp32 logits
    of the vocabulary shard (``4 s b ceil(V / t)``)."""
    inputs = 2 * seq * micro_batch * model.hidden * bytes_per_elem
    logits = 4 * seq * micro_batch * ceil_div(model.vocab, tp)
    return (inputs / tp if sequence_parallel else inputs) + logits


def weight_bytes(params: float, bytes_per_elem: int, shards: int = 1) -> float:
    """``P e / shards``: weight bytes split evenly over ``shards`` devices, replicated tensors
    (norms, row-parallel biases) ignored; :func:`tensorpar.planner.params.params_per_device` is the
    exact per-rank count."""
    return params * bytes_per_elem / shards
