"""`tensorpar run` and `tensorpar verify` end to end, as a user runs them: each command line through
``tensorpar.cli.main`` exactly as the ``tensorpar`` entry point calls it, in this process (its ranks
start from the suite's live fork server instead of a fresh interpreter importing torch again, ~10 s
a command), and the entry point itself in a subprocess for the errors it must report the same way."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def tensorpar(*args):
    """One command line through ``tensorpar.cli.main``, in this process: its exit code and what it
    printed, as ``subprocess.run`` gives them."""
    from types import SimpleNamespace

    from tests._cli_batch import run_all
    (r,) = run_all([list(args)])
    return SimpleNamespace(returncode=r["rc"], stdout=r["stdout"], stderr=r["stderr"])


def executable(*args, timeout=300):
    """The installed entry point, as a user's shell runs it."""
    return subprocess.run([sys.executable, "-m", "tensorpar", *args], capture_output=True, text=True,
                          env=ENV, timeout=timeout)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tensorpar.models.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {"llama": make_tiny_checkpoint(root / "llama", "llama"),
            "gpt2": make_tiny_checkpoint(root / "gpt2", "gpt2")}


def test_verify_json_agrees_at_every_layer(checkpoints):
    r = tensorpar("verify", "--model", str(checkpoints["llama"]), "--tp", "2,4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and [c["tp"] for c in out["checks"]] == [2, 4]
    for c in out["checks"]:
        names = [lay["name"] for lay in c["layers"]]
        assert names[:5] == ["embeddings", "block 0", "block 1", "rest (final norm, head)", "loss"]
        assert names[5].startswith("replicas (") and c["layers"][5]["ok"]
        for lay in c["layers"]:
            assert max(lay["activation_rel"], lay["activation_grad_rel"], lay["param_grad_rel"]) <= 1e-5
        assert c["first_divergence"] is None
        assert abs(c["loss_split"] - c["loss_dense"]) <= 1e-5 * abs(c["loss_dense"])


def test_verify_passes_the_packaged_model_in_float32():
    """all-MiniLM-L6-v2 at tp 4 in float32: its attention key biases have an exact gradient of 0,
    so what is compared there is rounding noise (relative differences above 1e-5); the split is
    as accurate as the unsplit model against float64, and verify says ok."""
    from tensorpar.models.minilm import minilm_path
    r = tensorpar("verify", "--model", str(minilm_path()), "--tp", "4", "--json")
    assert r.returncode == 0, r.stderr
    check = json.loads(r.stdout)["checks"][0]
    assert check["first_divergence"] is None
    assert max(lay["param_grad_rel"] for lay in check["layers"]) > 1e-5  # the noise is there
    assert all(lay["excess"] <= 1 for lay in check["layers"])
    # and the same shards in float64 against the float64 unsplit model: exact
    assert all(lay["structure"] <= 1 for lay in check["layers"])


def test_verify_reports_non_finite_weights(checkpoints, tmp_path):
    """A NaN in the checkpoint makes split and unsplit both NaN: no tolerance judges that, so
    verify names the tensor and fails (exit 1) instead of comparing."""
    import shutil

    from safetensors.torch import load_file, save_file
    bad = tmp_path / "nan"
    shutil.copytree(checkpoints["llama"], bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.post_attention_layernorm.weight"][3] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    r = tensorpar("verify", "--model", str(bad), "--tp", "2", "--json")
    assert r.returncode == 1, r.stderr
    check = json.loads(r.stdout)["checks"][0]
    assert check["nonfinite"] == ["model.layers.1.post_attention_layernorm.weight"]
    assert check["first_divergence"] == "non-finite weights (model.layers.1.post_attention_layernorm.weight)"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_verify_names_the_first_diverging_layer(checkpoints, family):
    r = tensorpar("verify", "--model", str(checkpoints[family]), "--tp", "2", "--inject-fault", "1", "--json")
    assert r.returncode == 1
    out = json.loads(r.stdout)
    check = out["checks"][0]
    assert not out["ok"] and check["first_divergence"] == "block 1"
    acts = {lay["name"]: lay["activation_rel"] for lay in check["layers"]}
    assert acts["block 0"] <= 1e-5 < acts["block 1"]  # the fault is invisible before its block
    assert "diverged at tp=2: block 1" in r.stderr


@pytest.mark.parametrize("dtype, fault, first", [("bfloat16", None, None), ("bfloat16", 0, "block 0")])
def test_verify_in_bfloat16(checkpoints, dtype, fault, first):
    # bf16 rounds at 3.9e-3: the split model stays within its 5e-2 tolerance, and a corrupted
    # shard is still named at its own block.
    args = ["verify", "--model", str(checkpoints["llama"]), "--tp", "2", "--dtype", dtype, "--json"]
    r = tensorpar(*args, *([] if fault is None else ["--inject-fault", str(fault)]))
    out = json.loads(r.stdout)
    assert out["checks"][0]["first_divergence"] == first and r.returncode == (0 if first is None else 1)
    structure = {lay["name"]: lay["structure"] for lay in out["checks"][0]["layers"]}
    assert (structure["block 0"] > 1) == (fault is not None)  # float64 sees the fault too, with full power


def test_verify_replays_a_routers_choices_in_bfloat16(tmp_path):
    """A mixture of experts in bfloat16: near-ties in the router can round either way in the split
    and the unsplit model (an O(1) difference for that token, nothing wrong). On this tiny Mixtral
    at tp 2 a token is routed differently without the replay (worst excess 1.6: a false
    divergence); with the float64 model's choices replayed in both, every call of them, 0.1."""
    from tensorpar.models.tiny import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "mixtral", "mixtral")
    r = tensorpar("verify", "--model", str(path), "--tp", "2", "--dtype", "bfloat16", "--json")
    assert r.returncode == 0, r.stderr
    for check in json.loads(r.stdout)["checks"]:
        assert "top-k choices (routers) replayed" in check["routing"] and "stopped" not in check["routing"]


@pytest.mark.parametrize("tp, backend", [(2, "gloo"), (3, "auto")])
def test_run_default_minilm_json(tp, backend):
    r = tensorpar("run", "--tp", str(tp), "--backend", backend, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tp"] == tp and out["family"] == "bert" and out["task"] == "sentence-embedding"
    assert out["backend"] == {"gloo": "gloo", "auto": "shm"}[backend]
    assert out["max_abs_diff"] <= 1e-5 and out["ok"]
    assert out["params_total"] == 22_713_216
    per_rank = out["params_per_rank"]
    assert len(per_rank) == tp and all(n < out["params_total"] / tp * 1.05 for n in per_rank)
    led = out["ledger"]
    assert led["ledger_bytes_per_rank"] == led["predicted_bytes_per_rank"]
    assert all(b > 0 for b in led["ledger_bytes_per_rank"])
    # what the sockets carried over gloo: the formula plus gloo's framing (measured 0.4% at tp 2,
    # 0.6% at tp 3 on these ~150 kB all-reduces), never less; nothing over shared memory
    if backend == "gloo":
        assert all(1.0 <= w / b <= 1.01 for w, b in zip(led["wire_bytes_per_rank"], led["ledger_bytes_per_rank"]))
    else:
        assert led["wire_bytes_per_rank"] == [None] * tp
    assert {c["op"] for c in led["collectives"]} == {"all_reduce"}
    assert len(led["collectives"]) == 1 + 2 * 6  # embedding + (attention, MLP) per layer
    assert set(led["per_layer"]) == {"embeddings.word_embeddings", *(f"encoder.layer.{i}" for i in range(6))}
    _per_module_agrees(led)
    ranking = out["result"]["ranking"]
    assert {ranking[0]["a"], ranking[0]["b"]} == {"A man is playing a guitar.", "Someone is strumming a guitar on stage."}


def _per_module_agrees(led):
    """Every module's measured bytes equal the planner's (blocks: the per-layer figure)."""
    block = led["predicted_per_layer_bytes_per_rank"][0]
    for name, s in led["per_layer"].items():
        want = block if name.rsplit(".", 1)[-1].isdigit() else led["predicted_per_module"][name]
        assert s["bytes_sent"] == want, (name, s["bytes_sent"], want)


def test_run_decoder_generates_the_unsplit_tokens(checkpoints):
    r = tensorpar("run", "--model", str(checkpoints["gpt2"]), "--tp", "2", "--prompt-ids", "3,1,4,1,5",
                  "--max-new-tokens", "5", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    res = out["result"]
    assert len(res["tokens"]) == 5 and res["tokens"] == res["dense_tokens"] and res["tokens_match"]
    assert res["decode_max_rel_diff"] <= 1e-5  # the logits of every step, not only the tokens
    assert out["ledger_matches"] and out["max_rel_diff"] <= 1e-5
    gen = out["ledger"]["generation"]
    assert gen["ledger_bytes_per_rank"] == gen["predicted_bytes_per_rank"]
    _per_module_agrees(out["ledger"])
    assert set(out["ledger"]["per_layer"]) == {"transformer.wte", "transformer.h.0", "transformer.h.1", "lm_head"}
    (row,) = res["rows"]  # one prompt: its row is also the flat keys above
    assert row["prompt_ids"] == res["prompt_ids"] == [3, 1, 4, 1, 5] and row["tokens"] == res["tokens"]
    assert row["new_tokens"] == 5 and not row["stopped"] and res["options"]["do_sample"] is False


def test_run_samples_a_batch_of_prompts_of_different_lengths(checkpoints):
    """Three prompts (5, 2 and 3 tokens, left-padded), top-k sampling at tp 2: every row's tokens
    are the unsplit model's (the same sampler and seed draw the same token from the same logits),
    and so are the logits of every step; the generation's calls are the planner's for a batch of
    3 padded to 5 tokens with 5 candidates per rank. Stop token 8 ends the second row after its
    second token (what this tiny model samples with seed 3); the others run on."""
    r = tensorpar("run", "--model", str(checkpoints["gpt2"]), "--tp", "2", "--prompt-ids", "3,1,4,1,5",
                  "--prompt-ids", "9,2", "--prompt-ids", "7,7,7", "--do-sample", "--top-k", "5", "--seed", "3",
                  "--eos-token-id", "8", "--pad-token-id", "0", "--max-new-tokens", "5", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    res = out["result"]
    assert out["ok"] and out["ledger_matches"] and out["max_rel_diff"] <= 1e-5
    assert [row["prompt_ids"] for row in res["rows"]] == [[3, 1, 4, 1, 5], [9, 2], [7, 7, 7]]
    for row in res["rows"]:
        assert len(row["tokens"]) == 5 and row["tokens"] == row["dense_tokens"] and row["tokens_match"]
        assert row["decode_max_rel_diff"] <= 1e-5
    assert [row["new_tokens"] for row in res["rows"]] == [5, 2, 5]
    assert [row["stopped"] for row in res["rows"]] == [False, True, False]
    assert res["rows"][1]["tokens"][1:] == [8, 0, 0, 0]  # the stop token, then --pad-token-id
    assert res["tokens"] == [row["tokens"] for row in res["rows"]]  # several prompts: lists per row
    assert res["options"] == {"do_sample": True, "temperature": 1.0, "top_k": 5, "top_p": 1.0, "seed": 3,
                              "eos_token_id": [8], "pad_token_id": 0, "engine": "auto"}
    assert out["ledger"]["collectives"] and out["ledger"]["ledger_bytes_per_rank"] == \
        out["ledger"]["predicted_bytes_per_rank"]
    gen = out["ledger"]["generation"]
    assert gen["compared"] and gen["steps"] == 5
    assert gen["ledger_bytes_per_rank"] == gen["predicted_bytes_per_rank"]
    # the same call with one candidate per rank (greedy's exchange) would be less: k = 5 is counted
    from tensorpar.sharding.inventory import predict_collectives
    greedy = predict_collectives(checkpoints["gpt2"], 2, 3, 5, 4, "generate", new_tokens=5)
    assert greedy.bytes_sent_per_rank[0] < gen["predicted_bytes_per_rank"][0]


def test_top_p_sampling_without_top_k_is_recorded_not_compared(checkpoints):
    """Top-p sampling without top_k gathers every logit per step, which the planner does not
    predict: the generation's bytes are reported with the reason and left out of
    ``ledger_matches`` (the forward's comparison still counts); with top_k the prediction counts k
    candidates per rank, and plain sampling one (each shard's best Gumbel-perturbed score)."""
    from tensorpar.jobs.common import open_checkpoint
    from tensorpar.jobs.run import RunReport, _generation_ledger
    from tensorpar.sharding.inventory import predict_collectives
    ckpt = open_checkpoint(checkpoints["llama"])
    per_rank = [{"split": {"tokens": [[1, 2, 3], [4, 5, 6]], "generation_bytes_sent": 6800,
                           "generation_wire_bytes_sent": None}}] * 2

    def ledger(**options):
        task = {"options": {"do_sample": True, "temperature": 1.0, "top_k": None, "top_p": 1.0, "seed": 0,
                            **options}}
        return _generation_ledger(ckpt, 2, "float32", "shm", task, per_rank, 2, 4)
    free = ledger(top_p=0.9)
    assert not free["compared"] and free["predicted_bytes_per_rank"] is None and "not predict" in free["note"]
    plain = ledger()
    one = predict_collectives(ckpt.path, 2, 2, 4, 4, "generate", new_tokens=3, candidates=1)
    assert plain["compared"] and plain["predicted_bytes_per_rank"] == one.bytes_sent_per_rank
    top5 = ledger(top_k=5)
    want = predict_collectives(ckpt.path, 2, 2, 4, 4, "generate", new_tokens=3, candidates=5)
    assert top5["compared"] and top5["predicted_bytes_per_rank"] == want.bytes_sent_per_rank
    forward = {"ledger_bytes_per_rank": [10, 10], "predicted_bytes_per_rank": [10, 10]}
    report = RunReport("m", "p", "llama", 2, "float32", "shm", "generation", 0.0, 0.0, 1e-5, 1, [1, 1], [],
                       {**forward, "generation": free})
    assert report.ledger_matches and report.ok
    report.ledger["generation"] = top5  # 6800 recorded against the prediction: not equal
    assert not report.ledger_matches and not report.ok


# Bad generation options, through the Python API in this process: each a ValueError naming the
# value and what is valid, before any rank starts (launching one fails the test).
RUN_API_ERRORS = [
    (dict(temperature=0), "temperature must be a positive finite number, got 0"),
    (dict(do_sample=True, top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(do_sample=True, top_k=0), "top_k must be a positive integer or None, got 0"),
    (dict(seed=-1), "seed must be an integer in [0, 2**63), got -1"),
    (dict(do_sample="yes"), "do_sample must be True or False, got 'yes'"),
    (dict(eos_token_id=130), "eos_token_id must be a token id or a list of them, each in [0, 130); got 130"),
    (dict(eos_token_id=[5, -1]), "each in [0, 130); got [5, -1]"),
    (dict(pad_token_id=130), "pad_token_id must be a token id in [0, 130), got 130"),
    (dict(prompt_ids=[]), "prompt token ids must be a non-empty list of integers in [0, 130); invalid: []"),
    (dict(prompt_ids=[[1, 2], []]), "integers in [0, 130); invalid (prompt 2 of 2): []"),
    (dict(prompt_ids=[[1, 2], [3, 130]]), "invalid (prompt 2 of 2): [130]"),
    (dict(prompt_ids=[1, [2]]), "prompt_ids mixes token ids and lists of them"),
    (dict(prompt_ids=None, prompt=[]), "need at least one prompt, got []"),
    (dict(prompt_ids=[1, 2], prompt="hi"), "give the prompts as text (--prompt) or as token ids (--prompt-ids), not both"),
    (dict(prompt_ids=[[1] * 40, [2]], max_new_tokens=30), "the longest prompt plus --max-new-tokens (70 tokens)"),
    (dict(max_new_tokens=0), "--max-new-tokens must be a positive integer, got 0"),
    (dict(engine="fast"), "--engine must be one of auto, lean, hf, got 'fast'"),
    (dict(engine="lean"), "--engine lean runs llama, mistral, qwen2 models; gpt2 is a 'gpt2' model"),
]


@pytest.mark.parametrize("kwargs, message", RUN_API_ERRORS)
def test_run_api_refuses_bad_generation_options(checkpoints, monkeypatch, kwargs, message):
    import re

    from tensorpar import distributed as dist
    from tensorpar.jobs.run import run

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started before the options were checked")
    monkeypatch.setattr(dist, "launch", no_ranks)
    with pytest.raises(ValueError, match=re.escape(message)):
        run(checkpoints["gpt2"], tp=2, **{"prompt_ids": [1, 2, 3], **kwargs})


def test_run_reports_each_row(checkpoints, tmp_path):
    """The report of a batch from made-up results, in this process: a row that differs from the
    unsplit model fails the run whichever row it is; a stopped row's count ends at its stop token;
    texts come from the checkpoint's tokenizer, one per row."""
    import shutil

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tensorpar.jobs.common import open_checkpoint
    from tensorpar.jobs.run_generation import generation_result, prompt_rows
    path = tmp_path / "with_tokenizer"
    shutil.copytree(checkpoints["gpt2"], path)
    words = ["<unk>", "tensor", "parallelism", "splits", "a", "model", "."]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    rows = prompt_rows(open_checkpoint(path), ["tensor parallelism splits", "a model"], None)
    assert rows == [[1, 2, 3], [4, 5]]
    task = {"prompt_ids": rows, "has_tokenizer": True, "options": {"do_sample": True, "eos_token_id": [6]}}
    logits = torch.randn(3, 2, 7)  # (steps, B, V)

    def rank0(split, dense):
        return {"split": {"tokens": split, "step_logits": logits, "generation_collectives": 9},
                "dense": {"tokens": dense, "step_logits": logits}}
    same = generation_result(task, rank0([[4, 5, 1], [6, 6, 6]], [[4, 5, 1], [6, 6, 6]]), path)
    assert same["tokens_match"] and same["decode_max_rel_diff"] == 0.0
    assert [(r["new_tokens"], r["stopped"]) for r in same["rows"]] == [(3, False), (1, True)]
    assert same["text"] == ["tensor parallelism splits a model tensor", "a model ."]
    for row in (0, 1):  # either row differing from the unsplit model's is a failed comparison
        dense = [[4, 5, 1], [6, 6, 6]]
        dense[row] = [4, 4, 4]
        res = generation_result(task, rank0([[4, 5, 1], [6, 6, 6]], dense), path)
        assert not res["tokens_match"] and res["decode_max_rel_diff"] == float("inf")
        assert [r["tokens_match"] for r in res["rows"]] == [row != 0, row != 1]
    other = logits.clone()
    other[1, 1] += 1.0  # the second row's logits at one step: the tokens equal, the logits not
    res = generation_result(task, {**rank0([[4, 5, 1], [6, 6, 6]], [[4, 5, 1], [6, 6, 6]]),
                                   "dense": {"tokens": [[4, 5, 1], [6, 6, 6]], "step_logits": other}}, path)
    assert res["rows"][0]["decode_max_rel_diff"] == 0.0 < res["rows"][1]["decode_max_rel_diff"]


# User errors: one line on stderr, exit code 2, nothing on stdout, before any rank starts. All cases
# run in one process (tests/_cli_batch.py calls the entry point's main per command line); the last
# case of each list goes through the real `tensorpar` executable as well.
VERIFY_ERRORS = [
    (["verify", "--model", "/nonexistent/dir"], "model directory '/nonexistent/dir' does not exist"),
    (["verify", "--model", "{llama}", "--tp", "3"], "valid tp sizes: 1, 2, 4"),
    (["verify", "--model", "{llama}", "--tp", "two"], "--tp 'two' must be comma-separated integers"),
    (["verify", "--model", "{llama}", "--dtype", "int8"], "--dtype 'int8' is not supported; valid:"),
    (["verify", "--model", "{llama}", "--seq", "100"], "--seq 100 (100 tokens) is longer than this model's 64 positions"),
    (["verify", "--model", "{unknown}"], "model type 'not_a_model' in"),
    (["verify", "--model", "{corrupt}"], "model.safetensors is not a readable safetensors file"),
    # checkpoints a rank would fail on: found in the parent from headers and index alone
    (["verify", "--model", "{truncated}"], "truncated/model.safetensors is not a readable safetensors file"),
    (["verify", "--model", "{missing}"], "is missing 1 tensors that LlamaForCausalLM needs, e.g. "
                                         "['model.layers.1.mlp.down_proj.weight']"),
    (["verify", "--model", "{reshaped}"], "does not match its config.json: 6 tensors have other shapes, e.g. "
                                          "['model.layers.0.mlp.gate_proj.weight: checkpoint (96, 48), model (104, 48)'"),
    (["verify", "--model", "{integer}"], "tensor 'model.norm.weight' is stored as I32, not as a float"),
    (["verify", "--model", "{outside}"], "names files outside the checkpoint folder: ['../elsewhere.safetensors']"),
    (["verify", "--model", "{stale}"], "has both model.safetensors and model.safetensors.index.json, which does not "
                                       "name it: one of them is stale"),
    (["verify", "--model", "{wrong_index}"], "tensors are not in the file the index names"),
    (["verify", "--model", "{billion_layers}"], "num_hidden_layers=1000000000 but the checkpoint's tensors hold "
                                                "layers 0..1 only (2)"),
    (["verify", "--model", "{zero_heads}"], "num_attention_heads=0 must be a positive integer"),
    (["verify", "--model", "{list_config}"], "is not a JSON object (got list)"),
]
RUN_ERRORS = [
    (["run", "--tp", "5"], "valid tp sizes: 1, 2, 3, 4, 6, 12"),
    (["run", "--model", "{llama}", "--prompt", "hello"], "has no tokenizer for --prompt"),
    (["run", "--model", "{llama}", "--prompt-ids", "1,99999"], "invalid: [99999]"),
    (["run", "--prompt", "hi"], "--prompt is for decoders"),
    (["run", "--do-sample", "--top-k", "3"], "--do-sample True, --top-k 3: for decoders;"),
    (["run", "--model", "{llama}", "--sentence", "hi"], "--sentence is for encoders"),
    (["run", "--model", "{broken}"], "config.json is not valid JSON"),
    (["run", "--model", "{llama}", "--prompt-ids", "1,2", "--max-new-tokens", "70"], "longer than this model's 64 positions"),
    (["run", "--model", "{llama}", "--prompt-ids", "1,2", "--prompt-ids", "3", "--do-sample", "--temperature", "0"],
     "temperature must be a positive finite number, got 0.0"),
    (["run", "--model", "{llama}", "--prompt-ids", "1,2", "--eos-token-id", "5", "--eos-token-id", "6,130"],
     "eos_token_id must be a token id or a list of them, each in [0, 130); got [5, 6, 130]"),
    (["run", "--model", "{llama}", "--prompt-ids", "1,2", "--prompt-ids", ""], "invalid (prompt 2 of 2): []"),
    (["run", "--model", "{llama}", "--top-k", "five"], "argument --top-k: invalid int value: 'five'"),
    (["run", "--model", "{llama}", "--engine", "fast"], "argument --engine: invalid choice: 'fast'"),
    (["run", "--model", "/nonexistent/dir"], "model directory '/nonexistent/dir' does not exist"),
]


# A multimodal model (tests.test_cli_train._nested_model: Gemma-3 with a vision tower) gives its
# language model's heads, layers and positions in config.json's text_config only: the parent-side
# checks read them there.
NESTED_ERRORS = [
    (["verify", "--model", "{nested}", "--tp", "3"], "tp_size (3) must divide n_heads (4)"),
    (["verify", "--model", "{nested}", "--seq", "200"], "--seq 200 (200 tokens) is longer than this model's 128 positions"),
    (["verify", "--model", "{nested}", "--inject-fault", "2"], "--inject-fault 2: valid blocks are 0..1"),
]


@pytest.fixture(scope="module")
def error_runs(checkpoints, tmp_path_factory):
    """``{tuple(args): {"rc", "stdout", "stderr"}}`` for every case above."""
    root = tmp_path_factory.mktemp("bad")
    dirs = {"llama": checkpoints["llama"]}
    for name, config in (("unknown", {"model_type": "not_a_model"}), ("corrupt", {"model_type": "t5"}),
                         ("broken", None)):
        dirs[name] = root / name
        dirs[name].mkdir()
        (dirs[name] / "config.json").write_text("{model_type: llama" if config is None else json.dumps(config))
        (dirs[name] / "model.safetensors").write_bytes(b"")  # empty: no header
    dirs.update(_broken_checkpoints(checkpoints["llama"], root))
    cases = [args for args, _ in VERIFY_ERRORS + RUN_ERRORS + NESTED_ERRORS] + [
        ["verify", "--model", "/nonexistent/dir", "--json"]]
    filled = [[a.format(**dirs) for a in args] for args in cases]
    from tests._cli_batch import run_all
    runs = dict(zip(map(tuple, cases), run_all(filled)))
    for args in (VERIFY_ERRORS[-1][0], RUN_ERRORS[-1][0]):  # and through the installed entry point
        real = executable(*[a.format(**dirs) for a in args])
        runs[("real", *args)] = {"rc": real.returncode, "stdout": real.stdout, "stderr": real.stderr}
    return runs


def _broken_checkpoints(good, root) -> dict:
    """Copies of a good checkpoint, each broken one way."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    def copy(name):
        shutil.copytree(good, root / name)
        return root / name

    def rewrite(d, change):
        tensors = load_file(d / "model.safetensors")
        change(tensors)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})

    out = {name: copy(name) for name in ("truncated", "missing", "reshaped", "integer", "outside", "stale",
                                         "wrong_index", "billion_layers", "zero_heads", "list_config")}
    from tests.test_cli_train import _nested_model
    out["nested"] = Path(_nested_model(str(root / "nested")))
    data = (good / "model.safetensors").read_bytes()
    (out["truncated"] / "model.safetensors").write_bytes(data[:len(data) // 2])
    rewrite(out["missing"], lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    config = json.loads((good / "config.json").read_text())
    (out["reshaped"] / "config.json").write_text(json.dumps({**config, "intermediate_size": 104}))
    (out["billion_layers"] / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10 ** 9}))
    (out["zero_heads"] / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    (out["list_config"] / "config.json").write_text(json.dumps([config]))
    rewrite(out["integer"], lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.int32)}))
    keys = list(load_file(good / "model.safetensors"))
    (out["outside"] / "model.safetensors").rename(root / "elsewhere.safetensors")
    (out["outside"] / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "../elsewhere.safetensors" for k in keys}}))
    shutil.copy(good / "model.safetensors", out["stale"] / "model-00001-of-00001.safetensors")
    (out["stale"] / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "model-00001-of-00001.safetensors" for k in keys}}))
    (out["wrong_index"] / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"not.a.tensor": "model.safetensors", **{k: "model.safetensors" for k in keys}}}))
    return out


def _one_line_exit_2(run, message):
    assert run["rc"] == 2, run["stderr"]
    lines = [ln for ln in run["stderr"].splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], run["stderr"]
    assert run["stdout"] == ""


def test_json_errors_are_a_json_object_on_stdout(error_runs):
    run = error_runs[("verify", "--model", "/nonexistent/dir", "--json")]
    assert run["rc"] == 2 and len(run["stderr"].strip().splitlines()) == 1
    assert json.loads(run["stdout"]) == {"ok": False, "exit_code": 2,
                                         "error": "model directory '/nonexistent/dir' does not exist"}


def test_a_failed_rank_is_one_line_with_exit_code_1(monkeypatch, capsys):
    """The launcher's RankFailedError carries the rank's traceback: the CLI prints its first line
    and how to see the rest."""
    from tensorpar import distributed as dist
    from tensorpar.cli import main
    from tensorpar.jobs import verify as verify_job

    def failing(*args, **kwargs):
        raise dist.RankFailedError(1, "RuntimeError", "out of memory", "Traceback (most recent call last): ...")
    monkeypatch.setattr(verify_job, "verify", failing)
    monkeypatch.delenv("TENSORPAR_TRACEBACK", raising=False)
    rc = main(["verify", "--model", "/tmp", "--json"])
    out, err = capsys.readouterr()
    assert rc == 1 and err.count("\n") == 1 and "rank 1 failed: RuntimeError: out of memory" in err
    assert "Traceback" not in err and json.loads(out)["exit_code"] == 1


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_under_torchrun_only_rank_0_prints_the_report(monkeypatch, capsys, rank, printed):
    """Every process of a torchrun job gets the whole report back from launch: one prints it."""
    from types import SimpleNamespace

    from tensorpar.cli import main
    from tensorpar.jobs import verify as verify_job
    report = SimpleNamespace(ok=True, to_dict=lambda: {"ok": True}, checks=[])
    monkeypatch.setattr(verify_job, "verify", lambda *a, **k: report)
    monkeypatch.setenv("RANK", rank)
    assert main(["verify", "--model", "/tmp", "--json"]) == 0
    out, err = capsys.readouterr()
    assert (out == '{"ok": true}\n') if printed else (out == "" and err == "")


@pytest.mark.parametrize("args, message", VERIFY_ERRORS)
def test_errors_are_one_line_with_exit_code_2(error_runs, args, message):
    _one_line_exit_2(error_runs[tuple(args)], message)


@pytest.mark.parametrize("args, message", RUN_ERRORS)
def test_run_errors_are_one_line_with_exit_code_2(error_runs, args, message):
    _one_line_exit_2(error_runs[tuple(args)], message)


@pytest.mark.parametrize("args, message", NESTED_ERRORS)
def test_nested_config_errors_are_one_line_with_exit_code_2(error_runs, args, message):
    _one_line_exit_2(error_runs[tuple(args)], message)


@pytest.mark.parametrize("args, message", [VERIFY_ERRORS[-1], RUN_ERRORS[-1]])
def test_the_executable_reports_errors_the_same_way(error_runs, args, message):
    _one_line_exit_2(error_runs[("real", *args)], message)


