"""Step 1 of ``parallelize``: which plan, in tensorpar's style names (a :class:`~.plan.Declaration`).

The plan is the registry's own (``tensorpar.architecture.registry``), else the model's declared
``tp_plan`` translated style by style (:mod:`.declared`) with the registry's overrides first,
else the user's dict, else none: pairs to split are then discovered by running the model
(``resolve``). Nothing is expanded to module names yet.
"""
from __future__ import annotations

from tensorpar.architecture import registry
from tensorpar.architecture.plans import pattern_regex
from tensorpar.sharding import declared
from tensorpar.sharding.records import Declaration, base_prefix
from tensorpar.sharding.sizes import model_type, text_config


def declare(model, plan) -> Declaration:
    """The :class:`Declaration` of ``plan`` (``"auto"``, ``"declared"``, an architecture name or a
    dict of pattern -> style) for ``model``."""
    source, entries, overrides, segments = choose(model, plan)
    bad = {}
    if source == "declared":
        entries, bad = translate(model, entries, overrides)
    return Declaration(source, model_type(model), entries, segments, bad)


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


def translate(model, entries: dict, overrides: dict) -> tuple[dict, dict]:
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
