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

from tensorpar.nn.regions import hidden_input, replace_input


def first_tensor(out):
    """The main tensor of a module's output: a model output's logits or last hidden state, else
    the first tensor of a tuple, list or dict."""
    if isinstance(out, torch.Tensor):
        return out
    for attr in ("logits", "last_hidden_state"):
        t = getattr(out, attr, None)
        if isinstance(t, torch.Tensor):
            return t
    if isinstance(out, (tuple, list)) and out:
        return first_tensor(out[0])
    if isinstance(out, dict) and out:
        return first_tensor(next(iter(out.values())))
    to_tuple = getattr(out, "to_tuple", None)
    return first_tensor(to_tuple()) if to_tuple else None


def call_model(model: nn.Module, inputs):
    """``model(**inputs)``, ``model(*inputs)`` or ``model(inputs)``; no KV cache for HF models."""
    if isinstance(inputs, dict):
        inputs = dict(inputs)
        params = inspect.signature(model.forward).parameters
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        if "use_cache" in params or (takes_kwargs and hasattr(getattr(model, "config", None), "use_cache")):
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
    """Temporarily make ``a_names`` hold rows block ``i`` and ``b_name`` columns block ``i``
    (leaf parameters that take gradients); yields ``{param name: shard}``."""
    saved, shards = [], {}
    try:
        for n in a_names:
            m = model.get_submodule(n)
            saved.append((m, m.weight, m.bias))
            m.weight = nn.Parameter(m.weight.detach().chunk(p, 0)[i].clone())  # (out/p, in)
            shards[f"{n}.weight"] = m.weight
            if m.bias is not None:
                m.bias = nn.Parameter(m.bias.detach().chunk(p, 0)[i].clone())
                shards[f"{n}.bias"] = m.bias
        b = model.get_submodule(b_name)
        saved.append((b, b.weight, b.bias))
        b.weight = nn.Parameter(b.weight.detach().chunk(p, 1)[i].clone())  # (out, in/p)
        shards[f"{b_name}.weight"] = b.weight
        b.bias = None
        yield shards
    finally:
        for m, w, bias in saved:
            m.weight, m.bias = w, bias


def _with_grad_input(args, kwargs):
    """The call's arguments with the hidden states (every occurrence of the first tensor, as the
    region's entry copies them) replaced by a fresh leaf taking gradients."""
    x = hidden_input(args, kwargs)
    if x is None or not x.is_floating_point():
        return None, args, dict(kwargs)
    leaf = x.detach().clone().requires_grad_(True)
    new_args, new_kwargs = replace_input(args, kwargs, x, leaf)
    return leaf, new_args, new_kwargs


def _run(module, args, kwargs, leaves, cotangent=None):
    """``(output, cotangent, {leaf: gradient})`` of ``<output, cotangent>``."""
    out = first_tensor(module(*args, **kwargs))
    if out is None:
        return None, None, {}
    if cotangent is None:
        g = torch.Generator().manual_seed(1234)
        cotangent = torch.randn(out.shape, generator=g, dtype=torch.float64).to(device=out.device, dtype=out.dtype)
    names = [n for n, t in leaves.items() if t is not None and t.requires_grad]
    grads = torch.autograd.grad((out * cotangent).sum(), [leaves[n] for n in names], allow_unused=True)
    return out.detach(), cotangent, dict(zip(names, grads))


def _pair_error(model, parent, a_names, b_name, args, kwargs, p) -> tuple[float | None, list]:
    """``(error, partial)``: the largest relative difference between ``P`` and its shard sum,
    forward and backward, and the replicated parameters of ``P`` whose shard gradients only sum
    to the dense one (they need ``grad_sync``); ``(None, [])`` when a shard run fails.

    Backward compares, against the dense gradients of ``<P(x), R>`` (R random): the input
    gradient with the sum over shards (the region's entry all-reduces it), each shard's weight
    gradients with the dense gradient's slice, and every other parameter of ``P`` with the sum
    over shards. Differences are relative to the largest dense gradient of the block, so a
    parameter whose exact gradient vanishes (a key bias) is judged on the block's scale.
    """
    module = model.get_submodule(parent)
    own = {f"{parent}.{n}" if parent else n: t for n, t in module.named_parameters()}
    split = {f"{n}.{a}" for n in (*a_names, b_name) for a in ("weight", "bias")}
    others = {n: t for n, t in own.items() if n not in split and t.requires_grad}
    with torch.enable_grad():
        x, d_args, d_kwargs = _with_grad_input(args, kwargs)
        try:
            dense, cot, d_grads = _run(module, d_args, d_kwargs, {"x": x, **own})
        except (RuntimeError, ValueError, IndexError, TypeError):  # the block runs only as the model calls it
            return None, []
        if dense is None:
            return None, []
        total, sums, shard_err = None, {}, 0.0
        try:
            for i in range(p):
                with _as_shard(model, a_names, b_name, i, p) as shards:
                    xi, s_args, s_kwargs = _with_grad_input(args, kwargs)
                    out, _, g = _run(module, s_args, s_kwargs, {"x": xi, **others, **shards}, cot)
                    shard_err = max(shard_err, _shard_grad_error(g, d_grads, shards, a_names, i, p))
                total = out if total is None else total + out
                for n in ("x", *others):
                    if g.get(n) is not None:
                        sums[n] = g[n] if n not in sums else sums[n] + g[n]
        except (RuntimeError, ValueError, IndexError):
            return None, []
    bias = model.get_submodule(b_name).bias
    if total is None or total.shape != dense.shape:
        return None, []
    total = total if bias is None else total + bias.detach()
    scale = max([d.abs().max().item() for d in d_grads.values() if d is not None] + [1e-30])
    fwd = float((total - dense).abs().max() / dense.abs().max().clamp_min(1e-30))
    err = max(fwd, shard_err / scale)
    partial = []
    for n, dg in d_grads.items():
        if n in split or n not in sums and (dg is None or not dg.abs().max()):
            continue
        err = max(err, _diff(sums.get(n), dg) / scale)
        if n != "x" and dg is not None and dg.abs().max() > 0:
            partial.append(n)
    return err, partial


def _diff(a, b) -> float:
    a = torch.zeros_like(b) if a is None and b is not None else a
    b = torch.zeros_like(a) if b is None else b
    return (a - b).abs().max().item() if a is not None else 0.0


def _shard_grad_error(g, d_grads, shards, a_names, i, p) -> float:
    """Largest |shard gradient - slice of the dense gradient| of one shard run."""
    worst = 0.0
    for name in shards:
        dense = d_grads.get(name)
        mine = g.get(name)
        if dense is None:
            continue
        dim = 0 if name.rpartition(".")[0] in a_names else 1
        worst = max(worst, _diff(mine, dense.chunk(p, dim)[i]))
    return worst


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


def discover(model, tp_size, example_inputs) -> tuple[dict, list[str]]:
    """``({name: style}, notes)``: checked pairs (their block an ``mlp`` region) and the vocabulary."""
    if example_inputs is None:
        example_inputs = getattr(model, "dummy_inputs", None)
    if example_inputs is None:
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(f"no plan for model type {kind!r}: it declares none and tensorpar's registry "
                         f"has no entry; plan='auto' on it needs example_inputs=... to check linear "
                         f"pairs on, or pass a plan dict")
    pairs, notes = find_pairs(model, tp_size, example_inputs)
    vocab, vnotes = find_vocab(model, pairs)
    return {**pairs, **vocab}, notes + vnotes


def find_pairs(model, tp_size, example_inputs, taken=frozenset()) -> tuple[dict, list[str]]:
    """``{linear_name: "colwise"|"rowwise", block: "mlp"}`` for every checked pair, and the notes.

    ``taken``: linears a plan already splits; a module calling any of them is not a candidate (a
    declared plan completed with pairs of the blocks it leaves whole)."""
    modes = {m: m.training for m in model.modules()}  # each module's own mode, restored after
    model.eval()  # dropout off: the dense and shard runs must see the same function
    try:
        calls, log = _record_calls(model, example_inputs)
        styles, notes, assigned = {}, [], set(taken)
        tol = _tolerance(model)
        for parent in sorted(calls, key=lambda n: -n.count(".") - bool(n)):  # deepest first
            pair = _candidate(model, calls[parent], log, assigned, tp_size)
            if pair is None:
                continue
            a_names, b_name = pair
            err, partial = _pair_error(model, parent, a_names, b_name, *calls[parent][:2], tp_size)
            where = parent or "<model>"
            if err is not None and err <= tol and (parent or not partial):
                styles.update({n: "colwise" for n in a_names} | {b_name: "rowwise"})
                if parent:  # one input copy for the block; its replicated parameters' gradients synced
                    styles[parent] = "mlp"
                assigned.update((*a_names, b_name))
                notes.append(f"paired {', '.join(a_names)} -> {b_name} in {where} (checked forward and "
                             f"backward, every parameter: relative error {err:.1e})"
                             + (f"; gradients all-reduced: {', '.join(partial)}" if partial else ""))
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
    for n, m in embeddings:  # an embedding tied to it (ProphetNet's decoder shares the encoder's)
        if n != name and m.weight is emb.weight:
            styles[n] = "vocab"
            notes.append(f"vocab-parallel embedding tied to it: {n}")
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear) and n not in assigned and (
                m.weight is emb.weight or m.out_features == emb.num_embeddings):
            styles[n] = "vocab_head"
            notes.append(f"vocab-parallel output head: {n}")
    return styles, notes
