"""Cross-entropy over vocab-sharded logits, without gathering them (Megatron-LM, sec. 3).

Rank i holds the logits of vocabulary rows ``[start_i, end_i)`` (the padded partition of
docs/architecture.md). With ``m`` the row max over the whole vocabulary,

    loss = log(sum_v exp(z_v - m)) - (z_target - m)

needs three all-reduces of one number per token: the max (op max), the target logit (only the
owning rank contributes, others add zero) and the sum of exponentials. Each sends
2(p-1)/p * (tokens * element size) bytes; the (tokens, V) logits never move. The gradient is
local: ``d loss / d z_v = softmax(z)_v - [v == target]``.
"""
from __future__ import annotations

import torch

from tensorpar import distributed as dist
from tensorpar.nn.layers import tp_info
from tensorpar.architecture.tp_rules import padded_range
from tensorpar.nn.validation import check_choice


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, end, ignore_index, group):
        # logits: (N, V/p), target: (N,)
        if end - start < logits.shape[-1]:  # only a shard holding padding is written to
            logits = logits.clone()
            logits[:, end - start:] = float("-inf")  # padded vocabulary rows never win nor count
        logits_max = logits.max(dim=-1).values  # (N,)
        dist.all_reduce(logits_max, group=group, op="max")
        shifted = logits - logits_max.unsqueeze(-1)  # (N, V/p), <= 0

        owned = (target >= start) & (target < end)  # (N,) this rank holds the target's logit
        local_target = (target - start).masked_fill(~owned, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)  # (N,)
        target_logit = target_logit.masked_fill(~owned, 0.0)
        dist.all_reduce(target_logit, group=group, op="sum")

        exp = shifted.exp()  # (N, V/p); padded rows give exp(-inf) = 0
        sum_exp = exp.sum(dim=-1)  # (N,)
        dist.all_reduce(sum_exp, group=group, op="sum")

        ignored = target == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)  # (N,)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, owned & ~ignored, local_target, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, hit, local_target, ignored = ctx.saved_tensors
        grad = softmax.clone()  # (N, V/p): softmax - one_hot(target) on the owning rank
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None, None, None, None


def _check(logits_shard, target, vocab_size, tp_size, reduction):
    check_choice(reduction, "reduction", ("mean", "sum", "none"))
    if target.shape != logits_shard.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} must equal the logits shape without "
                         f"its vocab dim, {tuple(logits_shard.shape[:-1])}")
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise ValueError(f"target must be an integer tensor of class ids; got dtype {target.dtype}")
    if not logits_shard.dtype.is_floating_point:
        raise ValueError(f"logits must be floating point; got dtype {logits_shard.dtype}")
    per = padded_range(vocab_size, 0, tp_size)[2]
    if logits_shard.shape[-1] != per:
        raise ValueError(f"logits_shard last dim ({logits_shard.shape[-1]}) must be "
                         f"ceil(vocab_size / tp_size) = {per} for vocab_size ({vocab_size}) and "
                         f"tp_size ({tp_size})")


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, *,
                                 tp_group=None, vocab_size: int | None = None,
                                 ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(full_logits, target)`` from this rank's vocab shard of the logits.

    ``logits_shard: (..., ceil(V/p))``, e.g. a ColumnParallelLinear LM head's output; ``target:
    (...)`` class ids in ``[0, vocab_size)`` or ``ignore_index``. ``vocab_size`` is the true V
    (default: the unpadded ``p * logits_shard.shape[-1]``); padded columns are masked. Reductions
    as ``F.cross_entropy``: ``mean`` over non-ignored targets, ``sum``, or ``none``. Half
    precision is computed, and returned, in float32.
    """
    tp_size, tp_rank = tp_info(tp_group)
    vocab_size = tp_size * logits_shard.shape[-1] if vocab_size is None else vocab_size
    _check(logits_shard, target, vocab_size, tp_size, reduction)
    valid = (target == ignore_index) | ((target >= 0) & (target < vocab_size))
    if not bool(valid.all()):
        bad = target[~valid][0].item()
        raise ValueError(f"target id {bad} is outside [0, {vocab_size}) and is not "
                         f"ignore_index ({ignore_index})")
    start, end, _ = padded_range(vocab_size, tp_rank, tp_size)
    compute_dtype = torch.promote_types(logits_shard.dtype, torch.float32)
    logits = logits_shard.to(compute_dtype).reshape(-1, logits_shard.shape[-1])  # (N, V/p)
    loss = _VocabParallelCrossEntropy.apply(logits, target.reshape(-1), start, end,
                                            ignore_index, tp_group)  # (N,)
    if reduction == "none":
        return loss.reshape(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()
