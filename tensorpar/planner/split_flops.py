"""Matmul FLOPs of a split model (:mod:`.flops` counts the same from shapes, for the papers'
closed forms; for the gpt and llama templates the two agree).

Per token: every weight matrix ``2 in out`` (an expert ``top_k / n_experts`` of it; the model's
``Matmul`` records), each attention layer's core ``2 c h (d_qk + d_v)`` over ``c`` keys. Model and
hardware FLOPs count every query against all ``s`` keys, as Narayanan et al. 2021 (Sec. 5.1) and
Korthikanti et al. 2022 (App. A, Eq. 8) do; the compute bounds only the unmasked causal pairs, at
most the window in a sliding-window layer. Backward costs twice the forward; full recomputation
runs every block's forward once more, selective recomputation adds three times the score FLOPs
to the hardware count (Eq. 8) and one forward of them to the bound.
"""
from __future__ import annotations

from tensorpar.architecture.split_model import AttentionLayer, SplitModel

from .layout import RECOMPUTE, check_choice


def _core(a: AttentionLayer, keys: float) -> float:
    return 2.0 * keys * a.heads_dense * (a.qk_dim + a.v_dim)


def mean_causal_keys(a: AttentionLayer, seq: int) -> float:
    """Keys one query attends to on average over a causal sequence of ``seq`` tokens: ``(s + 1)
    / 2``, or with a window of W keys ``(W (W + 1) / 2 + (s - W) W) / s`` when s > W."""
    if not a.window or seq <= a.window:
        return (seq + 1) / 2
    w = a.window
    return (w * (w + 1) / 2 + (seq - w) * w) / seq


def _keys(split: SplitModel, a: AttentionLayer, seq: int) -> float:
    return mean_causal_keys(a, seq) if split.causal else float(seq)


def body_matmul_flops(split: SplitModel) -> int:
    """Forward FLOPs per token of every weight matrix but the output head's."""
    return split.matmul_flops_per_token(head=False)


def head_matmul_flops(split: SplitModel) -> int:
    return split.matmul_flops_per_token() - body_matmul_flops(split)


def scores_flops(split: SplitModel, keys) -> float:
    """Attention cores per token, ``keys(layer)`` keys in each layer."""
    return sum(_core(a, keys(a)) for a in split.attention)


def forward_flops_per_token(split: SplitModel, context: float) -> float:
    """Every matmul and every core over ``context`` keys (the papers' count: no masking)."""
    return split.matmul_flops_per_token() + scores_flops(split, lambda a: context)


def flops_per_iteration(split: SplitModel, global_batch: int, seq: int) -> float:
    """Model FLOPs of one global batch, forward and backward: ``3 B s F(s)``."""
    return 3.0 * global_batch * seq * forward_flops_per_token(split, seq)


def hardware_flops_per_iteration(split: SplitModel, global_batch: int, seq: int, recompute: str) -> float:
    """Model FLOPs plus what recomputation re-runs (full: every block's forward; selective:
    three times the forward scores, Korthikanti et al. 2022, Eq. 8)."""
    check_choice("recompute", recompute, RECOMPUTE)
    scores = scores_flops(split, lambda a: seq)
    extra = {"none": 0.0, "full": body_matmul_flops(split) + scores, "selective": 3.0 * scores}[recompute]
    return flops_per_iteration(split, global_batch, seq) + float(global_batch) * seq * extra


def causal_flops_per_iteration(split: SplitModel, global_batch: int, seq: int, recompute: str) -> float:
    """The least FLOPs of one iteration (the compute bound): matmuls 3 passes (4 with full
    recomputation; the head 3), scores over unmasked pairs 3 passes plus one forward re-run
    under either recomputation."""
    check_choice("recompute", recompute, RECOMPUTE)
    dense_passes, score_passes = (4, 4) if recompute == "full" else (3, 4 if recompute == "selective" else 3)
    scores = scores_flops(split, lambda a: _keys(split, a, seq))
    per_token = dense_passes * body_matmul_flops(split) + score_passes * scores + 3 * head_matmul_flops(split)
    return float(global_batch) * seq * per_token


def prefill_flops(split: SplitModel, batch: int, prompt: int) -> float:
    """Least forward FLOPs to prefill ``batch`` prompts of ``prompt`` tokens: every block for
    every token over causal pairs, the head only for each prompt's last token."""
    per_seq = prompt * (body_matmul_flops(split) + scores_flops(split, lambda a: _keys(split, a, prompt)))
    return float(batch) * (per_seq + head_matmul_flops(split))


def decode_flops_per_token(split: SplitModel, batch: int, context: int) -> float:
    """One decode step: ``batch`` new tokens, each attending to ``context`` keys (at most the
    window in a windowed layer)."""
    return float(batch) * (split.matmul_flops_per_token()
                           + scores_flops(split, lambda a: min(context, a.window) if a.window else context))
