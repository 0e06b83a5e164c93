"""Rank workers for tests/test_sharding_runtime.py: the mechanisms ``parallelize`` builds Hugging
Face models from, each against a dense computation written here (float64), forward and backward.

One 4-rank launch: tp 2 on the sub-groups {0, 1} and {2, 3}, tp 4 on the world; every rank builds
the same dense tensors from one seed and compares its own shard with the same slice of them.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from tensorpar import distributed as dist
from tensorpar.nn import regions
from tensorpar.nn.layers import RowParallelLinear
from tensorpar.nn.rebase import column_parallel_like, vocab_parallel_like
from tensorpar.nn.norm import ShardedRMSNorm

D = torch.float64


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _rms(x, w, eps):  # the dense RMSNorm, written out (float32 compute as Hugging Face's)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w * h).to(x.dtype)


def _group(tp):
    r = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return (pairs[r // 2], r % 2) if tp == 2 else (None, r)


def sharded_norm_case(tp, group, rank, *, replicas=1) -> dict:
    """An RMSNorm over 8 features split over the ranks (or one replicated 4-feature head per pair)."""
    g = torch.Generator().manual_seed(3)
    n = 8
    x = torch.randn(2, 5, n, generator=g, dtype=D)
    w = torch.randn(n, generator=g, dtype=D)
    cot = torch.randn(2, 5, n, generator=g, dtype=D)
    xd, wd = x.clone().requires_grad_(), w.clone().requires_grad_()
    (_rms(xd, wd, 1e-6) * cot).sum().backward()
    per = n // (tp // replicas)
    head = rank // replicas
    cols = slice(head * per, (head + 1) * per)
    norm = ShardedRMSNorm(w[cols], 1e-6, n, tp_group=group, replicas=replicas)
    if replicas > 1:
        regions.sync_rows_grad(norm.weight, ((0, per),), head, tp // replicas, group, "norm.weight")
    xs = x[..., cols].clone().requires_grad_()
    y = norm(xs)
    # a replicated head serves several ranks' query heads: each holds a share of the loss through it
    share = (0.25, 0.75)[rank % replicas] if replicas == 2 else 1.0
    (y * cot[..., cols] * share).sum().backward()
    return {"y": _rel(y, _rms(x, w, 1e-6)[..., cols]), "dw": _rel(norm.weight.grad, wd.grad[cols]),
            # a replicated head's input gradient is each holder's share (summed by the projection
            # that made it); a split one is the dense slice
            "dx": _rel(xs.grad, xd.grad[..., cols]) if replicas == 1 else None,
            "clip_norm": _clip_norm(norm, per, replicas, tp, group, wd.grad) if replicas > 1 else None}


def _clip_norm(norm, per, replicas, tp, group, dense_grad) -> float:
    """clip_grad_norm_'s norm over the group against the dense gradient's: rows held by
    ``replicas`` ranks count once (as commit marks them: ``tp_row_replicas``)."""
    from types import SimpleNamespace

    from tensorpar.models.training import clip_grad_norm_
    norm.weight.tp_row_replicas = (((0, per),), replicas)
    holder = torch.nn.Module()
    holder.norm = norm
    holder.tp_report = SimpleNamespace(tp_group=group, tp_size=tp)
    return abs(clip_grad_norm_(holder, 1e30).item() - dense_grad.norm().item()) / dense_grad.norm().item()


class ScaledEmbedding(nn.Embedding):
    """Gemma's pattern: the lookup scaled in the subclass's own forward."""

    def __init__(self, n, h):
        super().__init__(n, h)
        self.register_buffer("scale", torch.tensor(2.5, dtype=D), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.scale


class ScaledHead(nn.Linear):
    """Dory's pattern: logits scaled per token id after the linear."""

    def __init__(self, h, v):
        super().__init__(h, v, bias=False)
        self.logit_scale = nn.Parameter(torch.linspace(0.5, 1.5, v, dtype=D))

    def forward(self, x):
        return super().forward(x) * self.logit_scale


def subclass_case(tp, group, rank) -> dict:
    torch.manual_seed(0)
    emb, head = ScaledEmbedding(11, 6).to(D), ScaledHead(6, 11).to(D)  # 11 rows: padded at tp 2 and 4
    ids = torch.tensor([[0, 3, 10, 7], [5, 5, 1, 9]])
    ref = head(emb(ids))
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=D)
    (ref * cot).sum().backward()
    pemb, phead = vocab_parallel_like(emb, tp_group=group), column_parallel_like(head, tp_group=group)
    out = phead(pemb(ids))
    (out * cot).sum().backward()
    start, end = pemb.vocab_start_index, pemb.vocab_end_index
    return {"out": _rel(out, ref), "emb_dw": _rel(pemb.weight.grad[: end - start], emb.weight.grad[start:end]),
            "head_dw": _rel(phead.weight.grad[: end - start], head.weight.grad[start:end]),
            "scale_dw": _rel(phead.logit_scale.grad, head.logit_scale.grad),
            "types": [type(pemb).__name__, type(phead).__name__]}


class _Block(nn.Module):
    """x -> norm(x W1_shard) with a replicated norm on the sharded activation -> W2 (partial)."""

    def __init__(self, h, f):
        super().__init__()
        self.up = nn.Linear(h, f, bias=False, dtype=D)
        self.scale = nn.Parameter(torch.tensor([1.7], dtype=D))  # replicated, acts on the sharded activation
        self.down = nn.Linear(f, h, bias=True, dtype=D)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)) * self.scale)


def grad_sync_case(tp, group, rank) -> dict:
    """A replicated parameter inside a split region: its gradient is this rank's share unless
    synchronised; summed over two backward passes (gradient accumulation) it must still be the
    dense one. A partial-sum row linear with its bias added once, the region reduced once."""
    torch.manual_seed(0)
    dense = _Block(6, 8)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(2), dtype=D)
    cot = torch.randn(3, 6, generator=torch.Generator().manual_seed(4), dtype=D)
    for _ in range(2):
        (dense(x) * cot).sum().backward()
    block = copy.deepcopy(dense)
    for p in block.parameters():
        p.grad = None
    cols = slice(rank * 8 // tp, (rank + 1) * 8 // tp)
    with torch.no_grad():
        block.up = nn.Linear(6, 8 // tp, bias=False, dtype=D)
        block.up.weight.copy_(dense.up.weight[cols])
    block.down = RowParallelLinear.from_dense(dense.down, tp_group=group, reduce_output=False)
    regions.enter_region(block, group)
    regions.exit_region(block, group)
    regions.sync_grad(block, "scale", group)
    with dist.ledger(model=block) as led:
        for _ in range(2):
            (block(x.clone().requires_grad_()) * cot).sum().backward()
    syncs = [r for r in led.records if r.phase == "backward" and r.shape == (1,)]
    return {"out": _rel(block(x), dense(x)), "scale": _rel(block.scale.grad, dense.scale.grad),
            "bias": _rel(block.down.bias.grad, dense.down.bias.grad),
            "up": _rel(block.up.weight.grad, dense.up.weight.grad[cols]),
            "sync_records": len(syncs), "sync_module": syncs[0].module if syncs else None,
            "forward_reduces": sum(r.op == "all_reduce" and r.phase == "forward" for r in led.records)}


def rank0_case(tp, group, rank) -> dict:
    """A bias added inside a partial sum: rank 0 only, its gradient the dense one on every rank."""
    b = nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=D))
    holder = nn.Module()
    holder.b = b
    holder.forward = lambda: holder.b * 1.0
    regions.rank0_only(holder, "b", group)
    partial = holder.__call__()  # (3,): b on rank 0, zeros elsewhere
    total = partial.detach().clone()
    dist.all_reduce(total, group)
    (partial * torch.tensor([1.0, 2.0, 3.0], dtype=D)).sum().backward()
    return {"sum": _rel(total, b.detach()), "grad": b.grad.tolist()}


class _Experts(nn.Module):
    """Two experts ``x -> relu(x U_e^T) D_e^T`` weighted by routing weights made outside it (as
    Gemma-4's decoder layer calls its experts): ``out = sum_e w[:, e] * expert_e(x)``."""

    def __init__(self, up, down):
        super().__init__()
        self.up, self.down = nn.Parameter(up), nn.Parameter(down)  # (E, F, H), (E, H, F)

    def forward(self, x, weights):  # x (T, H), weights (T, E)
        hidden = torch.relu(torch.einsum("th,efh->etf", x, self.up))  # (E, T, F)
        return torch.einsum("etf,ehf,te->th", hidden, self.down, weights)  # (T, H)


def experts_region_case(tp, group, rank) -> dict:
    """A ``moe_experts`` region: the experts' width split, their partial sums reduced at the
    module's output, and the routing weights copied in with the hidden states, so the replicated
    router outside the region gets its whole gradient (copied hidden states only: this rank's share)."""
    g = torch.Generator().manual_seed(6)
    up, down = torch.randn(2, 8, 5, generator=g, dtype=D), torch.randn(2, 5, 8, generator=g, dtype=D)
    router = torch.randn(2, 5, generator=g, dtype=D)
    x = torch.randn(4, 5, generator=g, dtype=D)
    cot = torch.randn(4, 5, generator=g, dtype=D)

    def run(experts, r):
        xi = x.clone().requires_grad_()
        weights = torch.softmax(xi @ r.T, dim=-1)  # (T, E), replicated
        out = experts(xi, weights)
        (out * cot).sum().backward()
        return out.detach(), xi.grad

    r_dense = router.clone().requires_grad_()
    dense = _Experts(up.clone(), down.clone())
    out_d, dx_d = run(dense, r_dense)
    cols = slice(rank * 8 // tp, (rank + 1) * 8 // tp)
    split = _Experts(up[:, cols].clone(), down[:, :, cols].clone())
    regions.enter_region(split, group, all_inputs=True)
    regions.exit_region(split, group)
    r_split = router.clone().requires_grad_()
    out_s, dx_s = run(split, r_split)
    return {"out": _rel(out_s, out_d), "dx": _rel(dx_s, dx_d), "router": _rel(r_split.grad, r_dense.grad),
            "up": _rel(split.up.grad, dense.up.grad[:, cols]), "down": _rel(split.down.grad, dense.down.grad[:, :, cols])}


def runtime_worker() -> dict:
    torch.set_num_threads(1)
    out = {}
    for tp in (2, 4):
        group, rank = _group(tp)
        out[("norm", tp)] = sharded_norm_case(tp, group, rank)
        out[("subclass", tp)] = subclass_case(tp, group, rank)
        out[("grad_sync", tp)] = grad_sync_case(tp, group, rank)
        out[("rank0", tp)] = rank0_case(tp, group, rank)
        out[("experts_region", tp)] = experts_region_case(tp, group, rank)
    out[("norm_replicated", 4)] = sharded_norm_case(4, None, dist.get_rank(), replicas=2)
    return out
