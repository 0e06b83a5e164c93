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

Each family plan is built from its :class:`Unit` s (an attention block, an MLP: modules that
split together or not at all) plus the vocabulary entries; ``tensorpar.models.plan_checks``
holds a user's plan to the same units.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

STYLES = ("colwise", "rowwise", "colwise_kv", "conv1d_colwise", "conv1d_rowwise", "conv1d_qkv",
          "vocab", "vocab_head", "attention", "mlp", "replicate")
REGION_STYLES = ("attention", "mlp")


def join_name(anchor: str, suffix: str) -> str:
    """``anchor.suffix``, or ``anchor`` for the empty suffix (the anchor itself)."""
    return f"{anchor}.{suffix}" if suffix else anchor


@dataclass(frozen=True)
class Unit:
    """Modules a plan must split together, or not at all.

    Once a plan shards any module of the unit, every ``members`` entry needs its style: a
    column split without its row partner leaves a sharded activation where a whole one is
    expected, and q split without k, v and the per-rank head counts computes another function
    (heads mixed up) without any error. Names are ``anchor`` + ``.`` + suffix (``""``: the
    anchor itself). ``optional`` entries may be left out: the MLP region entry saves one
    all-reduce of dX in backward but changes no result.
    """
    kind: str  # "attention" or "mlp"
    anchor: str
    members: tuple  # ((suffix, style), ...)
    optional: tuple = ()

    def entries(self) -> list[tuple[str, str]]:
        """``[(pattern, style)]``: the unit's plan entries, optional ones first."""
        return [(join_name(self.anchor, sfx), style) for sfx, style in self.optional + self.members]


def _plan(first: dict, units: tuple, last: dict) -> dict:
    return {**first, **{pat: style for u in units for pat, style in u.entries()}, **last}


_DECODER_UNITS = (
    Unit("attention", "layers.*.self_attn", (("", "attention"), ("q_proj", "colwise"),
         ("k_proj", "colwise_kv"), ("v_proj", "colwise_kv"), ("o_proj", "rowwise"))),
    Unit("mlp", "layers.*.mlp", (("gate_proj", "colwise"), ("up_proj", "colwise"),
         ("down_proj", "rowwise")), optional=(("", "mlp"),)),
)
_GPT2_UNITS = (
    Unit("attention", "h.*.attn", (("", "attention"), ("c_attn", "conv1d_qkv"),
         ("c_proj", "conv1d_rowwise"))),
    Unit("mlp", "h.*.mlp", (("c_fc", "conv1d_colwise"), ("c_proj", "conv1d_rowwise"))),
)
# BERT's row partners sit outside the module that holds the column linears:
# attention.self.{query,key,value} -> attention.output.dense, intermediate.dense -> output.dense.
_BERT_UNITS = (
    Unit("attention", "encoder.layer.*.attention", (("self", "attention"), ("self.query", "colwise"),
         ("self.key", "colwise"), ("self.value", "colwise"), ("output.dense", "rowwise"))),
    Unit("mlp", "encoder.layer.*", (("intermediate.dense", "colwise"), ("output.dense", "rowwise"))),
)

_DECODER = _plan({"embed_tokens": "vocab"}, _DECODER_UNITS, {"lm_head": "vocab_head"})
_GPT2 = _plan({"wte": "vocab"}, _GPT2_UNITS, {"lm_head": "vocab_head"})
_BERT = _plan({"embeddings.word_embeddings": "vocab"}, _BERT_UNITS,
              {"cls.predictions.decoder": "vocab_head"})


@dataclass(frozen=True)
class FamilyPlan:
    """A family's plan: ``styles`` (pattern -> style), the attention attributes that hold
    per-rank head counts (rewritten on every ``attention`` module), and the :class:`Unit` s a
    user plan must take whole."""
    family: str
    styles: dict
    head_attrs: tuple
    units: tuple = ()


FAMILY_PLANS = {
    "llama": FamilyPlan("llama", _DECODER, ("num_key_value_groups",), _DECODER_UNITS),
    "mistral": FamilyPlan("mistral", _DECODER, ("num_key_value_groups",), _DECODER_UNITS),
    "qwen2": FamilyPlan("qwen2", _DECODER, ("num_key_value_groups",), _DECODER_UNITS),
    "gpt2": FamilyPlan("gpt2", _GPT2, ("num_heads", "split_size"), _GPT2_UNITS),
    "bert": FamilyPlan("bert", _BERT, ("num_attention_heads", "all_head_size"), _BERT_UNITS),
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
