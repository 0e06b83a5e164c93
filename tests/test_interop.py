"""PyTorch's own tensor parallelism and Hugging Face's ``tp_plan`` on the groups ``dist.launch``
makes by default (the shared-memory backend): DTensor's redistribute, functional collectives,
``parallelize_module`` and ``from_pretrained(tp_plan="auto")`` all equal the dense computation,
while tensorpar's own collectives still travel over shared memory. Before, the first three raised
"No backend type associated with device type cpu" and tp_plan="auto" loaded an unsplit model (it
reads its world from torchrun's variables)."""
import pytest

from tensorpar import distributed as dist
from tests import _interop_workers as W

pytestmark = pytest.mark.multirank

# float64 throughout: the split sums partial products in another order, a few ulps of 1
EXACT = 1e-12


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tensorpar.models.tiny import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("interop") / "llama", "llama")
    return dist.launch(W.pytorch_apis_worker, 2, str(path), deadline=300)


def test_dtensor_and_functional_collectives_on_the_default_group(results):
    for out in results:
        assert out["transport"] == "shm", out
        assert out["redistribute"] == 0.0 and out["functional_all_reduce"] == 0.0, out
        assert out["reduce_scatter"] == 0.0, out


def test_dtensors_all_gather_and_reduce_scatter_run_in_the_groups_python_not_in_gloo_from_cpp(results):
    """DTensor's redistribute (Shard -> Replicate, Partial -> Shard) calls the group's coalesced
    all-gather and reduce-scatter from C++ with the GIL held. ProcessGroup's own queued them into
    gloo there, and 1 launch in ~150 deadlocked (gloo's worker took the GIL to free a finished
    call's tensors under its queue's lock; the rank was named unresponsive after 30 s). Served by
    the group's Python methods, each is in the ledger. Catches: either method removed."""
    for out in results:
        assert out["functional_ledger"] == [("all_gather", 2), ("reduce_scatter", 2)], out


def test_parallelize_module_colwise_rowwise_mlp_equals_the_dense_one(results):
    for out in results:
        mlp = out["mlp"]
        assert mlp["sharded"], mlp
        assert max(mlp["forward"], mlp["input_grad"], mlp["weight_grads"]) <= EXACT, mlp


def test_hugging_face_tp_plan_auto_splits_and_equals_the_dense_model(results):
    for out in results:
        assert out["hf_tp_plan"]["sharded"] and out["hf_tp_plan"]["logits"] <= EXACT, out["hf_tp_plan"]


def test_tensorpars_own_collectives_still_travel_over_shared_memory(results):
    for out in results:
        assert out["own_over_shm"] and out["own_sum"] == [2.0] * 4, out
