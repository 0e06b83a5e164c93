"""Partition-axis advice: it picks a feasible axis (>= p elements, divides evenly) with the least
data movement, and every option's bytes equal the ring formulas and what the simulation logs."""
import json
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorpar.reference import (CommLog, advise_matmul, advise_mlp, feasible_axes, mlp_tensor_parallel,
                                 ring_allreduce_bytes, split_matmul)

FAST = settings(max_examples=40, deadline=None)
DTYPES = {2: np.float16, 4: np.float32, 8: np.float64}


def divides(n, p):
    return n >= p and n % p == 0


@FAST
@given(p=st.integers(1, 8), lead=st.lists(st.integers(1, 12), max_size=2), k=st.integers(1, 24),
       n=st.integers(1, 24), itemsize=st.sampled_from([2, 4, 8]), output=st.sampled_from(["replicated", "sharded"]))
def test_matmul_advice_picks_the_cheapest_feasible_axis(p, lead, k, n, itemsize, output):
    advice = advise_matmul((*lead, k), (k, n), p, itemsize=itemsize, output=output)
    y, w = math.prod(lead) * n * itemsize, k * n * itemsize
    gather = 0 if output == "sharded" else (p - 1) * y / p
    expected = {"out": (n, gather, w / p),
                "in": (k, (1 if output == "sharded" else 2) * (p - 1) * y / p, w / p)}
    if lead:
        expected["batch"] = (lead[0], gather, w)
    assert [o.axis for o in advice.options] == list(expected)
    for o in advice.options:
        size, sent, weights = expected[o.axis]
        assert o.sizes == (size,) and o.feasible == divides(size, p)
        assert o.bytes_sent_per_rank == sent and o.weight_bytes_per_device == weights
    feasible = [o for o in advice.options if o.feasible]
    if not feasible:
        assert advice.choice is None and advice.why.startswith("no split is feasible")
        return
    chosen = advice.option(advice.choice)
    assert divides(chosen.sizes[0], p)
    assert (chosen.bytes_sent_per_rank, chosen.weight_bytes_per_device) == min(
        (o.bytes_sent_per_rank, o.weight_bytes_per_device) for o in feasible)
    assert chosen.what in advice.why


@FAST
@given(p=st.integers(1, 4), lead=st.lists(st.integers(1, 4), min_size=1, max_size=2), k=st.integers(1, 8),
       n=st.integers(1, 8), itemsize=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**32 - 1))
def test_matmul_advice_bytes_are_what_the_simulation_logs(p, lead, k, n, itemsize, seed):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((*lead, k)).astype(DTYPES[itemsize])
    W = rng.standard_normal((k, n)).astype(DTYPES[itemsize])
    advice = advise_matmul(X.shape, W.shape, p, itemsize=itemsize)
    for option in advice.options:
        if option.feasible:
            log = CommLog()
            split_matmul(X, W, p, option.axis, log=log)
            assert log.ops() == [c.op for c in option.collectives]
            assert log.bytes_sent_per_rank() == [option.bytes_sent_per_rank] * p


@FAST
@given(p=st.integers(1, 8), lead=st.lists(st.integers(1, 8), min_size=1, max_size=2), k=st.integers(1, 24),
       f=st.integers(1, 40), o=st.integers(1, 24))
def test_mlp_advice_costs_follow_the_formulas(p, lead, k, f, o):
    advice = advise_mlp((*lead, k), (k, f), (f, o), p)
    h, y, m = math.prod(lead) * f * 8, math.prod(lead) * o * 8, p - 1
    expected = {"out,in": ((f,), 2 * m * y / p), "out,out": ((f, o), m * h / p + m * y / p),
                "in,in": ((k, f), 2 * m * h / p + 2 * m * y / p), "in,out": ((k, o), 2 * m * h / p + m * y / p)}
    for opt in advice.options:
        sizes, sent = expected[opt.axis]
        assert opt.sizes == sizes and opt.feasible == all(divides(s, p) for s in sizes)
        assert opt.bytes_sent_per_rank == pytest.approx(sent, rel=1e-15)
        assert opt.weight_bytes_per_device == (k * f + f * o) * 8 / p
    feasible = [opt for opt in advice.options if opt.feasible]
    if feasible:
        assert advice.option(advice.choice).bytes_sent_per_rank == min(opt.bytes_sent_per_rank for opt in feasible)
    else:
        assert advice.choice is None


def test_mlp_advice_picks_megatron_and_matches_the_logged_all_reduce():
    X = np.ones((2, 16, 64))
    W1, W2 = np.ones((64, 256)), np.ones((256, 64))
    advice = advise_mlp(X.shape, W1.shape, W2.shape, 4)
    assert advice.choice == "out,in"
    log = CommLog()
    mlp_tensor_parallel(X, W1, W2, 4, log=log)
    assert log.bytes_sent_per_rank() == [advice.option("out,in").bytes_sent_per_rank] * 4
    assert advice.option("out,in").bytes_sent_per_rank == ring_allreduce_bytes(16_384, 4) == 24_576
    assert "alternatives: out,out: 61440 bytes" in advice.why
    json.dumps(advice.to_dict())


def test_advice_avoids_an_axis_that_does_not_divide():
    advice = advise_matmul((8, 6), (6, 10), 4)  # out = 10 does not divide by 4; in = 6 neither; batch = 8 does
    assert advice.choice == "batch"
    assert not advice.option("out").feasible and "10 elements do not split into 4" in advice.option("out").reason
    none = advise_matmul((3, 5), (5, 7), 2)
    assert none.choice is None and "no split is feasible" in none.why


def test_feasible_axes():
    assert feasible_axes((3, 8, 5, 4), 4) == [1, 3]
    assert feasible_axes((2, 3), 4) == []
    assert feasible_axes((7,), 1) == [0]
    assert feasible_axes((0, 4), 2) == [1]  # an empty axis gives empty shards: not a split


def test_an_empty_axis_is_not_feasible():
    advice = advise_matmul((0, 4), (4, 8), 2)
    assert not advice.option("batch").feasible and advice.choice == "out"


@pytest.mark.parametrize("call, message", [
    (lambda: advise_matmul((3, 5), (4, 6), 2), "shapes do not chain: advise_matmul: X's last axis is 5 but W's rows is 4"),
    (lambda: advise_matmul((), (4, 6), 2), "x_shape needs at least 1 axis and w_shape exactly 2"),
    (lambda: advise_matmul((3, 4), (4, 6, 1), 2), "got (3, 4) and (4, 6, 1)"),
    (lambda: advise_matmul((3, -4), (4, 6), 2), "x_shape must be a sequence of non-negative integers, got (3, -4)"),
    (lambda: advise_matmul((3, 4), (4, 6), 0), "p must be a positive integer (the number of devices), got 0"),
    (lambda: advise_matmul((3, 4), (4, 6), 2, itemsize=0), "itemsize must be a positive integer"),
    (lambda: advise_matmul((3, 4), (4, 6), 2, output="gathered"),
     "output must be one of 'replicated', 'sharded'; got 'gathered'"),
    (lambda: advise_mlp((3, 4), (4, 6), (5, 2), 2), "W1's columns is 6 but W2's rows is 5"),
    (lambda: advise_mlp((3, 4), (4, 6), (6,), 2), "w2_shape must have 2 axes, got (6,)"),
    (lambda: advise_matmul((3, 4), (4, 6), 2).option("rows"), "no option 'rows'; options: ['out', 'in', 'batch']"),
    (lambda: feasible_axes(5, 2), "shape must be a sequence of non-negative integers, got 5"),
])
def test_advice_errors(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()
