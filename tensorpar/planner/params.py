"""Parameter counts from shapes: the whole model, and what one tensor-parallel rank holds.

Per layer, with hidden h, heads a, kv heads g, head dim d, ffn f, tp size t (row-vector
convention, Megatron-LM partitioning, Shoeybi et al. 2019, Sec. 3):

    q       h x (a d / t)       column-parallel (heads split)       + bias a d / t  (qkv_bias)
    k, v    h x (g_t d) each    column-parallel; g_t = g / t, or 1   + bias g_t d each
            when t is a multiple of g (each kv head replicated t / g times)
    o       (a d / t) x h       row-parallel                         + bias h, replicated (gpt)
    q/k norm 2 d, replicated    per-head RMSNorms of Qwen3 (``qk_norm``)
    mlp     m x h x f_t         m = 2 (GELU) or 3 (SwiGLU), f_t = ceil(f / t)
            gpt biases: f_t (up, split) + h (down, replicated)
    norms   2 per layer, replicated: LayerNorm 2h, RMSNorm h

Embedding and (untied) LM head: ``ceil(V / t)`` rows of h per rank (vocabulary padded to a
multiple of t, docs/architecture.md). gpt adds a replicated learned position table and ties the
LM head to the embedding (with pp > 1 the last stage holds a copy, as in Megatron-LM). One final
norm, replicated, on the last stage.

For the gpt family with f = 4h this totals Narayanan et al. 2021, Eq. 2,
``12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))``, plus the final LayerNorm (2h) that Eq. 2 omits.
"""
from __future__ import annotations

from .models import ModelSpec, divisors


def ceil_div(n: int, p: int) -> int:
    return -(-n // p)


def padded(n: int, tp: int) -> int:
    """``ceil(n / tp) * tp``: the size a split of ``n`` over ``tp`` ranks is padded to."""
    return ceil_div(n, tp) * tp


def params_narayanan_eq2(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """GPT parameters, Narayanan et al. 2021 (arXiv:2104.04473), Eq. 2:
    ``P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))``."""
    l, h = layers, hidden
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (vocab + seq) / (12 * l * h))


def heads_per_device(model: ModelSpec, tp: int) -> int:
    """Query heads per rank, ``a / t``; ``ValueError`` when t does not divide a."""
    if model.heads % tp:
        valid = ", ".join(map(str, divisors(model.heads)))
        raise ValueError(f"tp ({tp}) must divide heads ({model.heads}); valid tp sizes: {valid}")
    return model.heads // tp


def kv_heads_per_device(model: ModelSpec, tp: int) -> int:
    """KV heads per rank: ``g / t`` when t divides g; 1 when t is a multiple of g (each kv head is
    replicated ``t / g`` times, as vLLM and TensorRT-LLM do for GQA); else ``ValueError``."""
    g = model.kv_heads
    if g % tp == 0:
        return g // tp
    if tp % g == 0:
        return 1
    raise ValueError(f"tp ({tp}) must divide kv_heads ({g}) or be a multiple of it; valid tp sizes: "
                     f"{', '.join(map(str, valid_tp_sizes(model)))}")


def valid_tp_sizes(model: ModelSpec) -> list[int]:
    """Every tp that runs: it divides the heads, and divides or is a multiple of the kv heads
    (ffn and vocabulary can always be padded)."""
    g = model.kv_heads
    return [t for t in divisors(model.heads) if g % t == 0 or t % g == 0]


def kv_replication(model: ModelSpec, tp: int) -> int:
    """How many ranks hold a copy of each kv head: ``max(1, t / g)``."""
    return max(1, tp // model.kv_heads)


def attention_params(model: ModelSpec, tp: int = 1) -> int:
    """Attention parameters on one rank (q, k, v, o, their biases, Qwen3's q/k norms)."""
    h, d = model.hidden, model.head_dim
    q_cols = heads_per_device(model, tp) * d
    kv_cols = kv_heads_per_device(model, tp) * d
    weights = h * q_cols + 2 * h * kv_cols + q_cols * h  # (h, a d/t), 2 x (h, g_t d), (a d/t, h)
    bias = (q_cols + 2 * kv_cols if model.qkv_bias else 0) + (h if model.biases else 0)
    qk_norm = 2 * d if model.qk_norm else 0  # one d-vector for all q heads, one for all k heads
    return weights + bias + qk_norm


def mlp_params(model: ModelSpec, tp: int = 1) -> int:
    """MLP parameters on one rank; ffn padded to a multiple of tp (``f_t = ceil(f / t)``)."""
    h, f_t = model.hidden, ceil_div(model.ffn, tp)
    bias = f_t + h if model.biases else 0
    return model.mlp_matrices * h * f_t + bias


def layer_params(model: ModelSpec, tp: int = 1) -> int:
    """One transformer layer on one rank: attention + MLP + two replicated norms."""
    return attention_params(model, tp) + mlp_params(model, tp) + 2 * model.norm_params


def embedding_params(model: ModelSpec, tp: int = 1) -> int:
    """Word embedding rows on one rank, ``ceil(V / t) * h`` (VocabParallelEmbedding)."""
    return ceil_div(model.vocab, tp) * model.hidden


def position_params(model: ModelSpec) -> int:
    """Learned position table (gpt family), replicated on every rank."""
    return model.position_table * model.hidden if model.family == "gpt" else 0


def lm_head_params(model: ModelSpec, tp: int = 1) -> int:
    """Untied LM head, ``ceil(V / t) * h`` per rank (column-parallel, logits stay sharded)."""
    return 0 if model.tied_embeddings else ceil_div(model.vocab, tp) * model.hidden


def count_params(model: ModelSpec) -> int:
    """Every parameter of the model, counted once (tied embeddings once)."""
    return (model.layers * layer_params(model) + embedding_params(model) + position_params(model)
            + lm_head_params(model) + model.norm_params)


def layers_per_stage(model: ModelSpec, pp: int) -> int:
    """Layers on one pipeline stage, ``ceil(l / pp)`` (equal when pp divides l)."""
    return ceil_div(model.layers, pp)


def stage_params_per_device(model: ModelSpec, tp: int, pp: int, stage: int) -> int:
    """Parameters one rank of pipeline ``stage`` holds (0 = first, ``pp - 1`` = last)."""
    n = layers_per_stage(model, pp) * layer_params(model, tp)
    if stage == 0:
        n += embedding_params(model, tp) + position_params(model)
    if stage == pp - 1:
        n += model.norm_params + lm_head_params(model, tp)
        if model.tied_embeddings and pp > 1:  # the last stage keeps a copy of the tied embedding
            n += embedding_params(model, tp)
    return n


def params_per_device(model: ModelSpec, tp: int = 1, pp: int = 1) -> int:
    """Parameters on the most loaded rank (the largest pipeline stage)."""
    return max(stage_params_per_device(model, tp, pp, s) for s in sorted({0, pp - 1}))


def param_breakdown(model: ModelSpec, tp: int = 1) -> dict:
    """Per-rank parameters by part (pp = 1): what a test compares with a sharded module's tensors."""
    return {
        "embedding": embedding_params(model, tp), "position_embedding": position_params(model),
        "attention_per_layer": attention_params(model, tp), "mlp_per_layer": mlp_params(model, tp),
        "norms_per_layer": 2 * model.norm_params, "final_norm": model.norm_params,
        "lm_head": lm_head_params(model, tp), "total": stage_params_per_device(model, tp, 1, 0),
    }
