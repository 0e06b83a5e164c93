"""Greedy generation with a KV cache, sharded or not.

Under tensor parallelism each rank's attention modules hold only their own heads, so the
Hugging Face cache each rank builds holds only its own KV heads: ``1/tp`` of the dense cache
(or one replicated KV head per rank when ``n_kv_heads < tp``). Per step, the new token goes
through the ordinary forward (one all-reduce per attention and MLP block, one all-gather of
the logits); the argmax is then broadcast from the group's rank 0 so that every rank appends
exactly the same token even if two ranks' logits differed in the last bit.
"""
from __future__ import annotations

import inspect

import torch

from tensorpar import dist


def _cache_kwarg(model) -> str:
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _check(input_ids, max_new_tokens):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        got = (tuple(input_ids.shape), input_ids.dtype) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ValueError(f"input_ids must be a (batch, seq) torch.long tensor; got {got}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, eos_token_id: int | None = None,
             return_cache: bool = False, return_logits: bool = False):
    """``(B, T + n)`` token ids: ``input_ids`` followed by up to ``max_new_tokens`` greedy tokens.

    ``model``: a Hugging Face causal LM, dense or parallelized (its tp group is taken from
    ``model.tp_report``). Prompts in a batch have the same length (no padding). A sequence
    that has produced ``eos_token_id`` continues with it; generation stops when all have.
    ``return_cache``: also return the KV cache of this rank. ``return_logits``: also return the
    logits each step chose from, ``[(B, V), ...]``, one per generated token (what a comparison of
    two models must look at: tiny random models often repeat one token whatever happens).
    """
    _check(input_ids, max_new_tokens)
    report = getattr(model, "tp_report", None)
    sharded = report is not None and report.tp_size > 1
    if sharded:  # ranks given different prompts would decode a model no one has: refuse
        from tensorpar.sharding.audit import check_same_inputs
        check_same_inputs(report.tp_group, input_ids=input_ids, max_new_tokens=max_new_tokens)
    kwarg, cache, ids = _cache_kwarg(model), None, input_ids
    step = input_ids
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    steps = []
    for _ in range(max_new_tokens):
        out = model(input_ids=step, use_cache=True, **{kwarg: cache})
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        if return_logits:
            steps.append(out.logits[:, -1, :].clone())  # (B, V)
        nxt = out.logits[:, -1, :].argmax(dim=-1)  # (B,)
        if sharded:  # tp_group None is the world group: it broadcasts too
            dist.broadcast(nxt, src=0, group=report.tp_group)
        if eos_token_id is not None:
            nxt = nxt.masked_fill(done, eos_token_id)
            done |= nxt == eos_token_id
        step = nxt[:, None]  # (B, 1): only the new token goes in; the cache holds the rest
        ids = torch.cat([ids, step], dim=1)
        if eos_token_id is not None and bool(done.all()):
            break
    extra = (cache,) * return_cache + (steps,) * return_logits
    return (ids, *extra) if extra else ids
