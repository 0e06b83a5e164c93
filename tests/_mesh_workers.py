"""Workers for tests/test_models_mesh.py (spawned ranks import them)."""
import copy
import warnings

import torch
import torch.distributed as tdist

from tensorpar import distributed as dist
from tensorpar.apply import parallelize
from tensorpar.models.tiny import make_tiny_model
from tensorpar.models.training import causal_lm_loss, train_step

STEPS, BATCH, SEQ = 20, 4, 8
LR, DECAY, MAX_NORM = 3e-3, 0.1, 0.5  # the norm of the tiny llama's gradient is ~1-3: clipping acts


def batches(vocab: int) -> list:
    """The global batch of every step, the same on every rank (and in the reference)."""
    gen = torch.Generator().manual_seed(21)
    return [torch.randint(0, vocab, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def reference(dense, steps) -> dict:
    """The unsplit model in this process, the global batch, AdamW, torch's own clipping."""
    model = copy.deepcopy(dense).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    losses, norms = [], []
    for ids in steps:
        opt.zero_grad(set_to_none=True)
        loss = causal_lm_loss(model, ids)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        losses.append(float(loss))
    return {"losses": losses, "norms": norms, "model": model}


# The models of the layouts: the tiny Llama (GQA 4/2 heads), and Phi-3 with one KV head, whose fused
# qkv_proj at tp 2 holds that head's rows on both ranks (tp_row_replicas): clipping counts them once,
# and under FSDP only on the dp rank whose rows they are (fsdp_first_row).
MODELS = {"llama": ("llama", {}), "phi3-kv1": ("phi3", {"num_key_value_heads": 1})}


def _reference_of(dtype: str, model: str) -> tuple:
    arch, sizes = MODELS[model]
    dense = make_tiny_model(arch, seed=5, dtype=getattr(torch, dtype), **sizes)
    steps = batches(dense.config.vocab_size)
    ref = reference(dense, steps)
    probe = torch.randint(0, dense.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref_logits = ref["model"].eval()(input_ids=probe).logits
        moved = ((ref_logits - dense(input_ids=probe).logits).abs().max() / ref_logits.abs().max()).item()
    return dense, steps, ref, probe, ref_logits, moved


def mesh_worker(layouts):
    """For each ``(dp, tp, data_parallel, sequence_parallel, dtype[, model])``: 20 AdamW steps with
    clipping on a (dp, tp) mesh, each dp rank on its slice of the global batch; the loss (averaged
    over dp), the clipped norm and the trained model's logits against :func:`reference` in that
    dtype. Also what is refused before anything changes (a mesh without dp given an engine, a mesh
    with dp > 1 given none) and ranks of a tp group given different batches."""
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh
    out, refs = {}, {}
    for layout in layouts:
        dp, tp, kind, sp, dtype, model_name = (*layout, "llama")[:6]
        if (dtype, model_name) not in refs:
            refs[(dtype, model_name)] = _reference_of(dtype, model_name)
        dense, steps, ref, probe, ref_logits, moved = refs[(dtype, model_name)]
        if "tp_only" not in out:
            out["tp_only"] = _tp_only_mesh_refused(dense)
            out["different_batches"] = _different_batches(dense)
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        if dp > 1 and "no_engine" not in out:
            out["no_engine"] = _dp_without_engine_refused(dense, mesh)
        model = parallelize(copy.deepcopy(dense), mesh=mesh, data_parallel=kind, sequence_parallel=sp).train()
        types = sorted({type(p).__name__ for p in model.parameters()})  # before a forward: FSDP's root
        # keeps its parameters unsharded after one (reshard_after_forward is off at the root)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
        d = mesh["dp"].get_local_rank()
        rows = slice(d * BATCH // dp, (d + 1) * BATCH // dp)
        losses, norms = [], []
        for ids in steps:
            res = train_step(model, opt, ids[rows], max_norm=MAX_NORM)
            loss = torch.tensor([res["loss"]], dtype=torch.float64)
            dist.all_reduce(loss, group=mesh["dp"].get_group())  # the mean over equal slices
            losses.append(loss.item() / dp)
            norms.append(res["grad_norm"])
        with torch.no_grad():
            logits = model.eval()(input_ids=probe).logits
        out[layout] = {
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])),
            "norm_err": max(abs(a - b) / b for a, b in zip(norms, ref["norms"])),
            "logits_err": ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item(),
            "clipped_steps": sum(n > MAX_NORM for n in ref["norms"]),
            "trained_moved": moved,  # the trained model's logits against the initial model's
            "report": (model.tp_report.data_parallel, model.tp_report.dp_size, model.tp_report.tp_size,
                       model.tp_report.sequence_parallel),
            "param_types": types,
            "row_replicated": sorted(n for n, p in model.named_parameters() if hasattr(p, "tp_row_replicas")),
            "transports": (dist.transport(mesh["dp"].get_group()), dist.transport(mesh["tp"].get_group())),
            "rank": tdist.get_rank()}
    return out


def _tp_only_mesh_refused(dense) -> tuple:
    """data_parallel on a mesh without a 'dp' dimension: refused before the model is touched."""
    from torch.distributed.device_mesh import init_device_mesh
    model = copy.deepcopy(dense)
    try:
        parallelize(model, mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)), data_parallel="ddp")
    except ValueError as exc:
        return str(exc), hasattr(model, "tp_report"), type(model.model.layers[0].mlp.up_proj).__name__
    return None, hasattr(model, "tp_report"), type(model.model.layers[0].mlp.up_proj).__name__


def _dp_without_engine_refused(dense, mesh) -> tuple:
    """A mesh with dp > 1 and data_parallel=None: each dp replica would train on its own rows and
    drift from the others. Refused (ValueError naming dp and the engines) before the model is touched."""
    model = copy.deepcopy(dense)
    try:
        parallelize(model, mesh=mesh, data_parallel=None)
    except ValueError as exc:
        return str(exc), hasattr(model, "tp_report"), type(model.model.layers[0].mlp.up_proj).__name__
    return None, hasattr(model, "tp_report"), type(model.model.layers[0].mlp.up_proj).__name__


def _different_batches(dense) -> dict:
    """tp 4 over the world, rank 3 given another batch: train_step refuses it by default, every rank
    (one all-reduce tells them all), naming rank 3; with check_batch=False the step runs."""
    from tensorpar.sharding.audit import ReplicaDriftError
    model = parallelize(copy.deepcopy(dense)).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = batches(dense.config.vocab_size)[0]
    mine = ids.flip(1) if tdist.get_rank() == 3 else ids
    out = {}
    try:
        train_step(model, opt, mine)
        out["refused"] = None
    except ReplicaDriftError as exc:
        out["refused"] = str(exc)
    out["unchecked_loss"] = train_step(model, opt, mine, check_batch=False)["loss"]
    return out
