"""Feasibility (divisibility with fixes, memory) and the layout search with its explanation."""
import json

import pytest

from tensorpar.planner import Layout, ModelSpec, get_hardware, get_model, plan, search
from tensorpar.planner.feasibility import clean_tp_sizes, valid_tp_sizes
from tensorpar.planner.search import tp_sweep

H100 = get_hardware("h100-sxm")


def test_heads_not_divisible_is_infeasible_with_valid_sizes():
    r = plan(get_model("llama-2-7b"), Layout(tp=3), H100)
    assert not r.feasible and r.memory_per_device is None
    assert r.reasons == ["tp_size (3) does not fit this llama model: tp_size (3) must divide n_heads (32); "
                         "tp_size (3) must divide n_kv_heads (32) or be a multiple of it; tp_size (3) must divide "
                         "the MLP width ffn (11008); valid tp sizes: 1, 2, 4, 8, 16, 32"]
    json.dumps(r.to_dict(), allow_nan=False)


def test_kv_heads_replicated_when_tp_is_a_multiple():
    m = get_model("llama-3-8b")  # 32 heads, 8 kv heads
    assert valid_tp_sizes(m) == [1, 2, 4, 8, 16, 32]
    r = plan(m, Layout(tp=16, workload="inference"), H100)
    assert r.feasible
    (fix,) = r.fixes
    assert fix["dimension"] == "kv_heads" and fix["kv_cache_factor"] == 2
    assert fix["extra_params"] == 32 * 2 * 4096 * 128 * (16 - 8)  # K and V of 8 extra kv heads per layer
    assert r.kv_cache_bytes_per_token["replication"] == 2


def test_kv_heads_neither_dividing_nor_multiple():
    m = ModelSpec(family="llama", layers=2, hidden=96, heads=12, kv_heads=4, ffn=240, vocab=64, seq=8)
    assert valid_tp_sizes(m) == [1, 2, 4, 12]
    r = plan(m, Layout(tp=6), H100)
    assert not r.feasible and ("tp_size (6) must divide n_kv_heads (4) or be a multiple of it; valid tp sizes: "
                               "1, 2, 4, 12") in r.reasons[0]


def test_valid_tp_sizes_are_the_runtimes_the_mlp_width_divides():
    """The runtime does not pad the MLP (ParallelMLP needs tp | ffn), so neither does the planner:
    ffn 100 at tp 8 is refused, naming ffn and the sizes that split it (the planner used to pad
    it to 104 and call tp 8 feasible, a layout the runtime refuses); the vocabulary is padded."""
    m = ModelSpec(family="gpt", layers=2, hidden=64, heads=8, ffn=100, vocab=50257, seq=32)
    assert valid_tp_sizes(m) == [1, 2, 4]
    r = plan(m, Layout(tp=8), H100)
    assert not r.feasible and r.memory_per_device is None
    assert r.reasons == ["tp_size (8) does not fit this gpt2 model: tp_size (8) must divide the MLP width ffn (100); "
                         "valid tp sizes: 1, 2, 4"]
    r = plan(m, Layout(tp=4), H100)
    assert r.feasible and [f["dimension"] for f in r.fixes] == ["vocab"]
    assert r.fixes[0]["extra_params"] == (50260 - 50257) * 64  # tied: one matrix
    assert 0 < r.fixes[0]["extra_flops_fraction"] < 1e-3
    assert clean_tp_sizes(m) == [1]


def test_sequence_parallel_and_pipeline_divisibility():
    m = ModelSpec(family="llama", layers=6, hidden=64, heads=4, vocab=64, seq=10)
    r = plan(m, Layout(tp=4, pp=8, sequence_parallel=True), H100)
    assert any("splits seq (10) over tp (4)" in x for x in r.reasons)
    assert any("pp (8) makes 8 stages, more than the model's 6 blocks; valid pp sizes: 1 to 6" in x for x in r.reasons)
    uneven = plan(m, Layout(pp=4, global_batch=4), H100)  # the runtime's cut: 2, 2, 1, 1 blocks
    assert uneven.feasible and [s["n_blocks"] for s in uneven.pipeline["stages"]] == [2, 2, 1, 1]


def test_memory_over_capacity_names_the_parts_and_remedies():
    r = plan(get_model("llama-2-70b"), Layout(tp=1), get_hardware("a100-80gb"))
    assert not r.feasible and r.memory_per_device["total"] > 80e9
    (reason,) = r.reasons
    assert reason.startswith("memory per device") and "exceeds capacity 80.00 GB" in reason
    assert "--recompute full" in reason


def test_inference_memory_has_kv_cache_and_no_optimizer():
    r = plan(get_model("llama-2-7b"), Layout(tp=2, micro_batch=4, workload="inference"), H100)
    mem = r.memory_per_device
    assert mem["gradients"] == mem["optimizer"] == 0
    assert mem["kv_cache"] == 4 * 4096 * r.kv_cache_bytes_per_token["per_device"]
    assert mem["weights"] == r.params_per_device * 2


def test_layout_validation_names_value_and_choices():
    with pytest.raises(ValueError, match=r"recompute \('some'\) must be one of: none, selective, full"):
        Layout(recompute="some")
    with pytest.raises(ValueError, match=r"tp \(0\) must be a positive integer"):
        Layout(tp=0)
    with pytest.raises(ValueError, match=r"global_batch \(10\) must be a multiple of micro_batch x dp \(2 x 2 = 4\)"):
        Layout(dp=2, micro_batch=2, global_batch=10)


def test_search_ranks_feasible_first_and_keeps_tp_in_a_node():
    m = get_model("llama-2-70b")
    res = search(m, H100, devices=32, global_batch=64, zero_stage=1, recompute="full", sequence_parallel=True)
    assert len(res.candidates) == 21  # (tp, pp) pairs with tp * pp dividing 32
    flags = [c["feasible"] for c in res.candidates]
    assert flags == sorted(flags, reverse=True)
    feasible = [c for c in res.candidates if c["feasible"]]
    estimates = [c["estimate_s"] for c in feasible]
    assert estimates == sorted(estimates) and res.best == feasible[0]
    assert res.best["tp"] <= 8
    assert any("stays within a node" in line for line in res.explanation)
    assert all(c["reasons"] for c in res.candidates if not c["feasible"])
    json.loads(res.to_json(allow_nan=False))


def test_search_says_when_tp_is_slower_than_one_device():
    """A small model's decode on PCIe: tp 2 and 4 halve and quarter the weight reads (the lower
    bound) but pay ~25 collectives' latency, so the estimate ranks tp=1 first and says why."""
    gpt2 = ModelSpec(family="gpt", layers=12, hidden=768, heads=12, vocab=50257, seq=1024)
    res = search(gpt2, get_hardware("h100-pcie"), devices=4, workload="inference")
    text = " ".join(res.explanation)
    assert res.best["tp"] == 1 and "Expected slower than tp=1 with the same pp" in text
    floor = min((c for c in res.candidates if c["feasible"]), key=lambda c: c["bound_s"])
    assert floor["tp"] > 1 and floor["estimate_s"] > res.best["estimate_s"]
    assert f"tp={floor['tp']}, pp={floor['pp']}, dp={floor['dp']} has the lowest lower bound" in res.explanation[0]


def test_search_with_nothing_feasible_explains_why():
    res = search(get_model("llama-3-405b"), get_hardware("a100-40gb"), devices=2)
    assert res.best is None and res.explanation[0].startswith("No layout of 2 devices is feasible")


def test_search_rejects_bad_device_counts():
    with pytest.raises(ValueError, match=r"devices \(0\) must be a positive integer"):
        search(get_model("llama-2-7b"), H100, devices=0)


def test_tp_sweep_memory_falls_and_comm_rises():
    rows = tp_sweep(get_model("llama-2-13b"), Layout(micro_batch=1, workload="train"), H100)
    assert [r["tp"] for r in rows] == valid_tp_sizes(get_model("llama-2-13b"))
    weights = [r["memory_per_device"]["weights"] for r in rows]
    comm = [r["comm_bytes_per_device_per_step"]["tp"] for r in rows]
    assert weights == sorted(weights, reverse=True) and comm[0] == 0 and comm == sorted(comm)


def test_the_estimate_keeps_tp_within_a_node_where_the_bound_would_cross_it():
    """llama-2-70b decode on 16 H100s: tp=16 has the lowest bound (a sixteenth of the weights per
    device) but its collectives cross the 50 GB/s network; the estimate ranks tp=8 within a node
    first and names the layout with the lowest bound it passed over."""
    res = search(get_model("llama-2-70b"), H100, devices=16, workload="inference", micro_batch=8)
    assert res.best["tp"] == 8
    floor = min((c for c in res.candidates if c["feasible"]), key=lambda c: c["bound_s"])
    assert floor["tp"] == 16 and floor["estimate_s"] > res.best["estimate_s"] and floor["bound_s"] < res.best["bound_s"]
    assert "tp=16, pp=1, dp=1 has the lowest lower bound" in res.explanation[0]
    assert "stays within a node" in res.explanation[1]


def test_tp_across_nodes_when_nothing_within_a_node_fits():
    one_layer = ModelSpec(family="llama", layers=1, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000,
                          seq=4096)  # 1.7 GB per device at tp=4, 2.9 GB or more at tp <= 2
    small = H100.with_overrides(mem_bytes=2e9, devices_per_node=2)
    res = search(one_layer, small, devices=4, workload="inference")
    assert res.best["tp"] == 4 and not any(c["feasible"] and c["tp"] <= 2 for c in res.candidates)
    assert "no layout with tp within a node fits" in res.explanation[1]


def test_the_estimate_ranks_and_the_bound_breaks_ties():
    """Feasible first; then the estimate (the bound where a layout has none), then the bound."""
    from tensorpar.planner.search import _rank
    rows = [dict(tp=1, pp=1, feasible=True, bound_s=1.0, estimate_s=3.0),
            dict(tp=2, pp=1, feasible=True, bound_s=0.5, estimate_s=3.0),
            dict(tp=4, pp=1, feasible=True, bound_s=2.5, estimate_s=None),
            dict(tp=8, pp=1, feasible=False, bound_s=0.1, estimate_s=0.1),
            dict(tp=1, pp=2, feasible=True, bound_s=2.0, estimate_s=2.0)]
    assert [(r["tp"], r["pp"]) for r in sorted(rows, key=_rank)] == [(1, 2), (4, 1), (2, 1), (1, 1), (8, 1)]
    res = search(get_model("llama-2-13b"), get_hardware("a100-80gb"), devices=16, workload="inference",
                 micro_batch=4)
    assert res.explanation[0].startswith(f"Choose tp={res.best['tp']}, pp={res.best['pp']}, dp={res.best['dp']}: "
                                         "lowest estimated decode latency per token")
    assert f"the runner-up, tp={res.candidates[1]['tp']}, pp={res.candidates[1]['pp']}" in res.explanation[0]


def test_padding_fixes_are_listed_only_for_a_split_the_heads_allow():
    m = ModelSpec(family="gpt", layers=2, hidden=64, heads=8, ffn=128, vocab=50257, seq=32)
    r = plan(m, Layout(tp=3), H100)  # heads 8 do not split in 3, so padding the vocabulary would not help
    assert not r.feasible and r.fixes == [] and "must divide n_heads (8)" in r.reasons[0]
    assert [f["dimension"] for f in plan(m, Layout(tp=8), H100).fixes] == ["vocab"]
