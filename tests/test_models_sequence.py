"""Sequence parallelism on Hugging Face models (``parallelize(..., sequence_parallel=True)``), on 4
real ranks: the split model against the dense one built from the same seed (output and every
parameter's gradient, float64), the collectives it issues against the planner's, the activation
memory it saves, and what it refuses."""
import functools
import math

import pytest
import torch

from tensorpar import distributed as dist
from tests import _sequence_workers as W

# float64. Sequence parallelism adds the same terms as the tensor-parallel split, in other orders
# (a reduce-scatter instead of an all-reduce, norm gradients summed per chunk then over ranks):
# ~1e-16 relative per operation, ~1e-15 after a few layers. Llama's and Qwen's RMSNorm compute in
# float32 whatever the model's dtype, but per token, the same in both runs; their weight gradients
# are summed in float64. 1e-10 sits far above that and far below a fault: a norm gradient left
# partial is off by ~5e-1, a chunk in the wrong place by O(1).
TOL = 1e-10


@functools.lru_cache(maxsize=None)
def exact() -> list:
    return dist.launch(W.exact_worker, 4, (4, 2), deadline=600)


@pytest.mark.parametrize("tp", (4, 2))
@pytest.mark.parametrize("arch", W.ARCHS)
def test_sequence_parallel_split_equals_the_dense_model(arch, tp):
    for res in exact():
        err, where, flag = res[(arch, tp)]
        assert flag is True
        assert err <= TOL, (arch, tp, where, err)


@functools.lru_cache(maxsize=None)
def ledger() -> list:
    return dist.launch(W.ledger_worker, 4, deadline=300)


def test_each_block_gathers_and_reduce_scatters_as_the_planner_counts():
    """Per layer: the ledger's collectives (op, phase, payload) equal the planner's for tp 4 with
    sequence parallelism (Korthikanti et al. 2022): an all-gather into and a reduce-scatter out of
    attention and MLP, their conjugates in backward, and the two norms' gradients all-reduced; no
    all-reduce of activations inside a block."""
    from collections import Counter

    from tensorpar.models.tiny import make_tiny_config
    from tensorpar.planner.comm import tp_layer_collectives
    from tensorpar.planner.hfconfig import from_hf_dict
    from tensorpar.planner.layout import Layout

    spec = from_hf_dict(make_tiny_config("llama").to_dict(), seq=W.SEQ)
    layout = Layout(tp=4, sequence_parallel=True, micro_batch=W.BATCH, dtype="fp64", workload="train")
    want = Counter()
    for it in tp_layer_collectives(spec, layout):
        want[(it.op, it.phase, int(it.payload_bytes))] += it.count
    for records in ledger():
        for layer in range(spec.layers):
            prefix = f"model.layers.{layer}."
            got = Counter((op, phase, payload) for op, module, phase, payload, _ in records
                          if module and module.startswith(prefix))
            assert got == want, (layer, got, want)
        # outside the blocks' insides: the embedding's all-reduce (its output stays whole: a
        # Hugging Face model takes positions and masks from its length), the chunks joined after
        # the last block, the logits gathered and the LM head's dX all-reduced; in backward, the
        # first block's input gradient joined from its chunks
        n = W.BATCH * W.SEQ * spec.hidden * 8
        logits = W.BATCH * W.SEQ * 132 * 8  # vocabulary 130 padded to 4 x 33
        outside = sorted((op, module, phase, payload) for op, module, phase, payload, _ in records
                         if not any(module.startswith(f"model.layers.{i}.") for i in range(spec.layers)))
        assert outside == sorted([("all_reduce", "model.embed_tokens", "forward", n), ("all_gather", "model", "forward", n),
                                  ("all_gather", "lm_head", "forward", logits), ("all_reduce", "lm_head", "backward", n),
                                  ("all_gather", "model.layers.0", "backward", n)]), outside


@functools.lru_cache(maxsize=None)
def memory() -> list:
    return dist.launch(W.memory_worker, 4, deadline=300)


def test_norms_keep_a_quarter_of_their_activations_at_tp4():
    """What the norms save for backward (their inputs, float32 copies, 1/rms) is per token: on a
    chunk of the sequence it is exactly 1/tp of the whole; the regions (which run on the gathered
    sequence) keep the same as without sequence parallelism."""
    for per in memory():
        norms = {sp: sum(b for m, b in per[sp].items() if m.endswith("layernorm")) for sp in (False, True)}
        assert norms[False] > 0 and norms[True] * 4 == norms[False], norms
        for region in ("self_attn", "mlp"):
            inside = {sp: sum(b for m, b in per[sp].items() if f".{region}" in m) for sp in (False, True)}
            assert inside[True] == inside[False], (region, inside)
        total = {sp: sum(per[sp].values()) for sp in (False, True)}
        assert total[True] < total[False], total


@functools.lru_cache(maxsize=None)
def refusals() -> dict:
    return dist.launch(W.refusal_worker, 4, deadline=300)[0]


def test_mixture_of_experts_is_refused_before_anything_changes():
    message, touched = refusals()["moe"]
    assert "supports blocks whose tensor-parallel regions are attention and mlp" in message
    assert "moe regions" in message and not touched


def test_cross_attention_is_refused_before_anything_changes():
    message, touched = refusals()["cross"]
    assert "has cross-attention: use sequence_parallel=False" in message and not touched


def test_tp_1_and_a_sequence_that_does_not_divide_are_refused():
    assert "tp is 1: use tp >= 2 or sequence_parallel=False" in refusals()["tp1"]
    assert "splits the sequence (7 tokens) over tp=4 ranks" in refusals()["seq7"]


def test_hidden_states_between_chunked_blocks_are_refused():
    assert "output_hidden_states=True needs a model parallelized without sequence_parallel" in refusals()["hidden_states"]


def test_example_inputs_reach_tp_tokens_when_the_default_is_shorter():
    """At tp 16 the proof's 12 default tokens are repeated up to 16 (the model takes 64)."""
    from tensorpar.models.tiny import make_tiny_model
    from tensorpar.sharding import sequence
    model = make_tiny_model("llama")
    assert sequence.example(model, None, 16)["input_ids"].shape == (2, 16)
    assert sequence.example(model, None, 5)["input_ids"].shape == (2, 10)


def test_a_wrong_sequence_parallel_split_is_caught_by_the_proof_and_undone():
    """Norm gradients left partial (the fault a forward-only check misses): parallelize raises and
    the model is as it was: no report, dense modules, no hooks."""
    message, has_report, down, hooks = refusals()["wrong"]
    assert "sequence_parallel=True does not compute LlamaForCausalLM's function" in message
    assert "layernorm.weight" in message
    assert not has_report and down == "Linear" and hooks == 0


def test_sequence_parallel_must_be_a_bool():
    from tensorpar.apply import parallelize
    from tensorpar.models.tiny import make_tiny_model
    with pytest.raises(ValueError, match="sequence_parallel must be True or False, got 'yes'"):
        parallelize(make_tiny_model("llama"), sequence_parallel="yes")


@functools.lru_cache(maxsize=None)
def dropout() -> list:
    return dist.launch(W.dropout_worker, 4, deadline=600)


def test_dropout_on_sharded_activations_draws_its_own_masks_on_each_rank():
    """GPT-2 with dropout at tp 4, every rank's generator seeded alike. Each rank's heads (and,
    with sequence parallelism, its chunk of the residual stream) get masks of their own, drawn
    from a per-rank generator state (tensorpar.nn.regions.RngFork): with the shared generator
    all four would repeat one pattern. What every rank holds alike, the residual stream without
    sequence parallelism, gets the same masks on every rank, and the default generator stays in
    step across ranks."""
    by_sp = {sp: [r[(4, sp)] for r in dropout()] for sp in (False, True)}
    for sp, ranks in by_sp.items():
        assert all(r["forked"] for r in ranks)
        attn = {_mask_digest(r["draws"][1]) for r in ranks}  # layer 0's attention probabilities
        assert len(attn) == 4, "attention masks repeat across ranks' heads"
        assert len({r["rng"] for r in ranks}) == 1, "the default generators went out of step"
    assert len({r["last"] for r in by_sp[False]}) == 1, "the replicated residual stream differs across ranks"
    resid = {_mask_digest(r["draws"][2]) for r in by_sp[True]}  # layer 0's attention branch, on a chunk
    assert len(resid) == 4, "residual masks repeat across sequence chunks"


def _mask_digest(draw) -> bytes:
    return draw[1].numpy().tobytes()


def _agreement(a, b):
    """Fraction of positions where two draws keep alike, over their common flat prefix where both
    inputs are nonzero (a zero input, e.g. a causally masked probability, shows no mask), and how
    many positions that is."""
    n = min(a[0].numel(), b[0].numel())
    valid = a[0][:n] & b[0][:n]
    count = int(valid.sum())
    return (int((a[1][:n] == b[1][:n])[valid].sum()) / count if count else 0.0), count


def _repeats(a, b) -> bool:
    """Whether draw ``b`` repeats draw ``a`` (at p = 0.5). Two draws from one generator state keep
    the same elements along their common prefix (CPU dropout draws element by element, whatever
    the shape): agreement 1. Independent masks agree on each position with probability 1/2: over
    n >= 64 positions, above 1/2 + 6 sigma (sigma = 1/(2 sqrt(n))) with probability below 1e-9."""
    share, n = _agreement(a, b)
    assert n >= 64, n  # enough positions to tell
    return share > 0.5 + 3 / math.sqrt(n)


def test_dropout_masks_never_repeat_between_regions_steps_or_ranks():
    """GPT-2 with dropout everywhere at tp 4 and tp 2, with and without sequence parallelism, two
    training steps: among all the masks every rank of a group draws (the embeddings', each layer's
    attention probabilities and both residual branches', per step), none repeats another (two
    layers' attention, attention and the MLP's branch, a sharded region and the replicated
    stream, one step and the next), except the replicated ones, which every rank draws alike by
    design. Under sequence parallelism the residual branches act on each rank's chunk of the
    sequence: drawn from the rank's own generator, they differ between ranks too. The seed that
    made the tracker also seeds the default generator, so a tracker not offset from it would
    repeat the replicated masks. Pairs compared: a few thousand; the chance of a false alarm
    below 1e-5 in all."""
    results = dropout()
    for key in results[0]:
        tp, sp = key
        for first in range(0, 4, tp):
            group = [(r, i, d) for r in range(first, first + tp) for i, d in enumerate(results[r][key]["draws"])]
            per_step = len(results[first][key]["draws"]) // 2
            assert per_step == 7, per_step  # embeddings, then per layer: attention, its branch, the MLP's
            for x, (ra, ia, a) in enumerate(group):
                for rb, ib, b in group[x + 1:]:
                    # what every rank holds whole: the embeddings' output, and without sequence
                    # parallelism the residual branches (attention probabilities are per head)
                    replicated = ia % per_step == 0 or (not sp and a[2] == 3)
                    if ia == ib and replicated:
                        assert torch.equal(a[1], b[1]), (key, ra, rb, ia, "replicated masks differ")
                    else:
                        assert not _repeats(a, b), (key, (ra, ia), (rb, ib), _agreement(a, b))
