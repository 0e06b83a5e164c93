"""ParallelMLP and ParallelAttention on real gloo ranks: equal to the dense blocks built from the
same seed (output, input gradient, every parameter gradient), one all-reduce forward and one
backward with the ring bytes of the ledger formula, and KV-cache decoding equal to a full pass.

One launch of 4 ranks; groups of size 1 (rank 3 alone), 2 ({0,1}, {2,3}) and 4 (the world)
inside it.
Tolerances as in test_nn_layers.py (float64 1e-10, float32 1e-5, relative to the largest entry
of each reference tensor): the parallel blocks reorder sums of at most 64 products.
"""
import pytest
import torch

import tensorpar.nn as tn
from tensorpar import distributed as dist
from tests.test_nn_layers import TOL, all_keys, padded_slice, randn, rel_err, tp_groups

pytestmark = pytest.mark.multirank
WORLD = 4
MLP_CASES = [  # hidden, ffn, activation, bias
    (16, 32, "gelu", True), (16, 64, "swiglu", False), (8, 16, "gelu_tanh", False),
    (12, 16, "geglu", True)]
ATTN_CASES = [  # hidden, n_heads, n_kv_heads, extra kwargs
    (32, 4, 4, {}),
    (32, 8, 2, {"qkv_bias": True}),                 # GQA; at tp=4 the 2 KV heads are replicated
    (32, 4, 1, {"out_bias": True}),                 # MQA: replicated at tp=2 and 4
    (24, 4, 4, {"rotary": False, "causal": False, "qkv_bias": True, "out_bias": True}),
    (16, 4, 2, {"head_dim": 8})]                    # n_heads * head_dim != hidden
SHAPES = [(2, 5), (1, 8)]


def expected_shard(name: str, full: torch.Tensor, block, p: int, r: int) -> torch.Tensor:
    """This rank's part of a dense parameter (or its gradient), written out independently."""
    proj, kind = name.split(".")
    if proj in ("down_proj", "o_proj"):  # row-parallel: input columns; bias replicated
        return full if kind == "bias" else padded_slice(full, 1, r, p)
    if proj in ("k_proj", "v_proj") and block.n_kv_heads < p:  # replicated KV head
        h, d = r // (p // block.n_kv_heads), block.head_dim
        return full[h * d:(h + 1) * d]
    return padded_slice(full, 0, r, p)  # column-parallel: output rows (whole heads)


def vanishing_grad_floor(name: str, dense, p: int, r: int) -> float:
    """0, except for a gradient that is zero in exact arithmetic; each tensor is otherwise judged
    against its own scale, max |reference|.

    Without rotary the keys' bias gets no gradient: ``q_i . (k_j + b) = q_i . k_j + q_i . b``
    adds the same number to every score of query i (per head, under any mask) and softmax is
    shift-invariant, so ``db_k = sum_t dK_t`` cancels exactly and the reference holds rounding
    noise only. Its floor is the same rank's slice of the k weight gradient, ``dW_k = dK^T X``:
    built from the same per-token key gradients dK (X is O(1) randn), it is the size db_k
    would have without the cancellation, so the tolerance still catches a wrong shard or a
    missing reduction of the bias gradient at that size.
    """
    if name != "k_proj.bias" or getattr(dense, "rotary", True):
        return 0.0
    w = expected_shard("k_proj.weight", dense.k_proj.weight.grad, dense, p, r)
    return w.abs().max().item()


def compare_block(dense, par, group, x, dtype, seed, **kw):
    """Errors of output, dX and every parameter gradient; and the ledger's records."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    dense.zero_grad(set_to_none=True)  # the blocks may be compared again, e.g. with a mask
    par.zero_grad(set_to_none=True)
    x_d, x_p = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_d = dense(x_d, **kw)
    with dist.ledger(model=par) as led:
        y_p = par(x_p, **kw)
        g = randn(y_d.shape, seed, dtype)
        y_p.backward(g)
    y_d.backward(g)
    errs = {"y": rel_err(y_p, y_d), "dx": rel_err(x_p.grad, x_d.grad)}
    dense_params = dict(dense.named_parameters())
    for name, prm in par.named_parameters():
        ref = expected_shard(name, dense_params.pop(name).grad, dense, p, r)
        floor = vanishing_grad_floor(name, dense, p, r)
        errs["d" + name] = rel_err(prm.grad, ref, max(ref.abs().max().item(), floor))
        if floor:  # the floor is earned only by a reference that is ~0 next to it
            errs[f"d{name} ~ 0"] = ref.abs().max().item() / floor
    assert not dense_params, f"dense parameters without a shard: {list(dense_params)}"
    records = [(c.op, c.phase, c.module, c.payload_bytes, c.bytes_sent, c.group_size)
               for c in led.records]
    return errs, records, y_d.numel() * y_d.element_size()


def mlp_cases(group, out):
    p = dist.get_world_size(group)
    for i, (hidden, ffn, act, bias) in enumerate(MLP_CASES):
        for dtype in (torch.float64, torch.float32):
            for lead in SHAPES:
                seed = 1000 * i + 10 * len(lead) + lead[1]
                torch.manual_seed(seed)
                dense = tn.MLP(hidden, ffn, activation=act, bias=bias, dtype=dtype)
                par = tn.ParallelMLP.from_dense(dense, tp_group=group)
                x = randn((*lead, hidden), seed + 1, dtype)
                out[("mlp", p, dtype, i, lead)] = compare_block(dense, par, group, x, dtype, seed)


def attention_cases(group, out):
    p = dist.get_world_size(group)
    for i, (hidden, heads, kv, kw) in enumerate(ATTN_CASES):
        if p not in tn.valid_attention_tp_sizes(heads, kv):
            continue
        for dtype in (torch.float64, torch.float32):
            for lead in SHAPES:
                seed = 1000 * i + lead[1]
                torch.manual_seed(seed)
                dense = tn.Attention(hidden, heads, kv, dtype=dtype, **kw)
                par = tn.ParallelAttention.from_dense(dense, tp_group=group)
                x = randn((*lead, hidden), seed + 1, dtype)
                out[("attn", p, dtype, i, lead)] = compare_block(dense, par, group, x, dtype, seed)
                if dtype == torch.float64 and lead == SHAPES[0]:  # cutting a mask is dtype-blind
                    mask = head_mask(lead[0], heads, lead[1], seed + 2)
                    out[("attn", p, dtype, i, lead, "head_mask")] = compare_block(
                        dense, par, group, x, dtype, seed, attn_mask=mask)
        if kw.get("causal", True):  # without the causal mask early tokens see later ones
            out[("decode", p, i)] = decode_case(group, hidden, heads, kv, kw, seed=77 + i)


def head_mask(b: int, heads: int, t: int, seed: int) -> torch.Tensor:
    """A random per-head ``(B, n_heads, T, T)`` bool mask (True = attend); the diagonal stays
    True so that no query row is fully masked (softmax over no keys is NaN)."""
    keep = torch.rand((b, heads, t, t), generator=torch.Generator().manual_seed(seed)) < 0.6
    return keep | torch.eye(t, dtype=torch.bool)


def decode_case(group, hidden, heads, kv, kw, seed):
    """Prefill 3 tokens, then decode 4 one at a time with a per-rank KV cache; compare with one
    pass over all 7 tokens. Also returns this rank's cache shape."""
    torch.manual_seed(seed)
    par = tn.ParallelAttention(hidden, heads, kv, tp_group=group, dtype=torch.float64, **kw)
    x = randn((2, 7, hidden), seed + 1, torch.float64)
    cache = tn.KVCache()
    with torch.no_grad():
        full = par(x)
        steps = [par(x[:, :3], cache=cache)] + [par(x[:, t:t + 1], cache=cache) for t in range(3, 7)]
    return rel_err(torch.cat(steps, dim=1), full), tuple(cache.k.shape), par.n_kv_heads_per_partition


def init_cases(group, out):
    """Constructing a block directly equals the dense block from the same seed, sliced."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(5)
    blocks = [tn.ParallelMLP(16, 32, activation="swiglu", tp_group=group),
              tn.ParallelAttention(32, 8, 2, qkv_bias=True, tp_group=group)]
    torch.manual_seed(5)
    dense = [tn.MLP(16, 32, activation="swiglu"), tn.Attention(32, 8, 2, qkv_bias=True)]
    same = []
    for par, ref in zip(blocks, dense):
        ref_params = dict(ref.named_parameters())
        same += [torch.equal(prm, expected_shard(name, ref_params[name].detach(), ref, p, r))
                 for name, prm in par.named_parameters()]
    out[("init", p)] = same


def blocks_worker():
    out = {}
    for group in tp_groups().values():
        mlp_cases(group, out)
        attention_cases(group, out)
        init_cases(group, out)
    return out


@pytest.fixture(scope="module")
def results():
    return dist.launch(blocks_worker, WORLD, deadline=240)


def _cases(results, kind):
    found = [(rank, key, val) for rank, res in enumerate(results)
             for key, val in res.items() if key[0] == kind]
    assert found, f"no {kind} cases ran"
    return found


@pytest.mark.parametrize("kind", ["mlp", "attn"])
def test_block_matches_dense_output_and_every_gradient(results, kind):
    bad = [(rank, key, name, e) for rank, key, (errs, _, _) in _cases(results, kind)
           for name, e in errs.items() if not e <= TOL[key[2]]]
    assert bad == []


@pytest.mark.parametrize("kind", ["mlp", "attn"])
def test_one_all_reduce_forward_and_one_backward_with_ring_bytes(results, kind):
    """Activations: all-reduce of N = B*T*H*e after the row projection (forward) and of dX
    (backward), each sending 2(p-1)/p * N. Replicated KV heads add, in backward only, one
    all-reduce per replicated projection of its (n_kv_heads, head_dim, H[+1]) gradient slots."""
    checked = 0
    for rank, key, (_, records, n) in _cases(results, kind):
        p = key[1]
        if p == 1:
            assert records == [], (rank, key, records)
            continue
        ring = 2 * (p - 1) / p
        row, block = ("down_proj", "ParallelMLP") if kind == "mlp" else ("o_proj", "ParallelAttention")
        expected = [("all_reduce", "forward", row, n, ring * n, p),
                    ("all_reduce", "backward", block, n, ring * n, p)]
        if kind == "attn" and ATTN_CASES[key[3]][2] < p:
            hidden, _, kv, kw = ATTN_CASES[key[3]]
            e = 8 if key[2] == torch.float64 else 4
            slots = kv * kw.get("head_dim", hidden // ATTN_CASES[key[3]][1]) * e
            slots *= hidden + kw.get("qkv_bias", False)
            expected += [("all_reduce", "backward", name, slots, ring * slots, p)
                         for name in ("k_proj", "v_proj")]
        assert sorted(records) == sorted(expected), (rank, key)
        checked += 1
    assert checked


def test_kv_cache_decoding_equals_full_sequence(results):
    for rank, key, (err, cache_shape, kv_local) in _cases(results, "decode"):
        hidden, heads, kv, kw = ATTN_CASES[key[2]]
        head_dim = kw.get("head_dim", hidden // heads)
        assert err <= 1e-10, (rank, key, err)
        assert cache_shape == (2, kv_local, 7, head_dim), (rank, key, cache_shape)
        p = key[1]
        assert kv_local == (kv // p if kv >= p else 1)


def test_direct_construction_gives_the_same_blocks_at_every_tp_size(results):
    for rank, key, same in _cases(results, "init"):
        assert same and all(same), (rank, key, same)


def test_gqa_replication_and_every_tp_size_were_covered(results):
    keys = all_keys(results)
    assert ("attn", 4, torch.float64, 1, (2, 5)) in keys  # 8 heads / 2 KV heads at tp=4
    assert ("attn", 2, torch.float32, 2, (1, 8)) in keys  # MQA at tp=2
    assert ("mlp", 4, torch.float32, 1, (1, 8)) in keys
    for p in (1, 2, 4):  # a per-head mask cut to each rank's heads, with split and replicated KV
        assert ("attn", p, torch.float64, 1, (2, 5), "head_mask") in keys


def test_vanishing_key_bias_gradient_is_floored_only_where_it_is_zero(results):
    """Case 3 (no rotary, qkv bias) is the only one whose reference key-bias gradient is ~0;
    there the floor is applied and the reference is checked to be negligible beside it."""
    floored = {(key[2], key[3]) for _, key, (errs, _, _) in _cases(results, "attn")
               if "dk_proj.bias ~ 0" in errs}
    assert floored == {(torch.float64, 3), (torch.float32, 3)}
