"""Three ~25M-parameter models at tp=2: tensorpar against its baselines, in one launch.

The models (:data:`MODELS`), each written as a random safetensors checkpoint:

- ``llama``: :data:`~tensorpar.architecture.tiny_sizes.BENCH_LLAMA`, dense MLPs, GQA attention;
- ``mixtral``: :data:`~tensorpar.architecture.tiny_sizes.BENCH_MIXTRAL`, a mixture of experts (8
  experts, top-2) in every layer;
- ``phi3``: :data:`~tensorpar.architecture.tiny_sizes.BENCH_PHI3`, BENCH_LLAMA's sizes with Phi-3's
  fused ``qkv_proj`` and ``gate_up_proj``.

Variants, per model and pass, interleaved round by round (the order rotating), each timed on the
slowest rank; each ratio is the median over rounds of the two variants' times in the same round:

- ``tensorpar``: the checkpoint loaded shard by shard (``load_sharded``), one thread per rank;
  training loss from vocab-sharded logits (``causal_lm_loss``).
- ``hf_tp``: the same checkpoint under Hugging Face's own tensor parallelism
  (``from_pretrained(..., tp_plan="auto")``, DTensor), one thread per rank, the model's own loss.
  Where it fails (to load, to run a forward or a training step), the rows say why
  (``hf_tp_error``) and the other two variants are timed without it.
- ``dense_2t``: the unsharded model in one process (rank 0) with 2 threads, the other rank idle.

Per pass: forward latency (``fwd``: one forward of ``batch x seq`` tokens, no grad) and one
training step (``train``: forward, backward, AdamW step). Also parameter bytes per rank against
the unsharded total, the largest logits difference from the dense model, and the collectives
each parallel variant issues in one pass, counted by the torch profiler (the process group's own
``gloo:<op>`` events, so tensorpar and DTensor are counted by the same instrument).
"""
from __future__ import annotations

import gc
import os
import re
import tempfile
import warnings
from pathlib import Path

import torch

from tensorpar import distributed as dist
from tensorpar.architecture.tiny_sizes import BENCH_LLAMA, BENCH_MIXTRAL, BENCH_PHI3
from tensorpar.bench.timing import interleaved, medians, on_rank0_with_threads, paired_ratio, wait_ready
from tensorpar.models.checkpoint import load_sharded
from tensorpar.models.tiny import make_tiny_checkpoint
from tensorpar.models.training import causal_lm_loss

BATCH, SEQ = 4, 128

MODELS = (("llama", BENCH_LLAMA), ("mixtral", BENCH_MIXTRAL), ("phi3", BENCH_PHI3))


# `--quick`: the same three architectures at ~0.56M parameters, 2 x 32 tokens.
_QUICK = dict(vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
QUICK_MODELS = (("llama", dict(_QUICK, intermediate_size=256)),
                ("mixtral", dict(_QUICK, intermediate_size=64, head_dim=32, num_local_experts=4,
                                 num_experts_per_tok=2, sliding_window=None)),
                ("phi3", dict(_QUICK, intermediate_size=256, sliding_window=None)))
QUICK = dict(models=QUICK_MODELS, batch=2, seq=32)  # run_models_bench's arguments


def _dense(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _hf_tp(path):
    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings():  # transformers' notice that tp_plan= moves to another argument
        warnings.simplefilter("ignore", FutureWarning)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto")


def _hf_loss(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def _steps(model, ids, loss_fn):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def fwd():
        with torch.no_grad():
            wait_ready(model(input_ids=ids, use_cache=False).logits)

    def train():
        opt.zero_grad(set_to_none=True)
        loss_fn(model, ids).backward()
        opt.step()
    return fwd, train


def _param_bytes(model) -> int:
    return sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in model.parameters())


@torch.no_grad()
def _max_diff(model, ids, ref) -> float:
    """Largest logits difference from the dense model's ``ref`` on the first ``len(ref)`` sequences."""
    logits = wait_ready(model(input_ids=ids[:len(ref)], use_cache=False).logits)
    return (logits - ref).abs().max().item()


_COLLECTIVE = re.compile(r"^(?:gloo|nccl|mpi|ucc):(\w+)$")


def collectives(fn) -> dict:
    """``{op: count}`` of the collectives ``fn()`` runs on this rank, from the torch profiler's
    events of the process group's backend (``gloo:all_reduce``, ``gloo:all_gather``, ...)."""
    from torch.profiler import ProfilerActivity, profile
    # Kineto logs every profiler start and stop on stderr unless told otherwise (read at its first
    # use); the bench prints nothing itself. A level the user set stays.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: dict = {}
    for event in prof.events():
        m = _COLLECTIVE.match(event.name)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return dict(sorted(counts.items()))


def _on_all_ranks(stage: str, fn):
    """``(fn(), None)``; or ``(None, why)`` on every rank when ``fn`` raised on any rank.

    The ranks agree after every stage, so a rank that failed never leaves its peer waiting in a
    collective of the next stage."""
    try:
        value, error = fn(), None
    except Exception as exc:  # Hugging Face's failure is a result: the rows say why
        value, error = None, f"{stage}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    failed = torch.tensor([error is not None], dtype=torch.int32)
    dist.all_reduce(failed, op="max")
    if failed.item():
        return None, error or f"{stage}: failed on another rank"
    return value, None


def _hf_variant(path, ids, ref):
    """``(model, steps on ids, max_abs_diff, None)`` for HF's ``tp_plan="auto"``, or
    ``(None, None, None, why)`` where it fails to load, to run a forward or a training step."""
    model, error = _on_all_ranks("from_pretrained(tp_plan='auto')", lambda: _hf_tp(path))
    if error:
        return None, None, None, error
    diff, error = _on_all_ranks("forward", lambda: _max_diff(model, ids, ref))
    if error:
        return None, None, None, error
    steps = _steps(model, ids, _hf_loss)
    _, error = _on_all_ranks("training step", steps[1])
    return (None, None, None, error) if error else (model, steps, diff, None)


def bench_model(arch: str, path, repeats: int, batch: int, seq: int) -> list[dict]:
    """The two rows (``fwd``, ``train``) of one model's checkpoint in ``path``."""
    dense = _dense(path)
    ids = torch.randint(0, dense.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = dense(input_ids=ids[:1], use_cache=False).logits
    tp, _ = load_sharded(path, dtype=torch.float32)
    tp_diff = _max_diff(tp, ids, ref)
    hf, hf_steps, hf_diff, hf_error = _hf_variant(path, ids, ref)
    steps = {"tensorpar": _steps(tp, ids, causal_lm_loss), "dense_2t": _steps(dense, ids, _hf_loss)}
    if hf_steps is not None:
        steps["hf_tp"] = hf_steps
    n_params = sum(p.numel() for p in dense.parameters())
    common = {"model": arch, "label": f"{arch} {n_params / 1e6:.3g}M, {batch}x{seq}", "tp": dist.get_world_size(),
              "rounds": repeats, "batch": batch, "seq": seq,
              "max_abs_diff": max(d for d in (tp_diff, hf_diff) if d is not None),
              "tensorpar_max_abs_diff": tp_diff, "hf_tp_max_abs_diff": hf_diff, "hf_tp_error": hf_error,
              "param_bytes_total": _param_bytes(dense), "param_bytes_per_rank": _param_bytes(tp),
              "hf_tp_param_bytes_per_rank": None if hf is None else _param_bytes(hf)}
    rows = []
    for i, name in enumerate(("fwd", "train")):
        counts = {k: collectives(v[i]) for k, v in steps.items() if k != "dense_2t"}
        variants = {k: (on_rank0_with_threads(v[i]) if k == "dense_2t" else v[i]) for k, v in steps.items()}
        samples = interleaved(variants, repeats)
        rows.append({**common, "pass": name, "median_s": medians(samples), "samples_s": samples,
                     "tensorpar_vs_hf_tp": paired_ratio(samples, "tensorpar", "hf_tp") if hf is not None else None,
                     "tensorpar_vs_dense_2t": paired_ratio(samples, "tensorpar", "dense_2t"),
                     "collectives": counts})
    return rows


def models_worker(checkpoints, repeats, batch, seq):
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()  # from_pretrained's bars, in these rank processes only
    dist.check_collectives(False)  # timed as users run: no signature exchange before each collective
    rows = []
    for arch, path in checkpoints:
        rows += bench_model(arch, path, repeats, batch, seq)
        gc.collect()  # this model's three copies go before the next model loads
    return rows


def run_models_bench(repeats: int = 5, tp: int = 2, models=None, batch: int = BATCH,
                     seq: int = SEQ) -> list[dict]:
    """Every model in ``models`` (``(arch, sizes)`` pairs; default :data:`MODELS`: llama,
    mixtral, phi3 at ~25M) in one launch of ``tp`` ranks; returns rank 0's rows, two per model."""
    with tempfile.TemporaryDirectory(prefix="tensorpar-bench-") as tmp:
        checkpoints = []
        for i, (arch, sizes) in enumerate(MODELS if models is None else models):
            path = make_tiny_checkpoint(Path(tmp) / f"{i}-{arch}", arch, dtype=torch.float32, **sizes)
            checkpoints.append((arch, str(path)))
        return dist.launch(models_worker, tp, checkpoints, repeats, batch, seq, backend="gloo", timeout=600)[0]
