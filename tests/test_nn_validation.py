"""Bad input to tensorpar.nn raises ValueError, naming the value and the valid choices, before any
collective (checked on 3 real gloo ranks with a ledger open: it must record nothing; ranks 0-1
form the tp group, rank 2 is outside it); and the pure pieces (partition rule, dense attention,
rotary) against independent formulas."""
import math

import pytest
import torch

import tensorpar.nn as tn
from tensorpar import distributed as dist
from tensorpar.architecture.tp_rules import divide, padded_range

pytestmark = pytest.mark.multirank
F64 = torch.float64


def _cache(*shape, dtype=F64):
    """A KV cache already holding keys and values of ``shape`` (B, KV heads, S, head_dim)."""
    cache = tn.KVCache()
    cache.append(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    return cache


def _bad_calls(g):
    """(name, thunk, text the message must contain) on the tp=2 group ``g``; modules built up
    front."""
    col = tn.ColumnParallelLinear(8, 6, dtype=F64, tp_group=g)
    col_sp = tn.ColumnParallelLinear(8, 6, sequence_parallel=True, dtype=F64, tp_group=g)
    row = tn.RowParallelLinear(8, 6, dtype=F64, tp_group=g)
    row_sp = tn.RowParallelLinear(8, 6, sequence_parallel=True, dtype=F64, tp_group=g)
    emb = tn.VocabParallelEmbedding(10, 4, dtype=F64, tp_group=g)
    emb_sp = tn.VocabParallelEmbedding(10, 4, sequence_parallel=True, dtype=F64, tp_group=g)
    mlp = tn.ParallelMLP(8, 16, dtype=F64, tp_group=g)
    attn = tn.ParallelAttention(16, 4, 2, dtype=F64, tp_group=g)  # per rank: 2 q, 1 KV head, D 4
    attn_sp = tn.ParallelAttention(16, 4, 2, sequence_parallel=True, dtype=F64, tp_group=g)
    norm = tn.SequenceParallelNorm(8, dtype=F64, tp_group=g)
    x = torch.zeros(2, 3, 8, dtype=F64)
    x16, x16_sp = torch.zeros(1, 3, 16, dtype=F64), torch.zeros(1, 2, 16, dtype=F64)  # T=4 in SP
    logits4 = torch.zeros(3, 4, dtype=F64)  # the shard of a 16-vocab split 4 ways: wrong group
    target = torch.zeros(3, dtype=torch.long)
    mask = torch.ones(1, 4, 3, 3, dtype=torch.bool)  # a valid per-head mask for x16

    def ce(logits, tgt, **kw):
        return tn.vocab_parallel_cross_entropy(logits, tgt, tp_group=g, **kw)

    return [
        ("column: last dim", lambda: col(torch.zeros(2, 3, 7, dtype=F64)), "in_features (8)"),
        ("column: dtype", lambda: col(x.float()), "torch.float32"),
        ("column: indivisible", lambda: tn.ColumnParallelLinear(8, 7, tp_group=g), "valid tp sizes: 1, 7"),
        ("column: sp 2-d", lambda: col_sp(torch.zeros(3, 8, dtype=F64)), "(B, T/p, H)"),
        ("row: full input", lambda: row(x), "in_features_per_partition (4)"),
        ("row: dtype", lambda: row(torch.zeros(2, 3, 4)),
         "RowParallelLinear: input dtype (torch.float32) does not match the weight dtype (torch.float64)"),
        ("row: sp odd T", lambda: row_sp(torch.zeros(2, 3, 4, dtype=F64)), "multiple of 2"),
        ("row: sp needs parallel input",
         lambda: tn.RowParallelLinear(8, 6, sequence_parallel=True, input_is_parallel=False, tp_group=g),
         "input_is_parallel=True"),
        ("row: indivisible", lambda: tn.RowParallelLinear(5, 6, tp_group=g), "in_features (5)"),
        ("embedding: id range", lambda: emb(torch.tensor([[1, 10]])), "[0, 10)"),
        ("embedding: float ids", lambda: emb(torch.zeros(2, 3)), "integer"),
        ("embedding: sp odd T", lambda: emb_sp(torch.zeros(2, 3, dtype=torch.long)), "multiple of 2"),
        ("ce: wrong group size", lambda: ce(logits4, target, vocab_size=16), "= 8 for vocab_size (16)"),
        ("ce: target shape", lambda: ce(torch.zeros(3, 8, dtype=F64), target[:2]), "target shape"),
        ("ce: target range", lambda: ce(torch.zeros(3, 8, dtype=F64), target + 16), "target id 16"),
        ("ce: float target", lambda: ce(torch.zeros(3, 8, dtype=F64), target.double()), "integer"),
        ("ce: reduction", lambda: ce(torch.zeros(3, 8, dtype=F64), target, reduction="avg"), "'avg'"),
        ("mlp: indivisible", lambda: tn.ParallelMLP(8, 15, tp_group=g), "ffn_hidden_size (15)"),
        ("mlp: activation", lambda: tn.ParallelMLP(8, 16, activation="tanh", tp_group=g), "'swiglu'"),
        ("mlp: hidden", lambda: mlp(torch.zeros(2, 3, 6, dtype=F64)), "hidden_size (8)"),
        ("mlp: dtype", lambda: mlp(x.float()), "does not match"),
        ("attention: heads", lambda: tn.ParallelAttention(24, 6, 3, tp_group=g), "valid tp sizes: 1, 3, 6"),
        ("attention: hidden", lambda: attn(x), "hidden_size (16)"),
        ("attention: dtype", lambda: attn(x16.float()),
         "ParallelAttention: input dtype (torch.float32) does not match the weight dtype (torch.float64)"),
        ("attention: sp dtype", lambda: attn_sp(x16_sp.float()), "input dtype (torch.float32)"),
        ("attention: mask dtype", lambda: attn(x16, attn_mask=torch.zeros(3, 3)), "bool"),
        ("attention: mask heads", lambda: attn(x16, attn_mask=mask[:, :3]),
         "(1, 3, 3, 3) does not broadcast to (B, n_heads, T, S) = (1, 4, 3, 3)"),
        ("attention: mask 5-d", lambda: attn(x16, attn_mask=mask[None]), "(1, 4, 3, 3)"),
        ("attention: sp mask is over the full T", lambda: attn_sp(x16_sp, attn_mask=mask[..., :2, :2]),
         "(B, n_heads, T, S) = (1, 4, 4, 4)"),
        ("attention: sp mask after a cache",  # T = 4 queries, S = 2 cached + 4 keys
         lambda: attn_sp(x16_sp, cache=_cache(1, 1, 2, 4), attn_mask=mask[..., :1, :1].expand(1, 4, 4, 4)),
         "= (1, 4, 4, 6)"),
        ("attention: sp cache batch", lambda: attn_sp(x16_sp, cache=_cache(3, 1, 2, 4)), "needs batch 1"),
        ("attention: sp cache heads", lambda: attn_sp(x16_sp, cache=_cache(1, 2, 2, 4)), "1 KV heads"),
        ("attention: sp cache head_dim", lambda: attn_sp(x16_sp, cache=_cache(1, 1, 2, 8)), "head_dim 4"),
        ("attention: cache dtype", lambda: attn(x16, cache=_cache(1, 1, 2, 4, dtype=torch.float32)),
         "dtype torch.float64"),
        ("attention: dropout rng", lambda: tn.ParallelAttention(16, 4, attn_dropout=0.1, tp_group=g),
         "rng_tracker"),
        ("norm: hidden", lambda: norm(torch.zeros(2, 3, 6, dtype=F64)), "hidden_size (8)"),
        ("norm: dtype", lambda: norm(x.float()), "does not match"),
        ("dropout: sharded rng", lambda: tn.ParallelDropout(0.1, sharded=True), "rng_tracker"),
        ("dropout: p", lambda: tn.ParallelDropout(1.5), "1.5"),
    ]


def _non_member_calls(g):
    """(name, thunk) building every tensor-parallel piece on a rank outside the group ``g``;
    several are also otherwise invalid, to show that membership is checked first."""
    lin, emb = torch.nn.Linear(8, 6), torch.nn.Embedding(10, 4)
    mlp, attn, norm = tn.MLP(8, 16), tn.Attention(16, 4, 2), torch.nn.RMSNorm(8)
    return [
        ("column", lambda: tn.ColumnParallelLinear(8, 6, tp_group=g)),
        ("column: from_dense", lambda: tn.ColumnParallelLinear.from_dense(lin, tp_group=g)),
        ("row", lambda: tn.RowParallelLinear(8, 6, tp_group=g)),
        ("row: from_dense, also indivisible", lambda: tn.RowParallelLinear.from_dense(
            torch.nn.Linear(5, 6), tp_group=g)),
        ("row: also sp without parallel input", lambda: tn.RowParallelLinear(
            8, 6, sequence_parallel=True, input_is_parallel=False, tp_group=g)),
        ("embedding: also 0 rows", lambda: tn.VocabParallelEmbedding(0, 4, tp_group=g)),
        ("embedding: from_dense", lambda: tn.VocabParallelEmbedding.from_dense(emb, tp_group=g)),
        ("mlp: also bad activation", lambda: tn.ParallelMLP(8, 16, activation="tanh", tp_group=g)),
        ("mlp: from_dense", lambda: tn.ParallelMLP.from_dense(mlp, tp_group=g)),
        ("attention: also bad heads", lambda: tn.ParallelAttention(24, 6, 4, tp_group=g)),
        ("attention: from_dense", lambda: tn.ParallelAttention.from_dense(attn, tp_group=g)),
        ("norm: also bad kind", lambda: tn.SequenceParallelNorm(8, kind="batchnorm", tp_group=g)),
        ("norm: from_dense", lambda: tn.SequenceParallelNorm.from_dense(norm, tp_group=g)),
        ("cross-entropy", lambda: tn.vocab_parallel_cross_entropy(
            torch.zeros(3, 8), torch.zeros(3, dtype=torch.long), tp_group=g)),
        ("model_parallel_seed", lambda: tn.model_parallel_seed(0, tp_group=g)),
    ]


def _outcome(thunk) -> tuple[str, str]:
    try:
        thunk()
        return "no error", ""
    except Exception as exc:  # noqa: BLE001 -- the type is what is being checked
        return type(exc).__name__, str(exc)


def validation_worker():
    """World of 3: ranks 0 and 1 form the tp=2 group of the bad-input calls; rank 2 is outside
    it and tries to build every layer on it. Every rank creates the group, as torch requires."""
    pair = dist.new_group([0, 1])
    if dist.get_rank() < 2:
        calls = _bad_calls(pair)
    else:
        text = "global rank 2 is not a member of tp_group"
        calls = [(name, thunk, text) for name, thunk in _non_member_calls(pair)]
    with dist.ledger() as led:
        out = [(name, *_outcome(thunk), text) for name, thunk, text in calls]
    return out, len(led.records)


@pytest.fixture(scope="module")
def results():
    return dist.launch(validation_worker, 3, deadline=120)


def test_bad_input_raises_value_error_with_the_value_and_choices(results):
    for rank, (calls, _) in enumerate(results):
        assert len(calls) == (39 if rank < 2 else 15), rank
        bad = [(name, kind, msg) for name, kind, msg, text in calls
               if kind != "ValueError" or text not in msg]
        assert bad == [], rank


def test_no_collective_was_issued_by_bad_input(results):
    assert [n_records for _, n_records in results] == [0, 0, 0]


# -- pure checks, no ranks ----------------------------------------------------------------------

def test_padding_rule_of_the_architecture():
    assert [padded_range(13, r, 4) for r in range(4)] == [(0, 4, 4), (4, 8, 4), (8, 12, 4), (12, 13, 4)]
    assert [padded_range(5, r, 4) for r in range(4)] == [(0, 2, 2), (2, 4, 2), (4, 5, 2), (6, 6, 2)]
    assert padded_range(16, 3, 4) == (12, 16, 4)
    with pytest.raises(ValueError, match=r"tp_size \(4\) must divide n \(6\); valid tp sizes: 1, 2, 3, 6"):
        divide(6, 4, "n")


def test_valid_attention_tp_sizes():
    assert tn.valid_attention_tp_sizes(8, 2) == [1, 2, 4, 8]  # 4, 8: KV heads replicated
    assert tn.valid_attention_tp_sizes(6, 3) == [1, 3, 6]
    assert tn.valid_attention_tp_sizes(32, 8) == [1, 2, 4, 8, 16, 32]
    assert tn.valid_tp_sizes(12, 8) == [1, 2, 4]


def _naive_attention(attn, x):
    """Loops over heads; rotary as a complex rotation of (x_i, x_{i+D/2}); explicit causal mask."""
    b, t, _ = x.shape
    d, hq, hkv = attn.head_dim, attn.n_heads, attn.n_kv_heads
    q = (x @ attn.q_proj.weight.T).view(b, t, hq, d)
    k = (x @ attn.k_proj.weight.T).view(b, t, hkv, d)
    v = (x @ attn.v_proj.weight.T).view(b, t, hkv, d)
    angle = torch.arange(t, dtype=F64)[:, None] * attn.rope_theta ** (-torch.arange(0, d, 2, dtype=F64) / d)
    rot = torch.polar(torch.ones_like(angle), angle)[None, :, None, :]  # (1, T, 1, D/2)

    def rotate(z):
        zc = torch.complex(z[..., : d // 2], z[..., d // 2:]) * rot
        return torch.cat([zc.real, zc.imag], dim=-1)

    q, k = rotate(q), rotate(k)
    heads = []
    for h in range(hq):
        kv = h // (hq // hkv)
        scores = torch.einsum("btd,bsd->bts", q[:, :, h], k[:, :, kv]) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(torch.einsum("bts,bsd->btd", scores.softmax(-1), v[:, :, kv]))
    return torch.cat(heads, dim=-1) @ attn.o_proj.weight.T


def test_dense_attention_equals_a_naive_implementation_and_decodes_with_a_cache():
    torch.manual_seed(0)
    attn = tn.Attention(32, 8, 2, dtype=F64)
    x = torch.randn(2, 6, 32, dtype=F64)
    full = attn(x)
    assert torch.allclose(full, _naive_attention(attn, x), rtol=0, atol=1e-12)
    cache = tn.KVCache()
    steps = [attn(x[:, :2], cache=cache)] + [attn(x[:, i:i + 1], cache=cache) for i in range(2, 6)]
    assert torch.allclose(torch.cat(steps, dim=1), full, rtol=0, atol=1e-12)
    assert cache.k.shape == (2, 2, 6, 4)


def test_dense_swiglu_mlp_formula():
    torch.manual_seed(0)
    mlp = tn.MLP(8, 16, activation="swiglu", bias=False, dtype=F64)
    x = torch.randn(3, 8, dtype=F64)
    gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    expect = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    assert torch.allclose(mlp(x), expect, rtol=0, atol=1e-13)
