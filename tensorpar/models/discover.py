"""The ``"auto"`` plan of a model no family plan knows: find column -> row linear pairs.

A module ``P`` whose forward calls linears ``A_1 .. A_k`` and then ``B`` (last) can run as
``A_j`` column-parallel and ``B`` row-parallel with no collective between them exactly when
everything between them acts on each column block on its own (elementwise activations,
gating products, attention over whole heads):

    P(x) = sum_i P_i(x) + b_B,   P_i = P with A_j -> A_j[:, block i] and B -> B[block i, :] (no bias)

Instead of guessing from names or shapes, each candidate is *checked*: ``P`` is run on the
inputs it receives in one forward pass of the model on ``example_inputs``, densely and as the
``p`` shard computations, and the pair is taken only if the sums agree (float64: 1e-9
relative; float32: 1e-4). A LayerNorm or residual add inside ``P``, a head count hard-coded
in a reshape, or a linear called twice makes the check fail and the linears stay replicated.
The largest embedding is split by vocabulary (always exact), with an output head tied to it
or as wide as its vocabulary; everything else is replicated. Every decision is reported.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from torch import nn


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out:
        return _first_tensor(out[0])
    if isinstance(out, dict) and out:
        return _first_tensor(next(iter(out.values())))
    first = getattr(out, "to_tuple", None)
    return _first_tensor(first()) if first else None


def call_model(model: nn.Module, inputs):
    """``model(**inputs)``, ``model(*inputs)`` or ``model(inputs)``; no KV cache for HF models."""
    if isinstance(inputs, dict):
        inputs = dict(inputs)
        if "use_cache" in inspect.signature(model.forward).parameters:
            inputs.setdefault("use_cache", False)
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _record_calls(model: nn.Module, example_inputs) -> tuple[dict, list]:
    """One forward pass: each module's first (args, kwargs, linear-call span), and the linear log."""
    log, seen, handles = [], {}, []
    names = {m: n for n, m in model.named_modules()}

    def pre(mod, args, kwargs):
        if mod not in seen:
            seen[mod] = [args, kwargs, len(log), None]

    def post(mod, args, kwargs, out):
        if seen[mod][3] is None:
            seen[mod][3] = len(log)

    for mod in names:
        if isinstance(mod, nn.Linear):
            handles.append(mod.register_forward_hook(lambda m, a, o: log.append(names[m])))
        if sum(isinstance(m, nn.Linear) for m in mod.modules()) >= 2:
            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(mod.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad():
            call_model(model, example_inputs)
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"example_inputs do not run through {type(model).__name__}: "
                         f"{type(exc).__name__}: {exc}; pass what its forward accepts (a tensor, "
                         f"a tuple of positional arguments or a dict of keyword arguments)") from None
    finally:
        for h in handles:
            h.remove()
    return {names[m]: v for m, v in seen.items()}, log


@contextmanager
def _as_shard(model, a_names, b_name, i, p):
    """Temporarily make ``a_names`` hold rows block ``i`` and ``b_name`` columns block ``i``."""
    saved = []
    try:
        for n in a_names:
            m = model.get_submodule(n)
            saved.append((m, m.weight, m.bias))
            m.weight = nn.Parameter(m.weight.chunk(p, 0)[i], requires_grad=False)  # (out/p, in)
            if m.bias is not None:
                m.bias = nn.Parameter(m.bias.chunk(p, 0)[i], requires_grad=False)
        b = model.get_submodule(b_name)
        saved.append((b, b.weight, b.bias))
        b.weight = nn.Parameter(b.weight.chunk(p, 1)[i], requires_grad=False)  # (out, in/p)
        b.bias = None
        yield
    finally:
        for m, w, bias in saved:
            m.weight, m.bias = w, bias


def _pair_error(model, parent, a_names, b_name, args, kwargs, p) -> float | None:
    """Max relative |P(x) - (sum_i P_i(x) + b)|, or None when a shard run fails."""
    module = model.get_submodule(parent)
    with torch.no_grad():
        dense = _first_tensor(module(*args, **kwargs))
        try:
            total = None
            for i in range(p):
                with _as_shard(model, a_names, b_name, i, p):
                    out = _first_tensor(module(*args, **kwargs))
                total = out if total is None else total + out
        except (RuntimeError, ValueError, IndexError):
            return None
        bias = model.get_submodule(b_name).bias
        if dense is None or total is None or total.shape != dense.shape:
            return None
        total = total if bias is None else total + bias
        return float((total - dense).abs().max() / dense.abs().max().clamp_min(1e-30))


def _candidate(model, calls, log, assigned, p):
    args, kwargs, start, end = calls
    used = log[start:end]
    if len(used) < 2 or len(set(used)) != len(used) or set(used) & assigned:
        return None
    a_names, b_name = used[:-1], used[-1]
    if any(model.get_submodule(n).out_features % p for n in a_names):
        return None
    if model.get_submodule(b_name).in_features % p:
        return None
    return a_names, b_name


def _tolerance(model) -> float:
    dtype = next(model.parameters()).dtype
    return 1e-9 if dtype == torch.float64 else 1e-4


def find_pairs(model, tp_size, example_inputs) -> tuple[dict, list[str]]:
    """``{linear_name: "colwise"|"rowwise"}`` for every checked pair, and the notes."""
    modes = {m: m.training for m in model.modules()}  # each module's own mode, restored after
    model.eval()  # dropout off: the dense and shard runs must see the same function
    try:
        calls, log = _record_calls(model, example_inputs)
        styles, notes, assigned = {}, [], set()
        tol = _tolerance(model)
        for parent in sorted(calls, key=lambda n: -n.count(".") - bool(n)):  # deepest first
            pair = _candidate(model, calls[parent], log, assigned, tp_size)
            if pair is None:
                continue
            a_names, b_name = pair
            err = _pair_error(model, parent, a_names, b_name, *calls[parent][:2], tp_size)
            where = parent or "<model>"
            if err is not None and err <= tol:
                styles.update({n: "colwise" for n in a_names} | {b_name: "rowwise"})
                assigned.update((*a_names, b_name))
                notes.append(f"paired {', '.join(a_names)} -> {b_name} in {where} "
                             f"(checked: relative error {err:.1e})")
            else:
                why = "a shard run failed" if err is None else f"relative error {err:.1e}"
                notes.append(f"not paired in {where}: {', '.join(a_names)} -> {b_name} ({why}); replicated")
        return styles, notes
    finally:
        for m, training in modes.items():
            m.training = training


def find_vocab(model, assigned: dict) -> tuple[dict, list[str]]:
    """The largest embedding -> ``vocab``; a linear tied to it or as wide as it -> ``vocab_head``."""
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        return {}, []
    name, emb = max(embeddings, key=lambda nm: nm[1].weight.numel())
    styles, notes = {name: "vocab"}, [f"vocab-parallel embedding: {name} ({emb.num_embeddings} rows)"]
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear) and n not in assigned and (
                m.weight is emb.weight or m.out_features == emb.num_embeddings):
            styles[n] = "vocab_head"
            notes.append(f"vocab-parallel output head: {n}")
    return styles, notes
