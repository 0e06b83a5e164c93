"""N-d partition (even, pad, remainder) and split_matmul along every axis, against the unsplit array.

Float comparisons use matmul_error_bound (2 gamma_{k+2} |X| |W|, Higham eq. 3.5; see
test_reference_seed.py), with k the padded contraction length where padding lengthens it.
"""
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorpar.reference import (CommLog, matmul_error_bound, partition, partition_bounds, per_partition,
                                 split_matmul, unpartition)

FAST = settings(max_examples=30, deadline=None)
MODES = ["even", "pad", "remainder"]


@st.composite
def array_axis_p(draw, mode):
    """An N-d int array, an axis (maybe negative) and p, even-divisible when mode is "even"."""
    p = draw(st.integers(1, 5))
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    shape[axis] = p * draw(st.integers(1, 3)) if mode == "even" else draw(st.integers(0, 11))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.integers(1, 100, size=shape), axis, p  # entries >= 1 so padding (0) is visible


@FAST
@given(n=st.integers(0, 40), p=st.integers(1, 9), mode=st.sampled_from(MODES))
def test_bounds_tile_the_axis_in_rank_order(n, p, mode):
    if mode == "even" and (n < p or n % p):
        with pytest.raises(ValueError, match=f"has {n} elements, which do not divide evenly into p={p}"):
            partition_bounds(n, p, mode)
        return
    bounds = partition_bounds(n, p, mode)
    assert len(bounds) == p and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [stop - start for start, stop in bounds]
    if mode == "even":
        assert sizes == [n // p] * p
    elif mode == "remainder":
        assert sizes == [n // p + 1] * (n % p) + [n // p] * (p - n % p)
    else:  # docs/architecture.md: per = ceil(n/p); rank r owns [r*per, min((r+1)*per, n))
        per = math.ceil(n / p)
        assert per_partition(n, p) == per
        assert bounds == [(min(r * per, n), min((r + 1) * per, n)) for r in range(p)]


def test_pad_policy_worked_examples():
    assert partition_bounds(10, 4, "pad") == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert partition_bounds(5, 4, "pad") == [(0, 2), (2, 4), (4, 5), (5, 5)]  # rank 3: padding only
    assert partition_bounds(10, 4, "remainder") == [(0, 3), (3, 6), (6, 8), (8, 10)]
    shards = partition(np.arange(1, 6), 4, mode="pad")
    assert [s.tolist() for s in shards] == [[1, 2], [3, 4], [5, 0], [0, 0]]


@FAST
@given(st.sampled_from(MODES).flatmap(lambda m: st.tuples(st.just(m), array_axis_p(m))))
def test_partition_round_trips(case):
    mode, (x, axis, p) = case
    shards = partition(x, p, axis=axis, mode=mode)
    n = x.shape[axis]
    assert len(shards) == p
    for shard, (start, stop) in zip(shards, partition_bounds(n, p, mode)):
        real = np.take(shard, np.arange(stop - start), axis=axis)
        assert np.array_equal(real, np.take(x, np.arange(start, stop), axis=axis))
        if mode == "pad":
            assert shard.shape[axis] == per_partition(n, p)
            assert not np.take(shard, np.arange(stop - start, shard.shape[axis]), axis=axis).any()
    assert np.array_equal(unpartition(shards, axis=axis, size=n), x)
    if mode != "pad":
        assert np.array_equal(unpartition(shards, axis=axis), x)


def test_shards_are_copies():
    x = np.arange(8.0)
    shards = partition(x, 2)
    shards[0][0] = 99
    assert x[0] == 0


@pytest.mark.parametrize("call, message", [
    (lambda: partition(np.ones((3, 10)), 4, axis=1), "axis 1 of x (shape (3, 10)) has 10 elements, which do not "
                                                      "divide evenly into p=4 non-empty shards; valid p: 1, 2, 5, 10; "
                                                      "or use mode='pad' or mode='remainder'"),
    (lambda: partition(np.ones(3), 4), "has 3 elements, which do not divide evenly into p=4"),
    (lambda: partition(np.ones(0), 1), "has 0 elements, which do not divide evenly into p=1 non-empty shards; "
                                       "valid p: none (the axis is empty)"),
    (lambda: partition(np.ones((2, 2)), 2, axis=2), "axis must be an integer in -2..1 for x with 2 axes, got 2"),
    (lambda: partition(np.ones((2, 2)), 2, axis=1.0), "got 1.0"),
    (lambda: partition(np.ones(4), 2, mode="ceil"), "mode must be one of 'even', 'pad', 'remainder'; got 'ceil'"),
    (lambda: partition(np.ones(4), 0), "p must be a positive integer"),
    (lambda: partition(np.array(["a", "b"]), 2), "x must be a numeric array"),
    (lambda: partition_bounds(-1, 2), "n must be a sequence of non-negative integers"),
    (lambda: unpartition([]), "shards must hold at least one array, got none"),
    (lambda: unpartition([np.ones(2)], size=3), "size (3) exceeds the 2 elements the shards hold on axis 0"),
])
def test_partition_errors(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


# --- split_matmul: a contraction split along a chosen axis -----------------------------------

@st.composite
def matmul_split_case(draw):
    mode = draw(st.sampled_from(MODES))
    axis = draw(st.sampled_from(["out", "in", "batch", 1]))
    p = draw(st.integers(1, 4))
    lead = [draw(st.integers(1, 6)), draw(st.integers(1, 3))]
    k, n = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    if mode == "even":  # make the split axis a multiple of p
        size = p * draw(st.integers(1, 3))
        if axis == "in":
            k = size
        elif axis == "out":
            n = size
        else:
            lead[0 if axis == "batch" else 1] = size
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.standard_normal((*lead, k)), rng.standard_normal((k, n)), p, axis, mode


@FAST
@given(matmul_split_case())
def test_split_matmul_equals_unsplit_on_every_axis_and_mode(case):
    X, W, p, axis, mode = case
    log = CommLog()
    Y = split_matmul(X, W, p, axis, mode=mode, log=log)
    dense = X @ W
    k_terms = per_partition(W.shape[0], p) * p if (axis == "in" and mode == "pad") else None
    assert Y.shape == dense.shape
    assert np.all(np.abs(Y - dense) <= matmul_error_bound(X, W, k_terms))
    expected_op = "all_reduce" if axis == "in" else "all_gather"
    assert log.ops() == [expected_op]
    N = log.records[0].payload_bytes
    if axis == "in":
        assert N == dense.nbytes and log.bytes_sent_per_rank() == [2 * (p - 1) * N / p] * p
    else:  # the gathered tensor includes any padding; rank r forwards every chunk but rank r+1's
        n_d = dense.shape[{"out": -1, "batch": 0, 1: 1}[axis]]
        sizes = ([per_partition(n_d, p)] * p if mode == "pad"
                 else [stop - start for start, stop in partition_bounds(n_d, p, mode)])
        row_bytes = dense.nbytes // n_d
        assert N == row_bytes * sum(sizes)
        assert log.bytes_sent_per_rank() == [N - row_bytes * sizes[(r + 1) % p] for r in range(p)]


@pytest.mark.parametrize("mode", ["pad", "remainder"])
@pytest.mark.parametrize("axis", ["out", "in", "batch", 1])
def test_split_matmul_uneven_sizes_give_the_exact_shape_and_values(axis, mode):
    """Every axis has 5 elements over p = 4: pad gives shards of 2 (the last all padding)."""
    rng = np.random.default_rng(0)
    X, W = rng.integers(-9, 9, (5, 5, 5)), rng.integers(-9, 9, (5, 5))
    assert np.array_equal(split_matmul(X, W, 4, axis, mode=mode), X @ W)


def test_split_matmul_pad_on_the_contracted_axis_adds_zero():
    X, W = np.arange(1, 6)[None, :], np.arange(1, 11).reshape(5, 2)  # k = 5 over p = 4: per 2, one all-pad rank
    assert np.array_equal(split_matmul(X, W, 4, "in", mode="pad"), X @ W)
    assert np.array_equal(split_matmul(X, W, 4, "in", mode="remainder"), X @ W)


@pytest.mark.parametrize("call, message", [
    (lambda: split_matmul(np.ones((2, 4)), np.ones((4, 6)), 4, "out"), "the column axis of W (out) has 6 elements"),
    (lambda: split_matmul(np.ones((2, 6)), np.ones((6, 4)), 4, "in"), "the contracted axis (X's last, W's rows) has 6"),
    (lambda: split_matmul(np.ones((3, 4)), np.ones((4, 4)), 2, "batch"), "axis 0 of X (shape (3, 4)) has 3 elements"),
    (lambda: split_matmul(np.ones((2, 4)), np.ones((4, 4)), 2, "rows"),
     "axis must be one of ['out', 'in', 'batch', 0] for X of shape (2, 4), got 'rows'"),
    (lambda: split_matmul(np.ones(4), np.ones((4, 4)), 2, "batch"), "axis must be one of ['out', 'in'] for X of shape (4,)"),
    (lambda: split_matmul(np.ones((2, 4)), np.ones((4, 4)), 2, 1), "got 1"),
    (lambda: split_matmul(np.ones((2, 4)), np.ones((4, 4)), 2, "out", mode="ceil"), "mode must be one of"),
    (lambda: split_matmul(np.ones((2, 4)), np.ones((3, 4)), 2, "out"), "shapes do not chain"),
    (lambda: split_matmul(np.ones((2, 4)), np.ones((4, 4)), 2, "out", log={}), "log must be a CommLog or None"),
])
def test_split_matmul_errors(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()
