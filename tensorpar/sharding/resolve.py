"""Step 2 of ``parallelize``: what a :class:`~.plan.Declaration` means for this model, name by name.

``resolve`` expands the declaration's patterns to the model's concrete module and parameter
names (for a model nothing declares, pairs discovered numerically, :mod:`.discover`), and
completes them into a :class:`~tensorpar.sharding.records.Resolution`:

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

A model on the meta device has no weights to run: discovery, and the completion of a
declaration, run on its replica (:func:`~tensorpar.sharding.replica.replica_of`), whose
findings are given to the model's modules of the same generic name.
"""
from __future__ import annotations

from torch import nn

from tensorpar.architecture import registry
from tensorpar.architecture.plans import compile_plan, generic, match_style, pattern_regex, relative_names
from tensorpar.sharding import discover
from tensorpar.sharding.marks import (EXPERTS, _ancestors, _split_names, _within, derive_regions, drop_whole,
                                      mark_grad_sync, mark_kv, mark_moe_mlps)
from tensorpar.sharding.records import Declaration, Placement, Resolution, base_prefix
from tensorpar.sharding.probes import example_inputs as default_inputs
from tensorpar.sharding.replica import replica_of
from tensorpar.sharding.sizes import model_dims
from tensorpar.sharding.styles import STYLES

_VALID = (*STYLES, EXPERTS)

# ---- expanding patterns to names --------------------------------------------------------------------

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

def resolve(model, decl: Declaration, tp_size: int, example_inputs=None, runnable=None) -> Resolution:
    """The :class:`Resolution` of ``decl`` for ``model`` at ``tp_size`` (nothing is changed).
    ``runnable``: what discovery and completion run, ``model`` itself or, for a model on the meta
    device, its replica (built here when not given)."""
    kind = decl.model_type
    arch = registry.arch(kind)
    dims = model_dims(model)
    source, entries = decl.source, decl.entries
    res = Resolution(source=source, arch=kind, dims=dims, strict=decl.strict,
                     head_attrs=arch.head_attrs if arch else (), head_config=arch.head_config if arch else ())
    if source == "discovered":
        runnable = _runnable(model, tp_size, runnable)
        styles, notes = discover.discover(runnable, tp_size, example_inputs)
        styles = _onto(model, runnable, styles)
        res.notes += notes
        if not styles:
            raise ValueError(f"unsupported model type {kind or type(model).__name__!r}: it declares no "
                             f"tensor-parallel plan, tensorpar's registry has no entry for it, and no "
                             f"column -> row linear pair or embedding to split was found; {'; '.join(notes)}")
        entries = styles
    placements, unused = expand(model, entries, decl.segments, source=source)
    if source == "user" and unused:
        raise ValueError(f"plan patterns {unused} match no module of {type(model).__name__}")
    if source == "declared":
        placements = _complete(model, placements, tp_size, example_inputs, res, runnable)
    if source == "declared" or (source == "tensorpar" and not any(
            STYLES.get(p.style) and STYLES[p.style].kind == "region" for p in placements.values())):
        placements = derive_regions(model, placements)
    if source == "declared":
        res.whole.update(untranslated_blocks(model, decl.untranslated))
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


def _complete(model, placements: dict, tp_size: int, example_inputs, res, runnable) -> dict:
    """A declaration completed: pairs of linears in the blocks it leaves whole (an attention it does
    not name, a shared MLP), each checked forward and backward before it is taken."""
    if tp_size == 1:
        return placements
    modules = dict(model.named_modules())
    split = {n for n in _split_names(placements) if n in modules}
    holding = {a for s in split for a in _ancestors(s)}
    taken = {n for n, m in modules.items() if isinstance(m, nn.Linear) and (_within(n, split) or n in holding)}
    runnable = _runnable(model, tp_size, runnable)
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


def _runnable(model, tp_size: int, runnable=None):
    """What runs in discovery and completion: ``runnable`` when given, ``model`` when it has
    weights, else a small replica of its config (:func:`~tensorpar.sharding.replica.replica_of`)."""
    if runnable is not None:
        return runnable
    if not any(p.is_meta for p in model.parameters()):
        return model
    return replica_of(model, tp_size)
