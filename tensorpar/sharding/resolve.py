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
from tensorpar.sharding.plan import (Dims, Placement, Resolution, base_prefix, compile_plan, match_style, parent_name,
                                     pattern_regex, relative_names)
from tensorpar.sharding.styles import STYLES, splits_module

EXPERTS = "experts"  # internal marker: a mixture-of-experts module whose parameters are split
_VALID = (*STYLES, EXPERTS)


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


# ---- completing a declared plan ---------------------------------------------------------------------

def _under(name: str, anchor: str) -> bool:
    return name.startswith(anchor + ".")


def _is_attention(module) -> bool:
    cls = type(module).__name__.lower()
    return "attention" in cls or "attn" in cls


def _is_experts(module) -> bool:
    """A fused mixture-of-experts module: it holds its experts' weights as 3-D parameters."""
    return any(p.dim() == 3 for p in module.parameters(recurse=False))


def derive_regions(model, placements: dict) -> dict:
    """Add a region for each row split's parent (a fused experts module's parent for its split
    parameters); regions nested in another region, derived or placed, join the outer one."""
    experts = {n for n, p in placements.items() if p.style == EXPERTS}
    placed = {n for n, p in placements.items() if p.style in STYLES and STYLES[p.style].kind == "region"}
    anchors = set()
    for name, p in placements.items():
        if p.style == "rowwise":
            anchors.add(parent_name(name))
        elif p.style.startswith("param_") and p.style not in ("param_rank0", "param_heads"):
            owner = parent_name(name)
            fused = owner in experts or _is_experts(model.get_submodule(owner))
            anchors.add(parent_name(owner) if fused else owner)
    everything = anchors | placed
    outer = {a for a in anchors if a not in placed and not any(_under(a, b) for b in everything if b != a)}
    out = dict(placements)
    for anchor in sorted(outer):
        module = model.get_submodule(anchor) if anchor else model
        fused = any(_under(e, anchor) for e in experts) or any(
            _is_experts(m) for m in module.modules())
        style = "moe" if fused else ("attention" if _is_attention(module) else "mlp")
        out[anchor] = Placement(anchor, style, "region of its row split's parent")
    regs = regions(out)
    for inner in [a for a in regs if any(_under(a, b) for b in regs if b != a)]:
        del out[inner]  # a region inside another joins it: one input copy, one reduction
    return out


def regions(placements: dict) -> dict:
    return {n: p for n, p in placements.items() if p.style in STYLES and STYLES[p.style].kind == "region"}


def region_of(name: str, regs: dict) -> str | None:
    hits = [a for a in regs if _under(name, a)]
    return min(hits, key=len) if hits else None


def mark_kv(model, placements: dict, dims: Dims | None) -> dict:
    """Column linears of attention regions that produce the KV heads -> ``colwise_kv``."""
    if dims is None or dims.n_kv_heads == dims.n_heads:
        return placements
    regs = regions(placements)
    out = dict(placements)
    for name, p in placements.items():
        if p.style != "colwise":
            continue
        anchor = region_of(name, regs)
        if anchor is None or regs[anchor].style != "attention":
            continue
        mod = model.get_submodule(name)
        if getattr(mod, "out_features", None) == dims.n_kv_heads * dims.head_dim:
            out[name] = Placement(name, "colwise_kv", p.why + " (KV heads)", p.options)
    return out


# Linear names that close an MLP (its row split); the others of the MLP open it (column splits).
ROW_NAMES = ("down_proj", "w2", "fc2", "c_proj", "dense_4h_to_h", "out_proj", "wo", "fc_out", "dense_out")


def mark_moe_mlps(model, placements: dict) -> dict:
    """Inside a ``moe`` region, an MLP the plan leaves whole (a shared expert a declaration does
    not name) would add its whole output to the partial sums on every rank, ``tp`` times in all:
    its linears are split too, by name (the closing one by rows, the others by columns), and the
    proof checks the result."""
    regs = regions(placements)
    out = dict(placements)
    experts = {n for n, p in placements.items() if p.style == EXPERTS}
    for anchor, reg in regs.items():
        if reg.style not in ("moe", "moe_split"):
            continue
        for name, module in model.get_submodule(anchor).named_modules():
            full = f"{anchor}.{name}" if name else anchor
            if not name or full in experts or any(_under(full, e) for e in experts):
                continue
            linears = {n: m for n, m in module.named_children() if splits_module("colwise", m)}
            if len(linears) < 2 or any(f"{full}.{n}" in placements for n in linears):
                continue
            rows = [n for n in linears if n in ROW_NAMES]
            if len(rows) != 1:
                continue
            width = linears[rows[0]].in_features
            cols = [n for n, m in linears.items() if n != rows[0] and m.out_features == width]
            fused = [n for n, m in linears.items() if n != rows[0] and m.out_features == 2 * width]
            if len(cols) + len(fused) != len(linears) - 1:
                continue
            for n in cols:
                out[f"{full}.{n}"] = Placement(f"{full}.{n}", "colwise", "an MLP inside a moe region")
            for n in fused:  # [gate | up] in one linear
                out[f"{full}.{n}"] = Placement(f"{full}.{n}", "fused_colwise", "a fused MLP inside a moe region",
                                               (("segments", (width, width)),))
            out[f"{full}.{rows[0]}"] = Placement(f"{full}.{rows[0]}", "rowwise", "an MLP inside a moe region")
    return out


def _split_names(placements: dict) -> set:
    """Modules replaced by a split and parameters split in place."""
    return {n for n, p in placements.items() if p.style in STYLES and STYLES[p.style].kind in
            ("column", "row", "vocab", "norm")} | {n for n, p in placements.items() if p.style.startswith("param_")}


def mark_grad_sync(model, placements: dict) -> dict:
    """Every unsplit parameter inside a region: ``grad_sync`` (``param_rank0`` for an expert
    bias added inside a partial sum). Declared ``grad_sync`` modules expand to their parameters."""
    regs = regions(placements)
    split = _split_names(placements)
    experts = {n for n, p in placements.items() if p.style == EXPERTS}
    out = {n: p for n, p in placements.items() if p.style != "grad_sync"}
    declared_sync = {n for n, p in placements.items() if p.style == "grad_sync"}
    for mname, module in model.named_modules():
        if any(mname == s or _under(mname, s) for s in split if s in dict(model.named_modules())):
            continue
        anchor = region_of(mname, regs) if mname not in regs else mname
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if full in split:
                continue
            in_decl = mname in declared_sync or full in declared_sync
            if anchor is None and not in_decl:
                continue
            owner_is_experts = mname in experts
            if owner_is_experts and regs.get(anchor) is not None and regs[anchor].style in ("moe", "moe_split"):
                out[full] = Placement(full, "param_rank0", "unsplit expert parameter inside the partial sum")
            else:
                why = "declared replicated_with_grad_allreduce" if in_decl else f"replicated inside region {anchor!r}"
                out[full] = Placement(full, "grad_sync", why)
    return out


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
        styles, notes = discover.discover(_runnable(model, tp_size), tp_size, example_inputs)
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
    from tensorpar.sharding.prove import example_inputs as default_inputs
    if tp_size == 1:
        return placements
    modules = dict(model.named_modules())
    split = {n for n in _split_names(placements) if n in modules}
    taken = {n for n, m in modules.items() if isinstance(m, nn.Linear)
             and any(n == s or _under(n, s) or _under(s, n) for s in split)}
    runnable = _runnable(model, tp_size)
    try:
        inputs = default_inputs(runnable, example_inputs)
        styles, notes = discover.find_pairs(runnable, tp_size, inputs, taken)
    except ValueError as exc:  # the model cannot run on example inputs: the declaration as it is
        res.notes.append(f"declared plan not completed: {exc}")
        return placements
    res.notes += [n for n in notes if n.startswith("paired")]
    out = dict(placements)
    for name, style in styles.items():
        if name not in out and not any(_under(name, s) for s in split):
            out[name] = Placement(name, style, "discovered: a block the declaration leaves whole")
    return out


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
    if hasattr(replica.config, "_experts_implementation"):
        replica.config._experts_implementation = "eager"
    return replica


def unit_root(name: str, placements: dict) -> str:
    """The block that splits with ``name`` or not at all: its region, else its parent module."""
    regs = regions(placements)
    if name in regs:
        return name
    anchor = region_of(name, regs)
    if anchor is not None:
        return anchor
    style = STYLES.get(placements[name].style) if name in placements else None
    if style is not None and style.kind == "vocab":
        return name
    if style is not None and style.kind == "param":
        return parent_name(name)  # the module holding the parameter
    return parent_name(name)  # a column or row split and its sibling partners


def drop_whole(res: Resolution) -> None:
    """Remove every placement of each unit the resolution leaves whole. ``res.whole`` names a
    block concretely or generically (``model.layers.*.mlp``: every layer's MLP)."""
    from tensorpar.sharding.feasibility import generic
    for block in list(res.whole):
        g = generic(block)
        for name in list(res.placements):
            if name not in res.placements:
                continue
            gn = generic(name)
            if gn == g or gn.startswith(g + ".") or g.startswith(gn + "."):
                root = unit_root(name, res.placements) if not g.startswith(gn + ".") else name
                for n in [n for n in res.placements if n == root or _under(n, root)]:
                    del res.placements[n]


def plan_sizes(model_or_config, tp_size: int) -> list:
    """The :class:`~tensorpar.sharding.feasibility.Size` s the ``"auto"`` plan of a model (or of a
    config, built on the meta device) splits."""
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
