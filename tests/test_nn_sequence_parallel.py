"""Sequence parallelism and dropout randomness on real gloo ranks.

A one-layer transformer (vocab-parallel embedding, RMSNorm, attention, LayerNorm, SwiGLU MLP,
RMSNorm, LM head, vocab-parallel cross-entropy; vocab 13 so it is padded) runs dense, tensor
parallel, and tensor + sequence parallel; loss and every gradient must agree (float64, 1e-10
relative, as in test_nn_layers.py). Two variants: no biases, and biases everywhere (q/k/v, o_proj,
the MLP, the LM head) with a per-head attention mask, so that under sequence parallelism the
row-parallel bias gradients (partial over each rank's tokens) must be all-reduced, and a mask
over the full sequence is cut to each rank's heads. Dropout: replicated activations get one
mask on every rank, sharded activations a different mask on every rank.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorpar.nn as tn
from tensorpar import distributed as dist
from tests.test_nn_blocks import expected_shard, head_mask
from tests.test_nn_layers import padded_slice, rel_err, tp_groups

pytestmark = pytest.mark.multirank
WORLD = 4
VOCAB, HIDDEN, B, T = 13, 16, 2, 8


VARIANTS = ("plain", "bias")  # "bias": every linear has a bias and attention a per-head mask
N_PARAMS = {"plain": 13, "bias": 13 + 8}  # + q, k, v, o, gate, up, down and head biases


def dense_model(seed, bias: bool) -> nn.ModuleDict:
    torch.manual_seed(seed)
    kw = {"dtype": torch.float64}
    return nn.ModuleDict({
        "emb": nn.Embedding(VOCAB, HIDDEN, **kw), "n1": nn.RMSNorm(HIDDEN, eps=1e-6, **kw),
        "attn": tn.Attention(HIDDEN, 4, 2, qkv_bias=bias, out_bias=bias, **kw),
        "n2": nn.LayerNorm(HIDDEN, **kw),
        "mlp": tn.MLP(HIDDEN, 32, activation="swiglu", bias=bias, **kw),
        "nf": nn.RMSNorm(HIDDEN, eps=1e-6, **kw), "head": nn.Linear(HIDDEN, VOCAB, bias=bias, **kw)})


def parallel_model(dense, group, sp: bool) -> nn.ModuleDict:
    def norm(m):
        return tn.SequenceParallelNorm.from_dense(m, tp_group=group) if sp else copy.deepcopy(m)
    return nn.ModuleDict({
        "emb": tn.VocabParallelEmbedding.from_dense(dense["emb"], tp_group=group, sequence_parallel=sp),
        "n1": norm(dense["n1"]),
        "attn": tn.ParallelAttention.from_dense(dense["attn"], tp_group=group, sequence_parallel=sp),
        "n2": norm(dense["n2"]),
        "mlp": tn.ParallelMLP.from_dense(dense["mlp"], tp_group=group, sequence_parallel=sp),
        "nf": norm(dense["nf"]),
        "head": tn.ColumnParallelLinear.from_dense(dense["head"], tp_group=group, sequence_parallel=sp,
                                                   pad_out_features=True)})


def run(model, ids, target, loss_fn, mask):
    x = model["emb"](ids)
    x = x + model["attn"](model["n1"](x), attn_mask=mask)  # mask: (B, 4 heads, T, T), full T
    x = x + model["mlp"](model["n2"](x))
    loss = loss_fn(model["head"](model["nf"](x)), target)
    loss.backward()
    return loss


def expected_grad(name, full, dense, p, r):
    part, _ = name.split(".", 1)
    if part in ("attn", "mlp"):
        return expected_shard(name.split(".", 1)[1], full, dense[part], p, r)
    return padded_slice(full, 0, r, p) if part in ("emb", "head") else full


def sp_case(group, variant):
    p, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(3)
    ids, target = torch.randint(0, VOCAB, (B, T), generator=g), torch.randint(0, VOCAB, (B, T), generator=g)
    mask = None if variant == "plain" else head_mask(B, 4, T, seed=5)
    dense = dense_model(seed=11, bias=variant == "bias")
    loss_d = run(dense, ids, target,
                 lambda z, t: F.cross_entropy(z.reshape(-1, VOCAB), t.reshape(-1)), mask)
    out = {}
    for sp in (False, True):
        model = parallel_model(dense, group, sp)
        with dist.ledger(model=model) as led:  # ids are whole: the SP embedding splits T itself
            loss = run(model, ids, target, lambda z, t: tn.vocab_parallel_cross_entropy(
                z, t, tp_group=group, vocab_size=VOCAB), mask)
        dense_grads = {n: prm.grad for n, prm in dense.named_parameters()}
        errs = {"loss": rel_err(loss, loss_d)}
        errs.update({n: rel_err(prm.grad, expected_grad(n, dense_grads[n], dense, p, r))
                     for n, prm in model.named_parameters()})
        out[sp] = (errs, [(c.op, c.phase, c.module, c.bytes_sent) for c in led.records])
    return out


def dropout_case(group):
    """Masks of ParallelDropout gathered from every rank of the group, plus RNG bookkeeping."""
    p = dist.get_world_size(group)
    tracker = tn.model_parallel_seed(1234, tp_group=group)
    ones = torch.ones(256, dtype=torch.float64)
    replicated = tn.ParallelDropout(0.5)(ones)
    sharded = tn.ParallelDropout(0.5, sharded=True, rng_tracker=tracker)(ones)
    after_fork = torch.rand(4)
    tn.model_parallel_seed(1234, tp_group=group)
    tn.ParallelDropout(0.5)(ones)  # the same default-generator draws, without the sharded one
    undisturbed = torch.rand(4)
    again = tn.ParallelDropout(0.5, sharded=True,
                               rng_tracker=tn.model_parallel_seed(1234, tp_group=group))(ones)
    gather = lambda m: dist.all_gather(m[None], 0, group).reshape(p, -1)  # (p, 256)
    return {"replicated": gather(replicated), "sharded": gather(sharded),
            "default_stream_kept": torch.equal(after_fork, undisturbed),
            "reproducible": torch.equal(again, sharded),
            "eval_identity": torch.equal(tn.ParallelDropout(0.5).eval()(ones), ones)}


def sp_worker():
    return {p: {"sp": {v: sp_case(group, v) for v in VARIANTS}, "dropout": dropout_case(group)}
            for p, group in tp_groups().items()}


@pytest.fixture(scope="module")
def results():
    return dist.launch(sp_worker, WORLD, deadline=240)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("sp", [False, True])
def test_transformer_layer_equals_dense_with_and_without_sequence_parallelism(results, sp, variant):
    for rank, res in enumerate(results):
        for p, cases in res.items():
            errs, _ = cases["sp"][variant][sp]
            assert len(errs) == 1 + N_PARAMS[variant], errs.keys()  # loss + every parameter
            bad = {k: e for k, e in errs.items() if not e <= 1e-10}
            assert bad == {}, (rank, p, bad)


def _bias_reductions(records):
    """Under SP, the row-parallel linears' bias gradients: all-reduces in their backward."""
    return sorted((mod, b) for op, ph, mod, b in records if op == "all_reduce"
                  and ph == "backward" and mod in ("attn.o_proj", "mlp.down_proj"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_sequence_parallel_moves_the_same_bytes_per_block(results, variant):
    """all-gather + reduce-scatter ((p-1)/p N each) replace each all-reduce (2(p-1)/p N).

    Activation collectives only: at tp=4 the 2 KV heads are replicated and k_proj / v_proj
    add their gradient all-reduces in both modes alike. With biases, sequence parallelism adds
    one all-reduce of each row-parallel bias gradient (H*e bytes, 2(p-1)/p of it sent): each
    rank's covers only its T/p tokens. Without SP the replicated dY gives the full gradient.
    """
    def activation(mod):
        return mod.split(".")[0] in ("attn", "mlp") and not mod.endswith(("k_proj", "v_proj"))

    for res in results:
        for p in (2, 4):
            per_block, bias_bytes = {}, 2 * (p - 1) / p * HIDDEN * 8
            for sp in (False, True):
                records = res[p]["sp"][variant][sp][1]
                bias = _bias_reductions(records)
                expected = ([("attn.o_proj", bias_bytes), ("mlp.down_proj", bias_bytes)]
                            if sp and variant == "bias" else [])
                assert bias == expected, (p, sp, bias)
                records = [c for c in records if c[0] != "all_reduce" or (c[2], c[3]) not in bias]
                per_block[sp] = {blk: sum(b for _, _, mod, b in records
                                          if activation(mod) and mod.split(".")[0] == blk)
                                 for blk in ("attn", "mlp")}
                ops = {op for op, _, mod, _ in records if activation(mod)}
                assert ops == ({"all_gather", "reduce_scatter"} if sp else {"all_reduce"})
            assert per_block[True] == per_block[False]
            norm_reductions = [m for op, ph, m, _ in res[p]["sp"][variant][True][1]
                               if m.startswith("n") and op == "all_reduce" and ph == "backward"]
            assert sorted(norm_reductions) == ["n1", "n2", "n2", "nf"]  # n2 is a LayerNorm: weight, bias


def test_replicated_dropout_masks_agree_and_sharded_masks_differ(results):
    for rank, res in enumerate(results):
        for p, cases in res.items():
            d = cases["dropout"]
            assert all(torch.equal(row, d["replicated"][0]) for row in d["replicated"]), (rank, p)
            rows = d["sharded"]
            assert all(not torch.equal(rows[i], rows[j]) for i in range(p) for j in range(i)), (rank, p)
            assert set(rows.unique().tolist()) == {0.0, 2.0}  # kept elements scaled by 1/(1-p)
            assert d["default_stream_kept"] and d["reproducible"] and d["eval_identity"], (rank, p)
