"""Tiny configurations of any architecture, and the replica a model on the meta device is run through.

Whether a plan computes a model's function exactly depends on the model's code, its
configuration flags and the plan, not on the weights. So a model on the meta device (what
``load_sharded`` builds before reading its shards) is run and proved through a *replica*
(:func:`replica_of`): the same class built from the same configuration with every size shrunk
(:func:`tiny_like`: hidden 64, 4 query heads over 2 KV heads or as many as the model has,
vocabulary 130, ...; every flag, string and layout choice kept; 2 layers, or as many as it takes
to hold each kind of layer the model has: sliding and full attention, dense and expert MLPs),
random float64 weights drawn from one seed on every rank. A configuration that cannot be shrunk
is refused with the reason.

:func:`make_tiny_config` is the tiny configuration of a model type (``tensorpar.models.tiny``
builds models and checkpoints from it); the sizes are ``tensorpar.architecture.tiny_sizes``'s and the
registry entry's (``Arch.tiny``).
"""
from __future__ import annotations

import dataclasses

import torch

from tensorpar.architecture import registry
from tensorpar.architecture.layer_kinds import layer_layout
from tensorpar.architecture.tiny_sizes import DROPOUT_WORDS, OMIT, REPLICA_SEED, TOKENS, replica_kv_heads, sizes_for
from tensorpar.sharding.model_classes import config_class, eager_experts
from tensorpar.sharding.sizes import model_dims


def _fields(cls) -> dict:
    return {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}


def _no_dropout(fields: dict) -> dict:
    return {name: 0.0 for name, f in fields.items()
            if any(w in name for w in DROPOUT_WORDS) and isinstance(f.default, float)}


def _layout(cls, layout_of) -> dict:
    """:func:`~tensorpar.architecture.layer_kinds.layer_layout` of ``layout_of``, else of the class's defaults."""
    if layout_of is None:
        try:
            layout_of = cls()
        except Exception:  # noqa: BLE001 - a class without defaults for every field: its own rule
            return {}
    return layer_layout(layout_of)


def make_tiny_config(arch: str, *, tp: int = 1, layout_of=None, **sizes):
    """A transformers config of ``arch`` with tiny sizes (split by ``tp`` ranks, see
    :func:`~tensorpar.architecture.tiny_sizes.sizes_for`), dropout off, overridden by ``sizes``; as many
    layers as it takes to hold every kind of layer (attention, dense or expert MLP) that
    ``layout_of`` (default: the architecture's full-size configuration) has."""
    cls = config_class(arch)
    fields = _fields(cls)
    entry = registry.arch(arch)
    if entry is not None and entry.tiny_only:
        return cls(**{**entry.tiny, **_no_dropout(fields), **sizes})
    kw = {k: v for k, v in sizes_for(tp).items() if k in fields}
    kw.update({k: v for k, v in TOKENS.items() if k in fields})
    kw.update(_no_dropout(fields))
    if "layer_types" in fields:
        kw["layer_types"] = None  # rebuilt from num_hidden_layers by the config itself
    kw.update({k: v for k, v in _layout(cls, layout_of).items() if k in fields})
    kw.update(entry.tiny if entry is not None else {})
    kw.update(sizes)
    return cls(**{k: v for k, v in kw.items() if v is not OMIT})


def tiny_like(config, tp: int):
    """``config`` with its sizes shrunk to the test sizes for ``tp`` and every flag, string and
    layout choice kept."""
    kind = config.model_type
    tiny = make_tiny_config(kind, tp=tp, layout_of=config)
    entry = registry.arch(kind)
    sizes = set(sizes_for(tp)) | set(entry.tiny if entry is not None else {}) | {"layer_types", "vocab_size"}
    keep = {k: v for k, v in config.to_dict().items()
            if k not in sizes and not k.startswith("_") and isinstance(v, (bool, str))
            and k not in ("architectures", "dtype", "torch_dtype", "transformers_version", "model_type")}
    fields = {**tiny.to_dict(), **keep}
    for name in getattr(type(config), "sub_configs", None) or {}:  # a composite's text and vision models
        sub = getattr(config, name, None)
        if hasattr(sub, "model_type") and hasattr(sub, "to_dict"):  # else the class's full-size default
            try:
                fields[name] = tiny_like(sub, tp).to_dict()
            except ValueError:  # a sub-model type transformers does not list: its own sizes
                fields[name] = sub.to_dict()
    dims, tiny_dims = model_dims(config), model_dims(tiny)
    if dims is not None and tiny_dims is not None and "num_key_value_heads" in fields:
        kv = replica_kv_heads(dims.n_heads, dims.n_kv_heads, tiny_dims.n_heads, tp)
        if kv is not None:
            fields["num_key_value_heads"] = kv
    allowed = set(_fields(type(config)))
    return type(config)(**{k: v for k, v in fields.items() if k in allowed and v is not OMIT})


def replica_of(model, tp: int):
    """A float64 replica of ``model`` (on the meta device) at the tiny sizes for ``tp``, in eval
    mode, its weights drawn from :data:`~tensorpar.architecture.tiny_sizes.REPLICA_SEED` (the same on
    every rank); ValueError when ``model`` has no transformers config or the replica does not build."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise ValueError(f"{type(model).__name__} is on the meta device and has no transformers config to "
                         f"build a small replica from (its split is found and proved by running one): load it "
                         f"with real weights, or pass a plan dict and prove=False")
    try:
        small = tiny_like(config, tp)
        torch.manual_seed(REPLICA_SEED)
        replica = type(model)(small).to(torch.float64).eval()
    except Exception as exc:  # noqa: BLE001 - any failure to build means: no replica to run
        raise ValueError(f"a small replica of this {config.model_type} model's config does not build "
                         f"({type(exc).__name__}: {exc}); its split cannot be proved: pass prove=False to "
                         f"split it unproved") from None
    return eager_experts(replica)
