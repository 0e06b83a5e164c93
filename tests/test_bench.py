"""The benchmark harness runs and reports what it claims (timings themselves are not tested)."""
import dataclasses
import os
import subprocess
import sys

import pytest

from tensorpar.bench.mlp import run_mlp_bench
from tensorpar.bench.summary import mlp_table, models_table, plot_model_ratios
from tensorpar.bench.timing import paired_ratio


def test_paired_ratio_is_the_median_of_per_round_ratios():
    # round 2 ran under load for both variants: its pair still says 2, the medians would not
    samples = {"a": [2.0, 4.0, 20.0], "b": [1.0, 2.0, 10.0], "c": [0.5, 1.0, 0.1]}
    assert paired_ratio(samples, "a", "b") == 2.0
    assert paired_ratio(samples, "a", ["b", "c"]) == pytest.approx(4.0 / 3.0)  # parts added per round
    # here the two differ: per-round ratios [2, 0.2, 2] -> 2; a quotient of medians would give 0.2
    assert paired_ratio({"a": [1.0, 2.0, 30.0], "b": [0.5, 10.0, 15.0]}, "a", "b") == 2.0


def test_interleaved_rotates_the_order_each_round():
    from tensorpar.bench import timing

    calls = []
    variants = {name: (lambda name=name: calls.append(name)) for name in "xyz"}
    samples = timing.interleaved(variants, repeats=6, warmup=0)
    assert calls == list("xyzyzxzxy" "zyxxzyyxz") and all(len(v) == 6 for v in samples.values())
    # rounds taken in two calls continue one rotation (start=): the same order as one call of six
    calls.clear()
    timing.interleaved(variants, repeats=4, warmup=0)
    timing.interleaved(variants, repeats=2, warmup=0, start=4)
    assert calls == list("xyzyzxzxy" "zyxxzyyxz")


@pytest.mark.multirank
def test_mlp_bench_rows_are_complete_and_the_variants_agree():
    rows = run_mlp_bench(sizes=((16, 64),), repeats=3)
    assert [r["pass"] for r in rows] == ["fwd", "fwd+bwd"]
    for r in rows:
        assert set(r["median_s"]) == {"tensorpar", "torch_tp", "dense_2t", "floor", "floor_parts"}
        assert all(v > 0 for v in r["median_s"].values())
        samples = r["samples_s"]
        assert len(samples["tensorpar"]) == r["rounds"] == 15  # 3 x 5: short samples, more rounds
        per_round = sorted(a / b for a, b in zip(samples["tensorpar"], samples["torch_tp"]))
        assert r["tensorpar_vs_torch_tp"] == pytest.approx(per_round[len(per_round) // 2], rel=1e-12)
        assert r["max_abs_diff"] <= 1e-5  # both parallel MLPs compute the dense one (float32)
        assert r["floor_max_rel_diff"] <= 1e-5  # and so does the hand-written floor
    table = mlp_table(rows)
    assert table.count("\n") == 2 + len(rows) and "| 16 | 64 | fwd |" in table


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_the_floor_computes_the_dense_mlp(world):
    """The floor the benchmark times is a tensor-parallel MLP, not something cheaper: its output,
    dX and every gradient slice equal the dense MLP's in float64 (1e-12: summation order only).
    Catches a floor without its forward or backward all-reduce, or with the bias on every rank."""
    from tensorpar import distributed as dist
    from tests import _bench_workers as W

    assert all(d <= 1e-12 for d in dist.launch(W.floor_worker, world, 8, 16, deadline=120))


@pytest.mark.multirank
def test_models_bench_rows_per_model_and_a_failed_hf_tp_is_a_row(tmp_path):
    from tensorpar.bench.models import QUICK_MODELS, run_models_bench

    # gpt2: tensorpar splits it, Hugging Face declares no tp_plan for it
    rows = run_models_bench(repeats=3, models=QUICK_MODELS + (("gpt2", {}),), batch=2, seq=16)
    archs = ("llama", "mixtral", "phi3", "gpt2")
    assert [(r["model"], r["pass"]) for r in rows] == [(a, p) for a in archs for p in ("fwd", "train")]
    layers = 2
    for r in rows:
        samples = r["samples_s"]
        assert len(samples["tensorpar"]) == r["rounds"] == 3 and all(v > 0 for v in r["median_s"].values())
        assert r["tensorpar_max_abs_diff"] <= 1e-5  # float32
        assert r["param_bytes_per_rank"] < 0.6 * r["param_bytes_total"]
        tp_ops = r["collectives"]["tensorpar"]
        if r["model"] == "gpt2":
            assert "no `tp_plan`" in r["hf_tp_error"] and r["hf_tp_error"].startswith("from_pretrained")
            assert r["tensorpar_vs_hf_tp"] is None and r["hf_tp_max_abs_diff"] is None
            assert "hf_tp" not in samples and "hf_tp" not in r["collectives"]
            assert r["max_abs_diff"] == r["tensorpar_max_abs_diff"]
            continue
        assert r["hf_tp_error"] is None and r["hf_tp_max_abs_diff"] <= 1e-5
        per_round = sorted(a / b for a, b in zip(samples["tensorpar"], samples["hf_tp"]))
        assert r["tensorpar_vs_hf_tp"] == pytest.approx(per_round[1], rel=1e-12)
        if r["pass"] == "fwd":
            # one all-reduce per attention and one per MLP or MoE layer, one for the embedding; the
            # logits gathered once
            assert tp_ops == {"all_gather": 1, "all_reduce": 2 * layers + 1}
        if r["model"] == "phi3" and r["pass"] == "fwd":  # HF gathers each fused projection's output
            assert r["collectives"]["hf_tp"]["all_gather"] == 2 * layers + 1
    table = models_table(rows)
    assert table.count("\n") == 2 + len(rows)
    assert table.count("failed: from_pretrained(tp_plan='auto'): ValueError") == 2
    assert (tmp_path / "models.png") == plot_model_ratios(rows, tmp_path / "models.png",
                                                          {"tensorpar_vs_hf_tp": "HF", "tensorpar_vs_dense_2t": "dense"}, "t")
    assert (tmp_path / "models.png").stat().st_size > 0


def test_decode_bench_rows_time_every_variant_on_the_same_tokens():
    from tensorpar.bench.decode import QUICK, run_decode_bench

    rows = run_decode_bench(3, sizes=QUICK["sizes"], batches=(2,), new=6)
    assert [r["batch"] for r in rows] == [2]
    for r in rows:
        assert set(r["per_token_s"]) == {"shm", "shm_hf", "gloo", "hf_tp", "dense_2t", "dense_lean_2t"}
        assert all(len(v) == 3 for v in r["samples_per_token_s"].values())
        assert r["same_tokens_as_dense"] == {"shm": True, "shm_hf": True, "gloo": True, "hf_tp": True,
                                             "dense_lean_2t": True}
        per_round = sorted(a / b for a, b in zip(r["samples_per_token_s"]["shm"], r["samples_per_token_s"]["hf_tp"]))
        assert r["shm_vs_hf_tp"] == pytest.approx(per_round[1], rel=1e-12)
        assert 0 < r["planner_bound_s"]
        for name in ("shm", "gloo"):
            c = r[f"{name}_collectives"]
            # per decode token: one all-reduce per attention and per MLP block (2 layers), one for the
            # embedding, one all-gather of the next token's candidates (16 bytes per row and rank)
            assert c["collectives_per_token"] == 2 * 2 + 1 + 1, c
            assert c["collective_s_per_token"] > 0 and 0 < c["share_in_collectives"]
        assert r["hardware"]["hbm_bytes_per_s"] > 0


@pytest.mark.parametrize("args, message", [
    (["--suite", "gpu"], "--suite 'gpu': unknown ['gpu']; valid: mlp, models"),
    (["--repeats", "1"], "--repeats 1: need at least 3 rounds for a median"),
])
def test_bench_bad_arguments(args, message):
    r = subprocess.run([sys.executable, "-m", "tensorpar", "bench", *args], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_train_guard_refuses_a_variant_that_computes_another_step():
    """In one process: a copy of the dense model passes the guard, a step whose loss is off by
    1e-4 makes it raise, naming the variant, before anything is timed."""
    import contextlib
    import copy

    import torch

    from tensorpar.bench.train import _adamw, _torch_step, guard
    from tensorpar.models.tiny import make_tiny_model

    dense = make_tiny_model("llama", seed=3, dtype=torch.float32)
    ids = torch.randint(0, dense.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    copy_ = copy.deepcopy(dense)
    right = _torch_step(copy_, _adamw(copy_), ids, contextlib.nullcontext)
    ok = {"dense_2t": (dense, _adamw(dense), None), "right": (copy_, None, right)}
    assert guard(ok, ids)["right"]["loss_rel_err"] <= 1e-6
    dense = make_tiny_model("llama", seed=3, dtype=torch.float32)
    copy_ = copy.deepcopy(dense)
    step = _torch_step(copy_, _adamw(copy_), ids, contextlib.nullcontext)

    def off():  # the same step, its loss reported 1e-4 too high
        res = step()
        return {**res, "loss": res["loss"] * (1 + 1e-4)}
    wrong = {"dense_2t": (dense, _adamw(dense), None), "wrong": (copy_, None, off)}
    with pytest.raises(RuntimeError, match=r"wrong loss_rel_err 1\.0"):
        guard(wrong, ids)


@pytest.fixture(scope="module")
def train_and_pipeline_rows(tmp_path_factory):
    """The train, pipeline and estimates suites' ``--quick`` runs at 3 rounds, in one launch of 2
    ranks (one checkpoint: the suites' quick Llama is the same; the estimates suite calibrates
    this machine in the same launch)."""
    import torch

    from tensorpar import distributed as dist
    from tensorpar.bench import calibrate, estimates, pipeline, train
    from tensorpar.models.tiny import make_tiny_checkpoint
    from tests import _bench_workers as W

    assert pipeline.QUICK["sizes"] == train.QUICK["sizes"] == estimates.QUICK["sizes"]
    tmp = tmp_path_factory.mktemp("bench-train-pipeline")
    path = make_tiny_checkpoint(tmp / "llama", "llama", dtype=torch.float32, **train.QUICK["sizes"])
    (tmp / "checkpoints").mkdir()
    q, p, e = train.QUICK, pipeline.QUICK, estimates.QUICK
    return dist.launch(W.train_and_pipeline_worker, 2, str(path), str(tmp / "checkpoints"),
                       (3, q["batch"], q["seq"], q["saves"]), (3, p["batch"], p["seq"], pipeline.MICROBATCHES),
                       # spell 0: the check after the windows always finds a spell, so its window is measured too
                       (3, e["batch"], e["seq"], e["new"], None, dict(calibrate.QUICK, spell=(0.0, 0.0))), backend="auto",
                       timeout=600)[0]


@pytest.mark.multirank
def test_train_bench_times_every_variant_after_the_losses_agree(train_and_pipeline_rows):
    from tensorpar.bench.summary import train_table
    from tensorpar.bench.train import CHECKPOINTS, QUICK, VARIANTS

    rows = train_and_pipeline_rows["train"]
    steps = [r for r in rows if r["kind"] == "step"]
    ckpts = [r for r in rows if r["kind"] == "checkpoint"]
    assert [r["variant"] for r in steps] == list(VARIANTS)
    assert [r["name"] for r in ckpts] == [c[0] for c in CHECKPOINTS]
    dense = steps[-1]["guard"]["loss"]
    for r in steps:
        assert r["guard"]["loss"] == pytest.approx(dense, rel=1e-5)  # every variant trains the same model
        assert len(r["samples_s"]) == r["rounds"] == 3 and r["median_s"] > 0
        if r["variant"] != "dense_2t":
            assert r["transports"] == ["shm"]
            assert r["guard"]["step2_loss_rel_err"] <= 1e-5 and r["guard"]["grad_norm_rel_err"] <= 1e-4
    by = {r["variant"]: r for r in steps}
    per_round = sorted(a / b for a, b in zip(by["tp_tp2"]["samples_s"], by["torch_dtensor_tp2"]["samples_s"]))
    assert by["tp_tp2"]["vs_baseline"] == pytest.approx(per_round[1], rel=1e-12)
    assert by["tp_dp2_fsdp"]["baseline"] == "torch_fsdp2_dp2" and by["torch_fsdp2_dp2"]["vs_baseline"] is None
    for r in ckpts:
        assert r["save_s"] > 0 and r["load_s"] > 0 and len(r["save_samples_s"]) == QUICK["saves"]
        # each rank writes its own shard, nothing gathered (the rest: DCP's per-item headers)
        assert all(0.9 < x < 1.1 for x in r["written_vs_shard"]), r["written_vs_shard"]
    table = train_table(rows)
    assert table.count("\n") == 2 + len(steps) + 1 + 2 + len(ckpts)


@pytest.mark.multirank
def test_pipeline_bench_times_both_pipelines_after_the_losses_agree(train_and_pipeline_rows):
    """The quick pipeline suite: both pipelines pass the guard, every round is timed, the ledger's
    bytes equal the planner's (microbatch 1 x 32 tokens x hidden 128 x 4 bytes, 4 microbatches,
    forward from stage 0, backward from stage 1), a bubble per rank beside the formula's 1/5."""
    from tensorpar.bench.pipeline import VARIANTS, pipeline_page, pipeline_table

    rows = train_and_pipeline_rows["pipeline"]
    steps = [r for r in rows if r["kind"] == "step"]
    stages = [r for r in rows if r["kind"] == "stage"]
    assert [r["variant"] for r in steps] == list(VARIANTS) and [r["rank"] for r in stages] == [0, 1]
    dense = steps[-1]["guard"]["loss"]
    for r in steps:
        assert r["guard"]["loss"] == pytest.approx(dense, rel=1e-5) and len(r["samples_s"]) == r["rounds"] == 3
        if r["variant"] != "dense_2t":
            assert r["guard"]["step2_loss_rel_err"] <= 1e-5 and r["guard"]["grad_norm_rel_err"] <= 1e-4
    by = {r["variant"]: r for r in steps}
    per_round = sorted(a / b for a, b in zip(by["tensorpar_pp2"]["samples_s"], by["torch_pp2"]["samples_s"]))
    assert by["tensorpar_pp2"]["vs_baseline"] == pytest.approx(per_round[1], rel=1e-12)
    hidden = 4 * 32 * 128  # (1, 32, 128) float32 per microbatch
    assert [r["sent_by_phase"] for r in stages] == [{"forward": 4 * hidden, "backward": 0},
                                                    {"forward": 0, "backward": 4 * hidden}]
    assert all(r["sent_vs_planner"] == 1.0 and r["sends"] == r["recvs"] == 4 for r in stages)
    for r in stages:
        assert r["bubble_formula"] == pytest.approx(1 / 5) and len(r["bubble_samples"]) == 3
        assert 0 < r["bubble"] < 1 and 0 < r["busy_s"] < r["schedule_s"]
    table = pipeline_table(rows)
    assert table.count("\n") == 2 + len(steps) + 1 + 2 + len(stages)
    assert pipeline_page(rows, "tensorpar bench --suite pipeline --quick").count("`tensorpar bench --suite pipeline") == 1


def test_pipeline_bench_arithmetic_on_made_up_figures():
    """The bubble of each step, the ledger's sends by phase and the planner's per-rank figure, on
    made-up numbers (no ranks)."""
    from tensorpar.bench.pipeline import bubble_fractions, planner_sends, sent_by_phase, stage_rows

    assert bubble_fractions([{"seconds": 2.0, "busy_seconds": 1.5}, {"seconds": 1.0, "busy_seconds": 0.8}]) == \
        pytest.approx([0.25, 0.2])
    records = [{"op": "send", "phase": "forward", "payload_bytes": 100}, {"op": "recv", "phase": "backward",
               "payload_bytes": 100}, {"op": "send", "phase": "forward", "payload_bytes": 100},
               {"op": "all_reduce", "phase": "forward", "payload_bytes": 8}, {"op": "send", "phase": "backward",
                                                                               "payload_bytes": 7}]
    assert sent_by_phase(records) == {"forward": 200, "backward": 7}  # receives and collectives left out
    # 3 stages on 3 ranks, the boundaries 10 and 20 bytes each way: the middle rank sends 20 forward
    # and 10 back per microbatch; the last stage's own entry (0) is not a boundary
    p2p = [{"forward": 10, "backward": 10}, {"forward": 20, "backward": 20}, {"forward": 0, "backward": 0}]
    section = {"microbatches": 4, "bubble_fraction": 2 / 6, "bubble_source": "(p-1)/(m+p-1)",
               "stages": [{"stage": s, "rank": s, "p2p_bytes_per_microbatch": p} for s, p in enumerate(p2p)]}
    assert [planner_sends(section, r) for r in range(3)] == [
        {"forward": 40, "backward": 0}, {"forward": 80, "backward": 40}, {"forward": 0, "backward": 80}]
    measured = [{"sent": {"forward": 40, "backward": 0}, "sends": 4, "recvs": 4, "bubble_samples": [0.5, 0.1, 0.3],
                 "busy_samples_s": [1.0, 2.0, 3.0], "step_samples_s": [2.0, 2.5, 4.0]}]
    row = stage_rows(measured, section)[0]
    assert row["sent_vs_planner"] == 1.0 and row["bubble"] == 0.3 and row["busy_s"] == 2.0 and row["stages"] == [0]
    assert row["bubble_formula"] == pytest.approx(1 / 3)


def test_llama_stages_cut_by_hand_compose_to_the_dense_model():
    """torchtitan's manual split, in one process: each stage holds only its blocks (the embedding on
    the first, norm and head on the last), and stage 1 after stage 0 gives the dense model's logits."""
    import torch

    from tensorpar.bench.pipeline import LlamaStage
    from tensorpar.models.tiny import make_tiny_model

    dense = make_tiny_model("llama", seed=3, dtype=torch.float64, num_hidden_layers=3)
    first, last = LlamaStage(dense, 0, 2), LlamaStage(dense, 1, 2)
    assert (len(first.layers), len(last.layers)) == (2, 1)  # the remainder to the first stage, as tensorpar cuts
    assert first.norm is None and first.lm_head is None and last.embed_tokens is None
    ids = torch.randint(0, dense.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    want = dense(input_ids=ids, use_cache=False).logits
    assert (last(first(ids)) - want).abs().max().item() <= 1e-12


@pytest.mark.multirank
def test_estimates_bench_puts_every_case_beside_its_estimate(train_and_pipeline_rows):
    """The quick estimates suite: a profile measured in the launch (every phase, both transports,
    every op), then every case (training at tp, dp and pp, decode, prefill) timed with the
    planner's estimate from that profile beside it; its terms add up to the estimate."""
    import math
    import statistics

    from tensorpar.bench.estimates import TARGET, estimates_table
    from tensorpar.planner.profile import OPS, PHASES, from_dict

    out = train_and_pipeline_rows["estimates"]
    profile = from_dict(out["profile"])
    assert set(PHASES) <= set(profile.block_call_s) and profile.measured["ranks"] == 2
    assert set(profile.links) == {"shm", "gloo"} and all(set(link.ops) == set(OPS) for link in profile.links.values())
    # the all-reduce's small payloads at more moments (after each kind's rounds: 2 kinds x 3 windows,
    # the check's one among them)
    assert all(len(link.ops["all_reduce"]["2"]["fit"]["latency"]) == 6 * 3 for link in profile.links.values())
    # the check after the windows: the dispatch probe after each of the two windows, three readings
    # of both probes, and (at spell 0) one more window: its GEMM pass and rounds in by_window
    check = profile.measured["check"]
    assert check["again"] and len(check["windows_dispatch_s"]) == 2 and len(check["speeds"]) == 3
    assert check["kept_windows"] and set(check["kept_windows"]) <= {0, 2}  # the windows with a pass
    assert 0 < check["again_dispatch_s"] < 1 and out["profile"]["measured"]["seconds_by_part"]["again"] > 0
    assert all(0 < t < 1 for t in check["dispatch_s"] + check["windows_dispatch_s"])
    assert 0.05 < check["gemm_speed"] < 20 and 0.05 < check["dispatch_speed"] < 20
    windows = profile.measured["by_window"]
    assert len(windows) == 3 and "gemm_s" in windows[2] and "block_s" in windows[2] and "gemm_s" not in windows[1]
    assert all(g.rate_flops > 0 and "median_rel_err" in g.fit for g in profile.gemm.values())
    rows = out["rows"]
    assert [r["case"] for r in rows] == ["tp2", "dp2_ddp", "dp2_fsdp", "pp2", "decode_b1", "decode_b8", "decode_hf_b1",
                                         "decode_gloo_b1", "prefill_b1", "prefill_b8"]
    for r in rows:
        assert len(r["samples_s"]) == 3 and r["measured_s"] > 0 and math.isfinite(r["estimate_s"]) and r["estimate_s"] > 0
        assert r["estimate_s"] == pytest.approx(sum(r["terms"].values()))
        assert r["measured_vs_estimate"] == pytest.approx(r["measured_s"] / r["estimate_s"])
        # each sample read at the profile's speed (the host's, measured before it), then the median
        assert 0.05 < r["host_speed"] < 20, r
        at_speed = statistics.median(t * f for t, f in zip(r["samples_s"], r["speeds"])) / r["estimate_s"]
        assert r["at_profile_speed_vs_estimate"] == pytest.approx(at_speed)
        assert r["within_target"] == (abs(r["measured_vs_estimate"] - 1) <= TARGET)
        assert r["dominant"] == max(r["terms"], key=r["terms"].get)
        assert r["host_wait_s"] == 0  # a smoke run never waits for the host
        # the dispatch probe read before every sample from the run's DISPATCH_AFTER-th probe on
        assert all(0.05 < x < 20 for x in r["dispatch_slowdowns"]), r["dispatch_slowdowns"]
    assert sum(len(r["dispatch_slowdowns"]) for r in rows) > 0  # (their arithmetic: the unit test below)
    by = {r["case"]: r for r in rows}
    assert by["pp2"]["terms"]["bubble_s"] > 0 and by["pp2"]["terms"]["pp_comm_s"] > 0
    assert by["tp2"]["terms"]["tp_comm_s"] > 0 and by["dp2_ddp"]["terms"]["dp_comm_s"] > 0
    assert by["decode_gloo_b1"]["terms"]["tp_comm_s"] != by["decode_b1"]["terms"]["tp_comm_s"]  # each its link
    assert "| tp2 |" in estimates_table(rows)
    # the wait for the slower rank, measured over both transports, priced at tp's collectives only
    assert set(profile.collective_wait) == {"shm", "gloo"}
    for w in profile.collective_wait.values():
        assert len(w["2"]["points"]) == 2 and len(w["2"]["measured"]) == 2
    assert all(by[c]["terms"]["tp_wait_s"] == 0 for c in ("dp2_ddp", "dp2_fsdp", "pp2"))
    # wait_points measures the wait: each rank sleeps S >= 2 ms on every other call, the two in turn,
    # so alone each averages S / 2 a call and together every call waits S: a wait of at least S / 2,
    # the segment's own length (S overshoots 2 ms on a loaded host, so the two are compared). Under
    # the suite's load a woken rank is also late (seen: 1.1 and 1.4 x the segment), so above it only
    # a gross error (a unit, a sum over rounds) is refused.
    (seg, both), = train_and_pipeline_rows["wait"][2]
    assert seg >= 0.95e-3 and 0.7 < (both - seg) / seg < 3, (seg, both)
    assert 1e-11 < profile.optimizer_s_per_param < 1e-6  # measured: seconds per parameter of a step


def test_the_wait_at_a_collective_is_what_calibrate_measured_less_its_latency():
    """collective_wait: each point's loop time with the collective, less the work and the link's
    fitted alpha at that group size (never below 0), by transport and size; the profile
    interpolates it by the work's length and takes the largest measured size up to the group's."""
    from tensorpar.bench.calibrate import collective_wait
    from tensorpar.planner.profile import Link, published

    links = {tr: Link(tr, {"all_reduce": {"2": {"alpha_s": a, "beta_s_per_byte": 0.0},
                                          "4": {"alpha_s": 2 * a, "beta_s_per_byte": 0.0}}})
             for tr, a in (("shm", 20e-6), ("gloo", 500e-6))}
    got = collective_wait({"shm": {2: [[1e-3, 1.07e-3], [1e-4, 1.3e-4]], 4: [[1e-4, 2.4e-4]]},
                           "gloo": {2: [[1e-4, 4e-4]]}}, links)
    assert got["shm"]["2"]["points"] == [[1e-4, pytest.approx(10e-6)], [1e-3, pytest.approx(50e-6)]]
    assert got["shm"]["4"]["points"] == [[1e-4, pytest.approx(100e-6)]] and got["gloo"]["2"]["points"] == [[1e-4, 0.0]]
    p = dataclasses.replace(published("h200"), collective_wait=got, intra_link="shm", inter_link="gloo",
                            links=links)
    assert p.wait_s(5.5e-4) == pytest.approx(30e-6)  # linear between the points
    assert p.wait_s(5e-5) == pytest.approx(5e-6)  # proportional below the shortest
    assert p.wait_s(1.0) == pytest.approx(50e-6)  # the longest's above it
    assert p.wait_s(1e-4, ranks=4) == pytest.approx(100e-6) == p.wait_s(1e-4, ranks=8)  # the largest measured
    assert p.wait_s(1e-3, "gloo") == 0.0 and p.wait_s(1e-3, "nccl") == 0.0 and p.wait_s(0.0) == 0.0
    for bad in ({"shm": {"2": {"points": [[0.0, 1e-6]]}}}, {"shm": {"2": {"points": [[2e-3, 0.0], [1e-3, 0.0]]}}},
                {"shm": {"points": [[1e-3, 0.0]]}}):
        with pytest.raises(ValueError, match="collective_wait must be"):
            dataclasses.replace(p, collective_wait=bad)


def test_calibrate_fits_recover_known_figures():
    """The GEMM fit recovers the three figures that made its points; the link fit takes alpha
    from the small payloads (a bimodal latency: the median) from 64 B (gloo's all-reduce of one
    element a rank takes a faster path) and beta from the large; with latency samples, the mean of
    the grid's and the samples' medians. Catches: the 8 B point in the median (alpha 0.95 ms), a
    mean, a fit through every size, no fallback to the smaller payloads where none is from 64 B;
    the samples pooled with the grid's points (1.2 ms), the samples alone (1.1), the 8 B or
    large samples kept, the contexts' means."""
    from tensorpar.bench.calibrate import fit_gemm
    from tensorpar.bench.calibrate_links import fit_link

    c, rate, bw = 5e-6, 50e9, 10e9
    points = [[m, n, k, c + 2 * m * n * k / rate + 4 * (m * k + k * n + m * n) / bw]
              for m in (1, 8, 64, 512) for n, k in ((128, 128), (512, 512), (1408, 512))]
    g = fit_gemm(points, 4)
    assert g.rate_flops == pytest.approx(rate, rel=1e-6) and g.bytes_per_s == pytest.approx(bw, rel=1e-6)
    assert g.fixed_s == pytest.approx(c, rel=1e-6) and g.fit["max_rel_err"] < 1e-9
    lat = [4.5e-4, 1.4e-3, 1.5e-3, 0.5e-3]  # gloo over loopback: 8 B at 0.45 ms; the rest jump by 3x
    pts = list(zip((8, 64, 512, 4096), lat)) + [(n, 1.4e-3 + n / 2e9) for n in (262144, 2097152, 16777216)]
    fit = fit_link(pts)
    assert fit["alpha_s"] == pytest.approx(1.4e-3) and fit["beta_s_per_byte"] == pytest.approx(1 / 2e9, rel=0.05)
    assert fit_link([(8, 1e-3), (32, 2e-3), (1 << 20, 5e-3)])["alpha_s"] == pytest.approx(1.5e-3)  # none from 64 B
    # none from 64 B in the grid, but samples: theirs alone, not the 8 B fallback's
    assert fit_link([(8, 1e-3), (32, 2e-3), (1 << 20, 5e-3)], [(64, 1.2e-3)])["alpha_s"] == pytest.approx(1.2e-3)
    # the samples after the fixed costs' rounds are the other context: alpha is the mean of the
    # grid's median (1.4 ms) and theirs (1.1 ms: 8 B and large payloads are not among them; with
    # either, 1.0 or 1.2), each context weighing alike (pooled in one median: 1.2 ms)
    more = [(64, 1.0e-3), (4096, 1.0e-3), (512, 1.2e-3), (64, 1.2e-3), (8, 1e-5), (8, 1e-5), (1 << 20, 1.0)]
    fit = fit_link(pts, more)
    assert fit["alpha_s"] == pytest.approx(1.25e-3) and fit["fit"]["latency"] == [[n, s] for n, s in more]
    assert "latency" not in fit_link(pts)["fit"]


def test_calibrate_keeps_the_slowest_ranks_latency_samples():
    """The all-reduce's extra samples (``LatencySamples``), per transport and group size, each the
    slowest member's; a group a rank is outside of leaves it none. Catches: the fastest rank's,
    one rank's only, samples of different moments mixed."""
    from tensorpar.bench.calibrate_links import _latency_of

    r0 = {"latency": {"gloo": {2: [(64, 1e-3), (512, 3e-3)], 3: [(64, 2e-3)]}}}
    r1 = {"latency": {"gloo": {2: [(64, 2e-3), (512, 1e-3)], 3: [(64, 1e-3)]}}}
    r2 = {"latency": {"gloo": {2: [], 3: [(64, 4e-3)]}}}
    assert _latency_of([r0, r1, r2]) == {"gloo": {2: [(64, 2e-3), (512, 3e-3)], 3: [(64, 4e-3)]}}
    assert _latency_of([{}]) == {}


def test_calibrate_takes_each_point_as_the_median_of_its_passes():
    """The rates and the collectives are measured at the start, the middle and the end of a
    calibration; each GEMM point, rate and collective point is the median of the passes that
    measured it (gloo's latency moves 2-6x between windows of seconds on a shared host). Catches:
    one pass's links kept, a mean, points of different payloads mixed."""
    from tensorpar.bench.calibrate import _median_of_passes

    def one(t, gemm=True):
        return {"gemm": {"fp32": [[1, 8, 8, t]], **({"fp64": [[1, 8, 8, 2 * t]]} if gemm else {})},
                "memory": 1e10 / t, "optimizer": t,
                "links": {"gloo": {"all_reduce": {2: [(8, t), (4096, 10 * t)]}}}}
    out = _median_of_passes([one(3.0), one(1.0, gemm=False), one(10.0, gemm=False)])
    assert out["links"] == {"gloo": {"all_reduce": {2: [(8, 3.0), (4096, 30.0)]}}}
    assert out["gemm"] == {"fp32": [[1, 8, 8, 3.0]], "fp64": [[1, 8, 8, 6.0]]}  # fp64: its one pass
    assert out["memory"] == pytest.approx(1e10 / 3.0) and out["optimizer"] == 3.0


def test_after_a_spell_calibrate_keeps_the_rates_of_the_windows_it_spared():
    """Where the check found a spell, each rate is the median over the passes whose probe GEMMs
    (the largest weight at its least and most m) took at most 1.08x the fastest pass's, their
    geometric mean; a dtype only the first window measured keeps that pass. Catches: every pass
    kept (the median of five: 1.06), the fastest alone (1.0), the least-m probe alone (it keeps
    pass 2), the threshold from the slowest pass, fp64 lost with its pass."""
    from tensorpar.bench.calibrate import _median_of_passes, spared

    def one(f, g=None, fp64=False):  # probe GEMMs at f and g (default f) times quiet; other points at f
        g = f if g is None else g
        return {"gemm": {"fp32": [[1, 8, 8, f], [1, 64, 64, 10 * f], [16, 64, 64, 100 * g]],
                         **({"fp64": [[1, 64, 64, 2.0]]} if fp64 else {})},
                "memory": 1e10 / f, "optimizer": f, "links": {"gloo": {"all_reduce": {2: [(64, f)]}}}}
    # the spell over the first three windows: 1.3x, 1.2x, and 1.02 / 1.25 (geometric mean 1.13); the last quiet
    passes = [one(1.3, fp64=True), one(1.2), one(1.02, 1.25), one(1.0)]
    assert spared(passes) == [3]
    passes.append(one(1.06))  # 1.06x the fastest: spared too
    assert spared(passes) == [3, 4]
    out = _median_of_passes(passes, [passes[j] for j in spared(passes)])
    assert out["gemm"]["fp32"][0][3] == pytest.approx(1.03) and out["memory"] == pytest.approx((1e10 + 1e10 / 1.06) / 2)
    assert out["links"]["gloo"]["all_reduce"][2] == [(64, pytest.approx(1.03))]
    assert out["gemm"]["fp64"] == [[1, 64, 64, 2.0]]  # its one pass, though the spell's


def test_calibrate_spreads_the_fixed_costs_rounds_over_its_windows_and_takes_their_least():
    """Five rounds in three windows (2, 2, 1), a smoke run's three in two; a block's cost is the
    slope over depths of each timed function's least sample, so one spoiled round (a slow spell)
    does not move it. Catches: every round in one window, a window dropped, a mean, a decode step not
    ``(t(new) - t(1)) / (new - 1)``, prefill from the long generation."""
    from tensorpar.bench.timing import spread
    from tensorpar.bench.calibrate_costs import BlockCosts

    assert spread(5, 3) == [2, 2, 1] and spread(3, 2) == [2, 1] and spread(1, 3) == [1, 0, 0]
    assert spread(11, 5) == [3, 2, 2, 2, 2]  # the estimates bench's inference groups around 4 training cases
    costs = BlockCosts.__new__(BlockCosts)  # its arithmetic over given samples, no model
    costs._layers, costs._new = (1, 6), 17
    costs._samples = {"train": {1: [0.6, 0.6, 5.0], 6: [1.1, 1.1, 9.0]},  # 0.5 + 0.1 a block; round 3 spoiled
                      "decode": {(1, 1): [1.0] * 3, (17, 1): [2.6] * 3, (1, 6): [2.0] * 3, (17, 6): [6.8] * 3}}
    out = costs.costs()
    assert out["train"] == pytest.approx((0.1, 0.5))
    assert out["decode"] == pytest.approx((0.04, 0.06))  # 0.1 and 0.3 a token at 1 and 6 blocks
    assert out["prefill"] == pytest.approx((0.2, 0.8))  # one token: 1.0 and 2.0


def test_calibrate_keeps_each_windows_own_figures_beside_the_medians():
    """``measured.by_window``: each window's decode and training block costs over its own rounds,
    each transport's all-reduce alpha from its own pass, and the probe GEMMs; across ranks the
    slowest's; the summary prints them. Catches: every window's figures from all rounds (a spell in
    one window hidden), windows' rounds misaligned, alpha from another pass, the fastest rank's."""
    from types import SimpleNamespace

    from tensorpar.bench.calibrate import _by_window, _max_over
    from tensorpar.bench.calibrate_costs import BlockCosts
    from tensorpar.cli.calibrate import summary

    split = BlockCosts.__new__(BlockCosts)
    split._layers, split._new = (1, 6), 17
    slow = [1.0, 1.0, 3.0, 3.0, 1.0]  # a spell over the middle window's two rounds: 3x the block
    split._samples = {"train": {1: [0.6] * 5, 6: [0.6 + 0.5 * f for f in slow]},
                      "decode": {(1, 1): [1.0] * 5, (17, 1): [2.6] * 5, (1, 6): [2.0] * 5,
                                 (17, 6): [2.0 + 16 * (0.1 + 0.2 * f) for f in slow]}}

    def one_pass(gloo, window):
        return {"links": {"gloo": {"all_reduce": {2: [(8, 1e-4), (64, gloo), (512, gloo), (4096, gloo)]}}},
                "gemm": {"fp32": [[1, 512, 512, 1e-4], [64, 512, 512, 1e-3], [1, 128, 128, 1e-5]]}, "window": window}
    out = _by_window([one_pass(1e-3, 0), one_pass(2e-3, 1), one_pass(1.5e-3, 2)], split, [2, 2, 1])
    assert [w["block_s"]["train"] for w in out] == pytest.approx([0.1, 0.3, 0.1])
    assert [w["block_s"]["decode"] for w in out] == pytest.approx([0.04, 0.12, 0.04])
    assert [w["alpha_s"]["gloo"] for w in out] == pytest.approx([1e-3, 2e-3, 1.5e-3])
    assert out[0]["gemm_s"] == {"1x512x512": 1e-4, "64x512x512": 1e-3}
    ranks = _max_over([out, [{**w, "alpha_s": {"gloo": 5e-3}} if i == 0 else w for i, w in enumerate(out)]])
    assert ranks[0]["alpha_s"]["gloo"] == 5e-3 and ranks[1]["alpha_s"]["gloo"] == 2e-3
    text = summary(SimpleNamespace(name="p", measured={"by_window": out}, gemm={}, memory_bytes_per_s=1e9,
                                   optimizer_s_per_param=None, block_call_s={}, step_call_s={}, links={},
                                   collective_wait={}))
    assert "decode block 40000 / 120000 / 40000 us; train block 100000 / 300000 / 100000 us; gloo alpha 1.00 / 2.00 / 1.50 ms" in text
    check = {"gemm_speed": 1.12, "dispatch_speed": 0.97, "again": True}
    text = summary(SimpleNamespace(name="p", measured={"check": check}, gemm={}, memory_bytes_per_s=1e9,
                                   optimizer_s_per_param=None, block_call_s={}, step_call_s={}, links={},
                                   collective_wait={}))
    assert ("the check after the windows: the host ran 1.12x (GEMMs) and 0.97x (a block's dispatch) as fast as "
            "during them; a slow spell: one more window measured") in text
    # a quick run's second window has no pass; the window a spell adds has one
    out = _by_window([one_pass(1e-3, 0), one_pass(2e-3, 2)], split, [2, 2, 1])
    assert [w.get("alpha_s", {}).get("gloo") for w in out] == [1e-3, None, 2e-3] and "gemm_s" not in out[1]


def test_the_fixed_costs_model_reads_past_the_caches_before_each_norm_and_takes_the_reads_out(monkeypatch):
    """Every norm of the tiny model reads the next 4 MiB slice of a 64 MiB pool first (so a block
    runs with cold caches, as in a model whose weights pass through them), and a sample takes the
    reads' own time out: on a clock that reads advance by 1 and the rest of a call by 10, a call of
    three reads samples at 10, not 13. Catches: the reads left in the sample, hooks on modules
    other than the norms, one slice read again and again (it would stay in the cache), reads on a
    GPU's host."""
    import torch

    from tensorpar.bench import calibrate_costs as cc
    from tensorpar.models.tiny import make_tiny_model

    model = make_tiny_model("llama", dtype=torch.float32, num_hidden_layers=2, **cc.TINY)
    cold = cc.ColdCaches("cpu")
    cold.hook(model)
    norms = [m for m in model.modules() if type(m).__name__.endswith("Norm")]
    assert len(norms) == 2 * 2 + 1  # two a block and the final one
    assert [t.numel() * 4 for t in cold.pool] == [cc.FLUSH_BYTES] * (cc.COLD_BYTES // cc.FLUSH_BYTES)
    with torch.no_grad():
        model(torch.arange(4).reshape(1, 4))
    assert cold._turn == len(norms) and cold.spent > 0
    assert not cc.ColdCaches("cuda").active and cc.ColdCaches("cuda").pool == []

    clock, read = [0.0], []

    class Slice:
        def __init__(self, i):
            self.i = i

        def sum(self):
            read.append(self.i)
            clock[0] += 1.0
    cold.pool, cold.spent, cold._turn = [Slice(i) for i in range(16)], 0.0, 0
    monkeypatch.setattr(cc.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(cc.dist, "broadcast", lambda t, src: t)  # one process: nothing to agree on

    def call():
        for _ in range(3):
            cold._read(None, None)
        clock[0] += 10.0
    sample = cc._sampler(call, min_s=0.02, cold=cold)
    assert [sample() for _ in range(3)] == [10.0] * 3
    assert read == [i % 16 for i in range(len(read))] and len(read) == 12  # each slice in turn, from memory


@pytest.mark.parametrize("argv, message", [
    (["calibrate", "--ranks", "1"], "--ranks (1) must be an integer >= 2"),
    (["calibrate", "--repeats", "2"], "--repeats 2: need at least 3"),
])
def test_calibrate_bad_arguments(argv, message, capsys, tmp_path):
    from tensorpar.cli import main

    assert main([*argv, "--out", str(tmp_path / "p.json")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_a_profile_without_measured_gemms_has_no_host_speed_and_is_judged_raw():
    """A preset's profile (public figures, no measured points): no probe, nothing to read the
    samples at, the raw ratio judged; a measured one reads each sample at the profile's speed."""
    from tensorpar.bench.estimates import _known, judged
    from tensorpar.bench.host_speed import HostSpeed
    from tensorpar.planner.profile import published

    speed = HostSpeed(published("h100-sxm"))
    assert not speed.usable and speed() is None
    speeds = {"tp2": [speed(), speed()]}
    assert _known(speeds, "tp2") is None and _known({}, "tp2") is None
    row = judged(1.5, {"estimate_s": 1.0}, _known(speeds, "tp2"), [1.5, 1.5])
    assert row["measured_vs_estimate"] == 1.5 and not row["within_target"] and "host_speed" not in row
    row = judged(1.5, {"estimate_s": 1.0}, _known({"a/1": [0.5, 1.0], "a/n": [0.7, 1.0]}, "a/1", "a/n"), [2.0, 1.0])
    assert row["speeds"] == pytest.approx([0.6, 1.0]) and row["at_profile_speed_vs_estimate"] == pytest.approx(1.1)


def test_a_run_that_finds_the_host_faster_than_its_profile_flags_the_calibration():
    """The median over every sample's probe at ``PROFILE_SLOW`` or more: the profile was measured
    in a slow spell (its estimates run high), and the bench says so; under it, or with no probes (a
    preset), nothing. Catches: the mean (one fast sample flagging a sound run), a threshold on one
    case's probes, a note for a run without probes."""
    from tensorpar.bench.host_speed import PROFILE_SLOW, spell_note

    sound = [{"speeds": [0.95, 1.0, 1.02]}, {"speeds": [1.04, 3.0]}, {}]  # mean 1.4, median 1.02
    assert spell_note(sound) is None
    assert spell_note([{}, {"speeds": None}]) is None
    spell = [{"speeds": [1.12, 1.15, 0.99]}, {"speeds": [1.1, 1.09]}, {}]
    note = spell_note(spell)
    assert note is not None and "1.10x" in note and "5 samples" in note and "calibrate again" in note
    assert spell_note([{"speeds": [PROFILE_SLOW]}]) is not None and spell_note([{"speeds": [PROFILE_SLOW - 0.01]}]) is None


def test_the_estimates_page_flags_each_run_whose_profile_met_a_slow_spell():
    """tools/estimates_page.py: the verdict over every run, each run's wait, a line naming
    the runs the bench flagged (and only those), and each calibration's check. Catches: the flag
    read from one run for all, the flag dropped from the page, a flagged run counted as within
    target, the check's figures from another run."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("estimates_page", Path(__file__).parents[1] / "tools/estimates_page.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    def run(ratio, speeds):
        row = {"case": "decode_b1", "layout": "tp2", "measured_s": ratio, "estimate_s": 1.0, "measured_vs_estimate": ratio,
               "within_target": abs(ratio - 1) <= 0.2, "dominant": "fixed_s", "speeds": speeds,
               "host_speed": sorted(speeds)[len(speeds) // 2], "host_wait_s": 2.0}
        return {"profile": {"measured": {"cpu_count": 2}}, "rows": [row], "start": "s", "end": "e", "repeats": 3}
    page = tool.page([run(1.02, [1.0, 0.98, 1.01]), run(0.75, [1.12, 1.15, 1.1]), run(0.99, [1.0, 1.01, 0.97])])
    assert "Within 20% in every run: 0 of 1 cases" in page and "decode_b1 (1.02, 0.75, 0.99)" in page
    assert "Flagged by the bench: run 2: the host ran 1.12x as fast" in page and "run 1:" not in page.split("Flagged")[1]
    assert "run 1 2 s, run 2 2 s, run 3 2 s" in page
    assert "Flagged" not in tool.page([run(1.02, [1.0, 0.98, 1.01])])
    assert "check after its windows" not in page  # profiles from before calibrate's check
    checked = run(1.0, [1.0, 1.0, 1.0])
    checked["profile"]["measured"]["check"] = {"gemm_speed": 1.12, "dispatch_speed": 0.97, "again": True}
    assert ("check after its windows (the host's speed then against during them: GEMMs, dispatch): run 2 1.12 / 0.97 "
            "(a slow spell: one more window).") in tool.page([run(1.0, [1.0, 1.0, 1.0]), checked])


def test_the_estimates_bench_waits_for_a_host_in_a_slow_spell_within_its_bounds(monkeypatch):
    """Before a sample, a probe under 0.9 of the calibrated speed is waited for (probed again every
    2 s), at most ``SETTLE_WAIT_S`` (60 s) a sample and the run's budget in all; a preset (no probe) never waits.
    Catches: no wait, a wait without end (a slow spell of a minute), the budget not spent, the
    sample's own time deciding instead of the probe's."""
    from tensorpar.bench import host_speed as E
    from tensorpar.planner.profile import published

    slept = []
    monkeypatch.setattr(E.time, "sleep", slept.append)

    class Probe(E.HostSpeed):
        def __init__(self, readings, budget_s=E.SETTLE_BUDGET_S):
            super().__init__(published("h100-sxm"), budget_s=budget_s)
            self.readings = iter(readings)

        def __call__(self):
            return next(self.readings)

    assert Probe([1.0]).settled() == (1.0, 0.0) and slept == []
    assert Probe([0.8, 0.85, 0.95]).settled() == (0.95, 4.0) and slept == [2.0, 2.0]
    slow = Probe([0.5] * 100)
    assert E.SETTLE_WAIT_S == 60.0 and slow.settled() == (0.5, 60.0)  # a sample's most
    assert slow.budget_s == E.SETTLE_BUDGET_S - 60.0
    spent = Probe([0.5] * 100, budget_s=5.0)
    assert spent.settled() == (0.5, 4.0) and spent.settled() == (0.5, 0.0)  # the run's budget, then none
    assert E.HostSpeed(published("h100-sxm")).settled() == (None, 0.0)  # a preset: nothing to probe
    speeds, waited, before = E._probed(Probe([0.8, 0.95, 1.0]))
    before("tp2")
    before("tp2")
    assert speeds == {"tp2": [0.95, 1.0]} and waited == {"tp2": 2.0}


def test_the_estimates_bench_waits_while_its_dispatch_probe_reads_slow(monkeypatch):
    """The dispatch probe's reading over the lower quartile of the run's readings so far (the
    quiet ones), from the
    ``DISPATCH_AFTER``-th on; over ``DISPATCH_CEIL`` the host is waited for as for a slow GEMM
    probe, whatever the GEMMs read. Catches: the reference taken as the median (a spell of half
    the readings would hide itself), the first readings judged against too few, a dispatch
    spell not waited for, and each row's readings lost."""
    from tensorpar.bench import host_speed as E
    from tensorpar.planner.profile import published

    host = E.HostSpeed(published("h100-sxm"))
    for t in (1.0, 2.0, 2.0):
        host.note_dispatch(t)
        assert host.dispatch is None  # fewer than DISPATCH_AFTER readings: nothing to judge against
    host.note_dispatch(2.0)  # [1, 2, 2, 2]: lower quartile 1.75 (the median, 2, would read 1.0)
    assert E.DISPATCH_AFTER == 4 and host.dispatch == pytest.approx(2.0 / 1.75)
    assert not host.slow(1.0) and host.slow(0.85) and not host.slow(None)
    for _ in range(30):  # a long spell's polls: [1, 2, 2, 2, 3], 3 / 2 each time, none kept
        host.note_dispatch(3.0)
        assert host.dispatch == pytest.approx(1.5) and host.slow(1.0)
    assert host.readings == [1.0, 2.0, 2.0, 2.0]

    slept = []
    monkeypatch.setattr(E.time, "sleep", slept.append)

    class Probe(E.HostSpeed):  # the GEMMs read calibrated speed throughout; the dispatch probe a spell, then not
        def __init__(self, dispatch):
            super().__init__(published("h100-sxm"))
            self.feed = iter(dispatch)

        def __call__(self):
            self.dispatch = next(self.feed)
            return 1.0

    probe = Probe([1.4, 1.3, 1.1, 1.0])
    assert probe.settled() == (1.0, 4.0) and slept == [2.0, 2.0]
    probe = Probe([1.4, 1.0, None])
    speeds, waited, before = E._probed(probe)
    before("decode_b1/1")
    before("decode_b1/n")
    assert waited == {"decode_b1/1": 2.0, "decode_b1/n": 0.0} and probe.slowdowns == {"decode_b1/1": [1.0], "decode_b1/n": [None]}
    assert E.slowdowns(probe, "decode_b1/1") == [1.0] and E.slowdowns(probe, "decode_b1/1", "decode_b1/n") == []


def test_calibrates_check_reads_the_probes_after_its_windows(monkeypatch):
    """After its windows calibrate reads both probes three times a second apart: the GEMMs' median
    speed, and the dispatch probe's median seconds during the windows over its median now (> 1:
    faster now, the windows met a slow spell). Catches: a mean (1.07, not 1.1), one reading, the
    dispatch ratio upside down (0.9), no pause between readings, the windows' own readings left out."""
    from tensorpar.bench import host_speed as E

    slept = []
    monkeypatch.setattr(E.time, "sleep", slept.append)
    feed = iter([(1.2, 1.0), (0.9, 0.8), (1.1, 0.9)])  # (GEMMs' speed, dispatch seconds) each reading

    class Probes(E.HostSpeed):
        def __call__(self):
            speed, self.dispatch_s = next(feed)
            return speed

    monkeypatch.setattr(E, "HostSpeed", Probes)
    check = E.calibration_check([], [1.0, 1.0, 0.95], probe=None)
    assert check["gemm_speed"] == pytest.approx(1.1) and check["dispatch_speed"] == pytest.approx(1.0 / 0.9)
    assert check["speeds"] == [1.2, 0.9, 1.1] and check["dispatch_s"] == [1.0, 0.8, 0.9]
    assert check["windows_dispatch_s"] == [1.0, 1.0, 0.95] and slept == [E.CHECK_PAUSE_S] * 2


def test_calibrate_measures_another_window_when_either_probe_finds_a_spell():
    """The check's verdict: the GEMMs at 1.08x or more, or the dispatch probe at 1.25x or more (its
    readings spread more), each alone. Catches: both required, one threshold for both, a strict
    comparison, the thresholds swapped."""
    from tensorpar.bench.calibrate import met_spell
    from tensorpar.bench.host_speed import DISPATCH_CEIL, PROFILE_SLOW

    assert (PROFILE_SLOW, DISPATCH_CEIL) == (1.08, 1.25)
    for gemm, dispatch, found in ((1.0, 1.0, False), (1.08, 1.0, True), (1.07, 1.24, False), (1.0, 1.25, True),
                                  (1.2, 1.2, True), (0.9, 1.3, True)):
        assert met_spell({"gemm_speed": gemm, "dispatch_speed": dispatch}) == found, (gemm, dispatch)
    assert met_spell({"gemm_speed": 1.0, "dispatch_speed": 1.0}, (0.0, float("inf")))
    assert met_spell({"gemm_speed": 1.0, "dispatch_speed": 1.0}, (float("inf"), 0.0))


def test_a_block_cost_is_the_least_of_its_rounds():
    """What moves a sample on a shared host only adds time: each timed function's cost is its
    least sample over the rounds, then the slope over depths and the intercept. Catches: the
    median and the lower quartile (a spell over four rounds of five pulls them up), the least
    of each round's slope (a spell on the one-block sample alone makes that round's slope smaller,
    and the least picks it)."""
    from tensorpar.bench.calibrate_costs import BlockCosts
    from tensorpar.bench.host_speed import lower_quartile

    assert lower_quartile([5.0, 1.0, 4.0, 2.0, 3.0]) == 2.0 and lower_quartile([7.0]) == 7.0
    costs = object.__new__(BlockCosts)  # its samples as rounds would leave them: 1 and 6 blocks, 5 rounds
    costs._layers, costs._new = (1, 6), 17
    # a spell over rounds 1, 2, 4 and 5; in round 4 on the one-block sample only
    one, six = [3.0, 3.1, 1.5, 3.2, 2.9], [13.0, 12.8, 6.6, 6.7, 12.0]
    costs._samples = {"train": {1: one, 6: six}}
    block, step = costs.costs()["train"]
    # least 1.5 and 6.6: a block 1.02, the step 0.48 (each round's slope: 2.0, 1.94, 1.02, 0.7, 1.82, the
    # least 0.7; the lower quartiles, 2.9 and 6.7, put the block at 0.76; the medians, 3.0 and 12.0, at 1.8)
    assert block == pytest.approx(1.02) and step == pytest.approx(0.48)


def test_bench_json_carries_the_slow_spell_warning(tmp_path, monkeypatch, capsys):
    """``tensorpar bench --json``: a run whose probes flag its profile (a calibration in a slow
    spell) carries the warning in its JSON, not only on stderr; a sound run an empty ``warnings``.
    Catches: the warning printed and dropped from the JSON."""
    import json

    from tensorpar.bench import estimates
    from tensorpar.cli import main
    from tensorpar.planner.profile import published

    def rows(speed):
        return [{"case": "tp2", "layout": "tp2", "measured_s": 1.0, "estimate_s": 1.0, "measured_vs_estimate": 1.0,
                 "within_target": True, "speeds": [speed] * 3, "host_speed": speed,
                 "at_profile_speed_vs_estimate": speed, "dominant": "gemm_s"}]
    for speed, flagged in ((1.2, True), (1.0, False)):
        monkeypatch.setattr(estimates, "run_estimates_bench", lambda *a, speed=speed, **k: (rows(speed), published("h100-sxm")))
        assert main(["bench", "--suite", "estimates", "--json", "--out", str(tmp_path / "out"),
                     "--profile", str(tmp_path / f"p{speed}.json")]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["results"]["estimates"][0]["case"] == "tp2"
        assert ("calibrate again" in out["warnings"].get("estimates", "")) == flagged, out["warnings"]
