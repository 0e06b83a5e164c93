"""A model's sizes, read from its config and its attention modules.

``model_dims`` reads head counts and widths from a config (the registry's field names for the
architecture first, then :data:`tensorpar.architecture.configs.NAMES`); ``attention_dims`` one
attention module's own head counts (layers of one model may differ).
"""
from __future__ import annotations

from dataclasses import replace

from tensorpar.architecture import configs, registry
from tensorpar.architecture.configs import is_count
from tensorpar.architecture.tp_rules import Dims
from tensorpar.sharding.model_classes import meta_model  # noqa: F401 - re-exported for sharding/inventory.py


def model_type(model_or_config) -> str | None:
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "model_type", None)


def text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _size(config, field: str, arch):
    names = (arch.config_names[field],) if arch and field in arch.config_names else configs.NAMES[field]
    return configs.count(config, names)


_K_NAMES = ("k_proj", "key", "Wk", "k")
HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size")


def _heads_of(module, names, head_dim) -> int | None:
    for n in names:
        width = getattr(getattr(module, n, None), "out_features", None)
        if width:
            return width // head_dim
    return None


def attention_dims(module, dims: Dims) -> Dims:
    """``dims`` with one attention module's own head counts and head dim. Query heads: its
    attribute, else the config's (a query projection may be wider than its heads: Qwen3-Next's
    carries a gate per head). KV heads: its attribute, else query heads over its groups, else its
    key projection's width over the head dim, else the config's. Layers of one model may differ:
    Gemma-4's full-attention heads are wider than its sliding ones, MiMo's sliding-window layers
    have twice the KV heads of its global ones."""
    head_dim = next((v for a in HEAD_DIM_ATTRS if is_count(v := getattr(module, a, None))), dims.head_dim)
    counts = {what: getattr(module, attr) for attr, what in registry.HEAD_ATTRS.items()
              if is_count(getattr(module, attr, None))}
    q = counts.get("q") or dims.n_heads
    kv = counts.get("kv") or (q // counts["groups"] if counts.get("groups") else None) or (
        _heads_of(module, _K_NAMES, head_dim)) or dims.n_kv_heads
    return replace(dims, n_heads=q, n_kv_heads=kv, head_dim=head_dim)


def model_dims(model_or_config) -> Dims | None:
    """:class:`Dims` from a model's config (None where the head counts cannot be read)."""
    config = text_config(model_or_config)
    arch = registry.arch(model_type(model_or_config))
    n_heads, hidden = _size(config, "n_heads", arch), _size(config, "hidden", arch)
    if n_heads is None or hidden is None:
        return None
    n_kv = _size(config, "n_kv_heads", arch)
    if getattr(config, "multi_query", False) is True and not getattr(config, "new_decoder_architecture", False):
        n_kv = 1
    head_dim = _size(config, "head_dim", arch) or hidden // n_heads
    ffn = _size(config, "ffn", arch) or 4 * hidden
    return Dims(n_heads, n_kv or n_heads, head_dim, ffn, _size(config, "vocab", arch) or 0, hidden)
