"""The inventory's prediction equals what the runtime does, architecture by architecture.

For every architecture of tests/_planner_inventory_workers.py, built tiny in float64 and split
at tp 2 and 4 on real gloo ranks (one launch), each rank's measurements equal what
``tensorpar.sharding.inventory`` predicts from the config alone:

- parameters held after ``parallelize``, bare model and model with its head (vocabulary padding
  at tp 4: 130 rows -> 132; KV heads replicated where tp exceeds them);
- every collective of a bare forward, a forward with gathered logits and a training step, by
  (op, phase, module, payload bytes, bytes sent) at each module the ledger names, and through the
  planner's ``RuntimePrediction`` (merged by generic module name, with counts and totals per rank);
- two greedy decode steps (generate of 3 tokens minus generate of 1), for the decoders;
- KV-cache bytes of a forward with ``use_cache=True``, at 5 tokens and at 10 (past the tiny
  sliding windows of 8: a windowed layer keeps 7);
- linear FLOPs of the split forward (``FlopCounterMode``: mm and addmm) on each rank.

All are integer byte or FLOP counts: exact equality.
"""
from __future__ import annotations

import functools
from collections import Counter

import pytest

from tensorpar import distributed as dist
from tensorpar.planner.predict import _steps
from tensorpar.planner.runtime import generic_name, predict_from_inventory, runs
from tests._planner_inventory_workers import (ARCHS, BATCH, LONG_SEQ, NEW_TOKENS, SEQ, inventory_worker,
                                              tiny_config)

pytestmark = pytest.mark.multirank
E = 8  # float64
TP_SIZES = (2, 4)
CASES = [(arch, tp) for tp in TP_SIZES for arch in ARCHS]
WORKLOADS = ("forward", "logits", "train")
OUTSIDE = {"all_reduce": "cross_entropy", "broadcast": "next_token"}  # issued outside the model


@functools.lru_cache(maxsize=None)
def results() -> dict:
    merged: dict = {}
    for res in dist.launch(inventory_worker, 4, ARCHS, deadline=900):
        for key, val in res.items():
            merged.setdefault(key, []).append(val)
    return merged


@functools.lru_cache(maxsize=None)
def inventory(arch: str, tp: int, head: bool):
    from tensorpar.sharding.inventory import build_inventory
    return build_inventory(tiny_config(arch), tp, head=head)


def _ranks(arch, tp) -> list:
    runs_ = results()[(arch, tp)]
    assert len(runs_) == tp and not any("error" in r for r in runs_), [r.get("error") for r in runs_]
    return runs_


def _prediction(arch, tp, workload, new_tokens=1):
    return predict_from_inventory(inventory(arch, tp, workload != "forward"), BATCH, SEQ, E, workload,
                                  new_tokens=new_tokens)


def _generic(records) -> Counter:
    return Counter((op, phase, generic_name(m) if m else OUTSIDE[op], n, sent) for op, phase, m, n, sent in records)


def _predicted(pred, rank) -> Counter:
    return Counter({(i.op, i.phase, i.where, i.payload_bytes, i.bytes_sent_per_rank[rank]): i.count
                    for i in pred.items})


def _at_modules(inv, workload) -> Counter:
    """(op, phase, module, payload bytes) of every collective the sites issue, module by module
    (the loss's reductions and the broadcast, outside the model, are the prediction's)."""
    out = Counter()
    for step in _steps(workload, SEQ, 1):
        for s in inv.sites:
            if runs(s, step):
                out[(s.op, s.phase, s.module, s.payload_bytes(BATCH * step.seq, E))] += step.count
    return out


@pytest.mark.parametrize("arch, tp", CASES)
def test_parameters_per_rank_as_parallelize_leaves_them(arch, tp):
    for head, key in ((False, "bare_params"), (True, "params")):
        inv = inventory(arch, tp, head)
        assert [r[key] for r in _ranks(arch, tp)] == inv.params_per_rank()
    assert all(r["whole"] == inventory(arch, tp, True).whole for r in _ranks(arch, tp))


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("arch, tp", CASES)
def test_every_collective_as_predicted(arch, tp, workload):
    pred = _prediction(arch, tp, workload)
    for rank, res in enumerate(_ranks(arch, tp)):
        got, want = _generic(res[workload]), _predicted(pred, rank)
        assert got == want, (rank, got - want, want - got)
        assert sum(r[-1] for r in res[workload]) == pred.bytes_sent_per_rank[rank]


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("arch, tp", CASES)
def test_every_collective_at_its_module(arch, tp, workload):
    want = _at_modules(inventory(arch, tp, workload != "forward"), workload)
    for res in _ranks(arch, tp):
        got = Counter((op, phase, m, n) for op, phase, m, n, _ in res[workload] if m)
        assert got == want, (got - want, want - got)


@pytest.mark.parametrize("arch, tp", CASES)
def test_decode_steps_as_predicted(arch, tp):
    ranks = _ranks(arch, tp)
    if not inventory(arch, tp, True).causal:
        assert all(r["cache"][SEQ] is None for r in ranks)  # an encoder keeps no cache
        pytest.skip(f"{arch} is an encoder")
    pred = _prediction(arch, tp, "decode")
    generated = _prediction(arch, tp, "generate", NEW_TOKENS)
    for rank, res in enumerate(ranks):
        steps = _generic(res[f"generate{NEW_TOKENS}"]) - _generic(res["generate1"])
        assert steps == Counter({k: (NEW_TOKENS - 1) * c for k, c in _predicted(pred, rank).items()})
        assert _generic(res[f"generate{NEW_TOKENS}"]) == _predicted(generated, rank)


@pytest.mark.parametrize("arch, tp", CASES)
def test_kv_cache_bytes_per_rank(arch, tp):
    inv = inventory(arch, tp, True)
    for rank, res in enumerate(_ranks(arch, tp)):
        for seq in (SEQ, LONG_SEQ):
            want = BATCH * inv.kv_cache_elems(seq, rank) * E
            assert (res["cache"][seq] or 0) == want, (seq, res["cache"][seq], want)


@pytest.mark.parametrize("arch, tp", CASES)
def test_linear_flops_per_rank(arch, tp):
    inv = inventory(arch, tp, True)
    for rank, res in enumerate(_ranks(arch, tp)):
        assert res["linear_flops"] == BATCH * SEQ * inv.matmul_flops_per_token(rank)
