"""`tensorpar train`: a causal LM trained on a ``("dp", "tp")`` mesh of local ranks (or torchrun's).

Checked before any rank starts (``ValueError`` naming the value and what is valid; see
:mod:`tensorpar.jobs.train_checks`): the numbers; the paths (none empty, the folders writable with
room for every checkpoint and the export); the layout (tp must split the model's heads: its
feasibility check; zero 0 or 3; the global batch divisible by dp; the sequence by tp under
sequence parallelism; dp x tp ranks this machine can hold, or torchrun's WORLD_SIZE); the
checkpoint; the data (every id inside the vocabulary); the checkpoint to resume from; an output
folder holding another run's checkpoints. Then, on every rank:

- the checkpoint loaded dense and split by ``parallelize(mesh=, data_parallel="ddp"`` (zero 0)
  ``| "fsdp"`` (zero 3) ``, sequence_parallel=)``; AdamW over its parameters;
- with ``resume``, ``tensorpar.load`` (saved at any layout) and training goes on from its step;
- step ``s`` trains on the global batch :func:`tensorpar.data.batch_for_step` draws from ``s`` and
  the seed alone, dp rank ``d`` on its rows ``[d B/dp, (d+1) B/dp)``; ``train_step`` clips the
  norm of the whole model's gradient; the loss reported is the dp mean of the ranks' mean losses,
  which is the global batch's mean (every rank has as many rows);
- a loss or gradient norm that is not finite (every rank holds the same: both are reduced) stops
  the run at that step, before its checkpoint, and :class:`NonFiniteLossError` names the step;
  ``allow_nonfinite`` goes on;
- every ``save_every`` steps ``tensorpar.save``; at the end ``tensorpar.export`` if asked.

Each rank reports the bytes it holds: parameters, gradients and optimizer state (its local
tensors; under FSDP its shards), its peak RSS, and on a GPU torch's peak allocation, beside the
planner's figure for the same rank; and the collectives and transfers of one step (the third, past
the first two's one-off exchanges) as the ledger recorded them, beside the calls the planner
predicts for that rank (:func:`tensorpar.planner.mesh.mesh_step`, with pipeline stages
:func:`tensorpar.planner.pipeline_step.pipeline_step`): ``equal`` when every call matches.
"""
from __future__ import annotations

import math
import os
import resource
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tensorpar import distributed as dist
from tensorpar.apply import parallelize
from tensorpar.data import batch_for_step, open_tokens
from tensorpar.distributed import dp_engines
from tensorpar.jobs import train_checks as checks, train_plan
from tensorpar.planner.profile import load as load_profile
from tensorpar.jobs.common import (DTYPES, check_length, check_tp, dense_model, is_decoder, no_phase,
                                   open_checkpoint, quiet_transformers, vocab_size)
from tensorpar.jobs.relay import Relay
from tensorpar.jobs.train_checks import ZERO
from tensorpar.models.saving import export, load, save
from tensorpar.models.tiny import make_tiny_checkpoint
from tensorpar.models.training import train_step
from tensorpar.plots import plot_losses

TINY_MODEL = "tiny-llama"  # the folder under ``out`` of the model made when none is given
COLLECTIVE_TIMEOUT_S = 300.0  # a checkpoint's barrier waits for the slowest rank's writes


@dataclass(kw_only=True)
class TrainConfig:
    model: str | None = None  # a Hugging Face causal-LM directory; None: a tiny Llama made in ``out``
    tp: int = 2
    dp: int = 2
    pp: int = 1  # pipeline stages' ranks; > 1 cuts the model into stages (``schedule``, ``microbatches``)
    schedule: str = "1F1B"
    microbatches: int | None = None  # per dp rank's batch; None: pp (one in flight per stage under 1F1B)
    virtual_stages: int | None = None  # stages per pp rank; None: the schedule's (1, or 2 for the multi-stage ones)
    sequence_parallel: bool = False
    zero: int = 0
    steps: int = 20
    lr: float = 1e-3
    batch: int = 8  # global sequences per step
    seq: int = 64
    data: str | None = None  # a UTF-8 text file, a folder of .npy ids; None: the packaged corpus
    save_every: int | None = None
    out: str = "tensorpar-train"
    resume: str | None = None
    export: str | None = None
    max_norm: float = 1.0
    weight_decay: float = 0.01
    seed: int = 0
    dtype: str = "float32"
    backend: str = "auto"
    allow_nonfinite: bool = False  # go on past a step whose loss or gradient norm is NaN or inf
    profile: str | None = None  # a hardware profile (tensorpar calibrate): the planner's step time beside the run's


class NonFiniteLossError(RuntimeError):
    """Training reached a loss or gradient norm that is NaN or inf (the model diverged): stopped at
    that step, its checkpoint not written."""


@dataclass
class TrainReport:
    model: str
    model_path: str
    generated_model: bool  # no model given: a tiny random Llama made offline in ``out``
    data: dict  # kind (text, npy, packaged), path, tokenizer, tokens
    layout: dict  # dp, tp, zero, data_parallel, sequence_parallel, world_size, backend
    dtype: str
    batch: int
    seq: int
    lr: float
    weight_decay: float
    max_norm: float
    seed: int
    start_step: int  # 0, or the step of the checkpoint resumed from
    steps: int
    step_numbers: list
    losses: list  # per step: the global batch's mean next-token cross-entropy
    grad_norms: list  # per step: the whole model's gradient norm before clipping
    tokens_per_s: list  # per step: global batch tokens over the step's wall time
    memory_per_rank: list
    # per rank: one step's collectives and transfers as the ledger recorded them beside the planner's
    communication_per_rank: list
    checkpoints: list
    resumed_from: str | None
    export: str | None
    png: str | None
    out: str
    # with a profile: the planner's step time beside the median of the run's steps (train_plan.time_estimate)
    time_estimate: dict | None = None

    def to_dict(self) -> dict:
        return {"ok": True, **asdict(self)}


def train(cfg: TrainConfig, *, on_event=None, phase=no_phase) -> TrainReport:
    """Train as ``cfg`` says (see the module); ``on_event(dict)``: rank 0's progress (``start``,
    each ``step``, each ``save``), called in this process."""
    with phase("checking the arguments, the model and the data"):
        plan = prepare(cfg)
    relay, world = Relay(on_event), cfg.pp * cfg.dp * cfg.tp
    try:
        with phase(f"{world} ranks: load the model, split it, train"):
            per_rank = dist.launch(train_worker, world, plan["spec"], plan["tokens"], relay.sink,
                                   backend=cfg.backend, timeout=COLLECTIVE_TIMEOUT_S, deadline=None)
    finally:
        relay.close()
    stopped = per_rank[0]["stopped"]
    if stopped is not None:
        raise NonFiniteLossError(_stop_message(cfg, stopped))
    return _report(cfg, plan, per_rank)


def _stop_message(cfg: TrainConfig, s: dict) -> str:
    what = " and ".join(f"{name} is {value}" for name, value in (("the loss", s["loss"]),
                                                                 ("the gradient norm", s["grad_norm"]))
                        if not math.isfinite(value))
    saved = f"; the last checkpoint is {s['last_checkpoint']}" if s["last_checkpoint"] else ""
    return (f"training stopped at step {s['step']}: {what} (loss {s['loss']:.6g}, gradient norm "
            f"{s['grad_norm']:.6g}); the model diverged: lower --lr ({cfg.lr:g}), or pass "
            f"--allow-nonfinite to go on{saved}")


# ---- before any rank starts ----------------------------------------------------------------------

def prepare(cfg: TrainConfig) -> dict:
    """Every check, then the model (made if none is given), the tokens and the ranks' spec."""
    checks.check_numbers(cfg)
    checks.check_layout(cfg)
    checks.check_paths(cfg)
    if cfg.profile is not None:  # a wrong or unreadable profile is refused before any rank starts
        load_profile(cfg.profile)
    checks.check_world(cfg.pp * cfg.dp * cfg.tp, cfg.backend, dims="pp x dp x tp" if cfg.pp > 1 else "dp x tp")
    out = Path(cfg.out)  # made once every check passed (or to hold the tiny model): a refusal leaves nothing
    ckpt = open_checkpoint(_tiny_model(out, cfg.seed) if cfg.model is None else cfg.model)
    if not is_decoder(ckpt):
        raise ValueError(f"--model {str(ckpt.path)!r} is a {ckpt.family} model without a causal-LM head; "
                         f"tensorpar train trains causal LMs (Llama, Mistral, Qwen2, GPT-2, ...)")
    fixes = check_tp(ckpt, cfg.tp)
    check_length(ckpt, cfg.seq, f"--seq {cfg.seq}")
    checks.check_finite_weights(ckpt.path)
    inv = checks.check_split(cfg, ckpt)
    pipeline = checks.check_pipeline(cfg, ckpt)
    tokens = open_tokens(cfg.data, vocab_size(ckpt), ckpt.path)
    if len(tokens) < cfg.seq:
        raise ValueError(f"the data holds {len(tokens)} tokens, fewer than one window of --seq {cfg.seq}; "
                         f"use --seq {max(2, len(tokens))} or less, or more data")
    start, folder = checks.resume_point(cfg, tokens)
    save_dir = out / "checkpoints"
    identity, settings = checks.run_identity(cfg, tokens), checks.run_settings(cfg, ckpt.path)
    checks.check_previous_run(cfg, save_dir, {**identity, **settings}, folder)
    checks.check_room(cfg, inv.params_total, DTYPES[cfg.dtype].itemsize, start, save_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = {"path": str(ckpt.path), "dtype": cfg.dtype, "dp": cfg.dp, "tp": cfg.tp, "pipeline": pipeline,
            "data_parallel": ZERO[cfg.zero], "sequence_parallel": cfg.sequence_parallel,
            "start": start, "steps": cfg.steps, "batch": cfg.batch, "seq": cfg.seq, "seed": cfg.seed,
            "lr": cfg.lr, "weight_decay": cfg.weight_decay, "max_norm": cfg.max_norm,
            "save_every": cfg.save_every, "save_dir": str(save_dir), "identity": identity, "settings": settings,
            "allow_nonfinite": cfg.allow_nonfinite,
            "resume": folder, "export": None if cfg.export is None else str(Path(cfg.export))}
    return {"spec": spec, "tokens": tokens, "ckpt": ckpt, "fixes": fixes, "out": out, "inventory": inv,
            "pipeline": pipeline}


def _tiny_model(out: Path, seed: int) -> Path:
    """A tiny random Llama with 256 ids (UTF-8 bytes) in ``out/tiny-llama``, written in a folder of
    this process's and moved in file by file (``os.replace``): torchrun's processes all write the
    same files, and none reads a half-written one."""
    out.mkdir(parents=True, exist_ok=True)
    final, tmp = out / TINY_MODEL, out / f".{TINY_MODEL}.{socket.gethostname()}.{os.getpid()}"
    make_tiny_checkpoint(tmp, "llama", seed=seed, vocab_size=256)
    final.mkdir(exist_ok=True)
    for f in tmp.iterdir():
        os.replace(f, final / f.name)
    tmp.rmdir()
    return final


# ---- on every rank -------------------------------------------------------------------------------

def train_worker(spec: dict, tokens, sink) -> dict:
    """One rank: build, resume, train steps ``start+1 .. steps`` (saving), export; what it did and
    holds, and ``stopped``: the step whose loss or gradient norm was not finite (None: none)."""
    device = dist.rank_device()
    model, opt, mesh = _build(spec, device)
    start = _resume(model, opt, spec)
    lead = dist.get_rank() == 0
    rows = _rows(spec["batch"], spec["dp"], mesh["dp"].get_local_rank())
    if lead:
        sink.send({"event": "start", "start": start, "steps": spec["steps"], "world_size": dist.get_world_size()})
    history, saved, stopped = [], [], None
    recorded = None
    for step in range(start + 1, spec["steps"] + 1):
        ids = batch_for_step(tokens, step, spec["batch"], spec["seq"], spec["seed"], rows).to(device)  # (B/dp, T)
        if step == train_plan.ledger_step(start, spec["steps"]):  # past the first step's one-off exchanges
            with dist.ledger(model) as led:
                history.append(_step(model, opt, ids, step, spec))
            recorded = {"step": step, "records": train_plan.by_dimension(led, mesh, model)}
        else:
            history.append(_step(model, opt, ids, step, spec))
        memory = dist.all_gather_object(held_bytes(model, opt, device)) if step == start + 1 else None
        if lead:
            sink.send({"event": "step", **history[-1], "memory": memory})
        h = history[-1]
        if not (math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"])) and not spec["allow_nonfinite"]:
            # both are reduced over the ranks: every rank stops here, none saves what diverged
            stopped = {"step": step, "loss": h["loss"], "grad_norm": h["grad_norm"],
                       "last_checkpoint": saved[-1] if saved else spec["resume"]}
            break
        if spec["save_every"] and step % spec["save_every"] == 0:
            extra = {"train": spec["identity"], "settings": spec["settings"]}
            saved.append(str(save(model, opt, spec["save_dir"], step=step, extra=extra)))
            if lead:
                sink.send({"event": "save", "step": step, "path": saved[-1]})
    if spec["export"] is not None and stopped is None:
        export(model, spec["export"])
    return {"history": history, "memory": held_bytes(model, opt, device), "checkpoints": saved,
            "start": start, "transport": dist.transport(None), "stopped": stopped, "ledger": recorded,
            "coords": {k: mesh[k].get_local_rank() for k in mesh.mesh_dim_names}}


def _step(model, opt, ids, step: int, spec: dict) -> dict:
    """One training step; its loss (the global batch's mean: train_step averages over dp), gradient
    norm and time."""
    t0 = time.perf_counter()
    res = train_step(model, opt, ids, max_norm=spec["max_norm"])
    seconds = time.perf_counter() - t0
    return {"step": step, "loss": res["loss"], "grad_norm": res["grad_norm"], "seconds": seconds,
            "tokens_per_s": spec["batch"] * spec["seq"] / seconds}


def _build(spec: dict, device: torch.device):
    """The checkpoint's dense model split on the ``(dp, tp)`` mesh (``(pp, dp, tp)`` with pipeline
    stages), and AdamW over its parameters (this rank's stages')."""
    quiet_transformers()
    pipe = spec["pipeline"]
    mesh = dp_engines.init_mesh(spec["dp"], spec["tp"], device.type, pp=pipe["pp"] if pipe else None)
    model = dense_model(spec["path"], DTYPES[spec["dtype"]]).to(device)
    stages = {} if pipe is None else {"pipeline": pipe["schedule"], "microbatches": pipe["microbatches"],
                                      "virtual_stages": pipe["virtual_stages"]}
    model = parallelize(model.train(), mesh=mesh, data_parallel=spec["data_parallel"],
                        sequence_parallel=spec["sequence_parallel"], **stages).train()
    return model, torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"]), mesh


def _rows(batch: int, dp: int, dp_rank: int) -> slice:
    """Dp rank ``dp_rank``'s rows of the global batch: ``batch / dp`` of them, in dp rank order."""
    per_rank = batch // dp
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def _resume(model, opt, spec) -> int:
    """The checkpoint's weights, optimizer state and step; the learning rate and weight decay stay
    this run's (the command line says what this run does)."""
    if spec["resume"] is None:
        return 0

    step = load(model, opt, spec["resume"])
    assert step == spec["start"], (step, spec["start"])  # the folder resolved before the launch
    for group in opt.param_groups:
        group["lr"], group["weight_decay"] = spec["lr"], spec["weight_decay"]
    return step


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP: this dp rank's shard


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def held_bytes(model, opt, device: torch.device) -> dict:
    """What this rank holds: parameter, gradient and optimizer-state bytes (its local tensors),
    its peak RSS (``getrusage``), and on a GPU ``torch.cuda.max_memory_allocated``."""
    params = list(model.parameters())
    out = {"rank": dist.get_rank(),
           "parameter_bytes": _nbytes(params),
           "gradient_bytes": _nbytes(p.grad for p in params if p.grad is not None),
           "optimizer_bytes": _nbytes(v for st in opt.state.values() for v in st.values()
                                      if isinstance(v, torch.Tensor)),
           "optimizer_moment_bytes": _nbytes(v for st in opt.state.values() for k, v in st.items()
                                             if k in ("exp_avg", "exp_avg_sq"))}
    out["state_bytes"] = out["parameter_bytes"] + out["gradient_bytes"] + out["optimizer_bytes"]
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return out


# ---- the report ----------------------------------------------------------------------------------

def _report(cfg: TrainConfig, plan: dict, per_rank: list) -> TrainReport:
    spec, ckpt, rank0 = plan["spec"], plan["ckpt"], per_rank[0]
    hist = rank0["history"]
    layout = {"pp": cfg.pp, "dp": cfg.dp, "tp": cfg.tp, "zero": cfg.zero, "data_parallel": ZERO[cfg.zero],
              "sequence_parallel": cfg.sequence_parallel, "world_size": cfg.pp * cfg.dp * cfg.tp,
              "backend": rank0["transport"], "fixes": plan["fixes"], "pipeline": plan["pipeline"]}
    report = TrainReport(
        model=ckpt.path.name, model_path=str(ckpt.path), generated_model=cfg.model is None,
        data={**plan["tokens"].source, "tokens": len(plan["tokens"])}, layout=layout, dtype=cfg.dtype,
        batch=cfg.batch, seq=cfg.seq, lr=cfg.lr, weight_decay=cfg.weight_decay, max_norm=cfg.max_norm,
        seed=cfg.seed, start_step=rank0["start"], steps=cfg.steps, step_numbers=[h["step"] for h in hist],
        losses=[h["loss"] for h in hist], grad_norms=[h["grad_norm"] for h in hist],
        tokens_per_s=[h["tokens_per_s"] for h in hist],
        memory_per_rank=train_plan.with_plan(cfg, plan["inventory"], per_rank, plan["pipeline"]),
        communication_per_rank=train_plan.communication(cfg, plan, per_rank),
        checkpoints=rank0["checkpoints"], resumed_from=spec["resume"], export=spec["export"], png=None,
        out=str(plan["out"]), time_estimate=train_plan.time_estimate(cfg, ckpt.path, hist, plan["pipeline"], cfg.profile))
    if os.environ.get("RANK", "0") == "0":  # under torchrun every process holds the report: one figure
        report.png = plot_losses(report.step_numbers, report.losses, str(plan["out"] / "loss.png"),
                                 title=_title(report))
    return report


def _title(report: TrainReport) -> str:
    lay = report.layout
    stages = f"pp {lay['pp']} ({lay['pipeline']['schedule']}) x " if lay["pipeline"] else ""
    return (f"{report.model}: {stages}dp {lay['dp']} x tp {lay['tp']}, zero {lay['zero']}"
            f"{', sequence parallel' if lay['sequence_parallel'] else ''}, {report.dtype}")
