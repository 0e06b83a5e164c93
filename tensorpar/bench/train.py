"""Training suite: a training step of the ~25M Llama (``BENCH_LLAMA``) on 2 ranks, tensorpar's data
and tensor parallelism against PyTorch's own composition (FSDP2 + DTensor tensor parallelism, as
torchtitan builds it), and the checkpoints each writes; all in one launch over shared memory
(``backend="auto"``: :mod:`tensorpar.distributed.shm`), one thread per rank, float32.

Every variant is built from the same dense weights and takes the same full step on the same global
batch: forward, mean next-token cross-entropy, backward, gradient clipping at ``MAX_NORM``, AdamW:

- ``tp_dp2_ddp`` / ``tp_dp2_fsdp``: ``parallelize(model, mesh=init_mesh(2, 1),
  data_parallel="ddp" | "fsdp")``, ``train_step`` on each dp rank's half of the batch;
- ``torch_fsdp2_dp2``: FSDP2 ``fully_shard`` on every decoder layer and the root over a 1-D dp
  mesh (torchtitan's ``apply_fsdp``), ``F.cross_entropy`` on the full logits,
  ``torch.nn.utils.clip_grad_norm_``;
- ``tp_tp2``: ``parallelize(model)`` at tp 2, the whole batch on both ranks, ``train_step``;
- ``torch_dtensor_tp2``: ``parallelize_module`` with :data:`TORCHTITAN_LLAMA`, torchtitan's Llama
  plan without sequence parallelism (tensorpar's default has none either): logits sharded by
  vocabulary into DTensor's ``loss_parallel`` cross-entropy (torchtitan's default);
  ``clip_grad_norm_`` with the unsplit norm weights taken as replicated;
- ``dense_2t``: the unsplit model on rank 0 with 2 threads, the other rank idle.

Before anything is timed, every variant takes two steps, which must give the dense model's loss
on step 1 and on step 2 (the clipped update applied) within ``TOL``, and its gradient norm on step
1 within ``NORM_TOL`` (float32): a variant that does not raises ``RuntimeError``; a baseline that
computes something else is never timed. Then the steps are interleaved round by round; ratios are
medians of per-round ratios.

Checkpoints: tensorpar's ``save`` / ``load`` at tp 2 and at dp 2 FSDP, and PyTorch's distributed
checkpoint (DCP) of the DTensor TP and FSDP2 models (``get_state_dict``, as torchtitan saves), each
after the steps above (AdamW state exists): save and load times (interleaved, medians), and the
bytes each rank wrote (its ``__{rank}_*.distcp`` files) against what it holds (its local parameters
and optimizer state). Each load is checked once on a wiped model: it must restore every tensor.
"""
from __future__ import annotations

import contextlib
import copy
import statistics
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from tensorpar import distributed as dist
from tensorpar.apply import parallelize
from tensorpar.bench.timing import interleaved, medians, on_rank0_with_threads, paired_ratio
from tensorpar.distributed import pytorch_parallel
from tensorpar.distributed.dp_engines import init_mesh
from tensorpar.models import saving
from tensorpar.models.tiny import make_tiny_checkpoint
from tensorpar.models.training import train_step
from tensorpar.architecture.tiny_sizes import BENCH_LLAMA

BATCH, SEQ = 4, 128  # the global batch, 512 tokens: a step takes ~1-1.5 s on this machine's 2 cores
MAX_NORM, LR, TOL = 1.0, 3e-4, 1e-5
# The gradient norm's tolerance: torch's clip_grad_norm_ sums each tensor's squares in float32, which
# at 25M parameters lands ~3e-5 from the norm of the same float32 gradients summed in float64.
NORM_TOL = 1e-4
VARIANTS = ("tp_dp2_ddp", "tp_dp2_fsdp", "torch_fsdp2_dp2", "tp_tp2", "torch_dtensor_tp2", "dense_2t")
BASELINE = {"tp_dp2_ddp": "torch_fsdp2_dp2", "tp_dp2_fsdp": "torch_fsdp2_dp2", "tp_tp2": "torch_dtensor_tp2"}
LAYOUT = {"tp_dp2_ddp": "dp 2 × tp 1, DDP", "tp_dp2_fsdp": "dp 2 × tp 1, FSDP", "torch_fsdp2_dp2": "dp 2, FSDP2",
          "tp_tp2": "dp 1 × tp 2", "torch_dtensor_tp2": "tp 2, DTensor", "dense_2t": "1 process, 2 threads"}
# checkpointed: (name, the variant whose model and optimizer it saves, tensorpar's or torch's DCP)
CHECKPOINTS = (("tensorpar_tp2", "tp_tp2", "tensorpar"), ("torch_dtensor_tp2", "torch_dtensor_tp2", "torch"),
               ("tensorpar_dp2_fsdp", "tp_dp2_fsdp", "tensorpar"), ("torch_fsdp2_dp2", "torch_fsdp2_dp2", "torch"))
SAVES = 5

# torchtitan's Llama TP plan (``apply_tp``) on Hugging Face's module names, sequence parallelism left out.
TORCHTITAN_LLAMA = {
    "model.embed_tokens": "embedding",
    **{f"model.layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")},
    "model.layers.*.self_attn.o_proj": "rowwise",
    **{f"model.layers.*.mlp.{p}": "colwise" for p in ("gate_proj", "up_proj")},
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "head_sharded",
}

# `--quick`: BENCH_LLAMA shrunk to ~0.6M parameters, 4 x 32 tokens.
QUICK = dict(sizes=dict(BENCH_LLAMA, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=1024),
             batch=4, seq=32, saves=2)


def _torch_step(model, opt, ids, loss_context, exact_norm: bool = False):
    """PyTorch's own step: the full logits' cross-entropy (inside ``loss_context``), clipping, AdamW.
    ``exact_norm``: also return the gradients' norm summed in float64 (the guard's reference)."""
    def step():
        opt.zero_grad(set_to_none=True)
        with loss_context():
            logits = model(input_ids=ids, use_cache=False).logits  # (B, T, V), a DTensor under TP
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
        exact = _norm_f64(model) if exact_norm else None
        norm = pytorch_parallel.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        return {"loss": float(pytorch_parallel.full_value(loss.detach())), "grad_norm": float(norm),
                "grad_norm_f64": exact}
    return step


@torch.no_grad()
def _norm_f64(model) -> float:
    """The unsplit model's gradient norm, its squares summed in float64."""
    return sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None).sqrt().item()


def _tensorpar_step(model, opt, ids):
    return lambda: train_step(model, opt, ids, max_norm=MAX_NORM)


def _half(ids):
    """This rank's half of the global batch (dp 2 over the world)."""
    b = len(ids) // 2
    return ids[dist.get_rank() * b:(dist.get_rank() + 1) * b]


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR)


def build(dense, ids) -> dict:
    """``{variant: (model, optimizer, step)}``, each from a copy of ``dense`` (``dense_2t``: itself)."""
    out = {}
    for kind in ("ddp", "fsdp"):
        model = parallelize(copy.deepcopy(dense), mesh=init_mesh(2, 1), data_parallel=kind).train()
        opt = _adamw(model)
        out[f"tp_dp2_{kind}"] = (model, opt, _tensorpar_step(model, opt, _half(ids)))
    model = copy.deepcopy(dense)
    pytorch_parallel.fsdp2(model, model.model.layers, 2)
    opt = _adamw(model)
    out["torch_fsdp2_dp2"] = (model, opt, _torch_step(model, opt, _half(ids), contextlib.nullcontext))
    model = parallelize(copy.deepcopy(dense)).train()
    opt = _adamw(model)
    out["tp_tp2"] = (model, opt, _tensorpar_step(model, opt, ids))
    model = pytorch_parallel.dtensor_tp(copy.deepcopy(dense), TORCHTITAN_LLAMA, 2)
    opt = _adamw(model)
    out["torch_dtensor_tp2"] = (model, opt, _torch_step(model, opt, ids, pytorch_parallel.loss_parallel))
    opt = _adamw(dense)
    out["dense_2t"] = (dense, opt, _torch_step(dense, opt, ids, contextlib.nullcontext))  # run on rank 0 only
    return out


def _mean_over_ranks(x: float) -> float:
    """The global batch's loss from each rank's (a dp rank's mean over its equal half; under tp
    every rank holds the same value, which the mean keeps)."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def guard(variants: dict, ids) -> dict:
    """Two steps of every variant against the dense model's (rank 0, 2 threads): ``{variant:
    {"loss", "loss_rel_err", "grad_norm_rel_err", "step2_loss_rel_err"}}``. The losses must agree
    within ``TOL``, the gradient norm (against the dense gradients' float64 norm) within
    ``NORM_TOL``; ``RuntimeError`` naming every variant and figure that does not."""
    want = None
    if dist.get_rank() == 0:
        model, opt, _ = variants["dense_2t"]
        torch.set_num_threads(2)
        want = [_torch_step(model, opt, ids, contextlib.nullcontext, exact_norm=True)() for _ in range(2)]
        torch.set_num_threads(1)
    want = dist.broadcast_object(want)
    out, bad = {}, []
    for name, (_, _, step) in variants.items():
        if name == "dense_2t":
            continue
        got = [step() for _ in range(2)]
        loss = [_mean_over_ranks(g["loss"]) for g in got]
        errs = {"loss_rel_err": abs(loss[0] - want[0]["loss"]) / abs(want[0]["loss"]),
                "grad_norm_rel_err": abs(got[0]["grad_norm"] - want[0]["grad_norm_f64"]) / want[0]["grad_norm_f64"],
                "step2_loss_rel_err": abs(loss[1] - want[1]["loss"]) / abs(want[1]["loss"])}
        out[name] = {"loss": loss[0], "grad_norm": got[0]["grad_norm"], **errs}
        bad += [f"{name} {k} {v:.2e}" for k, v in errs.items() if not v <= (NORM_TOL if "norm" in k else TOL)]
    w = want[0]
    out["dense_2t"] = {"loss": w["loss"], "grad_norm": w["grad_norm"], "grad_norm_f64": w["grad_norm_f64"],
                       "grad_norm_rel_err": abs(w["grad_norm"] - w["grad_norm_f64"]) / w["grad_norm_f64"],
                       "step2_loss": want[1]["loss"]}
    if bad:
        raise RuntimeError(f"variants that do not compute the dense model's step (loss tolerance {TOL:g}, "
                           f"gradient norm {NORM_TOL:g}): " + "; ".join(bad))
    return out


def time_steps(variants: dict, repeats: int, tokens: int) -> list[dict]:
    """One row per variant: median step time, tokens/s, and its per-round ratios to its PyTorch
    baseline and to the unsplit model. The guard's two steps were the warm-up."""
    fns = {name: on_rank0_with_threads(step) if name == "dense_2t" else step
           for name, (_, _, step) in variants.items()}
    samples = interleaved(fns, repeats, warmup=0)
    med = medians(samples)
    rows = []
    for name in variants:
        base = BASELINE.get(name)
        rows.append({"kind": "step", "variant": name, "layout": LAYOUT[name], "median_s": med[name],
                     "transports": _transports(variants[name][0]) if name != "dense_2t" else [],
                     "tokens_per_s": tokens / med[name], "samples_s": samples[name], "baseline": base,
                     "vs_baseline": paired_ratio(samples, name, base) if base else None,
                     "vs_dense_2t": paired_ratio(samples, name, "dense_2t") if name != "dense_2t" else None})
    return rows


def _transports(model) -> list:
    """How the groups the variant's collectives run in move bytes (``"shm"``, ``"gloo"``)."""
    report = getattr(model, "tp_report", None)
    if report is None:
        groups = pytorch_parallel.mesh_groups(model)
    else:  # a tp_group of None is the world
        groups = [g for g, size in ((report.dp_group, report.dp_size), (report.tp_group, report.tp_size)) if size > 1]
    return sorted({dist.transport(g) for g in groups})


def _held(model, opt) -> list:
    """This rank's pieces of every parameter and optimizer state (views of their storage)."""
    states = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return [pytorch_parallel.local(t) for t in (*model.parameters(), *states)]


def _written(folder: Path) -> int:
    """Bytes this rank wrote: DCP's ``__{rank}_{n}.distcp`` files of the folder."""
    return sum(f.stat().st_size for f in folder.glob(f"__{dist.get_rank()}_*.distcp"))


class _Checkpointer:
    """Save (each time to a fresh folder under ``root``) and load one variant's model and optimizer."""

    def __init__(self, name, model, opt, impl, root: Path):
        self.name, self.model, self.opt, self.impl, self.root = name, model, opt, impl, root
        self.saves, self.folder = 0, None

    def save(self):
        self.saves += 1
        target = self.root / f"{self.name}-{self.saves}"
        if self.impl == "tensorpar":
            self.folder = saving.save(self.model, self.opt, target, step=2)
        else:
            pytorch_parallel.dcp_save(self.model, self.opt, target)
            self.folder = target

    def load(self):
        if self.impl == "tensorpar":
            saving.load(self.model, self.opt, self.folder)
        else:
            pytorch_parallel.dcp_load(self.model, self.opt, self.folder)

    @torch.no_grad()
    def check_load(self) -> bool:
        """Wipe every parameter and optimizer state, load: is every tensor restored exactly?"""
        before = [t.clone() for t in _held(self.model, self.opt)]
        for t in _held(self.model, self.opt):
            t.zero_()
        self.load()
        after = _held(self.model, self.opt)
        return len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))


def time_checkpoints(variants: dict, root: Path, saves: int) -> list[dict]:
    """One row per entry of :data:`CHECKPOINTS`: save and load times (interleaved, medians), bytes
    written per rank against the rank's shard (its parameters and optimizer state)."""
    ckpts = {name: _Checkpointer(name, *variants[v][:2], impl, root) for name, v, impl in CHECKPOINTS}
    save_s = interleaved({n: c.save for n, c in ckpts.items()}, saves, warmup=1)
    restored = {n: c.check_load() for n, c in ckpts.items()}  # also the loads' warm-up
    bad = [n for n, ok in restored.items() if not all(dist.all_gather_object(ok))]
    if bad:
        raise RuntimeError(f"checkpoints that do not restore the model and optimizer they saved: {bad}")
    load_s = interleaved({n: c.load for n, c in ckpts.items()}, saves, warmup=0)
    rows = []
    for name, variant, impl in CHECKPOINTS:
        c = ckpts[name]
        written = dist.all_gather_object(_written(c.folder))
        held = dist.all_gather_object(sum(t.nbytes for t in _held(c.model, c.opt)))
        rows.append({"kind": "checkpoint", "name": name, "variant": variant, "layout": LAYOUT[variant],
                     "implementation": "tensorpar.save / load" if impl == "tensorpar" else "DCP + get_state_dict",
                     "save_s": statistics.median(save_s[name]), "load_s": statistics.median(load_s[name]),
                     "save_samples_s": save_s[name], "load_samples_s": load_s[name],
                     "bytes_written_per_rank": written, "shard_bytes_per_rank": held,
                     "written_vs_shard": [w / h for w, h in zip(written, held)],
                     "folder_bytes": sum(f.stat().st_size for f in c.folder.iterdir() if f.is_file())})
    pairs = {"tensorpar_tp2": "torch_dtensor_tp2", "tensorpar_dp2_fsdp": "torch_fsdp2_dp2"}
    for row in rows:
        base = pairs.get(row["name"])
        row["baseline"] = base
        row["save_vs_baseline"] = paired_ratio(save_s, row["name"], base) if base else None
        row["load_vs_baseline"] = paired_ratio(load_s, row["name"], base) if base else None
    return rows


def train_worker(path: str, ckpt_root: str, repeats: int, batch: int, seq: int, saves: int) -> list[dict]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    # FSDP2 warns that the model returns a view (HF's output): nothing here writes into it in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    dist.check_collectives(False)  # timed as users run
    if dist.transport(None) != "shm":
        raise RuntimeError(f"the world group runs over {dist.transport(None)}, not shared memory")
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    ids = torch.randint(0, dense.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    n_params = sum(p.numel() for p in dense.parameters())
    variants = build(dense, ids)
    checks = guard(variants, ids)
    rows = time_steps(variants, repeats, batch * seq)
    rows += time_checkpoints(variants, Path(ckpt_root), saves)
    common = {"params": n_params, "batch": batch, "seq": seq, "rounds": repeats, "dtype": "float32",
              "transport": "shm", "max_norm": MAX_NORM, "label": f"llama {n_params / 1e6:.3g}M, {batch}x{seq}"}
    return [{**common, **r, **({"guard": checks[r["variant"]]} if r["kind"] == "step" else {})} for r in rows]


def run_train_bench(repeats: int = 11, sizes=None, batch: int = BATCH, seq: int = SEQ,
                    saves: int = SAVES) -> list[dict]:
    """Rank 0's rows: one per variant (``kind="step"``), one per checkpointer (``kind="checkpoint"``)."""
    if batch % 2:
        raise ValueError(f"batch ({batch}) must be even: the dp variants split it over 2 ranks")
    with tempfile.TemporaryDirectory(prefix="tensorpar-bench-train-") as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "llama", "llama", dtype=torch.float32, **(sizes or BENCH_LLAMA))
        ckpts = Path(tmp) / "checkpoints"
        ckpts.mkdir()
        return dist.launch(train_worker, 2, str(path), str(ckpts), repeats, batch, seq, saves, backend="auto",
                           timeout=600)[0]
