"""Autograd-aware collectives: the f / g operators of Megatron-LM (Shoeybi et al. 2019, Sec. 3).

Each operator is a small ``torch.autograd.Function`` whose backward is the conjugate collective
of its forward, so a parallel layer's gradients come out right without hand-written backward
passes. Every one takes the tensor-parallel group explicitly.

    operator                                   forward                      backward
    copy_to_tp_region            ("f")         identity                     all-reduce
    reduce_from_tp_region        ("g")         all-reduce                   identity
    scatter_to_tp_region                       keep own slice (last dim)    all-gather (last dim)
    gather_from_tp_region                      all-gather (last dim)        keep own slice
    scatter_to_sequence_parallel_region        keep own slice (seq)         all-gather (seq)
    gather_from_sequence_parallel_region       all-gather (seq)             reduce-scatter (seq)
    reduce_scatter_to_sequence_parallel_region reduce-scatter (seq)         all-gather (seq)

The module named in the ledger for a backward collective is the one running when the forward ran.
"""
from __future__ import annotations

import torch

from tensorpar.dist import collectives as C
from tensorpar.dist.ledger import active_ledger, ledger_for_backward


def _remember(ctx, group, dim=None) -> None:
    """Keep what backward needs: the group, the dim, and the ledger and module of this forward."""
    ctx.group, ctx.dim, ctx.led = group, dim, active_ledger()
    ctx.module = ctx.led.current_module() if ctx.led is not None else None


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy in one pass: the in-place all-reduce must not write into autograd's tensor."""
    return t.clone(memory_format=torch.contiguous_format)


def _bwd(ctx) -> dict:
    return {"phase": "backward", "module": ctx.module, "record_to": ledger_for_backward(ctx.led)}


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        _remember(ctx, group)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(_fresh(grad), ctx.group, **_bwd(ctx)), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return C.all_reduce(_fresh(x), group)  # (..., h): partial sums -> full sum

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        _remember(ctx, group, dim)
        return C.split_own(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather(grad, ctx.dim, ctx.group, **_bwd(ctx)), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return C.all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return C.split_own(grad, ctx.dim, ctx.group), None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        _remember(ctx, group, dim)
        return C.all_gather(x, dim, group)  # (B, T/p, H) -> (B, T, H)

    @staticmethod
    def backward(ctx, grad):
        return C.reduce_scatter(grad, ctx.dim, ctx.group, **_bwd(ctx)), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        _remember(ctx, group, dim)
        return C.reduce_scatter(x, dim, group)  # (B, T, H) partial -> (B, T/p, H) summed

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather(grad, ctx.dim, ctx.group, **_bwd(ctx)), None, None


def copy_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient in backward (input of a column-parallel layer)."""
    return x if C.group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward (output of a row-parallel layer)."""
    return x if C.group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's slice of the last dim; all-gather the gradient in backward."""
    return x if C.group_size(group) == 1 else _ScatterToRegion.apply(x, group, x.dim() - 1)


def gather_from_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last dim; backward keeps this rank's slice of the gradient."""
    return x if C.group_size(group) == 1 else _GatherFromRegion.apply(x, group, x.dim() - 1)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """Keep this rank's chunk of the sequence; all-gather the gradient in backward."""
    return x if C.group_size(group) == 1 else _ScatterToRegion.apply(x, group, dim)


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """All-gather along the sequence forward; reduce-scatter the gradient in backward."""
    return x if C.group_size(group) == 1 else _GatherSequence.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """Reduce-scatter along the sequence forward; all-gather the gradient in backward."""
    return x if C.group_size(group) == 1 else _ReduceScatterSequence.apply(x, group, dim)
