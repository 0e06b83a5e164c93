"""Step 1 of ``parallelize``: which plan, and what it means for this model, name by name.

``resolve`` picks the plan (the registry's own, the model's declaration translated, a user's
dict, or pairs discovered numerically), expands its patterns to the model's concrete module and
parameter names, and completes it into a :class:`~tensorpar.sharding.plan.Resolution`:

- **regions**: a declared plan names column and row linears only; each row linear's parent
  becomes a region (``attention`` for attention modules, ``mlp``, or ``moe`` when it holds the
  experts) whose entry copies the input into the tensor-parallel region once; regions nested
  in another region join it (one entry, one reduction);
- **KV heads**: a column linear of an attention region that produces the KV heads becomes
  ``colwise_kv`` (KV heads split, or replicated when there are fewer than ranks);
- **gradient synchronisation**: every parameter inside a region that no style splits (a
  per-head norm, a router, the down projection of a partial sum) acts on sharded activations
  and gets only this rank's share of its gradient: ``grad_sync`` (all-reduced in backward), or
  ``param_rank0`` for an unsplit expert bias added inside the partial sum;
- **partial sums**: row linears inside a ``moe`` region leave partial sums for the region's one
  all-reduce.
"""
from __future__ import annotations

from torch import nn

from tensorpar.sharding import declared, registry
from tensorpar.sharding.marks import (EXPERTS, _ancestors, _split_names, _within, derive_regions, drop_whole, mark_grad_sync, mark_kv,
                                      mark_moe_mlps)
from tensorpar.sharding.feasibility import generic
from tensorpar.sharding.plan import Placement, Resolution, base_prefix, compile_plan, match_style, pattern_regex, relative_names
from tensorpar.sharding.sizes import model_dims, model_type, text_config
from tensorpar.sharding.styles import STYLES

_VALID = (*STYLES, EXPERTS)

# ---- choosing the plan ---------------------------------------------------------------------------

def choose(model, plan) -> tuple[str, dict, dict, dict]:
    """``(source, {pattern: style}, overrides, {pattern: segments})`` of ``plan`` for ``model``:
    for a declared plan, its entries in transformers' style names and the registry's overrides
    in tensorpar's (full-name patterns)."""
    kind = model_type(model)
    arch = registry.arch(kind)
    segments = _of_config(arch.segments, model) if arch else {}
    if isinstance(plan, dict):
        return "user", plan, {}, segments
    if plan not in ("auto", "declared") and plan not in registry.ARCHS:
        raise ValueError(f"plan {plan!r} is not supported; valid: 'auto', 'declared', an architecture "
                         f"name ({', '.join(sorted(n for n, a in registry.ARCHS.items() if a.plan))}) "
                         f"or a dict of pattern -> style")
    if plan in registry.ARCHS:
        if kind != plan:
            raise ValueError(f"plan {plan!r} does not fit this model (config.model_type {kind!r}); "
                             f"use plan='auto'")
    if plan != "declared" and arch is not None and arch.plan is not None:
        return "tensorpar", _of_config(arch.plan, model), {}, segments
    tp_plan = getattr(model, "tp_plan", None)
    if isinstance(tp_plan, dict) and tp_plan:
        return "declared", dict(tp_plan), _full(model, arch.overrides if arch else {}), segments
    if plan == "declared":
        raise ValueError(f"{type(model).__name__} declares no tensor-parallel plan (model.tp_plan is empty)")
    if arch is not None and arch.overrides:  # the registry's entries complete a declaration there is none of
        return "tensorpar", _of_config(arch.overrides, model), {}, segments
    return "discovered", {}, {}, segments


def _of_config(value, model) -> dict:
    """A registry field, or its value for this model's config where it is a function of it."""
    return dict(value(text_config(model)) if callable(value) else value)


def _full(model, overrides: dict) -> dict:
    """Registry overrides (relative to the base model) as full-name patterns, like ``tp_plan``'s."""
    prefix = base_prefix(model) or ""
    return {prefix + pattern: style for pattern, style in overrides.items()}


# ---- expanding patterns to names --------------------------------------------------------------------

def _declared_styles(model, entries: dict, overrides: dict) -> tuple[dict, dict]:
    """Declared entries translated, overrides first: ``({pattern: tensorpar style}, {pattern: why
    untranslated})``. The output head's gathered column split is the vocabulary head; a
    vocabulary split of anything but the input embedding is left whole."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    names = {m: n for n, m in model.named_modules()}
    head = names.get(_get(model, "get_output_embeddings"))
    embed = names.get(_get(model, "get_input_embeddings"))
    out, bad = dict(overrides), {}
    for pattern, style in entries.items():
        regex = pattern_regex(pattern)
        is_param = any(regex.match(n) for n in params)
        ours, why = declared.translate(style, is_param)
        if ours == "colwise_gather" and head is not None and regex.match(head):
            ours = "vocab_head"
        if ours == "vocab" and not (embed is not None and regex.match(embed)):
            ours, why = None, f"declared {style!r} on an embedding that is not the input embedding"
        if ours is None:
            bad[pattern] = why
        elif pattern not in out:
            out[pattern] = ours
    return out, bad


def _get(model, method):
    fn = getattr(model, method, None)
    try:
        return fn() if callable(fn) else None
    except (NotImplementedError, AttributeError):
        return None


def expand(model, entries: dict, segments: dict, *, source: str) -> tuple[dict, list]:
    """``({name: Placement}, [patterns that matched nothing])``; first matching entry wins."""
    compiled = compile_plan(entries, _VALID)
    prefix = base_prefix(model)
    seg_rx = _segment_patterns(segments)
    used, out = set(), {}
    module_entries = [(p, r, s) for p, r, s in compiled if STYLES.get(s) is None or STYLES[s].target == "module"
                      or s == "grad_sync"]
    param_entries = [(p, r, s) for p, r, s in compiled if s in STYLES and STYLES[s].target == "param"]
    for name, _ in model.named_modules():
        if not name:
            continue
        hit = match_style(module_entries, relative_names(name, prefix))
        if hit is not None:
            used.add(hit[0])
            if hit[1] != "replicate":
                out[name] = Placement(name, hit[1], f"{source}: {hit[0]}", _options(seg_rx, name, prefix))
    for name, _ in model.named_parameters():
        hit = match_style(param_entries, relative_names(name, prefix))
        if hit is not None:
            used.add(hit[0])
            out[name] = Placement(name, hit[1], f"{source}: {hit[0]}")
    return out, [p for p, _, _ in compiled if p not in used]


def _segment_patterns(segments: dict) -> list:
    return [(pattern_regex(p), tuple(s)) for p, s in segments.items()]


def _options(seg_rx, name, prefix) -> tuple:
    for regex, segs in seg_rx:
        if any(n is not None and regex.match(n) for n in relative_names(name, prefix)):
            return (("segments", segs),)
    return ()


def untranslated_blocks(model, bad: dict) -> dict:
    """``{module name: why}`` for declared entries tensorpar cannot translate."""
    if not bad:
        return {}
    prefix = base_prefix(model)
    compiled = compile_plan({p: "replicate" for p in bad}, ("replicate",))
    out = {}
    for name, _ in model.named_modules():
        hit = match_style(compiled, relative_names(name, prefix))
        if hit is not None:
            out[name] = bad[hit[0]]
    return out


# ---- the whole step ----------------------------------------------------------------------------------

def resolve(model, plan, tp_size: int, example_inputs=None) -> Resolution:
    """The :class:`Resolution` of ``plan`` for ``model`` at ``tp_size`` (nothing is changed)."""
    from tensorpar.sharding import discover
    source, entries, overrides, segments = choose(model, plan)
    kind = model_type(model)
    arch = registry.arch(kind)
    dims = model_dims(model)
    res = Resolution(source=source, arch=kind, dims=dims, strict=source == "user",
                     head_attrs=arch.head_attrs if arch else (), head_config=arch.head_config if arch else ())
    if source == "discovered":
        runnable = _runnable(model, tp_size)
        styles, notes = discover.discover(runnable, tp_size, example_inputs)
        styles = _onto(model, runnable, styles)
        res.notes += notes
        if not styles:
            raise ValueError(f"unsupported model type {kind or type(model).__name__!r}: it declares no "
                             f"tensor-parallel plan, tensorpar's registry has no entry for it, and no "
                             f"column -> row linear pair or embedding to split was found; {'; '.join(notes)}")
        entries = styles
    bad = {}
    if source == "declared":
        entries, bad = _declared_styles(model, entries, overrides)
    placements, unused = expand(model, entries, segments, source=source)
    if source == "user" and unused:
        raise ValueError(f"plan patterns {unused} match no module of {type(model).__name__}")
    if source == "declared":
        placements = _complete(model, placements, tp_size, example_inputs, res)
    if source == "declared" or (source == "tensorpar" and not any(
            STYLES.get(p.style) and STYLES[p.style].kind == "region" for p in placements.values())):
        placements = derive_regions(model, placements)
    if source == "declared":
        res.whole.update(untranslated_blocks(model, bad))
    if source != "user":
        placements = mark_moe_mlps(model, placements)
    placements = mark_kv(model, placements, dims if source != "user" else None)
    placements = mark_grad_sync(model, placements)
    if arch is not None and source != "user":
        prefix = base_prefix(model) or ""
        skip = [pattern_regex(prefix + p) for p in arch.no_sync] + [pattern_regex(p) for p in arch.no_sync]
        placements = {n: p for n, p in placements.items()
                      if not (p.style == "grad_sync" and any(rx.match(n) for rx in skip))}
        res.whole.update({prefix + k: f"{v} (registry)" for k, v in arch.whole.items()})
    res.placements = {n: p for n, p in placements.items() if p.style != EXPERTS}
    res.experts = sorted(n for n, p in placements.items() if p.style == EXPERTS)
    drop_whole(res)
    return res


def _complete(model, placements: dict, tp_size: int, example_inputs, res) -> dict:
    """A declaration completed: pairs of linears in the blocks it leaves whole (an attention it does
    not name, a shared MLP), each checked forward and backward before it is taken."""
    from tensorpar.sharding import discover
    from tensorpar.sharding.probes import example_inputs as default_inputs
    if tp_size == 1:
        return placements
    modules = dict(model.named_modules())
    split = {n for n in _split_names(placements) if n in modules}
    holding = {a for s in split for a in _ancestors(s)}
    taken = {n for n, m in modules.items() if isinstance(m, nn.Linear) and (_within(n, split) or n in holding)}
    runnable = _runnable(model, tp_size)
    if runnable is not model:  # the replica's linears of the kinds the plan splits
        kinds = {generic(n) for n in taken}
        taken = {n for n, m in runnable.named_modules() if isinstance(m, nn.Linear) and generic(n) in kinds}
    try:
        inputs = default_inputs(runnable, example_inputs)
        styles, notes = discover.find_pairs(runnable, tp_size, inputs, taken)
    except ValueError as exc:  # the model cannot run on example inputs: the declaration as it is
        res.notes.append(f"declared plan not completed: {exc}")
        return placements
    styles = _onto(model, runnable, styles)
    res.notes += [n for n in notes if n.startswith("paired")]
    out = dict(placements)
    for name, style in styles.items():
        if name not in out and not _within(name, split):
            out[name] = Placement(name, style, "discovered: a block the declaration leaves whole")
    return out


def _onto(model, runnable, styles: dict) -> dict:
    """Styles found on a replica, given to the real model's modules of the same generic name (every
    layer of the kind; the replica holds one layer of each kind the model has). A generic name
    the replica's layers disagree on gets none."""
    if runnable is model:
        return styles
    by_kind = {}
    for name, style in styles.items():
        by_kind.setdefault(generic(name), set()).add(style)
    return {name: next(iter(by_kind[g])) for name, _ in model.named_modules()
            if len(by_kind.get(g := generic(name), ())) == 1}


def _runnable(model, tp_size: int):
    """``model``, or for one on the meta device (no weights to run the pair checks on) a small
    replica of its config with random weights: the same module names, the same code."""
    if not any(p.is_meta for p in model.parameters()):
        return model
    import torch
    from tensorpar.sharding.certify import REPLICA_SEED, tiny_like
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise ValueError(f"{type(model).__name__} is on the meta device and no plan is known for it: the "
                         f"pairs of linears to split are found by running it; pass a plan dict")
    torch.manual_seed(REPLICA_SEED)
    replica = type(model)(tiny_like(config, tp_size)).to(torch.float64).eval()
    return eager_experts(replica)


def eager_experts(model):
    """Make a model's mixture-of-experts layers run transformers' eager experts loop, which takes
    float64 (its grouped-matmul kernel takes float32, bfloat16 and float16 only). Returns ``model``."""
    if hasattr(getattr(model, "config", None), "_experts_implementation"):
        model.config._experts_implementation = "eager"
    return model


