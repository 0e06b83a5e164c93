"""``parallelize``: a plan applied to a model, in place, exactly or not at all.

The work walks one way, each step handing a typed record to the next:

1. **resolve** (:mod:`.resolve`): the plan (the registry's, the model's declaration translated,
   the user's, or discovered pairs) as a :class:`~.plan.Resolution`: a style per concrete module
   and parameter, the regions, the gradients to synchronise, the blocks left whole and why;
2. **check** (:mod:`.feasibility`, :mod:`.checks`): every split size against tp (ValueError
   listing the valid tp sizes), a user plan against the family's units;
3. **build** (:mod:`.styles`): every replacement module and parameter shard, without touching
   the model; in an ``"auto"`` plan a block whose builder refuses it stays whole;
4. **commit** (:mod:`.commit`): swap modules and parameters, re-tie, install the region hooks,
   set per-rank head counts; every change is logged so it can be undone;
5. **prove** (:mod:`.prove`): the split model against the dense one on example inputs, forward
   and backward, every parameter's gradient; a block that fails is restored whole (``"auto"``)
   or the whole model is restored and ``ValueError`` names it (a user plan).

After any error the model is exactly as it was (parameters, module types, hooks, attributes).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from tensorpar.nn import ColumnParallelLinear, ReplicatedHeadLinear, RowParallelLinear, VocabParallelEmbedding
from tensorpar.dist import mesh as data_mesh
from tensorpar.nn.layers import tp_info
from tensorpar.sharding import checks, commit as C, marks as M, probes, prove as P, resolve as R, sequence as SP
from tensorpar.sharding.certify import certify
from tensorpar.sharding.feasibility import report as feasibility_report
from tensorpar.sharding.plan import base_prefix
from tensorpar.sharding.report import ParallelizeReport
from tensorpar.sharding.sizes import attention_dims, sizes_of
from tensorpar.sharding.styles import REGION_STYLES, STYLES, Built, StyleContext

_PARALLEL = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ReplicatedHeadLinear)
MAX_ATTEMPTS = 8  # build -> prove rounds: each one leaves at least one more unit whole


def parallelize(model: nn.Module, plan="auto", *, tp_group=None, mesh=None, data_parallel: str | None = None,
                sequence_parallel: bool = False, example_inputs=None, prove: bool = True) -> nn.Module:
    """Shard ``model`` over the ranks of ``tp_group`` (None: world) following ``plan``; return it.

    ``plan``: ``"auto"`` (the registry's plan for ``config.model_type``, else the model's own
    declared ``tp_plan`` translated, else column -> row pairs checked on ``example_inputs``),
    ``"declared"`` (the model's declaration, even where the registry has a plan), an
    architecture name, or a dict of module-name pattern -> style. ``prove``: run the split
    model against the dense one on example inputs before returning (forward and backward,
    every parameter's gradient; every rank takes part); a block that fails is left whole
    (``"auto"``) or raises ``ValueError`` (a dict). What was done is in ``model.tp_report``.

    ``mesh``: a ``DeviceMesh`` with dimensions ``("dp", "tp")`` instead of ``tp_group``: tensor
    parallelism inside ``mesh["tp"]``, data parallelism across ``mesh["dp"]`` by PyTorch's own
    engines, ``data_parallel="ddp"`` (replicated, ZeRO-0) or ``"fsdp"`` (FSDP2, ZeRO-3); see
    :mod:`tensorpar.dist.mesh`. Each dp rank then trains on its own slice of the batch.

    ``sequence_parallel=True``: between the regions of each block (norms, residuals, dropout)
    every rank holds only its chunk of the sequence, all-gathered into each region and
    reduce-scattered out of it (:mod:`tensorpar.sharding.sequence`); the sequence length must
    then divide by tp. Proved, with ``prove``, against the split model without it.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_dense(model)
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    data_mesh.check_args(mesh, tp_group, data_parallel)
    if mesh is not None:
        tp_group = data_mesh.tp_group_of(mesh)
    tp_size, tp_rank = tp_info(tp_group)  # ValueError on a rank outside tp_group
    params_total = sum(p.numel() for p in model.parameters())
    res = R.resolve(model, plan, tp_size, example_inputs)
    res.layer_params_total = sum(p.numel() for _, b in probes.blocks(model) for p in b.parameters())
    _check(model, res, tp_size)
    seq_blocks = SP.check(model, res, tp_size) if sequence_parallel else None
    on_meta = any(p.is_meta for p in model.parameters())
    evidence = None
    if prove and tp_size > 1 and on_meta:  # no weights to run: prove a small replica instead
        res.whole.update(certify(model, plan, tp_group, example_inputs))
        M.drop_whole(res)
    elif prove and tp_size > 1:
        evidence = P.Evidence.collect(model, res, example_inputs)
    for _ in range(MAX_ATTEMPTS):
        built = _build(model, res, tp_group, tp_size, tp_rank)
        undo = C.commit(model, res, built, tp_group, tp_size)
        failed = evidence.check(model, res, built, tp_group) if evidence is not None else {}
        if not failed:
            break
        undo.revert()
        if res.strict:
            raise ValueError("plan does not compute the model's function: " +
                             "; ".join(f"{k}: {v}" for k, v in failed.items()))
        _fall_back(res, failed)
    else:
        raise ValueError(f"could not split {type(model).__name__} exactly after {MAX_ATTEMPTS} attempts")
    if sequence_parallel:
        _sequence_parallel(model, res, seq_blocks, tp_group, tp_size, undo,
                           prove and not on_meta, example_inputs)
        if not (prove and not on_meta):
            res.notes.append("sequence parallelism applied without its proof (" +
                             ("no weights to run" if on_meta else "prove=False") + ")")
    C.tag_params(model, built, tp_size, res)
    model.tp_report = ParallelizeReport.of(model, res, tp_group, tp_size, tp_rank, params_total,
                                           proved=("replica" if on_meta else True) if prove and tp_size > 1
                                           else tp_size == 1)
    if data_parallel is not None:
        try:
            data_mesh.apply(model, mesh, data_parallel, [block for _, block in probes.blocks(model)])
        except BaseException:  # exactly or not at all: the split undone too
            undo.revert()
            del model.tp_report
            model.__dict__.pop("_tp_param_tags", None)
            raise
        model.tp_report.data_parallel, model.tp_report.dp_group = data_parallel, mesh["dp"].get_group()
        model.tp_report.dp_size = mesh["dp"].size()
    model.tp_report.sequence_parallel = sequence_parallel
    return model


def _sequence_parallel(model, res, blist, tp_group, tp_size, undo, prove: bool, given_inputs) -> None:
    """Sequence parallelism on the split model; with ``prove``, the model's output and every
    gradient with it equal those without it (rounding only), else everything is undone."""
    try:
        inputs = SP.example(model, given_inputs, tp_size) if prove else None
        before = SP.run(model, inputs) if prove else None
        SP.apply(model, res, blist, tp_group, undo)
        if not prove:
            return
        try:
            after = SP.run(model, inputs)
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:  # the same on every rank
            raise ValueError(f"sequence_parallel=True: {type(model).__name__} fails on sequence chunks "
                             f"({type(exc).__name__}: {exc}); use sequence_parallel=False") from exc
        errors = SP.differences(model, before, after, blist)
        tol = P.TOLERANCE.get(probes.least_precise({before[2], after[2]}), 1e-4)
        keys = sorted(errors)
        worst = torch.tensor([errors[k][0] for k in keys], dtype=torch.float64)
        from tensorpar import dist
        dist.all_reduce(worst, tp_group, op="max")  # every rank reaches the same verdict
        bad = {k: e for k, e in zip(keys, worst.tolist()) if not e <= tol}
        if bad:
            where = "; ".join(f"{k}{f' (worst here: {errors[k][1]})' if errors[k][1] else ''}: {e:.1e}"
                              for k, e in bad.items())
            raise ValueError(f"sequence_parallel=True does not compute {type(model).__name__}'s function "
                             f"(relative error above {tol:.0e}: {where}); use sequence_parallel=False")
    except BaseException:
        undo.revert()
        raise


def _fall_back(res, failed: dict) -> None:
    """A failed unit splits a safer way where there is one (a mixture of experts whose block ends in
    a norm reduces its experts where they are made, not at its output), else stays whole."""
    from tensorpar.sharding.feasibility import generic
    moe = {generic(n) for n, p in res.placements.items() if p.style == "moe"}
    for name, why in failed.items():
        if name.startswith("@unsync:"):
            param = name.split(":", 1)[1]
            for n in [n for n, p in res.placements.items() if p.style == "grad_sync" and generic(n) == param]:
                del res.placements[n]
            res.notes.append(f"{param}: gradient not all-reduced ({why} when it was)")
        elif name in moe:
            for n, p in list(res.placements.items()):
                if p.style == "moe" and generic(n) == name:
                    res.placements[n] = replace(p, style="moe_split", why=f"{p.why}; one reduction failed: {why}")
            res.notes.append(f"{name}: experts reduced where they are made ({why})")
        else:
            res.whole[name] = why
    M.drop_whole(res)


def _check_dense(model) -> None:
    """Refuse a model that is, or holds a module that is, already parallelized."""
    for name, mod in model.named_modules():
        if hasattr(mod, "tp_report") or isinstance(mod, _PARALLEL):
            what = "it has a tp_report" if not name else (
                f"its submodule {name!r} " + ("has a tp_report" if hasattr(mod, "tp_report")
                                             else f"is a {type(mod).__name__}"))
            raise ValueError(f"model is already parallelized ({what}); build a fresh dense model")


def _check(model, res, tp_size) -> None:
    """A user plan against its modules' kinds and its family's units, then every split size."""
    needs_heads = [n for n, p in res.placements.items() if STYLES[p.style].needs_heads]
    if needs_heads and res.dims is None:
        raise ValueError(f"styles on {needs_heads[:3]} need the model's head counts, which its config "
                         f"does not give (num_attention_heads, hidden_size)")
    if res.source == "user":
        modules = {n: s for n, s in res.styles().items() if STYLES[s].target == "module"}
        checks.check_plan(model, modules, res.arch, res.dims, tp_size, base_prefix(model))
    feas = feasibility_report(res.arch or type(model).__name__, sizes_of(model, res), tp_size)
    res.feasibility = feas
    if not feas.ok:
        raise ValueError(feas.error_message())
    res.notes = feas.fixes + res.notes


def _context(model, name: str, p, regs: dict, res, tp_group, tp_size, tp_rank) -> StyleContext:
    """The builder's context: the sizes (inside an attention region, its module's own heads),
    whether an enclosing region copies the input in, and whether a ``moe`` region reduces the
    block's output once for all its partial sums."""
    anchor = M.region_of(name, regs)
    dims = res.dims
    if anchor is not None and dims is not None and regs[anchor].style == "attention":
        dims = attention_dims(model.get_submodule(anchor), dims)
    return StyleContext(tp_group, tp_size, tp_rank, dims, anchor is not None, p,
                        reduce_later=anchor is not None and regs[anchor].style in ("moe", "moe_experts"))


def _build(model, res, tp_group, tp_size, tp_rank) -> dict:
    """``{name: Built}`` for every placement with a builder; a block whose builder refuses it is
    left whole (an ``"auto"`` plan; a user plan raises)."""
    while True:
        built, failed = {}, {}
        regs = M.regions(res.placements)
        for name, p in res.placements.items():
            style = STYLES[p.style]
            if style.build is None:
                continue
            owner = model.get_submodule(name.rpartition(".")[0]) if style.target == "param" else (
                model.get_submodule(name))
            ctx = _context(model, name, p, regs, res, tp_group, tp_size, tp_rank)
            try:
                built[name] = style.build(owner, ctx, name)
            except ValueError as exc:
                if res.strict:
                    raise
                failed[name] = str(exc)
        if not failed:
            return built
        res.whole.update(failed)
        M.drop_whole(res)


__all__ = ["parallelize", "REGION_STYLES", "Built"]
