"""Autograd-aware collectives: the f / g operators of Megatron-LM (Shoeybi et al. 2019, Sec. 3).

Each operator's backward is the conjugate collective of its forward, so a parallel layer's
gradients come out right without hand-written backward passes: a small
``torch.autograd.Function`` for most, and for ``g`` (identity backward) a collective run with
grad mode off on a tensor whose own backward is already the identity. With no gradient to carry
(grad mode off, or an input that needs none) an operator runs its forward bare, without autograd.
Every one takes the tensor-parallel group explicitly.

    operator                                   forward                      backward
    copy_to_tp_region            ("f")         identity                     all-reduce
    reduce_from_tp_region        ("g")         all-reduce                   identity
    linear_with_grad_allreduce   (f + linear)  X W^T + b                    all-reduce of dX,
                                                                            overlapped with dW
    scatter_to_tp_region                       keep own slice (last dim)    all-gather (last dim)
    gather_from_tp_region                      all-gather (last dim)        keep own slice
    scatter_to_sequence_parallel_region        keep own slice (seq)         all-gather (seq)
    gather_from_sequence_parallel_region       all-gather (seq)             reduce-scatter (seq);
                                                                            keep own chunk when the
                                                                            gradient is whole
    reduce_scatter_to_sequence_parallel_region reduce-scatter (seq)         all-gather (seq)

The module named in the ledger for a backward collective is the one running when the forward ran.
"""
from __future__ import annotations

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch._C._functorch import is_functorch_wrapped_tensor

from tensorpar.distributed import collectives
from tensorpar.distributed.ledger import active_ledger, ledger_for_backward


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
    run = staticmethod(lambda x, group: x)

    @staticmethod
    def forward(ctx, x, group):
        _remember(ctx, group)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_reduce(_fresh(grad), ctx.group, **_bwd(ctx)), None


class _ScatterToRegion(torch.autograd.Function):
    run = staticmethod(lambda x, group, dim: collectives.split_own(x, dim, group))

    @staticmethod
    def forward(ctx, x, group, dim):
        _remember(ctx, group, dim)
        return _ScatterToRegion.run(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_gather(grad, ctx.dim, ctx.group, **_bwd(ctx)), None, None


class _GatherFromRegion(torch.autograd.Function):
    run = staticmethod(lambda x, group, dim: collectives.all_gather(x, dim, group))

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _GatherFromRegion.run(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return collectives.split_own(grad, ctx.dim, ctx.group), None, None


class _GatherSequence(torch.autograd.Function):
    run = staticmethod(lambda x, group, dim: collectives.all_gather(x, dim, group))  # (B, T/p, H) -> (B, T, H)

    @staticmethod
    def forward(ctx, x, group, dim):
        _remember(ctx, group, dim)
        return _GatherSequence.run(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return collectives.reduce_scatter(grad, ctx.dim, ctx.group, **_bwd(ctx)), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    # (B, T, H) partial -> (B, T/p, H) summed
    run = staticmethod(lambda x, group, dim: collectives.reduce_scatter(x, dim, group))

    @staticmethod
    def forward(ctx, x, group, dim):
        _remember(ctx, group, dim)
        return _ReduceScatterSequence.run(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_gather(grad, ctx.dim, ctx.group, **_bwd(ctx)), None, None


class _LinearGradAllReduce(torch.autograd.Function):
    """``F.linear`` whose backward all-reduces dX while it computes dW (Megatron-LM's
    ``LinearWithGradAccumulationAndAsyncCommunication``, without its fused accumulation).

    A column-parallel layer's input copy (``f``) has an all-reduce of dX in backward. Written as
    ``F.linear(copy_to_tp_region(x), W, b)`` that all-reduce can only start once autograd has
    finished the whole linear node, dW included. Here dX is computed first, its all-reduce is
    issued asynchronously, and dW (the larger GEMM, ``(out/p, T) @ (T, in)``) runs while it is in
    flight. Same bytes, same ledger record. The all-reduce hides behind dW where the two really
    run at once (NCCL beside a GPU GEMM); on a CPU, gloo's thread competes with the GEMM for the
    same cores, and it measured neutral (the README's benchmark notes).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        _remember(ctx, group)
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)  # x only for dW
        ctx.has_bias = bias is not None
        # (..., in) @ (in, out/p): matmul, not F.linear, whose N-d output is a view (a view out
        # of a custom Function refuses later in-place ops such as ReLU(inplace=True))
        y = x.matmul(weight.t())
        return y if bias is None else y.add_(bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight)  # (..., out/p) @ (out/p, in) -> (..., in): this rank's partial dX
        work = collectives.all_reduce(dx, ctx.group, async_op=True, **_bwd(ctx))  # in flight from here
        dy2 = dy.reshape(-1, dy.shape[-1])  # (T, out/p)
        dw = dy2.t().matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None  # (out/p, in)
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None  # (out/p,)
        if work is not None:
            work.wait()
        return dx, dw, db, None


def linear_with_grad_allreduce(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               group=None) -> torch.Tensor:
    """``F.linear(copy_to_tp_region(x), weight, bias)``, with the backward all-reduce of dX
    overlapped with the weight-gradient GEMM (see :class:`_LinearGradAllReduce`).

    Falls back to the plain composition where the fused backward does not apply: no gradient
    for ``x``, a group of one, or autocast on (whose casts the plain ``F.linear`` handles).
    """
    if (collectives.group_size(group) == 1 or not (torch.is_grad_enabled() and x.requires_grad)
            or torch.is_autocast_enabled(x.device.type)):
        return F.linear(copy_to_tp_region(x, group), weight, bias)
    _check_reverse_mode(x, "linear_with_grad_allreduce")
    return _LinearGradAllReduce.apply(x, weight, bias, group)


def _check_reverse_mode(x: torch.Tensor, what: str) -> None:
    """Refuse the autograd modes these operators do not carry, before any collective.

    Forward-mode AD (``torch.autograd.forward_ad``) and ``torch.func`` transforms (jvp, vmap,
    grad and vjp included) would each need the collective applied to tangents, batches or
    wrapped tensors too; run bare, the collective would reach the primal values only and the
    result would be silently wrong.
    """
    if is_functorch_wrapped_tensor(x):
        got = "a tensor under a torch.func transform (jvp, vmap, grad, vjp, functionalize)"
    elif forward_ad._current_level >= 0 and forward_ad.unpack_dual(x).tangent is not None:
        got = "a dual tensor (torch.autograd.forward_ad)"
    else:
        return
    raise NotImplementedError(f"{what}: tensorpar's tensor-parallel operators support torch.autograd's "
                              f"reverse mode only (loss.backward(), torch.autograd.grad); got {got}")


def _apply(op, x: torch.Tensor, group, *args) -> torch.Tensor:
    """``op`` on ``x``: through autograd only when a gradient will flow back into ``x``.

    Every backward above produces the gradient of ``x`` alone, so with grad mode off or an ``x``
    that needs no gradient the forward runs bare: the same collective, recorded the same way,
    without the autograd Function's bookkeeping (about 20 us a call, measured; it dominates a
    decode step at small sizes).
    """
    if collectives.group_size(group) == 1:
        return x
    _check_reverse_mode(x, op.__name__)
    if torch.is_grad_enabled() and x.requires_grad:
        return op.apply(x, group, *args)
    return op.run(x, group, *args)


def copy_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient in backward (input of a column-parallel layer)."""
    return _apply(_CopyToRegion, x, group)


def reduce_from_tp_region(x: torch.Tensor, group=None, *, in_place: bool = False) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward (output of a row-parallel layer).

    No autograd Function is needed: the all-reduce runs with grad mode off, in place on a clone of
    ``x`` whose backward is already the identity, which keeps a Python node out of every
    row-parallel layer's forward and backward.

    ``in_place=True`` skips the clone and sums into ``x`` itself, for a caller that owns ``x``: a
    fresh result no one else holds, from an op whose backward does not need it (a matmul's
    output, as in :class:`~tensorpar.nn.RowParallelLinear`). The gradient then flows to that op
    unchanged, the identity the operator needs. Should an autograd node have saved ``x``, its
    backward fails loudly on the changed version counter; nothing is silently wrong.
    """
    if collectives.group_size(group) == 1:
        return x
    _check_reverse_mode(x, "reduce_from_tp_region")
    y = x if in_place else _fresh(x)  # (..., h) partial sums; a clone's backward is the identity
    with torch.no_grad():
        collectives.all_reduce(y, group)  # -> full sum, in place
    return y


def scatter_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's slice of the last dim; all-gather the gradient in backward."""
    return _apply(_ScatterToRegion, x, group, x.dim() - 1)


def gather_from_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last dim; backward keeps this rank's slice of the gradient."""
    return _apply(_GatherFromRegion, x, group, x.dim() - 1)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """Keep this rank's chunk of the sequence; all-gather the gradient in backward."""
    return _apply(_ScatterToRegion, x, group, dim)


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None, dim: int = 1, *,
                                         grad_is_partial: bool = True) -> torch.Tensor:
    """All-gather along the sequence forward. Backward: reduce-scatter the gradient when each rank
    holds a partial sum of it (the gathered tensor feeds column-parallel linears), else keep this
    rank's chunk (``grad_is_partial=False``: what follows is replicated, every rank's gradient is
    the whole one; Megatron-LM's ``tensor_parallel_output_grad=False``)."""
    return _apply(_GatherSequence if grad_is_partial else _GatherFromRegion, x, group, dim)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """Reduce-scatter along the sequence forward; all-gather the gradient in backward."""
    return _apply(_ReduceScatterSequence, x, group, dim)
