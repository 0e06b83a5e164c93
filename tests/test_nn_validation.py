"""Bad input to tensorpar.nn raises ValueError, naming the value and the valid choices, before any
collective (checked on 2 real gloo ranks with a ledger open: it must record nothing); and the
pure pieces (partition rule, dense attention, rotary) against independent formulas."""
import math

import pytest
import torch

import tensorpar.nn as tn
from tensorpar import dist
from tensorpar.nn.partition import divide, padded_range

pytestmark = pytest.mark.multirank
F64 = torch.float64


def _bad_calls():
    """(name, thunk, text the message must contain) on a tp=2 world; modules built up front."""
    col = tn.ColumnParallelLinear(8, 6, dtype=F64)
    col_sp = tn.ColumnParallelLinear(8, 6, sequence_parallel=True, dtype=F64)
    row = tn.RowParallelLinear(8, 6, dtype=F64)
    row_sp = tn.RowParallelLinear(8, 6, sequence_parallel=True, dtype=F64)
    emb = tn.VocabParallelEmbedding(10, 4, dtype=F64)
    emb_sp = tn.VocabParallelEmbedding(10, 4, sequence_parallel=True, dtype=F64)
    mlp = tn.ParallelMLP(8, 16, dtype=F64)
    attn = tn.ParallelAttention(16, 4, 2, dtype=F64)
    norm = tn.SequenceParallelNorm(8, dtype=F64)
    x = torch.zeros(2, 3, 8, dtype=F64)
    logits4 = torch.zeros(3, 4, dtype=F64)  # the shard of a 16-vocab split 4 ways: wrong group
    target = torch.zeros(3, dtype=torch.long)
    ce = tn.vocab_parallel_cross_entropy
    return [
        ("column: last dim", lambda: col(torch.zeros(2, 3, 7, dtype=F64)), "in_features (8)"),
        ("column: dtype", lambda: col(x.float()), "torch.float32"),
        ("column: indivisible", lambda: tn.ColumnParallelLinear(8, 7), "valid tp sizes: 1, 7"),
        ("column: sp 2-d", lambda: col_sp(torch.zeros(3, 8, dtype=F64)), "(B, T/p, H)"),
        ("row: full input", lambda: row(x), "in_features_per_partition (4)"),
        ("row: sp odd T", lambda: row_sp(torch.zeros(2, 3, 4, dtype=F64)), "multiple of 2"),
        ("row: sp needs parallel input",
         lambda: tn.RowParallelLinear(8, 6, sequence_parallel=True, input_is_parallel=False),
         "input_is_parallel=True"),
        ("row: indivisible", lambda: tn.RowParallelLinear(5, 6), "in_features (5)"),
        ("embedding: id range", lambda: emb(torch.tensor([[1, 10]])), "[0, 10)"),
        ("embedding: float ids", lambda: emb(torch.zeros(2, 3)), "integer"),
        ("embedding: sp odd T", lambda: emb_sp(torch.zeros(2, 3, dtype=torch.long)), "multiple of 2"),
        ("ce: wrong group size", lambda: ce(logits4, target, vocab_size=16), "= 8 for vocab_size (16)"),
        ("ce: target shape", lambda: ce(torch.zeros(3, 8, dtype=F64), target[:2]), "target shape"),
        ("ce: target range", lambda: ce(torch.zeros(3, 8, dtype=F64), target + 16), "target id 16"),
        ("ce: float target", lambda: ce(torch.zeros(3, 8, dtype=F64), target.double()), "integer"),
        ("ce: reduction", lambda: ce(torch.zeros(3, 8, dtype=F64), target, reduction="avg"), "'avg'"),
        ("mlp: indivisible", lambda: tn.ParallelMLP(8, 15), "ffn_hidden_size (15)"),
        ("mlp: activation", lambda: tn.ParallelMLP(8, 16, activation="tanh"), "'swiglu'"),
        ("mlp: hidden", lambda: mlp(torch.zeros(2, 3, 6, dtype=F64)), "hidden_size (8)"),
        ("mlp: dtype", lambda: mlp(x.float()), "does not match"),
        ("attention: heads", lambda: tn.ParallelAttention(24, 6, 3), "valid tp sizes: 1, 3, 6"),
        ("attention: hidden", lambda: attn(x), "hidden_size (16)"),
        ("attention: mask dtype",
         lambda: attn(torch.zeros(1, 3, 16, dtype=F64), attn_mask=torch.zeros(3, 3)), "bool"),
        ("attention: dropout rng", lambda: tn.ParallelAttention(16, 4, attn_dropout=0.1), "rng_tracker"),
        ("norm: hidden", lambda: norm(torch.zeros(2, 3, 6, dtype=F64)), "hidden_size (8)"),
        ("norm: dtype", lambda: norm(x.float()), "does not match"),
        ("dropout: sharded rng", lambda: tn.ParallelDropout(0.1, sharded=True), "rng_tracker"),
        ("dropout: p", lambda: tn.ParallelDropout(1.5), "1.5"),
    ]


def validation_worker():
    calls = _bad_calls()
    out = []
    with dist.ledger() as led:
        for name, thunk, text in calls:
            try:
                thunk()
                out.append((name, "no error", "", text))
            except Exception as exc:  # noqa: BLE001 -- the type is what is being checked
                out.append((name, type(exc).__name__, str(exc), text))
    return out, len(led.records)


@pytest.fixture(scope="module")
def results():
    return dist.launch(validation_worker, 2, deadline=120)


def test_bad_input_raises_value_error_with_the_value_and_choices(results):
    for rank, (calls, _) in enumerate(results):
        assert len(calls) == 28
        bad = [(name, kind, msg) for name, kind, msg, text in calls
               if kind != "ValueError" or text not in msg]
        assert bad == [], rank


def test_no_collective_was_issued_by_bad_input(results):
    assert [n_records for _, n_records in results] == [0, 0]


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
