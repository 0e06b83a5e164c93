"""A ~25M-parameter Llama-style model at tp=2: tensorpar against its baselines, in one launch.

Variants, interleaved round by round (the order rotating), each timed on the slowest rank; each
ratio is the median over rounds of the two variants' times in the same round:

- ``tensorpar``: the checkpoint loaded shard by shard (``load_sharded``), one thread per rank;
  training loss from vocab-sharded logits (``causal_lm_loss``).
- ``hf_tp``: the same checkpoint under Hugging Face's own tensor parallelism
  (``from_pretrained(..., tp_plan="auto")``, DTensor), one thread per rank, the model's own loss.
- ``dense_2t``: the unsharded model in one process (rank 0) with 2 threads, the other rank idle.

Per pass: forward latency (``fwd``: one forward of ``batch x seq`` tokens, no grad) and one
training step (``train``: forward, backward, AdamW step). Also parameter bytes per rank
against the unsharded total.
"""
from __future__ import annotations

import os
import tempfile
import warnings

import torch

from tensorpar import dist
from tensorpar.bench.timing import interleaved, medians, on_rank0_with_threads, paired_ratio, wait_ready

BATCH, SEQ = 4, 128


def _dense(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _hf_tp(path):
    from transformers import AutoModelForCausalLM
    # transformers reads its rank from the environment (torchrun's variables); the process group
    # itself is the one tensorpar's launcher started.
    os.environ.update(RANK=str(dist.get_rank()), LOCAL_RANK=str(dist.get_rank()),
                      WORLD_SIZE=str(dist.get_world_size()))
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


def models_worker(path, repeats):
    from tensorpar.models.checkpoint import load_sharded
    from tensorpar.models.training import causal_lm_loss

    torch.set_num_threads(1)
    ids = torch.randint(0, 8000, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    dense, hf = _dense(path), _hf_tp(path)
    tp, load = load_sharded(path, dtype=torch.float32)
    with torch.no_grad():
        ref = dense(input_ids=ids[:1], use_cache=False).logits
        diff = max((m(input_ids=ids[:1], use_cache=False).logits - ref).abs().max().item() for m in (tp, hf))
    steps = {"tensorpar": _steps(tp, ids, causal_lm_loss), "hf_tp": _steps(hf, ids, _hf_loss),
             "dense_2t": _steps(dense, ids, _hf_loss)}
    rows = []
    for i, name in enumerate(("fwd", "train")):
        variants = {k: (on_rank0_with_threads(v[i]) if k == "dense_2t" else v[i]) for k, v in steps.items()}
        samples = interleaved(variants, repeats)
        med = medians(samples)
        rows.append({"label": f"llama {load.checkpoint_bytes / 4e6:.1f}M, {BATCH}x{SEQ}", "pass": name,
                     "tp": dist.get_world_size(), "rounds": repeats, "max_abs_diff": diff, "median_s": med,
                     "samples_s": samples,
                     "tensorpar_vs_hf_tp": paired_ratio(samples, "tensorpar", "hf_tp"),
                     "tensorpar_vs_dense_2t": paired_ratio(samples, "tensorpar", "dense_2t"),
                     "param_bytes_total": _param_bytes(dense), "param_bytes_per_rank": _param_bytes(tp),
                     "hf_tp_param_bytes_per_rank": _param_bytes(hf)})
    return rows


def run_models_bench(repeats: int = 5, tp: int = 2) -> list[dict]:
    from tensorpar.models.testing import BENCH_LLAMA, make_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="tensorpar-bench-") as tmp:
        make_tiny_checkpoint(tmp, "llama", dtype=torch.float32, **BENCH_LLAMA)
        return dist.launch(models_worker, tp, tmp, repeats, backend="gloo", timeout=600)[0]
