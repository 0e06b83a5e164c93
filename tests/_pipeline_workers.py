"""Workers for tests/test_pipeline.py (spawned ranks import them)."""
import copy
import functools
import warnings

import torch
import torch.distributed as tdist

from tensorpar import distributed as dist
from tensorpar.apply import parallelize
from tensorpar.models.tiny import make_tiny_model
from tensorpar.models.training import causal_lm_loss, train_step

STEPS, BATCH, SEQ = 20, 4, 8
SHORT = 6  # the steps of the layouts beyond the list (options {"steps": SHORT})
LR, DECAY, MAX_NORM = 3e-3, 0.1, 0.5  # the tiny models' gradient norms are ~1-3: clipping acts

# name -> (architecture, sizes): 4 blocks unless the case says otherwise
MODELS = {
    "llama": ("llama", {"num_hidden_layers": 4}),
    "llama3": ("llama", {"num_hidden_layers": 3}),   # uneven: 2 + 1 blocks at pp 2
    "llama5": ("llama", {"num_hidden_layers": 5}),   # 5 blocks: 2 virtual stages per rank at pp 2 do not divide them
    "gpt2": ("gpt2", {"num_hidden_layers": 4}),      # tied wte/lm_head, learned positions (wpe)
    "mixtral": ("mixtral", {"num_hidden_layers": 2}),  # mixture of experts
}


@functools.lru_cache(maxsize=None)
def _mesh(*shape):
    """One DeviceMesh per shape for the whole launch: each new mesh makes process groups, whose
    gloo halves connect through the launch's file store (slower as it fills)."""
    from torch.distributed.device_mesh import init_device_mesh
    names = ("pp", "dp", "tp") if len(shape) == 3 else ("dp", "tp")
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _dense(name):
    arch, sizes = MODELS[name]
    return make_tiny_model(arch, seed=5, dtype=torch.float64, **sizes)


def _batches(vocab: int) -> list:
    gen = torch.Generator().manual_seed(21)
    return [torch.randint(0, vocab, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def _reference(dense, steps) -> dict:
    """The unsplit model in this process on the global batch: AdamW, torch's own clipping; the
    first step's clipped gradients by name."""
    model = copy.deepcopy(dense).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    losses, norms, first, after = [], [], None, {}
    for ids in steps:
        opt.zero_grad(set_to_none=True)
        loss = causal_lm_loss(model, ids)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        if first is None:
            first = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        opt.step()
        losses.append(float(loss.detach()))
        if len(losses) == SHORT:
            after[SHORT] = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return {"losses": losses, "norms": norms, "grads": first, "after": after,
            "params": {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}}


def _grad_err(model, ref_grads) -> float:
    """The largest relative difference of this rank's gradient of every parameter it holds from its
    piece of the reference's."""
    return max(_err(p.grad, p, ref_grads[name]) for name, p in model.named_parameters())


def _param_err(model, ref_params) -> float:
    return max(_err(p.detach(), p, ref_params[name]) for name, p in model.named_parameters())


def _err(mine, p, dense) -> float:
    """``mine`` (this rank's tensor: a DTensor's local part) against its piece of ``dense``: the tp
    shard (``p.tp_spec``), and under FSDP2 this dp rank's rows of it (``torch.chunk``'s split of dim
    0). No collective: the ranks of a pipeline do not wait for each other here."""
    expected = p.tp_spec.apply(dense) if p.tp_spec.is_shard else dense
    if hasattr(mine, "to_local"):
        if any(getattr(pl, "dim", None) == 0 for pl in mine.placements):  # FSDP2: Shard(0) over dp
            per = -(-expected.shape[0] // mine.device_mesh.size())
            start = mine.device_mesh.get_local_rank() * per
            expected = expected[start:start + per]
        mine = mine.to_local()
    return float((mine - expected).abs().max()) / max(float(expected.abs().max()), 1e-30)


def pipeline_worker(layouts):
    """For each ``(pp, dp, tp, schedule, microbatches, model[, options])``: 20 AdamW steps with
    clipping on a (pp, dp, tp) mesh, each dp rank on its rows of the global batch, against the
    reference in float64: the loss train_step returns, the clipped norm, every parameter's first
    gradient and every trained parameter."""
    warnings.filterwarnings("ignore")
    out, refs = {}, {}
    for layout in layouts:
        pp, dp, tp, schedule, mb, name, opts = (*layout, {})[:7]
        if name not in refs:
            dense = _dense(name)
            steps = _batches(dense.config.vocab_size)
            refs[name] = (dense, steps, _reference(dense, steps))
        dense, steps, ref = refs[name]
        mesh = _mesh(pp, dp, tp)
        model = parallelize(copy.deepcopy(dense).train(), mesh=mesh, pipeline=schedule, microbatches=mb,
                            data_parallel=opts.get("dp"), sequence_parallel=opts.get("sp", False),
                            virtual_stages=opts.get("virtual"), stage_blocks=opts.get("blocks"))
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
        d = mesh["dp"].get_local_rank()
        rows = slice(d * BATCH // dp, (d + 1) * BATCH // dp)
        losses, norms, grad_err = [], [], None
        for ids in steps[:opts.get("steps", STEPS)]:
            res = train_step(model, opt, ids[rows], max_norm=MAX_NORM)
            losses.append(res["loss"])
            norms.append(res["grad_norm"])
            if grad_err is None:
                grad_err = _grad_err(model, ref["grads"])
        n = len(losses)
        out[str(layout)] = {
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])),
            "norm_err": max(abs(a - b) / b for a, b in zip(norms, ref["norms"])),
            "grad_err": grad_err,
            "param_err": _param_err(model, ref["params"]) if n == STEPS else _param_err(model, ref["after"][n]),
            "clipped_steps": sum(n > MAX_NORM for n in ref["norms"]),
            "stages": model.stage_indices, "stage_blocks": model.tp_report.stage_blocks,
            "names": sorted(n for n, _ in model.named_parameters()),
            "rank": tdist.get_rank()}
    return out


def _untouched(model) -> bool:
    return not hasattr(model, "tp_report") and type(model.model.layers[0].mlp.up_proj).__name__ == "Linear"


def refusal_worker() -> dict:
    """What a pipelined parallelize refuses, before any collective and with the model untouched;
    what train_step and generate refuse on a pipelined model."""
    warnings.filterwarnings("ignore")
    from tensorpar.models.generation import generate
    mesh, flat = _mesh(2, 1, 2), _mesh(2, 2)
    out = {}
    cases = {"schedule": ("llama", dict(mesh=mesh, pipeline="Bogus")),
             "too_many_stages": ("llama", dict(mesh=mesh, pipeline="Interleaved1F1B", virtual_stages=4)),
             "virtual_not_dividing": ("llama5", dict(mesh=mesh, pipeline="Interleaved1F1B", virtual_stages=2,
                                                     microbatches=2)),
             "torch_limit": ("llama", dict(mesh=mesh, pipeline="1F1B", microbatches=1)),
             "bad_blocks": ("llama", dict(mesh=mesh, pipeline="1F1B", microbatches=2, stage_blocks=(3, 2))),
             "pp_without_schedule": ("llama", dict(mesh=mesh)),
             "schedule_without_pp": ("llama", dict(mesh=flat, pipeline="1F1B", data_parallel="ddp")),
             "schedule_without_mesh": ("llama", dict(pipeline="1F1B")),
             "microbatches_without_schedule": ("llama", dict(mesh=flat, data_parallel="ddp", microbatches=2))}
    for key, (name, kwargs) in cases.items():
        model = copy.deepcopy(_dense(name))
        try:
            parallelize(model, **kwargs)
            out[key] = (None, _untouched(model))
        except ValueError as exc:
            out[key] = (str(exc), _untouched(model))
    model = parallelize(copy.deepcopy(_dense("llama")).train(), mesh=mesh, pipeline="1F1B", microbatches=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = _batches(model.config.vocab_size)[0]
    for key, call in (("microbatches", lambda: train_step(model, opt, ids)),
                      ("generate", lambda: generate(model, ids[:1], 2)),
                      ("forward", lambda: model(input_ids=ids))):
        try:
            call()
            out[key] = None
        except ValueError as exc:
            out[key] = str(exc)
    return out


def all_worker(layouts, folder, ledger_layouts) -> dict:
    """Everything test_pipeline.py asks of 4 ranks, in one launch."""
    return {"refusals": refusal_worker(), "layouts": pipeline_worker(layouts),
            "checkpoints": checkpoint_worker(folder), "ledger": ledger_worker(ledger_layouts)}


CKPT_STEPS = 6  # 3 steps, a checkpoint, 3 more in another layout


def _run(model, opt, steps, rows=slice(None)) -> list:
    return [train_step(model, opt, ids[rows], max_norm=MAX_NORM)["loss"] for ids in steps]


def _layout_model(dense, layout):
    """``layout``: "pp2xtp2", "pp4", "tp4" or "dense", on the 4 ranks."""
    model = copy.deepcopy(dense).train()
    if layout == "pp2xtp2":
        mesh = _mesh(2, 1, 2)
        return parallelize(model, mesh=mesh, pipeline="1F1B", microbatches=2)
    if layout == "pp4":
        mesh = _mesh(4, 1, 1)
        return parallelize(model, mesh=mesh, pipeline="GPipe", microbatches=4)
    if layout == "tp4":
        return parallelize(model)
    return model


def checkpoint_worker(folder: str) -> dict:
    """A checkpoint saved at pp 2 x tp 2 resumes at tp 4, at pp 4 and unsplit, and checkpoints saved
    at tp 4 and unsplit resume at pp 2 x tp 2: each the last 3 of 6 steps against the reference's;
    ``export`` of the pipelined model after 3 steps against the reference's parameters then."""
    from pathlib import Path
    from tensorpar.models.saving import export, load, save
    warnings.filterwarnings("ignore")
    dense = _dense("gpt2")  # tied embedding and head: one key in the checkpoint, two stages holding it
    steps = _batches(dense.config.vocab_size)[:CKPT_STEPS]
    ref_model = copy.deepcopy(dense).train()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=DECAY)
    ref = _run(ref_model, ref_opt, steps[:3])
    ref_after3 = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    ref += _run(ref_model, ref_opt, steps[3:])
    out = {}
    for src, dsts in (("pp2xtp2", ("tp4", "pp4", "dense")), ("tp4", ("pp2xtp2",)), ("dense", ("pp2xtp2",))):
        model = _layout_model(dense, src)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
        first = _run(model, opt, steps[:3])
        where = Path(folder) / src
        save(model, opt, where, step=3)
        if src == "pp2xtp2":
            export(model, Path(folder) / "export")
        for dst in dsts:
            resumed = _layout_model(dense, dst)
            ropt = torch.optim.AdamW(resumed.parameters(), lr=LR, weight_decay=DECAY)
            step = load(resumed, ropt, where)
            after = _run(resumed, ropt, steps[3:])
            out[(src, dst)] = {"step": step, "err": max(abs(a - b) / abs(b) for a, b in zip(first + after, ref))}
    tdist.barrier()
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(Path(folder) / "export", torch_dtype=torch.float64)
    out["export"] = max(float((p.detach() - ref_after3[n]).abs().max()) / float(ref_after3[n].abs().max())
                        for n, p in exported.named_parameters())
    return out


LEDGER_BATCH = 4


def _held(model, opt) -> dict:
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    params = list(model.parameters())
    return {"params": sum(local(p).numel() * p.element_size() for p in params),
            "grads": sum(local(p.grad).numel() * p.element_size() for p in params if p.grad is not None),
            "optimizer": sum(local(v).numel() * v.element_size() for s in opt.state.values()
                             for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))}


def ledger_worker(layouts) -> dict:
    """For each ``(pp, dp, tp, schedule, microbatches, model[, options])``: two training steps, then
    a third under the ledger; its records by mesh dimension (the tied embedding's group counted as
    pp) and the bytes this rank holds."""
    warnings.filterwarnings("ignore")
    out = {}
    for layout in layouts:
        pp, dp, tp, schedule, mb, name, opts = (*layout, {})[:7]
        mesh = _mesh(pp, dp, tp)
        model = parallelize(copy.deepcopy(_dense(name)).train(), mesh=mesh, pipeline=schedule, microbatches=mb,
                            data_parallel=opts.get("dp"), sequence_parallel=opts.get("sp", False),
                            virtual_stages=opts.get("virtual"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        d = mesh["dp"].get_local_rank()
        ids = _batches(model.config.vocab_size)[0][:LEDGER_BATCH]
        rows = ids[d * LEDGER_BATCH // dp:(d + 1) * LEDGER_BATCH // dp]
        for _ in range(2):
            train_step(model, opt, rows, max_norm=1.0)
        with dist.ledger(model) as led:
            train_step(model, opt, rows, max_norm=1.0)
        names = {mesh[k].get_group().group_name: k for k in ("tp", "dp", "pp")}
        if model._tied_group is not None:
            names[model._tied_group.group_name] = "pp"
        out[str(layout)] = {
            "records": [(names.get(r.group, r.group), r.op, r.module, r.phase, r.payload_bytes, r.bytes_sent)
                        for r in led.records],
            "held": _held(model, opt), "pp_rank": mesh["pp"].get_local_rank(), "dp_rank": d,
            "tp_rank": mesh["tp"].get_local_rank(), "rank": tdist.get_rank()}
    return out
