"""Simulated collectives and their byte log, checked against an explicit step-by-step ring.

The ring simulations below move chunks one hop at a time (rank r -> rank r+1) and count the bytes
each rank sends, independently of tensorpar.reference; the byte formulas and the logged bytes must
match what they count. Integer arrays make every sum exact.
"""
import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorpar.reference import (CommLog, all_gather, all_reduce, broadcast, reduce_scatter,
                                 ring_allgather_bytes, ring_allreduce_bytes, ring_broadcast_bytes,
                                 ring_reduce_scatter_bytes, shard_bytes)

FAST = settings(max_examples=30, deadline=None)


def ring_allreduce(arrays):
    """Reduce-scatter then all-gather over p equal chunks of the flattened arrays; returns (results, sent)."""
    p = len(arrays)
    chunks = [np.split(a.ravel().copy(), p) for a in arrays]  # chunks[rank][chunk]
    sent = [0] * p
    for step in range(p - 1):  # reduce-scatter: rank r sends chunk r-step, r+1 adds it
        msgs = [(r, (r - step) % p, chunks[r][(r - step) % p].copy()) for r in range(p)]
        for r, c, data in msgs:
            sent[r] += data.nbytes
            chunks[(r + 1) % p][c] += data
    for step in range(p - 1):  # all-gather: rank r owns reduced chunk r+1 and passes it on
        msgs = [(r, (r + 1 - step) % p, chunks[r][(r + 1 - step) % p].copy()) for r in range(p)]
        for r, c, data in msgs:
            sent[r] += data.nbytes
            chunks[(r + 1) % p][c] = data
    return [np.concatenate(c).reshape(arrays[0].shape) for c in chunks], sent


def ring_allgather(shards):
    """Each step rank r forwards to r+1 the chunk it got last step (its own first); returns (held, sent)."""
    p = len(shards)
    held = [{r: shards[r]} for r in range(p)]
    sent = [0] * p
    for step in range(p - 1):
        msgs = [(r, (r - step) % p) for r in range(p)]
        for r, c in msgs:
            sent[r] += held[r][c].nbytes
            held[(r + 1) % p][c] = held[r][c]
    return held, sent


@st.composite
def rank_arrays(draw, divisible_by_p=True):
    p = draw(st.integers(1, 6))
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    shape[-1] = p * draw(st.integers(1, 3)) if divisible_by_p else shape[-1]
    dtype = draw(st.sampled_from([np.int64, np.int32, np.int16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return [rng.integers(-1000, 1000, size=shape).astype(dtype) for _ in range(p)]


@FAST
@given(rank_arrays())
def test_all_reduce_sums_and_logs_the_ring_bytes(arrays):
    p, log = len(arrays), CommLog()
    results = all_reduce(arrays, log=log)
    ring_results, ring_sent = ring_allreduce(arrays)
    total = sum(arrays[1:], arrays[0])
    assert all(np.array_equal(r, total) and np.array_equal(r, q) for r, q in zip(results, ring_results))
    assert list(log.records[0].bytes_sent) == ring_sent == [ring_allreduce_bytes(total.nbytes, p)] * p
    assert log.records[0].payload_bytes == total.nbytes and log.records[0].shape == total.shape


@FAST
@given(p=st.integers(1, 6), sizes=st.lists(st.integers(0, 5), min_size=6, max_size=6), rows=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_all_gather_concatenates_and_logs_what_a_ring_sends(p, sizes, rows, seed):
    rng = np.random.default_rng(seed)
    shards = [rng.integers(0, 9, (rows, sizes[r])) for r in range(p)]  # unequal sizes on axis 1
    log = CommLog()
    results = all_gather(shards, axis=1, log=log)
    held, ring_sent = ring_allgather(shards)
    full = np.concatenate(shards, axis=1)
    assert all(np.array_equal(r, full) for r in results)
    assert all(sorted(h) == list(range(p)) for h in held)  # the simulated ring delivered every chunk
    assert list(log.records[0].bytes_sent) == ring_sent
    if len(set(sizes[:p])) == 1:
        assert ring_sent == [ring_allgather_bytes(full.nbytes, p)] * p


@FAST
@given(rank_arrays(), st.booleans())
def test_reduce_scatter_gives_rank_r_chunk_r_of_the_sum(arrays, first_axis):
    p, log = len(arrays), CommLog()
    axis = 0 if first_axis and arrays[0].shape[0] % p == 0 else -1
    results = reduce_scatter(arrays, axis=axis, log=log)
    total = sum(arrays[1:], arrays[0])
    for r, chunk in enumerate(np.split(total, p, axis=axis)):
        assert np.array_equal(results[r], chunk)
    _, ring_sent = ring_allreduce(arrays)  # a ring reduce-scatter is the first half of the ring all-reduce
    assert [2 * b for b in log.records[0].bytes_sent] == ring_sent
    assert list(log.records[0].bytes_sent) == [ring_reduce_scatter_bytes(total.nbytes, p)] * p


@pytest.mark.parametrize("p, src", [(1, 0), (2, 1), (4, 0), (4, 2), (5, 4)])
def test_broadcast_copies_src_and_the_chain_sends_p_minus_1_tensors(p, src):
    value = np.arange(6.0).reshape(2, 3)
    shards = [None] * p
    shards[src] = value
    log = CommLog()
    results = broadcast(shards, src=src, log=log)
    assert all(np.array_equal(r, value) for r in results)
    sent = list(log.records[0].bytes_sent)
    assert sent == ring_broadcast_bytes(value.nbytes, p, src)
    assert sum(sent) == (p - 1) * value.nbytes and sent[(src - 1) % p] == 0


def test_results_are_per_rank_copies():
    out = all_reduce([np.ones(2), np.ones(2)])
    out[0][0] = 7
    assert out[1][0] == 2


def test_comm_log_aggregates_and_serialises():
    log = CommLog()
    all_reduce([np.ones(4), np.ones(4)], log=log)                         # N = 32: 32 each
    all_gather([np.ones(2), np.ones(2), np.ones(2)], log=log)             # N = 48: 32 each
    broadcast([None, np.ones(1), None], src=1, log=log)                   # N = 8: ranks 1, 2 send
    assert len(log) == 3 and log.count() == 3 and log.count("all_gather") == 1
    assert log.bytes_sent_per_rank() == [64, 72, 40]
    assert log.total_bytes_sent() == 176
    assert log.by_op() == {"all_reduce": 64, "all_gather": 96, "broadcast": 16}
    d = json.loads(json.dumps(log.to_dict()))
    assert d["bytes_sent_per_rank"] == [64, 72, 40] and d["records"][0]["op"] == "all_reduce"


@FAST
@given(n=st.integers(0, 10**12), p=st.integers(1, 64))
def test_ring_formulas_are_exact(n, p):
    from fractions import Fraction
    for fn, factor in ((ring_allreduce_bytes, 2 * (p - 1)), (ring_allgather_bytes, p - 1),
                       (ring_reduce_scatter_bytes, p - 1), (shard_bytes, 1)):
        value, exact = fn(n, p), Fraction(factor * n, p)
        assert isinstance(value, int) == (exact.denominator == 1)
        assert value == (int(exact) if exact.denominator == 1 else float(exact))
    assert ring_allreduce_bytes(n, 1) == ring_allgather_bytes(n, 1) == 0


@pytest.mark.parametrize("call, message", [
    (lambda: all_reduce([]), "all_reduce: shards must be a non-empty list of per-rank arrays, got []"),
    (lambda: all_reduce(np.ones((2, 2))), "all_reduce: shards must be a non-empty list"),
    (lambda: all_reduce([np.ones(2), np.ones(3)]), "all_reduce: shards[1] has shape (3,) but shards[0] has (2,)"),
    (lambda: all_reduce([np.ones(2), np.ones(2, dtype=np.float32)]),
     "shards[1] has dtype float32 but shards[0] has float64"),
    (lambda: all_reduce([np.ones(2), np.array([True, False])]), "all_reduce: shards[1] must be a numeric array"),
    (lambda: all_gather([np.ones((2, 1)), np.ones((3, 1))], axis=1),
     "all_gather: shards[1] has shape (3, 1) but shards[0] has (2, 1); shapes must match (except on axis 1)"),
    (lambda: all_gather([np.ones(2)], axis=1), "axis must be an integer in -1..0"),
    (lambda: reduce_scatter([np.ones(3), np.ones(3)]), "reduce_scatter: axis 0 of shape (3,) has 3 elements"),
    (lambda: broadcast([np.ones(2)], src=1), "src must be a rank in 0..0, got 1"),
    (lambda: broadcast([np.ones(2), None], src=1), "broadcast: shards[1] must be a numeric array"),
    (lambda: broadcast([np.ones(2)], src=True), "src must be a rank in 0..0, got True"),
    (lambda: all_reduce([np.ones(2)], log="log"), "log must be a CommLog or None, got str"),
    (lambda: ring_broadcast_bytes(8, 2, src=-1), "src must be a rank in 0..1, got -1"),
    (lambda: ring_allgather_bytes(-8, 2), "n_bytes must be non-negative, got -8"),
    (lambda: ring_reduce_scatter_bytes(8, 2.5), "p must be a positive integer (the number of devices), got 2.5"),
])
def test_collective_errors(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()
