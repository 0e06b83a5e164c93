"""The plan's pipeline section (tensorpar.planner.pipeline_report) and the schedule in the
layout: stages cut as the runtime cuts them, activations in flight per schedule, boundary bytes,
bubble; bad schedules refused with the valid choices."""
from __future__ import annotations

import pytest

from tensorpar.planner import Layout, ModelSpec, get_hardware, plan
from tensorpar.planner.schedules import bubble_fraction

MODEL = ModelSpec(family="llama", layers=6, hidden=16, heads=4, kv_heads=2, ffn=32, vocab=64, seq=8)
H100 = get_hardware("h100-sxm")


def _plan(**kw):
    return plan(MODEL, Layout(dtype="fp32", **kw), H100)


def test_stages_blocks_params_and_boundaries():
    r = _plan(pp=4, tp=2, micro_batch=2, global_batch=8, schedule="GPipe")
    p = r.pipeline
    assert [s["blocks"] for s in p["stages"]] == [[0, 2], [2, 4], [4, 5], [5, 6]]  # remainder to the first stages
    assert p["microbatches"] == 4 and p["schedule"] == "GPipe" and p["virtual_stages"] == 1
    whole = 2 * 8 * 16 * 4  # (b, s, h) in fp32
    sent = whole // 2  # each tp rank's slice of the hidden dim (the receiver all-gathers them over tp)
    assert [s["p2p_bytes_per_microbatch"] for s in p["stages"]] == [{"forward": sent, "backward": sent}] * 3 + [
        {"forward": 0, "backward": 0}]
    assert [s["params_per_rank"] for s in p["stages"]] == r.params_per_stage
    sp = _plan(pp=2, tp=2, micro_batch=2, global_batch=4, sequence_parallel=True)
    assert sp.pipeline["stages"][0]["p2p_bytes_per_microbatch"]["forward"] == whole // 2  # seq / tp


@pytest.mark.parametrize("schedule, alive", [("GPipe", [4, 4]), ("1F1B", [2, 1])])
def test_activations_in_flight_are_the_schedules_peak_times_the_stage(schedule, alive):
    r = _plan(pp=2, micro_batch=1, global_batch=4, schedule=schedule)
    stages, ranks = r.pipeline["stages"], r.pipeline["ranks"]
    assert [x["microbatches_alive"] for x in ranks] == alive
    assert [x["activation_bytes_in_flight"] for x in ranks] == [
        a * s["activation_bytes_per_microbatch"] for a, s in zip(alive, stages)]
    assert r.memory_per_device["activations"] == max(x["activation_bytes_in_flight"] for x in ranks)
    assert r.pipeline["bubble_fraction"] == r.estimates["pipeline_bubble_fraction"] == 1 / 5  # (p-1)/(m+p-1)


def test_multi_stage_schedules_place_stages_on_ranks():
    v = _plan(pp=2, global_batch=4, schedule="ZBVZeroBubble")
    assert [x["stages"] for x in v.pipeline["ranks"]] == [[0, 3], [1, 2]]
    assert v.pipeline["stages"][1]["next_stage_on_same_rank"]  # the V's tip hands over in memory
    assert v.pipeline["stages"][1]["p2p_bytes_per_microbatch"] == {"forward": 0, "backward": 0}
    looped = _plan(pp=2, global_batch=4, schedule="interleaved1f1b", virtual_stages=3)
    assert looped.layout["schedule"] == "Interleaved1F1B" and looped.pipeline["stages_total"] == 6
    assert looped.pipeline["bubble_fraction"] == bubble_fraction("Interleaved1F1B", pp=2, microbatches=4, virtual=3)
    assert [x["stages"] for x in looped.pipeline["ranks"]] == [[0, 2, 4], [1, 3, 5]]


def test_what_the_runtime_refuses_is_a_warning_and_bad_names_an_error():
    r = _plan(pp=4, global_batch=2)
    assert any("tensorpar train refuses this pipeline: schedule 1F1B needs microbatches >= pp (4); got 2" in w
               for w in r.warnings)
    with pytest.raises(ValueError, match=r"schedule 'zigzag' does not exist; valid: GPipe, 1F1B, Interleaved1F1B"):
        Layout(pp=2, schedule="zigzag")
    with pytest.raises(ValueError, match=r"virtual_stages \(2\) must be 1 under 1F1B"):
        Layout(pp=2, virtual_stages=2)
    with pytest.raises(ValueError, match=r"virtual_stages \(3\) must be 2 under DualPipeV"):
        Layout(pp=2, schedule="DualPipeV", virtual_stages=3)
