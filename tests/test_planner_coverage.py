"""`tensorpar plan --search` on the full-size default config of the architectures ``parallelize``
splits (issue 21, "Done when"): a ranked list of feasible (tp, pp, dp) layouts of 16 A100-80GB,
with memory per device and the bytes each device sends per step, through the one planning path
(the config split as the runtime splits it, on the meta device, at every tp the search tries).

``make test`` runs :data:`SAMPLE` (dense, mixture-of-experts, sliding-window, state-space,
encoder, multi-query), each of which must have a feasible layout; ``TENSORPAR_PLANNER_COVERAGE=all``
(``make coverage``) runs every architecture of the coverage matrix (``tests/_matrix_workers.ARCHS``),
each of which must be planned: a ranked list, feasible layouts first, or none when none fits and
every layout says why (a 120B model's Adam states alone exceed 16 x 80 GB: no layout can fit).

The sequence is 4096 tokens: a default config's position limit is the longest context the model
allows (32768 for Qwen3-MoE, 131072 for some), and training that context without FlashAttention
(the planner counts the attention scores, Korthikanti et al. 2022) fits no 16 A100s; the planner
says so (exit 1, every layout's reason), which :func:`test_the_config_context_is_planned_as_given`
keeps honest.
"""
from __future__ import annotations

import json
import os

import pytest

from tensorpar.cli import main
from tests._matrix_workers import ARCHS

# Each with what it needs to fit 16 A100-80GB (the planner's own advice when it does not).
SAMPLE = {
    "llama": (), "qwen3_moe": (), "gemma2": (), "phi3": (), "mamba": (), "bert": (), "mixtral": (),
    "falcon": ("--recompute", "full"),  # 71 heads: tp 1 or 71, and 4096 tokens' activations at tp 1 need it
    "gpt_oss": ("--workload", "inference"),  # 117B: Adam's 16 bytes a parameter exceed 16 x 80 GB
}
ALL = os.environ.get("TENSORPAR_PLANNER_COVERAGE") == "all"
DEVICES = 16
SEARCH = ("--search", "--devices", str(DEVICES), "--hardware", "a100-80gb", "--json")
LAYOUTS = {(t, p, DEVICES // (t * p)) for t in (1, 2, 4, 8, 16) for p in (1, 2, 4, 8, 16) if DEVICES % (t * p) == 0}


# Fields transformers' default config leaves None although its own model needs them: without them
# ``AutoModelForCausalLM.from_config`` fails on its own (``head_dim ** -0.5`` of None, ``heads // None``,
# ``torch.empty(None, ...)``), so that default config is not a model. Completed as a real checkpoint
# of the family sets them (the default sizes are that checkpoint's); the planner completes nothing.
# :func:`test_the_completed_fields_are_ones_transformers_cannot_build_without` keeps each needed.
COMPLETED = {
    "ministral": {"head_dim": 128},  # Ministral-8B-Instruct-2410: 4096 hidden / 32 heads
    "hunyuan_v1_dense": {"head_dim": 128},  # Hunyuan-7B: 4096 hidden / 32 heads
    "hunyuan_v1_moe": {"head_dim": 128},  # Hunyuan-A13B: 4096 hidden / 32 heads
    "nemotron": {"num_key_value_heads": 8},  # Nemotron-4-15B (6144 hidden, 48 heads, 32 layers): 8 KV heads
    "dots1": {"n_routed_experts": 128, "n_shared_experts": 2, "num_experts_per_tok": 6},  # dots.llm1.base
    # Qwen4-Exp's default layers are "indexed_attention" (QSA), whose indexer has no default and no
    # published checkpoint: one key head (the validator requires it), the query heads of the model
    # (16), the head dim of its attention (256, the least the validator allows with full rotary),
    # a budget of 2048 tokens (DeepSeek-V3.2's indexer top-k) in blocks of 64.
    "qwen4_exp_text": {"indexer_n_heads": 16, "indexer_kv_heads": 1, "indexer_head_dim": 256,
                       "indexer_budget": 2048, "indexer_compress_ratio": 64},
}


def _default_config(arch: str, root) -> str:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    CONFIG_MAPPING[arch](**COMPLETED.get(arch, {})).save_pretrained(root)
    return str(root)


def _plan(capsys, *argv) -> tuple[int, dict]:
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    assert out.count("\n") == 1, err  # one JSON object, nothing else on stdout
    return rc, json.loads(out)


def _check_ranking(r: dict) -> list:
    """Every layout of 16 devices once, feasible first in the order of the estimate, each with
    memory and collectives, each rejection with its reason; the feasible ones."""
    rows = r["candidates"]
    assert {(c["tp"], c["pp"], c["dp"]) for c in rows} == LAYOUTS
    feasible = [c for c in rows if c["feasible"]]
    assert rows[:len(feasible)] == feasible and r["best"] == (feasible[0] if feasible else None)
    assert [c["estimate_s"] for c in feasible] == sorted(c["estimate_s"] for c in feasible)
    for c in feasible:  # 16 devices: every layout communicates; nothing fits that exceeds 80 GB
        assert 0 < c["memory_per_device_bytes"] <= 80e9 and c["comm_bytes_per_device_per_step"] > 0, c
        assert 0 < c["bound_s"] <= c["estimate_s"], c
    for c in rows[len(feasible):]:
        assert c["reasons"], c
    return feasible


@pytest.mark.parametrize("arch", list(SAMPLE))
def test_search_ranks_feasible_layouts_of_the_full_size_config(arch, tmp_path, capsys):
    rc, r = _plan(capsys, "--model", _default_config(arch, tmp_path), *SEARCH, "--seq", "4096", *SAMPLE[arch])
    assert rc == 0 and _check_ranking(r), r["explanation"]


@pytest.mark.skipif(not ALL, reason="every architecture: make coverage (TENSORPAR_PLANNER_COVERAGE=all)")
@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_is_planned(arch, tmp_path, capsys):
    rc, r = _plan(capsys, "--model", _default_config(arch, tmp_path), *SEARCH, "--seq", "4096")
    assert rc == (0 if _check_ranking(r) else 1), r["explanation"]


def test_the_config_context_is_planned_as_given(tmp_path, capsys):
    """Without --seq a config is planned at its position limit, the field named: Qwen3-MoE's
    32768 tokens of training on one device do not fit, and the plan says what does not (exit 1,
    not a silent fit)."""
    path = _default_config("qwen3_moe", tmp_path)
    rc, r = _plan(capsys, "--model", path, "--json")
    assert r["model"]["seq"] == 32768 and r["model"]["seq_source"] == f"max_position_embeddings in {path}/config.json"
    assert rc == 1 and not r["feasible"] and "exceeds capacity" in r["reasons"][0]
    assert r["memory_per_device"]["activations"] > 80e9  # the scores of 32768 keys alone


def test_inventory_is_the_same_plan(tmp_path, capsys):
    """``--inventory`` (the former second path) is kept and plans a config exactly as without it."""
    from tensorpar.models.tiny import make_tiny_config
    make_tiny_config("qwen2_moe").save_pretrained(tmp_path)
    argv = ("--model", str(tmp_path), "--search", "--devices", "4", "--seq", "32", "--json")
    assert _plan(capsys, *argv) == _plan(capsys, *argv, "--inventory")


@pytest.mark.parametrize("arch", list(COMPLETED))
def test_the_completed_fields_are_ones_transformers_cannot_build_without(arch):
    """Each :data:`COMPLETED` entry is needed: transformers itself cannot build its default config
    on the meta device (a completion it no longer needs must go: the default is then planned as is)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    with pytest.raises(TypeError), torch.device("meta"):
        AutoModelForCausalLM.from_config(CONFIG_MAPPING[arch]())


@pytest.mark.parametrize("arch", ["rwkv", "llama"])
def test_pipeline_stages_send_their_boundary_activations(arch, tmp_path, capsys):
    """A pp 2 layout's first stage sends micro-batch x seq x hidden x bytes each micro-batch, read
    from the config's hidden size, also where the model has no attention heads (RWKV: the planner
    once sent 0 bytes between its stages)."""
    from tensorpar.models.tiny import make_tiny_config
    config = make_tiny_config(arch)
    config.save_pretrained(tmp_path)
    rc, r = _plan(capsys, "--model", str(tmp_path), "--pp", "2", "--micro-batch", "3", "--global-batch", "6",
                  "--seq", "40", "--dtype", "fp32", "--json")
    sends = [c for c in r["comm"]["per_step"] if c["op"] == "send"]
    assert [(c["where"], c["payload_bytes"], c["count"]) for c in sends] == [
        ("pipeline.activation", 3 * 40 * config.hidden_size * 4, 2)], r["comm"]
    assert r["comm"]["bytes_sent_per_device_per_step"]["pp"] == 2 * 3 * 40 * config.hidden_size * 4
    assert (r["model"]["hidden"], r["model"]["vocab"]) == (config.hidden_size, config.vocab_size)


def test_a_config_with_infinity_is_read_as_transformers_wrote_it(tmp_path, capsys):
    """transformers writes Bamba's ``time_step_limit`` (0, inf) as ``[0.0, {"__float__": "Infinity"}]``
    and reads it back as (0.0, inf); tensorpar's reader must too (it once refused the config)."""
    from tensorpar.sharding.inventory import load_config
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    CONFIG_MAPPING["bamba"](num_hidden_layers=2).save_pretrained(tmp_path)
    assert "__float__" in (tmp_path / "config.json").read_text()
    assert load_config(tmp_path)[0].time_step_limit == (0.0, float("inf"))
