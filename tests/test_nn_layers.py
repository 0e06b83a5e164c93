"""Column-, row- and vocab-parallel layers and the vocab-parallel cross-entropy on real gloo ranks.

One launch of 4 ranks; inside it every case runs on groups of size 1 (rank 3 alone), 2
(sub-groups {0,1} and {2,3}) and 4 (the world group, tp_group=None). Each rank compares its
output, input gradient and parameter-gradient shards with the dense torch module built from the
same seed.

Tolerances (relative to the largest reference entry): float64 1e-10, float32 1e-5. The sharded
and dense computations sum the same products in different orders over at most 64 terms, so the
rounding difference is a few units of eps (2.2e-16 / 1.2e-7) times that length; a wrong slice,
a missing reduction or a double-counted bias gives an O(1) error.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorpar.nn as tn
from tensorpar import distributed as dist

pytestmark = pytest.mark.multirank
WORLD = 4
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
SHAPES = [(2, 3), (1, 5), (4,)]  # leading dims of the input


def rel_err(a: torch.Tensor, b: torch.Tensor, scale: float | None = None) -> float:
    """max |a - b| over max |b| (or over ``scale``, for a reference that may vanish)."""
    if scale is None:
        scale = b.abs().max().item() if b.numel() else 0.0
    return (a - b).abs().max().item() / (scale or 1.0) if a.numel() else 0.0


def randn(shape, seed, dtype):
    """The same tensor on every rank (inputs of a tp group are replicated)."""
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=dtype)


def tp_groups() -> dict:
    """This rank's group of each tp size; every rank creates every group, as torch requires.

    tp=1 runs on the last rank only: on every other rank it would repeat the same computation
    (same seeds, a group of one), and on the last rank the group rank (0) differs from the global
    rank (3), which is the case a global-for-group rank mix-up would fail.
    """
    r = dist.get_rank()
    single = dist.new_group([WORLD - 1])
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return ({1: single} if r == WORLD - 1 else {}) | {2: pairs[r // 2], 4: None}


def all_keys(results) -> set:
    """The case keys of every rank (tp=1 cases run on the last rank only)."""
    return set().union(*results)


def padded_slice(t: torch.Tensor, dim: int, r: int, p: int) -> torch.Tensor:
    """Rank r's slice of ``t`` along ``dim`` under the padding rule, zero-padded to ceil(n/p)."""
    n = t.shape[dim]
    per = -(-n // p)
    part = t.narrow(dim, min(r * per, n), max(0, min((r + 1) * per, n) - r * per))
    pad = list(t.shape)
    pad[dim] = per - part.shape[dim]
    return torch.cat([part, t.new_zeros(pad)], dim=dim)


def column_case(group, in_f, out_f, bias, gather, lead, dtype, seed):
    p, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(seed)
    dense = nn.Linear(in_f, out_f, bias=bias, dtype=dtype)
    layer = tn.ColumnParallelLinear.from_dense(dense, tp_group=group, gather_output=gather,
                                               pad_out_features=out_f % p != 0)
    x_d = randn((*lead, in_f), seed + 1, dtype).requires_grad_()
    x_p = x_d.detach().clone().requires_grad_()
    y_d, y_p = dense(x_d), layer(x_p)
    g = randn(y_d.shape, seed + 2, dtype)
    y_d.backward(g)
    y_p.backward(g if gather else padded_slice(g, -1, r, p))
    errs = {"y": rel_err(y_p, y_d if gather else padded_slice(y_d, -1, r, p)),
            "dx": rel_err(x_p.grad, x_d.grad),
            "dw": rel_err(layer.weight.grad, padded_slice(dense.weight.grad, 0, r, p))}
    if bias:
        errs["db"] = rel_err(layer.bias.grad, padded_slice(dense.bias.grad, 0, r, p))
    return errs


def column_frozen_case(group, lead, dtype, seed):
    """A frozen weight (no dW: the fused backward skips that GEMM) and a bare vector input."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(seed)
    dense = nn.Linear(8, 16, dtype=dtype)
    dense.weight.requires_grad_(False)
    layer = tn.ColumnParallelLinear.from_dense(dense, tp_group=group)
    x_d = randn((*lead, 8), seed + 1, dtype).requires_grad_()
    x_p = x_d.detach().clone().requires_grad_()
    y_d, y_p = dense(x_d), layer(x_p)
    g = randn(y_d.shape, seed + 2, dtype)
    y_d.backward(g)
    y_p.backward(padded_slice(g, -1, r, p))
    return {"y": rel_err(y_p, padded_slice(y_d, -1, r, p)), "dx": rel_err(x_p.grad, x_d.grad),
            "db": rel_err(layer.bias.grad, padded_slice(dense.bias.grad, 0, r, p)),
            "no dW": float(layer.weight.grad is not None)}


def row_case(group, in_f, out_f, bias, input_is_parallel, lead, dtype, seed):
    p, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(seed)
    dense = nn.Linear(in_f, out_f, bias=bias, dtype=dtype)
    layer = tn.RowParallelLinear.from_dense(dense, tp_group=group,
                                            input_is_parallel=input_is_parallel)
    x_d = randn((*lead, in_f), seed + 1, dtype).requires_grad_()
    x_in = padded_slice(x_d.detach(), -1, r, p) if input_is_parallel else x_d.detach()
    x_p = x_in.clone().requires_grad_()
    y_d, y_p = dense(x_d), layer(x_p)
    g = randn(y_d.shape, seed + 2, dtype)
    y_d.backward(g)
    y_p.backward(g)
    dx = padded_slice(x_d.grad, -1, r, p) if input_is_parallel else x_d.grad
    errs = {"y": rel_err(y_p, y_d), "dx": rel_err(x_p.grad, dx),
            "dw": rel_err(layer.weight.grad, padded_slice(dense.weight.grad, 1, r, p))}
    if bias:
        errs["db"] = rel_err(layer.bias.grad, dense.bias.grad)
    return errs


def embedding_case(group, vocab, dim, padding_idx, lead, dtype, seed):
    p, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(seed)
    dense = nn.Embedding(vocab, dim, padding_idx=padding_idx, dtype=dtype)
    layer = tn.VocabParallelEmbedding.from_dense(dense, tp_group=group)
    ids = torch.randint(0, vocab, lead, generator=torch.Generator().manual_seed(seed + 1))
    ids.view(-1)[:2] = torch.tensor([vocab - 1, 0 if padding_idx is None else padding_idx % vocab])
    y_d, y_p = dense(ids), layer(ids)
    g = randn(y_d.shape, seed + 2, dtype)
    y_d.backward(g)
    y_p.backward(g)
    return {"y": rel_err(y_p, y_d),
            "dw": rel_err(layer.weight.grad, padded_slice(dense.weight.grad, 0, r, p))}


def cross_entropy_case(group, vocab, lead, reduction, dtype, seed):
    """Padded logit columns hold +50 (they would dominate the softmax if not masked)."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    logits = randn((*lead, vocab), seed, dtype) * 3
    target = torch.randint(0, vocab, lead, generator=torch.Generator().manual_seed(seed + 1))
    target.view(-1)[0] = -100  # ignore_index
    target.view(-1)[-1] = vocab - 1  # the last (possibly partly padded) shard owns a target
    full = logits.clone().requires_grad_()
    loss_d = F.cross_entropy(full.reshape(-1, vocab), target.reshape(-1), reduction=reduction)
    shard = padded_slice(logits, -1, r, p)
    real = max(0, min(vocab - r * shard.shape[-1], shard.shape[-1]))
    shard[..., real:] = 50.0
    shard.requires_grad_()
    loss_p = tn.vocab_parallel_cross_entropy(shard, target, tp_group=group, vocab_size=vocab,
                                             reduction=reduction)
    g = randn(loss_p.shape, seed + 2, dtype)
    loss_d.backward(g.reshape(loss_d.shape))
    loss_p.backward(g)
    return {"loss": rel_err(loss_p.reshape(-1), loss_d.reshape(-1)),
            "dlogits": rel_err(shard.grad, padded_slice(full.grad, -1, r, p))}


def init_case(group, seed):
    """Direct construction slices the master drawn exactly as the dense module draws it; two
    layers in a row also match, so the RNG is left where the dense construction leaves it."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(seed)
    col = tn.ColumnParallelLinear(12, 10, tp_group=group, pad_out_features=True)
    row = tn.RowParallelLinear(8, 6, tp_group=group)
    emb = tn.VocabParallelEmbedding(11, 4, tp_group=group, padding_idx=3)
    torch.manual_seed(seed)
    d_col, d_row, d_emb = nn.Linear(12, 10), nn.Linear(8, 6), nn.Embedding(11, 4, padding_idx=3)
    return [torch.equal(col.weight, padded_slice(d_col.weight, 0, r, p)),
            torch.equal(col.bias, padded_slice(d_col.bias, 0, r, p)),
            torch.equal(row.weight, padded_slice(d_row.weight, 1, r, p)),
            torch.equal(row.bias, d_row.bias),
            torch.equal(emb.weight, padded_slice(d_emb.weight, 0, r, p))]


def layers_worker():
    out = {}
    for p, group in tp_groups().items():
        seed = 0  # the same on every rank of the group, whichever groups this rank ran before
        for dtype in (torch.float64, torch.float32):
            for lead in SHAPES:
                for bias in (True, False):
                    seed += 10
                    for in_f, out_f in ((8, 16), (16, 12), (8, 6)):  # 6 and 12: padded at p=4
                        for gather in (False, True):
                            out[("column", p, dtype, lead, bias, in_f, out_f, gather)] = \
                                column_case(group, in_f, out_f, bias, gather, lead, dtype, seed)
                    for in_f, out_f in ((16, 8), (8, 12)):
                        for parallel in (True, False):
                            out[("row", p, dtype, lead, bias, in_f, out_f, parallel)] = \
                                row_case(group, in_f, out_f, bias, parallel, lead, dtype, seed)
                for vocab, padding_idx in ((16, None), (13, 5), (5, -1)):  # 13, 5: padded
                    out[("embedding", p, dtype, lead, vocab, padding_idx)] = \
                        embedding_case(group, vocab, 6, padding_idx, lead, dtype, seed)
                    for reduction in ("mean", "sum", "none"):
                        out[("ce", p, dtype, lead, vocab, reduction)] = \
                            cross_entropy_case(group, vocab, lead, reduction, dtype, seed)
            for lead in ((), (3,), (2, 3)):
                seed += 10
                out[("column", p, dtype, lead, "frozen")] = column_frozen_case(group, lead, dtype, seed)
        out[("init", p)] = init_case(group, seed=123)
    return out


@pytest.fixture(scope="module")
def results():
    return dist.launch(layers_worker, WORLD, deadline=240)


def _failures(results, kind):
    bad, n = [], 0
    for rank, res in enumerate(results):
        for key, errs in res.items():
            if key[0] != kind:
                continue
            n += 1
            tol = TOL[key[2]]
            bad += [(rank, key, name, e) for name, e in errs.items() if not e <= tol]
    assert n, f"no {kind} cases ran"
    return bad


@pytest.mark.parametrize("kind", ["column", "row", "embedding", "ce"])
def test_layer_matches_dense_forward_and_backward(results, kind):
    assert _failures(results, kind) == []


def test_every_tp_size_and_shape_was_covered(results):
    keys = all_keys(results)
    for p in (1, 2, 4):
        assert ("column", p, torch.float32, (4,), False, 8, 6, True) in keys
        assert ("ce", p, torch.float64, (2, 3), 5, "none") in keys
        assert ("column", p, torch.float64, (), "frozen") in keys


def test_direct_construction_gives_the_same_model_at_every_tp_size(results):
    assert {("init", p) for p in (1, 2, 4)} <= all_keys(results)
    for rank, res in enumerate(results):
        for key in (k for k in res if k[0] == "init"):
            assert all(res[key]), (rank, key, res[key])
