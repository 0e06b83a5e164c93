"""Where a model's configuration keeps each size: the field names, in one table.

Hugging Face configurations name one size many ways (``num_hidden_layers``, ``n_layer``,
``num_layers``, ...). :data:`NAMES` lists, for each size, the names looked for, in order; the
first that holds a positive integer is the size. The readers take a configuration object (a
``transformers`` config) or a ``config.json`` read as a dict alike. Standard library only.
"""
from __future__ import annotations

from collections.abc import Mapping

NAMES = {
    "n_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads"),
    "n_kv_heads": ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_n_heads", "num_query_groups"),
    "head_dim": ("head_dim", "kv_channels", "attention_head_dim", "dim_head"),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim", "decoder_ffn_dim", "ffn_hidden_size", "dim_ff"),
    "hidden": ("hidden_size", "n_embd", "d_model", "dim_model"),
    "vocab": ("vocab_size",),
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"),
    "positions": ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length"),
}

# Sizes a config may give (old and new names): where one is given as a number (or a list of them,
# one per layer), each must be positive. head_dim is not among them: 0 means "derived" in some
# configurations (GLM-5).
CORE_SIZES = ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers", "encoder_layers", "hidden_size",
              "n_embd", "d_model", "num_attention_heads", "n_head", "num_key_value_heads", "vocab_size",
              "intermediate_size", "n_inner", "ffn_dim", "max_position_embeddings", "n_positions")

# Where a multimodal or composite config.json nests its language model, as transformers names it
# (``get_text_config``) and as some remote-code models do (InternVL's ``llm_config``).
TEXT_KEYS = ("text_config", "llm_config", "language_config", "decoder", "generator", "text_decoder")


def get(config, name: str):
    """``config``'s field ``name`` (a dict's key or an object's attribute), None when absent."""
    if isinstance(config, Mapping):
        return config.get(name)
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - configs whose per-layer attributes raise on the global name
        return None


def is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def positive(value) -> bool:
    """A positive integer, or a non-empty list of them (one per layer: Gemma-3n)."""
    return all(map(is_count, value)) if isinstance(value, list) and value else is_count(value)


def count(config, names) -> int | None:
    """The first of ``names`` that ``config`` holds as a positive integer."""
    return next((v for n in names if is_count(v := get(config, n))), None)


def size(config, what: str) -> int | None:
    """Size ``what`` (a key of :data:`NAMES`) of ``config``."""
    return count(config, NAMES[what])


def n_layers(config) -> int | None:
    return count(config, NAMES["layers"])


def max_positions(config) -> int | None:
    """The longest sequence its position table or rotary setting allows (None: no limit given)."""
    return count(config, NAMES["positions"])


def nested(cfg: Mapping, where: str = ""):
    """``(prefix, dict)`` of a ``config.json`` and of every config nested in it (``text_config``,
    ``llm_config``, ``vision_config``, ``decoder``, ...), depth first."""
    yield where, cfg
    for key, value in cfg.items():
        if isinstance(value, Mapping) and (key.endswith("_config") or key in ("decoder", "encoder", "generator")):
            yield from nested(value, f"{where}{key}.")


def check_sizes(cfg: Mapping, source: str) -> None:
    """Every size of :data:`CORE_SIZES` that ``cfg`` (a ``config.json`` as a dict) or a config
    nested in it gives is a positive integer (per layer: a list of them); ``ValueError`` naming
    ``source`` and the field otherwise (``num_hidden_layers: -3`` built a model of no layers,
    planned as if it were one; a billion layers were built on the meta device until memory ran out)."""
    for where, sub in nested(cfg):
        for name in CORE_SIZES:
            value = sub.get(name)
            if value is not None and not positive(value):
                raise ValueError(f"{source}: {where}{name}={value!r} must be a positive integer")


def text_configs(cfg: Mapping) -> list:
    """``cfg`` and the language model's config nested in it, in that order: where a size of the
    text model (its heads, layers, positions) is looked up."""
    return [cfg] + [cfg[k] for k in TEXT_KEYS if isinstance(cfg.get(k), Mapping)]
