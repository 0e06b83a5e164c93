"""The planner's collectives and model states for a training step on a dp x tp mesh
(:mod:`tensorpar.planner.mesh`) against the ledger's records on 4 real ranks: tensor-parallel
collectives (with and without sequence parallelism) and the data-parallel ones PyTorch's engines
issue (DDP's gradient buckets, FSDP2's all-gathers and reduce-scatters), per collective; the bytes
of parameters, gradients and AdamW moments each rank holds."""
import functools
from collections import Counter

import pytest

from tensorpar import distributed as dist
from tensorpar.planner import mesh as PM
from tensorpar.planner.runtime import generic_name
from tests import _planner_mesh_workers as W

LAYOUTS = [(2, 2, "ddp", False), (2, 2, "fsdp", False), (2, 2, "ddp", True), (2, 2, "fsdp", True),
           (1, 4, "fsdp", True), (4, 1, "fsdp", False), (4, 1, "ddp", False),
           # GPT-2 (Conv1D rows, a column split outside any region, row biases) and BERT (a post-norm
           # encoder whose attention output projection and norm lie outside its region)
           (2, 2, "ddp", True, "gpt2"), (2, 2, "ddp", True, "bert")]


@functools.lru_cache(maxsize=None)
def results() -> list:
    return dist.launch(W.step_worker, 4, LAYOUTS, deadline=600)


@functools.lru_cache(maxsize=None)
def inventory(tp: int, arch: str = "llama"):
    from tensorpar.models.tiny import make_tiny_config
    from tensorpar.sharding.inventory import build_inventory
    return build_inventory(make_tiny_config(arch), tp)


def _ids(layout) -> str:
    return f"dp{layout[0]}xtp{layout[1]}-{layout[2]}{'-sp' * layout[3]}{''.join('-' + a for a in layout[4:])}"


def _recorded(records, dim) -> Counter:
    """``(op, where, phase, payload)`` counts; ``""``: the loss's reductions, issued outside the model."""
    return Counter((op, generic_name(module) or "cross_entropy", phase, payload)
                   for g, op, module, phase, payload, _ in records if g == dim)


def _predicted(items) -> Counter:
    out = Counter()
    for i in items:
        out[(i.op, i.where, i.phase, i.payload_bytes)] += i.count
    return out


def _cases(layout):
    """``((dp, tp, data_parallel, sequence_parallel), inventory, rank's result)`` for every rank."""
    inv = inventory(layout[1], *layout[4:])
    return [(layout[:4], inv, res[layout]) for res in results()]


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_planner_collectives_equal_the_ledger_per_collective(layout):
    for (dp, tp, kind, sp), inv, r in _cases(layout):
        plan = PM.mesh_step(inv, dp=dp, data_parallel=kind, sequence_parallel=sp, batch=W.BATCH, seq=W.SEQ,
                            e=8, tp_rank=r["tp_rank"])
        if tp > 1:
            assert _recorded(r["records"], "tp") == _predicted(plan["tp"]), ("tp", r["rank"])
        if dp > 1:
            assert _recorded(r["records"], "dp") == _predicted(plan["dp"]), ("dp", r["rank"])
        assert {g for g, *_ in r["records"]} <= {"tp", "dp"}, "a collective on another group"


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_planner_model_states_equal_what_each_rank_holds(layout):
    for (dp, tp, kind, sp), inv, r in _cases(layout):
        want = PM.state_bytes(inv, dp=dp, data_parallel=kind, e=8, tp_rank=r["tp_rank"], dp_rank=r["dp_rank"])
        assert r["held"] == {k: want[k] for k in ("params", "grads", "optimizer")}, (r["rank"], r["held"], want)


def test_ddp_buckets_follow_torch_defaults():
    """Reverse registration order, the first bucket closed at 1 MiB, the others at 25 MiB."""
    mib = 1 << 20
    assert PM.ddp_buckets([10]) == [10]
    assert PM.ddp_buckets([30 * mib, mib // 2, mib // 2]) == [mib, 30 * mib]
    assert PM.ddp_buckets([mib] * 60) == [mib, 25 * mib, 25 * mib, 9 * mib]


def test_fsdp_pads_every_parameter_to_dp_rows():
    assert PM.fsdp_unit_elems([(65, 48), (48,)], 2) == 66 * 48 + 48
    assert PM.fsdp_unit_elems([(5, 3)], 4) == 8 * 3


def test_plan_command_plans_a_training_step_on_the_mesh(tmp_path, capsys):
    """``tensorpar plan --model DIR --dp 2 --zero-stage 3 --sequence-parallel --optimizer adamw
    --json``: its step's dp and tp collectives are those of :func:`tensorpar.planner.mesh.mesh_step`
    (what the tests above hold equal to the ledger), its model states ``state_bytes``; ZeRO-1 keeps
    the weights whole and shards the optimizer state (the planner's, not a runtime engine)."""
    import json

    from tensorpar.cli import main
    from tensorpar.models.tiny import make_tiny_checkpoint
    make_tiny_checkpoint(tmp_path, "llama", seed=1)
    args = ["plan", "--model", str(tmp_path), "--tp", "2", "--micro-batch", "2", "--seq", "8",
            "--dtype", "fp64", "--optimizer", "adamw", "--json"]
    assert main(args + ["--dp", "2", "--zero-stage", "3", "--sequence-parallel"]) == 0
    r = json.loads(capsys.readouterr().out)
    step = PM.mesh_step(inventory(2), dp=2, data_parallel="fsdp", sequence_parallel=True, batch=4, seq=8, e=8)

    def rows(items):
        return sorted((i["op"], i["where"], i["phase"], i["payload_bytes"], i["count"]) for i in items)
    for group in ("dp", "tp"):
        assert rows(i for i in r["comm"]["per_step"] if i["group"] == group) == rows(
            i.to_dict() for i in step[group]), group
    states = PM.state_bytes(inventory(2), dp=2, data_parallel="fsdp", e=8)
    assert r["memory_per_device"]["weights"] == states["params"]
    assert r["memory_per_device"]["optimizer"] == states["optimizer"]
    assert main(args + ["--dp", "2", "--zero-stage", "1"]) == 0
    one = json.loads(capsys.readouterr().out)["memory_per_device"]
    whole = PM.state_bytes(inventory(2), dp=2, data_parallel="ddp", e=8)
    assert one["weights"] == whole["params"] and one["optimizer"] == whole["optimizer"] / 2
