"""Decode suite: time per generated token of the ~25M Llama (``BENCH_LLAMA``) at tp=2, in one launch.

Variants, interleaved round by round (:func:`~tensorpar.bench.timing.interleaved`), each timed
on the slowest rank, at batch 1 and 8, a 32-token prompt and 32 greedy tokens:

- ``shm``: tensorpar (``load_sharded``) on a group over shared memory (:mod:`tensorpar.distributed.shm`),
  ``tensorpar.generate`` with its default engine: the lean forward (:mod:`tensorpar.models.lean`);
- ``shm_hf``: the same split model stepped through Hugging Face's forward (``engine="hf"``);
- ``gloo``: the lean forward on the gloo world group (loopback TCP);
- ``hf_tp``: Hugging Face ``from_pretrained(..., tp_plan="auto")`` and its ``generate``;
- ``dense_2t``: the unsplit model on rank 0 with 2 threads, through its own (Hugging Face)
  forward in the same decoding loop (``engine="hf"``), the other rank idle: the model as a user
  runs it, the baseline the issue names;
- ``dense_lean_2t``: the unsplit model through the lean forward, 2 threads: what the lean
  forward alone gives, without tensor parallelism.

The time per token of a round is ``(t(32 tokens) - t(1 token)) / 31``: the prompt step cancels.
Ratios are medians over rounds of two variants' per-token times in the same round. Beside them:

- the share of a tensorpar decode step spent inside collectives (the ledger's per-call wall
  times, waiting for the peer included), and the collectives and bytes per token it recorded;
- the planner's lower bound of a decode step for *this machine* (:func:`this_machine`: memory
  bandwidth and matmul rate measured on both ranks at once, the shared-memory all-gather's rate
  as the link), from the checkpoint's split (``tensorpar.planner.plan`` of its ``MetaSource``);
- every variant's tokens against the unsplit model's (a speed-up that changes the output is none).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from tensorpar import distributed as dist
from tensorpar.architecture.tiny_sizes import BENCH_LLAMA
from tensorpar.bench.timing import interleaved, medians, on_rank0_with_threads
from tensorpar.models.checkpoint import load_sharded
from tensorpar.models.generation import generate
from tensorpar.models.tiny import make_tiny_checkpoint
from tensorpar.planner import Layout, plan
from tensorpar.planner.hardware import custom_hardware
from tensorpar.sharding.inventory import MetaSource

PROMPT, NEW, BATCHES = 32, 32, (1, 8)
VARIANTS = ("shm", "shm_hf", "gloo", "hf_tp", "dense_2t", "dense_lean_2t")
QUICK = dict(sizes=dict(BENCH_LLAMA, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=1024),
             batches=(1, 2), new=8)


def this_machine(shm_group):
    """The planner's ``Hardware`` for one rank of this machine, measured with every rank at work
    at once (they share the memory bus): copy bandwidth of 64 MiB (read + write), a 512-square
    float32 matmul's rate, and an 8 MiB all-gather over shared memory as the link."""
    src = torch.ones(16 << 20)  # 64 MiB
    dst = torch.empty_like(src)
    a = torch.randn(512, 512)
    copy_s = _best_of(lambda: dst.copy_(src))
    mm_s = _best_of(lambda: a @ a)
    piece = torch.ones(1 << 20)  # 4 MiB per rank
    link_s = _best_of(lambda: dist.all_gather(piece, 0, group=shm_group))
    gathered = piece.nbytes * dist.get_world_size(shm_group)
    figures = torch.tensor([2 * src.nbytes / copy_s, 2 * 512 ** 3 / mm_s, gathered / link_s], dtype=torch.float64)
    dist.all_reduce(figures, op="min")  # the slowest rank's figures
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return custom_hardware(peak_tflops=figures[1].item() / 1e12, hbm_gbps=figures[0].item() / 1e9,
                           memory_gb=memory_gb, intra_node_gbps=figures[2].item() / 1e9,
                           inter_node_gbps=figures[2].item() / 1e9, devices_per_node=dist.get_world_size(),
                           name="this machine, one rank (measured)")


def _best_of(fn, n: int = 5) -> float:
    dist.barrier()
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _bound(path, hw, batch: int) -> float:
    layout = Layout(tp=dist.get_world_size(), micro_batch=batch, dtype="fp32", workload="inference")
    return plan(MetaSource(path), layout, hw, seq=PROMPT + NEW // 2).decode_time_per_token_lower_bound_s


def _hf_tp(path):
    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto")


# variant -> (model, engine of tensorpar.generate, or None for Hugging Face's generate)
_SETUP = {"shm": ("shm", "auto"), "shm_hf": ("shm", "hf"), "gloo": ("gloo", "auto"), "hf_tp": ("hf_tp", None),
          "dense_2t": ("dense", "hf"), "dense_lean_2t": ("dense", "lean")}


def _runs(models: dict, ids, new: int) -> dict:
    """``{variant: (prefill, full)}``: functions generating 1 and ``new`` tokens; each returns the ids."""
    def ours(model, engine, n):
        return lambda: generate(model, ids, n, engine=engine)

    def hf(model, n):
        mask = torch.ones_like(ids)
        return lambda: model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0)
    out = {}
    for name in VARIANTS:
        model, engine = models[_SETUP[name][0]], _SETUP[name][1]
        out[name] = tuple(hf(model, n) if engine is None else ours(model, engine, n) for n in (1, new))
    return out


def _share_in_collectives(run_prefill, run_full, new: int, runs: int = 3) -> dict:
    """Seconds in collectives and wall seconds per decode token (medians of ``runs`` instrumented
    runs of each length), the share of one in the other, and the collectives and bytes per token."""
    per_run = []
    for _ in range(runs):
        timings = []
        for fn in (run_prefill, run_full):
            with dist.ledger() as led:
                t0 = time.perf_counter()
                fn()
                timings.append((time.perf_counter() - t0, led.seconds_in_collectives(), len(led.records),
                                led.total_bytes_sent()))
        per_run.append([(b - a) / (new - 1) for a, b in zip(*timings)])  # wall, in collectives, count, bytes
    wall, coll, count, sent = (statistics.median(column) for column in zip(*per_run))
    return {"collective_s_per_token": coll, "wall_s_per_token": wall,
            "share_in_collectives": coll / wall if wall > 0 else None,
            "collectives_per_token": count, "bytes_sent_per_token": sent}


def bench_batch(models: dict, path, hw, batch: int, new: int, repeats: int, vocab: int) -> dict:
    ids = torch.randint(0, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
    runs = _runs(models, ids, new)
    want = runs["dense_2t"][1]() if dist.get_rank() == 0 else None
    got = {name: full() for name, (_, full) in runs.items() if not name.startswith("dense")}  # every rank takes part
    if dist.get_rank() == 0:
        got["dense_lean_2t"] = runs["dense_lean_2t"][1]()
    same = {name: torch.equal(ids_[:, -new:], want[:, -new:]) if want is not None else None
            for name, ids_ in got.items()}
    variants = {}
    for name, (prefill, full) in runs.items():
        wrap = on_rank0_with_threads if name.startswith("dense") else (lambda fn: fn)
        variants[f"{name}:1"], variants[f"{name}:{new}"] = wrap(prefill), wrap(full)
    samples = interleaved(variants, repeats)
    per_token = {name: [(b - a) / (new - 1) for a, b in zip(samples[f"{name}:1"], samples[f"{name}:{new}"])]
                 for name in runs}
    row = {"batch": batch, "prompt": PROMPT, "new_tokens": new, "rounds": repeats,
           "per_token_s": medians(per_token), "samples_per_token_s": per_token,
           "same_tokens_as_dense": same, "planner_bound_s": _bound(path, hw, batch)}
    for a, b in (("shm", "hf_tp"), ("shm", "dense_2t"), ("shm", "dense_lean_2t"), ("shm", "shm_hf"), ("shm", "gloo"),
                 ("gloo", "hf_tp"), ("hf_tp", "dense_2t"), ("dense_lean_2t", "dense_2t")):
        if a in per_token and b in per_token:
            row[f"{a}_vs_{b}"] = sorted(x / y for x, y in zip(per_token[a], per_token[b]))[len(per_token[a]) // 2]
    for name in ("shm", "gloo"):
        row[f"{name}_collectives"] = _share_in_collectives(*runs[name], new)
    return row


def decode_worker(path, repeats: int, batches, new: int) -> list:
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    dist.check_collectives(False)  # timed as users run
    shm_group = dist.new_group(list(range(dist.get_world_size())), backend="shm")
    if dist.transport(shm_group) != "shm":
        raise RuntimeError(f"the shared-memory group runs over {dist.transport(shm_group)}: {shm_group.why_not}")
    from transformers import AutoModelForCausalLM
    models = {"shm": load_sharded(path, tp_group=shm_group, dtype=torch.float32)[0],
              "gloo": load_sharded(path, dtype=torch.float32)[0],
              "hf_tp": _hf_tp(path),
              "dense": AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)}
    for model in models.values():
        model.eval()
    hw = this_machine(shm_group)
    vocab = models["dense"].config.vocab_size
    with torch.no_grad():
        rows = [bench_batch(models, path, hw, b, new, repeats, vocab) for b in batches]
    return [{**r, "hardware": hw.to_dict()} for r in rows]


def run_decode_bench(repeats: int = 11, sizes=None, batches=BATCHES, new: int = NEW) -> list[dict]:
    """Rank 0's rows, one per batch size (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="tensorpar-bench-decode-") as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "llama", "llama", dtype=torch.float32, **(sizes or BENCH_LLAMA))
        return dist.launch(decode_worker, 2, str(path), repeats, tuple(batches), new, backend="gloo",
                           timeout=600)[0]
