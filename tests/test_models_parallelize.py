"""parallelize on real gloo ranks: every family at tp 1, 2, 3 (where the heads allow) and 4.

One launch of 4 ranks (tests/_models_launch.py, shared with the training and checkpoint
tests) runs every case; sub-groups give tp 1, 2 and 3. Models are tiny float64 Hugging Face models from one seed (models/testing.py):
vocabulary 130 (padded at tp 3 and 4), llama/mistral GQA, qwen2 MQA (KV replication).

Tolerance 1e-12 relative (float64): the sharded model adds the same products in a different
order (row-parallel partial sums, then the all-reduce); each output is a sum of at most
~200 terms through 2 layers, so the reordering error is ~1e-14 relative, while a wrong slice,
head count or missing reduction is O(1).
"""
import math

import pytest

from tests import _models_launch, _models_workers as W

pytestmark = pytest.mark.multirank
TOL = 1e-12
HIDDEN = {"llama": 48, "mistral": 64, "qwen2": 48, "gpt2": 48, "bert": 48}
# (vocab-sized matrices, vocab-sized biases) held once: untied embedding + head = 2, tied = 1.
VOCAB_TENSORS = {"llama": (2, 0), "mistral": (2, 0), "qwen2": (1, 0), "gpt2": (1, 0), "bert": (1, 1)}
KV_REPLICATED = {("llama", 4), ("qwen2", 2), ("qwen2", 3), ("qwen2", 4)}
CASES = [(f, tp) for f in W.FAMILIES for tp in (1, 2, 3, 4) if not (tp == 3 and f in W.TP3_DOES_NOT_FIT)]


@pytest.fixture(scope="module")
def results():
    return _models_launch.results()["inference"]


def _members(results, key):
    return [(r, res[key]) for r, res in enumerate(results) if key in res]


@pytest.mark.parametrize("family, tp", CASES)
def test_outputs_equal_the_unsharded_model(results, family, tp):
    cases = _members(results, (family, tp))
    assert cases, f"no rank ran {family} at tp {tp}"
    for rank, res in cases:
        assert res["logits_rel"] <= TOL, (rank, res["logits_rel"])
        assert res["hidden_rel"] <= TOL, (rank, res["hidden_rel"])


@pytest.mark.parametrize("family, tp", [c for c in CASES if c[0] in W.DECODERS])
def test_greedy_generation_gives_the_unsharded_tokens(results, family, tp):
    for rank, res in _members(results, (family, tp)):
        assert res["tokens_equal"], f"{family} tp {tp} rank {rank}: tokens differ"
        assert res["hf_equal"], "the dense reference generate differs from transformers' generate"
        n_kv = {"llama": 2, "mistral": 4, "qwen2": 1, "gpt2": 12}[family]
        assert res["cache_heads"] == (n_kv // tp if n_kv % tp == 0 else 1)  # this rank's KV heads only
        assert res["cache_len"] == 5 + 8 - 1


@pytest.mark.parametrize("family, tp", CASES)
def test_each_rank_holds_about_one_tp_th_of_the_parameters(results, family, tp):
    cases = _members(results, (family, tp))
    p = cases[0][1]["params"]
    per = math.ceil(W.VOCAB / tp)
    n_mat, n_bias = VOCAB_TENSORS[family]
    padding = (per * tp - W.VOCAB) * (n_mat * HIDDEN[family] + n_bias)
    # Counting each parameter over the ranks holding it: the dense model plus the padding rows.
    group_total = sum(res["params"]["share"] for _, res in cases)
    assert group_total == pytest.approx((p["total"] + padding) * len(cases) / tp)
    for _, res in cases:
        q = res["params"]
        assert q["vocab_rows"] == [per] * len(q["vocab_rows"])  # embedding and head split by vocab
        assert q["vocab_tags"] == [1] * len(q["vocab_tags"])
        if (family, tp) not in KV_REPLICATED:  # all but the replicated tensors split exactly
            assert q["per_rank"] == (q["total"] - q["replicated"] + padding) / tp + q["replicated"]
        assert q["per_rank"] * tp <= 1.5 * q["total"]  # tiny models: replicated norms are ~10%


@pytest.mark.parametrize("family", W.TP3_DOES_NOT_FIT)
def test_tp_that_does_not_fit_raises_and_leaves_the_model_unchanged(results, family):
    cases = _members(results, (family, 3))
    assert len(cases) == 3
    valid = {"llama": "1, 2, 4", "mistral": "1, 2, 4, 8"}[family]
    for _, res in cases:
        assert res["error"] is not None and f"valid tp sizes: {valid}" in res["error"]
        assert "tp_size (3) must divide n_heads" in res["error"]
        assert res["unchanged"]


@pytest.mark.parametrize("family", W.FAMILIES)
def test_one_all_reduce_per_block_forward(results, family):
    for tp in (1, 2, 4):
        for _, res in _members(results, (family, tp)):
            want = [] if tp == 1 else [("all_reduce", "forward")] * 5 + [("all_gather", "forward")]
            assert sorted(res["fwd_ops"]) == sorted(want), (tp, res["fwd_ops"])


@pytest.mark.parametrize("family", W.FAMILIES)
def test_backward_one_all_reduce_per_block_plus_replicated_kv_sync(results, family):
    for tp in (2, 3, 4):
        # 2 layers x (attention, MLP) + output head; replicated KV heads: + k and v per layer
        n = 5 + (4 if (family, tp) in KV_REPLICATED else 0)
        for _, res in _members(results, (family, tp)):
            if "bwd_ops" in res:
                assert res["bwd_ops"] == ["all_reduce"] * n, (tp, res["bwd_ops"])


def test_fixes_are_reported(results):
    notes = _members(results, ("qwen2", 4))[0][1]["notes"]
    assert any("KV-head replication" in n for n in notes)
    assert any("padded to 132" in n for n in notes)
