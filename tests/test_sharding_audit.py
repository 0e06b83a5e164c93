"""tensorpar.audit on 2 gloo ranks: replicated tensors (and their gradients) compared across the
group by checksum; drift named with its ranks, shards left alone; different inputs refused."""
import functools

import pytest

from tensorpar import distributed as dist
from tests import _audit_workers as W

pytestmark = pytest.mark.multirank


@functools.lru_cache(maxsize=None)
def results():
    return dist.launch(W.audit_worker, 2, deadline=300)


def test_a_fresh_split_and_its_gradients_are_identical_on_every_rank():
    for r in results():
        ok, checked, differs = r["fresh"]
        assert ok and checked > 5 and not differs  # norms, rotary buffers...
        ok, checked_grads, differs = r["after_backward"]
        assert ok and checked_grads > checked, differs


def test_drift_in_the_last_bits_is_named_with_its_ranks_and_shards_are_not():
    for r in results():
        ok, _, differs = r["drifted"]
        assert not ok and differs == {"model.norm.weight": [1]}
        ok, _, differs = r["grad_drift"]
        assert not ok and differs == {"model.layers.1.input_layernorm.weight.grad": [1]}
        assert "1 of" in r["raised"] and "model.norm.weight (ranks [1] differ from rank 0)" in r["raised"]


def test_ranks_given_different_prompts_are_refused():
    for r in results():
        assert "input_ids differs from rank 0's on ranks [1]" in r["inputs"]
        assert "input_ids differs from rank 0's on ranks [1]" in r["generate"]


def test_a_deep_copy_of_a_split_model_is_still_known_for_what_it_is():
    """Clipping and the audit read each parameter's tags; a deep copy must not lose them (a copy
    counting replicated tensors on every rank would clip by a larger norm; its audit would call
    every shard drifted)."""
    for (original, copied), audit_ok, same_count in dist.launch(W.deepcopy_worker, 2, deadline=120):
        assert copied == pytest.approx(original, rel=1e-12)
        assert audit_ok and same_count


def test_a_training_step_with_audit_names_drift_and_different_batches():
    """What train_step(audit=True) catches: replicas an optimizer moved differently on one rank
    (named after the step), and ranks fed different batches (refused before it); the latter also
    without audit=, by default."""
    for out in dist.launch(W.training_audit_worker, 2, deadline=120):
        assert out["clean"]
        assert out["lr"] is not None and "norm.weight" in out["lr"] and "ranks [1]" in out["lr"], out["lr"]
        assert out["batch"] is not None and "input_ids differs from rank 0's on ranks [1]" in out["batch"], out["batch"]
        # without audit=: the batch check train_step makes by default (one 16-byte all-reduce)
        assert out["default"] is not None and "ranks [1]" in out["default"], out["default"]
