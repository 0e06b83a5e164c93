"""Parameter styles: one parameter of a module that stays is split in place.

A fused mixture-of-experts module indexes its 3-D weights per expert and acts elementwise along
the expert width, so a slice of that width computes the slice of every expert's output; attention
sinks are one value per head. The module's own forward runs unchanged on the slices.
"""
from __future__ import annotations

import torch
from torch import nn

from tensorpar.sharding.records import Built
from tensorpar.sharding.spec import ShardSpec, even_pieces, segment_pieces


def _param_shard(owner, attr, dim, pieces) -> Built:
    p = getattr(owner, attr)
    spec = ShardSpec("", dim % p.dim(), tuple(pieces))
    with torch.no_grad():
        shard = nn.Parameter(spec.apply(p.detach()), requires_grad=p.requires_grad)
    return Built(None, {attr: spec}, {attr: shard})


def _param_attr(name: str) -> str:
    return name.rpartition(".")[2]


def _split_dim(owner, attr, dim, ctx, name, widths=None):
    p = getattr(owner, attr, None)
    if not isinstance(p, nn.Parameter):
        raise ValueError(f"parameter style on {name!r}: no parameter {attr!r} there")
    size = p.shape[dim]
    widths = widths or (size,)
    if sum(widths) != size or any(w % ctx.tp_size for w in widths):
        raise ValueError(f"{name!r}: tp_size ({ctx.tp_size}) must divide each of {widths} along dim "
                         f"{dim % p.dim()} of shape {tuple(p.shape)}")
    return _param_shard(owner, attr, dim, segment_pieces(tuple(widths), ctx.tp_rank, ctx.tp_size))


# Parameter styles name the dim they split by storage, as transformers' declarations do: ``colwise``
# the second to last (``(E, out, in)``: the output), ``rowwise`` the last (the input; for a weight
# stored transposed, ``is_transposed``, the output), a 1-D or 2-D bias its last.

def _colwise_dim(p) -> int:
    return -2 if p.dim() >= 3 else -1


def _halves(owner, p, dim):
    """``[gate | up]`` halves of a fused width, or None when the pairs are interleaved
    (``is_concatenated=False``: a contiguous block keeps each pair together)."""
    return (p.shape[dim] // 2,) * 2 if getattr(owner, "is_concatenated", True) else None


def param_colwise(owner, ctx, name):
    """A fused expert weight ``(E, out, in)`` split along out (a bias ``(E, out)`` along its last dim)."""
    attr = _param_attr(name)
    return _split_dim(owner, attr, _colwise_dim(getattr(owner, attr)), ctx, name)


def param_rowwise(owner, ctx, name):
    """A fused expert weight split along its last dim: ``(E, out, in)`` by input features (partial
    sums of every expert's output); a transposed ``(E, in, out)`` by output features."""
    attr = _param_attr(name)
    return _split_dim(owner, attr, -1, ctx, name)


def param_packed_colwise(owner, ctx, name):
    """A fused ``[gate | up]`` expert weight ``(E, 2F, H)`` (or bias ``(E, 2F)``) split along F:
    this rank's gate and up blocks side by side."""
    attr = _param_attr(name)
    p = getattr(owner, attr)
    dim = _colwise_dim(p)
    return _split_dim(owner, attr, dim, ctx, name, widths=_halves(owner, p, dim))


def param_packed_rowwise(owner, ctx, name):
    """A fused ``[gate | up]`` expert weight stored transposed, ``(E, H, 2F)``: both halves split
    along F."""
    attr = _param_attr(name)
    p = getattr(owner, attr)
    return _split_dim(owner, attr, -1, ctx, name, widths=_halves(owner, p, -1))


def param_heads(owner, ctx, name):
    """A per-head parameter (attention sinks, ``(n_heads,)``): this rank's query heads."""
    attr = _param_attr(name)
    p = getattr(owner, attr)
    d = ctx.dims
    if d is None or p.shape[0] != d.n_heads:
        raise ValueError(f"{name!r}: a per-head parameter needs dim 0 of n_heads ({None if d is None else d.n_heads})")
    return _param_shard(owner, attr, 0, even_pieces(p.shape[0], ctx.tp_rank, ctx.tp_size))


def param_rank0(owner, ctx, name):
    """A replicated bias inside a partial-sum region: added on rank 0 only (``rank0_only``)."""
    return Built(None, {}, {}, rank0=(_param_attr(name),))
