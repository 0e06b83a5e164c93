"""Hugging Face models as tensorpar's runtime shards them: shapes and parameters per rank.

The model types counted here are those whose registry entry has
:class:`~tensorpar.architecture.registry.Formulas` (``registry.formula_types``): the ``llama``
and ``gpt`` families read by :mod:`.hfconfig` (Llama, Mistral, Qwen2, Qwen3; GPT-2, GPT-BigCode),
and BERT. Their layers are the planner's two families (:mod:`.models`). BERT counts as a ``gpt``
layer (biases everywhere, LayerNorm, a GELU MLP, a learned position table, the output head tied
to the input embedding) and adds what a GPT-2 does not have, all replicated on every rank: a
token-type table, and either a pooler (``BertModel``, the bare model) or the masked-LM head's
transform (``BertForMaskedLM``), whose output bias is split with the vocabulary like the decoder
it belongs to. Every other architecture ``parallelize`` splits is counted from its split
meta-device model instead (``tensorpar.sharding.inventory``).

Per rank, with ``t`` the tp size and ``ceil(V / t)`` rows of every vocabulary-split tensor
(docs/architecture.md padding rule), :func:`params_per_rank` is

    layers x layer_params(t)  +  ceil(V/t) h  (embedding)  +  final / embedding norm
    + position table (gpt2, bert)  +  ceil(V/t) h (untied LM head)  +  BERT extras

where the layer count is :func:`.params.layer_params` (q/k/v split by heads, KV heads
replicated when t exceeds them, o_proj and down row-split with replicated biases, norms
replicated). Parameters tied to each other are counted once, as ``model.parameters()`` does.
"""
from __future__ import annotations

from dataclasses import dataclass

from tensorpar.architecture import registry

from .hfconfig import from_hf_dict, refuse_unmodelled
from .layout import check_size
from .models import ModelSpec
from .params import ceil_div, heads_per_device, kv_heads_per_device, param_breakdown, valid_tp_sizes

FAMILIES = registry.formula_types("llama", "gpt", "bert")


@dataclass(frozen=True)
class HFModel:
    """A runtime-supported Hugging Face model: its ``kind`` (``model_type``), the planner's
    :class:`ModelSpec` of its layers, and BERT's extra replicated tables."""

    kind: str
    spec: ModelSpec
    type_vocab: int = 0  # BERT token-type rows

    @property
    def is_causal(self) -> bool:
        return registry.ARCHS[self.kind].formulas.family != "bert"


def hf_model(hf_config: dict, *, seq: int | None = None) -> HFModel:
    """:class:`HFModel` of a config dict (``config.to_dict()``); ValueError for a model type
    the runtime does not shard or an option the planner does not count."""
    if not isinstance(hf_config, dict):
        raise ValueError(f"hf_config must be a dict (config.to_dict()); got {type(hf_config).__name__}")
    kind = hf_config.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"model_type {kind!r} is not counted by the planner's closed forms; valid: "
                         f"{', '.join(FAMILIES)} (tensorpar plan counts the others from their split model)")
    if kind == "bert":
        refuse_unmodelled(hf_config, kind)
        return _bert(hf_config, seq)
    return HFModel(kind, from_hf_dict(hf_config, seq=seq))  # NotModelled (a ValueError) for an option


def _bert(cfg: dict, seq: int | None) -> HFModel:
    """A BERT encoder's layers count as a gpt layer: q/k/v and o with biases, a two-matrix GELU
    MLP with biases, two LayerNorms; the embedding LayerNorm takes the final norm's place."""
    spec = ModelSpec(name=cfg.get("_name_or_path") or "bert", family="gpt", layers=cfg["num_hidden_layers"],
                     hidden=cfg["hidden_size"], heads=cfg["num_attention_heads"], ffn=cfg["intermediate_size"],
                     vocab=cfg["vocab_size"], seq=seq or cfg.get("max_position_embeddings", 512),
                     max_positions=cfg.get("max_position_embeddings", 512),
                     tied_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    return HFModel("bert", spec, type_vocab=cfg.get("type_vocab_size", 2))


def check_tp(model: HFModel, tp: int) -> None:
    """What the runtime needs of tp (tensorpar.models.feasibility): tp divides the query heads,
    divides or is a multiple of the KV heads, and divides ffn (ParallelMLP does not pad it)."""
    check_size("tp", tp)
    spec = model.spec
    heads_per_device(spec, tp)
    kv_heads_per_device(spec, tp)
    if spec.ffn % tp:
        valid = [t for t in valid_tp_sizes(spec) if spec.ffn % t == 0]
        raise ValueError(f"tp ({tp}) must divide ffn ({spec.ffn}); valid tp sizes: {', '.join(map(str, valid))}")


def _bert_extras(model: HFModel, tp: int, head: bool) -> int:
    """BERT's replicated tables and head: token types ``T h``; the pooler ``h^2 + h`` (bare
    model) or the MLM transform ``h^2 + h + 2h`` and the vocabulary-split output bias ``ceil(V/t)``."""
    h = model.spec.hidden
    extra = model.type_vocab * h
    if head:
        return extra + h * h + h + 2 * h + ceil_div(model.spec.vocab, tp)
    return extra + h * h + h


def params_per_rank(hf_config: dict, tp: int, *, head: bool = True) -> int:
    """Parameters on each rank (every rank holds the same count; the last rank's vocabulary
    rows past V are zero padding). ``head``: the model with its output head (``*ForCausalLM``,
    ``GPT2LMHeadModel``, ``BertForMaskedLM``), else the bare model (``AutoModel``)."""
    model = hf_model(hf_config)
    check_tp(model, tp)
    parts = param_breakdown(model.spec, tp)
    total = parts["total"] - (0 if head else parts["lm_head"])
    if model.kind == "bert":
        total += _bert_extras(model, tp, head)
    return total
