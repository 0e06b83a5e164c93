"""`tensorpar train`: the command line's losses against the unsplit model trained in this process
with plain torch (transformers' model, AdamW, torch's clip_grad_norm_) on the same global batches,
float64; a resume at another layout continues the same curve; bad inputs refused before any rank
starts; a failing rank ends the job. Two 4-rank launches shared by the tests (``_run``), and one of
a single rank."""
import contextlib
import functools
import io
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tensorpar.distributed
from tensorpar.cli import main as cli

pytestmark = pytest.mark.multirank

# Rounding only separates the split run from the reference: the ranks' partial sums, all-reduces and
# the clipping norm's shares, ~1e-16 per operation, which 6 AdamW steps (dividing by sqrt(v)) amplify
# to ~1e-14 at most; a fault (rows trained twice, a gradient not averaged) moves the loss by >1e-4.
TOL = 1e-12
STEPS, SAVE_AT, BATCH, SEQ, SEED, LR, DECAY, MAX_NORM = 6, 3, 8, 16, 7, 1e-2, 0.1, 1.0
TEXT = ("Tensor parallelism splits each weight matrix over the ranks; data parallelism splits the batch. "
        "Ünïcödé bytes count as several tokens each. ") * 12
COMMON = ["--steps", str(STEPS), "--batch", str(BATCH), "--seq", str(SEQ), "--seed", str(SEED), "--lr", str(LR),
          "--weight-decay", str(DECAY), "--max-norm", str(MAX_NORM), "--dtype", "float64", "--json"]


@functools.lru_cache(maxsize=None)
def _files(root: str) -> dict:
    """A tiny Llama of 256 ids without a tokenizer (the text is read as UTF-8 bytes), the text
    file, and the same bytes as a tokenized dataset of two .npy files of different int types."""
    from tensorpar.models.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(os.path.join(root, "model"), "llama", seed=3, vocab_size=256)
    text = os.path.join(root, "corpus.txt")
    with open(text, "w", encoding="utf-8") as f:
        f.write(TEXT)
    ids = np.frombuffer(TEXT.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    npy = os.path.join(root, "tokens")
    os.makedirs(npy)
    np.save(os.path.join(npy, "part-0.npy"), ids[:500].astype(np.int32))  # sorted name order: 0 then 1
    np.save(os.path.join(npy, "part-1.npy"), ids[500:])
    return {"model": str(model), "text": text, "npy": npy, "ids": ids, "root": root}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return _files(str(tmp_path_factory.mktemp("train")))


def _main(argv, capsys) -> tuple[int, dict | None, str]:
    code = cli(["train", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


@functools.lru_cache(maxsize=None)
def _run(root: str, which: str) -> dict:
    """``full``: dp 2 x tp 2 (DDP) on the text file, every step, saving at SAVE_AT; ``resumed``:
    from that checkpoint at dp 1 x tp 4 (FSDP, sequence parallel) on the .npy folder, up to STEPS,
    then exported."""
    f = _files(root)
    if which == "full":
        argv = ["--model", f["model"], "--tp", "2", "--dp", "2", "--data", f["text"], "--save-every", str(SAVE_AT),
                "--out", os.path.join(root, "out-full")]
    else:
        resume = os.path.join(_run(root, "full")["out"], "checkpoints", f"step-{SAVE_AT:08d}")
        argv = ["--model", f["model"], "--tp", "4", "--dp", "1", "--zero", "3", "--sequence-parallel",
                "--data", f["npy"], "--resume", resume, "--save-every", str(SAVE_AT),
                "--out", os.path.join(root, "out-resumed"),
                "--export", os.path.join(root, "exported")]
    if which == "pipelined":
        resume = os.path.join(_run(root, "full")["out"], "checkpoints", f"step-{SAVE_AT:08d}")
        argv = ["--model", f["model"], "--pp", "2", "--tp", "2", "--dp", "1", "--schedule", "GPipe",
                "--microbatches", "2", "--data", f["text"], "--resume", resume, "--out", os.path.join(root, "out-pp")]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli(["train", *argv, *COMMON])
    assert code == 0, buf.getvalue()
    return json.loads(buf.getvalue())


@functools.lru_cache(maxsize=None)
def _reference(root: str) -> dict:
    """The unsplit model in this process on the global batch of every step (the windows drawn as
    documented: seed * 1_000_003 + step seeds the generator of the starts), plain torch."""
    from transformers import AutoModelForCausalLM

    f = _files(root)
    model = AutoModelForCausalLM.from_pretrained(f["model"], dtype=torch.float64).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    data = torch.from_numpy(f["ids"])
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        gen = torch.Generator().manual_seed(SEED * 1_000_003 + step)
        starts = torch.randint(0, len(data) - SEQ + 1, (BATCH,), generator=gen)
        ids = torch.stack([data[s:s + SEQ] for s in starts.tolist()])  # (B, T)
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits  # (B, T, V)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "model": model.eval()}


def _rel(got, want) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def test_dp2_tp2_equals_the_single_process_run(files):
    run, ref = _run(files["root"], "full"), _reference(files["root"])
    assert run["ok"] and run["step_numbers"] == list(range(1, STEPS + 1))
    assert _rel(run["losses"], ref["losses"]) <= TOL, (run["losses"], ref["losses"])
    assert _rel(run["grad_norms"], ref["norms"]) <= TOL, (run["grad_norms"], ref["norms"])
    assert min(ref["norms"]) > MAX_NORM  # clipping acted on every step
    assert ref["losses"][-1] < ref["losses"][0] - 0.05  # and the model learned something
    assert run["layout"] == {"pp": 1, "dp": 2, "tp": 2, "zero": 0, "data_parallel": "ddp", "sequence_parallel": False,
                             "world_size": 4, "backend": "shm", "fixes": [], "pipeline": None}
    assert run["data"]["kind"] == "text" and run["data"]["tokenizer"] == "UTF-8 bytes"
    assert run["data"]["tokens"] == len(files["ids"])
    assert [os.path.basename(p) for p in run["checkpoints"]] == ["step-00000003", "step-00000006"]


def test_resumed_at_another_layout_continues_the_same_curve(files):
    full, run, ref = _run(files["root"], "full"), _run(files["root"], "resumed"), _reference(files["root"])
    assert run["start_step"] == SAVE_AT and run["step_numbers"] == list(range(SAVE_AT + 1, STEPS + 1))
    assert _rel(run["losses"], ref["losses"][SAVE_AT:]) <= TOL, (run["losses"], ref["losses"][SAVE_AT:])
    assert _rel(run["grad_norms"], ref["norms"][SAVE_AT:]) <= TOL
    assert _rel(run["losses"], full["losses"][SAVE_AT:]) <= TOL
    assert run["layout"]["tp"] == 4 and run["layout"]["data_parallel"] == "fsdp" and run["layout"]["sequence_parallel"]
    assert run["data"]["kind"] == "npy" and run["data"]["files"] == ["part-0.npy", "part-1.npy"]
    assert run["checkpoints"] == [os.path.join(run["out"], "checkpoints", f"step-{STEPS:08d}")]


def _all_equal(run) -> bool:
    """Every rank's recorded step issued exactly the calls the planner predicted for it."""
    comm = run["communication_per_rank"]
    return len(comm) == run["layout"]["world_size"] and all(c["equal"] for c in comm)


def test_each_run_costs_what_the_planner_said(files):
    """dp 2 x tp 2 (DDP), tp 4 (FSDP, sequence parallel) and pp 2 x tp 2 (GPipe): the ledger's calls
    of the recorded step equal the planner's per rank, and each rank holds the planner's bytes."""
    for which in ("full", "resumed", "pipelined"):
        run = _run(files["root"], which)
        assert _all_equal(run), (which, run["communication_per_rank"])
        assert run["communication_per_rank"][0]["step"] == run["start_step"] + 3  # past the one-off exchanges
        for m in run["memory_per_rank"]:
            held = {k: m[f"{k}_bytes"] for k in ("parameter", "gradient")}
            assert held == {"parameter": m["planned"]["params"], "gradient": m["planned"]["grads"]}, (which, m)


def test_the_planners_best_layout_runs_as_planned(files, tmp_path):
    """From plan to run: `plan --search` over 4 devices prints the `tensorpar train` command of its
    best layout; that command, run, issues on every rank the calls the planner predicts."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli(["plan", "--model", files["model"], "--search", "--devices", "4", "--json"]) == 0
    command = json.loads(buf.getvalue())["command"].split()
    assert command[:2] == ["tensorpar", "train"] and "--pp" in command
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli([*command[1:], "--steps", "3", "--seq", str(SEQ), "--out", str(tmp_path / "out"), "--json"])
    assert code == 0, buf.getvalue()
    run = json.loads(buf.getvalue())
    lay = run["layout"]
    assert [lay[k] for k in ("tp", "pp", "dp")] == [int(command[command.index(f"--{k}") + 1]) for k in ("tp", "pp", "dp")]
    assert _all_equal(run), run["communication_per_rank"]


def test_resumed_with_pipeline_stages_continues_the_same_curve(files):
    """The dp 2 x tp 2 checkpoint at step 3, resumed at pp 2 x tp 2 (GPipe, 2 microbatches): steps 4-6
    on the reference's curve, the loss the global batch's on every rank."""
    run, ref = _run(files["root"], "pipelined"), _reference(files["root"])
    assert run["start_step"] == SAVE_AT and run["step_numbers"] == list(range(SAVE_AT + 1, STEPS + 1))
    assert _rel(run["losses"], ref["losses"][SAVE_AT:]) <= TOL, (run["losses"], ref["losses"][SAVE_AT:])
    assert _rel(run["grad_norms"], ref["norms"][SAVE_AT:]) <= TOL
    assert run["layout"]["pp"] == 2 and run["layout"]["world_size"] == 4
    assert run["layout"]["pipeline"] == {"pp": 2, "schedule": "GPipe", "microbatches": 2, "virtual_stages": 1,
                                         "stage_blocks": [1, 1]}
    assert [m["rank"] for m in run["memory_per_rank"]] == [0, 1, 2, 3]


def test_the_export_computes_the_trained_model(files):
    from transformers import AutoModelForCausalLM

    run, ref = _run(files["root"], "resumed"), _reference(files["root"])
    exported = AutoModelForCausalLM.from_pretrained(run["export"], dtype=torch.float64).eval()
    probe = torch.from_numpy(files["ids"][:SEQ]).reshape(1, SEQ)
    with torch.no_grad():
        want, got = ref["model"](input_ids=probe).logits, exported(input_ids=probe).logits
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-10


def test_report_png_and_memory(files):
    for which in ("full", "resumed"):
        run = _run(files["root"], which)
        with open(run["png"], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert run["png"] == os.path.join(run["out"], "loss.png")
        assert [m["rank"] for m in run["memory_per_rank"]] == [0, 1, 2, 3]
        for m in run["memory_per_rank"]:
            assert m["state_bytes"] == m["parameter_bytes"] + m["gradient_bytes"] + m["optimizer_bytes"]
            assert m["gradient_bytes"] == m["parameter_bytes"] and m["optimizer_bytes"] >= 2 * m["parameter_bytes"]
            assert m["peak_rss_bytes"] > 10 * 2 ** 20 and m["cuda_max_allocated_bytes"] is None
            # the planner's figure for this rank (tensorpar.planner.mesh.state_bytes): its parameters,
            # gradients and AdamW's two moments, exactly (the optimizer's state also holds step counters)
            assert m["planned"]["params"] == m["parameter_bytes"] and m["planned"]["grads"] == m["gradient_bytes"]
            assert m["planned"]["optimizer"] == m["optimizer_moment_bytes"] < m["optimizer_bytes"]
        assert all(t > 0 for t in run["tokens_per_s"])
    # tp 4 holds about half of what tp 2 does (replicated norms and KV heads aside)
    full, resumed = (_run(files["root"], w)["memory_per_rank"][0]["parameter_bytes"] for w in ("full", "resumed"))
    assert 0.4 < resumed / full < 0.75


def _small_model(files) -> str:
    """A tiny Llama of 130 ids: too few for UTF-8 bytes, and another model than ``files["model"]``."""
    return train_fixtures(files["root"])["small"]


# Bad input: exit 2, one line, nothing written, before any rank starts ("{name}": a folder of
# train_fixtures(root); run from any folder, these leave none of their own). Refusals
# that an argument or the model's config can each cause are listed by both paths (marked "config:"),
# and those of a multimodal model's nested text config ("nested") as well.
TRAIN_ERRORS = [
    # tp must split the heads: --tp 3 on 4 heads; config: 3 heads at the default --tp 2; nested: both
    (["train", "--model", "{model}", "--tp", "3", "--dp", "1"], "tp_size (3) must divide n_heads (4)"),
    (["train", "--model", "{heads3}", "--dp", "1"], "tp_size (2) must divide n_heads (3)"),
    (["train", "--model", "{nested}", "--tp", "3", "--dp", "1"], "tp_size (3) must divide n_heads (4)"),
    (["train", "--model", "{nested_heads3}", "--dp", "1"], "tp_size (2) must divide n_heads (3)"),
    # the sequence within the positions: --seq 100 over 64; config: 32 positions under the default 64; nested
    (["train", "--model", "{model}", "--seq", "100"], "--seq 100 (100 tokens) is longer than this model's 64 positions"),
    (["train", "--model", "{short_positions}"], "--seq 64 (64 tokens) is longer than this model's 32 positions"),
    (["train", "--model", "{nested}", "--seq", "200"], "--seq 200 (200 tokens) is longer than this model's 128 positions"),
    # sizes that make no model, at the top and nested; heads that do not divide the hidden size
    (["train", "--model", "{negative_layers}"], "num_hidden_layers=-3 must be a positive integer"),
    (["train", "--model", "{nested_negative_layers}"], "num_hidden_layers=-3 must be a positive integer"),
    (["train", "--model", "{heads5}"], "The hidden size (48) is not a multiple of the number of attention heads (5)"),
    # sequence parallelism: arguments (--seq not divisible by tp, tp 1), config (mixture of experts)
    (["train", "--model", "{model}", "--sequence-parallel", "--seq", "15"], "--seq 15"),
    (["train", "--model", "{model}", "--sequence-parallel", "--tp", "1"], "--tp is 1"),
    (["train", "--model", "{mixtral}", "--sequence-parallel"], "has mixture-of-experts layers"),
    # mixture of experts: the expert width split by tp: --tp 3; config: a width of 33 at the default --tp 2
    (["train", "--model", "{mixtral}", "--tp", "3", "--dp", "1"], "tp_size (3) must divide"),
    (["train", "--model", "{mixtral_odd}", "--dp", "1"], "tp_size (2) must divide"),
    # the vocabulary: an id outside it (data), a vocabulary below the 256 byte values (config)
    (["train", "--model", "{model}", "--data", "{oov}"], "b.npy: token id 300 at position 1"),
    (["train", "--model", "{small}", "--data", "{text}"], "vocabulary of 130"),
    (["train", "--model", "{model}", "--zero", "2"], "--zero 2"),
    (["train", "--model", "{model}", "--dp", "4", "--tp", "1", "--batch", "6"], "--batch 6"),
    (["train", "--model", "{model}", "--data", "{missing}"], "missing.txt"),
    (["train", "--model", "{model}", "--steps", "0"], "--steps must be a positive integer, got 0"),
    (["train", "--model", "{model}", "--dtype", "float16"], "--dtype 'float16'"),
    (["train", "--model", "{model}", "--resume", "{not_a_checkpoint}"], "not-a-checkpoint"),
    (["train", "--model", "{model}", "--out", "{text}"], "is a file"),
    (["train", "--model", "{gpt2}", "--zero", "3", "--save-every", "2"], "transposed (Conv1D) shard"),
    # empty paths (Path("") is the working directory), folders that cannot be written
    (["train", "--model", "{model}", "--out", ""], "--out '' is empty"),
    (["train", "--model", "{model}", "--data", ""], "--data '' is empty"),
    (["train", "--model", "{model}", "--export", ""], "--export '' is empty"),
    (["train", "--model", "{model}", "--resume", ""], "--resume '' is empty"),
    (["train", "--model", ""], "--model '' is empty"),
    (["train", "--model", "{model}", "--export", "/proc/tensorpar-export"], "--export: '/proc/tensorpar-export' is not writable"),
    (["train", "--model", "{model}", "--out", "/proc/tensorpar-out"], "--out: '/proc/tensorpar-out' is not writable"),
    # more local ranks than any machine holds (8192 processes)
    (["train", "--model", "{model}", "--dp", "4096", "--tp", "2", "--batch", "4096"], "more local ranks than this machine"),
    # pipeline stages: more stages than blocks, an unknown schedule, microbatches not dividing a dp rank's
    # rows, virtual stages beyond the blocks
    (["train", "--model", "{model}", "--pp", "3", "--tp", "1", "--dp", "1"],
     "pp=3 x 1 stage(s) per rank = 3 stages, more than the model's 2 blocks; valid pp with 1 stage(s) per rank: [1, 2]"),
    (["train", "--model", "{model}", "--pp", "2", "--schedule", "Bogus"],
     "pipeline schedule 'Bogus' does not exist; valid: GPipe, 1F1B"),
    (["train", "--model", "{model}", "--pp", "2", "--microbatches", "3"],
     "microbatches=3 does not divide the batch of 4 sequences (per data-parallel rank); valid: [1, 2, 4]"),
    (["train", "--model", "{model}", "--pp", "2", "--schedule", "Interleaved1F1B"],
     "pp=2 x 2 stage(s) per rank = 4 stages, more than the model's 2 blocks"),
    (["train", "--model", "{model}", "--pp", "0"], "--pp must be a positive integer, got 0"),
    # data that is not a regular file; a tokenizer that does not parse (the file named)
    (["train", "--model", "{model}", "--data", "{fifo}"], "is a named pipe (FIFO)"),
    (["train", "--model", "{bad_tokenizer_json}"], "bad-tokenizer-json/tokenizer.json is not valid JSON"),
    (["train", "--model", "{bad_tokenizer}"], "bad-tokenizer (tokenizer.json) cannot be read: KeyError"),
    # weights that are not finite: the tensor named (the ranks' proof said "could not split")
    (["train", "--model", "{nan_weights}"], "tensor 'model.layers.1.mlp.up_proj.weight' in model.safetensors holds NaN"),
    # an --out holding the checkpoints of a run with another seed
    (["train", "--model", "{model}", "--out", "{previous_run}", "--seed", "1"],
     "holds the checkpoints of another run (step 3: seed 0 (now 1)); this run's saves would mix with them"),
]


@functools.lru_cache(maxsize=None)
def train_fixtures(root: str) -> dict:
    """The folders TRAIN_ERRORS names, made under ``root`` (once per root)."""
    from tensorpar.models.tiny import make_tiny_checkpoint

    f = _files(root)
    out = {k: f[k] for k in ("model", "text", "npy")}
    out["small"] = str(make_tiny_checkpoint(os.path.join(root, "small-model"), "llama", seed=1))
    out["missing"] = os.path.join(root, "missing.txt")
    out["not_a_checkpoint"] = _mkdir(root, "not-a-checkpoint")
    out["oov"] = _mkdir(root, "oov")
    np.save(os.path.join(out["oov"], "a.npy"), np.arange(100))
    np.save(os.path.join(out["oov"], "b.npy"), np.array([5, 300, 7]))
    for arch in ("mixtral", "gpt2"):
        out[arch] = str(make_tiny_checkpoint(os.path.join(root, arch), arch, seed=1))
    out["mixtral_odd"] = str(make_tiny_checkpoint(os.path.join(root, "mixtral-odd"), "mixtral", seed=1,
                                                  intermediate_size=33))
    big = dict(vocab_size=256)
    out["heads3"] = str(make_tiny_checkpoint(os.path.join(root, "heads3"), "llama", seed=1, num_attention_heads=3,
                                             num_key_value_heads=3, **big))
    out["short_positions"] = str(make_tiny_checkpoint(os.path.join(root, "short-positions"), "llama", seed=1,
                                                      max_position_embeddings=32, **big))
    out["negative_layers"] = _edited(f["model"], root, "negative-layers", num_hidden_layers=-3)
    out["heads5"] = _edited(f["model"], root, "heads5", num_attention_heads=5, head_dim=None)
    out["nested"] = _nested_model(os.path.join(root, "nested"))
    out["nested_heads3"] = _nested_model(os.path.join(root, "nested-heads3"), hidden_size=48, num_attention_heads=3,
                                         num_key_value_heads=1)
    out["nested_negative_layers"] = _edited(out["nested"], root, "nested-negative-layers",
                                            text_config={"num_hidden_layers": -3})
    out["fifo"] = os.path.join(root, "fifo")
    os.mkfifo(out["fifo"])
    out["bad_tokenizer_json"] = _edited(f["model"], root, "bad-tokenizer-json", files={"tokenizer.json": "{not json"})
    out["bad_tokenizer"] = _edited(f["model"], root, "bad-tokenizer",
                                   files={"tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}'})
    out["nan_weights"] = _nan_weights(f["model"], root)
    out["previous_run"] = _previous_run(f["model"], root)
    return out


def _mkdir(root: str, name: str) -> str:
    path = os.path.join(root, name)
    os.makedirs(path)
    return path


def _edited(model: str, root: str, name: str, files: dict | None = None, **config) -> str:
    """A copy of ``model`` with config.json's fields (a dict value: fields of that nested config)
    set, None deleting one, and ``files`` written beside."""
    import shutil

    path = os.path.join(root, name)
    shutil.copytree(model, path)
    with open(os.path.join(path, "config.json")) as fh:
        cfg = json.load(fh)
    for key, value in config.items():
        target, items = (cfg[key], value.items()) if isinstance(value, dict) else (cfg, [(key, value)])
        for k, v in items:
            target.pop(k) if v is None else target.__setitem__(k, v)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    for fname, text in (files or {}).items():
        with open(os.path.join(path, fname), "w") as fh:
            fh.write(text)
    return path


def _nested_model(path: str, **text) -> str:
    """A tiny Gemma-3 with its vision tower: the language model's sizes (4 heads, 128 positions) in
    config.json's ``text_config``, none at its top."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from tensorpar.models.tiny import make_tiny_config

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = Gemma3Config(text_config={**make_tiny_config("gemma3_text").to_dict(), **text}, vision_config=vision,
                       mm_tokens_per_image=4)
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(cfg).save_pretrained(path)
    return path


def _nan_weights(model: str, root: str) -> str:
    from safetensors.torch import load_file, save_file

    path = _edited(model, root, "nan-weights")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][5, 7] = float("nan")
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def _previous_run(model: str, root: str) -> str:
    """An --out folder holding a checkpoint of step 3 that tensorpar train saved with seed 0."""
    from tensorpar.models import saving
    from tensorpar.models.tiny import make_tiny_model

    out = os.path.join(root, "previous-run")
    dense = make_tiny_model("llama", seed=3, vocab_size=256)
    saving.save(dense, torch.optim.AdamW(dense.parameters()), os.path.join(out, "checkpoints"), step=3,
                extra={"train": {"seed": 0}, "settings": {"lr": 1e-3}})
    return out


def _no_launch(*args, **kwargs):
    raise AssertionError("a rank was launched")


def test_bad_inputs_exit_2_before_any_rank(files, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tensorpar.distributed, "launch", _no_launch)
    dirs = train_fixtures(files["root"])
    capsys.readouterr()  # what making them printed (transformers' progress bars)
    for argv, named in TRAIN_ERRORS:
        argv = [a.format(**dirs) for a in argv[1:]]  # argv[0]: "train"
        code, out, err = _main(["--out", str(tmp_path / "out"), "--json", *argv], capsys)
        assert code == 2, (argv, err)
        assert err.count("\n") == 1 and named in err and out["ok"] is False and named in out["error"], (argv, err)
        assert not (tmp_path / "out").exists(), argv  # a refused run leaves nothing behind


def test_a_resume_with_other_batches_is_refused_before_any_rank(files, tmp_path, capsys, monkeypatch):
    """The checkpoint keeps the seed, batch, sequence length and the data's fingerprint: resuming
    with another would silently read other batches than the run it continues."""
    resume = os.path.join(_run(files["root"], "full")["out"], "checkpoints")
    monkeypatch.setattr(tensorpar.distributed, "launch", _no_launch)
    m = ["--model", files["model"], "--resume", resume, "--steps", str(STEPS + 2), "--out", str(tmp_path / "o")]
    for extra, named in ((["--seed", "8", "--data", files["text"]], "seed 7 (now 8)"),
                         (["--seed", str(SEED)], "data '")):
        code, out, err = _main([*m, *extra, "--batch", str(BATCH), "--seq", str(SEQ), "--json"], capsys)
        assert code == 2 and named in err and "would read other batches" in err, (extra, err)


def test_an_out_holding_another_runs_checkpoints_is_refused(files, tmp_path, capsys, monkeypatch):
    """--out of the dp 2 x tp 2 run (its checkpoints hold seed, batch, data, lr, ...): a run with
    another seed or learning rate is refused naming it; the same run again, or one resuming
    from those checkpoints (here with another learning rate), reaches the launch."""
    out = _run(files["root"], "full")["out"]
    monkeypatch.setattr(tensorpar.distributed, "launch", _no_launch)
    same = ["--model", files["model"], "--tp", "2", "--dp", "2", "--data", files["text"], "--out", out, *COMMON]
    for extra, named in ((["--seed", "8"], "seed 7 (now 8)"), (["--lr", "0.5"], "lr 0.01 (now 0.5)")):
        code, _, err = _main([*same, *extra], capsys)
        assert code == 2 and "holds the checkpoints of another run (step 6: " + named in err, (extra, err)
        assert f"give another --out, or --resume '{os.path.join(out, 'checkpoints')}'" in err, err
    resume = ["--resume", os.path.join(out, "checkpoints", f"step-{SAVE_AT:08d}"), "--lr", "0.5"]
    for extra in ([], resume):
        with pytest.raises(AssertionError, match="a rank was launched"):
            cli(["train", *same, *extra])


def test_room_for_every_checkpoint_and_the_export_before_any_rank(files, tmp_path, capsys, monkeypatch):
    """Free space for all the checkpoints the run keeps (3 with --save-every 2 of 6 steps, not 1),
    and for the export beside them on the same filesystem (disk_usage reports less than that). The
    estimate of one checkpoint covers the dp 2 x tp 2 run's real one, within 2x and 1 MiB."""
    import shutil
    from collections import namedtuple

    from tensorpar.jobs.train_checks import checkpoint_bytes
    from tensorpar.sharding.inventory import build_inventory

    params = build_inventory(files["model"], 2).params_total
    weights, one = params * 8, checkpoint_bytes(params, 8)  # float64
    real = os.path.join(_run(files["root"], "full")["out"], "checkpoints", f"step-{SAVE_AT:08d}")
    real = sum(os.path.getsize(os.path.join(real, f)) for f in os.listdir(real))
    assert real <= one <= 2 * real + 2 ** 20, (real, one)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 ** 12, 0, 2 * one + weights // 2))
    monkeypatch.setattr(tensorpar.distributed, "launch", _no_launch)
    m = ["--model", files["model"], "--data", files["text"], "--out", str(tmp_path / "o"), *COMMON]
    for extra, named in ((["--save-every", "2"], "--save-every (3 checkpoints of"),
                         (["--save-every", "3", "--export", str(tmp_path / "e")],
                          "--save-every and --export (2 checkpoints of")):
        code, _, err = _main([*m, *extra], capsys)
        assert code == 2 and named in err and "not enough free space" in err, (extra, err)
    with pytest.raises(AssertionError, match="a rank was launched"):  # two checkpoints alone fit
        cli(["train", *m, "--save-every", "3"])


def test_a_diverging_run_stops_at_the_first_non_finite_step(files, tmp_path, capsys):
    """lr 1e30: the loss and gradient norm turn NaN within a few steps. With --allow-nonfinite the
    run goes on (exit 0, NaN in its report); without, the same global batches on dp 2 ranks (the
    loss and norm reduced: both ranks stop together) stop at the first step whose loss or gradient
    norm is not finite (exit 1, named), with every earlier step's checkpoint and neither that
    step's nor the export. (Overflow from weights of ~1e30 does not hang on rounding: one rank or
    two reach NaN at the same step.)"""
    argv = ["--model", files["model"], "--tp", "1", "--lr", "1e30", "--steps", "4", "--seq", "16", "--batch", "4",
            "--json"]
    code, on, err = _main([*argv, "--dp", "1", "--allow-nonfinite", "--out", str(tmp_path / "on")], capsys)
    assert code == 0 and on["ok"] and on["step_numbers"] == [1, 2, 3, 4], err
    first = next(i + 1 for i, (loss, norm) in enumerate(zip(on["losses"], on["grad_norms"]))
                 if not (np.isfinite(loss) and np.isfinite(norm)))
    assert first >= 2, on["losses"]  # a checkpoint before it: the stop must keep it and write no more
    out = tmp_path / "stop"
    code, res, err = _main([*argv, "--dp", "2", "--save-every", "1", "--out", str(out), "--export", str(tmp_path / "e")],
                           capsys)
    assert code == 1 and res["exit_code"] == 1 and err.count("\n") == 1, err
    assert f"training stopped at step {first}: " in err and "--allow-nonfinite" in err, err
    saved = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert saved == [f"step-{s:08d}" for s in range(1, first)], saved
    assert f"the last checkpoint is {out / 'checkpoints' / f'step-{first - 1:08d}'}" in err
    assert not (tmp_path / "e").exists()


def test_torchrun_world_size_must_be_dp_times_tp(files, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tensorpar.distributed, "launch", _no_launch)
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    code, _, err = _main(["--model", files["model"], "--tp", "2", "--dp", "2", "--out", str(tmp_path)], capsys)
    assert code == 2 and "--dp x --tp = 4 ranks, but torchrun started WORLD_SIZE=2" in err, err
    code, _, err = _main(["--model", files["model"], "--pp", "2", "--tp", "2", "--dp", "1", "--out", str(tmp_path)],
                         capsys)
    assert code == 2 and "--pp x --dp x --tp = 4 ranks, but torchrun started WORLD_SIZE=2" in err, err


def test_a_failing_rank_ends_the_job_with_its_error(files, tmp_path, capsys):
    """A checkpoint of another model (saved by tensorpar.save, not by this command, so nothing is
    compared before the launch): the rank's load refuses it and the launcher ends the job, exit 1."""
    from tensorpar.models import saving
    from tensorpar.models.tiny import make_tiny_model

    other = make_tiny_model("llama", seed=3, vocab_size=256)
    resume = saving.save(other, torch.optim.AdamW(other.parameters()), tmp_path / "other", step=3)
    argv = ["--model", _small_model(files), "--tp", "1", "--dp", "1", "--resume", str(resume), "--steps", str(STEPS + 2),
            "--seq", str(SEQ), "--out", str(tmp_path), "--json"]
    code, out, err = _main(argv, capsys)
    assert code == 1 and out["ok"] is False, err
    assert "rank 0 failed: ValueError" in err and "'model.model.embed_tokens.weight' is (256, 48) there" in err, err


def test_without_model_a_tiny_llama_and_the_packaged_corpus(tmp_path):
    from tensorpar.jobs.train import TrainConfig, prepare

    plan = prepare(TrainConfig(out=str(tmp_path)))
    assert plan["spec"]["path"] == str(tmp_path / "tiny-llama") and (tmp_path / "tiny-llama" / "config.json").is_file()
    assert plan["tokens"].source["kind"] == "packaged" and len(plan["tokens"]) > 2000


def test_windows_cross_files_and_depend_only_on_the_step(files):
    import pickle

    from tensorpar.data import batch_for_step, open_tokens

    stream = open_tokens(files["npy"], 256, files["model"])
    back = pickle.loads(pickle.dumps(stream))  # a rank maps the files itself
    assert back.files == stream.files and len(back) == len(files["ids"])
    assert (back.window(490, 20) == files["ids"][490:510]).all()  # across the two files
    a = batch_for_step(stream, 5, BATCH, SEQ, SEED)
    assert torch.equal(a, batch_for_step(back, 5, BATCH, SEQ, SEED))
    assert torch.equal(a[4:], batch_for_step(stream, 5, BATCH, SEQ, SEED, slice(4, 8)))
    assert not torch.equal(a, batch_for_step(stream, 6, BATCH, SEQ, SEED))
