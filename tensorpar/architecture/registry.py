"""Architecture facts in one place: what tensorpar knows about each ``model_type``.

Every consumer reads this module: ``parallelize`` (the plan to apply and how attention modules
hold their head counts), ``load_sharded`` and the jobs (which models are supported), the tiny
models and the proof's replicas (their sizes), the lean decode path (which types it takes), and
the planner (through the inventory ``tensorpar.sharding.inventory`` builds from the same resolved
plan). Plain data, standard library only.

How a plan is chosen for a model (``tensorpar.sharding.resolve``):

1. the architecture's :class:`Arch` entry here has a ``plan``: that plan (architectures whose
   transformers config declares none: GPT-2, BERT, OPT, BLOOM, MPT, GPT-BigCode, StableLM,
   Persimmon, Falcon, ...);
2. otherwise the model's own declared plan (``model.tp_plan``: transformers'
   ``base_model_tp_plan``), translated style by style (``tensorpar.sharding.declared``), with the
   entry's ``overrides`` where tensorpar splits better than the declaration (Phi-3's fused
   ``qkv_proj`` split per head and segment instead of gathered);
3. otherwise column -> row pairs found and checked numerically (``tensorpar.sharding.discover``).

Adding an architecture is one :class:`Arch` entry, or nothing when the model declares its plan
and its tiny model builds from the generic sizes (``tensorpar.architecture.tiny_sizes``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tensorpar.architecture.plans import Unit, plan_of_units
from tensorpar.architecture.tiny_sizes import OMIT

# Attributes an attention module may hold its head counts in, and what each one counts. A
# module's attributes of these names are set to their per-rank values when its heads are split.
HEAD_ATTRS = {
    "num_heads": "q", "num_attention_heads": "q", "n_heads": "q", "n_head": "q", "num_q_heads": "q",
    "num_key_value_heads": "kv", "num_kv_heads": "kv", "n_kv_heads": "kv", "kv_n_heads": "kv",
    "num_key_value_groups": "groups", "num_queries_per_kv": "groups",
}
# Width attributes (query heads x head dim), set only where an entry names them: on some modules
# a name like ``hidden_size`` means the model width instead.
WIDTH_ATTRS = ("all_head_size", "split_size", "embed_dim", "hidden_size", "inner_dim", "kv_dim")
KV_WIDTH_ATTRS = ("kv_dim",)  # KV heads x head dim


@dataclass(frozen=True)
class Formulas:
    """How the planner's closed forms count a model type from its ``config.json`` alone, torch-free
    (``tensorpar.planner.hfconfig`` reads the sizes, ``tensorpar.architecture.templates`` splits
    them, ``tensorpar.planner.hf`` counts parameters and collectives): every other type is planned
    from its split meta-device model (``tensorpar.sharding.inventory``).

    - ``family``: ``"llama"`` (RMSNorm, gated MLP, rotary), ``"gpt"`` (LayerNorm, GELU MLP, learned
      positions, biases everywhere) or ``"bert"`` (a gpt layer with BERT's replicated extras: an
      encoder, counted by ``tensorpar.planner.hf`` only);
    - ``model_class``: the transformers class the forms describe (``*ForCausalLM``);
    - ``refuse``: config options that add parameters or collectives the forms do not count
      (refused, never guessed); options the type's code ignores are not listed;
    - ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3's per-head q/k RMSNorms), ``multi_query`` (one KV
      head unless the config's ``multi_query`` is false: GPT-BigCode);
    - ``window``: ``"every"`` (every layer windowed by ``sliding_window``: Mistral), ``"optional"``
      (only with ``use_sliding_window``, in the layers ``layer_types`` or ``max_window_layers``
      say: Qwen2, Qwen3), or None.
    """
    family: str
    model_class: str
    refuse: tuple = ()
    qkv_bias: bool = False
    qk_norm: bool = False
    multi_query: bool = False
    window: str | None = None


@dataclass(frozen=True)
class Arch:
    """What tensorpar knows about one architecture (a transformers ``model_type``).

    - ``plan``: tensorpar's own plan (pattern -> style), or None to use the model's declaration;
      a function of the config where the layout depends on it (Falcon's fused qkv).
    - ``overrides``: pattern -> style replacing or adding to the declared plan; a fused style's
      segments in ``segments`` (pattern -> ``("q", "kv", "kv")``: widths in query heads, KV heads
      or the ffn width).
    - ``head_attrs``: extra width attributes of the attention module (see :data:`WIDTH_ATTRS`).
    - ``head_config``: config fields the attention module reads its head counts from; it gets a
      copy of the config with the per-rank values.
    - ``head_inputs``: keyword inputs of the attention module that carry one slice per head
      (ALiBi biases), with their layout: ``"batch*heads"`` (``(B * n_heads, ...)``) or
      ``"heads"`` (``(n_heads, ...)``).
    - ``linear_classes``: ``nn.Linear`` subclasses whose forward computes exactly ``x W^T + b``.
    - ``config_names``: the config field of a size where it is none of
      :data:`tensorpar.architecture.configs.NAMES`.
    - ``units``: family blocks a user plan must split whole (``tensorpar.sharding.check``).
    - ``whole``: module-name pattern -> why it stays whole (reported, never approximated): what the
      proof finds inexact for this architecture, recorded so that the plan, the planner's prediction
      and the checkpoint loader agree before any proof runs.
    - ``no_sync``: replicated parameters inside a region whose gradient is whole on every rank
      already (they act after the region's reduction): not all-reduced.
    - ``tiny``: what its tiny model needs besides the generic sizes of
      :mod:`tensorpar.architecture.tiny_sizes` (sizes its validators insist on, fields whose generic
      value does not fit it; :data:`~tensorpar.architecture.tiny_sizes.OMIT`: leave the field to the
      config's own rule); with ``tiny_only``, every size of its tiny model, the generic ones unused.
    - ``lean``: the prefix of its transformers classes (``"Llama"``) where the lean decode path
      (``tensorpar.models.lean``) takes it, else None.
    - ``formulas``: :class:`Formulas` where the planner's closed forms count it, else None.
    """
    name: str
    plan: dict | None = None
    overrides: dict = field(default_factory=dict)
    segments: dict = field(default_factory=dict)
    head_attrs: tuple = ()
    head_config: tuple = ()
    head_inputs: dict = field(default_factory=dict)
    linear_classes: tuple = ()
    config_names: dict = field(default_factory=dict)
    units: tuple = ()
    whole: dict = field(default_factory=dict)
    no_sync: tuple = ()
    notes: tuple = ()
    tiny: dict = field(default_factory=dict)
    tiny_only: bool = False
    lean: str | None = None
    formulas: Formulas | None = None



# ---- tensorpar's own plans, for architectures that declare none -------------------------------

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

_LLAMA = plan_of_units({"embed_tokens": "vocab"}, _DECODER_UNITS, {"lm_head": "vocab_head"})
_GPT2 = plan_of_units({"wte": "vocab"}, _GPT2_UNITS, {"lm_head": "vocab_head"})
_BERT = plan_of_units({"embeddings.word_embeddings": "vocab"}, _BERT_UNITS,
                    {"cls.predictions.decoder": "vocab_head", "lm_head.decoder": "vocab_head",
                     "generator_lm_head": "vocab_head"})
# Encoders of BERT's layout under other names (used as decoders by their *ForCausalLM classes).
_BERT_LIKE = ("roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "electra", "ernie",
              "megatron-bert", "rembert", "roc_bert", "roformer", "big_bird", "bert-generation", "xmod",
              "roberta-prelayernorm")


def _attention(prefix: str, q: str, k: str, v: str, o: str, kv_style: str = "colwise_kv") -> dict:
    return {prefix: "attention", f"{prefix}.{q}": "colwise", f"{prefix}.{k}": kv_style,
            f"{prefix}.{v}": kv_style, f"{prefix}.{o}": "rowwise"}


def _pair(col: str, row: str, region: str | None = None) -> dict:
    return {**({region: "mlp"} if region else {}), col: "colwise", row: "rowwise"}


# Decoders of encoder-decoder models used as causal LMs (BartForCausalLM and its kin): the MLP
# is fc1 -> fc2 directly in the layer; the cross-attention ("encoder_attn", used when encoder
# states are given) splits by heads like the self-attention, its keys and values taking the
# encoder states into the region.
_BART_DECODER = {"decoder.embed_tokens": "vocab",
                 **_attention("decoder.layers.*.self_attn", "q_proj", "k_proj", "v_proj", "out_proj", "colwise"),
                 **_attention("decoder.layers.*.encoder_attn", "q_proj", "k_proj", "v_proj", "out_proj", "colwise"),
                 **_pair("decoder.layers.*.fc1", "decoder.layers.*.fc2"), "lm_head": "vocab_head",
                 "output_projection": "vocab_head", "proj_out": "vocab_head"}
_RESHAPES_BY_INPUT = "its forward reshapes the attention output by the input's width (the proof's split raised)"
_OPT = {"decoder.embed_tokens": "vocab",
        **_attention("decoder.layers.*.self_attn", "q_proj", "k_proj", "v_proj", "out_proj", "colwise"),
        **_pair("decoder.layers.*.fc1", "decoder.layers.*.fc2"), "lm_head": "vocab_head"}
_FAIRSEQ = {"embed_tokens": "vocab",  # BioGPT, XGLM: the same layer as BART's decoder, no cross-attention
            **_attention("layers.*.self_attn", "q_proj", "k_proj", "v_proj", "out_proj", "colwise"),
            **_pair("layers.*.fc1", "layers.*.fc2"), "lm_head": "vocab_head", "output_projection": "vocab_head"}
_NEOX_STYLE = {  # per-head interleaved fused qkv: a contiguous split keeps whole heads together
    "h.*.self_attention": "attention", "h.*.self_attention.query_key_value": "colwise",
    "h.*.self_attention.dense": "rowwise", **_pair("h.*.mlp.dense_h_to_4h", "h.*.mlp.dense_4h_to_h", "h.*.mlp"),
}

def _falcon(config) -> tuple[dict, dict]:
    """Falcon's fused qkv: multi-query (one KV head) is ``[q heads | k | v]``, split per segment
    with the KV head replicated; the other layouts keep each head (or each KV group) contiguous."""
    plan = {"word_embeddings": "vocab", **_NEOX_STYLE, "lm_head": "vocab_head"}
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        qkv = "h.*.self_attention.query_key_value"
        return {**plan, qkv: "fused_colwise"}, {qkv: ("q", "kv", "kv")}
    return plan, {}


def _bigcode(config) -> tuple[dict, dict]:
    """GPT-BigCode's c_attn: multi-query is ``[q | k | v]`` (one KV head, replicated), else each
    head's q, k, v side by side (a contiguous split keeps heads whole)."""
    plan = {"wte": "vocab", "h.*.attn": "attention", "h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise",
            **_pair("h.*.mlp.c_fc", "h.*.mlp.c_proj", "h.*.mlp"), "lm_head": "vocab_head"}
    if getattr(config, "multi_query", True):
        return {**plan, "h.*.attn.c_attn": "fused_colwise"}, {"h.*.attn.c_attn": ("q", "kv", "kv")}
    return plan, {}


def _llama_layers(attention="self_attn", mlp="mlp", o="o_proj", gate="gate_proj", up="up_proj",
                  down="down_proj") -> dict:
    """The attention and MLP splits of a Llama-style layer (regions derived from the row splits)."""
    a, m = f"layers.*.{attention}", f"layers.*.{mlp}"
    return {f"{a}.q_proj": "colwise", f"{a}.k_proj": "colwise", f"{a}.v_proj": "colwise", f"{a}.{o}": "rowwise",
            f"{m}.{gate}": "colwise", f"{m}.{up}": "colwise", f"{m}.{down}": "rowwise"}


# OLMo-2 and its kin normalise q and k over all heads at once; their declarations gather q, k and v
# and run attention on every head on every rank. Split by heads instead, the norms' statistic
# summed over the ranks (ShardedRMSNorm): attention runs sharded.
_QK_NORM_SHARDED = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
                    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
                    "layers.*.self_attn.q_norm": "norm_sharded", "layers.*.self_attn.k_norm": "norm_sharded"}


_MLA = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.q_b_proj": "colwise",
        "layers.*.self_attn.kv_b_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}


# Tiny sizes of multi-head latent attention: 4 KV heads (the latent's), head_dim derived by the config.
_MLA_TINY = dict(num_key_value_heads=4, head_dim=OMIT)

ARCHS: dict[str, Arch] = {a.name: a for a in (
    # The first phase's families keep the sizes their tests count parameters from.
    Arch("llama", units=_DECODER_UNITS, lean="Llama", tiny_only=True,
         formulas=Formulas("llama", "LlamaForCausalLM", refuse=("attention_bias", "mlp_bias")), tiny=dict(
        vocab_size=130, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)),
    Arch("mistral", units=_DECODER_UNITS, lean="Mistral", tiny_only=True,
         formulas=Formulas("llama", "MistralForCausalLM", window="every"), tiny=dict(
        vocab_size=130, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=64, sliding_window=None, tie_word_embeddings=False)),
    Arch("qwen2", units=_DECODER_UNITS, lean="Qwen2", tiny_only=True,
         formulas=Formulas("llama", "Qwen2ForCausalLM", qkv_bias=True, window="optional"), tiny=dict(
        vocab_size=130, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=12,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True)),
    # Qwen3 runs from its declared plan; the entry says how the closed forms count it.
    Arch("qwen3", formulas=Formulas("llama", "Qwen3ForCausalLM", refuse=("attention_bias",), qk_norm=True,
                                    window="optional")),
    Arch("gpt2", _GPT2, head_attrs=("split_size",), units=_GPT2_UNITS, tiny_only=True,
         formulas=Formulas("gpt", "GPT2LMHeadModel", refuse=("add_cross_attention",)), tiny=dict(
        vocab_size=130, n_embd=48, n_layer=2, n_head=12, n_positions=64, bos_token_id=0, eos_token_id=1)),
    Arch("bert", _BERT, head_attrs=("all_head_size",), units=_BERT_UNITS, tiny_only=True,
         formulas=Formulas("bert", "BertForMaskedLM", refuse=("add_cross_attention",)), tiny=dict(
        vocab_size=130, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=12,
        max_position_embeddings=64, pad_token_id=0)),
    *(Arch(name, _BERT, head_attrs=("all_head_size",), units=_BERT_UNITS) for name in _BERT_LIKE),
    Arch("opt", _OPT),
    Arch("bart", _BART_DECODER), Arch("mbart", _BART_DECODER), Arch("marian", _BART_DECODER),
    Arch("pegasus", _BART_DECODER), Arch("plbart", _BART_DECODER), Arch("blenderbot", _BART_DECODER),
    Arch("blenderbot-small", _BART_DECODER), Arch("bigbird_pegasus", _BART_DECODER),
    Arch("whisper", _BART_DECODER),
    # TrOCR's and MVP's attention reshape their output by the width of their input (the model's):
    # split by heads, the reshape fails; what the proof finds, recorded here.
    *(Arch(name, _BART_DECODER, whole={"decoder.layers.*.self_attn": _RESHAPES_BY_INPUT,
                                       "decoder.layers.*.encoder_attn": _RESHAPES_BY_INPUT})
      for name in ("trocr", "mvp")),
    Arch("openai-gpt", {**_GPT2, "tokens_embed": "vocab"}, head_attrs=("split_size",)),
    Arch("biogpt", _FAIRSEQ), Arch("xglm", _FAIRSEQ),
    Arch("bloom", {"word_embeddings": "vocab", **_NEOX_STYLE, "lm_head": "vocab_head"},
         head_inputs={"alibi": "batch*heads"}),
    Arch("falcon", lambda c: _falcon(c)[0], segments=lambda c: _falcon(c)[1],
         linear_classes=("FalconLinear",), head_inputs={"alibi": "batch*heads"}),
    Arch("persimmon", {"embed_tokens": "vocab", "layers.*.self_attn": "attention",
                       "layers.*.self_attn.query_key_value": "colwise", "layers.*.self_attn.dense": "rowwise",
                       **_pair("layers.*.mlp.dense_h_to_4h", "layers.*.mlp.dense_4h_to_h", "layers.*.mlp"),
                       "lm_head": "vocab_head"}),
    Arch("stablelm", _LLAMA),
    Arch("mpt", {"wte": "vocab", "blocks.*.attn": "attention", "blocks.*.attn.Wqkv": "fused_colwise",
                 "blocks.*.attn.out_proj": "rowwise",
                 **_pair("blocks.*.ffn.up_proj", "blocks.*.ffn.down_proj", "blocks.*.ffn"), "lm_head": "vocab_head"},
         segments={"blocks.*.attn.Wqkv": ("q", "q", "q")}, head_inputs={"position_bias": "heads"},
         head_attrs=("hidden_size",)),
    Arch("gpt_bigcode", lambda c: _bigcode(c)[0], segments=lambda c: _bigcode(c)[1],
         head_attrs=("embed_dim", "kv_dim", "split_size"),
         formulas=Formulas("gpt", "GPTBigCodeForCausalLM", refuse=("add_cross_attention",), multi_query=True)),
    # Declarations that name the embedding only: the layers split as Llama's.
    Arch("hunyuan_v1_dense", overrides=_llama_layers()),
    Arch("lfm2", overrides=_llama_layers(o="out_proj", mlp="feed_forward", gate="w1", up="w3", down="w2")),
    # LFM-3's attention gates each head's output by a sigmoid of its own projection (hidden -> heads)
    Arch("lfm3", overrides={**_llama_layers(mlp="feed_forward", gate="w1", up="w3", down="w2"),
                            "layers.*.self_attn.g_proj": "colwise"}),
    # GPT-OSS declares the embedding only: attention by heads with the per-head sinks split alike,
    # experts (interleaved gate/up, stored transposed) along their width, the down bias added once.
    Arch("gpt_oss", overrides={**{k: v for k, v in _llama_layers().items() if ".mlp." not in k},
                               "layers.*.self_attn.sinks": "param_heads", "layers.*.mlp": "moe",
                               "layers.*.mlp.experts.gate_up_proj": "param_packed_rowwise",
                               "layers.*.mlp.experts.gate_up_proj_bias": "param_packed_colwise",
                               "layers.*.mlp.experts.down_proj": "param_colwise",
                               "layers.*.mlp.experts.down_proj_bias": "param_rank0"}),
    *(Arch(name, overrides=_QK_NORM_SHARDED) for name in ("olmo2", "olmo3", "olmo_hybrid", "flex_olmo",
                                                           "minimax_m2", "olmoe")),
    # MiniMax-M3 normalises q and k per head (replicated, gradient synchronised): split by heads.
    Arch("minimax_m3_vl_text", overrides={k: v for k, v in _QK_NORM_SHARDED.items() if "norm" not in k}),
    # BitNet normalises the attention output over all heads and the MLP's inner activation over
    # the whole width, between the column and the row splits: both norms split with them.
    Arch("bitnet", overrides={**_llama_layers(), "layers.*.self_attn.attn_sub_norm": "norm_sharded",
                              "layers.*.mlp.ffn_sub_norm": "norm_sharded"}),
    # DiffLlama pairs head i with head i + n/2 (and splits V in halves): q, k and v split each half
    # on its own so that every rank holds whole pairs; o_proj takes the pairs in order.
    Arch("diffllama", overrides={**_llama_layers(), **{f"layers.*.self_attn.{n}_proj": "fused_colwise"
                                                       for n in ("q", "k", "v")}},
         segments={"layers.*.self_attn.q_proj": ("q/2", "q/2"), "layers.*.self_attn.k_proj": ("kv/2", "kv/2"),
                   "layers.*.self_attn.v_proj": ("kv/2", "kv/2")}),
    # Dory (nGPT-style) scales the split activations by replicated per-feature vectors; the proof
    # finds its attention and MLP inexact split, and they stay whole.
    Arch("dory", overrides=_llama_layers(), whole={
        "layers.*.self_attn": "a replicated per-feature scale multiplies the split heads (the proof's split raised)",
        "layers.*.mlp": "a replicated per-feature scale multiplies the split width (the proof's split raised)"}),
    # Doge's dt_proj maps the values of every KV head to each head's gate: no split of the heads
    # keeps it local. Its tiny model has its experts switched on (the full-size default has none).
    Arch("doge", whole={"layers.*.self_attn": "dt_proj mixes the values of every KV head (the proof's split raised)"},
         tiny=dict(is_moe=True)),
    # AXK-1 normalises its MoE output inside the block (post_mlp_layernorm): the experts reduce
    # where they are made, and the norm's gradient, whole on every rank, needs no sync.
    Arch("axk1", overrides={"layers.*.mlp": "moe_split"}, no_sync=("layers.*.mlp.post_mlp_layernorm.weight",),
         tiny=_MLA_TINY),
    # Multi-head latent attention the declaration does not name: the low-rank q_a / kv_a projections
    # stay whole (their gradients synchronised), q_b / kv_b split by heads, o_proj by rows.
    *(Arch(name, overrides=_MLA, tiny=_MLA_TINY) for name in ("deepseek_v3", "youtu", "sarvam_mla")),
    # Kimi-Linear's linear-attention layers (also ``self_attn``) run short convolutions over their
    # projections' channels, which no style splits yet: the attention stays whole. Its tiny model's
    # delta-attention layers would default to 32 heads of 128 (reference kernel: ~1 s a pass).
    Arch("kimi_linear", overrides=_MLA, whole={
        "layers.*.self_attn": "its linear-attention layers convolve the projections' channels (the proof's split raised)"},
         tiny=dict(_MLA_TINY, linear_num_heads=4, linear_head_dim=16)),
    # Declared plans whose tiny models need sizes of their own: multi-head latent attention,
    # the query-sparse indexer of Qwen4's indexed-attention layers, Gemma-4's experts switched on.
    *(Arch(name, tiny=_MLA_TINY) for name in ("deepseek_v2", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa",
                                              "minicpm3", "longcat_flash", "axk2")),
    Arch("qwen4_exp_text", tiny=dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                                     indexer_compress_ratio=2)),
    Arch("gemma4_text", tiny=dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)),
    Arch("modernbert-decoder", overrides={"layers.*.attn.q_proj": "colwise", "layers.*.attn.k_proj": "colwise",
                                          "layers.*.attn.v_proj": "colwise", "layers.*.attn.Wo": "rowwise",
                                          "layers.*.mlp.Wi": "fused_colwise", "layers.*.mlp.Wo": "rowwise"},
         segments={"layers.*.mlp.Wi": ("ffn", "ffn")}),
    Arch("gpt_neox_japanese", {"embed_in": "vocab", "layers.*.attention": "attention",
                               "layers.*.attention.query_key_value": "colwise", "layers.*.attention.dense": "rowwise",
                               **_pair("layers.*.mlp.dense_h_to_4h", "layers.*.mlp.dense_4h_to_h", "layers.*.mlp"),
                               "embed_out": "vocab_head"},
         # its attention adds dense_bias after the reduction: whole on every rank, never synced
         no_sync=("layers.*.attention.dense_bias",)),
    # Phi-3 declares qkv_proj and gate_up_proj gathered (every rank then computes every head);
    # split per segment, attention runs on this rank's heads.
    Arch("phi3", overrides={"layers.*.self_attn": "attention", "layers.*.self_attn.qkv_proj": "fused_colwise",
                            "layers.*.self_attn.o_proj": "rowwise", "layers.*.mlp": "mlp",
                            "layers.*.mlp.gate_up_proj": "fused_colwise", "layers.*.mlp.down_proj": "rowwise"},
         segments={"layers.*.self_attn.qkv_proj": ("q", "kv", "kv"), "layers.*.mlp.gate_up_proj": ("ffn", "ffn")},
         head_config=("num_attention_heads", "num_key_value_heads")),
)}


def arch(model_type: str | None) -> Arch | None:
    return ARCHS.get(model_type) if model_type else None


FAMILIES = tuple(ARCHS)  # the architectures with an entry here (more run from their declared plan)
LEAN_TYPES = tuple(name for name, a in ARCHS.items() if a.lean)  # those the lean decode path takes


def formula_types(*families: str) -> tuple:
    """The model types the planner's closed forms count, of the given :class:`Formulas` families."""
    return tuple(name for name, a in ARCHS.items() if a.formulas and a.formulas.family in families)


def linear_equivalents() -> frozenset:
    """Names of ``nn.Linear`` subclasses, across all entries, whose forward is ``x W^T + b``."""
    return frozenset(c for a in ARCHS.values() for c in a.linear_classes)
