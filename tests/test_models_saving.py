"""Checkpoints (tensorpar.models.saving on torch.distributed.checkpoint): a run saved at step 10 and
resumed continues on the uninterrupted single-process curve, at the same layout and at others
(resharded over tp and dp, DDP and FSDP); a save killed anywhere leaves the previous checkpoint;
a broken or foreign checkpoint is refused naming the file or key, before anything changes."""
import functools
import json

import pytest
import torch

from tensorpar import distributed as dist
from tensorpar.models import saving
from tensorpar.models.tiny import make_tiny_model
from tests import _saving_workers as W

# float64, the same bound as the mesh training tests (tests/test_models_mesh.py): a resumed run
# repeats the uninterrupted one's operations, up to summation order in other layouts.
TOL = 1e-12
# "cold": loaded into a model that has not run a forward yet (what a training job's resume does)
LOADS = [(2, 2, "ddp"), (1, 4, None), (4, 1, "fsdp"), (2, 2, "fsdp"), (2, 2, "fsdp", "cold")]


# loaded on 4 ranks from a checkpoint saved at tp 2 on 2 ranks (more ranks than it was saved from)
MORE_RANKS = [(1, 4, None), (2, 2, "fsdp")]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One launch of 2 ranks: the dropout run (its test below) and the tiny Llama saved at tp 2,
    which the 4-rank resume launch of the DDP save also loads (no launch of its own)."""
    root = tmp_path_factory.mktemp("two-ranks")
    results = dist.launch(W.two_rank_worker, 2, str(root / "dropout"), str(root / "tp2"), str(root / "late"),
                          deadline=300)
    return str(root / "tp2"), results


@functools.lru_cache(maxsize=None)
def resumed(save_layout, tp2_root=None) -> list:
    import tempfile
    more = None if tp2_root is None else (tp2_root, MORE_RANKS)
    with tempfile.TemporaryDirectory() as tmp:
        return dist.launch(W.resume_worker, 4, tmp, save_layout, LOADS, None, more, deadline=600)


def _resumed(save_layout, request) -> list:
    """The DDP save's launch also loads the 2-rank checkpoint (so both tests share one launch)."""
    return resumed(save_layout, request.getfixturevalue("two_ranks")[0] if save_layout[2] == "ddp" else None)


@pytest.mark.parametrize("save_layout", [(2, 2, "ddp"), (2, 2, "fsdp")], ids=["saved-dp2xtp2-ddp", "saved-dp2xtp2-fsdp"])
@pytest.mark.parametrize("load_layout", LOADS, ids=lambda x: f"loaded-dp{x[0]}xtp{x[1]}-{x[2]}{''.join('-' + a for a in x[3:])}")
def test_a_resumed_run_continues_the_uninterrupted_curve(save_layout, load_layout, request):
    for res in _resumed(save_layout, request):
        r = res[load_layout]
        assert r["step"] == W.SAVE_AT
        assert r["err"] <= TOL, r


@pytest.mark.parametrize("load_layout", MORE_RANKS, ids=lambda x: f"loaded-dp{x[0]}xtp{x[1]}-{x[2]}")
def test_a_checkpoint_saved_on_2_ranks_continues_on_4(load_layout, request):
    """Saved at tp 2 on 2 ranks, loaded at tp 4 and at dp 2 x tp 2 (FSDP) on 4: each rank's blocks
    come from pieces another layout wrote; steps 11-20 on the uninterrupted curve (float64, TOL)."""
    results = _resumed((2, 2, "ddp"), request)
    assert len(results) == 4
    for res in results:
        r = res["more"][load_layout]
        assert r["step"] == W.SAVE_AT and r["tp"] == load_layout[1]
        assert r["err"] <= TOL, r


# six heads (and six KV heads) split at tp 2, 3 and 6: the tiny llama's four do not split over 3
SIX_HEADS = {"num_attention_heads": 6, "num_key_value_heads": 6}


@functools.lru_cache(maxsize=None)
def resharded_to_tp3_and_tp1() -> dict:
    """Saved at dp 2 x tp 2 (FSDP) on 4 ranks; loaded at tp 3 on 3 ranks and whole in one process."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        dist.launch(W.save_worker, 4, tmp, (2, 2, "fsdp"), SIX_HEADS, deadline=300)
        out = dist.launch(W.reshard_worker, 3, tmp, [(1, 3, None)], SIX_HEADS, deadline=300)
        out += dist.launch(W.reshard_worker, 1, tmp, [(1, 1, None)], SIX_HEADS, deadline=300)
    return out


def test_a_checkpoint_saved_at_dp2xtp2_resumes_at_tp3_and_unsplit():
    results = resharded_to_tp3_and_tp1()
    assert len(results) == 4
    for res in results:
        ((layout, r),) = res.items()
        assert r["tp"] == layout[1] and r["step"] == W.SAVE_AT
        assert r["err"] <= TOL, (layout, r)


def test_every_rank_returns_the_folder_rank_0_published_however_late_it_looks(two_ranks):
    """The checkpoint's folder name is rank 0's pick, shared: a rank that looked for the step's
    folder after rank 0 had published it once returned a name of its own (a folder that never
    existed), and the bench's load of it failed."""
    (folders, exist), (folders1, exist1) = [r["late_look"] for r in two_ranks[1]]
    assert folders == folders1 and exist == exist1 == [True, True], (folders, exist, folders1, exist1)
    assert folders[0] == "step-00000007" and folders[1].startswith("step-00000007."), folders


def test_a_resume_with_dropout_repeats_the_uninterrupted_masks(two_ranks):
    """GPT-2 with attention and residual dropout at tp 2: the checkpoint keeps each rank's default
    generator and its tensor-parallel one, so steps 4-6 after a resume draw the same masks as the
    uninterrupted run and give the same losses, exactly (the same operations in the same order)."""
    for r in two_ranks[1]:
        assert r["resumed"] == r["whole"], r


@pytest.mark.parametrize("where", ["write", "commit"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, where):
    with pytest.raises(dist.RankFailedError):
        dist.launch(W.killed_save_worker, 4, str(tmp_path), where, deadline=300)
    assert (tmp_path / "latest").read_text() == "step-00000005"
    unfinished = [p for p in tmp_path.iterdir() if p.name.startswith(".step-00000010")]
    assert unfinished and not any((p / "COMPLETE").exists() for p in unfinished)
    with pytest.raises(ValueError, match="an unfinished save|not a tensorpar checkpoint"):
        saving.resolve(unfinished[0])
    assert dist.launch(W.load_worker, 4, str(tmp_path), deadline=300) == [5] * 4


@pytest.fixture()
def saved(tmp_path):
    """A dense model and its optimizer after one step, saved in this process (no ranks)."""
    model = make_tiny_model("llama", seed=1).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()
    opt.step()
    folder = saving.save(model, opt, tmp_path / "ckpt", step=3)
    return model, opt, folder


def _fresh():
    model = make_tiny_model("llama", seed=2).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_a_dense_model_round_trips(saved):
    model, opt, folder = saved
    other, other_opt = _fresh()
    assert saving.load(other, other_opt, folder.parent) == 3
    for (name, a), b in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(a, b), name
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][k], other_opt.state[b][k]), (name, k)
    assert json.loads((folder / "COMPLETE").read_text())["step"] == 3


def _broken_file(folder):
    return sorted(folder.glob("*.distcp"))[0]


@pytest.mark.parametrize("damage, message", [
    (lambda f: _broken_file(f).unlink(), "is missing its file __0_0.distcp"),
    (lambda f: _broken_file(f).write_bytes(_broken_file(f).read_bytes()[:100]), "is truncated: 100 bytes"),
    (lambda f: (f / "COMPLETE").unlink(), "an unfinished save (no COMPLETE record)"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_file_before_anything_changes(saved, damage, message):
    _, _, folder = saved
    damage(folder)
    model, opt = _fresh()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=_escape(message)):
        saving.load(model, opt, folder)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state


def _escape(text):
    import re
    return re.escape(text)


@pytest.mark.parametrize("make, message", [
    (lambda: make_tiny_model("gpt2"), "has no 'model.transformer.wte.weight': it is of another model"),
    (lambda: make_tiny_model("llama", hidden_size=64), "'model.model.embed_tokens.weight' is (130, 48) there and (130, 64)"),
])
def test_a_checkpoint_of_another_model_is_refused(saved, make, message):
    _, _, folder = saved
    model = make()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=_escape(message)):
        saving.load(model, torch.optim.AdamW(model.parameters()), folder)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_folder_that_is_not_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    model, opt = _fresh()
    with pytest.raises(ValueError, match="is not a tensorpar checkpoint: expected latest or COMPLETE"):
        saving.load(model, opt, tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        saving.load(model, opt, tmp_path / "nothing")


def test_an_export_loads_in_transformers_and_at_any_tp_as_the_trained_model(tmp_path):
    """Trained at dp 2 x tp 2 (FSDP), exported: transformers' from_pretrained and load_sharded at
    tp 2 and 4 compute its logits (float64, <= 1e-12); the training moved them (power)."""
    for r in dist.launch(W.export_worker, 4, str(tmp_path / "hf"), (2, 2, "fsdp"), deadline=600):
        assert r["moved"] > 1e-3, r
        assert max(r["transformers"], r["tp2"], r["tp4"]) <= TOL, r
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "generation_config.json",
                                                                    "model.safetensors"] or \
        sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]


def test_the_same_step_saved_again_replaces_it_and_keeps_latest_whole(saved, tmp_path):
    model, opt, folder = saved
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    again = saving.save(model, opt, folder.parent, step=3)
    assert again != folder and again.name.startswith("step-00000003.") and not folder.exists()
    assert (folder.parent / "latest").read_text() == again.name
    other, other_opt = _fresh()
    assert saving.load(other, other_opt, folder.parent) == 3
    assert torch.equal(next(other.parameters()), next(model.parameters()))


def test_optimizer_mismatches_are_refused_before_anything_changes(saved, tmp_path):
    model, _, folder = saved
    no_opt = saving.save(model, None, tmp_path / "bare", step=1)
    other, other_opt = _fresh()
    with pytest.raises(ValueError, match="was saved without an optimizer; load it with optimizer=None"):
        saving.load(other, other_opt, no_opt)
    assert not other_opt.state
    assert saving.load(other, None, no_opt) == 1
    two_groups = torch.optim.AdamW([{"params": list(other.parameters())[:2]},
                                    {"params": list(other.parameters())[2:]}], lr=1e-2)
    with pytest.raises(ValueError, match="has 1 optimizer parameter groups, this optimizer 2"):
        saving.load(other, two_groups, folder)


def test_the_optimizers_hyperparameters_come_back_and_how_it_runs_stays(tmp_path):
    """As the README says: the optimizer's hyperparameters go with the checkpoint (every one set
    off its default here), how it runs (foreach, fused) stays this process's choice."""
    hyper = {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.05, "amsgrad": True, "maximize": True}
    model = make_tiny_model("llama", seed=1).train()
    opt = torch.optim.AdamW(model.parameters(), fused=True, **hyper)
    model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()
    opt.step()
    folder = saving.save(model, opt, tmp_path / "ckpt", step=1)
    other = make_tiny_model("llama", seed=2)
    fresh = torch.optim.AdamW(other.parameters(), lr=1e-2, foreach=True)  # every other setting its default
    saving.load(other, fresh, folder)
    group = fresh.param_groups[0]
    assert {k: group[k] for k in hyper} == hyper
    assert (group["foreach"], group["fused"]) == (True, None)
    assert torch.equal(fresh.state[next(other.parameters())]["max_exp_avg_sq"],
                       opt.state[next(model.parameters())]["max_exp_avg_sq"])
