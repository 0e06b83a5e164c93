"""Tiny models of any architecture, and the benchmark's model recipes. Standard library only.

A tiny model (``tensorpar.models.tiny``) takes its configuration class and gives every size field
it has the value here (:data:`GENERIC_SIZES`): hidden 64, 4 query heads over 2 KV heads of 16,
ffn 128, 2 layers, vocabulary 130 (which tp 3 and 4 do not divide: the padding path), 4 experts
of width 32 where the model has experts, dropout off; :func:`sizes_for` scales the widths and
head counts so that a given tp splits them. An architecture's registry entry adds what it needs
on top (``Arch.tiny``: its own field names, or sizes its validators insist on); the five
families of the first phase give every size themselves (``Arch.tiny_only``), which the older
tests count parameters from.

A model on the meta device is proved through a *replica* of its configuration at these sizes
(``tensorpar.sharding.replica``); :func:`replica_kv_heads` keeps the replica's KV heads in the
model's relation to tp.
"""
from __future__ import annotations

import math

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

OMIT = object()  # in an ``Arch.tiny``: do not pass this field, leave the config's own rule to set it
DROPOUT_WORDS = ("dropout", "pdrop", "drop_rate")  # float fields whose names hold these are set to 0
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1, "sep_token_id": 2}
REPLICA_SEED = 1234  # every rank draws a replica's weights from this seed: its proof's collectives line up


def sizes_for(tp: int = 1) -> dict:
    """:data:`GENERIC_SIZES` with widths and head counts scaled so that ``tp`` divides them
    (x3 for tp 3, x2 for tp 8, ...): the sizes of a tiny model that tp ranks can split."""
    factor = tp // math.gcd(tp, 4)
    return {k: v * factor if k in _SCALED else v for k, v in GENERIC_SIZES.items()}


def replica_kv_heads(n_heads: int, n_kv: int | None, tiny_heads: int, tp: int) -> int | None:
    """A replica's KV heads in the model's relation to tp: MHA stays MHA, MQA stays MQA, KV heads
    that tp divides stay divisible, KV heads fewer than tp stay replicated (None: the tiny
    config's own)."""
    if n_kv is None or n_kv == n_heads:
        return tiny_heads
    if n_kv == 1:
        return 1
    if n_kv % tp == 0:
        return tp
    return n_kv if tp % n_kv == 0 and tiny_heads % n_kv == 0 else None


# ---- the benchmark's models (``tensorpar bench``, ``make bench``) ------------------------------------

# The Llama-style model: 25.9M parameters (6 layers, hidden 512, GQA 8/4 heads).
BENCH_LLAMA = dict(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                   tie_word_embeddings=False)
# ~25.5M parameters: 4 layers of GQA attention (8/4 heads of 64) and 8 experts of width 288,
# top-2 (expert weights 17.7M; 3.5M active per token); vocabulary 8000.
BENCH_MIXTRAL = dict(vocab_size=8000, hidden_size=512, intermediate_size=288, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_local_experts=8,
                     num_experts_per_tok=2, max_position_embeddings=512, sliding_window=None,
                     tie_word_embeddings=False)
# 25.9M parameters: BENCH_LLAMA's sizes (6 layers, hidden 512, GQA 8/4 heads, ffn 1408) with fused
# qkv_proj (512 -> 1024) and gate_up_proj (512 -> 2816).
BENCH_PHI3 = dict(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                  sliding_window=None, tie_word_embeddings=False)
