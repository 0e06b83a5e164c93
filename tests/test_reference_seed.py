"""The seed API (tensorpar.reference.seed, .matvec, .costs, .bounds) against the unsplit computation.

Tolerance: a split and the unsplit product are two orderings of the same inner products, so by
Higham eq. (3.5) they differ by at most 2 gamma_{k+2} |X| |W| elementwise (k the contraction
length, gamma_n ~ n * 2**-53): a few ulps times k, computed per element by matmul_error_bound /
mlp_error_bound. test_bounds_hold_against_exact_arithmetic checks that bound against exact
rational arithmetic. Integer inputs must match exactly.
"""
import re
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from tensorpar.reference import (CommLog, colwise_matvec, column_parallel, matmul_error_bound,
                                 mlp_error_bound, mlp_tensor_parallel, ring_allreduce_bytes,
                                 row_parallel, rowwise_matvec, shard_bytes)

FAST = settings(max_examples=30, deadline=None)


@st.composite
def matmul_case(draw, split_axis):
    """(X, W, p) with X: (*lead, k), W: (k, n) and the split axis a multiple of p."""
    p = draw(st.integers(1, 5))
    lead = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    k = p * draw(st.integers(1, 4)) if split_axis == "in" else draw(st.integers(1, 9))
    n = p * draw(st.integers(1, 4)) if split_axis == "out" else draw(st.integers(1, 9))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.standard_normal((*lead, k)), rng.standard_normal((k, n)), p


def assert_within(split, dense, bound):
    assert split.shape == dense.shape and split.dtype == dense.dtype
    assert np.all(np.abs(split - dense) <= bound), np.max(np.abs(split - dense) - bound)


@FAST
@given(matmul_case("out"))
def test_column_parallel_equals_unsplit_with_one_all_gather(case):
    X, W, p = case
    log = CommLog()
    Y = column_parallel(X, W, p, log=log)
    assert_within(Y, X @ W, matmul_error_bound(X, W))
    assert log.ops() == ["all_gather"]
    rec = log.records[0]
    assert rec.payload_bytes == Y.nbytes and rec.shape == Y.shape
    assert rec.bytes_sent == ((p - 1) * Y.nbytes / p,) * p


@FAST
@given(matmul_case("in"))
def test_row_parallel_equals_unsplit_with_one_all_reduce(case):
    X, W, p = case
    log = CommLog()
    Y = row_parallel(X, W, p, log=log)
    assert_within(Y, X @ W, matmul_error_bound(X, W))
    assert log.ops() == ["all_reduce"]
    assert log.records[0].bytes_sent == (2 * (p - 1) * Y.nbytes / p,) * p


@FAST
@given(p=st.integers(1, 4), lead=st.lists(st.integers(0, 3), max_size=2), k=st.integers(1, 8),
       f_per=st.integers(1, 4), n=st.integers(1, 8), bias=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_mlp_tensor_parallel_equals_unsplit_with_exactly_one_all_reduce(p, lead, k, f_per, n, bias, seed):
    rng = np.random.default_rng(seed)
    X, W1, W2 = rng.standard_normal((*lead, k)), rng.standard_normal((k, p * f_per)), rng.standard_normal((p * f_per, n))
    b1, b2 = (rng.standard_normal(p * f_per), rng.standard_normal(n)) if bias else (None, None)
    log = CommLog()
    Y = mlp_tensor_parallel(X, W1, W2, p, b1=b1, b2=b2, log=log)
    dense = np.maximum(X @ W1 + (0 if b1 is None else b1), 0) @ W2 + (0 if b2 is None else b2)
    assert_within(Y, dense, mlp_error_bound(X, W1, W2, b1, b2))
    assert log.ops() == ["all_reduce"]
    assert log.records[0].payload_bytes == Y.nbytes
    assert log.bytes_sent_per_rank() == [ring_allreduce_bytes(Y.nbytes, p)] * p


@FAST
@given(p=st.integers(1, 4), m_per=st.integers(1, 4), n_per=st.integers(1, 4), k=st.sampled_from([None, 1, 3]),
       seed=st.integers(0, 2**32 - 1))
def test_integer_inputs_split_exactly(p, m_per, n_per, k, seed):
    rng = np.random.default_rng(seed)
    X = rng.integers(-50, 50, (3, p * m_per))
    W = rng.integers(-50, 50, (p * m_per, p * n_per))
    W2 = rng.integers(-50, 50, (p * n_per, 2))
    assert np.array_equal(column_parallel(X, W, p), X @ W)
    assert np.array_equal(row_parallel(X, W, p), X @ W)
    assert np.array_equal(mlp_tensor_parallel(X, W, W2, p), np.maximum(X @ W, 0) @ W2)
    x = rng.integers(-50, 50, (p * n_per,) if k is None else (p * n_per, k))
    assert np.array_equal(rowwise_matvec(W, x, p), W @ x)
    assert np.array_equal(colwise_matvec(W, x, p), W @ x)


@FAST
@given(p=st.integers(1, 4), m_per=st.integers(1, 4), n_per=st.integers(1, 4), k=st.sampled_from([None, 1, 3]),
       seed=st.integers(0, 2**32 - 1))
def test_column_vector_convention_swaps_the_names(p, m_per, n_per, k, seed):
    """y = W x: a row split of W is the row-vector column split of W.T, and vice versa."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((p * m_per, p * n_per))
    x = rng.standard_normal((p * n_per,) if k is None else (p * n_per, k))
    gathered, reduced = CommLog(), CommLog()
    y_rows = rowwise_matvec(W, x, p, log=gathered)
    y_cols = colwise_matvec(W, x, p, log=reduced)
    bound = matmul_error_bound(W, x)
    assert_within(y_rows, W @ x, bound)
    assert_within(y_cols, W @ x, bound)
    assert_within(y_rows, column_parallel(x.T, W.T, p).T, bound)
    assert_within(y_cols, row_parallel(x.T, W.T, p).T, bound)
    assert gathered.ops() == ["all_gather"] and reduced.ops() == ["all_reduce"]
    assert reduced.records[0].bytes_sent[0] == 2 * gathered.records[0].bytes_sent[0]


def test_worked_numbers_of_the_source_exercise():
    assert shard_bytes(14_000_000_000, 4) == 3_500_000_000
    assert shard_bytes(14e9, 4) == 3.5e9
    assert ring_allreduce_bytes(16_384, 4) == 24_576
    assert isinstance(ring_allreduce_bytes(16_384, 4), int)
    assert ring_allreduce_bytes(10, 4) == 15 and ring_allreduce_bytes(1, 3) == pytest.approx(4 / 3)


def test_a_row_split_combines_by_sum():
    X = np.array([[1.0, 2.0, 3.0, 4.0]])
    W = np.arange(8.0).reshape(4, 2)
    partials = [X[:, :2] @ W[:2], X[:, 2:] @ W[2:]]
    log = CommLog()
    assert np.array_equal(row_parallel(X, W, 2, log=log), partials[0] + partials[1])
    assert np.array_equal(partials[0] + partials[1], X @ W)  # [[40, 50]]: small integers, exact
    assert log.ops() == ["all_reduce"]


def test_top_level_exports_are_the_reference_functions():
    for name in ("column_parallel", "row_parallel", "mlp_tensor_parallel", "shard_bytes", "ring_allreduce_bytes"):
        assert getattr(tensorpar, name) is getattr(tensorpar.reference, name)


def test_numpy_integer_p_and_a_1d_x_are_accepted():
    X, W = np.arange(4.0), np.arange(8.0).reshape(4, 2)
    assert np.array_equal(column_parallel(X, W, np.int64(2)), X @ W)
    assert np.array_equal(row_parallel(X, W, np.int32(4)), X @ W)


# --- every ValueError path -------------------------------------------------------------------

X34, W46, W63 = np.ones((3, 4)), np.ones((4, 6)), np.ones((6, 3))
SEED_CALLS = {
    "column_parallel": lambda p: column_parallel(X34, W46, p),
    "row_parallel": lambda p: row_parallel(X34, W46, p),
    "mlp_tensor_parallel": lambda p: mlp_tensor_parallel(X34, W46, W63, p),
    "rowwise_matvec": lambda p: rowwise_matvec(W46.T, np.ones(4), p),
    "colwise_matvec": lambda p: colwise_matvec(W46, np.ones(6), p),
}


@pytest.mark.parametrize("fn", SEED_CALLS)
@pytest.mark.parametrize("p", [0, -1, 2.5, 2.0, True, False, "2", None])
def test_p_must_be_a_positive_integer(fn, p):
    with pytest.raises(ValueError, match=r"p must be a positive integer.*got " + re.escape(repr(p))):
        SEED_CALLS[fn](p)


@pytest.mark.parametrize("call, message", [
    (lambda: column_parallel(X34, W46, 4), "the column axis of W (out) has 6 elements, which do not divide evenly into p=4"),
    (lambda: column_parallel(X34, np.ones((4, 2)), 4), "has 2 elements, which do not divide evenly into p=4"),
    (lambda: row_parallel(X34, W46, 3), "the row axis of W (in) has 4 elements, which do not divide evenly into p=3"),
    (lambda: mlp_tensor_parallel(X34, W46, W63, 4), "the hidden axis (W1's columns, W2's rows) has 6 elements"),
    (lambda: rowwise_matvec(W46, np.ones(6), 3), "the row axis of W (m) has 4 elements"),
    (lambda: colwise_matvec(W46, np.ones(6), 4), "the column axis of W (n) has 6 elements"),
])
def test_uneven_splits_are_refused_with_the_valid_p(call, message):
    with pytest.raises(ValueError, match=re.escape(message) + r".*valid p: 1, "):
        call()


@pytest.mark.parametrize("call, message", [
    (lambda: column_parallel(np.ones((3, 5)), W46, 2), "X's last axis (shape (3, 5)) is 5 but W's rows (shape (4, 6)) is 4"),
    (lambda: row_parallel(np.ones((2, 3, 5)), W46, 2), "X's last axis (shape (2, 3, 5)) is 5"),
    (lambda: mlp_tensor_parallel(np.ones((3, 5)), W46, W63, 2), "is 5 but W's rows (shape (4, 6)) is 4"),
    (lambda: mlp_tensor_parallel(X34, W46, np.ones((4, 3)), 2), "W1's columns (shape (4, 6)) is 6 but W2's rows (shape (4, 3)) is 4"),
    (lambda: rowwise_matvec(W46, np.ones(5), 2), "W's columns (shape (4, 6)) is 6 but x's rows (shape (5,)) is 5"),
])
def test_shapes_that_do_not_chain_are_refused(call, message):
    with pytest.raises(ValueError, match="shapes do not chain: .*" + re.escape(message)):
        call()


@pytest.mark.parametrize("bad", [np.array([[object()] * 4] * 3), np.full((3, 4), "a"),
                                 np.ones((3, 4), dtype=bool)], ids=["object", "str", "bool"])
def test_non_numeric_arrays_are_refused(bad):
    calls = [lambda: column_parallel(bad, W46, 2), lambda: column_parallel(X34, bad.reshape(4, 3), 2),
             lambda: row_parallel(bad, W46, 2), lambda: row_parallel(X34, bad.reshape(4, 3), 2),
             lambda: mlp_tensor_parallel(bad, W46, W63, 2),
             lambda: mlp_tensor_parallel(X34, bad.reshape(4, 3), W63, 2),
             lambda: mlp_tensor_parallel(X34, W46, bad.reshape(6, 2), 2),
             lambda: mlp_tensor_parallel(X34, W46, W63, 2, b1=bad.ravel()[:6]),
             lambda: rowwise_matvec(bad, np.ones(4), 2), lambda: colwise_matvec(W46, bad.ravel()[:6], 2)]
    for call in calls:
        with pytest.raises(ValueError, match=r"must be a numeric array .*got dtype " + re.escape(str(bad.dtype))):
            call()


def test_none_is_not_an_array():
    with pytest.raises(ValueError, match=r"X must be a numeric array .*got dtype object"):
        column_parallel(None, W46, 2)


@pytest.mark.parametrize("call, message", [
    (lambda: column_parallel(X34, np.ones(4), 2), "W must be 2-D, got shape (4,)"),
    (lambda: row_parallel(np.float64(1.0), W46, 2), "X must be at least 1-D, got shape ()"),
    (lambda: column_parallel([[1, 2], [3]], W46, 2), "X is not a rectangular numeric array"),
    (lambda: mlp_tensor_parallel(X34 + 0j, W46, W63, 2), "X must be a numeric array (integer or float dtype), got dtype complex128"),
    (lambda: mlp_tensor_parallel(X34, W46, W63, 2, b1=np.ones(3)), "b1 must have shape (6,), got (3,)"),
    (lambda: mlp_tensor_parallel(X34, W46, W63, 2, b2=np.ones((1, 3))), "b2 must have shape (3,), got (1, 3)"),
    (lambda: column_parallel(X34, W46, 2, log=[]), "log must be a CommLog or None, got list"),
    (lambda: colwise_matvec(W46, np.ones((6, 2, 2)), 2), "x must be 1-D (n,) or 2-D (n, k), got shape (6, 2, 2)"),
])
def test_malformed_inputs_are_refused(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


@pytest.mark.parametrize("fn", [shard_bytes, ring_allreduce_bytes])
@pytest.mark.parametrize("n, message", [
    (-1, "must be non-negative, got -1"), (-0.5, "must be non-negative, got -0.5"),
    (2.5, "must be a whole number of bytes, got 2.5"), (float("nan"), "must be a finite number of bytes, got nan"),
    (float("inf"), "must be a finite number of bytes, got inf"), (True, "got True of type bool"),
    ("16", "got '16' of type str"), (None, "got None of type NoneType"),
])
def test_byte_counts_must_be_non_negative_whole_numbers(fn, n, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(n, 4)
    with pytest.raises(ValueError, match="p must be a positive integer"):
        fn(16, 0)


# --- the tolerance itself --------------------------------------------------------------------

@settings(max_examples=10, deadline=None)
@given(p=st.integers(1, 4), k_per=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_bounds_hold_against_exact_arithmetic(p, k_per, seed):
    """Both the split and the unsplit result lie within half the bound of the exact product."""
    rng = np.random.default_rng(seed)
    X, W = rng.standard_normal((2, p * k_per)), rng.standard_normal((p * k_per, 3))
    exact = [[sum(Fraction(a) * Fraction(b) for a, b in zip(row, col)) for col in W.T] for row in X]
    half = matmul_error_bound(X, W) / 2
    for result in (X @ W, row_parallel(X, W, p)):
        for (i, j), value in np.ndenumerate(result):
            assert abs(Fraction(value) - exact[i][j]) <= Fraction(half[i, j])
    assert np.all(half <= 2 * (p * k_per + 2) * 2.0**-53 * (np.abs(X) @ np.abs(W)) * (1 + 1e-12))
