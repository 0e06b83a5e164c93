"""The planner's prediction equals what tensorpar's runtime does (issue 5, item 4).

On real gloo ranks (one launch at tp 2, one at tp 4; each loops over the families and
workloads inside the worker), every tiny float64 Hugging Face model of tensorpar.models.tiny
(vocabulary 130: padded to 132 at tp 4; llama GQA 4/2 heads and qwen2 MQA 12/1 replicate KV
heads at tp 4 and 2) runs each workload under ``tensorpar.distributed.ledger``. For each rank, the
records must equal ``tensorpar.planner.predict_collectives`` for the same ``config.to_dict()``:
the same multiset of (op, phase, where, payload bytes, bytes sent), hence the same count per
(op, phase), the same bytes per layer and per step; and the parameter bytes each rank holds
must equal ``param_bytes_per_rank``. All of these are integer byte counts: exact equality.

``decode`` is one step of ``tensorpar.models.generate``: the records of generate(n=3) minus
those of generate(n=1) are two decode steps.
"""
import os
import re
from collections import Counter

import pytest
import torch

from tensorpar import distributed as dist
from tensorpar.architecture import registry
from tensorpar.distributed.ledger import ring_bytes_sent as ledger_ring_bytes_sent
from tensorpar.planner import collectives as C
from tensorpar.planner import predict_collectives

FAMILIES = registry.formula_types("llama", "gpt", "bert")  # every type the closed forms count
CAUSAL = registry.formula_types("llama", "gpt")
BATCH, SEQ, E = 2, 5, 8  # float64 models
NEW_TOKENS = 3


# ---- the worker (module level: spawned ranks import it) -------------------------------------

def _records(led) -> list:
    return [(r.op, r.phase, r.module, r.payload_bytes, r.bytes_sent) for r in led.records]


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _run_family(family: str, ids: torch.Tensor, group) -> dict:
    from tensorpar.apply import parallelize
    from tensorpar.models.generation import generate
    from tensorpar.models.tiny import make_tiny_model
    from tensorpar.models.training import causal_lm_loss

    out = {}
    bare = parallelize(make_tiny_model(family, head=False))
    with dist.ledger(model=bare) as led, torch.no_grad():
        bare(input_ids=ids)
    out["forward"] = {"records": _records(led), "param_bytes": _param_bytes(bare)}
    model = parallelize(make_tiny_model(family))
    with dist.ledger(model=model) as led, torch.no_grad():
        model(input_ids=ids)
    out["logits"] = {"records": _records(led), "param_bytes": _param_bytes(model)}
    if family not in CAUSAL:
        return out
    with dist.ledger(model=model) as led:
        causal_lm_loss(model, ids).backward()
    out["train"] = {"records": _records(led), "param_bytes": _param_bytes(model)}
    with dist.ledger(model=model) as led:
        generate(model, ids, 1)
    out["generate1_world"] = {"records": _records(led), "param_bytes": _param_bytes(model)}
    on_group = parallelize(make_tiny_model(family), tp_group=group)
    for n in (1, NEW_TOKENS):
        with dist.ledger(model=on_group) as led:
            generate(on_group, ids, n)
        out[f"generate{n}"] = {"records": _records(led), "param_bytes": _param_bytes(on_group)}
    return out


def agreement_worker() -> dict:
    """{(family, workload): {"records": [...], "param_bytes": int}} on this rank.

    Models are parallelized over the default (world) group, as ``tensorpar run`` does; the
    generate runs also use an explicit group of every rank (see test_generate_on_the_world_group).
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    ids = torch.randint(2, 130, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    group = dist.new_group(list(range(dist.get_world_size())))
    return {(f, w): v for f in FAMILIES for w, v in _run_family(f, ids, group).items()}


# ---- module names -> the planner's "where" (only the tests and tensorpar.models know names) ---

_WHERE = [
    (r"(embed_tokens|wte|word_embeddings)$", "embedding"),
    (r"\.self_attn\.(k_proj|v_proj)$", "layer.attention.kv_replicas"),
    (r"\.attn\.c_attn\.(weight|bias)$", "layer.attention.kv_replicas"),  # GPT-BigCode's fused q/k/v: its KV rows
    (r"\.self_attn\.(q_norm|k_norm)$", "layer.attention.qk_norm"),
    (r"\.(self_attn|attn|attention)(\.|$)", "layer.attention"),
    (r"\.(mlp|intermediate|output)(\.|$)", "layer.mlp"),
    (r"(lm_head|cls\.predictions\.decoder)$", "lm_head"),
]
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|layer)\.(\d+)\.")


def _where(op: str, module: str) -> str:
    if module in ("", "next_token"):  # issued outside the model: the loss's reductions, generate's exchange
        return {"all_reduce": "cross_entropy", "all_gather": "next_token"}[op]
    for pattern, where in _WHERE:
        if re.search(pattern, module):
            return where
    raise AssertionError(f"the planner has no item for a collective issued by {module!r} ({op})")


def _measured(records) -> Counter:
    return Counter((op, phase, _where(op, mod), n, sent) for op, phase, mod, n, sent in records)


def _predicted(items, rank: int) -> Counter:
    return Counter({(i.op, i.phase, i.where, i.payload_bytes, i.bytes_sent_per_rank[rank]): i.count
                    for i in items})


def _by_op_phase(counter: Counter) -> Counter:
    out = Counter()
    for (op, phase, *_), c in counter.items():
        out[(op, phase)] += c
    return out


def _bytes(counter: Counter) -> int:
    return sum(key[-1] * c for key, c in counter.items())


def _config(family: str) -> dict:
    from tensorpar.models.tiny import make_tiny_config
    return make_tiny_config(family).to_dict()


# ---- the launches -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def measured():
    return {tp: dist.launch(agreement_worker, tp, deadline=240) for tp in (2, 4)}


CASES = [(tp, f, w) for tp in (2, 4) for f in FAMILIES
         for w in (("forward", "logits") if f not in CAUSAL else ("forward", "logits", "train", "generate"))]


def _runs(measured, tp, family, workload):
    """(rank, records, param_bytes, prediction) of every rank."""
    key = "generate3" if workload == "generate" else workload
    cfg = _config(family)
    pred = predict_collectives(cfg, tp, BATCH, SEQ, E, workload, new_tokens=NEW_TOKENS)
    return [(r, res[(family, key)]["records"], res[(family, key)]["param_bytes"], pred)
            for r, res in enumerate(measured[tp])]


@pytest.mark.multirank
@pytest.mark.parametrize("tp, family, workload", CASES)
def test_every_collective_as_predicted(measured, tp, family, workload):
    for rank, records, _, pred in _runs(measured, tp, family, workload):
        got, want = _measured(records), _predicted(pred.items, rank)
        assert _by_op_phase(got) == _by_op_phase(want), (rank, got, want)
        assert got == want, (rank, got - want, want - got)
        assert _bytes(got) == pred.bytes_sent_per_rank[rank] == sum(r[-1] for r in records)


@pytest.mark.multirank
@pytest.mark.parametrize("tp, family, workload", CASES)
def test_every_layer_as_predicted(measured, tp, family, workload):
    for rank, records, _, pred in _runs(measured, tp, family, workload):
        layers = {}
        for rec in records:
            m = _LAYER.search(rec[2])
            if m:
                layers.setdefault(int(m.group(1)), []).append(rec)
        assert sorted(layers) == list(range(pred.layers))
        want = _predicted(pred.per_layer, rank)
        for index, recs in layers.items():
            got = _measured(recs)
            assert got == want, (rank, index, got - want, want - got)
            assert _bytes(got) == pred.per_layer_bytes_sent_per_rank[rank]


@pytest.mark.multirank
@pytest.mark.parametrize("tp, family", [(tp, f) for tp in (2, 4) for f in CAUSAL])
def test_a_decode_step_as_predicted(measured, tp, family):
    pred = predict_collectives(_config(family), tp, BATCH, SEQ, E, "decode")
    for rank, res in enumerate(measured[tp]):
        two_steps = _measured(res[(family, "generate3")]["records"]) - _measured(res[(family, "generate1")]["records"])
        want = Counter({k: 2 * c for k, c in _predicted(pred.items, rank).items()})
        assert two_steps == want, (rank, two_steps, want)
        assert _bytes(two_steps) == 2 * pred.bytes_sent_per_rank[rank]


@pytest.mark.multirank
@pytest.mark.parametrize("tp, family", [(tp, f) for tp in (2, 4) for f in CAUSAL])
def test_generate_on_the_world_group_as_predicted(measured, tp, family):
    pred = predict_collectives(_config(family), tp, BATCH, SEQ, E, "generate", new_tokens=1)
    for rank, res in enumerate(measured[tp]):
        assert _measured(res[(family, "generate1_world")]["records"]) == _predicted(pred.items, rank)


@pytest.mark.multirank
@pytest.mark.parametrize("tp, family, workload", [c for c in CASES if c[2] in ("forward", "logits")])
def test_parameter_bytes_per_rank_as_predicted(measured, tp, family, workload):
    for rank, _, param_bytes, pred in _runs(measured, tp, family, workload):
        assert param_bytes == pred.param_bytes_per_rank, (rank, param_bytes, pred.param_bytes_per_rank)


# ---- without ranks --------------------------------------------------------------------------------

def test_planner_bytes_equal_the_ledger_formula_bit_for_bit():
    """Non-integer ring figures (tp 3, 5, 6, 7) too: the planner mirrors the ledger's float expression."""
    for p in range(1, 9):
        for n in (8, 64, 1000, 3840, 123_456_789):
            for op in ("all_reduce", "all_gather", "reduce_scatter"):
                assert C.ring_bytes_sent(op, n, p) == ledger_ring_bytes_sent(op, n, p)


def test_broadcast_bytes_per_rank_by_algorithm():
    """Hand counts: the chain's last rank and the tree's leaves send nothing; every rank but the
    source receives N once, so the group sends (p - 1) N whatever the algorithm."""
    n = 16
    tree = {1: [0], 2: [1, 0], 3: [2, 0, 0], 4: [2, 1, 0, 0], 8: [3, 2, 1, 1, 0, 0, 0, 0]}
    for p, sends in tree.items():
        assert [C.broadcast_bytes_sent(n, p, r, 0, "tree") for r in range(p)] == [k * n for k in sends]
    assert [C.broadcast_bytes_sent(n, 4, r, 1, "tree") for r in range(4)] == [0, 2 * n, n, 0]
    assert [C.broadcast_bytes_sent(n, 4, r, 1, "chain") for r in range(4)] == [0, n, n, n]
    for p in range(1, 9):
        for algorithm in ("chain", "tree"):
            assert sum(C.broadcast_bytes_sent(n, p, r, p // 2, algorithm) for r in range(p)) == (p - 1) * n


def test_tp_one_predicts_nothing_and_the_dense_parameter_count():
    from tensorpar.models.tiny import make_tiny_model
    for family in FAMILIES:
        for workload in ("forward", "logits"):
            pred = predict_collectives(_config(family), 1, BATCH, SEQ, E, workload)
            dense = make_tiny_model(family, head=workload == "logits")
            assert pred.items == [] and pred.bytes_sent_per_rank == [0]
            assert pred.params_per_rank == pred.params_total == sum(p.numel() for p in dense.parameters())


@pytest.mark.parametrize("kwargs, message", [
    (dict(workload="prefill"), "workload ('prefill') must be one of"),
    (dict(tp=3, family="llama"), "tp (3) must divide heads (4); valid tp sizes: 1, 2, 4"),
    (dict(family="bert", workload="train"), "valid workloads: forward, logits"),
    (dict(bytes_per_elem=3), "bytes_per_elem (3) must be one of"),
    (dict(seq=1, workload="train"), "seq (1) must be at least 2"),
    (dict(batch=0), "batch (0) must be a positive integer"),
    (dict(candidates=0, workload="generate"), "candidates (0) must be a positive integer"),
    (dict(backend="mpi"), "backend ('mpi') must be one of: gloo, nccl"),
])
def test_bad_input_names_the_value_and_the_choices(kwargs, message):
    args = dict(family="llama", tp=2, batch=BATCH, seq=SEQ, bytes_per_elem=E, workload="forward") | kwargs
    cfg = _config(args.pop("family"))
    with pytest.raises(ValueError, match=re.escape(message)):
        predict_collectives(cfg, **args)


def test_unsupported_configs_are_refused_not_guessed():
    with pytest.raises(ValueError, match="model_type 't5' is not counted by the planner's closed forms"):
        predict_collectives({"model_type": "t5"}, 2, 1, 4, 4)
    with pytest.raises(ValueError, match="llama with mlp_bias=True in the config is not modelled"):
        predict_collectives(_config("llama") | {"mlp_bias": True}, 2, 1, 4, 4)
    with pytest.raises(ValueError, match="bert with add_cross_attention=True in the config is not modelled"):
        predict_collectives(_config("bert") | {"add_cross_attention": True}, 2, 1, 4, 4)
    with pytest.raises(ValueError, match=r"hf_config must be a dict \(config.to_dict\(\)\)"):
        predict_collectives("llama", 2, 1, 4, 4)


_TINY_LLAMA = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=50, max_position_embeddings=64)
_TINY_GPT = dict(n_embd=32, n_head=4, n_layer=2, n_positions=16, vocab_size=50)
HF_SHAPES = [  # every model type the planner reads from a config.json, and the options that change counts
    ("llama", _TINY_LLAMA), ("llama", _TINY_LLAMA | {"tie_word_embeddings": True}),
    ("mistral", _TINY_LLAMA | {"sliding_window": 8}), ("qwen2", _TINY_LLAMA),
    ("qwen3", _TINY_LLAMA | {"head_dim": 16}), ("gpt2", _TINY_GPT), ("gpt2", _TINY_GPT | {"n_inner": 40}),
    ("gpt_bigcode", _TINY_GPT | {"multi_query": True}), ("gpt_bigcode", _TINY_GPT | {"multi_query": False}),
]


@pytest.mark.parametrize("kind, fields", HF_SHAPES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(HF_SHAPES)])
def test_count_params_equals_the_transformers_modules(kind, fields):
    """``count_params`` of ``from_hf_dict(config.to_dict())`` equals the parameters of the
    ``*ForCausalLM`` transformers builds from the same config (tied tensors once), exactly."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tensorpar.planner import count_params, from_hf_dict

    config = AutoConfig.for_model(kind, **fields)
    with torch.device("meta"):  # shapes only, no memory
        model = AutoModelForCausalLM.from_config(config)
    assert count_params(from_hf_dict(config.to_dict())) == sum(p.numel() for p in model.parameters())
