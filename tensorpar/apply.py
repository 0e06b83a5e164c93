"""``parallelize``: apply a tensor-parallel plan to a model, in place, all or nothing.

The plan (``tensorpar.models.plans``) names a style per module; this one function turns each
named dense module into this rank's shard (``tensorpar.models.styles``), sets the per-rank head
counts on attention modules, makes attention/MLP inputs enter the tensor-parallel region once,
and re-ties parameters that were tied (input embedding = output head). Order of work:

1. resolve the plan and check feasibility (heads, KV heads, ffn, vocabulary) -> ValueError
   listing the valid tp sizes; check that the plan computes the model's function
   (``tensorpar.models.plan_checks``: column splits paired with row splits, attention split
   whole) -> ValueError naming the missing entries;
2. build every replacement module (slicing weights) without touching the model; any error
   here leaves the model exactly as it was;
3. commit: swap modules, re-tie, set head counts, install region hooks, tag parameters.

Each parameter gets ``tp_replicas``: how many ranks of the group hold an identical copy (1 for
a shard, ``tp_size`` for a replicated tensor, ``tp / n_kv_heads`` for a replicated KV head),
which is what gradient-norm clipping needs to count every parameter once.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

from torch import nn

from tensorpar import dist
from tensorpar.models import discover, styles as S
from tensorpar.models.feasibility import check_feasibility
from tensorpar.models.plan_checks import check_plan
from tensorpar.models.plans import (FAMILY_PLANS, REGION_STYLES, compile_plan, local_head_attrs,
                                    match_style, model_dims, model_family)
from tensorpar.models.report import ParallelizeReport
from tensorpar.nn import (ColumnParallelLinear, ReplicatedHeadLinear, RowParallelLinear,
                          VocabParallelEmbedding)
from tensorpar.nn.layers import tp_info

_PARALLEL = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ReplicatedHeadLinear)

HEAD_STYLES = ("attention", "colwise_kv", "conv1d_qkv")  # need the model's head counts


def parallelize(model: nn.Module, plan="auto", *, tp_group=None, example_inputs=None) -> nn.Module:
    """Shard ``model`` over the ranks of ``tp_group`` (None: world) following ``plan``; return it.

    ``plan``: ``"auto"`` (the family plan from ``config.model_type``; for an unknown model,
    checked column -> row pairs found on ``example_inputs``, default ``model.dummy_inputs``),
    a family name (``"llama"``, ``"mistral"``, ``"qwen2"``, ``"gpt2"``, ``"bert"``) or a dict
    of module-name pattern -> style. What was done is in ``model.tp_report``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_dense(model)
    tp_size, tp_rank = tp_info(tp_group)  # ValueError on a rank outside tp_group
    resolved = _resolve(model, plan, tp_size, example_inputs)
    report = ParallelizeReport(family=resolved["family"], source=resolved["source"], tp_size=tp_size,
                               tp_rank=tp_rank, notes=resolved["notes"],
                               feasibility=resolved["feasibility"], tp_group=tp_group,
                               params_total=sum(p.numel() for p in model.parameters()))
    ctx_args = dict(tp_group=tp_group, tp_size=tp_size, tp_rank=tp_rank, dims=resolved["dims"])
    assigned = _assign(model, resolved)
    if resolved["source"] != "discovered":  # discovered pairs were checked numerically
        check_plan(model, assigned, resolved["family"], resolved["dims"], tp_size, _base_prefix(model))
    built = _build(model, assigned, ctx_args)
    ties = _plan_ties(model, built)
    _commit(model, assigned, built, ties, resolved, ctx_args)
    report.styles = {n: s for n, s in assigned.items()}
    report.replicated = _replicated_names(model, assigned)
    report.params_per_rank = sum(p.numel() for p in model.parameters())
    model.tp_report = report
    return model


# ---- 1. plan ---------------------------------------------------------------------------------

def _check_dense(model) -> None:
    """Refuse a model that is, or holds a module that is, already parallelized."""
    for name, mod in model.named_modules():
        if hasattr(mod, "tp_report") or isinstance(mod, _PARALLEL):
            what = "it has a tp_report" if not name else (
                f"its submodule {name!r} " + ("has a tp_report" if hasattr(mod, "tp_report")
                                             else f"is a {type(mod).__name__}"))
            raise ValueError(f"model is already parallelized ({what}); build a fresh dense model")


def _resolve(model, plan, tp_size, example_inputs) -> dict:
    family = model_family(model)
    out = {"family": family, "dims": None, "feasibility": None, "notes": [], "head_attrs": ()}
    if isinstance(plan, dict):
        compiled = compile_plan(plan)
        heads = any(style in HEAD_STYLES for _, _, style in compiled)
        if heads and family is None:
            raise ValueError(f"styles {', '.join(HEAD_STYLES)} need the head counts of a known family "
                             f"({', '.join(FAMILY_PLANS)}); this model's type is not one of them")
        return {**out, "source": "user", "compiled": compiled, "strict": True,
                **_family_extras(model, family, tp_size, enforce=heads)}
    if plan in FAMILY_PLANS:
        if family != plan:
            raise ValueError(f"plan {plan!r} does not fit this model (config.model_type "
                             f"{getattr(getattr(model, 'config', None), 'model_type', None)!r}); "
                             f"use plan='auto' or one of {', '.join(FAMILY_PLANS)}")
        family = plan
    elif plan != "auto":
        raise ValueError(f"plan {plan!r} is not supported; valid: 'auto', "
                         f"{', '.join(map(repr, FAMILY_PLANS))} or a dict of pattern -> style")
    if family is None:
        return {**out, **_discovered(model, tp_size, example_inputs)}
    fp = FAMILY_PLANS[family]
    return {**out, "source": "family", "compiled": compile_plan(fp.styles), "strict": False,
            **_family_extras(model, family, tp_size)}


def _family_extras(model, family, tp_size, enforce=True) -> dict:
    """Dims, feasibility (raised when ``enforce``: the plan splits heads) and head attributes.

    A user plan that splits no heads is checked by its layers' own divisibility checks instead.
    """
    if family is None:
        return {}
    dims = model_dims(model.config)
    feas = check_feasibility(dims, tp_size, family)
    if enforce and not feas.ok:
        raise ValueError(feas.error_message())
    return {"family": family, "dims": dims, "feasibility": feas, "head_attrs": FAMILY_PLANS[family].head_attrs,
            "notes": feas.fixes if feas.ok else []}


def _discovered(model, tp_size, example_inputs) -> dict:
    kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if example_inputs is None:
        example_inputs = getattr(model, "dummy_inputs", None)
    if example_inputs is None:
        raise ValueError(f"no plan for model type {kind!r} (families: {', '.join(FAMILY_PLANS)}); "
                         f"plan='auto' on an unknown model needs example_inputs=... to check "
                         f"linear pairs on, or pass a plan dict")
    pairs, notes = discover.find_pairs(model, tp_size, example_inputs)
    vocab, vnotes = discover.find_vocab(model, pairs)
    if not pairs and not vocab:
        raise ValueError(f"unsupported model type {kind!r}: not a known family ({', '.join(FAMILY_PLANS)}) "
                         f"and no column -> row linear pair or embedding to split was found; {'; '.join(notes)}")
    styles = {**pairs, **vocab}
    return {"source": "discovered", "compiled": compile_plan(styles), "strict": True,
            "notes": notes + vnotes}


def _base_prefix(model) -> str | None:
    prefix = getattr(model, "base_model_prefix", "")
    sub = getattr(model, prefix, None) if prefix else None
    return prefix + "." if isinstance(sub, nn.Module) and sub is not model else None


def _assign(model, resolved) -> dict:
    """``{module_name: style}`` for every module a plan entry matches (first match wins)."""
    compiled, prefix = resolved["compiled"], _base_prefix(model)
    assigned, used = {}, set()
    for name, _ in model.named_modules():
        if not name:
            continue
        rel = name[len(prefix):] if prefix and name.startswith(prefix) else None
        hit = match_style(compiled, (name, rel))
        if hit is not None:
            used.add(hit[0])
            if hit[1] != "replicate":
                assigned[name] = hit[1]
    unused = [p for p, _, _ in compiled if p not in used]
    if resolved["strict"] and unused:
        raise ValueError(f"plan patterns {unused} match no module of {type(model).__name__}")
    return assigned


# ---- 2. build --------------------------------------------------------------------------------

def _in_region(name: str, assigned: dict) -> bool:
    parts = name.split(".")
    return any(assigned.get(".".join(parts[:k])) in REGION_STYLES for k in range(1, len(parts)))


def _build(model, assigned, ctx_args) -> dict:
    """``{name: (new_module, {param: ShardSpec})}``; raises before the model is touched."""
    built = {}
    for name, style in assigned.items():
        if style in REGION_STYLES:
            continue
        if any(name.startswith(other + ".") for other in built):
            raise ValueError(f"plan shards both {name!r} and an enclosing module; name one of them")
        ctx = S.StyleContext(in_region=_in_region(name, assigned), **ctx_args)
        module, specs = S.BUILDERS[style](model.get_submodule(name), ctx, name)
        built[name] = (module, {k: replace(v, key=f"{name}.{k}") for k, v in specs.items()
                                if getattr(module, k, None) is not None})
    return built


def _holders(model) -> dict:
    """id(param) -> [(module_name, attr)] over every module holding it (tied params: several)."""
    out = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((mname, pname))
    return out


def _plan_ties(model, built) -> list:
    """``[(canonical_new_param, [(module_name, attr), ...])]`` for dense params held twice."""
    ties = []
    for key, holders in _holders(model).items():
        if len(holders) < 2:
            continue
        new = [(m, a) for m, a in holders if m in built]
        if not new:
            continue
        canon = getattr(built[new[0][0]][0], new[0][1])
        for m, a in holders:
            if m in built and getattr(built[m][0], a).shape != canon.shape:
                raise ValueError(f"tied parameters {new[0][0]}.{new[0][1]} and {m}.{a} would get "
                                 f"different shards; give both vocab styles ('vocab'/'vocab_head')")
            compute = isinstance(model.get_submodule(m), (nn.Linear, nn.Embedding))
            if m not in built and compute:
                raise ValueError(f"{m}.{a} is tied to {new[0][0]}.{new[0][1]}, which the plan "
                                 f"shards; shard {m!r} too ('vocab_head' for an output head)")
        ties.append((canon, holders))
    return ties


# ---- 3. commit (cannot fail) -------------------------------------------------------------------

def _commit(model, assigned, built, ties, resolved, ctx_args) -> None:
    for name, (module, specs) in built.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module)
        _tag(module, specs, ctx_args, resolved["dims"])
    for canon, holders in ties:
        for m, a in holders:
            setattr(model.get_submodule(m), a, canon)
    for name, style in assigned.items():
        if style in REGION_STYLES:
            _enter_region(model.get_submodule(name), ctx_args["tp_group"])
        if style == "attention":
            heads = local_head_attrs(resolved["head_attrs"], resolved["dims"], ctx_args["tp_size"])
            for attr, value in heads.items():
                setattr(model.get_submodule(name), attr, value)
    for p in model.parameters():
        if not hasattr(p, "tp_replicas"):
            p.tp_replicas = ctx_args["tp_size"]  # untouched by the plan: whole on every rank


def _tag(module, specs, ctx_args, dims) -> None:
    tp = ctx_args["tp_size"]
    for attr, spec in specs.items():
        p = getattr(module, attr)
        if isinstance(module, ReplicatedHeadLinear):
            p.tp_replicas = tp // dims.n_kv_heads
        else:
            p.tp_replicas = tp if spec.pieces is None else 1
        p.tp_spec = spec


def _copy_in(module, args, kwargs, *, group):
    """Forward pre-hook: the hidden states enter the TP region (identity; all-reduce of dX)."""
    if args:
        return (dist.copy_to_tp_region(args[0], group=group), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": dist.copy_to_tp_region(kwargs["hidden_states"], group=group)}
    raise ValueError(f"{type(module).__name__} is a tensor-parallel region ('attention'/'mlp' style) "
                     f"but was called without a positional input or hidden_states=; its colwise "
                     f"linears would miss their input copy")


def _enter_region(module, group) -> None:
    module.register_forward_pre_hook(partial(_copy_in, group=group), with_kwargs=True)


def _replicated_names(model, assigned) -> list[str]:
    return [n for n, m in model.named_modules()
            if n and n not in assigned and any(True for _ in m.parameters(recurse=False))]
