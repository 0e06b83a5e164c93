"""Step 3 of ``parallelize``: a resolved plan checked before any module is built.

Two checks. Every size the plan splits against tp (:func:`sizes_of` lists them, the rules are
``tensorpar.architecture.tp_rules``): a ``ValueError`` listing the valid tp sizes. And a user's
plan against its modules (:func:`check_plan`):

A plan assigns styles module by module, and some assignments build fine and then fail in the
middle of a forward pass or, worse, compute another function without any error:

- a column split whose sharded output ``(..., out/p)`` never reaches a row split: the next
  layer gets ``out/p`` features where it expects ``out`` (shape error mid-forward);
- a row split whose input is whole: ``in`` features where it expects ``in/p``;
- q split by heads without k, v and the per-rank head counts: query heads meet the wrong KV
  heads (wrong numbers, no error);
- a region entry (``attention``/``mlp``) over linears left whole: dX is all-reduced over ranks
  that each computed all of it (the input gradient comes out ``tp`` times too large).

The MLP and attention split (Megatron-LM, Shoeybi et al. 2019, sec. 3) is ``Y = sum_i f(X A_i)
B_i``: the column blocks ``A_i`` and row blocks ``B_i`` belong together. For a known family the
plan's :class:`~tensorpar.architecture.plans.Unit` s say which modules split together (in BERT the
row partner sits outside the module holding the column linears); for any other module a
column split needs a row split among its siblings and the other way round. The discovered
plan (``"auto"`` on an unknown model) does not come here: each of its pairs was checked
numerically.
"""
from __future__ import annotations

from torch import nn

from tensorpar.architecture import registry
from tensorpar.architecture.plans import compile_plan, generic, join_name, match_style
from tensorpar.architecture.tp_rules import Dims, FeasibilityReport, Size, fits, head_sizes, hidden_size, model_sizes, report
from tensorpar.sharding.declare import declare
from tensorpar.sharding.marks import region_of, regions
from tensorpar.sharding.model_classes import meta_model
from tensorpar.sharding.records import Resolution, base_prefix
from tensorpar.sharding.resolve import resolve
from tensorpar.sharding.sizes import model_type
from tensorpar.sharding.styles import COLUMN_STYLES, REGION_STYLES, ROW_STYLES, STYLES, splits_module

# A gathered column split and a row split of a whole input are complete on their own.
COLUMN = tuple(s for s in COLUMN_STYLES if s != "colwise_gather")
ROW = tuple(s for s in ROW_STYLES if s != "rowwise_split")


def _rel_names(model, prefix):
    """``(name, name inside the base model or None)`` of every named submodule."""
    for name, _ in model.named_modules():
        if name:
            yield name, (name[len(prefix):] if prefix and name.startswith(prefix) else None)


def _same(got, want, dims, tp_size) -> bool:
    # K/V split plainly by columns is the same split as colwise_kv when tp divides the KV heads
    kv_even = dims is not None and fits("divide", dims.n_kv_heads, tp_size)
    return got == want or (want == "colwise_kv" and got == "colwise" and kv_even)


def _unit_message(family, unit, inst, got, bad) -> str:
    want = ", ".join(f"{join_name(unit.anchor, s)!r}: {st!r}" for s, st in unit.members)
    off = ", ".join(f"{join_name(unit.anchor, s)!r}: {st!r} (plan: {got[s] or 'replicate'!r})" for s, st in bad)
    cols = [s for s, st in got.items() if st in COLUMN]
    if cols and not any(st in ROW for st in got.values()):
        lead = (f"{got[cols[0]]} {join_name(inst, cols[0])!r} has no rowwise partner in {inst!r}; "
                f"add one or use 'replicate'")
    else:
        split = [join_name(inst, s) for s, st in got.items() if st]
        lead = (f"plan splits {split} but not the whole {family} {unit.kind} block {inst!r} "
                f"(the rest would stay whole and the block would compute another function)")
    return f"{lead}; a {family} {unit.kind} split needs all of {{{want}}}; missing or different: {off}"


def _check_units(model, assigned, family, dims, tp_size, prefix) -> set:
    """Every family unit a plan touches is split whole; returns the names the units cover."""
    covered = set()
    for unit in registry.ARCHS[family].units:
        anchor = compile_plan({unit.anchor: "replicate"}, ("replicate",))
        for name, rel in _rel_names(model, prefix):
            if match_style(anchor, (name, rel)) is None:
                continue
            got = {s: assigned.get(join_name(name, s)) for s, _ in unit.optional + unit.members}
            covered.update(join_name(name, s) for s in got)
            if not any(got.values()):
                continue
            bad = [(s, st) for s, st in unit.members if not _same(got[s], st, dims, tp_size)]
            bad += [(s, st) for s, st in unit.optional if got[s] not in (None, st)]
            if bad:
                raise ValueError(_unit_message(family, unit, name, got, bad))
    return covered


def _check_partners(assigned, covered) -> None:
    """A column split outside the family units needs a row split among its siblings, and back."""
    free = {n: s for n, s in assigned.items() if n not in covered}
    for name, style in free.items():
        parent = name.rpartition(".")[0]
        siblings = [s for n, s in free.items() if n != name and n.rpartition(".")[0] == parent]
        where = parent or "<model>"
        if style in COLUMN and not any(s in ROW for s in siblings):
            raise ValueError(f"{style} {name!r} has no rowwise partner in {where!r}; add one or use "
                             f"'replicate' (its output would stay split: 1/tp of the features)")
        if style in ROW and not any(s in COLUMN for s in siblings):
            raise ValueError(f"{style} {name!r} has no colwise partner in {where!r}; add one or use "
                             f"'replicate' (it expects its input split: 1/tp of the features)")


def _is_linear(module) -> bool:
    """A Linear or a GPT-2 Conv1D: a module some split style builds from."""
    return splits_module("colwise", module) or splits_module("conv1d_colwise", module)


def _check_regions(model, assigned, covered) -> None:
    """A region entry outside the family units needs every linear inside it split."""
    for name, style in assigned.items():
        if style not in REGION_STYLES or name in covered:
            continue
        inside = [f"{name}.{n}" for n, m in model.get_submodule(name).named_modules() if n and _is_linear(m)]
        whole = [n for n in inside if assigned.get(n) not in COLUMN + ROW]
        if whole or not inside:
            raise ValueError(f"region style {style!r} on {name!r} needs every linear inside it split "
                             f"(its input gradient is all-reduced over the ranks); left whole: "
                             f"{whole or 'no linear found'}; split them or drop the {style!r} entry")


def _check_kinds(model, assigned) -> None:
    """A column or row split applies to linear layers only: say so before any pairing advice."""
    for name, style in assigned.items():
        module = model.get_submodule(name)
        if style in COLUMN + ROW and not splits_module(style, module):
            kind = "a GPT-2 Conv1D" if style.startswith("conv1d_") else "a Linear"
            raise ValueError(f"plan style {style!r} needs {kind} but module {name!r} is "
                             f"{type(module).__name__}; use 'replicate' or a matching style")


def check_plan(model, assigned: dict, family, dims, tp_size: int, prefix) -> None:
    """ValueError when ``assigned`` (module name -> style) would not compute ``model``'s function."""
    _check_kinds(model, assigned)
    units = family is not None and family in registry.ARCHS and registry.ARCHS[family].units
    covered = _check_units(model, assigned, family, dims, tp_size, prefix) if units else set()
    _check_partners(assigned, covered)
    _check_regions(model, assigned, covered)


# ---- every size the plan splits, against tp ------------------------------------------------------------

def check(model, res: Resolution, tp_size: int) -> FeasibilityReport:
    """A user plan against its modules' kinds and its family's units, then every split size:
    ``ValueError`` naming what does not fit and the valid tp sizes. Returns the report (its fixes:
    KV-head replication, vocabulary padding)."""
    needs_heads = [n for n, p in res.placements.items() if STYLES[p.style].needs_heads]
    if needs_heads and res.dims is None:
        raise ValueError(f"styles on {needs_heads[:3]} need the model's head counts, which its config "
                         f"does not give (num_attention_heads, hidden_size)")
    if res.source == "user":
        modules = {n: s for n, s in res.styles().items() if STYLES[s].target == "module"}
        check_plan(model, modules, res.arch, res.dims, tp_size, base_prefix(model))
    feas = report(res.arch or type(model).__name__, sizes_of(model, res), tp_size)
    if not feas.ok:
        raise ValueError(feas.error_message())
    return feas


def check_feasibility(model_or_config, tp_size: int, family: str | None = None) -> FeasibilityReport:
    """The :class:`~tensorpar.architecture.tp_rules.FeasibilityReport` of splitting a model over
    ``tp_size`` ranks.

    ``model_or_config``: a Hugging Face model or config (its plan is resolved on a copy built on
    the meta device, so every split the plan makes is checked), or
    :class:`~tensorpar.architecture.tp_rules.Dims` (the sizes of a standard decoder split).
    """
    if isinstance(model_or_config, Dims):
        return report(family or "model", model_sizes(model_or_config), tp_size)
    kind = model_type(model_or_config) or type(model_or_config).__name__
    return report(kind, plan_sizes(model_or_config, tp_size), tp_size)


def plan_sizes(model_or_config, tp_size: int) -> list:
    """The :class:`~tensorpar.architecture.tp_rules.Size` s the ``"auto"`` plan of a model (or of a
    config, built on the meta device) splits."""
    model = model_or_config if isinstance(model_or_config, nn.Module) else meta_model(model_or_config)
    if hasattr(model, "tp_report"):
        raise ValueError("model is already parallelized")
    return sizes_of(model, resolve(model, declare(model, "auto"), tp_size))


def sizes_of(model, res: Resolution) -> list:
    """Every size ``res`` splits: the head counts (attention regions), each split dimension."""
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
