"""The shared-memory transport (tensorpar.distributed.shm): exact against gloo, safe, and quiet while waiting."""
import functools
import os
import stat

import pytest

from tensorpar import distributed as dist
from tensorpar.distributed import shm_segment as seg
from tests import _shm_workers as W


def _our_segments() -> list:
    return [n for n in os.listdir(seg.SHM_DIR) if n.startswith(seg.PREFIX)]


@pytest.mark.parametrize("world, groups", [
    (2, [[0, 1]]),
    (3, [[0, 1, 2]]),
    (4, [[0, 1, 2, 3], [0, 1], [2, 3], [1, 3]]),  # the world and sub-groups, disjoint and interleaved
])
def test_every_collective_is_exact_over_shared_memory(world, groups):
    for failures, checked in dist.launch(W.exactness_worker, world, groups, backend="shm", deadline=600):
        assert not failures, failures[:10]
        assert checked > 0


def test_auto_picks_shared_memory_for_local_cpu_ranks():
    assert dist.launch(W.transport_worker, 2, deadline=60) == [("shm", "tpshm")] * 2


def test_gloo_is_kept_when_asked():
    assert dist.launch(W.transport_worker, 2, backend="gloo", deadline=60) == [("gloo", "gloo")] * 2


def test_transport_env_turns_shared_memory_off(monkeypatch):
    monkeypatch.setenv("TENSORPAR_TRANSPORT", "gloo")
    assert dist.launch(W.transport_worker, 2, deadline=60) == [("gloo", "tpshm")] * 2


def test_a_group_across_hosts_runs_over_gloo_on_every_rank():
    for transport, value, why in dist.launch(W.fallback_worker, 2, deadline=60):
        assert transport == "gloo" and value == [3.0, 3.0, 3.0]
        assert "more than one host" in why


def test_a_rank_killed_in_a_collective_is_named_and_nothing_stays_in_dev_shm(tmp_path):
    with pytest.raises(dist.RankFailedError) as info:
        dist.launch(W.killed_in_collective_worker, 2, str(tmp_path), deadline=60)
    assert info.value.rank == 1 and "SIGKILL" in str(info.value), str(info.value)
    # a segment is named after the rank that made it: none of this launch's ranks left one (other
    # launches, of tests running alongside under pytest-xdist, have their own in flight)
    ranks = [(tmp_path / f"rank{r}.pid").read_text() for r in range(2)]
    assert not [n for n in _our_segments() if n.startswith(tuple(f"{seg.PREFIX}{pid}-" for pid in ranks))]


@functools.cache
def idle_wait() -> list:
    """One launch for the two tests of waiting ranks."""
    return dist.launch(W.idle_wait_worker, 2, 2.0, deadline=60)


def test_a_waiting_rank_sleeps_instead_of_spinning():
    for rank, (cpu, wall, value, _) in enumerate(idle_wait()):
        assert value == [2.0] * 4
        if rank == 0:
            assert wall > 1.5, wall
            # a rank spinning for 2 s would use ~2 s of CPU; futex sleeps use a few ms
            assert cpu < 0.2 * wall, (cpu, wall)


def test_the_stopwatch_times_every_collective_and_hooks_nothing():
    """calibrate takes a block's collectives out of its fixed cost with it: rank 0's stopwatch
    holds the 0.5 s it waited for rank 1 at each call (rank 1's does not: it came late), on the
    shared-memory fast path, the ledger's path, a reduce-scatter and a broadcast alike, and for an
    asynchronous all-reduce over gloo the time its wait() blocked (0.25 s), not the 0.25 s of
    work done between the call and the wait; no module hook runs while
    it is open, and a ledger inside it records no more than it adds (the ledger times the backend
    call alone). Margins: 0.2 s for a rank leaving the barrier late on a loaded host."""
    for rank, (*_, got) in enumerate(idle_wait()):
        for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
            assert (0.3 < got[op] < 2.0) if rank == 0 else (got[op] < 0.2), (rank, op, got[op])
        assert (0.1 < got["async"] < 0.45) if rank == 0 else (got["async"] < 0.2), (rank, got["async"])
        assert got["hooks"] == 0
        on_watch, on_ledger = got["nested"]
        assert 0 < on_ledger <= on_watch < on_ledger + 0.2, (on_ledger, on_watch)


def test_a_peer_that_never_arrives_ends_at_the_timeout_naming_it():
    with pytest.raises(dist.RankFailedError) as info:
        dist.launch(W.peer_timeout_worker, 2, timeout=3, deadline=60)
    message = str(info.value)
    assert "timed out after 3s waiting for rank 1 of the group to arrive" in message, message
    assert "rank 1 no collective yet" in message and "rank 0 in all_reduce #" in message, message


def test_segments_are_private_and_checked_on_open(tmp_path, monkeypatch):
    path = os.path.join(seg.SHM_DIR, f"{seg.PREFIX}{os.getpid()}-test")
    segment = seg.Segment(path, 0, 2, 4096, create=True)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        os.chmod(path, 0o644)
        with pytest.raises(OSError, match="not a segment this user made"):
            seg.Segment(path, 1, 2, 4096, create=False)
    finally:
        os.unlink(path)
    del segment


def test_a_dead_creators_segment_is_swept():
    import subprocess
    import sys
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = os.path.join(seg.SHM_DIR, f"{seg.PREFIX}{gone.pid}-abc")
    open(stale, "w").close()
    seg.sweep_stale()
    assert not os.path.exists(stale)


def test_collectives_of_other_sizes_are_named_not_read():
    for rank, (sizes, after, kinds, past_a_slot) in enumerate(dist.launch(W.mismatch_worker, 2, deadline=60)):
        other = 1 - rank
        assert f"ranks {rank} and {other} of a shared-memory group issued different collectives" in sizes, sizes
        mine, theirs = (16, 24) if rank == 0 else (24, 16)
        assert f"rank {rank} all_reduce (sum) of {mine} B" in sizes, sizes
        assert f"rank {other} all_reduce (sum) of {theirs} B" in sizes, sizes
        assert "this shared-memory group failed earlier" in after and "cannot be used again" in after, after
        assert "all_reduce (sum) of 16 B" in kinds and "broadcast from rank 0 of 16 B" in kinds, kinds
        assert "all_reduce (sum) of 1200000 B" in past_a_slot and "of 1048576 B" in past_a_slot, past_a_slot


def test_outputs_of_the_wrong_size_are_refused_before_any_round():
    for errors, value in dist.launch(W.bad_sizes_worker, 2, deadline=60):
        assert all("the larger must hold 2 x the smaller, in the same dtype" in e for e in errors), errors
        assert value == [2.0, 2.0, 2.0]


def test_segments_are_unlinked_while_the_ranks_still_run():
    assert dist.launch(W.unlinked_worker, 2, deadline=60) == [[], []]


def test_collectives_serve_inside_and_outside_inference_mode():
    assert dist.launch(W.inference_mode_worker, 2, deadline=60) == [[[3.0] * 3] * 3] * 2


@functools.lru_cache(maxsize=None)
def matrix() -> list:
    """One spawn of 4 ranks: the world (4) and the pairs [0, 1], [2, 3] (2)."""
    return dist.launch(W.ops_and_layouts_worker, 4, [[0, 1, 2, 3], [0, 1], [2, 3]], backend="shm", deadline=600)


def test_every_reduce_op_dtype_and_layout_equals_gloo_at_2_and_4_ranks():
    """Every ReduceOp (SUM, PRODUCT, MIN, MAX, AVG on float64/float32/bfloat16; SUM, PRODUCT, MIN,
    MAX, BAND, BOR, BXOR on int64) through all_reduce and reduce_scatter (tensor and list), and
    all_gather (tensor and list) and broadcast, on contiguous tensors and on views that are not
    (a strided slice, a transpose, a column slice; an expanded input), and on a view at a storage
    offset: each result, written back into the caller's view with the rest of its buffer
    untouched, equals the rank-order result bit for bit, and gloo's on contiguous copies of the
    same inputs bit for bit wherever the order of the operations is the same (2 ranks; MIN, MAX,
    the bitwise ops and integers at any size), otherwise within the bound of two orders
    (2 gamma_{p-1} sum|x_i|, Higham). Over shared memory each call took its rounds there; the
    same backend without a segment (its gloo fallback, on the pairs) gives gloo's bits, its buffers
    untouched outside the view (gloo alone writes past a strided view: measured on torch 2.13).
    What the backend always hands to gloo (reduce, scatter, gather) is checked on the same views."""
    for failures_by_group in (res for res, _ in matrix()):
        for name, failures, counts in failures_by_group:
            assert not failures, (name, len(failures), failures[:8])
            assert counts["all_reduce"] >= 60 and counts["reduce_scatter"] >= 60, (name, counts)
            assert counts["all_gather"] >= 24 and counts["broadcast"] >= 40, (name, counts)
            assert counts["forwarded"] == 15, (name, counts)


REFUSED = ("all_reduce with ReduceOp.PREMUL_SUM is not supported (gloo has none either); valid: SUM, PRODUCT, MAX, "
           "MIN, AVG, BAND, BOR, BXOR",
           "all_reduce with ReduceOp.BAND takes integer or bool tensors, got torch.float32",
           "all_reduce with ReduceOp.AVG takes floating-point tensors (an integer mean would round), got torch.int64",
           "reduce_scatter with ReduceOp.AVG takes floating-point tensors",
           "all_reduce writes into a tensor of shape (4,) and strides (0,) whose elements share memory",
           "all_gather writes into a tensor of shape")


def test_what_no_backend_does_exactly_is_refused_before_any_round():
    """PREMUL_SUM, a bitwise op on floats, AVG on integers, a result into an expanded view: a
    ValueError naming the op or the layout on every rank, over shared memory and over its gloo
    fallback alike, and the group still works after each (no rank was left in a round)."""
    for _, refusals in matrix():
        for name, cases in refusals.items():
            for (message, works_after), want in zip(cases, REFUSED):
                assert want in message, (name, message)
                assert works_after, (name, want)
