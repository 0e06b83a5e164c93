"""A small model with every kind of layer its full-size configuration has.

A configuration decides per layer which attention (sliding, full, chunked, linear) and which
feed-forward (dense or mixture of experts) a layer gets: by a list (``layer_types``,
``mlp_layer_types``), by a count of leading dense layers (``first_k_dense_replace``), by a period
and an offset (``decoder_sparse_step``, ``attn_layer_period``) or by a list of layer indices
(``mlp_only_layers``). Shrunk to 2 layers by the configuration's own rule, many keep only one
kind: a Gemma-3 of 2 layers has no full-attention layer, a DeepSeek-V3 of 2 layers no experts.
A test of such a model, or a proof run on it, says nothing of the kinds it lacks.
:func:`layer_layout` gives the fields that make a small model of ``max(2, kinds)`` layers hold
each kind of the full one at least once, in the order they first appear.
"""
from __future__ import annotations

from tensorpar.architecture.configs import NAMES, get as _get, n_layers

LAYER_COUNTS = NAMES["layers"]
_LEADING_DENSE = ("first_k_dense_replace", "num_dense_layers")  # layers [0, k) dense
_PERIODS = ("decoder_sparse_step", "interleave_moe_layer_step", "attn_layer_period", "expert_layer_period",
            "moe_layer_interval", "no_rope_layer_interval")
_OFFSETS = ("attn_layer_offset", "expert_layer_offset")
_INDEX_LISTS = ("mlp_only_layers", "moe_layers")


def _kind_lists(config, n_full: int) -> dict:
    """``{field: [kinds in first-appearance order]}`` of the per-layer lists of strings (as the
    config holds them, not as it serialises them)."""
    out = {}
    for name in config.to_dict():
        value = _get(config, name)
        if (isinstance(value, list) and len(value) == n_full and value
                and all(isinstance(v, str) for v in value)):
            out[name] = list(dict.fromkeys(value))
    return out


def _index_list(indices, n_full: int, n: int) -> list:
    """Layer indices mapped onto ``n`` layers: none, all, or (some of them) the first only."""
    chosen = {i for i in indices if isinstance(i, int)}
    if not chosen:
        return []
    return list(range(n)) if len(chosen) >= n_full else [0]


def layer_layout(config, min_layers: int = 2) -> dict:
    """Config fields for a small model holding every kind of layer ``config`` has (see module doc)."""
    n_full = n_layers(config)
    if n_full is None:
        return {}
    kinds = _kind_lists(config, n_full)
    n = min(n_full, max([min_layers] + [len(k) for k in kinds.values()]))
    out = {name: (k * n)[:n] for name, k in kinds.items()}  # each kind once, then repeated
    out.update({name: n for name in LAYER_COUNTS if _get(config, name) is not None})
    for name in _LEADING_DENSE:
        value = _get(config, name)
        if isinstance(value, int) and value > 0:
            out[name] = min(value, n - 1) if value < n_full else n  # some dense layers: the first only
    for name in _PERIODS:
        value = _get(config, name)
        if isinstance(value, int) and value > 1:
            out[name] = min(value, n)
    for name in _OFFSETS:
        value = _get(config, name)
        if isinstance(value, int) and value > 0:
            out[name] = min(value, 1)
    for name in _INDEX_LISTS:
        value = _get(config, name)
        if isinstance(value, (list, tuple)):
            out[name] = _index_list(value, n_full, n)
    return out
