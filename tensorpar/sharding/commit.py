"""Step 5 of ``parallelize``: the built :class:`~.plan.Shards` put into the model, every change
logged for undo.

``commit`` swaps each planned module for its parallel version (or each planned parameter for its
shard), re-ties parameters that were tied (input embedding = output head), installs the region
hooks (:mod:`tensorpar.nn.regions`), sets per-rank head counts on attention modules and slices
per-head inputs (ALiBi biases). It returns an :class:`Undo` that restores the model exactly
(module objects, parameters, hooks, attributes), which ``parallelize`` uses when the proof fails.
"""
from __future__ import annotations

import copy
from functools import partial

import torch
from torch import nn

from tensorpar import distributed as dist
from tensorpar.architecture import registry
from tensorpar.architecture.configs import is_count
from tensorpar.architecture.tp_rules import kv_split, local_heads
from tensorpar.nn import ReplicatedHeadLinear, RowParallelLinear, regions
from tensorpar.nn.random import _TP_SEED_OFFSET, TP_RNG, RNGStatesTracker
from tensorpar.sharding import marks
from tensorpar.sharding.records import Shards
from tensorpar.sharding.sizes import attention_dims
from tensorpar.sharding.spec import ShardSpec

_MISSING = object()


class Undo:
    """Reverse actions, run last first."""

    def __init__(self):
        self.actions = []

    def add(self, action) -> None:
        self.actions.append(action)

    def set_attr(self, obj, attr: str, value) -> None:
        """``setattr`` with its inverse logged (an attribute the object did not have is deleted)."""
        old = obj.__dict__.get(attr, _MISSING) if not isinstance(obj, nn.Module) else _module_attr(obj, attr)
        setattr(obj, attr, value)
        self.add(lambda: _restore_attr(obj, attr, old))

    def revert(self) -> None:
        while self.actions:
            self.actions.pop()()


def _module_attr(module, attr):
    for store in (module._parameters, module._buffers, module._modules):
        if attr in store:
            return ("store", store, store[attr])
    return module.__dict__.get(attr, _MISSING)


def _restore_attr(obj, attr, old):
    if isinstance(obj, nn.Module):
        stored = isinstance(old, tuple) and len(old) == 3 and old[0] == "store"
        for store in (obj._parameters, obj._buffers, obj._modules):
            if not (stored and store is old[1]):
                store.pop(attr, None)
        obj.__dict__.pop(attr, None)
        if stored:
            old[1][attr] = old[2]  # in its own place: the order of children and parameters is kept
        elif old is not _MISSING:
            obj.__dict__[attr] = old
    elif old is _MISSING:
        obj.__dict__.pop(attr, None)
    else:
        obj.__dict__[attr] = old


def _swap_param(owner, attr, new, undo: Undo) -> None:
    old = owner._parameters[attr]
    owner._parameters[attr] = new
    undo.add(lambda: owner._parameters.__setitem__(attr, old))


def _holders(model) -> dict:
    """id(param) -> [(module_name, attr)] over every module holding it (tied params: several)."""
    out = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((mname, pname))
    return out


def plan_ties(model, built) -> list:
    """``[(canonical_new_param, [(module_name, attr), ...])]`` for dense params held twice."""
    ties = []
    for holders in _holders(model).values():
        if len(holders) < 2:
            continue
        new = [(m, a) for m, a in holders if m in built and built[m].module is not None]
        if not new:
            continue
        canon = getattr(built[new[0][0]].module, new[0][1])
        for m, a in holders:
            if m in built and built[m].module is not None and getattr(built[m].module, a).shape != canon.shape:
                raise ValueError(f"tied parameters {new[0][0]}.{new[0][1]} and {m}.{a} would get "
                                 f"different shards; give both vocab styles ('vocab'/'vocab_head')")
            compute = isinstance(model.get_submodule(m), (nn.Linear, nn.Embedding))
            if m not in built and compute:
                raise ValueError(f"{m}.{a} is tied to {new[0][0]}.{new[0][1]}, which the plan "
                                 f"shards; shard {m!r} too ('vocab_head' for an output head)")
        ties.append((canon, holders))
    return ties


def commit(model, res, shards: Shards, tp_group) -> Undo:
    """Put ``shards`` into ``model`` (the region hooks, head counts and gradient synchronisation
    ``res`` implies with them); the :class:`Undo` that restores it. On any error nothing stays changed."""
    built, tp_size = shards.built, shards.tp_size
    ties = plan_ties(model, built)  # may raise: nothing changed yet
    undo = Undo()
    try:
        for name, b in built.items():
            _put(model, name, b, tp_group, undo)
        for canon, holders in ties:
            for m, a in holders:
                undo.set_attr(model.get_submodule(m), a, canon)
        _regions(model, res, tp_group, tp_size, undo)
        for name, p in res.placements.items():
            if p.style == "grad_sync":
                owner, _, attr = name.rpartition(".")
                module = model.get_submodule(owner)
                regions.sync_grad(module, attr, tp_group)
                undo.add(partial(regions.drop_substitute, module, attr))
    except BaseException:
        undo.revert()
        raise
    return undo


def _put(model, name, b, tp_group, undo) -> None:
    if b.module is not None:
        parent, _, child = name.rpartition(".")
        b.module.train(model.get_submodule(name).training)  # a new module is made in training mode
        undo.set_attr(model.get_submodule(parent), child, b.module)
        return
    owner = model.get_submodule(name.rpartition(".")[0])
    for attr, param in b.params.items():
        _swap_param(owner, attr, param, undo)
    for attr in b.rank0:
        regions.rank0_only(owner, attr, tp_group)
        undo.add(partial(regions.drop_substitute, owner, attr))


def _regions(model, res, tp_group, tp_size, undo) -> None:
    arch = registry.arch(res.arch)
    for anchor, p in marks.regions(res.placements).items():
        module = model.get_submodule(anchor)
        handle = regions.enter_region(module, tp_group, all_inputs=p.style == "moe_experts")
        undo.add(handle.remove)
        if has_dropout(module):  # masks on its heads (or columns) must differ from rank to rank,
            # up to its row-parallel reduction: a dropout after it acts on the replicated sum
            rows = [m for m in module.modules() if isinstance(m, RowParallelLinear) and m.reduce_output]
            for h in rng_fork(model, tp_group, undo).around(module, [*rows, module]):
                undo.add(h.remove)
        if p.style in ("moe", "moe_experts"):
            undo.add(regions.exit_region(module, tp_group).remove)
        if p.style == "moe_split":  # reduce where the partial sums are made: the routed experts' output
            for sub in module.modules():
                if marks._is_experts(sub):
                    undo.add(regions.exit_region(sub, tp_group).remove)
        if p.style == "attention":
            dims = attention_dims(module, res.dims)  # the dense module's, before its counts change
            _set_heads(module, dims, res, tp_size, undo)
            if arch is not None and arch.head_inputs:
                rank = module_rank(tp_group)
                hook = partial(_slice_head_inputs, layouts=arch.head_inputs, dims=dims,
                               tp_size=tp_size, tp_rank=rank)
                undo.add(module.register_forward_pre_hook(hook, with_kwargs=True).remove)


_DROPOUT_ATTRS = ("attention_dropout", "attn_dropout", "dropout", "dropout_p", "attn_pdrop", "hidden_dropout")


def has_dropout(module) -> bool:
    """Whether ``module`` may drop activations in training: an ``nn.Dropout`` with p > 0 in it, or
    a dropout probability above 0 kept as a float attribute (Hugging Face attention modules pass
    ``self.attention_dropout`` to SDPA)."""
    for m in module.modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return True
        if any(isinstance(m.__dict__.get(a), float) and m.__dict__[a] > 0 for a in _DROPOUT_ATTRS):
            return True
    return False


def rng_fork(model, tp_group, undo) -> "regions.RngFork":
    """The model's one :class:`~tensorpar.nn.regions.RngFork` (made on first use, with a tracker
    seeded ``torch.initial_seed() + 2718 + tp_rank`` on the parameters' device, and a hook on the
    model that closes a stretch a failed forward left open)."""
    fork = model.__dict__.get("_tp_rng_fork")
    if fork is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        tracker = RNGStatesTracker("cpu" if device.type == "meta" else device)
        tracker.add(TP_RNG, torch.initial_seed() + _TP_SEED_OFFSET + module_rank(tp_group))
        fork = regions.RngFork(tracker)
        undo.set_attr(model, "_tp_rng_fork", fork)
        undo.add(model.register_forward_hook(fork.close, always_call=True).remove)
    return fork


def rng_to(model, device: torch.device) -> None:
    """The model's dropout tracker (if it has one) for ``device``'s generator: for a model split
    on one device (the meta device, when loading) and then placed on another."""
    fork = model.__dict__.get("_tp_rng_fork")
    if fork is not None:
        fork.tracker = fork.tracker.on(device)


def module_rank(tp_group) -> int:
    return dist.get_rank(tp_group)


def module_heads(module, anchor: str, res) -> tuple[int, int]:
    """``(query heads, KV heads)`` of one attention module (:func:`~tensorpar.sharding.sizes.attention_dims`)."""
    d = attention_dims(module, res.dims)
    return d.n_heads, d.n_kv_heads


def _set_heads(module, d, res, tp_size, undo) -> None:
    """Per-rank head counts on an attention module of dense sizes ``d`` (and on its own copy of
    the config where the architecture's attention reads them there)."""
    hq, hkv = local_heads(d.n_heads, d.n_kv_heads, tp_size)
    values = {"q": hq, "kv": hkv, "groups": hq // hkv}
    for attr, what in registry.HEAD_ATTRS.items():
        if is_count(getattr(module, attr, None)):
            undo.set_attr(module, attr, values[what])
    for attr in res.head_attrs:
        if is_count(getattr(module, attr, None)):
            heads = hkv if attr in registry.KV_WIDTH_ATTRS else hq
            undo.set_attr(module, attr, heads * d.head_dim)
    if res.head_config and getattr(module, "config", None) is not None:
        local = copy.copy(module.config)
        for field in res.head_config:
            what = "kv" if "key_value" in field or "kv" in field else "q"
            setattr(local, field, values[what])
        undo.set_attr(module, "config", local)


def _slice_head_inputs(module, args, kwargs, *, layouts, dims, tp_size, tp_rank):
    """Keep this rank's heads of every per-head keyword input (ALiBi biases)."""
    hq = dims.n_heads // tp_size
    heads = slice(tp_rank * hq, (tp_rank + 1) * hq)
    out = dict(kwargs)
    for key, layout in layouts.items():
        t = kwargs.get(key)
        if not isinstance(t, torch.Tensor):
            continue
        if layout == "batch*heads":
            b = t.shape[0] // dims.n_heads
            out[key] = t.reshape(b, dims.n_heads, *t.shape[1:])[:, heads].reshape(b * hq, *t.shape[1:])
        elif layout == "heads":
            out[key] = t[heads] if t.shape[0] == dims.n_heads else t[:, heads]
    return args, out


def tag_params(model, shards: Shards) -> None:
    """Give every parameter ``tp_replicas`` (ranks holding an identical copy) and ``tp_spec``."""
    tp_size = shards.tp_size
    for name, b in shards.built.items():
        owner = b.module if b.module is not None else model.get_submodule(name.rpartition(".")[0])
        prefix = name if b.module is not None else name.rpartition(".")[0]
        for attr, spec in b.specs.items():
            p = getattr(owner, attr, None)
            if not isinstance(p, nn.Parameter):
                continue
            p.tp_spec = ShardSpec(f"{prefix}.{attr}", spec.dim, spec.pieces, spec.pad_to, spec.transpose)
            if isinstance(owner, ReplicatedHeadLinear):
                p.tp_replicas = kv_split(owner.n_kv_heads, tp_size)[1]  # one KV head, held by this many ranks
            elif getattr(owner, "replicas", 1) > 1:
                p.tp_replicas = owner.replicas
            else:
                p.tp_replicas = 1 if spec.is_shard else tp_size
            rows = getattr(owner, "replicated_rows", None)
            if rows and p.tp_replicas == 1:  # a fused shard whose KV-head rows other ranks hold too
                p.tp_row_replicas = (rows, owner.row_replicas)
    for name, p in model.named_parameters():
        if not hasattr(p, "tp_replicas"):
            p.tp_replicas = tp_size  # untouched by the plan: whole on every rank
        if not hasattr(p, "tp_spec"):
            p.tp_spec = ShardSpec(name)
    # the same tags by parameter name on the model itself: torch's Parameter.__deepcopy__ keeps
    # only the data and requires_grad, and a copied model must not lose them (restore_tags)
    model._tp_param_tags = {name: {k: getattr(p, k) for k in _TAGS if hasattr(p, k)}
                            for name, p in model.named_parameters(remove_duplicate=False)}


_TAGS = ("tp_spec", "tp_replicas", "tp_row_replicas")


def restore_tags(model) -> None:
    """Give back the tags of :func:`tag_params` to parameters that lost them: those of a
    ``copy.deepcopy`` of a parallelized model. Clipping and the audit, which take any model a
    user hands them, call this first; a model never parallelized is left alone."""
    table = getattr(model, "_tp_param_tags", None)
    if not table:
        return
    for name, p in model.named_parameters(remove_duplicate=False):
        tags = table.get(name)
        if tags and not hasattr(p, "tp_spec"):
            for k, v in tags.items():
                setattr(p, k, v)
