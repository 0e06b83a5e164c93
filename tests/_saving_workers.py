"""Workers for tests/test_models_saving.py (spawned ranks import them)."""
import os
import warnings

import torch

from tensorpar import distributed as dist
from tensorpar.apply import parallelize
from tensorpar.models import saving
from tensorpar.models.tiny import make_tiny_model
from tensorpar.models.training import train_step
from tests._mesh_workers import DECAY, LR, MAX_NORM, batches, reference

SAVE_AT = 10


def _build(layout, model):
    from torch.distributed.device_mesh import init_device_mesh
    dp, tp, kind = layout
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = parallelize(model, mesh=mesh, data_parallel=kind).train()
    d = mesh["dp"].get_local_rank()
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY), slice(d * 4 // dp, (d + 1) * 4 // dp)


def _train(model, opt, rows, steps, dp_group) -> list:
    losses = []
    for ids in steps:
        loss = torch.tensor([train_step(model, opt, ids[rows], max_norm=MAX_NORM)["loss"]], dtype=torch.float64)
        dist.all_reduce(loss, group=dp_group)
        losses.append(loss.item() / dist.get_world_size(dp_group))
    return losses


def resume_worker(root, save_layout, load_layouts, sizes=None, more=None):
    """Train 10 steps at ``save_layout`` and save; for each of ``load_layouts``, a model built from
    other weights loads the checkpoint and trains steps 11-20: each curve against the single-process
    run of all 20 steps (the reference shares no code with saving or loading). ``more``: ``(root,
    layouts)`` of a checkpoint saved elsewhere from the same run (on fewer ranks), loaded the same
    way; its curves under the key ``"more"``."""
    save_worker(root, save_layout, sizes)
    out = reshard_worker(root, load_layouts, sizes)
    if more is not None:
        out["more"] = reshard_worker(*more, sizes)
    return out


def save_worker(root, save_layout, sizes=None):
    """Train 10 steps of the tiny llama (``sizes``: its config changes) at ``save_layout``; save."""
    warnings.filterwarnings("ignore")
    model, opt, rows = _build(save_layout, make_tiny_model("llama", seed=5, **(sizes or {})))
    steps = batches(model.config.vocab_size)
    _train(model, opt, rows, steps[:SAVE_AT], model.tp_report.dp_group)
    saving.save(model, opt, root, step=SAVE_AT)
    return "saved"


def reshard_worker(root, load_layouts, sizes=None):
    """Steps 11-20 after loading ``root`` at each of ``load_layouts`` (see :func:`resume_worker`)."""
    warnings.filterwarnings("ignore")
    dense = make_tiny_model("llama", seed=5, **(sizes or {}))
    steps = batches(dense.config.vocab_size)
    want = reference(dense, steps)["losses"]
    out = {}
    for layout in load_layouts:
        model, opt, rows = _build(layout[:3], make_tiny_model("llama", seed=77, **(sizes or {})))  # other weights
        if layout[3:] != ("cold",):  # an evaluation first: FSDP then holds its root's parameters unsharded
            with torch.no_grad():
                model(input_ids=steps[0][rows])
        step = saving.load(model, opt, root)
        got = _train(model, opt, rows, steps[SAVE_AT:], model.tp_report.dp_group)
        out[layout] = {"step": step, "err": max(abs(a - b) / abs(b) for a, b in zip(got, want[SAVE_AT:])),
                       "tp": model.tp_report.tp_size}
    return out


def killed_save_worker(root, where):
    """Save step 5, then die during the save of step 10: ``where`` is "write" (rank 1 dies as the
    writing starts) or "commit" (rank 0 dies with every block written, before its COMPLETE)."""
    warnings.filterwarnings("ignore")
    model, opt, rows = _build((2, 2, "ddp"), make_tiny_model("llama", seed=5))
    steps = batches(model.config.vocab_size)
    _train(model, opt, rows, steps[:5], model.tp_report.dp_group)
    saving.save(model, opt, root, step=5)
    _train(model, opt, rows, steps[5:10], model.tp_report.dp_group)
    if where == "write" and dist.get_rank() == 1:
        import torch.distributed.checkpoint as dcp
        dcp.save = lambda *a, **k: os._exit(9)
    if where == "commit" and dist.get_rank() == 0:
        saving._commit = lambda *a, **k: os._exit(9)
    saving.save(model, opt, root, step=10)
    return "saved"


def load_worker(root):
    warnings.filterwarnings("ignore")
    model, opt, _ = _build((2, 2, "ddp"), make_tiny_model("llama", seed=77))
    return saving.load(model, opt, root)


def export_worker(root, layout):
    """Train 5 steps at ``layout``, export; the Hugging Face directory loaded by transformers
    (dense) and by load_sharded at tp 2 and 4 computes the trained model's logits."""
    warnings.filterwarnings("ignore")
    import torch.distributed as tdist
    from transformers import AutoModelForCausalLM

    from tensorpar.models.checkpoint import load_sharded
    model, opt, rows = _build(layout, make_tiny_model("llama", seed=5))
    steps = batches(model.config.vocab_size)
    _train(model, opt, rows, steps[:5], model.tp_report.dp_group)
    probe = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model.eval()(input_ids=probe).logits
        initial = make_tiny_model("llama", seed=5)(input_ids=probe).logits
    saving.export(model, root)
    pair = [tdist.new_group([0, 1]), tdist.new_group([2, 3])][dist.get_rank() // 2]
    out = {"moved": ((want - initial).abs().max() / want.abs().max()).item()}
    dense = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float64).eval()
    with torch.no_grad():
        out["transformers"] = ((dense(input_ids=probe).logits - want).abs().max() / want.abs().max()).item()
    for tp, group in ((2, pair), (4, None)):
        split = load_sharded(root, tp_group=group, dtype=torch.float64)[0].eval()  # (its proof takes gradients)
        with torch.no_grad():
            out[f"tp{tp}"] = ((split(input_ids=probe).logits - want).abs().max() / want.abs().max()).item()
    return out


def dropout_resume_worker(root):
    """GPT-2 with dropout, tp 2, training mode: 6 steps uninterrupted; and 3 steps, saved, loaded
    into a model split from other weights, 3 more. With the default generator and the per-rank
    tensor-parallel one both restored, the resumed losses repeat the uninterrupted ones (the same
    masks); returns both curves."""
    warnings.filterwarnings("ignore")
    dense = make_tiny_model("gpt2", seed=5, attn_pdrop=0.3, resid_pdrop=0.3)
    steps = batches(dense.config.vocab_size)[:6]

    def run(model, opt, ids):
        return [train_step(model, opt, x, max_norm=MAX_NORM)["loss"] for x in ids]

    torch.manual_seed(1)
    model = parallelize(dense).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    first = run(model, opt, steps[:3])
    saving.save(model, opt, root, step=3)
    whole = first + run(model, opt, steps[3:])
    torch.manual_seed(99)  # another generator state, replaced by the checkpoint's
    other = parallelize(make_tiny_model("gpt2", seed=77, attn_pdrop=0.3, resid_pdrop=0.3)).train()
    opt = torch.optim.AdamW(other.parameters(), lr=LR, weight_decay=DECAY)
    saving.load(other, opt, root)
    return {"whole": whole, "resumed": first + run(other, opt, steps[3:])}


def late_look_worker(root) -> list:
    """The same step saved twice, rank 1 looking at the folder as it would once rank 0 has
    published the save (on a loaded machine it can: ``os.path.lexists`` then sees the step's
    folder, here answered so for it): both saves must still return, on every rank, the folder rank
    0 published. Returns this rank's returned folders, and whether each was a whole checkpoint
when its save returned."""
    import re
    model = parallelize(make_tiny_model("llama", seed=3))
    real = os.path.lexists
    if dist.get_rank() == 1:
        os.path.lexists = lambda p: bool(re.fullmatch(r"step-\d{8}", os.path.basename(str(p)))) or real(p)
    folders, exist = [], []
    try:
        for _ in range(2):  # the second save replaces the first (latest moves, the older folder goes)
            folders.append(os.path.relpath(saving.save(model, None, root, step=7), root))
            exist.append(os.path.isfile(os.path.join(root, folders[-1], "COMPLETE")))
            dist.barrier()
    finally:
        os.path.lexists = real
    return folders, exist


def two_rank_worker(dropout_root, tp2_root, late_root):
    """The launch of 2 ranks: :func:`dropout_resume_worker`, the tiny Llama's 10 steps saved at
    tp 2 (dp 1) for a launch of 4 ranks to resume (:func:`resume_worker`'s ``more``), and
    :func:`late_look_worker`."""
    out = dropout_resume_worker(dropout_root)
    save_worker(tp2_root, (1, 2, None))
    out["late_look"] = late_look_worker(late_root)
    return out
