"""Small random Hugging Face models and checkpoints of any architecture, built offline from configs.

``make_tiny_config(arch)`` (:mod:`tensorpar.sharding.replica`) takes the transformers
configuration class of ``arch`` (a ``model_type``: ``"llama"``, ``"mixtral"``, ``"phi3"``, ...)
and shrinks every size field it has to a few dozen units (``tensorpar.architecture.tiny_sizes``:
hidden 64, 4 query heads over 2 KV heads of 16, ffn 128, 2 layers, vocabulary 130, 4 experts of
width 32 where the model has experts, dropout off; the registry entry's own sizes on top).
:func:`make_tiny_model` builds a random model from it, :func:`make_tiny_checkpoint` saves one.

Used by the tests (tiny float64 models), the benchmarks (``tensorpar.architecture.tiny_sizes.BENCH_LLAMA``,
about 25M parameters) and ``tensorpar train``'s default model. Dropout is off, so the dense and
sharded models compute the same function in training too. The same ``seed`` gives the same
weights on every rank.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tensorpar.sharding.model_classes import eager_experts, model_class
from tensorpar.sharding.replica import make_tiny_config

__all__ = ["make_tiny_config", "make_tiny_model", "make_tiny_checkpoint"]


def make_tiny_model(arch: str, *, seed: int = 0, dtype=torch.float64, head: bool = True, **sizes):
    """A random model from :func:`make_tiny_config` (``head``: the LM head class), in eval mode.

    Mixture-of-experts layers run transformers' eager experts loop, which takes float64 (its
    grouped-matmul kernel does not)."""
    config = make_tiny_config(arch, **sizes)
    torch.manual_seed(seed)
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
