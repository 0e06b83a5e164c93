"""Tensor-parallel plans of the Hugging Face families, as data.

A plan maps module-name patterns to styles; ``tensorpar.apply.parallelize`` applies it with one
function. Patterns are matched against a module's full name and against its name relative to
the model's base model (``model.`` in ``LlamaForCausalLM``, ``transformer.`` in GPT-2,
``bert.`` in BERT heads), so one plan serves the bare model and its heads. ``*`` matches one
name component (a layer index). The model code is untouched: only these names know TP.

Styles (the partition of each, Megatron-LM sec. 3; row-vector convention ``Y = X A``):

- ``colwise``: ``nn.Linear`` split along out_features (ColumnParallelLinear), output sharded.
- ``rowwise``: ``nn.Linear`` split along in_features (RowParallelLinear), output all-reduced.
- ``colwise_kv``: a K or V projection: split by KV heads when tp divides n_kv_heads, else each
  rank holds the one KV head its query heads use (ReplicatedHeadLinear, tp a multiple of n_kv).
- ``conv1d_colwise`` / ``conv1d_rowwise``: GPT-2 ``Conv1D`` (``weight: (in, out)``, transposed
  against ``nn.Linear``) as column / row-parallel linears.
- ``conv1d_qkv``: GPT-2's fused ``c_attn`` (out = [q | k | v]): rank i takes ``[q_i | k_i | v_i]``.
- ``vocab``: ``nn.Embedding`` split along the vocabulary (VocabParallelEmbedding, padded).
- ``vocab_head``: output head split along the vocabulary (ColumnParallelLinear, padded),
  logits all-gathered so the ordinary forward returns full logits.
- ``attention``: an attention module: its per-rank head counts are set (``head_attrs``) and its
  hidden-states input enters the tensor-parallel region once (one all-reduce of dX in
  backward shared by q, k and v); its colwise children then skip their own input copy.
- ``mlp``: the same region entry for an MLP whose gate and up projections share the input.
- ``replicate``: left whole on every rank (the default for anything a plan does not name).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

STYLES = ("colwise", "rowwise", "colwise_kv", "conv1d_colwise", "conv1d_rowwise", "conv1d_qkv",
          "vocab", "vocab_head", "attention", "mlp", "replicate")
REGION_STYLES = ("attention", "mlp")

_DECODER = {
    "embed_tokens": "vocab",
    "layers.*.self_attn": "attention",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise_kv",
    "layers.*.self_attn.v_proj": "colwise_kv",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp": "mlp",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "lm_head": "vocab_head",
}

_GPT2 = {
    "wte": "vocab",
    "h.*.attn": "attention",
    "h.*.attn.c_attn": "conv1d_qkv",
    "h.*.attn.c_proj": "conv1d_rowwise",
    "h.*.mlp.c_fc": "conv1d_colwise",
    "h.*.mlp.c_proj": "conv1d_rowwise",
    "lm_head": "vocab_head",
}

_BERT = {
    "embeddings.word_embeddings": "vocab",
    "encoder.layer.*.attention.self": "attention",
    "encoder.layer.*.attention.self.query": "colwise",
    "encoder.layer.*.attention.self.key": "colwise",
    "encoder.layer.*.attention.self.value": "colwise",
    "encoder.layer.*.attention.output.dense": "rowwise",
    "encoder.layer.*.intermediate.dense": "colwise",
    "encoder.layer.*.output.dense": "rowwise",
    "cls.predictions.decoder": "vocab_head",
}


@dataclass(frozen=True)
class FamilyPlan:
    """A family's plan: ``styles`` (pattern -> style) and the attention attributes that hold
    per-rank head counts (rewritten on every ``attention`` module)."""
    family: str
    styles: dict
    head_attrs: tuple


FAMILY_PLANS = {
    "llama": FamilyPlan("llama", _DECODER, ("num_key_value_groups",)),
    "mistral": FamilyPlan("mistral", _DECODER, ("num_key_value_groups",)),
    "qwen2": FamilyPlan("qwen2", _DECODER, ("num_key_value_groups",)),
    "gpt2": FamilyPlan("gpt2", _GPT2, ("num_heads", "split_size")),
    "bert": FamilyPlan("bert", _BERT, ("num_attention_heads", "all_head_size")),
}
FAMILIES = tuple(FAMILY_PLANS)


@dataclass(frozen=True)
class Dims:
    """The sizes a tensor-parallel split must respect, read from a model config."""
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    hidden: int


def model_family(model_or_config) -> str | None:
    """The family of a Hugging Face model or config (``config.model_type``), None if unknown."""
    config = getattr(model_or_config, "config", model_or_config)
    kind = getattr(config, "model_type", None)
    return kind if kind in FAMILY_PLANS else None


def model_dims(config) -> Dims:
    """:class:`Dims` of a config of one of :data:`FAMILIES` (GPT-2's ``n_inner=None``: 4h)."""
    n_heads, hidden = config.num_attention_heads, config.hidden_size
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or hidden // n_heads
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    return Dims(n_heads, n_kv, head_dim, ffn, config.vocab_size, hidden)


def local_head_attrs(attrs: tuple, dims: Dims, tp_size: int) -> dict:
    """The per-rank values of the head-count attributes ``attrs`` of an attention module.

    Query heads split evenly (``hq = n_heads / tp``); KV heads split when tp divides them, else
    each rank holds one replicated KV head, so ``num_key_value_groups = hq / n_kv_local``.
    """
    hq = dims.n_heads // tp_size
    hkv = dims.n_kv_heads // tp_size if dims.n_kv_heads % tp_size == 0 else 1
    values = {"num_heads": hq, "num_attention_heads": hq, "num_key_value_heads": hkv,
              "num_key_value_groups": hq // hkv, "split_size": hq * dims.head_dim,
              "all_head_size": hq * dims.head_dim}
    return {a: values[a] for a in attrs}


def _pattern_regex(pattern: str) -> re.Pattern:
    return re.compile("".join("[^.]+" if part == "*" else re.escape(part)
                              for part in re.split(r"(\*)", pattern)) + r"\Z")


def compile_plan(styles: dict) -> list:
    """``[(pattern, regex, style)]``; ValueError for a style outside :data:`STYLES`."""
    if not isinstance(styles, dict) or not styles:
        raise ValueError(f"a plan must be a non-empty dict of module-name pattern -> style; got {styles!r}")
    compiled = []
    for pattern, style in styles.items():
        if style not in STYLES:
            raise ValueError(f"plan entry {pattern!r}: style {style!r} is not one of {', '.join(STYLES)}")
        compiled.append((pattern, _pattern_regex(pattern), style))
    return compiled


def match_style(compiled: list, names: tuple) -> tuple[str, str] | None:
    """``(pattern, style)`` of the first entry matching any of ``names`` (full, relative)."""
    for pattern, regex, style in compiled:
        if any(n is not None and regex.match(n) for n in names):
            return pattern, style
    return None
