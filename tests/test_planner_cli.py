"""`tensorpar plan`: JSON, the text report, the plot, and one-line errors with exit code 2."""
import json
import subprocess
import sys
import textwrap

import pytest

from tensorpar.cli import main
from tensorpar.cli.plan import sweep_title
from tensorpar.cli.plan_render import why_not

REQUIRED = ("params", "params_per_device", "flops_per_iteration", "hardware_flops_per_iteration",
            "activation_bytes_per_layer", "kv_cache_bytes_per_token", "memory_per_device", "comm",
            "compute_time_lower_bound_s", "comm_time_lower_bound_s", "step_time_lower_bound_s",
            "decode_time_per_token_lower_bound_s", "decode_steps_per_s_upper_bound", "prefill_time_lower_bound_s",
            "kv_transfer_time_lower_bound_s", "feasible", "reasons", "fixes")


def _run(capsys, *argv):
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_is_one_object_with_the_required_fields(capsys):
    rc, out, err = _run(capsys, "--model", "llama-2-7b", "--tp", "8", "--hardware", "a100-80gb", "--json")
    assert rc == 0 and err == ""
    d = json.loads(out)
    assert all(k in d for k in REQUIRED)
    assert d["params"] == 6_738_415_616 and d["layout"]["tp"] == 8 and d["feasible"] is True
    assert {"per_layer", "per_step", "decode_per_token"} <= set(d["comm"])


def test_shapes_and_custom_hardware(capsys):
    rc, out, _ = _run(capsys, "--family", "gpt", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "100",
                      "--seq", "16", "--tp", "2", "--hardware", "h100-pcie", "--intra-node-gbps", "25",
                      "--memory-gb", "1", "--json")
    d = json.loads(out)
    assert rc == 0 and d["model"]["family"] == "gpt" and d["model"]["ffn"] == 256
    assert d["hardware"]["intra_node_bytes_per_s_per_direction"] == 25e9 and d["hardware"]["mem_bytes"] == 1e9


def test_preset_with_overridden_seq(capsys):
    _, out, _ = _run(capsys, "--model", "llama-2-7b", "--seq", "1024", "--json")
    assert json.loads(out)["model"]["seq"] == 1024


def test_text_report_has_tables_and_memory_bar(capsys):
    rc, out, _ = _run(capsys, "--model", "llama-2-13b", "--tp", "4", "--hardware", "h100-sxm",
                      "--workload", "inference", "--micro-batch", "8")
    assert rc == 0
    for text in ("feasible", "memory per device", "memory [", "communication per step", "decode per token",
                 "KV transfer", "lower bound"):
        assert text in out, text


def test_search_text_and_json(capsys):
    rc, out, _ = _run(capsys, "--model", "llama-2-70b", "--search", "--devices", "16", "--hardware", "h100-sxm",
                      "--global-batch", "32", "--zero-stage", "1", "--recompute", "full")
    assert rc == 0 and "Choose tp=" in out and "layouts ranked by step" in out
    rc, out, _ = _run(capsys, "--model", "llama-2-7b", "--search", "--devices", "8", "--workload", "inference", "--json")
    d = json.loads(out)
    feasible = [c for c in d["candidates"] if c["feasible"]]
    assert rc == 0 and d["objective"] == "decode_time_per_token" and d["best"] == feasible[0]
    assert d["best"]["estimate_s"] == min(c["estimate_s"] for c in feasible)


def test_plot_writes_a_png(capsys, tmp_path):
    path = tmp_path / "sweep.png"
    rc, out, _ = _run(capsys, "--model", "llama-2-7b", "--plot", str(path), "--json")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out)["feasible"] is False and rc == 1  # 7B training on one 80 GB device: the plot still comes


@pytest.mark.parametrize("argv, needle", [
    (["--model", "llama-9b"], "unknown model 'llama-9b'; valid: llama-2-7b"),
    (["--model", "llama-2-7b", "--hardware", "b200"], "unknown hardware 'b200'; valid: a100-40gb"),
    (["--family", "gpt", "--layers", "0", "--hidden", "8", "--heads", "2", "--vocab", "8", "--seq", "4"],
     "layers (0) must be a positive integer"),
    (["--model", "llama-2-7b", "--tp", "-2"], "tp (-2) must be a positive integer"),
    (["--model", "llama-2-7b", "--tp", "2", "--devices", "8"], "tp x pp x dp (2 x 1 x 1 = 2) must equal --devices (8)"),
    (["--model", "llama-2-7b", "--search"], "--search needs --devices"),
    (["--family", "gpt", "--layers", "2"], "missing: --hidden, --heads, --vocab, --seq"),
    (["--model", "llama-2-7b", "--intra-node-link", "ib"], "must be one of a100-80gb's links: nvlink, pcie"),
    (["--model", "llama-2-7b", "--kv-link", "wifi"], "kv_link ('wifi') must be one of: inter-node, intra-node"),
    (["--model", "llama-2-7b", "--peak-tflops", "0"], "--peak-tflops (0) must be a positive finite number"),
    (["--model", "llama-2-7b", "--memory-gb", "-5"], "--memory-gb (-5) must be a positive finite number"),
    (["--model", "llama-2-7b", "--peak-tflops", "inf"], "--peak-tflops (inf) must be a positive finite number"),
    (["--model", "llama-2-7b", "--hbm-gbps", "nan"], "--hbm-gbps (nan) must be a positive finite number"),
    (["--model", "llama-2-7b", "--inter-node-gbps", "-1"], "--inter-node-gbps (-1) must be a positive finite"),
    (["--model", "llama-2-7b", "--devices-per-node", "0"], "--devices-per-node (0) must be a positive integer"),
    (["--model", "llama-2-7b", "--kv-link", "inf"], "--kv-link (inf) must be a positive finite GB/s"),
    (["--model", "llama-2-7b", "--collective-latency-us", "inf"], "--collective-latency-us (inf) must be a finite"),
    (["--model", "llama-2-7b", "--search", "--devices", "2", "--collective-latency-us", "-1"],
     "--collective-latency-us (-1) must be a finite number >= 0"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("tensorpar plan: error: ") and needle in err, err


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 48,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 130,
         "max_position_embeddings": 64}

# Configs that make no model, and arguments a config's plan refuses, at the top of config.json and
# nested in a multimodal one ("{name}": a file of plan_fixtures): exit 2, one line. One path plans
# every config (``--inventory`` is accepted and changes nothing), so each refusal holds with and
# without it.
PLAN_ERRORS = [
    (["plan", "--model", "{negative_layers}"], "negative_layers.json: num_hidden_layers=-3 must be a positive integer"),
    (["plan", "--model", "{negative_layers}", "--inventory"], "num_hidden_layers=-3 must be a positive integer"),
    (["plan", "--model", "{zero_heads}"], "num_attention_heads=0 must be a positive integer"),
    (["plan", "--model", "{nested_negative_layers}"], "text_config.num_hidden_layers=-3 must be a positive integer"),
    (["plan", "--model", "{heads5}"],
     "heads5.json: transformers refuses this llama config: The hidden size (48) is not a multiple of the number of "
     "attention heads (5)"),
    (["plan", "--model", "{heads5}", "--inventory"],
     "transformers refuses this llama config: The hidden size (48) is not a multiple of the number of attention "
     "heads (5)"),
    (["plan", "--model", "{a_list}"], "a_list.json is not a JSON object (got list)"),
    (["plan", "--model", "{a_list}", "--inventory"], "a_list.json is not a JSON object (got list)"),
    (["plan", "--model", "{vision}"], "tensorpar cannot build and split this aimv2 model for a plan"),
    (["plan", "--model", "{llama}", "--inventory", "--seq", "0"], "--seq (0) must be a positive integer"),
    (["plan", "--model", "{llama}", "--dp", "0"], "dp (0) must be a positive integer"),
    (["plan", "--model", "{llama}", "--search", "--devices", "4", "--micro-batch", "0"],
     "micro_batch (0) must be a positive integer"),
    (["plan", "--model", "{llama}", "--layers", "4", "--hidden", "64"],
     "--layers, --hidden: shape options describe a preset or --family model; llama.json is planned as written"),
    (["plan", "--model", "llama-2-7b", "--inventory"], "--inventory needs --model DIR or a config.json"),
]


def plan_fixtures(root) -> dict:
    """The config.json files PLAN_ERRORS names, written under ``root``."""
    from tensorpar.models.tiny import make_tiny_config

    text = make_tiny_config("gemma3_text").to_dict()
    nested = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text,
              "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
                                "patch_size": 14}, "mm_tokens_per_image": 4}
    configs = {"llama": LLAMA, "negative_layers": {**LLAMA, "num_hidden_layers": -3},
               "zero_heads": {**LLAMA, "num_attention_heads": 0}, "heads5": {**LLAMA, "num_attention_heads": 5},
               "heads3": {**LLAMA, "num_attention_heads": 3, "num_key_value_heads": 3}, "a_list": [LLAMA],
               "nested": nested, "nested_negative_layers": {**nested, "text_config": {**text, "num_hidden_layers": -3}},
               "vision": make_tiny_config("aimv2").to_dict()}
    out = {}
    for name, cfg in configs.items():
        out[name] = str(root / f"{name}.json")
        with open(out[name], "w") as f:
            json.dump(cfg, f)
    return out


def test_configs_and_arguments_refused_in_one_line(capsys, tmp_path):
    files = plan_fixtures(tmp_path)
    for argv, needle in PLAN_ERRORS:
        rc, out, err = _run(capsys, *[a.format(**files) for a in argv[1:]])
        assert rc == 2 and out == "", (argv, out)
        assert err.count("\n") == 1 and err.startswith("tensorpar plan: error: ") and needle in err, (argv, err)


@pytest.mark.parametrize("name, tp, needle", [("llama", 3, "tp_size (3) must divide n_heads (4)"),
                                              ("heads3", 2, "tp_size (2) must divide n_heads (3)"),
                                              ("nested", 3, "tp_size (3) must divide n_heads (4)")])
def test_a_config_tp_that_does_not_split_is_a_finding(capsys, tmp_path, name, tp, needle):
    """A tp the runtime cannot split a config's model at is what a preset's is: the report, not
    feasible, the runtime's reason naming the valid tp sizes, exit 1 (this was exit 2 while
    configs had a path of their own)."""
    files = plan_fixtures(tmp_path)
    rc, out, _ = _run(capsys, "--model", files[name], "--tp", str(tp), "--json")
    d = json.loads(out)
    assert rc == 1 and d["feasible"] is False and d["memory_per_device"] is None
    assert len(d["reasons"]) == 1 and needle in d["reasons"][0] and "valid tp sizes: 1, " in d["reasons"][0]


def test_positions_of_a_nested_text_config_plan_the_sequence(capsys, tmp_path):
    """A multimodal config.json gives its positions in text_config (128 here): the plan's sequence,
    not the 2048 assumed where a config gives none."""
    files = plan_fixtures(tmp_path)
    rc, out, _ = _run(capsys, "--model", files["nested"], "--tp", "2", "--json")
    assert rc in (0, 1) and json.loads(out)["model"]["seq"] == 128


def test_bad_choice_from_argparse_is_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "llama-2-7b", "--recompute", "some"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_infeasible_split_is_reported_with_exit_code_1(capsys):
    """A layout that does not fit is a finding, not a usage error: the report, then exit 1 (like a
    failed proof; 2 is for bad input)."""
    rc, out, _ = _run(capsys, "--model", "llama-2-7b", "--tp", "3", "--json")
    d = json.loads(out)
    assert rc == 1 and d["feasible"] is False and "valid tp sizes: 1, 2, 4, 8, 16, 32" in d["reasons"][0]
    rc, out, _ = _run(capsys, "--model", "llama-2-7b", "--tp", "8", "--json")
    assert rc == 0 and json.loads(out)["feasible"] is True


def test_cli_module_imports_rich_and_matplotlib_lazily():
    code = textwrap.dedent("""
        import sys
        import tensorpar.cli.plan, tensorpar.plots
        bad = [m for m in ("rich", "matplotlib", "torch", "numpy") if m in sys.modules]
        assert not bad, bad
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_why_not_keeps_the_reason_and_drops_the_list_of_choices():
    assert why_not(["pp (32) must divide layers (80); valid pp sizes: 1, 2, 4, 5, 8, 10, 16, 20, 40, 80"]) == \
        "pp (32) must divide layers (80)"
    memory = ("memory per device 166.84 GB exceeds capacity 80.00 GB (weights 34.75, gradients 34.75, optimizer "
              "26.06, activations 5.37, kv cache 0.00 GB); try: --zero-stage 2")
    assert why_not([memory, "pp (3) must divide layers (80)"]) == \
        "memory per device 166.84 GB exceeds capacity 80.00 GB (+1 more)"
    long = "x" * 100
    assert why_not([long]) == "x" * 59 + "…" and why_not([]) == ""


def test_search_text_shows_whole_reasons(capsys):
    rc, out, _ = _run(capsys, "--model", "llama-2-70b", "--search", "--devices", "32", "--hardware", "h100-sxm",
                      "--global-batch", "64", "--zero-stage", "1", "--recompute", "full", "--sequence-parallel")
    words = " ".join(out.split())  # rich wraps long lines
    assert rc == 0 and "try: --zero-stage 2, a larger tp or pp, a device with more memory" in words \
        and "lowest estimated step time" in words


def test_inference_report_labels_what_it_counts(capsys, tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 131072}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, out, _ = _run(capsys, "--model", str(tmp_path), "--workload", "inference", "--micro-batch", "2", "--dp", "2")
    words = " ".join(out.split())  # rich wraps long lines
    assert rc == 1 and "NOT feasible" in words  # 131072-token activations do not fit 80 GB
    assert f"seq 131072 (max_position_embeddings in {tmp_path / 'config.json'})" in words
    assert "FLOPs: prefill of the global batch (4 x 131072 tokens) / one decode step (2 tokens)" in words
    assert "here a step is the prefill of the global batch, 4 x 131072 tokens" in words
    assert "with recompute" not in words
    rc, out, _ = _run(capsys, "--model", str(tmp_path), "--seq", "512")
    words = " ".join(out.split())
    assert "seq 512 (--seq)" in words and "FLOPs per iteration, fwd + bwd" in words
    assert rc == (1 if "NOT feasible" in words else 0)


def test_plot_title_says_when_the_device_count_changes():
    from tensorpar.planner import Layout, get_hardware, get_model
    from tensorpar.planner.search import tp_sweep

    m, hw, base = get_model("llama-2-7b"), get_hardware("h100-sxm"), Layout(pp=2)
    title = sweep_title(m, hw, base, tp_sweep(m, base, hw))
    assert title.endswith("devices (tp x pp x dp) grow with tp: 2 to 64")
    assert "grow" not in sweep_title(m, hw, base, tp_sweep(m, base, hw)[:1])


def test_every_option_plans_a_config(tmp_path):
    """A config.json takes every option a preset takes (one path; the CLI hands them to plan() as
    a Layout): selective recomputation drops the attention scores from the activations, full keeps
    each block's input only, sequence parallelism splits the replicated part over tp, ZeRO-1 the
    optimizer state over dp, pp 2 halves the blocks per device and adds the stage sends; the
    plot's sweep covers the config's valid tp sizes."""
    from tensorpar.planner import Layout, get_hardware, plan
    from tensorpar.planner.search import tp_sweep
    from tensorpar.sharding.inventory import MetaSource
    src, hw = MetaSource(plan_fixtures(tmp_path)["llama"], seq=32), get_hardware("a100-80gb")

    def run(**kw):
        r = plan(src, Layout(tp=2, **kw), hw)
        assert r.feasible, r.reasons
        return r
    none = run()
    acts = {r: run(recompute=r).memory_per_device["activations"] for r in ("selective", "full")}
    assert none.memory_per_device["activations"] > acts["selective"] > acts["full"] > 0
    sp = run(sequence_parallel=True)
    assert sp.memory_per_device["activations"] < none.memory_per_device["activations"]
    assert {i["op"] for i in sp.comm["per_step"] if i["group"] == "tp"} >= {"all_gather", "reduce_scatter"}
    zero = run(dp=2, zero_stage=1)
    assert zero.memory_per_device["optimizer"] == none.memory_per_device["optimizer"] / 2
    pp = run(pp=2)
    assert pp.params_per_device < none.params_per_device and len(pp.params_per_stage) == 2
    assert any(i["op"] == "send" and i["group"] == "pp" for i in pp.comm["per_step"])
    assert [row["tp"] for row in tp_sweep(src, Layout(), hw)] == [1, 2, 4] == src.valid_tp_sizes()


def test_pipeline_flags_and_the_stage_table(capsys):
    rc, out, _ = _run(capsys, "--model", "llama-2-7b", "--pp", "4", "--tp", "2", "--microbatches", "8", "--schedule",
                      "interleaved1f1b", "--hardware", "h100-sxm", "--seq", "1024", "--json")
    p = json.loads(out)["pipeline"]
    assert rc == 0 and p["schedule"] == "Interleaved1F1B" and p["microbatches"] == 8 and p["stages_total"] == 8
    assert [x["microbatches_alive"] for x in p["ranks"]] == [11, 9, 7, 5]  # (v-1) p + 2 (p-1-r) + 1
    assert p["bubble_fraction"] == 3 / 19  # (p-1)/(v m + p-1)
    rc, out, _ = _run(capsys, "--model", "llama-2-7b", "--pp", "2", "--microbatches", "4", "--hardware", "h100-sxm",
                      "--seq", "1024")
    words = " ".join(out.split())
    assert rc == 0 and "pipeline: 1F1B, 1 stage(s) per rank, 4 microbatches" in words and "bubble 20.0%" in words


@pytest.mark.parametrize("argv, message", [
    (["--pp", "2", "--schedule", "zigzag"], "schedule 'zigzag' does not exist; valid: GPipe, 1F1B"),
    (["--pp", "2", "--virtual-stages", "2"], "virtual_stages (2) must be 1 under 1F1B"),
    (["--pp", "2", "--microbatches", "2", "--global-batch", "8"], "--global-batch (8) and --microbatches (2) disagree"),
    (["--search", "--devices", "4", "--microbatches", "2"], "--microbatches depends on each layout's dp"),
])
def test_bad_pipeline_flags_are_one_line_errors(capsys, argv, message):
    rc, _, err = _run(capsys, "--model", "llama-2-7b", *argv)
    assert rc == 2 and message in err


def test_search_prints_the_train_command_of_its_best_layout(capsys, tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, out, _ = _run(capsys, "--model", str(tmp_path), "--search", "--devices", "4", "--global-batch", "8",
                      "--schedule", "GPipe", "--dtype", "fp32", "--json")
    d = json.loads(out)
    b = d["best"]
    m = 8 // b["dp"]
    assert rc == 0 and d["command"] == (f"tensorpar train --model {tmp_path} --tp {b['tp']} --pp {b['pp']} "
                                        f"--dp {b['dp']} --schedule GPipe --microbatches {m} --batch 8 --dtype float32")
    rc, out, _ = _run(capsys, "--model", "llama-2-7b", "--search", "--devices", "8", "--hardware", "h100-sxm",
                      "--seq", "1024", "--global-batch", "32")
    assert rc == 0 and "Run it: tensorpar train --model DIR --tp" in out
    cfg["num_hidden_layers"] = 1  # one block: pp 1, so the devices go to dp and tp
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, out, _ = _run(capsys, "--model", str(tmp_path / "config.json"), "--search", "--devices", "4", "--global-batch",
                      "8", "--json")
    d = json.loads(out)
    assert d["best"]["dp"] > 1 and f"--microbatches {8 // d['best']['dp']} --batch 8" in d["command"]
