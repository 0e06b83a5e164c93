"""``parallelize``: a plan applied to a model, in place, exactly or not at all.

The work walks one way, each step a module handing a typed record (:mod:`.records`) to the next:

1. **declare** (:mod:`.declare`): which plan, in tensorpar's styles (the registry's, the model's
   declaration translated, the user's, or none: pairs to discover) -> ``Declaration``;
2. **resolve** (:mod:`.resolve`): a style per concrete module and parameter, the regions, the
   gradients to synchronise, the blocks left whole and why -> ``Resolution``;
3. **check** (:mod:`.check`): every split size against tp (ValueError listing the valid tp
   sizes), a user plan against the family's units -> ``FeasibilityReport``;
4. **place** (:mod:`.place`): every replacement module and parameter shard built, without
   touching the model; in an ``"auto"`` plan a block whose builder refuses it stays whole -> ``Shards``;
5. **commit** (:mod:`.commit`): swap modules and parameters, re-tie, install the region hooks,
   set per-rank head counts; every change is logged so it can be undone -> ``Undo``;
6. **prove** (:mod:`.prove`): the split model against the dense one on example inputs, forward
   and backward, every parameter's gradient; a block that fails is restored whole (``"auto"``)
   or the whole model is restored and ``ValueError`` names it (a user plan).

A model on the meta device has no weights to run: its replica (:mod:`.replica`, built once) is
what discovery and the proof run, through the same steps (:func:`_split_exactly`), never through
``parallelize`` again. After any error the model is exactly as it was (parameters, module types,
hooks, attributes).
"""
from __future__ import annotations

import copy
from dataclasses import replace

import torch
from torch import nn

from tensorpar import distributed as dist
from tensorpar.architecture.plans import generic
from tensorpar.distributed import dp_engines
from tensorpar.nn import ColumnParallelLinear, ReplicatedHeadLinear, RowParallelLinear, VocabParallelEmbedding
from tensorpar.nn.layers import tp_info
from tensorpar.nn.rebase import COLUMN_FORWARDS
from tensorpar.architecture import pipeline as arch_pipeline
from tensorpar.distributed import pipelining
from tensorpar.sharding import marks, pipelined, probes, sequence, stage_cut
from tensorpar.sharding.check import check
from tensorpar.sharding.commit import commit, tag_params
from tensorpar.sharding.declare import declare
from tensorpar.sharding.place import place
from tensorpar.sharding.prove import TOLERANCE, Evidence
from tensorpar.sharding.replica import replica_of
from tensorpar.sharding.parallelize_report import ParallelizeReport
from tensorpar.sharding.resolve import resolve

_PARALLEL = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ReplicatedHeadLinear)
MAX_ATTEMPTS = 8  # place -> commit -> prove rounds: each one leaves at least one more unit whole


def parallelize(model: nn.Module, plan="auto", *, tp_group=None, mesh=None, data_parallel: str | None = None,
                sequence_parallel: bool = False, example_inputs=None, prove: bool = True,
                pipeline: str | None = None, microbatches: int = 1, virtual_stages: int | None = None,
                stage_blocks=None) -> nn.Module:
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
    :mod:`tensorpar.distributed.dp_engines`. Each dp rank then trains on its own slice of the batch.

    ``sequence_parallel=True``: between the regions of each block (norms, residuals, dropout)
    every rank holds only its chunk of the sequence, all-gathered into each region and
    reduce-scattered out of it (:mod:`tensorpar.sharding.sequence`); the sequence length must
    then divide by tp. Proved, with ``prove``, against the split model without it.

    ``pipeline``: a schedule name (``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``,
    ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``, ...: :mod:`tensorpar.architecture.pipeline`)
    on a mesh with dimensions ``("pp", "dp", "tp")``: the model is cut into ``pp x virtual_stages``
    stages of consecutive blocks (``stage_blocks``: the blocks of each; default as even as
    possible, the extra ones to the first stages), each split by tensor parallelism as above and
    made data-parallel as above, run by PyTorch's pipelining with ``microbatches`` microbatches per
    step. Returns a :class:`~tensorpar.sharding.pipelined.PipelinedModel` holding this rank's stages
    (train it with :func:`tensorpar.models.training.train_step`); the model passed in is then
    only the source of its pieces.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_dense(model)
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    dp_engines.check_args(mesh, tp_group, data_parallel, pipeline)
    cut = _check_pipeline(model, mesh, pipeline, microbatches, virtual_stages, stage_blocks, sequence_parallel)
    if mesh is not None:
        tp_group = dp_engines.tp_group_of(mesh)
    tp_size, tp_rank = tp_info(tp_group)  # ValueError on a rank outside tp_group
    params_total = sum(p.numel() for p in model.parameters())
    on_meta = any(p.is_meta for p in model.parameters())
    decl = declare(model, plan)
    replica = _replica(model, decl, tp_size, prove, on_meta)
    res = resolve(model, decl, tp_size, example_inputs, runnable=replica)
    res.layer_params_total = sum(p.numel() for _, b in probes.blocks(model) for p in b.parameters())
    _checked(model, res, tp_size)
    seq_blocks = sequence.check(model, res, tp_size) if sequence_parallel else None
    evidence = None
    if prove and tp_size > 1 and on_meta:  # no weights to run: prove the replica instead
        res.whole.update(_replica_whole(replica, plan, tp_group, example_inputs))
        marks.drop_whole(res)
    elif prove and tp_size > 1:
        evidence = Evidence.collect(model, res, example_inputs)
    shards, undo = _split_exactly(model, res, tp_group, evidence)
    if sequence_parallel:
        _sequence_parallel(model, res, seq_blocks, tp_group, tp_size, undo,
                           prove and not on_meta, example_inputs)
        if not (prove and not on_meta):
            res.notes.append("sequence parallelism applied without its proof (" +
                             ("no weights to run" if on_meta else "prove=False") + ")")
    tag_params(model, shards)
    model.tp_report = ParallelizeReport.of(model, res, tp_group, tp_size, tp_rank, params_total,
                                           proved=("replica" if on_meta else True) if prove and tp_size > 1
                                           else tp_size == 1)
    if cut is not None:
        return _pipelined(model, mesh, data_parallel, sequence_parallel, cut, microbatches)
    if data_parallel is not None:
        try:
            dp_engines.apply(model, mesh, data_parallel, [block for _, block in probes.blocks(model)])
        except BaseException:  # exactly or not at all: the split undone too
            undo.revert()
            del model.tp_report
            model.__dict__.pop("_tp_param_tags", None)
            raise
        model.tp_report.data_parallel, model.tp_report.dp_group = data_parallel, mesh["dp"].get_group()
        model.tp_report.dp_size = mesh["dp"].size()
    model.tp_report.sequence_parallel = sequence_parallel
    return model


def _check_pipeline(model, mesh, pipeline, microbatches, virtual_stages, stage_blocks, sequence_parallel):
    """``(anatomy, schedule, virtual, blocks per stage)`` of a pipelined ``parallelize``, None without
    a pipeline: the arguments checked and the model's order traced, before any collective."""
    if pipeline is None:
        if virtual_stages is not None or stage_blocks is not None or microbatches != 1:
            raise ValueError("microbatches, virtual_stages and stage_blocks are pipeline settings: give "
                             "pipeline= a schedule name (and a mesh with a 'pp' dimension)")
        return None
    blocks = len(probes.blocks(model))
    schedule, virtual, sizes = pipelined.check(pipeline, microbatches, virtual_stages, stage_blocks, blocks,
                                               mesh["pp"].size())
    return stage_cut.anatomy(model, arch_pipeline.stage_ranges(sizes)), schedule, virtual, sizes


def _pipelined(model, mesh, data_parallel, sequence_parallel, cut, microbatches):
    """The split ``model`` cut into this rank's stages (:mod:`.stage_cut`), each made data-parallel,
    under the schedule (:mod:`.pipelined`)."""
    anat, schedule, virtual, sizes = cut
    report = model.tp_report
    pp, pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
    ranges = arch_pipeline.stage_ranges(sizes)
    indices = arch_pipeline.stages_of_rank(pp_rank, pp, virtual, schedule)
    chunks = report.tp_size if sequence_parallel else 1
    canon = {id(p): n for n, p in model.named_parameters()}  # before the cut: a tied head's first name
    tied = {canon[id(p)] for p in _tied_params(model, anat)}
    slices = report.tp_size > 1 and not sequence_parallel and anat.hidden % report.tp_size == 0

    def chunks_of(i):  # slices to and from a neighbouring stage on another rank (a V's tip is local)
        def away(j):
            return 0 <= j < len(ranges) and arch_pipeline.rank_of_stage(j, pp, schedule) != pp_rank
        return (pipelining.send_chunk if away(i + 1) else None, pipelining.receive_chunk if away(i - 1) else None,
                report.tp_group) if slices else None

    raw = [stage_cut.build_stage(model, anat, i, ranges, seq_chunks=chunks, tp_chunks=chunks_of(i)) for i in indices]
    if schedule in arch_pipeline.SPLIT_BACKWARD:  # a fused linear + all-reduce node would run twice
        for mod in model.modules():
            if isinstance(mod, COLUMN_FORWARDS):
                mod.fuse_grad_allreduce = False
    # each stage's parameters by their name in it -> by their name in the whole model
    where = [{n: canon[id(p)] for n, p in st.model.named_parameters(remove_duplicate=False)} for st in raw]
    first, last = (arch_pipeline.rank_of_stage(s, pp, schedule) for s in (0, len(ranges) - 1))
    tied_group = pipelining.tied_groups(mesh, first, last) if tied and first != last else None
    wrapped = []
    for stage in raw:  # data parallelism may replace a stage's parameters (DTensors): names found again after
        stage_blocks = [b for b in stage.model.get_submodule(anat.stack_name) if any(True for _ in b.parameters())]
        wrapped.append(dp_engines.wrap_stage(stage, mesh, data_parallel, stage_blocks))
    names = {id(st.model.get_parameter(n)): c for st, m in zip(raw, where) for n, c in m.items()}
    copies = {}  # a tied tensor's name -> its parameters on this rank (two when one rank holds both stages)
    for st, m in zip(raw, where):
        for n, c in m.items():
            p = st.model.get_parameter(n)
            if c in tied and all(p is not q for q in copies.get(c, [])):
                copies.setdefault(c, []).append(p)
    for ps in copies.values():
        for p in ps:  # held by the first and the last stage: clipping counts it once
            p.tp_pp_replicas = 2 if tied_group is not None else len(ps)
    if data_parallel is not None:
        report.data_parallel, report.dp_group, report.dp_size = data_parallel, mesh["dp"].get_group(), mesh["dp"].size()
    report.sequence_parallel = sequence_parallel
    report.pp_size, report.pp_rank, report.pp_group, report.pp_last_rank = pp, pp_rank, mesh["pp"].get_group(), last
    report.schedule, report.microbatches, report.virtual_stages = schedule, microbatches, virtual
    report.stage_blocks, report.stages = [list(r) for r in ranges], indices
    out = pipelined.PipelinedModel(wrapped, raw, config=getattr(model, "config", None), report=report,
                                   schedule=schedule, microbatches=microbatches, pp_group=mesh["pp"].get_group(),
                                   tied=list(copies.values()), tied_group=tied_group, names=names)
    out._tp_param_tags = model.__dict__.get("_tp_param_tags")
    return out


def _tied_params(model, anat) -> list:
    """Parameters held both by a piece before the blocks and by one after them (a tied head)."""
    before = {id(p) for name, _ in anat.before for p in model.get_submodule(name).parameters()}
    return [p for name in anat.after for p in model.get_submodule(name).parameters() if id(p) in before]


def _sequence_parallel(model, res, blist, tp_group, tp_size, undo, prove: bool, given_inputs) -> None:
    """Sequence parallelism on the split model; with ``prove``, the model's output and every
    gradient with it equal those without it (rounding only), else everything is undone."""
    try:
        inputs = sequence.example(model, given_inputs, tp_size) if prove else None
        before = sequence.run(model, inputs) if prove else None
        sequence.apply(model, res, blist, tp_group, undo)
        if not prove:
            return
        try:
            after = sequence.run(model, inputs)
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:  # the same on every rank
            raise ValueError(f"sequence_parallel=True: {type(model).__name__} fails on sequence chunks "
                             f"({type(exc).__name__}: {exc}); use sequence_parallel=False") from exc
        errors = sequence.differences(model, before, after, blist)
        tol = TOLERANCE.get(probes.least_precise({before[2], after[2]}), 1e-4)
        keys = sorted(errors)
        worst = torch.tensor([errors[k][0] for k in keys], dtype=torch.float64)
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
    marks.drop_whole(res)


def _check_dense(model) -> None:
    """Refuse a model that is, or holds a module that is, already parallelized."""
    for name, mod in model.named_modules():
        if hasattr(mod, "tp_report") or isinstance(mod, _PARALLEL):
            what = "it has a tp_report" if not name else (
                f"its submodule {name!r} " + ("has a tp_report" if hasattr(mod, "tp_report")
                                             else f"is a {type(mod).__name__}"))
            raise ValueError(f"model is already parallelized ({what}); build a fresh dense model")


def _checked(model, res, tp_size) -> None:
    """Step 3, its report and fixes (KV-head replication, vocabulary padding) kept in ``res``."""
    res.feasibility = check(model, res, tp_size)
    res.notes = res.feasibility.fixes + res.notes


def _replica(model, decl, tp_size: int, prove: bool, on_meta: bool):
    """The one replica a model on the meta device is run through, where anything must run: to
    discover its pairs, to complete its declaration, to prove its split. None otherwise."""
    needed = decl.source == "discovered" or (tp_size > 1 and (prove or decl.source == "declared"))
    return replica_of(model, tp_size) if on_meta and needed else None


def _replica_whole(replica, plan, tp_group, example_inputs) -> dict:
    """``{generic block: why}``: what the proof leaves whole on the replica, split by the same
    steps (every rank holds the same replica: the proof's collectives line up)."""
    plan = copy.deepcopy(plan) if isinstance(plan, dict) else plan
    res = resolve(replica, declare(replica, plan), tp_info(tp_group)[0], example_inputs, runnable=replica)
    _checked(replica, res, tp_info(tp_group)[0])
    _split_exactly(replica, res, tp_group, Evidence.collect(replica, res, example_inputs))
    return dict(res.whole)


def _split_exactly(model, res, tp_group, evidence):
    """Steps 4 to 6 until the proof passes: ``(Shards, Undo)``. A failed unit is undone and split
    a safer way or left whole (an ``"auto"`` plan), at most :data:`MAX_ATTEMPTS` rounds; a user
    plan that fails raises ``ValueError`` with the model restored."""
    for _ in range(MAX_ATTEMPTS):
        shards = place(model, res, tp_group)
        undo = commit(model, res, shards, tp_group)
        failed = evidence.check(model, res, shards, tp_group) if evidence is not None else {}
        if not failed:
            return shards, undo
        undo.revert()
        if res.strict:
            raise ValueError("plan does not compute the model's function: " +
                             "; ".join(f"{k}: {v}" for k, v in failed.items()))
        _fall_back(res, failed)
    raise ValueError(f"could not split {type(model).__name__} exactly after {MAX_ATTEMPTS} attempts")


__all__ = ["parallelize"]
