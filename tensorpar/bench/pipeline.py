"""Pipeline suite: a training step of the ~25M Llama (``BENCH_LLAMA``) cut into 2 pipeline stages
under 1F1B, tensorpar's pipeline against PyTorch's own built by hand (torchtitan's way); the bytes
the stages send against the planner's figure; the measured bubble against the schedule's formula.
One launch of 2 ranks over shared memory (``backend="auto"``; the stages' sends and receives go to
gloo, to which the shared-memory backend hands point-to-point transfers), one thread per rank,
float32, a global batch of ``BATCH x SEQ`` in ``MICROBATCHES`` microbatches.

- ``tensorpar_pp2``: ``parallelize(model, mesh=(pp 2, dp 1, tp 1), pipeline="1F1B",
  microbatches=M)``, ``train_step`` (clipping at ``MAX_NORM``, AdamW);
- ``torch_pp2``: torchtitan's manual split (``pipeline_llama_manual_split``): each rank deep-copies
  the dense model and deletes what its stage does not hold (:class:`LlamaStage`), under
  ``PipelineStage`` + ``Schedule1F1B`` (:class:`tensorpar.distributed.pytorch_parallel.Pipeline1F1B`),
  ``F.cross_entropy`` as the loss, clipping over the two stages, AdamW. The blocks are cut as
  tensorpar cuts them (:func:`tensorpar.architecture.pipeline.stage_sizes`);
- ``dense_2t``: the unsplit model on rank 0 with 2 threads (the reference; the other rank idles).

Before anything is timed, both pipelines take two steps that must give the dense model's loss and
gradient norm (the train suite's :func:`tensorpar.bench.train.guard`); the guard's steps are also
the warm-up (the first step's shape inference and handshakes). Then the steps are interleaved round
by round; ratios are medians of per-round ratios.

Beside the times, for tensorpar's pipeline:

- **bytes sent between stages** per step and rank: the ``send`` records of one step's ledger,
  against the planner's figure (``plan(...).pipeline``: the hidden states ``(b, s, h)`` per
  microbatch forward at each boundary, their gradient backward), :func:`planner_sends`;
- **the bubble** per rank: ``(seconds - busy_seconds) / seconds`` of ``model.last_step`` (the
  schedule's wall time less this rank's stage forward and backward time in it: waiting, for the
  other stage and for the transfers), median over the timed rounds, against the schedule's
  ``(p-1)/(m+p-1)`` (:func:`tensorpar.planner.schedules.bubble_fraction`), which takes equal
  stages and free transfers.
"""
from __future__ import annotations

import contextlib
import copy
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar import distributed as dist
from tensorpar.apply import parallelize
from tensorpar.architecture.pipeline import stage_ranges, stage_sizes
from tensorpar.architecture.tiny_sizes import BENCH_LLAMA
from tensorpar.bench import train
from tensorpar.bench.summary import _ms
from tensorpar.bench.timing import interleaved, medians, on_rank0_with_threads, paired_ratio
from tensorpar.distributed import pytorch_parallel
from tensorpar.distributed.dp_engines import init_mesh
from tensorpar.models.tiny import make_tiny_checkpoint
from tensorpar.planner import Layout, from_hf_dict, get_hardware, plan

PP, SCHEDULE, MICROBATCHES = 2, "1F1B", 4
BATCH, SEQ, MAX_NORM, LR = train.BATCH, train.SEQ, train.MAX_NORM, train.LR
VARIANTS = ("tensorpar_pp2", "torch_pp2", "dense_2t")
LAYOUT = {"tensorpar_pp2": f"pp 2, {SCHEDULE}", "torch_pp2": f"pp 2, {SCHEDULE}, PipelineStage",
          "dense_2t": "1 process, 2 threads"}
NAMES = {"tensorpar_pp2": "tensorpar pipeline", "torch_pp2": "PyTorch pipelining (torchtitan)",
         "dense_2t": "dense, 2 threads"}
BASELINE = {"tensorpar_pp2": "torch_pp2"}
# `--quick`: the train suite's ~0.6M Llama (2 layers: one per stage), 4 x 32 tokens.
QUICK = dict(sizes=train.QUICK["sizes"], batch=4, seq=32)


class LlamaStage(nn.Module):
    """Stage ``stage`` of ``n_stages`` of a Hugging Face Llama, cut by hand as torchtitan cuts one
    (``pipeline_llama_manual_split``): a deep copy of the whole model, the other stages' blocks
    deleted, the embedding ``None`` after the first stage, the final norm and the head ``None``
    before the last. Its forward: the embedding (first stage; else the hidden states received),
    the blocks with the rotary position embeddings and the causal mask, then norm and head (last
    stage: the logits)."""

    def __init__(self, dense: nn.Module, stage: int, n_stages: int):
        super().__init__()
        model = copy.deepcopy(dense)
        inner = model.model
        lo, hi = stage_ranges(stage_sizes(len(inner.layers), n_stages))[stage]
        self.config = model.config
        self.embed_tokens = inner.embed_tokens if stage == 0 else None
        self.layers = nn.ModuleList(inner.layers[lo:hi])
        self.rotary_emb = inner.rotary_emb
        self.norm = inner.norm if stage == n_stages - 1 else None
        self.lm_head = model.lm_head if stage == n_stages - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        h = self.embed_tokens(x) if self.embed_tokens is not None else x  # (B, T, hidden)
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)  # (1, T)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                                  position_ids=pos)
        rope = self.rotary_emb(h, position_ids=pos)  # (cos, sin), each (1, T, head_dim)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=pos)
        if self.norm is not None:
            h = self.lm_head(self.norm(h))  # (B, T, vocab)
        return h


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a microbatch (``loss_fn(output, target)``)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _torch_pp_step(stage: LlamaStage, pipe, opt, ids):
    def step():
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(ids, ids)
        norm = pipe.clip_grad_norm_(stage.parameters(), MAX_NORM)
        opt.step()
        return {"loss": float(loss), "grad_norm": float(norm)}
    return step


def _recording(model, step, log: list):
    """``step``, appending the schedule's ``model.last_step`` of each call to ``log``."""
    def run():
        out = step()
        log.append(dict(model.last_step))
        return out
    return run


def build(dense, ids, microbatches: int, log: list) -> dict:
    """``{variant: (model, optimizer, step)}``; tensorpar's step appends its ``last_step`` to ``log``."""
    model = parallelize(copy.deepcopy(dense), mesh=init_mesh(1, 1, pp=PP), pipeline=SCHEDULE,
                        microbatches=microbatches).train()
    opt = train._adamw(model)
    out = {"tensorpar_pp2": (model, opt, _recording(model, train._tensorpar_step(model, opt, ids), log))}
    stage = LlamaStage(dense, dist.get_rank(), PP).train()
    pipe = pytorch_parallel.Pipeline1F1B(stage, dist.get_rank(), PP, microbatches, next_token_loss)
    opt = train._adamw(stage)
    out["torch_pp2"] = (pipe, opt, _torch_pp_step(stage, pipe, opt, ids))
    opt = train._adamw(dense)
    out["dense_2t"] = (dense, opt, train._torch_step(dense, opt, ids, contextlib.nullcontext))  # rank 0 only
    return out


# ---- the arithmetic (no ranks) -------------------------------------------------------------------
def bubble_fractions(last_steps: list) -> list:
    """Each step's idle share on this rank: ``(seconds - busy_seconds) / seconds``."""
    return [(s["seconds"] - s["busy_seconds"]) / s["seconds"] for s in last_steps]


def sent_by_phase(records) -> dict:
    """``{"forward": bytes, "backward": bytes}`` of the ``send`` records (ledger records or dicts)."""
    out = {"forward": 0, "backward": 0}
    for r in records:
        r = r if isinstance(r, dict) else r.to_dict()
        if r["op"] == "send":
            out[r["phase"]] += r["payload_bytes"]
    return out


def planner_sends(section: dict, rank: int) -> dict:
    """Bytes pipeline rank ``rank`` sends per step by the plan's pipeline section
    (``PlanReport.pipeline``): each of its stages' activations forward at its boundary to the next
    stage, their gradients backward at the boundary from the previous one, per microbatch."""
    stages, m = section["stages"], section["microbatches"]
    out = {"forward": 0, "backward": 0}
    for s in (x for x in stages if x["rank"] == rank):
        out["forward"] += m * s["p2p_bytes_per_microbatch"]["forward"]
        if s["stage"] > 0:
            out["backward"] += m * stages[s["stage"] - 1]["p2p_bytes_per_microbatch"]["backward"]
    return out


def planned(config: dict, batch: int, seq: int, microbatches: int) -> dict:
    """The planner's pipeline section for this layout in float32 (the hardware plays no part in it)."""
    layout = Layout(pp=PP, micro_batch=batch // microbatches, global_batch=batch, dtype="fp32", schedule=SCHEDULE)
    return plan(from_hf_dict(config, seq=seq), layout, get_hardware("h100-sxm")).pipeline


def stage_rows(measured: list, section: dict) -> list:
    """One row per pipeline rank: bytes sent per step (``measured[r]``: the ledger's sends by
    phase, the send and receive counts, the bubble samples) against the plan."""
    rows = []
    for rank, got in enumerate(measured):
        want = planner_sends(section, rank)
        sent, expected = sum(got["sent"].values()), sum(want.values())
        bubbles = got["bubble_samples"]
        rows.append({"kind": "stage", "rank": rank, "stages": [s["stage"] for s in section["stages"]
                                                              if s["rank"] == rank],
                     "sent_bytes": sent, "sent_by_phase": got["sent"], "sends": got["sends"], "recvs": got["recvs"],
                     "planner_sent_bytes": expected, "planner_by_phase": want,
                     "sent_vs_planner": sent / expected if expected else None,
                     "bubble": statistics.median(bubbles), "bubble_samples": bubbles,
                     "busy_s": statistics.median(got["busy_samples_s"]), "schedule_s": statistics.median(got["step_samples_s"]),
                     "bubble_formula": section["bubble_fraction"], "bubble_source": section["bubble_source"]})
    return rows


# ---- ranks -------------------------------------------------------------------------------------
def _ledger_step(model, step) -> dict:
    """One more step of tensorpar's pipeline under the ledger: its point-to-point records."""
    with dist.ledger(model) as led:
        step()
    p2p = [r for r in led.records if r.op in ("send", "recv")]
    return {"sent": sent_by_phase(p2p), "sends": sum(r.op == "send" for r in p2p),
            "recvs": sum(r.op == "recv" for r in p2p)}


def time_steps(variants: dict, repeats: int, tokens: int) -> list:
    fns = {n: on_rank0_with_threads(step) if n == "dense_2t" else step for n, (_, _, step) in variants.items()}
    samples = interleaved(fns, repeats, warmup=0)
    med = medians(samples)
    return [{"kind": "step", "variant": n, "layout": LAYOUT[n], "median_s": med[n], "samples_s": samples[n],
             "tokens_per_s": tokens / med[n], "baseline": BASELINE.get(n),
             "vs_baseline": paired_ratio(samples, n, BASELINE[n]) if n in BASELINE else None,
             "vs_dense_2t": paired_ratio(samples, n, "dense_2t") if n != "dense_2t" else None}
            for n in variants]


def pipeline_worker(path: str, repeats: int, batch: int, seq: int, microbatches: int) -> list:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*pipelin.*")
    dist.check_collectives(False)  # timed as users run
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    ids = torch.randint(0, dense.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    log = []
    variants = build(dense, ids, microbatches, log)
    checks = train.guard(variants, ids)
    log.clear()  # the guard's steps: the warm-up
    rows = time_steps(variants, repeats, batch * seq)
    model, _, step = variants["tensorpar_pp2"]
    mine = {**_ledger_step(model, step), "bubble_samples": bubble_fractions(log[:repeats]),
            "busy_samples_s": [s["busy_seconds"] for s in log[:repeats]],
            "step_samples_s": [s["seconds"] for s in log[:repeats]]}
    measured = dist.all_gather_object(mine)
    rows += stage_rows(measured, planned(dense.config.to_dict(), batch, seq, microbatches))
    n_params = sum(p.numel() for p in dense.parameters())
    common = {"params": n_params, "batch": batch, "seq": seq, "microbatches": microbatches, "pp": PP,
              "schedule": SCHEDULE, "rounds": repeats, "dtype": "float32", "max_norm": MAX_NORM,
              "label": f"llama {n_params / 1e6:.3g}M, {batch}x{seq}, {microbatches} microbatches"}
    return [{**common, **r, **({"guard": checks[r["variant"]]} if r["kind"] == "step" else {})} for r in rows]


def run_pipeline_bench(repeats: int = 11, sizes=None, batch: int = BATCH, seq: int = SEQ,
                       microbatches: int = MICROBATCHES) -> list:
    """Rank 0's rows: one per variant (``kind="step"``), one per pipeline rank (``kind="stage"``)."""
    if batch % microbatches:
        raise ValueError(f"microbatches ({microbatches}) must divide the batch ({batch})")
    with tempfile.TemporaryDirectory(prefix="tensorpar-bench-pipeline-") as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "llama", "llama", dtype=torch.float32, **(sizes or BENCH_LLAMA))
        return dist.launch(pipeline_worker, PP, str(path), repeats, batch, seq, microbatches, backend="auto",
                           timeout=600)[0]


# ---- the page ----------------------------------------------------------------------------------
def _ratio(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def _step_row(r: dict) -> str:
    g = r["guard"]
    checks = (f"{g['loss_rel_err']:.1e}, {g['step2_loss_rel_err']:.1e}, {g['grad_norm_rel_err']:.1e}"
              if "loss_rel_err" in g else "reference")
    base = f" / {NAMES[r['baseline']]}" if r["baseline"] else ""
    vs = f"**{r['vs_baseline']:.2f}**{base}" if r["vs_baseline"] is not None else "–"
    return (f"| {NAMES[r['variant']]} | {r['layout']} | {_ms(r['median_s'], 4)} | {r['tokens_per_s']:.0f} | "
            f"{vs} | {_ratio(r['vs_dense_2t'])} | {checks} |")


def _stage_row(r: dict) -> str:
    by, want = r["sent_by_phase"], r["planner_by_phase"]
    return (f"| {r['rank']} | {', '.join(map(str, r['stages']))} | {by['forward']:,} + {by['backward']:,} "
            f"({r['sends']} sends, {r['recvs']} receives) | {want['forward']:,} + {want['backward']:,} | "
            f"{_ratio(r['sent_vs_planner'])} | {r['bubble']:.3f} | {r['bubble_formula']:.3f} | "
            f"{_ms(r['busy_s'], 4)} of {_ms(r['schedule_s'], 4)} |")


def pipeline_table(rows: list) -> str:
    """Two tables: the step of each variant, then per pipeline rank its bytes sent and bubble."""
    steps = [r for r in rows if r["kind"] == "step"]
    stages = [r for r in rows if r["kind"] == "stage"]
    table = ("| variant | layout | step | tokens/s | / PyTorch | / dense | rel. diff from dense: loss 1, loss 2, "
             "grad norm |\n|---|---|---:|---:|---|---:|---|\n" + "\n".join(map(_step_row, steps)) + "\n")
    if stages:
        table += ("\n| pp rank | stages | sent per step, forward + backward (ledger) | planner | sent / planner | "
                  "bubble, measured | bubble, (p-1)/(m+p-1) | busy of the schedule's step |\n"
                  "|---:|---|---:|---:|---:|---:|---:|---:|\n" + "\n".join(map(_stage_row, stages)) + "\n")
    return table


def pipeline_page(rows: list, command: str) -> str:
    """The suite's page: how it was run (the command, when, on what), the tables."""
    import transformers

    r = rows[0]
    return (f"# Benchmark: a training step at pp 2 ({r['schedule']}), tensorpar against PyTorch's pipelining\n\n"
            f"Written by `{command}` at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on "
            f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), load average "
            f"{os.getloadavg()[0]:.1f} at the end, torch {torch.__version__}, transformers {transformers.__version__}. "
            f"{r['label']}, float32, one thread per rank; {r['rounds']} interleaved rounds: each time is the median "
            f"over rounds of the slowest rank's, each ratio the median of the per-round ratios. Bytes: one step's "
            f"`send` records in tensorpar's ledger against the planner's pipeline section (`plan(...).pipeline`). "
            f"Bubble: `(seconds - busy_seconds) / seconds` of `model.last_step`, median over the rounds, against "
            f"the schedule's formula (equal stages, free transfers). What the suite measures: "
            f"[benchmarks.md](../benchmarks.md#pipeline-a-training-step-at-pp-2).\n\n{pipeline_table(rows)}")
