"""`verify`'s comparison, without ranks: what it calls ok and what it calls diverged.

The cases are the two ways the first version judged wrongly: rounding noise on a gradient whose
exact value is ~0 (a key bias) called a divergence, and a parameter whose gradient the split
lost called ok. Each is built by hand, so the expected verdict does not come from the code under
test: a float32 gradient is rounding noise around a float64 value, a wrong one is not.
"""
import torch

from tensorpar.jobs.verify import LayerCheck, TPCheck, _excess, _param_grads, rounding_factor
from tensorpar.sharding.spec import ShardSpec

TOL = 1e-5  # float32's tolerance
FACTOR = rounding_factor(2)


def _param(name, grad, spec=None):
    p = torch.nn.Parameter(torch.zeros(grad.shape, dtype=grad.dtype))
    p.grad = grad
    p.tp_spec = spec or ShardSpec(name)
    return p


def _noise(scale, n=96, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def test_rounding_noise_on_a_vanishing_gradient_is_not_a_divergence():
    """Exact 1e-18, unsplit and split float32 each off by rounding noise ~1e-9: their relative
    difference is O(1), but the split is as accurate as the unsplit model."""
    exact = _noise(1e-18)
    dense, split = exact + _noise(1e-9, seed=1), exact + _noise(1e-9, seed=2)
    rel = (split - dense).abs().max().item() / dense.abs().max().item()
    assert rel > TOL
    assert _excess(rel, split, dense, exact, TOL, FACTOR) <= 1


def test_an_error_far_above_rounding_is_a_divergence():
    """The same tensor with the split off by 1e-3 of its size (a partial reduction would be O(1))."""
    exact = _noise(1.0)
    dense = exact + _noise(1e-7, seed=1)
    split = exact * (1 + 1e-3)
    rel = (split - dense).abs().max().item() / dense.abs().max().item()
    assert _excess(rel, split, dense, exact, TOL, FACTOR) > 1
    # and where the split's error is the factor times the unsplit's, exactly at the bound
    split = exact + FACTOR * (dense - exact)
    assert abs(_excess(1.0, split, dense, exact, TOL, FACTOR) - 1.0) < 1e-9


def test_without_a_float64_reference_only_the_tolerance_counts():
    dense = _noise(1e-9)
    split = dense + _noise(1e-9, seed=3)
    assert _excess(0.5, split, dense, None, TOL, FACTOR) > 1


def test_a_lost_gradient_is_infinitely_wrong():
    dense = {"w": _param("w", _noise(1.0))}
    lost = _param("w", _noise(1.0))
    lost.grad = None
    assert _param_grads([lost], dense, None, TOL, FACTOR) == (float("inf"), float("inf"))
    kept = _param("w", dense["w"].grad.clone())
    assert _param_grads([kept], dense, None, TOL, FACTOR) == (0.0, 0.0)


def test_a_shard_is_compared_with_its_own_slice():
    full = _noise(1.0, n=8)
    dense = {"w": _param("w", full)}
    second_half = _param("w", full[4:].clone(), ShardSpec("w", 0, ((4, 8),)))
    assert _param_grads([second_half], dense, None, TOL, FACTOR)[0] == 0.0
    wrong_half = _param("w", full[:4].clone(), ShardSpec("w", 0, ((4, 8),)))
    assert _param_grads([wrong_half], dense, None, TOL, FACTOR)[0] > 1e-3


def test_the_rounding_allowance_counts_the_roundings_the_split_adds():
    """p partial sums rounded, then p - 1 roundings in the all-reduce: 2p - 1 where the unsplit
    matmul makes one (times 4 for the spread of the norms)."""
    assert [rounding_factor(p) for p in (1, 2, 4, 8)] == [4.0, 12.0, 28.0, 60.0]


def test_rounding_errors_are_compared_as_norms_not_maxima():
    """The unsplit model's largest rounding error and the split's fall on different elements: one
    element 20x the other's largest, the norms alike, is rounding (seen in bfloat16 on apertus);
    the same outlier on every element is not."""
    exact = _noise(1.0, n=400)
    dense = exact + _noise(1e-2, n=400, seed=1)  # bfloat16-like rounding, 1% of the values
    noise = _noise(1e-2, n=400, seed=2)
    noise[7] = 20 * (dense - exact).abs().max().item()
    split = exact + noise
    rel = (split - dense).abs().max().item() / dense.abs().max().item()
    assert rel > 5e-2 and _excess(rel, split, dense, exact, 5e-2, FACTOR) <= 1
    everywhere = exact + 20 * (dense - exact).abs().max().item() * torch.sign(noise)
    rel = (everywhere - dense).abs().max().item() / dense.abs().max().item()
    assert _excess(rel, everywhere, dense, exact, 5e-2, FACTOR) > 1


def test_a_layer_is_ok_only_when_both_questions_say_so():
    """Rounds like the unsplit model but wrong in float64 (a fault rounding hides in bfloat16):
    not ok; and the first divergence is the first block whose float64 output departs, not the
    last layer the gradients reach."""
    assert not LayerCheck.judged("block 0", 0.0, 0.0, 0.0, excess=0.5, structure=5.0).ok
    assert not LayerCheck.judged("block 0", 0.0, 0.0, 0.0, excess=5.0, structure=0.5).ok
    assert LayerCheck.judged("block 0", 0.0, 0.0, 0.0, excess=0.5, structure=0.5).ok
    check = TPCheck(tp=2, tolerance_rel=5e-2)
    check.layers = [LayerCheck.judged("embeddings", 0.0, 0.0, 0.0, 0.5, 3.0, 0.0),
                    LayerCheck.judged("block 0", 0.0, 0.0, 0.0, 0.5, 0.5, 0.0),
                    LayerCheck.judged("block 1", 1e-3, 0.0, 0.0, 0.5, 40.0, 20.0),
                    LayerCheck.judged("block 2", 1e-3, 0.0, 0.0, 0.5, 30.0, 15.0)]
    assert check.first_divergence == "block 1"
