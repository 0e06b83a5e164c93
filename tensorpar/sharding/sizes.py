"""What a model's sizes are and which of them a plan splits.

``model_dims`` reads head counts and widths from a config (the registry's field names first, then
the usual ones); ``sizes_of`` lists every size a :class:`~tensorpar.sharding.plan.Resolution`
divides, so the feasibility check can name each one that a tp size does not divide; ``meta_model``
builds a model on the meta device to plan without weights.
"""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from tensorpar.sharding import registry
from tensorpar.sharding.marks import region_of, regions
from tensorpar.sharding.plan import Dims, Resolution
from tensorpar.sharding.styles import STYLES


def model_type(model_or_config) -> str | None:
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "model_type", None)


def text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _size(config, field: str, arch):
    names = (arch.config_names[field],) if arch and field in arch.config_names else registry.CONFIG_NAMES[field]
    for name in names:
        try:
            value = getattr(config, name, None)
        except Exception:  # noqa: BLE001 - configs whose sizes vary per layer raise on the global name
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


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


def plan_sizes(model_or_config, tp_size: int) -> list:
    """The :class:`~tensorpar.sharding.feasibility.Size` s the ``"auto"`` plan of a model (or of a
    config, built on the meta device) splits."""
    from tensorpar.sharding.resolve import resolve
    model = model_or_config if isinstance(model_or_config, nn.Module) else meta_model(model_or_config)
    if hasattr(model, "tp_report"):
        raise ValueError("model is already parallelized")
    return sizes_of(model, resolve(model, "auto", tp_size))


def sizes_of(model, res: Resolution) -> list:
    """Every size ``res`` splits: the head counts (attention regions), each split dimension."""
    from tensorpar.sharding.feasibility import Size, generic, head_sizes, hidden_size
    sizes, seen = [], set()
    regs = regions(res.placements)
    d = res.dims
    if d is not None and any(p.style == "attention" for p in regs.values()):
        sizes += head_sizes(d)
    for name, p in res.placements.items():
        for size in _split_sizes(model, name, p, regs, d):
            label = generic(size.name)
            if d is not None and size.rule == "divide" and size.value == d.ffn:
                label = "ffn"  # the MLP width, by its usual name
            elif d is not None and size.rule == "pad" and size.value == d.vocab:
                label = "vocab"
            if label not in seen:
                seen.add(label)
                sizes.append(Size(label, size.value, size.rule, size.what))
    if d is not None:
        sizes.append(hidden_size(d))
    return sizes


def _split_sizes(model, name, p, regs, dims) -> list:
    from tensorpar.sharding.feasibility import Size
    style = STYLES.get(p.style)
    if style is None or style.kind in ("region", "replicate") or p.style in ("grad_sync", "param_rank0"):
        return []
    in_attention = (anchor := region_of(name, regs)) is not None and regs[anchor].style == "attention"
    if p.style in ("vocab", "vocab_head"):
        mod = model.get_submodule(name)
        rows = getattr(mod, "num_embeddings", None) or getattr(mod, "out_features", None)
        return [Size(name, rows, "pad", "vocabulary rows")] if rows else []
    if p.style in ("colwise_kv", "conv1d_qkv", "param_heads") or (in_attention and style.kind in ("column", "row")
                                                                    and p.style != "fused_colwise"):
        return []  # the head counts govern these
    if p.style == "fused_colwise":
        segs = p.option("segments") or ()
        return [Size(f"{name}[{s}]", dims.ffn if s == "ffn" else s, "divide", "columns")
                for s in segs if s == "ffn" or isinstance(s, int)] if dims else []
    if style.kind == "param":
        owner, _, attr = name.rpartition(".")
        t = getattr(model.get_submodule(owner), attr)
        dim = -1 if p.style in ("param_rowwise", "param_packed_rowwise") or t.dim() < 3 else -2
        n = t.shape[dim] // (2 if "packed" in p.style else 1)
        return [Size(name, n, "divide", "expert columns")]
    mod = model.get_submodule(name)
    if style.kind == "norm":
        return []  # its builder checks the features it normalises
    if style.kind == "column":
        width = getattr(mod, "out_features", None) or getattr(mod, "nf", None)
        return [] if p.style == "colwise_gather" or not width else [Size(name, width, "divide", "columns")]
    width = getattr(mod, "in_features", None) or getattr(mod, "nx", None)
    return [Size(name, width, "divide", "rows")] if width else []


def meta_model(config, model_class=None):
    """The model of ``config`` with its parameters on the meta device (no memory), in eval mode."""
    import transformers
    from accelerate import init_empty_weights
    from tensorpar.models.testing import model_class as default_class
    if model_class is None:
        arch_name = (getattr(config, "architectures", None) or [None])[0]
        model_class = getattr(transformers, arch_name, None) if arch_name else None
        model_class = model_class or default_class(config)
    with init_empty_weights():
        model = model_class(config)
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()
