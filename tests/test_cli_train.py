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

import tensorpar.dist
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
    from tensorpar.models.testing import make_tiny_checkpoint

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
    assert run["layout"] == {"dp": 2, "tp": 2, "zero": 0, "data_parallel": "ddp", "sequence_parallel": False,
                             "world_size": 4, "backend": "shm", "fixes": []}
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
    from tensorpar.models.testing import make_tiny_checkpoint

    small = os.path.join(files["root"], "small-model")
    if not os.path.isdir(small):
        make_tiny_checkpoint(small, "llama", seed=1)
    return small


def _bad_inputs(files, tmp):
    small = _small_model(files)
    oov = os.path.join(tmp, "oov")
    os.makedirs(oov)
    np.save(os.path.join(oov, "a.npy"), np.arange(100))
    np.save(os.path.join(oov, "b.npy"), np.array([5, 300, 7]))
    m = ["--model", files["model"]]
    return [
        (m + ["--tp", "3", "--dp", "1"], "tp_size (3)"),
        (m + ["--zero", "2"], "--zero 2"),
        (m + ["--dp", "4", "--tp", "1", "--batch", "6"], "--batch 6"),
        (m + ["--data", os.path.join(tmp, "missing.txt")], "missing.txt"),
        (m + ["--data", oov], "b.npy: token id 300 at position 1"),
        (["--model", small, "--data", files["text"]], "vocabulary of 130"),
        (m + ["--sequence-parallel", "--seq", "15"], "--seq 15"),
        (m + ["--steps", "0"], "--steps must be a positive integer, got 0"),
        (m + ["--dtype", "float16"], "--dtype 'float16'"),
        (m + ["--resume", tmp], "not a tensorpar checkpoint"),
        (m + ["--out", files["text"]], "is a file"),
        # what the ranks would refuse, refused before they start
        (["--model", _tiny(files, "mixtral"), "--sequence-parallel"], "has mixture-of-experts layers"),
        (["--model", _tiny(files, "gpt2"), "--zero", "3", "--save-every", "2"], "transposed (Conv1D) shard"),
    ]


def _tiny(files, arch, **sizes) -> str:
    from tensorpar.models.testing import make_tiny_checkpoint

    path = os.path.join(files["root"], f"{arch}-{'-'.join(f'{k}{v}' for k, v in sizes.items())}")
    if not os.path.isdir(path):
        make_tiny_checkpoint(path, arch, seed=1, **sizes)
    return path


def _no_launch(*args, **kwargs):
    raise AssertionError("a rank was launched")


def test_bad_inputs_exit_2_before_any_rank(files, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tensorpar.dist, "launch", _no_launch)
    for argv, named in _bad_inputs(files, str(tmp_path)):
        code, out, err = _main(["--out", str(tmp_path / "out"), "--json", *argv], capsys)
        assert code == 2, (argv, err)
        assert named in err and out["ok"] is False and named in out["error"], (argv, err)


def test_a_resume_with_other_batches_is_refused_before_any_rank(files, tmp_path, capsys, monkeypatch):
    """The checkpoint keeps the seed, batch, sequence length and the data's fingerprint: resuming
    with another would silently read other batches than the run it continues."""
    resume = os.path.join(_run(files["root"], "full")["out"], "checkpoints")
    monkeypatch.setattr(tensorpar.dist, "launch", _no_launch)
    m = ["--model", files["model"], "--resume", resume, "--steps", str(STEPS + 2), "--out", str(tmp_path / "o")]
    for extra, named in ((["--seed", "8", "--data", files["text"]], "seed 7 (now 8)"),
                         (["--seed", str(SEED)], "data '")):
        code, out, err = _main([*m, *extra, "--batch", str(BATCH), "--seq", str(SEQ), "--json"], capsys)
        assert code == 2 and named in err and "would read other batches" in err, (extra, err)


def test_torchrun_world_size_must_be_dp_times_tp(files, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tensorpar.dist, "launch", _no_launch)
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    code, _, err = _main(["--model", files["model"], "--tp", "2", "--dp", "2", "--out", str(tmp_path)], capsys)
    assert code == 2 and "--dp x --tp = 4 ranks, but torchrun started WORLD_SIZE=2" in err, err


def test_a_failing_rank_ends_the_job_with_its_error(files, tmp_path, capsys):
    """A checkpoint of another model (saved by tensorpar.save, not by this command, so nothing is
    compared before the launch): the rank's load refuses it and the launcher ends the job, exit 1."""
    from tensorpar.models import saving
    from tensorpar.models.testing import make_tiny_model

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
