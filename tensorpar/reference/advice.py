"""Which axis to split, and what each choice costs in data movement.

A split is *feasible* when every axis it partitions has at least ``p`` elements and divides
evenly by ``p`` (each device gets an equal, non-empty shard). Each option lists the collectives a
forward pass then needs, with the bytes every device sends by the ring formulas of
``tensorpar.reference.costs`` (all-reduce ``2(p-1)/p*N``, all-gather and reduce-scatter
``(p-1)/p*N``, ``N`` the full tensor's bytes), and the weight bytes each device holds. The advice
picks the feasible option that sends the fewest bytes per device, then the one holding the fewest
weight bytes, then the first listed. Inputs are taken as replicated on every device.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .costs import ring_allgather_bytes, ring_allreduce_bytes, ring_reduce_scatter_bytes, shard_bytes
from .validation import check_chain, check_choice, check_p, check_shape

_RING_BYTES = {"all_reduce": ring_allreduce_bytes, "all_gather": ring_allgather_bytes,
               "reduce_scatter": ring_reduce_scatter_bytes}


@dataclass(frozen=True)
class Collective:
    """A collective an option needs: ``op`` on ``tensor`` (``shape``), ``payload_bytes`` = N."""
    op: str
    tensor: str
    shape: tuple[int, ...]
    payload_bytes: int
    bytes_sent_per_rank: int | float


@dataclass(frozen=True)
class SplitOption:
    """One way to split: the axis label, the sizes it partitions, and its cost per device."""
    axis: str
    what: str
    sizes: tuple[int, ...]
    feasible: bool
    reason: str
    collectives: tuple[Collective, ...]
    bytes_sent_per_rank: int | float
    weight_bytes_per_device: int | float


@dataclass(frozen=True)
class AxisAdvice:
    """The advice for one operation: ``choice`` is an option's ``axis`` (``None`` if none is feasible)."""
    op: str
    p: int
    choice: str | None
    why: str
    options: tuple[SplitOption, ...]

    def option(self, axis: str) -> SplitOption:
        for opt in self.options:
            if opt.axis == axis:
                return opt
        raise ValueError(f"no option {axis!r}; options: {[o.axis for o in self.options]}")

    def to_dict(self) -> dict:
        return asdict(self)


def feasible_axes(shape, p) -> list[int]:
    """The axes of ``shape`` that split into ``p`` equal, non-empty shards."""
    shape, p = check_shape(shape, "shape"), check_p(p)
    return [i for i, n in enumerate(shape) if n >= p and n % p == 0]


def advise_matmul(x_shape, w_shape, p, *, itemsize: int = 8, output: str = "replicated") -> AxisAdvice:
    """Advice for ``Y = X @ W``, ``X: (..., in)``, ``W: (in, out)``.

    Options: ``"out"`` (column-parallel: all-gather ``Y``), ``"in"`` (row-parallel: all-reduce
    ``Y``), ``"batch"`` (``X``'s axis 0, ``W`` replicated: all-gather ``Y``). With
    ``output="sharded"`` the result may stay split: ``"out"`` and ``"batch"`` move nothing and
    ``"in"`` needs a reduce-scatter of ``Y`` instead of an all-reduce.
    """
    x_shape, w_shape, p, itemsize = _check_shapes(x_shape, w_shape, p, itemsize, "advise_matmul")
    check_choice(output, "output", ("replicated", "sharded"))
    (k, n), lead = w_shape, x_shape[:-1]
    y_shape, w_bytes = (*lead, n), k * n * itemsize
    gather = [] if output == "sharded" else [("all_gather", "Y", y_shape)]
    reduce = ("reduce_scatter" if output == "sharded" else "all_reduce", "Y", y_shape)
    options = [
        _option("out", f"W's columns (out={n})", (n,), p, gather, shard_bytes(w_bytes, p), itemsize),
        _option("in", f"the contracted axis (in={k})", (k,), p, [reduce], shard_bytes(w_bytes, p), itemsize),
    ]
    if lead:
        options.append(_option("batch", f"X's axis 0 (batch={lead[0]}), W replicated", (lead[0],), p,
                               gather, w_bytes, itemsize))
    return _advise("matmul", p, options)


def advise_mlp(x_shape, w1_shape, w2_shape, p, *, itemsize: int = 8) -> AxisAdvice:
    """Advice for ``relu(X @ W1) @ W2``; an option ``"a,b"`` splits ``W1`` along ``a``, ``W2`` along ``b``.

    ``H = relu(X W1)`` is nonlinear, so partial sums of ``X W1`` must be all-reduced before relu,
    and a column split of ``W2`` needs all of ``H``. Hence ``"out,in"`` (Megatron-LM) needs one
    all-reduce of ``Y``; ``"out,out"`` all-gathers ``H`` and ``Y``; ``"in,in"`` all-reduces ``H``
    and ``Y``; ``"in,out"`` all-reduces ``H`` and all-gathers ``Y``.
    """
    x_shape, w1_shape, p, itemsize = _check_shapes(x_shape, w1_shape, p, itemsize, "advise_mlp")
    w2_shape = check_shape(w2_shape, "w2_shape")
    if len(w2_shape) != 2:
        raise ValueError(f"advise_mlp: w2_shape must have 2 axes, got {w2_shape}")
    check_chain(w1_shape[1], w2_shape[0], "advise_mlp: W1's columns", "W2's rows")
    (k, f), o, lead = w1_shape, w2_shape[1], x_shape[:-1]
    h, y = ("H", (*lead, f)), ("Y", (*lead, o))
    per_device = shard_bytes((k * f + f * o) * itemsize, p)
    plans = [("out,in", f"W1's columns and W2's rows (ffn={f})", (f,), [("all_reduce", *y)]),
             ("out,out", f"W1's columns (ffn={f}) and W2's columns (out={o})", (f, o),
              [("all_gather", *h), ("all_gather", *y)]),
             ("in,in", f"W1's rows (in={k}) and W2's rows (ffn={f})", (k, f),
              [("all_reduce", *h), ("all_reduce", *y)]),
             ("in,out", f"W1's rows (in={k}) and W2's columns (out={o})", (k, o),
              [("all_reduce", *h), ("all_gather", *y)])]
    options = [_option(axis, what, sizes, p, colls, per_device, itemsize)
               for axis, what, sizes, colls in plans]
    return _advise("mlp", p, options)


def _check_shapes(x_shape, w_shape, p, itemsize, fn):
    x_shape, w_shape, p = check_shape(x_shape, "x_shape"), check_shape(w_shape, "w_shape"), check_p(p)
    itemsize = check_p(itemsize, "itemsize")
    if not x_shape or len(w_shape) != 2:
        raise ValueError(f"{fn}: x_shape needs at least 1 axis and w_shape exactly 2, "
                         f"got {x_shape} and {w_shape}")
    check_chain(x_shape[-1], w_shape[0], f"{fn}: X's last axis", "W's rows")
    return x_shape, w_shape, p, itemsize


def _option(axis, what, sizes, p, colls, weight_bytes, itemsize) -> SplitOption:
    bad = [n for n in sizes if n < p or n % p]
    reason = (f"{p} shards of {'/'.join(str(n // p) for n in sizes)}" if not bad else
              f"{bad[0]} elements do not split into {p} equal non-empty shards")
    collectives = tuple(_collective(op, name, shape, p, itemsize) for op, name, shape in colls)
    sent = sum((c.bytes_sent_per_rank for c in collectives), 0)
    return SplitOption(axis, what, tuple(sizes), not bad, reason, collectives, sent, weight_bytes)


def _collective(op, name, shape, p, itemsize) -> Collective:
    n_bytes = math.prod(shape) * itemsize
    return Collective(op, name, tuple(shape), n_bytes, _RING_BYTES[op](n_bytes, p))


def _advise(op: str, p: int, options: list[SplitOption]) -> AxisAdvice:
    feasible = [o for o in options if o.feasible]
    if not feasible:
        why = "no split is feasible: " + "; ".join(f"{o.axis}: {o.reason}" for o in options)
        return AxisAdvice(op, p, None, why, tuple(options))
    best = min(feasible, key=lambda o: (o.bytes_sent_per_rank, o.weight_bytes_per_device))
    others = "; ".join(f"{o.axis}: {_cost(o)}" if o.feasible else f"{o.axis}: infeasible, {o.reason}"
                       for o in options if o is not best)
    why = (f"split {best.what} ({best.reason}): {_cost(best)}, the least data movement among "
           f"feasible splits" + (f"; alternatives: {others}" if others else ""))
    return AxisAdvice(op, p, best.axis, why, tuple(options))


def _cost(o: SplitOption) -> str:
    moves = " + ".join(f"{c.op} of {c.tensor}{c.shape}" for c in o.collectives) or "no collective"
    return (f"{o.bytes_sent_per_rank} bytes sent per device ({moves}), "
            f"{o.weight_bytes_per_device} weight bytes per device")
