"""Small random Hugging Face models and checkpoints, built offline from configs.

Used by the tests (tiny float64 models) and the benchmark (``BENCH_LLAMA``, about 25M
parameters). Dropout is off, so the dense and sharded models compute the same function in
training too. The same ``seed`` gives the same weights on every rank.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tensorpar.models.plans import FAMILIES

_NO_DROPOUT = {
    "llama": {"attention_dropout": 0.0},
    "mistral": {"attention_dropout": 0.0},
    "qwen2": {"attention_dropout": 0.0},
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
}

# Tiny defaults: vocab 130 does not divide by 3 or 4 (padding), heads chosen so that tp 1, 2, 4
# work everywhere and tp 3 where the heads allow; mistral and llama are GQA, qwen2 is MQA.
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

# The benchmark's Llama-style model: 25.9M parameters (6 layers, hidden 512, GQA 8/4 heads).
BENCH_LLAMA = dict(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                   tie_word_embeddings=False)

_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM", "LlamaModel"),
            "mistral": ("MistralConfig", "MistralForCausalLM", "MistralModel"),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "Qwen2Model"),
            "gpt2": ("GPT2Config", "GPT2LMHeadModel", "GPT2Model"),
            "bert": ("BertConfig", "BertForMaskedLM", "BertModel")}


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not supported; valid: {', '.join(FAMILIES)}")


def make_tiny_config(family: str, **sizes):
    """A transformers config of ``family`` with the tiny defaults, overridden by ``sizes``."""
    _check_family(family)
    import transformers
    cls = getattr(transformers, _CLASSES[family][0])
    return cls(**{**_TINY[family], **_NO_DROPOUT[family], **sizes})


def make_tiny_model(family: str, *, seed: int = 0, dtype=torch.float64, head: bool = True, **sizes):
    """A random model from :func:`make_tiny_config` (``head``: the LM / MLM head class)."""
    import transformers
    config = make_tiny_config(family, **sizes)
    cls = getattr(transformers, _CLASSES[family][1 if head else 2])
    torch.manual_seed(seed)
    return cls(config).to(dtype).eval()


def make_tiny_checkpoint(directory, family: str = "llama", *, seed: int = 0,
                         dtype=torch.float32, head: bool = True, max_shard_size=None, **sizes) -> Path:
    """Save a random :func:`make_tiny_model` as a safetensors checkpoint in ``directory``.

    ``max_shard_size`` (e.g. ``"20KB"``): split the weights over several files with a
    ``model.safetensors.index.json``, as large checkpoints are. ``make_tiny_checkpoint(d,
    "llama", **BENCH_LLAMA)`` writes the benchmark's ~25M model.
    """
    from transformers.utils import logging as hf_logging
    model = make_tiny_model(family, seed=seed, dtype=dtype, head=head, **sizes)
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
