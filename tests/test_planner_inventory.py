"""The inventory of any architecture, without ranks: what it counts and how the planner uses it.

- the parameter count equals the real model's, for every architecture of the rank tests and more;
- linear and attention-core FLOPs equal ``FlopCounterMode`` on the dense tiny model (eager
  attention: the core is its two batched matmuls);
- for the five families of the formula path, the prediction from the inventory equals
  ``tensorpar.planner.predict_collectives`` collective for collective;
- the planning group answers its size and rank and refuses collectives; a model tensorpar cannot
  plan is refused with the reason; ``plan`` of a ``MetaSource`` and ``tensorpar plan --model DIR``.
"""
from __future__ import annotations

import functools
import json
from collections import Counter

import pytest
import torch

from tensorpar.architecture.split_model import ModelInventory
from tensorpar.planner import Layout, get_hardware, plan, predict_collectives, predict_from_inventory
from tensorpar.sharding.inventory import MetaSource, build_inventory
from tests._planner_inventory_workers import ARCHS, tiny_config, tiny_model

MORE = ("mistral", "qwen2", "qwen3_moe", "olmoe", "gpt_oss", "gemma2", "stablelm", "mpt", "persimmon",
        "gpt_neox", "starcoder2", "granitemoe")
B, S = 2, 5


@pytest.mark.parametrize("arch", ARCHS + MORE)
def test_parameter_count_equals_the_model(arch):
    """Tied tensors once (GPT-2, Qwen2's tied head), every expert, every norm and bias."""
    model = tiny_model(arch)
    inv = build_inventory(model.config, 2)
    assert inv.params_total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_matmul_and_attention_flops_equal_the_flop_counter(arch):
    """Linear layers (mm, addmm: ``2 in out`` per token, experts ``top_k`` of ``n_experts``) and,
    with eager attention, the core's batched matmuls (``2 c h (d_qk + d_v)`` per token, c = S keys:
    the counter counts masked pairs too)."""
    from torch.utils.flop_counter import FlopCounterMode
    model = tiny_model(arch)
    model.set_attn_implementation("eager")
    inv = build_inventory(model.config, 1)
    ids = torch.randint(3, 130, (B, S), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=ids)
    ops = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    assert ops.get("aten.mm", 0) + ops.get("aten.addmm", 0) == B * S * inv.matmul_flops_per_token()
    assert ops.get("aten.bmm", 0) + ops.get("aten.baddbmm", 0) == B * S * inv.attention_flops_per_token(S)


# ---- the five families: the same prediction as the formulas -------------------------------------------

FAMILY_CASES = [(f, tp, w, e) for f in ("llama", "mistral", "qwen2", "gpt2", "bert") for tp in (1, 2, 4)
                for w in (("forward", "logits") if f == "bert" else ("forward", "logits", "train", "decode", "generate"))
                for e in (8, 2)]


@functools.lru_cache(maxsize=None)
def _inventory(family, tp, head):
    from tensorpar.models.tiny import make_tiny_config
    return build_inventory(make_tiny_config(family), tp, head=head)


def _flat(pred) -> Counter:
    out = Counter()
    for i in pred.items:
        out[(i.op, i.phase, i.payload_bytes, i.bytes_sent_per_rank)] += i.count
    return out


@pytest.mark.parametrize("family, tp, workload, e", FAMILY_CASES)
def test_the_five_families_predict_as_the_formulas(family, tp, workload, e):
    """The same collectives (op, phase, payload, bytes per rank, count; ``where`` names differ: the
    formulas' parts, the inventory's modules), totals, per-layer totals and parameters."""
    from tensorpar.models.tiny import make_tiny_config
    cfg = make_tiny_config(family)
    old = predict_collectives(cfg.to_dict(), tp, B, S, e, workload, new_tokens=3)
    new = predict_from_inventory(_inventory(family, tp, workload != "forward"), B, S, e, workload, new_tokens=3)
    assert _flat(new) == _flat(old)
    assert new.bytes_sent_per_rank == old.bytes_sent_per_rank
    assert new.per_layer_bytes_sent_per_rank == old.per_layer_bytes_sent_per_rank
    assert (new.params_total, new.params_per_rank, new.param_bytes_per_rank, new.layers) == (
        old.params_total, old.params_per_rank, old.param_bytes_per_rank, old.layers)


@pytest.mark.parametrize("family, tp", [("llama", 2), ("gpt2", 4)])
def test_sampling_candidates_predict_as_the_formulas(family, tp):
    """top_k sampling: each rank offers its k best (value, index) pairs per row and step, at most
    its vocabulary shard ceil(V / tp) (130 tokens: 65 at tp 2, 33 at tp 4, padding included)."""
    from tensorpar.models.tiny import make_tiny_config
    cfg = make_tiny_config(family)
    for k in (1, 5, 1000):
        old = predict_collectives(cfg.to_dict(), tp, B, S, 4, "generate", new_tokens=3, candidates=k)
        new = predict_from_inventory(_inventory(family, tp, True), B, S, 4, "generate", new_tokens=3, candidates=k)
        assert _flat(new) == _flat(old) and new.bytes_sent_per_rank == old.bytes_sent_per_rank
        (exchange,) = [i for i in new.items if i.where == "next_token"]
        assert exchange.payload_bytes == B * tp * min(k, -(-cfg.vocab_size // tp)) * 16 and exchange.count == 3


# ---- the inventory as data ----------------------------------------------------------------------------

def test_inventory_round_trips_through_json():
    inv = build_inventory(tiny_config("qwen2_moe"), 4)
    back = ModelInventory.from_dict(json.loads(json.dumps(inv.to_dict())))
    assert back == inv and back.params_per_rank() == inv.params_per_rank()


def test_shards_say_what_each_rank_holds():
    """GPT-2's tied, padded vocabulary; a column split's pieces; a replicated norm."""
    inv = build_inventory(tiny_config("gpt2"), 4)
    by = {p.name: p for p in inv.params}
    wte = by["transformer.wte.weight"]
    assert wte.tied == ("lm_head.weight",) and wte.style == "vocab"
    assert [r.shape for r in wte.ranks] == [(33, 48)] * 4 and [r.pieces for r in wte.ranks][-1] == ((99, 130),)
    c_fc = by["transformer.h.0.mlp.c_fc.weight"]
    assert c_fc.style == "conv1d_colwise" and c_fc.ranks[1].pieces == ((48, 96),) and c_fc.ranks[1].transpose
    ln = by["transformer.h.0.ln_1.weight"]
    assert ln.style == "replicate" and all(r.replicas == 4 and r.pieces is None for r in ln.ranks)


def test_planning_group_answers_and_refuses_collectives():
    from tensorpar import distributed as dist
    from tensorpar.distributed import PlanningGroup, PlanningGroupError
    g = PlanningGroup(4, 3)
    assert (dist.get_world_size(g), dist.get_rank(g)) == (4, 3)
    with pytest.raises(PlanningGroupError, match=r"all_reduce on PlanningGroup\(size=4, rank=3\): a planning stand-in"):
        dist.all_reduce(torch.ones(2), g)
    with dist.ledger(), pytest.raises(PlanningGroupError):
        dist.all_gather(torch.ones(2), 0, g)
    for call in (lambda: dist.reduce_scatter(torch.ones(4), 0, g), lambda: dist.broadcast(torch.ones(2), 0, g),
                 lambda: dist.broadcast_object("x", 0, g), lambda: dist.barrier(g)):
        with pytest.raises(PlanningGroupError):
            call()
    for size, rank in ((0, 0), (2, 2), (2, -1), (True, 0)):
        with pytest.raises(ValueError, match="PlanningGroup"):
            PlanningGroup(size, rank)


@pytest.mark.parametrize("arch, message", [
    ("llama", r"tp_size \(3\) does not fit this llama model: .*valid tp sizes: 1, 2, 4"),
    ("no_such_model", "model_type 'no_such_model' is not known to transformers"),
    ("reformer", r"cannot build a reformer model from this config on the meta device \(AssertionError: If you "
                 r"want to use `ReformerModelWithLMHead` make sure that `is_decoder=True`"),
])
def test_models_tensorpar_cannot_split_are_refused_with_the_reason(arch, message):
    from tensorpar.models.tiny import make_tiny_config
    config = {"model_type": arch} if arch == "no_such_model" else make_tiny_config(arch)
    with pytest.raises(ValueError, match=message):
        build_inventory(config, 3)


# ---- plan() of a config and the CLI ----------------------------------------------------------------

def test_plan_of_a_config_counts_from_its_split():
    """``plan`` reads a config's split as the runtime makes it: parameters per rank, weights and
    mixed-precision Adam (bf16: 2 + 2 + 12 bytes a parameter) of the busiest rank, the KV cache of
    its windows (8 keys: 7 cached tokens a layer, not 64), activations counted (not left out),
    and a decode step's collectives, each rank's best candidate exchanged."""
    inv = build_inventory(tiny_config("mixtral"), 2)
    src, hw = MetaSource(tiny_config("mixtral")), get_hardware("h100-sxm")
    rep = plan(src, Layout(tp=2, micro_batch=2, workload="inference"), hw, seq=64)
    assert rep.params == inv.params_total and rep.params_per_rank == inv.params_per_rank()
    mem = rep.memory_per_device
    assert mem["weights"] == max(inv.params_per_rank()) * 2 and mem["activations"] > 0
    # 2 sequences x 2 layers x 7 tokens x one KV head per rank (K and V, 16 each) x 2 bytes
    assert mem["kv_cache"] == 2 * inv.kv_cache_elems(64, 0) * 2 == 2 * (2 * 7 * 2 * 16) * 2
    assert rep.kv_cache_bytes_per_token["per_device"] == max(inv.kv_elems_per_token(r) for r in range(2)) * 2
    assert "next_token" in {i["where"] for i in rep.comm["decode_per_token"]}
    train = plan(src, Layout(tp=2, micro_batch=2, workload="train"), hw, seq=64)
    assert train.memory_per_device["optimizer"] == 12 * max(inv.params_per_rank())
    assert train.memory_per_device["gradients"] == 2 * max(inv.params_per_rank())
    assert rep.model["model_type"] == "mixtral" and rep.model["n_experts"] == 4
    json.dumps(train.to_dict(), allow_nan=False)


def _cli(capsys, *argv):
    from tensorpar.cli import main
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_plans_a_checkpoint_directory_of_any_architecture(capsys, tmp_path):
    tiny_config("qwen2_moe").save_pretrained(tmp_path)
    rc, out, err = _cli(capsys, "--model", str(tmp_path), "--tp", "2", "--pp", "2", "--seq", "32", "--json")
    assert rc == 0, err
    d = json.loads(out)
    inv = build_inventory(tmp_path, 2)
    assert d["params"] == inv.params_total and d["params_per_rank"] == inv.params_per_rank()
    assert d["model"]["model_type"] == "qwen2_moe" and len(d["params_per_stage"]) == 2
    assert any(i["op"] == "send" and i["group"] == "pp" for i in d["comm"]["per_step"])
    rc, out, _ = _cli(capsys, "--model", str(tmp_path / "config.json"), "--tp", "2", "--workload", "inference")
    words = " ".join(out.split())
    assert rc == 0 and "decode per token" in words and "model.layers.*.mlp.gate " not in words


@pytest.mark.parametrize("arch, argv, needle", [
    ("reformer", ["--tp", "2"], "cannot build a reformer model from this config"),
    ("falcon", ["--tp", "2", "--layers", "4"], "--layers: shape options describe a preset or --family model"),
])
def test_cli_refusals_are_one_line(capsys, tmp_path, arch, argv, needle):
    from tensorpar.models.tiny import make_tiny_config
    make_tiny_config(arch).save_pretrained(tmp_path)
    rc, out, err = _cli(capsys, "--model", str(tmp_path), *argv)
    assert rc == 2 and out == "" and needle in err and err.count("\n") == 1
