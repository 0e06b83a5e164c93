"""Every collective tensorpar's runtime issues for any architecture, from its inventory.

``predict_from_inventory(inv, batch, seq, bytes_per_elem, workload)`` is
:func:`tensorpar.planner.predict.predict_collectives` with the items read from a
:class:`~tensorpar.architecture.split_model.SplitModel` instead of the five families' formulas: each
collective site of the inventory, once per step of the workload that runs it, with its payload at
that step's ``batch x seq`` tokens:

    workload   steps (tokens per step)                            sites that run
    forward    the bare model, b s                                ``always``
    logits     the model with its head, b s                       ``always`` + ``gathered`` (logits)
    train      causal_lm_loss forward + backward, b s             ``always`` + ``train``; with a head
                                                                  split by vocabulary, 3 all-reduces
                                                                  of b (s-1) max(e, 4) (the loss)
    decode     one greedy step, b                                 ``always``; with a head split by
                                                                  vocabulary an all-gather of b tp k
                                                                  (value, index) float64 pairs (k =
                                                                  ``candidates``, 1 greedy), else
                                                                  ``gathered`` (the logits)
    generate   the prompt (b s; the head on its last position),   as decode, each step
               then new_tokens - 1 steps of b

``where`` is the module the ledger names, with layer (and expert) indices as ``*``; the loss's
reductions and the next-token exchange run outside the model (``cross_entropy``, ``next_token``).
Bytes sent per rank are the ring figures of :func:`.collectives.ring_bytes_sent`, the same
expression the ledger evaluates.
"""
from __future__ import annotations

from dataclasses import replace

from .collectives import ring_bytes_sent
from tensorpar.architecture.split_model import CollectiveSite, ModelInventory
from .predict import (BACKENDS, CANDIDATE_BYTES, PredictedCollective, RuntimePrediction, _check_args, _merge,
                      _notes, _steps, _totals, candidates_per_rank)

CAUSAL_WORKLOADS = ("decode", "generate")


def generic_name(module: str) -> str:
    """``model.layers.3.mlp.experts.7`` -> ``model.layers.*.mlp.experts.*``."""
    return ".".join("*" if part.isdigit() else part for part in module.split("."))


def layer_of(module: str) -> int | None:
    """The first index in a module name: its layer (``model.layers.3.mlp`` -> 3)."""
    return next((int(part) for part in module.split(".") if part.isdigit()), None)


def runs(site: CollectiveSite, step) -> bool:
    """Whether ``site`` issues its collective in ``step`` (a training step or an inference one,
    with the head's logits gathered or kept sharded)."""
    if site.when == "train":
        return step.phase == "training"
    if site.when == "gathered":
        return step.head == "gathered"
    return True


def _item(site: CollectiveSite, tokens: int, e: int, tp: int, count: int) -> PredictedCollective:
    n = site.payload_bytes(tokens, e)
    return PredictedCollective(site.op, generic_name(site.module), site.phase, tp, n,
                               (ring_bytes_sent(site.op, n, tp),) * tp, count, site.note)


def step_items(inv: ModelInventory, step, batch: int, e: int, candidates: int = 1) -> tuple[list, dict]:
    """``(items, {layer: items})`` of one step of the workload, times ``step.count``; ``candidates``:
    the (value, index) pairs each rank offers per row at a decode step (1 greedy, else top_k)."""
    tp, tokens = inv.tp, batch * step.seq
    if tp == 1:
        return [], {}
    if step.next_token and not inv.sharded_head:  # a head that gathers: every rank has every logit
        step = replace(step, head="gathered", next_token=False)
    items, layers = [], {}
    for site in inv.sites:
        if runs(site, step):
            it = _item(site, tokens, e, tp, step.count)
            items.append(it)
            layer = layer_of(site.module)
            if layer is not None:
                layers.setdefault(layer, []).append(it)
    if step.loss and inv.sharded_head:  # causal_lm_loss's vocabulary-parallel cross-entropy
        n = batch * (step.seq - 1) * max(e, 4)
        items.append(PredictedCollective("all_reduce", "cross_entropy", "forward", tp, n,
                                         (ring_bytes_sent("all_reduce", n, tp),) * tp, 3 * step.count,
                                         "max, target logit and sum of exp per token (logits stay sharded)"))
    if step.next_token:
        n = batch * tp * candidates_per_rank(candidates, inv.vocab, tp) * CANDIDATE_BYTES  # (b, tp k, 2) float64
        items.append(PredictedCollective("all_gather", "next_token", "forward", tp, n,
                                         (ring_bytes_sent("all_gather", n, tp),) * tp, step.count,
                                         "each rank's best (value, index): every rank picks the same token"))
    return items, layers


def check_workload(inv: ModelInventory, workload: str) -> None:
    if workload == "forward" and inv.head:
        raise ValueError("workload 'forward' runs the bare model; build its inventory with head=False")
    if workload != "forward" and not inv.head:
        raise ValueError(f"workload {workload!r} runs the model with its output head; build its inventory "
                         f"with head=True")
    if workload in CAUSAL_WORKLOADS and not inv.causal:
        raise ValueError(f"workload {workload!r} needs a causal LM with a KV cache; {inv.model_type} is an "
                         f"encoder; valid workloads: forward, logits, train")


def predict_from_inventory(inv: ModelInventory, batch: int, seq: int, bytes_per_elem: int,
                           workload: str = "forward", *, new_tokens: int = 1, candidates: int = 1,
                           backend: str = "gloo") -> RuntimePrediction:
    """Every collective each rank issues in ``workload`` (see the module docstring), and the
    parameters each rank holds (the most loaded rank's, where ranks differ)."""
    _check_args(inv.tp, batch, seq, bytes_per_elem, workload, new_tokens, candidates)
    if backend not in BACKENDS:
        raise ValueError(f"backend ({backend!r}) must be one of: {', '.join(BACKENDS)}")
    check_workload(inv, workload)
    items, layers = [], {}
    for step in _steps(workload, seq, new_tokens):
        step_list, step_layers = step_items(inv, step, batch, bytes_per_elem, candidates)
        items += step_list
        for layer, its in step_layers.items():
            layers.setdefault(layer, []).extend(its)
    items = _merge(items)
    per_layer = _merge(layers.get(min(layers), [])) if layers else []
    params = inv.params_per_rank()
    return RuntimePrediction(
        family=inv.model_type, workload=workload, backend=backend, tp=inv.tp, batch=batch, seq=seq,
        bytes_per_elem=bytes_per_elem, new_tokens=new_tokens if workload == "generate" else 0,
        layers=inv.layers, items=items, per_layer=per_layer, bytes_sent_per_rank=_totals(items, inv.tp),
        per_layer_bytes_sent_per_rank=_totals(per_layer, inv.tp), params_total=inv.params_total,
        params_per_rank=max(params), param_bytes_per_rank=max(params) * bytes_per_elem,
        notes=_notes(workload) + _layer_notes(layers) + _rank_notes(params))


def _layer_notes(layers: dict) -> list:
    shapes = {tuple(sorted((i.op, i.where, i.phase, i.payload_bytes, i.count) for i in _merge(its)))
              for its in layers.values()}
    return [] if len(shapes) <= 1 else [f"layers differ ({len(shapes)} kinds): per_layer lists layer "
                                        f"{min(layers)}; items cover every layer"]


def _rank_notes(params: list) -> list:
    return [] if len(set(params)) <= 1 else [f"ranks hold different parameter counts {params}; "
                                             f"params_per_rank is the largest"]
