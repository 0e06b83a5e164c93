"""Pipeline stages (``parallelize(mesh=(pp, dp, tp), pipeline=...)``) against the unsplit model.

One launch of 4 ranks runs every layout (tests/_pipeline_workers.py): 20 AdamW steps with
clipping in float64 on the global batch (6 for the layouts beyond the issue's list), against the
same steps on one process. The tolerance,
1e-12 relative, is float64 rounding: the pipelined run adds the microbatches' losses and gradients
in another order than one process (a few ulps per step, grown over 20 steps of AdamW, which
divides by the root of the second moment), while a wrong cut, a missed tied-gradient sum, a
stage that drops a block or a gradient counted twice is off by far more than that.
"""
import atexit
import functools
import tempfile

import pytest

from tensorpar import distributed as dist
from tensorpar.planner.pipeline_step import pipeline_state_bytes, pipeline_step
from tests import _pipeline_workers as W
from tests.test_planner_mesh import _predicted, _recorded  # the ledger's and the plan's calls, counted alike

TOL = 1e-12
LAYOUTS = [
    (2, 1, 2, "1F1B", 2, "llama"),                                   # pp 2 x tp 2
    (2, 2, 1, "GPipe", 2, "llama", {"dp": "ddp"}),                    # pp 2 x dp 2 (DDP)
    (4, 1, 1, "1F1B", 4, "llama"),                                    # pp 4
    (2, 1, 2, "1F1B", 2, "llama", {"sp": True}),                      # pp 2 x tp 2, sequence parallel
    (2, 1, 2, "Interleaved1F1B", 2, "llama", {"virtual": 2}),         # 2 virtual stages per rank
    (2, 1, 2, "1F1B", 2, "gpt2"),                                     # tied embeddings, learned positions
    (2, 2, 1, "GPipe", 2, "mixtral", {"dp": "ddp"}),                  # mixture of experts
    (2, 2, 1, "1F1B", 2, "llama3", {"dp": "ddp"}),                    # uneven: 2 + 1 blocks
    (2, 1, 2, "ZBVZeroBubble", 2, "llama"),                           # zero bubble, a V of 2 stages per rank
    (2, 2, 1, "1F1B", 2, "llama", {"dp": "fsdp", "steps": W.SHORT}),   # pp 2 x dp 2 (FSDP2)
    (2, 1, 2, "1F1B", 2, "llama", {"blocks": (3, 1), "steps": W.SHORT}),  # uneven by request
    (2, 2, 1, "1F1B", 2, "gpt2", {"dp": "fsdp", "steps": W.SHORT}),   # tied copies made DTensors by FSDP
    (2, 2, 1, "ZBVZeroBubble", 2, "gpt2", {"dp": "ddp", "steps": W.SHORT}),  # both tied copies on one rank
]


# The planner against the ledger: each layout's third step on every rank (float64 tiny models).
LEDGER_LAYOUTS = [
    (2, 1, 2, "1F1B", 2, "llama"),
    (2, 1, 2, "1F1B", 2, "llama", {"sp": True}),
    (2, 1, 2, "GPipe", 2, "gpt2"),                       # the tied embedding's all-reduce
    (2, 2, 1, "1F1B", 2, "llama", {"dp": "ddp"}),
    (2, 2, 1, "1F1B", 2, "llama", {"dp": "fsdp"}),
    (2, 1, 2, "Interleaved1F1B", 2, "llama", {"virtual": 2}),
    (2, 2, 1, "ZBVZeroBubble", 2, "gpt2", {"dp": "ddp"}),  # a V: the tied pieces on one rank, the tip local
    (2, 1, 2, "ZBVZeroBubble", 2, "gpt2"),               # split backward at tp 2: every all-reduce once
    (4, 1, 1, "1F1B", 4, "llama"),
]


@functools.lru_cache(maxsize=None)
def _results():
    tmp = tempfile.TemporaryDirectory(prefix="tensorpar-pipeline-")
    atexit.register(tmp.cleanup)
    return dist.launch(W.all_worker, 4, LAYOUTS, tmp.name, LEDGER_LAYOUTS, deadline=900)


def _case(layout):
    """The layout's results on each of the 4 ranks."""
    return [r["layouts"][str(layout)] for r in _results()]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "-".join(str(x) for x in lay[:6]) +
                         ("-" + "-".join(f"{k}{v}" for k, v in lay[6].items()) if len(lay) > 6 else ""))
def test_pipelined_training_equals_the_single_process_run(layout):
    for r in _case(layout):
        assert r["loss_err"] <= TOL, r
        assert r["norm_err"] <= TOL, r
        assert r["grad_err"] <= TOL, r
        assert r["param_err"] <= TOL, r
    assert _case(layout)[0]["clipped_steps"] > 0  # clipping acted on some steps


def test_every_block_is_held_by_exactly_one_stage():
    uneven = (2, 2, 1, "1F1B", 2, "llama3", {"dp": "ddp"})
    res = _case(uneven)
    assert res[0]["stage_blocks"] == [[0, 2], [2, 3]]
    held = [r["names"] for r in res]
    blocks = {n.split(".")[2] for names in held for n in names if n.startswith("model.layers.")}
    assert blocks == {"0", "1", "2"}


REFUSALS = {
    "schedule": "pipeline schedule 'Bogus' does not exist; valid: GPipe, 1F1B, Interleaved1F1B",
    "too_many_stages": "pp=2 x 4 stage(s) per rank = 8 stages, more than the model's 4 blocks; valid pp with 4",
    "virtual_not_dividing": "4 virtual stages (pp=2 x 2) do not divide the model's 5 blocks; stages that do: [1, 5]",
    "torch_limit": "schedule 1F1B needs microbatches >= pp (2); got 1",
    "bad_blocks": "blocks per stage [3, 2] must be 2 positive counts adding up to the model's 4 blocks",
    "pp_without_schedule": "the mesh has a 'pp' dimension of 2: choose a pipeline schedule",
    "schedule_without_pp": "pipeline='1F1B' needs a 'pp' dimension; the mesh has ('dp', 'tp')",
    "schedule_without_mesh": "pipeline='1F1B' needs mesh=, a DeviceMesh with dimensions ('pp', 'dp', 'tp')",
    "microbatches_without_schedule": "microbatches, virtual_stages and stage_blocks are pipeline settings",
}


@pytest.mark.parametrize("key", sorted(REFUSALS))
def test_bad_pipeline_arguments_are_refused_before_anything_changes(key):
    for r in _results():
        message, untouched = r["refusals"][key]
        assert message is not None and REFUSALS[key] in message, message
        assert untouched


@pytest.mark.parametrize("key, message", [
    ("microbatches", "microbatches=3 does not divide the batch of 4 sequences"),
    ("generate", "generate does not run a model cut into pipeline stages"),
    ("forward", "runs through tensorpar.models.training.train_step")])
def test_a_pipelined_model_refuses_what_it_cannot_run(key, message):
    for r in _results():
        assert r["refusals"][key] is not None and message in r["refusals"][key]


@pytest.mark.parametrize("src, dst", [("pp2xtp2", "tp4"), ("pp2xtp2", "pp4"), ("pp2xtp2", "dense"),
                                      ("tp4", "pp2xtp2"), ("dense", "pp2xtp2")])
def test_a_checkpoint_resumes_on_the_same_curve_in_another_pipeline_layout(src, dst):
    for r in _results():
        res = r["checkpoints"][(src, dst)]
        assert res["step"] == 3
        assert res["err"] <= TOL, res


def test_export_of_a_pipelined_model_is_the_dense_model():
    for r in _results():
        assert r["checkpoints"]["export"] <= TOL


@functools.lru_cache(maxsize=None)
def _inventory(name: str, tp: int):
    from tensorpar.models.tiny import make_tiny_config
    from tensorpar.sharding.inventory import build_inventory
    arch, sizes = W.MODELS[name]
    return build_inventory(make_tiny_config(arch, **sizes), tp)


@pytest.mark.parametrize("layout", LEDGER_LAYOUTS, ids=lambda lay: "-".join(str(x) for x in lay[:6]) +
                         ("-" + "-".join(f"{k}{v}" for k, v in lay[6].items()) if len(lay) > 6 else ""))
def test_the_planner_equals_the_ledger_per_rank(layout):
    """Every collective and transfer of a pipelined step, per mesh dimension, and the model states
    each rank holds, as :func:`tensorpar.planner.pipeline_step.pipeline_step` plans them."""
    pp, dp, tp, schedule, mb, name, opts = (*layout, {})[:7]
    inv = _inventory(name, tp)
    for res in _results():
        r = res["ledger"][str(layout)]
        plan = pipeline_step(inv, pp=pp, dp=dp, data_parallel=opts.get("dp"), sequence_parallel=opts.get("sp", False),
                             batch=W.LEDGER_BATCH, seq=W.SEQ, e=8, schedule=schedule, microbatches=mb,
                             virtual=opts.get("virtual"), pp_rank=r["pp_rank"], tp_rank=r["tp_rank"])
        for dim in ("tp", "dp", "pp"):
            assert _recorded(r["records"], dim) == _predicted(plan[dim]), (dim, r["rank"])
        assert {g for g, *_ in r["records"]} <= {"tp", "dp", "pp"}, "a collective on another group"
        want = pipeline_state_bytes(inv, pp=pp, dp=dp, data_parallel=opts.get("dp"), e=8, schedule=schedule,
                                    virtual=opts.get("virtual"), pp_rank=r["pp_rank"], tp_rank=r["tp_rank"],
                                    dp_rank=r["dp_rank"])
        assert r["held"] == {k: want[k] for k in ("params", "grads", "optimizer")}, (r["rank"], r["held"], want)
