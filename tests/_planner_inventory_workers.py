"""What the runtime really does, measured on gloo ranks, for tests/test_planner_inventory_ranks.py.

One 4-rank launch: every architecture at tp 4 on the world group, and at tp 2 on two groups of two
ranks ([0, 1] and [2, 3]) that take half of the architectures each. Per architecture and rank:
the parameters held after ``parallelize`` (bare model and model with its head), the ledger's
records of a bare forward, a forward with gathered logits and a training step
(``causal_lm_loss(...).backward()``), the linear FLOPs of the split forward
(``FlopCounterMode``: ``aten.mm`` and ``aten.addmm``), the KV-cache bytes after a forward with
``use_cache=True`` (``SEQ`` tokens, and ``LONG_SEQ``, past the tiny sliding windows of 8), and the
records of greedy generation of 1 and of ``NEW_TOKENS`` tokens (their difference: decode steps).
"""
from __future__ import annotations

import os
import traceback
import warnings

import torch

# A case is a model_type, with sizes of its own in SIZES.
ARCHS = ("llama", "gpt2", "bert", "mixtral", "qwen2_moe", "qwen3", "gemma3_text", "phi3", "falcon",
         "gpt_bigcode", "opt", "bloom", "deepseek_v3", "olmo2")
# DeepSeek-V3: value heads (8) narrower than its query-key heads (16), as in the real model (128
# and 192). Its tiny model has a dense layer 0 and a MoE layer 1 (routed experts, a shared expert,
# a router with a correction bias), as the full model has both (tensorpar.architecture.layer_kinds).
SIZES = {"deepseek_v3": {"v_head_dim": 8}}
BATCH, SEQ, LONG_SEQ, NEW_TOKENS = 2, 5, 10, 3
LINEAR_OPS = ("aten.mm", "aten.addmm")


def tiny_config(case: str):
    from tensorpar.models.tiny import make_tiny_config
    return make_tiny_config(case, **SIZES.get(case, {}))


def tiny_model(case: str, head: bool = True):
    from tensorpar.models.tiny import make_tiny_model
    return make_tiny_model(case, head=head, **SIZES.get(case, {}))


def _records(led) -> list:
    return [(r.op, r.phase, r.module, r.payload_bytes, r.bytes_sent) for r in led.records]


def _cache_bytes(out) -> int | None:
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if cache is None:
        return None
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)


def _ids(seq: int) -> torch.Tensor:
    return torch.randint(3, 130, (BATCH, seq), generator=torch.Generator().manual_seed(seq))


def measure(arch: str, group) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from tensorpar import distributed as dist
    from tensorpar.apply import parallelize
    from tensorpar.models.generation import generate
    from tensorpar.models.training import causal_lm_loss

    ids, out = _ids(SEQ), {}
    bare = parallelize(tiny_model(arch, head=False), tp_group=group)
    out["bare_params"] = sum(p.numel() for p in bare.parameters())
    with dist.ledger(model=bare) as led, torch.no_grad():
        bare(input_ids=ids)
    out["forward"] = _records(led)
    model = parallelize(tiny_model(arch, head=True), tp_group=group)
    out["params"], out["whole"] = sum(p.numel() for p in model.parameters()), dict(model.tp_report.whole)
    with dist.ledger(model=model) as led, torch.no_grad(), FlopCounterMode(display=False) as flops:
        model(input_ids=ids)
    out["logits"] = _records(led)
    out["linear_flops"] = sum(v for k, v in flops.get_flop_counts()["Global"].items() if str(k) in LINEAR_OPS)
    with dist.ledger(model=model) as led:
        causal_lm_loss(model, ids).backward()
    out["train"] = _records(led)
    with torch.no_grad():
        out["cache"] = {seq: _cache_bytes(model(input_ids=_ids(seq), use_cache=True)) for seq in (SEQ, LONG_SEQ)}
    if out["cache"][SEQ] is not None:
        for n in (1, NEW_TOKENS):
            with dist.ledger(model=model) as led:
                generate(model, ids, n)
            out[f"generate{n}"] = _records(led)
    return out


def inventory_worker(archs) -> dict:
    """``{(arch, tp): result}`` of the cases this rank took part in (its group rank: world rank
    at tp 4, world rank mod 2 at tp 2)."""
    from tensorpar import distributed as dist
    os.environ["HF_HUB_OFFLINE"] = "1"
    warnings.filterwarnings("ignore")
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results = {}
    for tp, group, mine in ((4, None, archs), (2, pairs[rank // 2], archs[rank // 2::2])):
        for arch in mine:
            try:
                results[(arch, tp)] = measure(arch, group)
            except Exception:  # noqa: BLE001 - reported per case, the launch goes on
                results[(arch, tp)] = {"error": traceback.format_exc()[-3000:]}
    return results
