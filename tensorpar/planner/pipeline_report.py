"""The pipeline of a layout, stage by stage and rank by rank: the blocks each stage holds, its
parameters per rank, the activations each pipeline rank keeps in flight under the schedule, the
point-to-point bytes at each stage boundary, and the schedule's bubble (standard library only).

What crosses a boundary is what tensorpar's runtime sends (:mod:`tensorpar.sharding.pipelined`):
per microbatch the hidden states, ``(b, s / t if sequence parallel else s, h)`` in the model's
dtype, from stage ``k`` to ``k + 1`` in forward, and their gradient back in backward; without
sequence parallelism each tp rank sends its ``1 / t`` slice of the hidden dim (when ``h`` divides
by ``t``) and the receiving stage all-gathers them over tp (Megatron-LM's scatter/gather). Two adjacent stages on one rank (the tip of a V) hand them over in
memory. Activations in flight on a pipeline rank: the schedule's peak stage-microbatches alive
(:func:`.schedules.microbatches_alive`) times the largest per-microbatch activations among the
rank's stages (exact when they hold equal blocks, an upper bound otherwise).
"""
from __future__ import annotations

from tensorpar.architecture.pipeline import rank_of_stage, stage_ranges, stages_of_rank
from tensorpar.architecture.split_model import SplitModel

from . import split_memory
from .layout import Layout
from .schedules import SOURCES, bubble_fraction, microbatches_alive
from .stages import Stages, layers_of


def boundary_bytes(hidden: int, layout: Layout, seq: int) -> int:
    """Bytes one tp rank sends across a stage boundary per microbatch, each way: its chunk of the
    sequence under sequence parallelism, else its ``1 / tp`` slice of the hidden dim when it
    divides (the receiver all-gathers the slices over tp), else the whole hidden states."""
    t = layout.tp
    tokens = seq // t if layout.sequence_parallel else seq
    n = layout.micro_batch * tokens * hidden * layout.bytes_per_elem
    return n // t if t > 1 and not layout.sequence_parallel and hidden % t == 0 else n


def stage_bytes_per_microbatch(split: SplitModel, st: Stages, layout: Layout, seq: int, tp_rank: int) -> list:
    """Activation bytes each stage keeps for one microbatch on ``tp_rank`` (its blocks, the first
    stage's embedding mask, the last stage's head inputs and logits)."""
    per_layer = split_memory.layer_bytes(split, layout, seq, tp_rank, layout.recompute)
    return [split_memory.stage_activation_bytes(split, st, s, layout, seq, tp_rank, 1, per_layer=per_layer)
            for s in range(st.pp)]


def rank_alive(layout: Layout, rank: int) -> int:
    return microbatches_alive(layout.schedule, pp=layout.pp, microbatches=layout.num_micro_batches,
                              virtual=layout.virtual_stages, rank=rank)


def rank_activation_bytes(per_stage: list, layout: Layout, rank: int) -> float:
    """Activations pipeline rank ``rank`` holds at its peak (see the module docstring)."""
    mine = stages_of_rank(rank, layout.pp, layout.virtual_stages, layout.schedule)
    return rank_alive(layout, rank) * max(per_stage[s] for s in mine)


def pipeline_section(split: SplitModel, st: Stages, layout: Layout, seq: int) -> dict:
    """``PlanReport.pipeline``: the schedule, its bubble, one row per stage and per pipeline rank."""
    train = layout.workload == "train"
    m, p, v, name = layout.num_micro_batches, layout.pp, layout.virtual_stages, layout.schedule
    per_tp = [stage_bytes_per_microbatch(split, st, layout, seq, r) for r in range(split.tp)] if train else None
    sent = boundary_bytes(split.hidden, layout, seq)
    ranges = stage_ranges([len(layers_of(st, s)) for s in range(st.pp)])
    stage_rows = []
    for s in range(st.pp):
        local = s + 1 < st.pp and rank_of_stage(s + 1, p, name) == rank_of_stage(s, p, name)
        crosses = s + 1 < st.pp and not local
        stage_rows.append({
            "stage": s, "rank": rank_of_stage(s, p, name), "blocks": list(ranges[s]),
            "n_blocks": ranges[s][1] - ranges[s][0],
            "params_per_rank": max(sum(q.ranks[r].numel for q in split.params if s in st.homes[q.name])
                                   for r in range(split.tp)),
            "activation_bytes_per_microbatch": max(b[s] for b in per_tp) if train else None,
            "p2p_bytes_per_microbatch": {"forward": sent if crosses else 0,
                                         "backward": sent if crosses and train else 0},
            "next_stage_on_same_rank": local})
    rank_rows = []
    for r in range(p):
        mine = stages_of_rank(r, p, v, name)
        rank_rows.append({
            "rank": r, "stages": mine,
            "microbatches_alive": rank_alive(layout, r) if train else None,
            "activation_bytes_in_flight": max(rank_activation_bytes(b, layout, r) for b in per_tp) if train else None})
    return {"schedule": name, "virtual_stages": v, "stages_total": st.pp, "microbatches": m,
            "microbatch_size": layout.micro_batch,
            "bubble_fraction": bubble_fraction(name, pp=p, microbatches=m, virtual=v) if p > 1 else 0.0,
            "bubble_source": SOURCES[name], "stages": stage_rows, "ranks": rank_rows}
