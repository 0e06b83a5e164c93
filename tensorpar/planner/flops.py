"""Matmul FLOPs counted from shapes (a multiply-add is 2 FLOPs; elementwise work is not counted).

Forward, per token and layer, with hidden h, heads a, kv heads g, head dim d, ffn f, m MLP
matrices (2 GELU, 3 SwiGLU) and c keys attended to:

    q, k, v      2 h (a d + 2 g d)
    scores       2 c a d  (Q K^T)   +   2 c a d  (softmax(.) V)      "attention scores"
    o            2 a d h
    mlp          2 m h f
    LM head      2 h V   (once per token, not per layer)

Backward costs twice the forward (Narayanan et al. 2021, Sec. 5.1). For the gpt family with
f = 4h, a d = h and c = s this gives 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) per iteration, and
with full recomputation (one more forward of every layer, not of the LM head) Eq. 3,
96 B s l h^2 (1 + s/(6h) + V/(16 l h)).

Selective recomputation (Korthikanti et al. 2022, arXiv:2205.05198) re-runs only the
attention-score part. Their Appendix A, Eq. 8, gives hardware FLOPs
72 B L s h^2 (1 + s/(3h) + V/(12 h L)): 12 B s^2 h L over the model FLOPs, three times the
forward score FLOPs 4 B s^2 h L, although the text before it names only the forward re-run. The
equation is what the paper's figures use: Table 5's hardware FLOPs utilisation (43.7% ... 57.0%)
and Sec. 5's "2.7% and 1.6% FLOPs overhead" for GPT-3 and MT-NLG. ``hardware_flops_per_iteration``
reports Eq. 8 (counted from shapes: three times the forward score FLOPs), so that utilisations
compare with theirs. The compute *lower bound* (:func:`causal_flops_per_iteration`) counts only
what must run: one forward re-run of the scores, over the unmasked causal pairs.

Model and hardware FLOPs count every query against all ``s`` keys, as the papers do; only the
bounds count causal masking and sliding windows (``ModelSpec.causal_keys_per_query``).
"""
from __future__ import annotations

from .layout import RECOMPUTE, check_choice
from .models import ModelSpec

SECONDS_PER_DAY = 86400.0


def layer_forward_flops_per_token(model: ModelSpec, context: float) -> dict:
    """Forward FLOPs of one layer for one token attending to ``context`` keys, split into the
    dense part (projections and MLP) and the attention-score part (``4 c a d``)."""
    h, a, g, d = model.hidden, model.heads, model.kv_heads, model.head_dim
    dense = 2 * h * (a * d + 2 * g * d) + 2 * a * d * h + 2 * model.mlp_matrices * h * model.ffn
    return {"dense": dense, "attention_scores": 4 * context * a * d}


def lm_head_forward_flops_per_token(model: ModelSpec) -> int:
    """``2 h V``: the logits of one token (the input embedding is a lookup, no FLOPs)."""
    return 2 * model.hidden * model.vocab


def forward_flops_per_token(model: ModelSpec, context: float) -> float:
    """Forward FLOPs of one token through every layer and the LM head, attending to ``context``
    keys: ``l (dense + scores) + 2 h V``."""
    layer = layer_forward_flops_per_token(model, context)
    return model.layers * (layer["dense"] + layer["attention_scores"]) + lm_head_forward_flops_per_token(model)


def flops_per_iteration(model: ModelSpec, global_batch: int, seq: int | None = None) -> float:
    """Model FLOPs of one global batch, forward and backward, without recomputation.

    ``3 B s (l (dense + scores) + 2 h V)``; equals Narayanan et al. 2021's
    ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))`` for gpt with ffn = 4h.
    """
    s = model.seq if seq is None else seq
    return 3.0 * global_batch * s * forward_flops_per_token(model, s)


def recompute_flops_per_iteration(model: ModelSpec, global_batch: int, recompute: str,
                                  seq: int | None = None) -> float:
    """Extra FLOPs recomputation adds to the reported hardware FLOPs: full re-runs every layer's
    forward (Narayanan et al. 2021, Eq. 3); selective adds three times the forward score FLOPs,
    ``12 B s^2 a d L`` (Korthikanti et al. 2022, App. A, Eq. 8; see the module docstring)."""
    check_choice("recompute", recompute, RECOMPUTE)
    s = model.seq if seq is None else seq
    layer = layer_forward_flops_per_token(model, s)
    per_token = {"none": 0.0, "full": layer["dense"] + layer["attention_scores"],
                 "selective": 3.0 * layer["attention_scores"]}[recompute]
    return float(global_batch) * s * model.layers * per_token


def hardware_flops_per_iteration(model: ModelSpec, global_batch: int, recompute: str,
                                 seq: int | None = None) -> float:
    """FLOPs the devices execute for one global batch, recomputation included, as Narayanan et al.
    2021 (Eq. 3, full) and Korthikanti et al. 2022 (Eq. 8, selective) count them."""
    return (flops_per_iteration(model, global_batch, seq)
            + recompute_flops_per_iteration(model, global_batch, recompute, seq))


def causal_flops_per_iteration(model: ModelSpec, global_batch: int, recompute: str,
                               seq: int | None = None) -> float:
    """The least matmul FLOPs of one iteration, which the compute time bound uses.

    Per token: dense work 3 passes (4 with full recomputation), the LM head 3, and the attention
    scores 3 passes plus one forward re-run under either recomputation, each counting only the
    unmasked query-key pairs: ``(s + 1) / 2`` keys per query causally, fewer in sliding-window
    layers (kernels such as FlashAttention skip masked blocks; Dao et al. 2022). Selective
    recomputation adds one forward of the scores (``4 B s^2 a d L`` unmasked, Korthikanti et al.
    2022, App. A text), not Eq. 8's three.
    """
    check_choice("recompute", recompute, RECOMPUTE)
    s = model.seq if seq is None else seq
    layer = layer_forward_flops_per_token(model, model.causal_keys_per_query(s))
    dense_passes, score_passes = (4, 4) if recompute == "full" else (3, 4 if recompute == "selective" else 3)
    per_token = (model.layers * (dense_passes * layer["dense"] + score_passes * layer["attention_scores"])
                 + 3 * lm_head_forward_flops_per_token(model))
    return float(global_batch) * s * per_token


def korthikanti_eq8_flops(layers: int, hidden: int, vocab: int, seq: int, global_batch: int) -> float:
    """Korthikanti et al. 2022 (arXiv:2205.05198), App. A, Eq. 8, hardware FLOPs per iteration with
    selective recomputation: ``72 B L s h^2 (1 + s/(3h) + V/(12 h L))`` (gpt, ffn = 4h)."""
    l, h, s = layers, hidden, seq
    return 72.0 * global_batch * l * s * h**2 * (1 + s / (3 * h) + vocab / (12 * h * l))


def narayanan_eq3_flops(layers: int, hidden: int, vocab: int, seq: int, global_batch: int) -> float:
    """Narayanan et al. 2021 (arXiv:2104.04473), Eq. 3, FLOPs per iteration with full activation
    recomputation: ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` (gpt, ffn = 4h)."""
    l, h, s = layers, hidden, seq
    return 96.0 * global_batch * s * l * h**2 * (1 + s / (6 * h) + vocab / (16 * l * h))


def prefill_flops(model: ModelSpec, batch: int, prompt: int) -> float:
    """Least forward FLOPs to prefill ``batch`` prompts of ``prompt`` tokens: every layer for every
    token with causal (and, where the model has one, sliding-window) attention, and the LM head
    only for each prompt's last token (the one whose logits pick the next token)."""
    layer = layer_forward_flops_per_token(model, model.causal_keys_per_query(prompt))
    per_seq = prompt * model.layers * (layer["dense"] + layer["attention_scores"])
    return float(batch) * (per_seq + lm_head_forward_flops_per_token(model))


def decode_flops_per_token(model: ModelSpec, batch: int, context: int) -> float:
    """Forward FLOPs of one decode step: ``batch`` new tokens, each attending to ``context`` keys
    (at most the sliding window in windowed layers)."""
    return float(batch) * forward_flops_per_token(model, model.attended_keys(context))


def training_days_eq4(params: float, tokens: float, n_devices: int, flops_per_device: float,
                      *, recompute: bool = True) -> float:
    """End-to-end training time, Narayanan et al. 2021, Eq. 4: ``8 T P / (n X)`` seconds (with
    activation recomputation; ``6 T P / (n X)`` without), returned in days."""
    factor = 8.0 if recompute else 6.0
    return factor * tokens * params / (n_devices * flops_per_device) / SECONDS_PER_DAY


def achieved_flops_per_device(flops: float, n_devices: int, seconds: float) -> float:
    """FLOP/s each device achieved: ``F / (n t)`` (Narayanan et al. 2021, Sec. 5.1)."""
    return flops / (n_devices * seconds)


def weak_scaling_efficiency(params: float, tokens: float, n_devices: int, seconds: float, *,
                            base_params: float, base_tokens: float, base_n_devices: int,
                            base_seconds: float) -> float:
    """Per-device parameter-token throughput ``P T / (n t)`` relative to a baseline run: the weak
    scaling efficiency of the NVIDIA/Megatron-LM README (2020) tables (1-GPU 1.2B baseline)."""
    return (params * tokens / (n_devices * seconds)) / (base_params * base_tokens / (base_n_devices * base_seconds))


def scaling_efficiency(aggregate_flops: float, n_devices: int, single_device_flops: float) -> float:
    """Sustained throughput of ``n`` devices over ``n`` times one device's (Shoeybi et al. 2019,
    Sec. 1 and 5.1: 15.1 PFLOP/s on 512 GPUs against 39 TFLOP/s on one, 76%)."""
    return aggregate_flops / (n_devices * single_device_flops)
