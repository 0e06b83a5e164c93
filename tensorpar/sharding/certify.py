"""Proving the split of a model that has no weights yet (built on the meta device to be loaded).

Whether a plan computes a model's function exactly depends on the model's code, its
configuration flags and the plan, not on the weights. So a model on the meta device (what
``load_sharded`` builds before reading its shards) is proved through a *replica*: the same class
built from the same configuration with every size shrunk (:func:`tiny_like`: hidden 64, 4 query
heads over 2 KV heads or as many as the model has, vocabulary 130, ...; every flag, string and
layout choice kept; 2 layers, or as many as it takes to hold each kind of layer the model has:
sliding and full attention, dense and expert MLPs), random float64 weights drawn from one seed on every rank, parallelized
and proved like any in-memory model. The blocks the replica's proof leaves whole are left whole in
the real model. A configuration that cannot be shrunk is refused with the reason, unless the
caller gives up the proof explicitly (``prove=False``).
"""
from __future__ import annotations

import copy

import torch

REPLICA_SEED = 1234


def _kv_heads(n_heads: int, n_kv: int | None, tiny_heads: int, tp: int) -> int | None:
    """Tiny KV heads in the model's relation to tp: MHA stays MHA, MQA stays MQA, KV heads that tp
    divides stay divisible, KV heads fewer than tp stay replicated."""
    if n_kv is None or n_kv == n_heads:
        return tiny_heads
    if n_kv == 1:
        return 1
    if n_kv % tp == 0:
        return tp
    return n_kv if tp % n_kv == 0 and tiny_heads % n_kv == 0 else None


def tiny_like(config, tp: int):
    """``config`` with its sizes shrunk to the test sizes for ``tp`` and every flag, string and
    layout choice kept."""
    from tensorpar.models.testing import ARCH_SIZES, OMIT, make_tiny_config, sizes_for
    from tensorpar.sharding.sizes import model_dims
    kind = config.model_type
    tiny = make_tiny_config(kind, tp=tp, layout_of=config)
    sizes = set(sizes_for(tp)) | set(ARCH_SIZES.get(kind, {})) | {"layer_types", "vocab_size"}
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
        kv = _kv_heads(dims.n_heads, dims.n_kv_heads, tiny_dims.n_heads, tp)
        if kv is not None:
            fields["num_key_value_heads"] = kv
    allowed = _init_fields(type(config))
    return type(config)(**{k: v for k, v in fields.items() if k in allowed and v is not OMIT})


def _init_fields(cls) -> set:
    import dataclasses
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def certify(model, plan, tp_group, example_inputs=None) -> dict:
    """``{generic block: why}``: what the proof leaves whole on a tiny replica of ``model``.

    Every rank builds the same replica (same seed), so the proof's collectives line up."""
    from tensorpar.sharding.apply import parallelize
    from tensorpar.sharding.resolve import eager_experts
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise ValueError(f"cannot prove the split of {type(model).__name__} on the meta device: it has no "
                         f"transformers config to build a replica from; load it with real weights, or "
                         f"pass prove=False to split it unproved")
    from tensorpar import dist
    try:
        small = tiny_like(config, dist.get_world_size(tp_group))
        torch.manual_seed(REPLICA_SEED)
        replica = type(model)(small).to(torch.float64).eval()
    except Exception as exc:  # noqa: BLE001 - any failure to build means: no proof possible
        raise ValueError(f"cannot prove the split of this {config.model_type} model: a small replica of its "
                         f"config does not build ({type(exc).__name__}: {exc}); pass prove=False to split "
                         f"it unproved") from None
    eager_experts(replica)  # float64
    plan = copy.deepcopy(plan) if isinstance(plan, dict) else plan
    parallelize(replica, plan, tp_group=tp_group, example_inputs=example_inputs, prove=True)
    return dict(replica.tp_report.whole)
