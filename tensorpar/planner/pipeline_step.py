"""A training step on a ``("pp", "dp", "tp")`` mesh, planned for one rank: every collective and
point-to-point transfer it issues and the model states it holds, as
``parallelize(model, mesh=..., pipeline=NAME, microbatches=M)`` and ``train_step`` run it
(standard library only; the same form as :func:`.mesh.mesh_step`, plus ``"pp"``).

Per pipeline rank, over the stages its schedule gives it
(:func:`tensorpar.architecture.pipeline.stages_of_rank`), each microbatch of ``batch / dp / M``
sequences:

- ``tp``: each stage's tensor-parallel sites (the loss's on the last stage), as :func:`.mesh.mesh_step`
  plans them, ``M`` times; ``train_step``'s batch digest and clipping over tp once;
- ``dp``: each stage's data-parallel units (its blocks, then the stage itself), reduced once after
  the last microbatch (:func:`_dp_step`), the step's own items (the loss averaged over dp, FSDP's
  clipping) once;
- ``pp``: at every boundary to a stage on another rank, the hidden states
  ``(b, s / t if sequence parallel else s, h)`` in the model's dtype sent forward and their
  gradient sent back, each tp rank's ``1 / t`` slice of the hidden dim when they are whole on every
  tp rank (an all-gather over tp makes them whole again: in forward on the receiver, in backward
  on the sender): ``send`` (the payload) on the sender, ``recv`` (0 bytes) on the receiver;
  the tied embedding's gradient (this rank's tp shard) all-reduced over the two ranks holding the
  first and the last stage, when they differ; the loss broadcast (8 bytes) from the last stage's
  rank; clipping's all-reduce of 8 bytes.
"""
from __future__ import annotations

from dataclasses import replace

from tensorpar.architecture.pipeline import default_virtual, rank_of_stage, schedule_name, stages_of_rank
from tensorpar.architecture.ring import ring_bytes_sent as _ring
from tensorpar.architecture.split_model import ModelInventory

from .collectives import ring_bytes_sent
from .layout import check_size, check_virtual
from .mesh import DATA_PARALLEL, block_of, fsdp_unit_elems, sequence_sites, state_bytes
from .predict import PredictedCollective, _merge, _Step
from .runtime import generic_name, step_items
from .schedules import check_schedule
from .stages import blocks, held, stages, tied_across, why_not



PER_STEP = ("train_step", "clip_grad_norm")  # train_step's own items, once however many stages a rank holds


def _layout(inv: ModelInventory, pp: int, dp: int, batch: int, schedule: str, microbatches: int, virtual):
    """``(schedule, virtual, Stages)``, every argument checked."""
    for name, v in (("pp", pp), ("dp", dp), ("batch", batch)):
        check_size(name, v)
    if batch % dp:
        raise ValueError(f"batch ({batch}) must divide by dp ({dp}): each dp rank trains on its share")
    name, v, _ = check_schedule(pp=pp, blocks=len(blocks(inv)), schedule=schedule, microbatches=microbatches,
                                virtual=virtual, batch=batch // dp)
    return name, v, stages(inv, pp * v)


def _check_rank(name: str, value: int, size: int) -> None:
    if not isinstance(value, int) or not 0 <= value < size:
        raise ValueError(f"{name} ({value!r}) must be one of 0..{size - 1}")


def pipeline_step(inv: ModelInventory, *, pp: int, dp: int, data_parallel: str | None, sequence_parallel: bool,
                  batch: int, seq: int, e: int, schedule: str = "1F1B", microbatches: int = 1,
                  virtual: int | None = None, pp_rank: int = 0, tp_rank: int = 0, clip: bool = True) -> dict:
    """Every collective of one training step of the rank at ``(pp_rank, dp rank, tp_rank)``
    (every dp rank issues the same): ``{"tp": [...], "dp": [...], "pp": [...]}``."""
    name, v, st = _layout(inv, pp, dp, batch, schedule, microbatches, virtual)
    _check_rank("pp_rank", pp_rank, pp)
    _check_rank("tp_rank", tp_rank, inv.tp)
    if sequence_parallel and (inv.tp < 2 or seq % inv.tp):
        raise ValueError(f"sequence_parallel needs tp >= 2 dividing seq ({seq}); tp is {inv.tp}")
    mine, b = stages_of_rank(pp_rank, pp, v, name), batch // dp // microbatches
    sites = sequence_sites(inv) if sequence_parallel else inv.sites
    tp_items = []
    for s in mine:
        own = tuple(x for x in sites if st.of(x.module) == s)
        found, _ = step_items(replace(inv, sites=own), _Step("training", seq, "sharded", loss=s == st.pp - 1), b, e)
        tp_items += [replace(i, count=i.count * microbatches) for i in found]
    tp_items = (_merge(tp_items + _slice_gathers(inv, st, mine, pp, name, b, seq, e, microbatches, sequence_parallel))
                + _tp_step_items(inv, clip))
    dp_list = _dp_step(inv, st, mine, dp, data_parallel, e, tp_rank, clip) if data_parallel else []
    pp_list = _p2p_items(inv, st, mine, pp, name, b, seq, e, microbatches, sequence_parallel) \
        + _pp_step_items(inv, st, pp, pp_rank, name, e, tp_rank, clip)
    return {"tp": tp_items, "dp": dp_list, "pp": pp_list}


def _tp_step_items(inv: ModelInventory, clip: bool) -> list:
    if inv.tp == 1:
        return []
    out = [PredictedCollective("all_reduce", "train_step", "forward", inv.tp, 16,
                               (ring_bytes_sent("all_reduce", 16, inv.tp),) * inv.tp, 1,
                               "the batch's digest compared over tp")]
    if clip:
        out.append(PredictedCollective("all_reduce", "clip_grad_norm", "forward", inv.tp, 8,
                                       (ring_bytes_sent("all_reduce", 8, inv.tp),) * inv.tp, 1,
                                       "the squared gradient norm summed over tp"))
    return out


def _dp_step(inv, st, mine, dp, data_parallel, e, tp_rank, clip) -> list:
    """Data parallelism per stage as the pipeline runs it (:func:`tensorpar.distributed.dp_engines.wrap_stage`):
    every block of the stage and the stage itself (its other parameters) are units of FSDP2's
    ``fully_shard`` (``"fsdp"``) or of its replicated sibling ``replicate`` (``"ddp"``), kept
    unsharded from the first microbatch's forward to the step's end (``reshard_after_forward=False``,
    as torchtitan shards under pipelining). The schedule reduces the gradients once, after the last
    microbatch, outside autograd (phase ``forward``): per unit an all-reduce (``"ddp"``), or an
    all-gather at the unit's first forward and a reduce-scatter (``"fsdp"``). Then the step's own
    items: the loss averaged over dp; under FSDP clipping's rows summed over dp."""
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel ({data_parallel!r}) must be one of: {', '.join(DATA_PARALLEL)}")
    if dp == 1:
        return []

    def item(op, where, payload, note):
        return PredictedCollective(op, where, "forward", dp, payload, (ring_bytes_sent(op, payload, dp),), 1, note)

    out = []
    for s in mine:
        units: dict = {}
        for p in held(inv, st, s):
            units.setdefault(block_of(p.name) or "", []).append(tuple(p.ranks[tp_rank].shape))
        root = units.pop("", [])
        for unit, shapes in [*units.items(), ("", root)]:
            if not shapes:
                continue
            where = generic_name(unit) if unit else "FSDPStageModule"
            if data_parallel == "ddp":
                n = sum(_numel(shape) for shape in shapes) * e
                out.append(item("all_reduce", "data_parallel", n, "a replicated unit's gradients averaged"))
            else:
                n = fsdp_unit_elems(shapes, dp) * e
                out.append(item("all_gather", where, n, "FSDP unit unsharded for the step"))
                out.append(item("reduce_scatter", "data_parallel", n, "FSDP gradients reduced into shards"))
    if clip and data_parallel == "fsdp":
        out.append(item("all_reduce", "clip_grad_norm", 8, "the squared gradient norm's FSDP rows summed over dp"))
    out.append(item("all_reduce", "train_step", 8, "the loss averaged over dp"))
    return _merge(out)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _p2p_items(inv, st, mine, pp, name, b, seq, e, m, sequence_parallel) -> list:
    """Sends and receives of the hidden states and their gradients, ``m`` of each per boundary:
    under sequence parallelism this tp rank's chunk of the sequence; else, when the hidden size
    divides by tp, its slice of the hidden dim (Megatron-LM's scatter/gather: the tp all-gathers
    that make them whole are :func:`_slice_gathers`); else the whole."""
    t = inv.tp
    n = b * (seq // t if sequence_parallel else seq) * inv.hidden * e
    if _sliced(inv, sequence_parallel):
        n //= t
    me = rank_of_stage(mine[0], pp, name)

    def other(s):
        return 0 <= s < st.pp and rank_of_stage(s, pp, name) != me

    def item(op, what, phase):
        return PredictedCollective(op, f"pipeline.{what}", phase, pp, n, (n if op == "send" else 0,), m,
                                   "the hidden states" if what == "activation" else "their gradient")

    out = []
    for s in mine:
        out += [item("recv", "activation", "forward")] if other(s - 1) else []
        out += [item("send", "activation", "forward")] if other(s + 1) else []
        out += [item("recv", "activation_grad", "backward")] if other(s + 1) else []
        out += [item("send", "activation_grad", "backward")] if other(s - 1) else []
    return _merge(out)


def _sliced(inv, sequence_parallel: bool) -> bool:
    """Whether the stages send each tp rank's slice of the hidden states (the runtime's rule)."""
    return inv.tp > 1 and not sequence_parallel and inv.hidden % inv.tp == 0


def _slice_gathers(inv, st, mine, pp, name, b, seq, e, m, sequence_parallel) -> list:
    """The tp all-gathers that make sliced hidden states whole: on the receiving stage in forward,
    on the sending stage (their gradient) in backward, ``m`` of each per boundary to another rank."""
    if not _sliced(inv, sequence_parallel):
        return []
    n, t = b * seq * inv.hidden * e, inv.tp
    me = rank_of_stage(mine[0], pp, name)

    def other(s):
        return 0 <= s < st.pp and rank_of_stage(s, pp, name) != me

    def item(what, phase):
        return PredictedCollective("all_gather", f"pipeline.{what}", phase, t, n, (ring_bytes_sent("all_gather", n, t),),
                                   m, "the tp ranks' slices made whole")

    out = []
    for s in mine:
        out += [item("activation", "forward")] if other(s - 1) else []
        out += [item("activation_grad", "backward")] if other(s + 1) else []
    return _merge(out)


def _pp_step_items(inv, st, pp, pp_rank, name, e, tp_rank, clip) -> list:
    """Once per step: the tied tensor's gradient, the loss broadcast, clipping over pp."""
    first, last = rank_of_stage(0, pp, name), rank_of_stage(st.pp - 1, pp, name)
    out = []
    tied = tied_across(inv, st)
    if tied and first != last and pp_rank in (first, last):
        n = sum(p.ranks[tp_rank].numel for p in tied) * e
        out.append(PredictedCollective("all_reduce", "pipeline.tied_embedding", "forward", 2, n,
                                       (ring_bytes_sent("all_reduce", n, 2),), 1,
                                       "the tied copies' gradients summed over the first and last stage"))
    if pp > 1:
        out.append(PredictedCollective("broadcast", "train_step", "forward", pp, 8,
                                       (_ring("broadcast", 8, pp, rank=pp_rank, src=last),), 1,
                                       "the loss from the last stage's rank"))
        if clip:
            out.append(PredictedCollective("all_reduce", "clip_grad_norm", "forward", pp, 8,
                                           (ring_bytes_sent("all_reduce", 8, pp),), 1,
                                           "the squared gradient norm summed over pp"))
    return out


def pipeline_state_bytes(inv: ModelInventory, *, pp: int, dp: int, data_parallel: str | None, e: int,
                         schedule: str = "1F1B", virtual: int | None = None, pp_rank: int = 0, tp_rank: int = 0,
                         dp_rank: int = 0) -> dict:
    """Parameters, gradients and AdamW moments (bytes) the rank at ``(pp_rank, dp_rank, tp_rank)``
    holds: :func:`.mesh.state_bytes` over the parameters of its stages (a tensor two of its
    stages share, once; twice under data parallelism, which gives each stage its own copy)."""
    check_size("pp", pp)
    name = schedule_name(schedule)
    v = default_virtual(name) if virtual is None else virtual
    check_virtual(name, v)
    reason = why_not(inv, pp, v)
    if reason:
        raise ValueError(reason)
    st = stages(inv, pp * v)
    _check_rank("pp_rank", pp_rank, pp)
    mine = stages_of_rank(pp_rank, pp, v, name)
    # a tensor two of its stages share (a V's tied embedding and head) is one parameter, unless data
    # parallelism wraps each stage on its own: then each stage holds its copy (summed each step)
    params = tuple(p for p in inv.params for s in mine if s in st.homes[p.name]
                   if data_parallel is not None or s == next(t for t in mine if t in st.homes[p.name]))
    return state_bytes(replace(inv, params=params), dp=dp, data_parallel=data_parallel, e=e, tp_rank=tp_rank,
                       dp_rank=dp_rank)


__all__ = ["pipeline_step", "pipeline_state_bytes"]
