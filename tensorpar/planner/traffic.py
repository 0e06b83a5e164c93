"""Every collective a layout issues, read from the split model: tensor-parallel sites, pipeline
sends, data-parallel engines, per stage (standard library only).

Per micro-batch, a stage issues the collective sites of its modules (``runtime.step_items``: a
training step runs ``causal_lm_loss`` forward and backward with the logits left split by
vocabulary, the loss's reductions on the last stage; inference a forward with the head's logits
split), under sequence parallelism the sites as the runtime changes them (``mesh.sequence_sites``),
with full recomputation every block's forward sites again in backward (``recomputed``); and the
point-to-point sends of :func:`.comm.pp_p2p_items`. Per step: tensorpar's ``train_step`` compares
the batch's digest over tp (16 bytes) and sums the squared gradient norm (8 bytes); the
data-parallel engine of the ZeRO stage (0: DDP's gradient buckets, once per step; 3: FSDP2's
all-gathers and reduce-scatters per micro-batch; 1 and 2, which tensorpar does not run, the
ZeRO paper's items, :func:`.comm.dp_collectives`); and the all-reduce keeping a tensor tied
across the first and last stages equal.
"""
from __future__ import annotations

from dataclasses import replace

from tensorpar.architecture.pipeline import rank_of_stage, stages_of_rank
from tensorpar.architecture.split_model import SplitModel

from .comm import CommItem, dp_collectives, item, pp_p2p_items
from .layout import Layout
from .mesh import dp_items, sequence_sites
from .predict import _merge, _Step
from .runtime import layer_of, runs, step_items
from .stages import Stages, held, params_per_stage, tied_across


def _comm(i, group: str, *, recomputed: bool = False, note: str | None = None) -> CommItem:
    """A predicted collective (one tp rank's bytes) as the planner's :class:`CommItem`."""
    return CommItem(i.op, i.where, i.phase, group, i.group_size, i.payload_bytes, i.bytes_sent_per_rank[0],
                    i.count, recomputed, i.note if note is None else note)


def tp_micro_batch(split: SplitModel, st: Stages, stage: int, layout: Layout, seq: int,
                   phase: str) -> tuple[list, list]:
    """``(items, first block's items)`` of one micro-batch on one device of ``stage``."""
    if split.tp == 1:
        return [], []
    sites = sequence_sites(split) if layout.sequence_parallel else split.sites
    mine = tuple(s for s in sites if st.of(s.module) == stage)
    step = _Step(phase, seq, "sharded", loss=phase == "training" and stage == st.pp - 1)
    b, e = layout.micro_batch, layout.bytes_per_elem
    found, layers = step_items(replace(split, sites=mine), step, b, e)
    items = [_comm(i, "tp") for i in _merge(found)]
    if phase == "training" and layout.recompute == "full":
        again = tuple(s for s in mine if layer_of(s.module) is not None and s.phase == "forward" and runs(s, step))
        redo, _ = step_items(replace(split, sites=again), replace(step, loss=False), b, e)
        items += [_comm(i, "tp", recomputed=True, note=i.note + " (recomputed forward)") for i in _merge(redo)]
    first = [_comm(i, "tp") for i in _merge(layers[min(layers)])] if layers else []
    return items, first


def _stage_split(split: SplitModel, st: Stages, stage: int) -> SplitModel:
    """The parameters one stage holds, a tied copy included."""
    return replace(split, params=tuple(held(split, st, stage)))


def dp_step(split: SplitModel, st: Stages, stage: int, layout: Layout) -> list:
    """Data-parallel collectives of one training step on one device of ``stage``."""
    if layout.dp == 1 or layout.workload != "train":
        return []
    z, m, e = layout.zero_stage, layout.num_micro_batches, layout.bytes_per_elem
    if z in (1, 2):
        return dp_collectives(max(params_per_stage(split, st, r)[stage] for r in range(split.tp)), layout)
    engine = "ddp" if z == 0 else "fsdp"
    found = dp_items(_stage_split(split, st, stage), layout.dp, engine, e)
    per_micro_batch = engine == "fsdp"  # FSDP gathers and reduces in every forward and backward
    return [_comm(replace(i, count=i.count * (m if per_micro_batch and i.where != "clip_grad_norm" else 1)), "dp")
            for i in found]


def train_step_items(split: SplitModel) -> list:
    """``train_step``'s own collectives over tp: the batch's digest (max of ``[h, -h]``, two int64)
    and the squared gradient norm (one float64)."""
    if split.tp == 1:
        return []
    return [item("all_reduce", "train_step", "forward", "tp", split.tp, 16, note="the batch's digest compared over tp"),
            item("all_reduce", "clip_grad_norm", "forward", "tp", split.tp, 8,
                 note="the squared gradient norm summed over tp")]


def tied_items(split: SplitModel, st: Stages, stage: int, layout: Layout) -> list:
    """The gradient all-reduce between the first and last stage of a tensor tied across them."""
    tied, last = tied_across(split, st), st.pp - 1
    if layout.pp == 1 or layout.workload != "train" or not tied or stage not in (0, last):
        return []
    if rank_of_stage(0, layout.pp, layout.schedule) == rank_of_stage(last, layout.pp, layout.schedule):
        return []  # a V's first and last stage share a rank, and the tensor
    n = sum(p.ranks[0].numel for p in tied) * layout.bytes_per_elem
    return [item("all_reduce", "tied_embedding", "step", "embedding", 2, n,
                 note="keeps the first stage's embedding and the last stage's copy equal")]


def stage_step(split: SplitModel, st: Stages, stage: int, layout: Layout, seq: int) -> tuple[list, list]:
    """``(items of one step, first block's items per micro-batch)`` on one device of ``stage``."""
    phase = "training" if layout.workload == "train" else "inference"
    tp, first = tp_micro_batch(split, st, stage, layout, seq, phase)
    name = _stage_name(stage, st.pp)
    pp = pp_p2p_items(split.hidden, seq, layout, stage=name, phase=phase)
    items = [replace(i, count=i.count * layout.num_micro_batches) for i in tp + pp]
    if phase == "training":
        items += train_step_items(split)
    return items + dp_step(split, st, stage, layout) + tied_items(split, st, stage, layout), first


def rank_step(split: SplitModel, st: Stages, pp_rank: int, layout: Layout, seq: int) -> tuple[list, list]:
    """:func:`stage_step` over the stages pipeline rank ``pp_rank`` holds (``train_step``'s own
    collectives once)."""
    mine = stages_of_rank(pp_rank, layout.pp, layout.virtual_stages, layout.schedule)
    if len(mine) == 1:
        return stage_step(split, st, mine[0], layout, seq)
    steps = [stage_step(split, st, s, layout, seq) for s in mine]
    once = train_step_items(split) if layout.workload == "train" else []
    items = [i for found, _ in steps for i in found if i not in once] + once
    return _merge_comm(items), steps[0][1]


def _merge_comm(items: list) -> list:
    """Items of one kind (op, where, phase, group, payload) merged, counts summed, in first-seen order."""
    out: dict = {}
    for i in items:
        key = (i.op, i.where, i.phase, i.group, i.payload_bytes, i.recomputed)
        out[key] = i if key not in out else replace(out[key], count=out[key].count + i.count)
    return list(out.values())


def decode_items(split: SplitModel, layout: Layout) -> list:
    """One decode step of ``micro_batch`` sequences: every stage's forward sites for one token,
    the head's logits split and each rank's best candidate exchanged, and the stage hops."""
    items, _ = step_items(split, _Step("inference", 1, "sharded", next_token=True), layout.micro_batch,
                          layout.bytes_per_elem)
    out = [_comm(i, "tp") for i in _merge(items)]
    if layout.pp > 1:  # one token per sequence crosses each stage boundary
        hop = pp_p2p_items(split.hidden, 1, replace(layout, sequence_parallel=False), stage="middle",
                           phase="inference")
        out += [replace(i, count=layout.pp - 1) for i in hop if i.op == "send"]
    return out


def prefill_items(split: SplitModel, st: Stages, layout: Layout, seq: int) -> list:
    """One prompt of ``seq`` tokens per sequence through the first stage (its forward sites)."""
    return tp_micro_batch(split, st, 0, layout, seq, "inference")[0]


def _stage_name(stage: int, pp: int) -> str:
    return "all" if pp == 1 else "first" if stage == 0 else "last" if stage == pp - 1 else "middle"
