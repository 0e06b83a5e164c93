"""The collectives the planner predicts, against hand-computed lists for a tiny model.

Tiny llama: 2 layers, hidden 8, micro-batch 3, seq 6, fp32, tp 2, so N = 3*6*8*4 = 576 bytes;
a ring all-reduce sends 2(p-1)/p N = 576, an all-gather or reduce-scatter (p-1)/p N = 288, the
cross-entropy all-reduces carry b*s*4 = 72 bytes each (and send 72). These are the records the
runtime ledger must show (docs/architecture.md, last section), item for item.
"""
import dataclasses

import pytest

from tensorpar.planner import Layout, ModelSpec, TemplateSource, get_hardware, plan, predict_from_inventory
from tensorpar.planner.comm import bytes_sent, dp_collectives, pp_collectives, tp_collectives
from tensorpar.planner.params import params_per_device

TINY = ModelSpec(family="llama", layers=2, hidden=8, heads=4, kv_heads=2, head_dim=2, ffn=12, vocab=10, seq=6)
N, CE = 576, 72


def _lay(**kw):
    return Layout(**{"tp": 2, "micro_batch": 3, "dtype": "fp32", **kw})


def _rows(items):
    return sorted((i.op, i.where, i.phase, i.payload_bytes, i.bytes_sent_per_device, i.count, i.recomputed)
                  for i in items)


def test_inference_forward_only():
    got = tp_collectives(TINY, _lay(workload="inference"))
    assert _rows(got["per_layer"]) == sorted([
        ("all_reduce", "layer.attention", "forward", N, N, 1, False),
        ("all_reduce", "layer.mlp", "forward", N, N, 1, False)])
    assert _rows(got["per_micro_batch"]) == sorted([
        ("all_reduce", "embedding", "forward", N, N, 1, False),
        ("all_reduce", "layer.attention", "forward", N, N, 2, False),
        ("all_reduce", "layer.mlp", "forward", N, N, 2, False)])
    assert bytes_sent(got["per_micro_batch"]) == 5 * N


def test_training_forward_and_backward():
    got = tp_collectives(TINY, _lay())
    assert _rows(got["per_micro_batch"]) == sorted([
        ("all_reduce", "embedding", "forward", N, N, 1, False),
        ("all_reduce", "layer.attention", "forward", N, N, 2, False),
        ("all_reduce", "layer.attention", "backward", N, N, 2, False),
        ("all_reduce", "layer.mlp", "forward", N, N, 2, False),
        ("all_reduce", "layer.mlp", "backward", N, N, 2, False),
        ("all_reduce", "lm_head", "backward", N, N, 1, False),
        ("all_reduce", "cross_entropy", "forward", CE, CE, 3, False)])
    assert bytes_sent(got["per_micro_batch"]) == 10 * N + 3 * CE  # 5976


def test_training_with_sequence_parallelism_moves_the_same_activation_bytes():
    got = tp_collectives(TINY, _lay(sequence_parallel=True))
    h = N // 2
    assert _rows(got["per_layer"]) == sorted([
        ("all_gather", "layer.attention", "forward", N, h, 1, False),
        ("reduce_scatter", "layer.attention", "forward", N, h, 1, False),
        ("all_gather", "layer.attention", "backward", N, h, 1, False),
        ("reduce_scatter", "layer.attention", "backward", N, h, 1, False),
        ("all_gather", "layer.mlp", "forward", N, h, 1, False),
        ("reduce_scatter", "layer.mlp", "forward", N, h, 1, False),
        ("all_gather", "layer.mlp", "backward", N, h, 1, False),
        ("reduce_scatter", "layer.mlp", "backward", N, h, 1, False),
        ("all_reduce", "layer.norms", "backward", 32, 32, 2, False)])  # two RMSNorm weights, 8 x 4 bytes
    extra = [i for i in got["per_micro_batch"] if not i.where.startswith("layer.")]
    assert _rows(extra) == sorted([
        ("reduce_scatter", "embedding", "forward", N, h, 1, False),
        ("all_gather", "embedding", "backward", N, h, 1, False),
        ("all_gather", "lm_head", "forward", N, h, 1, False),
        ("reduce_scatter", "lm_head", "backward", N, h, 1, False),
        ("all_reduce", "final_norm", "backward", 32, 32, 1, False),
        ("all_reduce", "cross_entropy", "forward", CE, CE, 3, False)])
    activation = [i for i in got["per_micro_batch"] if i.payload_bytes == N]
    plain = [i for i in tp_collectives(TINY, _lay())["per_micro_batch"] if i.payload_bytes == N]
    assert bytes_sent(activation) == bytes_sent(plain)  # Korthikanti et al. 2022, Sec. 4.2.2


def test_gpt_sequence_parallel_adds_bias_and_position_gradients():
    gpt = ModelSpec(family="gpt", layers=2, hidden=8, heads=2, vocab=11, seq=4)
    got = tp_collectives(gpt, _lay(micro_batch=1, sequence_parallel=True))["per_layer"]
    small = _rows(i for i in got if i.where in ("layer.norms", "layer.row_biases"))
    assert small == [("all_reduce", "layer.norms", "backward", 32, 32, 4, False),  # 2 LayerNorms x (weight, bias)
                     ("all_reduce", "layer.row_biases", "backward", 32, 32, 2, False)]  # o_proj and fc2 biases
    pos = [i for i in tp_collectives(gpt, _lay(micro_batch=1, sequence_parallel=True))["per_micro_batch"]
           if i.where == "position_embedding"]
    assert _rows(pos) == [("all_reduce", "position_embedding", "backward", 4 * 8 * 4, 128, 1, False)]


def test_full_recompute_reissues_forward_collectives():
    got = tp_collectives(TINY, _lay(recompute="full"))["per_layer"]
    recomputed = [i for i in got if i.recomputed]
    assert _rows(recomputed) == sorted([("all_reduce", "layer.attention", "forward", N, N, 1, True),
                                        ("all_reduce", "layer.mlp", "forward", N, N, 1, True)])
    assert not [i for i in tp_collectives(TINY, _lay(recompute="selective"))["per_layer"] if i.recomputed]


def test_replicated_kv_heads_all_reduce_their_weight_gradients():
    # tp = 4 > kv_heads = 2: slots (g=2, d=2, h=8) x 4 bytes = 128 bytes, for k and for v
    got = tp_collectives(TINY, _lay(tp=4))["per_layer"]
    rows = [r for r in _rows(got) if r[1] == "layer.attention.kv_replicas"]
    assert rows == [("all_reduce", "layer.attention.kv_replicas", "backward", 128, 2 * 3 / 4 * 128, 2, False)]
    assert not [i for i in tp_collectives(TINY, _lay(tp=4, workload="inference"))["per_layer"]
                if i.where.endswith("kv_replicas")]


def test_tp1_issues_nothing_and_inference_loss_is_optional():
    assert tp_collectives(TINY, _lay(tp=1)) == {"per_layer": [], "per_micro_batch": []}
    with_loss = tp_collectives(TINY, _lay(workload="inference"), with_loss=True)["per_micro_batch"]
    assert [i.count for i in with_loss if i.where == "cross_entropy"] == [3]
    fp32_loss = tp_collectives(TINY, _lay(dtype="bf16"), loss_bytes=4)["per_micro_batch"]
    assert [i.payload_bytes for i in fp32_loss if i.where == "cross_entropy"] == [CE]  # b*s*4


def test_pipeline_sends_and_regathers():
    lay = _lay(pp=2)
    first = pp_collectives(TINY, lay, stage="first")
    assert _rows(first) == sorted([
        ("send", "pipeline.activation", "forward", N, N / 2, 1, False),  # scatter/gather: N / t per rank
        ("all_gather", "pipeline.activation_grad", "backward", N, N / 2, 1, False)])
    last = pp_collectives(TINY, lay, stage="last")
    assert _rows(last) == sorted([
        ("all_gather", "pipeline.activation", "forward", N, N / 2, 1, False),
        ("send", "pipeline.activation_grad", "backward", N, N / 2, 1, False)])
    assert [i.op for i in pp_collectives(TINY, _lay(pp=2, sequence_parallel=True), stage="middle")] == ["send", "send"]


def test_data_parallel_gradients_and_zero():
    p = params_per_device(TINY, 2)
    size = p * 4
    assert _rows(dp_collectives(p, _lay(dp=4))) == [("all_reduce", "gradients", "step", size, 1.5 * size, 1, False)]
    z3 = dp_collectives(p, _lay(dp=4, global_batch=24, zero_stage=3))  # 2 micro-batches per step
    assert sorted((i.op, i.phase, i.count) for i in z3) == [
        ("all_gather", "backward", 2), ("all_gather", "forward", 2), ("reduce_scatter", "backward", 2)]
    assert dp_collectives(p, _lay(dp=4, workload="inference")) == []


def test_plan_per_step_is_micro_batches_times_the_runtime_step_plus_dp():
    """The plan's tensor-parallel items of a step are the runtime's training step (the template's
    sites: the prediction the ledger tests check) once per micro-batch, plus train_step's digest
    and gradient-norm all-reduces once; data parallelism is one DDP bucket of every gradient and
    the loss's all-reduce."""
    lay = _lay(dp=2, global_batch=12)  # 2 micro-batches of 3 per data-parallel rank
    r = plan(TINY, lay, get_hardware("a100-80gb"))
    step = predict_from_inventory(TemplateSource(TINY).at(2), 3, TINY.seq, 4, "train")
    tp_items = [i for i in r.comm["per_step"] if i["group"] == "tp"]
    once = [(i["where"], i["payload_bytes"], i["count"]) for i in tp_items if i["where"] in ("train_step", "clip_grad_norm")]
    assert once == [("train_step", 16, 1), ("clip_grad_norm", 8, 1)]
    assert sum(i["bytes_sent_per_device"] * i["count"] for i in tp_items) == 2 * step.bytes_sent_per_rank[0] + 16 + 8
    dp_items = [i for i in r.comm["per_step"] if i["group"] == "dp"]
    assert [(i["where"], i["payload_bytes"]) for i in dp_items] == [  # and train_step's loss averaged over dp
        ("data_parallel", r.params_per_device * 4), ("train_step", 8)]
    assert [(i["op"], i["where"], i["payload_bytes"]) for i in r.comm["per_layer"]] == [
        (i.op, i.where, i.payload_bytes) for i in step.per_layer]


def test_decode_per_token_items():
    lay = dataclasses.replace(_lay(workload="inference"), micro_batch=1)
    r = plan(TINY, lay, get_hardware("h100-sxm"))
    rows = sorted((i["where"], i["payload_bytes"], i["count"]) for i in r.comm["decode_per_token"])
    # b*1*h*4 bytes at the embedding and each layer's two row splits; each rank's best (value,
    # index) pair of float64, b * tp * 16 bytes (generate's greedy exchange)
    assert rows == [("model.embed_tokens", 32, 1), ("model.layers.*.mlp.down_proj", 32, 2),
                    ("model.layers.*.self_attn.o_proj", 32, 2), ("next_token", 32, 1)]


@pytest.mark.parametrize("sp", [False, True])
def test_comm_bound_never_exceeds_ring_estimate(sp):
    m = ModelSpec(family="gpt", layers=4, hidden=256, heads=8, vocab=1000, seq=128)
    for hw in ("a100-80gb", "h100-pcie"):
        r = plan(m, _lay(tp=4, pp=2, dp=2, global_batch=12, sequence_parallel=sp, zero_stage=1), get_hardware(hw))
        assert 0 < r.comm_time_lower_bound_s <= r.estimates["comm_time_s"]
