"""pipeline_step / pipeline_state_bytes (tensorpar.planner.pipeline_step): one rank's collectives
and model states in a pipelined training step, in mesh_step's form plus "pp"."""
from __future__ import annotations

import pytest

from tensorpar.planner import ModelSpec, TemplateSource
from tensorpar.planner.mesh import mesh_step, state_bytes
from tensorpar.planner.pipeline_step import PER_STEP, pipeline_state_bytes, pipeline_step

LLAMA = ModelSpec(family="llama", layers=4, hidden=8, heads=4, kv_heads=2, head_dim=2, ffn=12, vocab=10, seq=8)
GPT = ModelSpec(family="gpt", layers=4, hidden=8, heads=2, vocab=12, seq=8)
ARGS = dict(dp=1, data_parallel=None, sequence_parallel=False, seq=8, e=4)


def _counts(items):
    out = {}
    for i in items:
        if i.where not in PER_STEP and not i.where.startswith("pipeline."):
            key = (i.op, i.where, i.phase, i.payload_bytes)
            out[key] = out.get(key, 0) + i.count
    return out


def test_the_stages_tp_items_add_up_to_the_unpipelined_step():
    inv = TemplateSource(LLAMA).at(2)
    whole = mesh_step(inv, batch=2, **ARGS)["tp"]
    ranks = [pipeline_step(inv, pp=2, batch=2, schedule="GPipe", pp_rank=r, **ARGS)["tp"] for r in range(2)]
    summed = _counts(ranks[0])
    for k, n in _counts(ranks[1]).items():
        summed[k] = summed.get(k, 0) + n
    assert summed == _counts(whole)
    assert [(i.where, i.payload_bytes) for i in ranks[0] if i.where in PER_STEP] == [("train_step", 16),
                                                                                      ("clip_grad_norm", 8)]
    # the hidden states' tp slices made whole: on the receiver in forward, on the sender in backward
    whole = 2 * 8 * 8 * 4
    gathers = [[(i.op, i.where, i.phase, i.payload_bytes) for i in r if i.where.startswith("pipeline.")] for r in ranks]
    assert gathers == [[("all_gather", "pipeline.activation_grad", "backward", whole)],
                       [("all_gather", "pipeline.activation", "forward", whole)]]


def test_point_to_point_loss_and_clipping_over_pp():
    inv = TemplateSource(LLAMA).at(2)
    n = 2 * 8 * 8 * 4 // 2  # (b = 4 sequences / 2 microbatches, s, h) in fp32: each tp rank's half of h
    first, last = (pipeline_step(inv, pp=2, batch=4, schedule="GPipe", microbatches=2, pp_rank=r, **ARGS)["pp"]
                   for r in (0, 1))
    assert [(i.op, i.where, i.phase, i.payload_bytes, i.bytes_sent_per_rank, i.count) for i in first] == [
        ("send", "pipeline.activation", "forward", n, (n,), 2),
        ("recv", "pipeline.activation_grad", "backward", n, (0,), 2),
        ("broadcast", "train_step", "forward", 8, (0,), 1),  # from the last stage's rank
        ("all_reduce", "clip_grad_norm", "forward", 8, (8,), 1)]
    assert [(i.op, i.where) for i in last[:2]] == [("recv", "pipeline.activation"), ("send", "pipeline.activation_grad")]
    assert last[2].bytes_sent_per_rank == (8,)
    sp = pipeline_step(inv, pp=2, batch=4, microbatches=2, pp_rank=0, **{**ARGS, "sequence_parallel": True})["pp"]
    assert sp[0].payload_bytes == n  # each tp rank sends its sequence chunk: as many bytes as its slice


def test_tied_embedding_and_the_v():
    inv = TemplateSource(GPT).at(2)
    shard = 6 * 8 * 4  # this tp rank's rows of the (12, 8) embedding
    ends = [pipeline_step(inv, pp=2, batch=2, microbatches=2, pp_rank=r, **ARGS)["pp"] for r in (0, 1)]
    for items in ends:
        tied = [i for i in items if i.where == "pipeline.tied_embedding"]
        assert [(i.op, i.group_size, i.payload_bytes, i.bytes_sent_per_rank) for i in tied] == [
            ("all_reduce", 2, shard, (shard,))]
    v = [pipeline_step(inv, pp=2, batch=2, microbatches=2, schedule="ZBVZeroBubble", pp_rank=r, **ARGS)["pp"]
         for r in (0, 1)]
    assert not any(i.where == "pipeline.tied_embedding" for items in v for i in items)  # one rank holds both ends
    tip = [(i.op, i.where) for i in v[1] if i.where.startswith("pipeline.activation")]
    assert tip == [("recv", "pipeline.activation"), ("send", "pipeline.activation_grad"),  # stage 1 with stage 0
                   ("send", "pipeline.activation"), ("recv", "pipeline.activation_grad")]  # stage 2 with stage 3


def test_dp_per_stage_and_state_bytes():
    inv = TemplateSource(LLAMA).at(1)
    args = {**ARGS, "dp": 2, "data_parallel": "ddp"}
    dp = pipeline_step(inv, pp=2, batch=4, microbatches=2, schedule="Interleaved1F1B", pp_rank=0, **args)["dp"]
    assert [(i.payload_bytes, i.count) for i in dp if i.where == "train_step"] == [(8, 1)]  # once for two stages
    # an all-reduce per replicated unit once per step: blocks 0 and 2 (stages 0 and 2), stage 0's embedding
    assert sum(i.count for i in dp if i.where == "data_parallel") == 3
    assert {i.phase for i in dp} == {"forward"}  # after the schedule's last microbatch, outside autograd
    held = [pipeline_state_bytes(inv, pp=2, dp=2, data_parallel="ddp", e=4, pp_rank=r)["params"] for r in (0, 1)]
    assert sum(held) == state_bytes(inv, dp=2, data_parallel="ddp", e=4)["params"]


def test_bad_arguments_name_the_value():
    inv = TemplateSource(LLAMA).at(2)
    with pytest.raises(ValueError, match=r"pp_rank \(2\) must be one of 0..1"):
        pipeline_step(inv, pp=2, batch=2, schedule="GPipe", pp_rank=2, **ARGS)
    with pytest.raises(ValueError, match=r"schedule 'Zig' does not exist; valid: GPipe"):
        pipeline_step(inv, pp=2, batch=2, schedule="Zig", **ARGS)
    with pytest.raises(ValueError, match=r"microbatches=3 does not divide the batch of 2"):
        pipeline_step(inv, pp=2, batch=2, microbatches=3, schedule="GPipe", **ARGS)
