"""parallelize on real gloo ranks: every family at tp 1, 2, 3 (where the heads allow) and 4.

One launch of 4 ranks (tests/_models_launch.py, shared with the training and checkpoint
tests) runs every case; sub-groups give tp 1, 2 and 3. Models are tiny float64 Hugging Face models from one seed (tensorpar.models.tiny):
vocabulary 130 (padded at tp 3 and 4), llama/mistral GQA, qwen2 MQA (KV replication).

Tolerance 1e-12 relative (float64): the sharded model adds the same products in a different
order (row-parallel partial sums, then the all-reduce); each output is a sum of at most
~200 terms through 2 layers, so the reordering error is ~1e-14 relative, while a wrong slice,
head count or missing reduction is O(1).
"""
import math

import pytest

from tensorpar.models.tiny import make_tiny_config
from tests import _models_launch, _models_workers as W

pytestmark = pytest.mark.multirank
TOL = 1e-12
HIDDEN = {"llama": 48, "mistral": 64, "qwen2": 48, "gpt2": 48, "bert": 48}
# (vocab-sized matrices, vocab-sized biases) held once: untied embedding + head = 2, tied = 1.
VOCAB_TENSORS = {"llama": (2, 0), "mistral": (2, 0), "qwen2": (1, 0), "gpt2": (1, 0), "bert": (1, 1)}
KV_REPLICATED = {("llama", 4), ("qwen2", 2), ("qwen2", 3), ("qwen2", 4)}
CASES = [(f, tp) for f in W.FAMILIES for tp in (1, 2, 3, 4) if not (tp == 3 and f in W.TP3_DOES_NOT_FIT)]


def expected_params_per_rank(config, family: str, tp: int) -> int:
    """Closed form of one rank's parameter count from the config sizes alone (no model, no tags):
    what each tensor of the family's plan should hold at ``tp`` (vocabulary rows padded to
    ``ceil(V/tp)``, query heads ``n_heads/tp``, KV heads ``n_kv/tp`` or 1 replicated head,
    MLP width ``ffn/tp``; norms, position embeddings and biases after a row split whole)."""
    per_vocab = -(-config.vocab_size // tp)
    if family == "gpt2":
        h, n_pos, layers = config.n_embd, config.n_positions, config.n_layer
        layer = (4 * h + 3 * h * h // tp + 3 * h // tp + h * h // tp + h  # ln_1, ln_2, c_attn, c_proj
                 + 4 * h * h // tp + 4 * h // tp + 4 * h * h // tp + h)   # c_fc, mlp.c_proj
        return per_vocab * h + n_pos * h + layers * layer + 2 * h         # wte (tied head), wpe, ln_f
    h, ffn, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    if family == "bert":
        layer = (3 * (h * h // tp + h // tp) + h * h // tp + h + 2 * h    # q, k, v, attn out, LN
                 + h * ffn // tp + ffn // tp + ffn * h // tp + h + 2 * h)  # intermediate, output, LN
        emb = per_vocab * h + config.max_position_embeddings * h + config.type_vocab_size * h + 2 * h
        head = h * h + h + 2 * h + per_vocab  # transform dense + LN; decoder tied, its bias split
        return emb + layers * layer + head
    hd = h // config.num_attention_heads
    q_width = config.num_attention_heads // tp * hd
    n_kv = config.num_key_value_heads
    kv_width = (n_kv // tp if n_kv % tp == 0 else 1) * hd
    qkv_bias = family == "qwen2"
    layer = (h * q_width + 2 * h * kv_width + qkv_bias * (q_width + 2 * kv_width)  # q, k, v
             + q_width * h + 3 * h * ffn // tp + 2 * h)                            # o, MLP, norms
    vocab_mats = 1 if config.tie_word_embeddings else 2
    return vocab_mats * per_vocab * h + layers * layer + h


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


# 2-D weights a correct split leaves whole (tp > 1): position and token-type embeddings, BERT's
# MLM transform, and Qwen2's single KV head (MQA: each rank holds that head whole).
WHOLE_2D = {"llama": [], "mistral": [], "gpt2": ["transformer.wpe.weight"],
            "qwen2": [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in "kv"],
            "bert": ["bert.embeddings.position_embeddings.weight",
                     "bert.embeddings.token_type_embeddings.weight", "cls.predictions.transform.dense.weight"]}


@pytest.mark.parametrize("family, tp", CASES)
def test_per_rank_parameters_match_the_closed_form_from_the_config(results, family, tp):
    """Independent of the tp_replicas tags: counts from the config sizes, and every 2-D weight
    split but the ones listed in WHOLE_2D."""
    config = make_tiny_config(family)
    cases = _members(results, (family, tp))
    assert cases, (family, tp)
    for rank, res in cases:
        assert res["counted"] == expected_params_per_rank(config, family, tp), (rank, res["counted"])
        if tp > 1:
            assert res["whole_2d"] == sorted(WHOLE_2D[family]), (rank, res["whole_2d"])


@pytest.mark.parametrize("name", list(W.VARIANTS))
def test_variants_at_tp_2(results, name):
    """Tied Llama head (one shard shared by embedding and head); vocabulary 131 padded to 132."""
    family, sizes = W.VARIANTS[name]
    config = make_tiny_config(family, **sizes)
    cases = _members(results, (name, 2))
    assert len(cases) == 4  # both tp-2 groups
    for rank, res in cases:
        assert res["logits_rel"] <= TOL and res["hidden_rel"] <= TOL, (rank, res["logits_rel"])
        assert res["tokens_equal"] and res["hf_equal"]
        assert res["params"]["tied"] is True  # llama_tied by config; gpt2 always
        assert res["params"]["vocab_rows"][0] == math.ceil(config.vocab_size / 2)
        assert res["counted"] == expected_params_per_rank(config, family, 2)
        assert res["whole_2d"] == sorted(WHOLE_2D[family])
    if name == "gpt2_v131":
        assert any("padded to 132" in n for n in cases[0][1]["notes"])


def test_frozen_parameters_stay_frozen(results):
    """embed_tokens, k_proj (replicated KV heads at tp 4) and down_proj frozen before the split."""
    for rank, res in enumerate(results):
        want = ["model.embed_tokens.weight"] + [f"model.layers.{i}.{m}.weight" for i in (0, 1)
                                                for m in ("mlp.down_proj", "self_attn.k_proj")]
        assert res["frozen"]["frozen"] == sorted(want), rank
        assert res["frozen"]["trainable"] > 0


def test_a_rank_outside_the_group_is_refused(results):
    errors = [res["outsider"] for res in results[1:]]
    assert all(e is not None and "is not a member of tp_group" in e for e in errors), errors


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
