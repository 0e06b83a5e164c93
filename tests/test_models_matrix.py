"""Every causal-LM architecture of transformers 5.24 that builds tiny, split at tp 2 and 4 on real
gloo ranks, against its unsplit copy (tests/_matrix_workers.py does the work, one launch).

For every architecture and tp size, ``parallelize(model)`` (plan ``"auto"``) either refuses with a
``ValueError`` or returns a model whose logits, every parameter's gradient, the global gradient norm
clipping uses and the logits of every greedy decoding step equal the dense model's: float64 1e-10 relative where the architecture computes
in float64 throughout (sums of at most a few hundred products reordered by the row-parallel
partial sums: ~1e-15; a missing reduction, a partial gradient or heads paired wrongly: O(1)),
float32 1e-5 where it computes part of the forward in float32 (MoE routers' softmax: float32
rounding, 6e-8, summed in another order). Architectures reported as split hold at most
``1/tp + 0.1`` of the decoder-layer parameters on each rank. Each tiny model holds every kind of
layer its full-size configuration has (``tensorpar.architecture.layer_kinds``: sliding and full attention,
linear attention, dense and expert MLPs), so no kind goes untested. The split built without the
proof (what the planner predicts from) equals the proved one.

``make test`` runs the architectures of ``QUICK`` (every plan source and layer kind);
``TENSORPAR_MATRIX=all`` (CI, ``make coverage``) runs every one. ``TENSORPAR_COVERAGE=path.json`` writes the results for ``python -m tensorpar.cli.coverage``,
which renders the coverage table of the README and docs/coverage.md.
"""
from __future__ import annotations

import functools
import json
import os

import pytest

from tensorpar import distributed as dist
from tests._matrix_workers import ARCHS, QUICK, matrix_worker

RUN = ARCHS if os.environ.get("TENSORPAR_MATRIX") == "all" else QUICK

pytestmark = pytest.mark.multirank
TP_SIZES = (2, 4)
TOL64, TOL32 = 1e-10, 1e-5


@functools.lru_cache(maxsize=None)
def results() -> dict:
    # timeout: a collective may wait while a slower rank checks a large block alone (2 shared cores)
    per_rank = dist.launch(matrix_worker, 4, RUN, TP_SIZES, timeout=600, deadline=3000)
    merged: dict = {}
    for res in per_rank:
        for key, val in res.items():
            merged.setdefault(key, []).append(val)
    path = os.environ.get("TENSORPAR_COVERAGE")
    if path:
        with open(path, "w") as f:
            json.dump([{"arch": a, "tp": tp, "ranks": v} for (a, tp), v in sorted(merged.items())], f, indent=1,
                      default=str)
    return merged


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("arch", RUN)
def test_split_is_exact_or_refused(arch, tp):
    runs = results().get((arch, tp))
    assert runs, f"no rank ran {arch} at tp {tp}"
    for r in runs:
        assert r["status"] in ("ran", "refused"), r.get("traceback", r)
        if r["status"] == "refused":
            continue
        tol = TOL64 if r["float64"] else TOL32
        assert r["logits"] <= tol, (r["logits"], r)
        assert r["grad"] <= tol, (r["grad"], r["grad_where"])
        assert r["grad_norm"] <= tol, r["grad_norm"]  # clipping counts every parameter once
        if r["generation"] is not None:
            assert r["generation"] <= tol, r["generation"]


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("arch", RUN)
def test_split_architectures_hold_their_share(arch, tp):
    """What the report calls split holds at most 1/tp + 0.1 of the layers (counted here); what it
    calls partly whole names what stays whole."""
    for r in results().get((arch, tp), []):
        if r["status"] != "ran":
            continue
        if r["reported"] == "split":
            assert r["share"] <= 1 / tp + 0.1, r["share"]
        else:
            assert r["whole"] or r["layers_replicated"], r


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("arch", RUN)
def test_the_proof_keeps_the_plan_the_planner_predicts(arch, tp):
    """The split ``prove=False`` builds (what ``tensorpar plan`` and the planner's inventory read)
    is the one the proof keeps: what a proof leaves whole or splits a safer way is recorded in the
    registry, so the prediction holds for the model that runs."""
    for r in results().get((arch, tp), []):
        if r["status"] == "ran":
            assert not r["proof_changed"], (r["proof_changed"], r["whole"], r["fallbacks"])


def test_ranks_agree_on_what_was_split():
    for (arch, tp), runs in results().items():
        whole = {json.dumps(r.get("whole"), sort_keys=True) for r in runs}
        assert len(whole) == 1, (arch, tp, whole)
