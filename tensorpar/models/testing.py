"""Small random Hugging Face models and checkpoints of any architecture, built offline from configs.

``make_tiny_config(arch)`` takes the transformers configuration class of ``arch`` (a
``model_type``: ``"llama"``, ``"mixtral"``, ``"phi3"``, ...) and shrinks every size field it has
to a few dozen units: hidden 64, 4 query heads over 2 KV heads of 16, ffn 128, 2 layers,
vocabulary 130 (which tp 3 and 4 do not divide: the padding path), 4 experts of width 32 where
the model has experts, dropout off. :data:`ARCH_SIZES` holds what an architecture needs on top
(its own field names, or sizes its validators insist on). The five families of the first phase
keep their own sizes (:data:`_TINY`), which the older tests count parameters from.

Used by the tests (tiny float64 models) and the benchmark (``BENCH_LLAMA``, about 25M
parameters). Dropout is off, so the dense and sharded models compute the same function in
training too. The same ``seed`` gives the same weights on every rank.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

# The first phase's families, with the sizes their tests count parameters from.
_TINY = {
    "llama": dict(vocab_size=130, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False),
    "mistral": dict(vocab_size=130, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                    sliding_window=None, tie_word_embeddings=False),
    "qwen2": dict(vocab_size=130, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=12, num_key_value_heads=1, max_position_embeddings=64,
                  tie_word_embeddings=True),
    "gpt2": dict(vocab_size=130, n_embd=48, n_layer=2, n_head=12, n_positions=64,
                 bos_token_id=0, eos_token_id=1),
    "bert": dict(vocab_size=130, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=12, max_position_embeddings=64, pad_token_id=0),
}

# Every other architecture: each field its configuration class has takes this value.
GENERIC_SIZES = dict(
    vocab_size=130, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
    # GPT-2 style names
    n_embd=64, n_layer=2, n_head=4, n_positions=128, n_inner=128, n_ctx=128,
    # other names of the same sizes
    d_model=64, ffn_dim=128, num_layers=2, num_heads=4, n_heads=4, n_layers=2,
    decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128,
    encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
    embedding_size=64, ffn_hidden_size=128, kv_channels=16, num_query_groups=2,
    attention_head_dim=16, attention_hidden_size=64, dim_head=16, dim_ff=128, num_kv_heads=2, dff=128,
    # mixture of experts
    moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
    moe_num_experts=4, num_experts_per_tok=2, moe_topk=2, num_experts_per_token=2, moe_k=2,
    shared_expert_intermediate_size=32, n_shared_experts=1, num_shared_experts=1,
    moe_num_shared_experts=1, shared_intermediate_size=32, moe_shared_expert_intermediate_size=32,
    n_group=1, topk_group=1, num_expert_group=1,
    # multi-head latent attention
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    # windows and rotary
    sliding_window=8, attention_chunk_size=8, sliding_window_size=8, window_size=8, rotary_dim=8,
    # linear attention and state-space mixers (left whole, but they must build)
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_n_heads=4,
    mamba_d_head=32, mamba_chunk_size=16, mamba_n_groups=1, mamba_headdim=32, mamba_num_heads=4,
    mamba_head_dim=32, ssm_state_size=8, state_size=8, time_step_rank=8, expand=2, conv_kernel=4,
    chunk_size=16, index_n_heads=2, index_head_dim=16, index_topk=4,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
    # per-layer and auxiliary embeddings (Gemma-4, RoCBert, XLM)
    vocab_size_per_layer_input=130, hidden_size_per_layer_input=16, emb_dim=64,
    pronunciation_vocab_size=32, pronunciation_embed_dim=16, shape_vocab_size=32, shape_embed_dim=16,
)

# Widths and head counts, scaled together so that every tp size splits them (head_dim stays 16).
_SCALED = ("hidden_size", "intermediate_size", "num_attention_heads", "n_embd", "n_head", "n_inner",
           "d_model", "ffn_dim", "num_heads", "n_heads", "decoder_attention_heads", "decoder_ffn_dim",
           "encoder_attention_heads", "encoder_ffn_dim", "embedding_size", "ffn_hidden_size",
           "attention_hidden_size", "dim_ff", "dff", "moe_intermediate_size", "shared_expert_intermediate_size",
           "shared_intermediate_size", "moe_shared_expert_intermediate_size", "swa_num_attention_heads",
           "emb_dim")


def sizes_for(tp: int = 1) -> dict:
    """:data:`GENERIC_SIZES` with widths and head counts scaled so that ``tp`` divides them
    (x3 for tp 3, x2 for tp 8, ...): the sizes of a tiny model that tp ranks can split."""
    factor = tp // math.gcd(tp, 4)
    return {k: v * factor if k in _SCALED else v for k, v in GENERIC_SIZES.items()}


# What an architecture needs besides GENERIC_SIZES (sizes its validators insist on, or fields
# whose generic value does not fit it).
OMIT = object()  # in ARCH_SIZES: do not pass this field, leave the config's own rule to set it
_MLA = dict(num_key_value_heads=4, head_dim=OMIT)
ARCH_SIZES = {
    "deepseek_v2": _MLA, "deepseek_v3": _MLA, "deepseek_v32": _MLA, "glm4_moe_lite": _MLA,
    "glm_moe_dsa": _MLA, "minicpm3": _MLA, "longcat_flash": _MLA, "sarvam_mla": _MLA,
    "axk1": _MLA, "axk2": _MLA, "youtu": _MLA,
    # its delta-attention layers default to 32 heads of 128 (reference kernel: ~1 s a pass)
    "kimi_linear": dict(_MLA, linear_num_heads=4, linear_head_dim=16),
    # experts switched on (the full-size default has none)
    # the query-sparse indexer its indexed-attention layers need
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=2),
    "doge": dict(is_moe=True), "gemma4_text": dict(enable_moe_block=True, num_experts=4, top_k_experts=2,
                                                   moe_intermediate_size=32),
}

_DROPOUT_WORDS = ("dropout", "pdrop", "drop_rate")
_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
           "sep_token_id": 2}

# The benchmark's Llama-style model: 25.9M parameters (6 layers, hidden 512, GQA 8/4 heads).
BENCH_LLAMA = dict(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                   tie_word_embeddings=False)


def config_class(arch: str):
    """The transformers configuration class of ``model_type`` ``arch``; ValueError if unknown."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    import transformers
    if arch not in CONFIG_MAPPING_NAMES:
        raise ValueError(f"model type {arch!r} is not known to transformers {transformers.__version__}")
    return getattr(transformers, CONFIG_MAPPING_NAMES[arch])


def _fields(cls) -> dict:
    return {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}


def _default(field):
    if field.default is not dataclasses.MISSING:
        return field.default
    return None


def _no_dropout(fields: dict) -> dict:
    return {name: 0.0 for name, f in fields.items()
            if any(w in name for w in _DROPOUT_WORDS) and isinstance(_default(f), float)}


def _layout(cls, layout_of) -> dict:
    """:func:`~tensorpar.models.layout.layer_layout` of ``layout_of``, else of the class's defaults."""
    from tensorpar.models.layout import layer_layout
    if layout_of is None:
        try:
            layout_of = cls()
        except Exception:  # noqa: BLE001 - a class without defaults for every field: its own rule
            return {}
    return layer_layout(layout_of)


def make_tiny_config(arch: str, *, tp: int = 1, layout_of=None, **sizes):
    """A transformers config of ``arch`` with tiny sizes (split by ``tp`` ranks, see
    :func:`sizes_for`), dropout off, overridden by ``sizes``; as many layers as it takes to hold
    every kind of layer (attention, dense or expert MLP) that ``layout_of`` (default: the
    architecture's full-size configuration) has."""
    cls = config_class(arch)
    if arch in _TINY:
        fields = _fields(cls)
        return cls(**{**_TINY[arch], **_no_dropout(fields), **sizes})
    fields = _fields(cls)
    kw = {k: v for k, v in sizes_for(tp).items() if k in fields}
    kw.update({k: v for k, v in _TOKENS.items() if k in fields})
    kw.update(_no_dropout(fields))
    if "layer_types" in fields:
        kw["layer_types"] = None  # rebuilt from num_hidden_layers by the config itself
    kw.update({k: v for k, v in _layout(cls, layout_of).items() if k in fields})
    kw.update(ARCH_SIZES.get(arch, {}))
    kw.update(sizes)
    return cls(**{k: v for k, v in kw.items() if v is not OMIT})


def model_class(config, head: bool = True):
    """The causal-LM class of ``config`` (``head``; the masked-LM class of an encoder), else the bare model."""
    import transformers
    from transformers.models.auto import modeling_auto as auto
    kind = config.model_type
    if head:
        for mapping in (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES):
            if kind in mapping:
                return getattr(transformers, mapping[kind])
    return getattr(transformers, auto.MODEL_MAPPING_NAMES[kind])


def make_tiny_model(arch: str, *, seed: int = 0, dtype=torch.float64, head: bool = True, **sizes):
    """A random model from :func:`make_tiny_config` (``head``: the LM head class), in eval mode.

    Mixture-of-experts layers run transformers' eager experts loop, which takes float64 (its
    grouped-matmul kernel does not)."""
    config = make_tiny_config(arch, **sizes)
    torch.manual_seed(seed)
    from tensorpar.sharding.resolve import eager_experts
    return eager_experts(model_class(config, head)(config).to(dtype).eval())


def make_tiny_checkpoint(directory, arch: str = "llama", *, seed: int = 0,
                         dtype=torch.float32, head: bool = True, max_shard_size=None, **sizes) -> Path:
    """Save a random :func:`make_tiny_model` as a safetensors checkpoint in ``directory``.

    ``max_shard_size`` (e.g. ``"20KB"``): split the weights over several files with a
    ``model.safetensors.index.json``, as large checkpoints are. ``make_tiny_checkpoint(d,
    "llama", **BENCH_LLAMA)`` writes the benchmark's ~25M model.
    """
    from transformers.utils import logging as hf_logging
    model = make_tiny_model(arch, seed=seed, dtype=dtype, head=head, **sizes)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # library code does not print
    try:
        extra = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(path, safe_serialization=True, **extra)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return path
