"""The proof's comparisons and verdicts: each shard against the same slice of the dense tensor.

``param_error`` compares every parameter's gradient (each shard against its
:class:`~tensorpar.sharding.spec.ShardSpec` slice of the dense gradient) on the scale of the
group's largest dense value; ``blame`` names the unit to leave whole for a failed check, one per
round; ``over_reduced`` finds a synchronised gradient that came out ``tp_size`` times too large.
"""
from __future__ import annotations

from torch import nn

from tensorpar.architecture.plans import generic
from tensorpar.sharding.marks import unit_root
from tensorpar.sharding.probes import blocks
from tensorpar.sharding.spec import ShardSpec


def shard_specs(model, built) -> dict:
    """Parameter name -> the ShardSpec that cut it, under every name of a tied parameter."""
    by_id = {}
    for name, b in built.items():
        owner = b.module if b.module is not None else model.get_submodule(name.rpartition(".")[0])
        for attr, spec in b.specs.items():
            p = getattr(owner, attr, None)
            if isinstance(p, nn.Parameter):
                by_id[id(p)] = spec
    return {n: by_id[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if id(p) in by_id}


def rel(a, b) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    scale = b.double().abs().max().item() or 1.0
    return (a.double() - b.double()).abs().max().item() / scale


def _dense_slice(name, dense_grad, specs):
    spec = specs.get(name)
    return dense_grad if spec is None else ShardSpec(name, spec.dim, spec.pieces, spec.pad_to,
                                                     spec.transpose).apply(dense_grad)


def _param_errors(split: dict, dense: dict, specs: dict) -> dict:
    scale = max([g.double().abs().max().item() for g in dense.values()] + [1e-300])
    out = {}
    for name, g in dense.items():
        mine = split.get(name)
        ref = _dense_slice(name, g, specs)
        if mine is None:
            out[name] = 0.0 if not ref.abs().max() else float("inf")
        elif mine.shape != ref.shape:
            out[name] = float("inf")
        else:
            out[name] = (mine.double() - ref.double()).abs().max().item() / scale
    for name in split:
        if name not in dense and split[name].abs().max() > 0:
            out[name] = float("inf")
    return out


def over_reduced(split: dict, dense: dict, res, tp_size: int) -> list:
    """Synchronised parameters whose gradient is ``tp_size`` times the dense one: each rank had the
    whole gradient already (the parameter acts after the region's reduction, a norm on the block's
    output), and the all-reduce added it ``tp_size`` times."""
    out = []
    for name, p in res.placements.items():
        if p.style != "grad_sync" or name not in split or name not in dense:
            continue
        want = dense[name].double() * tp_size
        scale = want.abs().max().item()
        if scale and (split[name].double() - want).abs().max().item() <= 1e-6 * scale:
            out.append(name)
    return out


def param_error(split, dense, specs) -> float:
    return max(_param_errors(split, dense, specs).values(), default=0.0)


def worst_params(split, dense, specs) -> list:
    return sorted(_param_errors(split, dense, specs).items(), key=lambda kv: -kv[1])


def raised_in(exc, model, res) -> str | None:
    """The unit whose module raised ``exc``: the innermost frame of its traceback that runs a module
    under a placement of the plan."""
    names = {id(m): n for n, m in model.named_modules()}
    tb, found = exc.__traceback__, None
    while tb is not None:
        module = tb.tb_frame.f_locals.get("self")
        name = names.get(id(module)) if isinstance(module, nn.Module) else None
        if name is not None and any(name == p or name.startswith(p + ".") or p.startswith(name + ".")
                                    for p in res.placements):
            found = name
        tb = tb.tb_next
    if found is None:
        return None
    owners = [p for p in res.placements if found == p or found.startswith(p + ".")]
    if owners:
        return unit_root(max(owners, key=len), res.placements)
    inside = [p for p in res.placements if p.startswith(found + ".")]  # a module holding splits, not one
    return unit_root(min(inside, key=len), res.placements) if inside else None


def blame(model, res, key, err, tol, params, raised=None, where=None, errors_out=None) -> dict:
    """The blocks to leave whole for a failed check, by generic name (every layer of the kind)."""
    why = (f"the split raised {raised[:200]}" if raised else
           f"split differs from the dense model by {err:.1e} (relative; limit {tol:.0e})")
    if key.startswith("<"):
        outside = [n for n in res.placements if not any(n.startswith(b + ".") for b, _ in blocks(model))]
        roots = {unit_root(n, res.placements) for n in outside}
        return {generic(r): f"{why} {key}" for r in roots} or {"<model>": why}
    if raised and where is not None:
        return {generic(where): f"{why} in {key}"}
    order = [n for n, _ in model.named_modules()]  # definition order: forward order, as a rule
    units = sorted({unit_root(n, res.placements) for n in res.placements if n.startswith(key + ".")},
                   key=lambda u: order.index(u) if u in order else len(order))
    bad_units = [u for u in units if any(n == u or n.startswith(u + ".") for n, e in (params or []) if e > tol)]
    # A forward error flows downstream: the first unit may be the cause. A backward error flows
    # upstream: with the block's output right, the last unit whose gradients differ is.
    out_ok = errors_out is not None and errors_out <= tol
    roots = {bad_units[-1]} if out_ok and bad_units else ({units[0]} if units else set())
    worst = ", ".join(n for n, _ in (params or [])[:3])
    return {generic(r): f"{why} in {key}" + (f" (worst: {worst})" if worst else "") for r in roots}
