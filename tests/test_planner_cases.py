"""The planner against every published or formula-derived figure in planner_cases.json.

Each case kind (by id prefix) maps to planner functions that compute its expected keys from its
inputs. Every numeric expected value is either reproduced within the case's tolerance
(``tolerance_rel``, or ``tolerance_abs`` for that key when given), or is a measurement that is
checked against the planner's lower bounds (no measured time may beat a bound), or is listed in
``NOT_REPRODUCED`` with the reason. Values with provenance "derived" must all be reproduced.
"""
import dataclasses
import json
import math
from pathlib import Path

import pytest

from tensorpar.planner import Layout, ModelSpec, get_hardware, get_model, plan
from tensorpar.planner import collectives as C
from tensorpar.planner import flops as F
from tensorpar.planner import memory as M
from tensorpar.planner.comm import pp_collectives, tp_collectives
from tensorpar.planner.hardware import Hardware
from tensorpar.planner.params import count_params

# The cases ship with the tests, so CI checks them on any clone. When the project's shared/
# folder sits beside the checkout, its copy must be the same file (drift is a failure, not a skip).
PATH = Path(__file__).resolve().parent / "data" / "planner_cases.json"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "reference_cases" / "planner_cases.json"
CASES = json.loads(PATH.read_text())["cases"]
BY_ID = {c["id"]: c for c in CASES}

# Quoted figures the planner does not (and should not) recompute, with the reason.
NOT_REPRODUCED = {
    ("shoeybi2019_scaling_efficiency", "mp_only_8gpu_8_3B_efficiency"): "read off Fig. 5; the inputs hold no throughput for that run",
    ("shoeybi2019_scaling_efficiency", "mp_dp_512gpu_efficiency"): "read off Fig. 5; the inputs hold no throughput for that run",
    ("shoeybi2019_scaling_efficiency", "baseline_pct_of_peak"): "the paper rounds 39/125 = 31.2% to '30%', outside 1%; checked as achieved <= peak instead",
}
# Measurements: checked against lower bounds in the tests below, not recomputed.
MEASURED = {"iteration_time_s", "a100_effective_busbw_GBps", "h100_ring_effective_busbw_GBps",
            "h100_nvls_allreduce_busbw_GBps", "h200_observed_allreduce_busbw_GBps"}


def _gpt(i, **kw) -> ModelSpec:
    return ModelSpec(family="gpt", layers=i["layers"], hidden=i["hidden"], heads=i["heads"], ffn=i.get("ffn"),
                     vocab=i.get("vocab", 51200), seq=i["seq"], **kw)


def _kv_model(i, **changes) -> ModelSpec:
    i = {**i, **changes}
    heads = i.get("heads", i["kv_heads"])
    return ModelSpec(family="llama", layers=i["layers"], hidden=i.get("hidden", heads * i["head_dim"]), heads=heads,
                     kv_heads=i["kv_heads"], head_dim=i["head_dim"], vocab=1, seq=1)


def map_training_time(c):
    i = c["inputs"]
    days = F.training_days_eq4(i["params"], i["tokens"], i["n_gpus"], i["achieved_tflops_per_gpu"] * 1e12)
    return {"training_days": days, "derived_training_days_eq4": days}


def map_tp_comm(c):
    i = c["inputs"]
    # per-layer collectives do not depend on the head count; heads = tp keeps the split valid
    model = ModelSpec(family="gpt", layers=1, hidden=i["hidden"], heads=i["tp"], vocab=i["tp"], seq=i["seq"])
    lay = Layout(tp=i["tp"], micro_batch=i["microbatch"], dtype={2: "bf16", 4: "fp32"}[i["bytes_per_elem"]],
                 sequence_parallel=i["sequence_parallel"], recompute=i["activation_recompute"])
    items = tp_collectives(model, lay, phase="training")["per_layer"]
    sends = [x for x in pp_collectives(model, dataclasses.replace(lay, pp=2), stage="first") if x.op == "send"]
    return {"allreduces_per_layer_fwd": sum(x.count for x in items if x.phase == "forward"),
            "allreduces_per_layer_bwd": sum(x.count for x in items if x.phase == "backward"),
            "allreduce_payload_bytes": items[0].payload_bytes,
            "ring_allreduce_bytes_sent_per_device": items[0].bytes_sent_per_device,
            "tp_bytes_sent_per_layer_per_device": sum(x.total_bytes_sent for x in items),
            "pp_p2p_bytes_per_microbatch": sends[0].payload_bytes,
            "pp_p2p_bytes_per_microbatch_scatter_gather": sends[0].bytes_sent_per_device}


def _megatron_hw(h) -> Hardware:
    if h["name"].startswith("A100"):
        return get_hardware(h["name"])
    # DGX-2H V100: the case gives peak and links only; "300 GB/s" is read as per direction and the
    # 100 GB/s node network as per device (the larger readings, so the bounds stay true). HBM
    # (V100 datasheet, 900 GB/s) does not enter a training-step bound.
    return Hardware(name=h["name"], peak_dense_bf16_flops=h["peak_dense_fp16_flops"], hbm_bytes_per_s=900e9,
                    mem_bytes=32e9, links={"nvswitch": 2 * h["intra_node_bw_bytes_per_s"]},
                    intra_node_link="nvswitch", inter_node_bytes_per_s=h["inter_node_bw_bytes_per_s_per_node"],
                    devices_per_node=16)


def map_megatron(c):
    i, e = c["inputs"], c["expected"]
    model = _gpt(i)
    hw_flops = F.hardware_flops_per_iteration(model, i["global_batch"], i["activation_recompute"])
    tokens = i["global_batch"] * i["seq"]
    base = next(b for b in CASES if b["id"].startswith("megatron_readme2020")
                and b["inputs"]["hardware"]["name"] == i["hardware"]["name"] and b["inputs"]["n_gpus"] == 1)
    bi = base["inputs"]
    achieved = F.achieved_flops_per_device(hw_flops, i["n_gpus"], e["iteration_time_s"]) / 1e12
    return {"params_billion": count_params(model) / 1e9, "params_eq2": count_params(model),
            "flops_per_iteration_eq3": hw_flops, "derived_tflops_per_gpu": achieved, "tflops_per_gpu": achieved,
            "weak_scaling_efficiency": F.weak_scaling_efficiency(
                count_params(model), tokens, i["n_gpus"], e["iteration_time_s"], base_params=count_params(_gpt(bi)),
                base_tokens=bi["global_batch"] * bi["seq"], base_n_devices=bi["n_gpus"],
                base_seconds=base["expected"]["iteration_time_s"])}


def map_korthikanti(c):
    i = c["inputs"]
    model = _gpt(i)
    t, pp, layers = i["tp"], i["pp"], i["layers"]
    assert i["bytes_per_activation"] == 2

    def act(tp, sp=False, rc="none"):
        return M.activation_bytes_per_layer(model, seq=i["seq"], micro_batch=i["microbatch"], tp=tp,
                                            sequence_parallel=sp, recompute=rc, bytes_per_elem=2)

    out = {"per_layer_no_parallel_bytes": act(1), "per_layer_tp_bytes": act(t),
           "per_layer_tp_sp_bytes": act(t, True), "per_layer_tp_selective_bytes": act(t, False, "selective"),
           "per_layer_tp_sp_selective_bytes": act(t, True, "selective"), "per_layer_full_recompute_bytes": act(t, False, "full"),
           # Eq. 5-6 assume at least pp micro-batches (1F1B keeps pp in flight on stage 0)
           "first_stage_total_tp_sp_bytes_eq5": M.first_stage_activation_bytes(act(t, True), layers, pp, pp),
           "first_stage_total_tp_sp_selective_bytes_eq6": M.first_stage_activation_bytes(act(t, True, "selective"), layers, pp, pp),
           "reduction_tp_baseline_vs_tp_sp_selective": act(t) / act(t, True, "selective")}
    if i["interleave_stages"]:
        v = i["interleave_stages"]
        out["interleave_factor"] = M.interleave_factor(pp, v)
        out["first_stage_total_tp_sp_selective_interleaved_bytes"] = M.first_stage_activation_bytes(
            act(t, True, "selective"), layers, pp, pp, interleave=v)
    return out


def map_shoeybi_scaling(c):
    i = c["inputs"]
    eff = F.scaling_efficiency(i["aggregate_pflops"] * 1e15, i["n_gpus"], i["baseline_tflops_single_gpu"] * 1e12)
    return {"derived_efficiency": eff, "scaling_efficiency_abstract": eff}


def map_shoeybi_table1(c):
    n = count_params(_gpt(c["inputs"]))
    return {"params_eq2": n, "params_billion": n / 1e9}


def map_zero_adam(c):
    psi = c["inputs"]["params"]
    states = M.model_state_bytes(psi, bytes_per_elem=2)
    return {"bytes_per_param": sum(M.model_state_bytes(1, bytes_per_elem=2).values()),
            "K_optimizer": M.optimizer_bytes_per_param(2), "model_state_bytes_gpt2_1_5B": sum(states.values()),
            "fp16_param_bytes_gpt2_1_5B": states["weights"]}


def map_zero_table(c):
    i = c["inputs"]
    assert i["K"] == M.optimizer_bytes_per_param(2)
    gb = {s: sum(M.model_state_bytes(i["params"], dp=i["dp"], zero_stage=s, bytes_per_elem=2).values()) / 1e9
          for s in (1, 2, 3)}
    return {"pos_GB": gb[1], "pos_g_GB": gb[2], "pos_g_p_GB": gb[3],
            "derived_pos_GB": gb[1], "derived_pos_g_GB": gb[2], "derived_pos_g_p_GB": gb[3]}


def map_zero_comm(c):
    psi = c["inputs"]["params"]
    v = {s: C.zero_dp_comm_elements(psi, s) for s in (0, 1, 2, 3)}
    assert v[1] == v[2]
    return {"dp_allreduce_elements_per_device": v[0], "pos_and_pos_g_elements": v[1],
            "pos_g_p_elements": v[3], "pos_g_p_over_dp": v[3] / v[0]}


def map_kv(c):
    i, e = c["inputs"], c["expected"]
    model = _kv_model(i)
    kv = M.kv_cache_bytes_per_token(model, tp=i.get("tp", 1), bytes_per_elem=i["bytes_per_elem"])
    per_token = kv["total"]
    out = {"kv_bytes_per_token": per_token, "quoted_per_token_bytes": per_token}
    for key in e:
        if key.startswith("kv_bytes_") and key.endswith("_tokens"):
            out[key] = per_token * int(key.split("_")[2])
    if "tokens" in i:
        seq_bytes = per_token * i["tokens"]
        out |= {"derived_kv_bytes": seq_bytes, "kv_bytes_sequence_quoted_GB": seq_bytes / 1e9,
                f"quoted_kv_bytes_{i['tokens']}_tokens": seq_bytes}
    out["quoted_2048_tokens_GB"] = per_token * 2048 / 1e9
    if "tp" in i:
        out[f"kv_bytes_per_token_per_device_tp{i['tp']}"] = kv["per_device"]
        out["kv_bytes_per_token_if_mha"] = M.kv_cache_bytes_per_token(
            _kv_model(i, kv_heads=i["heads"]), bytes_per_elem=i["bytes_per_elem"])["total"]
    if "batch" in i:
        total = per_token * i["batch"] * i["context"]
        out |= {"derived_kv_total_bytes": total, "kv_total_bytes_quoted": total,
                "derived_ratio_to_bf16_params": total / M.weight_bytes(i["params"], 2)}
    return out


def map_nccl_factors(c):
    n, s = c["inputs"]["n_ranks"], c["inputs"]["size_bytes"]
    out = {f"{op.replace('_', '')}_factor": C.bus_bandwidth_factor(op, n)
           for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")}
    return out | {"ring_allreduce_bytes_sent_per_rank": C.ring_bytes_sent("all_reduce", s, n),
                  "allgather_bytes_received_per_rank": C.unavoidable_device_bytes("all_gather", s, n),
                  "reducescatter_bytes_sent_per_rank": C.ring_bytes_sent("reduce_scatter", s, n)}


def map_nccl_measured(c):
    i = c["inputs"]
    t = i["time_us"] * 1e-6
    alg = C.algorithm_bandwidth(i["size_bytes"], t) / 1e9
    return {"algbw_GBps": alg, "derived_algbw_GBps": alg,
            "busbw_GBps": C.bus_bandwidth("all_reduce", i["size_bytes"], t, i["n_ranks"]) / 1e9}


def map_nccl_effective(c):
    a100, h100 = get_hardware("a100-80gb"), get_hardware("h100-sxm")
    e = c["expected"]
    return {"a100_nvlink_line_rate_per_direction_GBps": a100.intra_node_bytes_per_s / 1e9,
            "a100_nvlink_line_rate_bidirectional_GBps": a100.nvlink_total_bidirectional_bytes_per_s / 1e9,
            "h100_nvlink_line_rate_per_direction_GBps": h100.intra_node_bytes_per_s / 1e9,
            "h100_nvls_allreduce_algbw_GBps": e["h100_nvls_allreduce_busbw_GBps"] / C.bus_bandwidth_factor("all_reduce", 8),
            "derived_allreduce_time_1GiB_8xH100_ring_s": C.ring_time_estimate(
                "all_reduce", 2**30, 8, bytes_per_s=e["h100_ring_effective_busbw_GBps"] * 1e9)}


def map_hw(c):
    hw = get_hardware(c["inputs"]["device"])
    return {"peak_dense_bf16_flops": hw.peak_dense_bf16_flops, "peak_sparse_bf16_flops": hw.peak_sparse_bf16_flops,
            "hbm_bytes_per_s": hw.hbm_bytes_per_s, "mem_bytes": hw.mem_bytes,
            "nvlink_total_bidirectional_bytes_per_s": hw.nvlink_total_bidirectional_bytes_per_s,
            "pcie_x16_bidirectional_bytes_per_s": hw.pcie_x16_bidirectional_bytes_per_s,
            "derived_ridge_flops_per_byte": hw.ridge_flops_per_byte()}


def _decode_model(c) -> ModelSpec:
    name = {"llama2_70b": "llama-2-70b", "llama2_7b": "llama-2-7b"}[next(k for k in ("llama2_70b", "llama2_7b") if k in c["id"])]
    model, i = get_model(name), c["inputs"]
    assert (model.layers, model.hidden, model.kv_heads) == (i["layers"], i["hidden"], i["kv_heads"])
    return model


def map_decode(c):
    i = c["inputs"]
    model = _decode_model(c)
    e = {"bf16": 2}[i["dtype"]]
    total = M.weight_bytes(i["params"], e)
    per_device = M.weight_bytes(i["params"], e, shards=i["tp"])
    # tp = 1 issues no collectives; the per-token all-reduces a split would issue do not depend on
    # tp, so they are taken from a tp = 2 split of the same model
    lay = Layout(tp=max(2, i["tp"]), micro_batch=i["batch"], dtype=i["dtype"], workload="inference")
    layer_ars = [x for x in tp_collectives(model, lay, seq=1)["per_micro_batch"] if x.where.startswith("layer.")]
    return {"params_exact": count_params(model), "weight_bytes_total": total, "weight_bytes_per_device": per_device,
            "decode_lower_bound_ms_per_token": 1e3 * per_device / i["hardware"]["hbm_bytes_per_s"],
            "tp_allreduce_payload_bytes_per_token": layer_ars[0].payload_bytes,
            "allreduces_per_token": sum(x.count for x in layer_ars if x.op == "all_reduce")}


MAPPERS = [
    ("narayanan2021_eq4", map_training_time), ("tp_comm_per_layer", map_tp_comm),
    ("megatron_readme2020", map_megatron), ("korthikanti2022_actmem", map_korthikanti),
    ("shoeybi2019_scaling", map_shoeybi_scaling), ("shoeybi2019_table1", map_shoeybi_table1),
    ("zero_mixed_precision", map_zero_adam), ("zero_table1", map_zero_table), ("zero_comm", map_zero_comm),
    ("kv_", map_kv), ("nccl_busbw_factors", map_nccl_factors), ("nccl_measured", map_nccl_measured),
    ("nccl_effective", map_nccl_effective), ("hw_", map_hw), ("derived_decode_lb", map_decode),
]


def mapper(case_id):
    return next((fn for prefix, fn in MAPPERS if case_id.startswith(prefix)), None)


def _close(got, want, rel, abs_tol):
    if want is None or got is None:
        return got is want
    return math.isclose(got, want, rel_tol=max(rel, 1e-12), abs_tol=abs_tol)


def test_every_case_kind_is_mapped():
    unmapped = [c["id"] for c in CASES if mapper(c["id"]) is None]
    assert not unmapped, f"cases with no planner mapping: {unmapped}"


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_case_values_reproduced(case):
    got = mapper(case["id"])(case)
    rel, abs_tols = case.get("tolerance_rel", 0.0), case.get("tolerance_abs", {})
    provenance = case.get("provenance", {})
    for key, want in case["expected"].items():
        if isinstance(want, str):
            continue  # quoted as text ("800 KB", "1.6 GB"); its number is a neighbouring key
        if key in MEASURED or (case["id"], key) in NOT_REPRODUCED:
            assert not str(provenance.get(key, "")).startswith("derived"), f"derived {key} must be reproduced"
            continue
        assert key in got, f"{case['id']}: no planner value for {key}"
        assert _close(got[key], want, rel, abs_tols.get(key, 0.0)), (
            f"{case['id']}.{key}: planner {got[key]!r}, expected {want!r} (rel tol {rel}, abs {abs_tols.get(key, 0.0)})")


def test_quoted_values_not_reproduced_are_listed():
    listed = "; ".join(f"{cid}.{key}: {why}" for (cid, key), why in NOT_REPRODUCED.items())
    pytest.skip(f"quoted values deliberately not recomputed: {listed}")


MEGATRON = [c for c in CASES if c["id"].startswith("megatron_readme2020")]


@pytest.mark.parametrize("case", MEGATRON, ids=[c["id"] for c in MEGATRON])
def test_measured_iteration_time_not_below_step_bound(case):
    i = case["inputs"]
    hw = _megatron_hw(i["hardware"])
    lay = Layout(tp=i["tp"], pp=i["pp"], dp=i["dp"], micro_batch=i["global_batch"] // i["dp"],
                 global_batch=i["global_batch"], recompute=i["activation_recompute"], dtype="fp16")
    r = plan(_gpt(i), lay, hw)
    measured = case["expected"]["iteration_time_s"]
    assert 0 < r.step_time_lower_bound_s <= measured, (r.step_time_lower_bound_s, measured)
    assert case["expected"]["tflops_per_gpu"] * 1e12 <= hw.peak_dense_bf16_flops
    if i["hardware"]["name"].startswith("A100"):  # the case's A100 figures are the preset's
        h = i["hardware"]
        assert (hw.peak_dense_bf16_flops, hw.hbm_bytes_per_s, hw.mem_bytes, hw.intra_node_bytes_per_s,
                hw.inter_node_bytes_per_s) == (h["peak_dense_bf16_flops"], h["hbm_bytes_per_s"], h["mem_bytes"],
                                                h["intra_node_bw_bytes_per_s_per_direction"], h["inter_node_bw_bytes_per_s_per_gpu"])


@pytest.mark.parametrize("cid, model", [("narayanan2021_eq4_training_time_gpt3_175B", "gpt3-175b"),
                                        ("narayanan2021_eq4_training_time_1T", "megatron-1t")])
def test_quoted_training_days_not_below_bound(cid, model):
    """Training on A100s (Narayanan et al. 2021 used DGX A100): days >= least FLOPs at peak."""
    i, m = BY_ID[cid]["inputs"], get_model(model)
    assert count_params(m) == pytest.approx(i["params"], rel=1e-3)
    flops_per_token = F.causal_flops_per_iteration(m, 1, "none") / m.seq
    hw = get_hardware("a100-80gb")
    bound_days = flops_per_token * i["tokens"] / (i["n_gpus"] * hw.peak_dense_bf16_flops) / F.SECONDS_PER_DAY
    assert bound_days <= BY_ID[cid]["expected"]["training_days"]
    assert i["achieved_tflops_per_gpu"] * 1e12 <= hw.peak_dense_bf16_flops


def test_measured_nccl_times_not_below_collective_bound():
    i = BY_ID["nccl_measured_h100pcie_2gpu"]["inputs"]
    bridged = dataclasses.replace(get_hardware("h100-pcie"), intra_node_link="nvlink")  # the run used the bridge
    bound = C.collective_time_lower_bound("all_reduce", i["size_bytes"], i["n_ranks"], per_node=2,
                                          intra_bytes_per_s=bridged.intra_node_bytes_per_s, inter_bytes_per_s=1.0)
    assert 0 < bound <= i["time_us"] * 1e-6


@pytest.mark.parametrize("key, preset", [("a100_effective_busbw_GBps", "a100-80gb"),
                                         ("h100_ring_effective_busbw_GBps", "h100-sxm"),
                                         ("h100_nvls_allreduce_busbw_GBps", "h100-sxm"),
                                         ("h200_observed_allreduce_busbw_GBps", "h200")])
def test_observed_busbw_not_faster_than_bound(key, preset):
    """An 8-rank all-reduce of 1 GiB at the observed bus bandwidth must not beat the bound. NVLink
    SHARP's 480 GB/s exceeds the 450 GB/s line rate, which is why the bound counts N received per
    device and not the ring's 2(p-1)/p N."""
    busbw = BY_ID["nccl_effective_nvlink_bw"]["expected"][key] * 1e9
    s = 2**30
    observed_time = s * C.bus_bandwidth_factor("all_reduce", 8) / busbw
    hw = get_hardware(preset)
    bound = C.collective_time_lower_bound("all_reduce", s, 8, per_node=8, intra_bytes_per_s=hw.intra_node_bytes_per_s,
                                          inter_bytes_per_s=hw.inter_node_bytes_per_s)
    assert bound <= observed_time
    ring_over_line_rate = C.ring_bytes_sent("all_reduce", s, 8) / hw.intra_node_bytes_per_s
    if key == "h100_nvls_allreduce_busbw_GBps":
        assert observed_time < ring_over_line_rate  # ring bytes at line rate would not be a bound


def test_shoeybi_throughput_not_above_peak():
    """39 TFLOP/s on one V100 and 15.1 PFLOP/s on 512 are below the V100's 125 TFLOP/s fp16 peak
    (NVIDIA V100 datasheet; the DGX-2H parts run at 130)."""
    i = BY_ID["shoeybi2019_scaling_efficiency"]["inputs"]
    assert i["baseline_tflops_single_gpu"] <= 125
    assert i["aggregate_pflops"] * 1e3 <= i["n_gpus"] * 130


@pytest.mark.skipif(not SHARED.exists(), reason="no shared/ folder beside this checkout")
def test_shipped_cases_match_the_shared_reference():
    assert json.loads(SHARED.read_text()) == json.loads(PATH.read_text()), (
        f"{SHARED} changed: copy it to {PATH} and re-run the planner tests")


# Korthikanti et al. 2022 (arXiv:2205.05198): Table 3 (heads, hidden, layers, GPUs, global batch;
# no data parallelism), Sec. 6 (s = 2048, V = 51,200, 80 GB A100s at 312 TFLOP/s bf16) and Table 5
# (iteration time with sequence parallelism + selective recomputation, "present work"; MFU and
# HFU in %). The same utilisations are in the NVIDIA/Megatron-LM README. Not in planner_cases.json,
# which ships unchanged from shared/.
KORTHIKANTI_TABLE5 = [  # model, heads, hidden, layers, gpus, global batch, seconds, MFU %, HFU %
    ("22B", 64, 6144, 48, 8, 4, 1.10, 41.5, 43.7),
    ("175B", 96, 12288, 96, 64, 64, 13.75, 51.4, 52.8),
    ("530B", 128, 20480, 105, 280, 280, 37.83, 56.0, 57.0),
    ("1T", 160, 25600, 128, 512, 512, 71.49, 56.3, 57.0),
]


@pytest.mark.parametrize("row", KORTHIKANTI_TABLE5, ids=[r[0] for r in KORTHIKANTI_TABLE5])
def test_korthikanti_table5_utilisation(row):
    """MFU = model FLOPs (Eq. 7) and HFU = hardware FLOPs with selective recomputation (Eq. 8) per
    second over n x 312 TFLOP/s. Tolerance: the quoted time is rounded to 0.01 s and the quoted
    percentages to 0.1, so each must lie in [U(t + 0.005), U(t - 0.005)] widened by 0.05 points.
    The counting of 4 B s^2 h L (one forward re-run of the scores) instead of Eq. 8's 12 gives
    HFU 42.4 / 51.8 / 56.4 / 56.5 and fails for every row."""
    _, heads, hidden, layers, gpus, batch, seconds, mfu, hfu = row
    model = ModelSpec(family="gpt", layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048)
    peak = gpus * get_hardware("a100-80gb").peak_dense_bf16_flops

    def within(flops, quoted):
        low, high = (100 * flops / peak / (seconds + d) for d in (0.005, -0.005))
        return low - 0.05 <= quoted <= high + 0.05

    assert within(F.flops_per_iteration(model, batch), mfu)
    assert within(F.hardware_flops_per_iteration(model, batch, "selective"), hfu)
    one_rerun = F.flops_per_iteration(model, batch) + 4 * batch * 2048**2 * hidden * layers
    assert not within(one_rerun, hfu)
