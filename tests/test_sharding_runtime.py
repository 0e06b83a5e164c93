"""The mechanisms behind ``parallelize`` on real gloo ranks (tests/_sharding_workers.py), each
against a dense computation written in the worker, float64, tolerance 1e-12 relative (a few dozen
products summed in another order: ~1e-16; a missing or doubled reduction: O(1)).

What each catches:
- ``ShardedRMSNorm``: a norm over its local features only (statistic not summed: O(1) forward),
  a statistic summed without its backward all-reduce (weight and input gradients wrong), a
  replicated KV head counted twice (forward off by sqrt(2));
- ``vocab_parallel_like`` / ``column_parallel_like``: a subclass's own forward dropped (the scale
  missing), or a local lookup of global ids;
- ``sync_grad`` under gradient accumulation: a post-accumulate all-reduce (HF's hook) doubles the
  first pass's gradient on the second; a missing sync leaves this rank's share;
- ``RowParallelLinear(reduce_output=False)`` inside a region reduced once: the bias added on every
  rank (tp times), or a second reduction;
- ``rank0_only``: a bias on every rank, or a gradient only on rank 0 (copies drift apart);
- ``enter_region(all_inputs=True)`` on a fused experts module with routing weights made outside
  it: without the weights' input copy the router's gradient is this rank's share only.
"""
import functools

import pytest

from tensorpar import distributed as dist
from tests._sharding_workers import runtime_worker

pytestmark = pytest.mark.multirank
TOL = 1e-12


@functools.lru_cache(maxsize=None)
def results() -> dict:
    merged: dict = {}
    for res in dist.launch(runtime_worker, 4):
        for key, val in res.items():
            merged.setdefault(key, []).append(val)
    return merged


@pytest.mark.parametrize("tp", (2, 4))
def test_rms_norm_over_split_features(tp):
    for r in results()[("norm", tp)]:
        assert r["y"] <= 1e-6 and r["dw"] <= 1e-6 and r["dx"] <= 1e-6, r  # float32 compute, as HF's


def test_rms_norm_over_a_replicated_kv_head():
    for r in results()[("norm_replicated", 4)]:
        assert r["y"] <= 1e-6 and r["dw"] <= 1e-6, r
        assert r["clip_norm"] <= 1e-6, r  # float32 norm compute, as dw; counted twice: sqrt(2) - 1 = 0.41


@pytest.mark.parametrize("tp", (2, 4))
def test_subclasses_keep_their_own_forward(tp):
    for r in results()[("subclass", tp)]:
        assert r["types"] == ["VocabParallelScaledEmbedding", "ColumnParallelScaledHead"]
        assert max(r["out"], r["emb_dw"], r["head_dw"], r["scale_dw"]) <= TOL, r


@pytest.mark.parametrize("tp", (2, 4))
def test_replicated_gradients_inside_a_region(tp):
    for r in results()[("grad_sync", tp)]:
        assert max(r["out"], r["scale"], r["bias"], r["up"]) <= TOL, r
        assert r["sync_records"] == 2 and r["sync_module"] == "_Block"  # one per backward, named
        assert r["forward_reduces"] == 2  # one reduction per forward pass, at the region's exit


@pytest.mark.parametrize("tp", (2, 4))
def test_rank0_bias(tp):
    for r in results()[("rank0", tp)]:
        assert r["sum"] <= TOL and r["grad"] == [1.0, 2.0, 3.0], r


@pytest.mark.parametrize("tp", (2, 4))
def test_experts_region_copies_the_routing_weights_in(tp):
    for r in results()[("experts_region", tp)]:
        assert max(r["out"], r["dx"], r["router"], r["up"], r["down"]) <= TOL, r
