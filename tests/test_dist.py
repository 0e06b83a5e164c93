"""tensorpar.dist on real gloo ranks: the f/g operators, the ledger, sub-groups, fail-fast."""
import os
import time

import pytest
import torch

from tensorpar import dist
from tests import _dist_workers as W

pytestmark = pytest.mark.multirank
SHAPES = [(2, 3, 8), (1, 5, 16), (3, 1, 4)]


@pytest.mark.parametrize("world", [2, 4])
def test_mappings_forward_and_backward_equal_dense(world):
    report = dist.launch(W.mappings_worker, world, SHAPES, deadline=120)
    for rank, checks in enumerate(report):
        failed = [name for name, ok in checks if not ok]
        assert not failed, f"world {world}, rank {rank}: {failed}"
        assert len(checks) == 14 * len(SHAPES)


@pytest.mark.parametrize("world", [2, 4])
def test_ledger_records_every_collective_with_ring_bytes(world):
    shape = (2, 3, 8)
    n = 2 * 3 * 8 * 8  # float64 bytes of x
    out = dist.launch(W.ledger_worker, world, shape, deadline=120)
    for rank, res in enumerate(out):
        ops = [(r["op"], r["phase"], r["module"]) for r in res["records"]]
        assert ops == [("all_reduce", "forward", "Block"), ("all_reduce", "backward", "Block"),
                       ("all_gather", "forward", ""), ("reduce_scatter", "forward", ""),
                       ("all_reduce", "forward", ""), ("broadcast", "forward", "")]
        payloads = [r["payload_bytes"] for r in res["records"]]
        assert payloads == [n, n, world * n, world * n, n, n]
        sent = [r["bytes_sent"] for r in res["records"]]
        chain = 0 if rank == world - 1 else n  # broadcast from 0: the chain ends at rank p-1
        assert sent == [2 * (world - 1) * n / world] * 2 + [(world - 1) * n] * 2 + [2 * (world - 1) * n / world, chain]
        assert res["total"] == sum(sent)
        assert res["by_op"]["all_reduce"]["count"] == 3 and res["by_op"]["broadcast"]["count"] == 1
        assert res["by_module"]["Block"]["bytes_sent"] == sent[0] + sent[1]
        assert res["shapes"] == [(2, 3, 8 * world), (2, 3, 8), (2, 3, 8), (2, 3, 8)]
        assert {r["group_size"] for r in res["records"]} == {world}
        assert {r["dtype"] for r in res["records"]} == {"float64"}


def test_ring_bytes_formulas_of_the_source_exercise():
    assert dist.ring_bytes_sent("all_reduce", 16_384, 4) == 24_576
    assert dist.ring_bytes_sent("all_gather", 16_384, 4) == 12_288
    assert dist.ring_bytes_sent("reduce_scatter", 16_384, 1) == 0
    with pytest.raises(ValueError, match="unknown collective 'all_to_all'"):
        dist.ring_bytes_sent("all_to_all", 8, 2)


def test_no_ledger_means_no_hooks():
    from torch.nn.modules import module as nn_module
    before = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks))
    with dist.ledger():
        assert len(nn_module._global_forward_pre_hooks) == before[0] + 1
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == before


def test_subgroups_reduce_within_their_group():
    out = dist.launch(W.subgroup_worker, 4, deadline=120)
    sums = [o[0] for o in out]
    assert sums == [1.0, 1.0, 5.0, 5.0]  # 0+1 and 2+3
    base = list(range(8))
    for r, (_, rs, grank, gsize) in enumerate(out):
        factor = 3 if r < 2 else 7  # (r+1) summed over the group: 1+2 or 3+4
        half = base[:4] if grank == 0 else base[4:]
        assert rs == [[factor * v for v in half]]
        assert (grank, gsize) == (r % 2, 2)


def _no_rank_left(pids_before):
    time.sleep(0.2)
    import multiprocessing
    return not multiprocessing.active_children()


@pytest.mark.parametrize("world, bad", [(2, 1), (4, 2)])
def test_a_raising_rank_ends_the_launch_with_its_error(world, bad):
    t0 = time.monotonic()
    with pytest.raises(dist.RankFailedError) as info:
        dist.launch(W.raising_worker, world, bad, timeout=30, deadline=60)
    assert time.monotonic() - t0 < 30
    assert info.value.rank == bad and info.value.exc_type == "KeyError"
    assert "boom on purpose" in str(info.value)
    assert _no_rank_left(None)


def test_a_killed_rank_ends_the_launch_named():
    t0 = time.monotonic()
    with pytest.raises(dist.RankFailedError, match=r"rank 1 failed: RankDied: .*SIGKILL"):
        dist.launch(W.dying_worker, 3, 1, timeout=30, deadline=60)
    assert time.monotonic() - t0 < 30
    assert _no_rank_left(None)


def test_deadline_stops_every_rank():
    with pytest.raises(dist.LaunchTimeoutError, match="deadline of 3s"):
        dist.launch(W.sleepy_worker, 2, deadline=3)
    assert _no_rank_left(None)


def test_results_come_back_in_rank_order_from_distinct_processes():
    pids = dist.launch(W.pid_worker, 2)
    assert len(set(pids)) == 2 and os.getpid() not in pids


@pytest.mark.parametrize("bad, match", [
    (0, "world_size must be a positive integer, got 0"),
    (True, "world_size must be a positive integer, got True"),
    (2.0, "world_size must be a positive integer, got 2.0"),
])
def test_bad_world_size(bad, match):
    with pytest.raises(ValueError, match=match):
        dist.launch(W.pid_worker, bad)


def test_bad_backend_and_timeout():
    with pytest.raises(ValueError, match="backend 'mpi' is not supported; valid: auto, gloo, nccl"):
        dist.launch(W.pid_worker, 2, backend="mpi")
    with pytest.raises(ValueError, match="timeout must be positive"):
        dist.launch(W.pid_worker, 2, timeout=0)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="backend 'nccl' needs 2 GPUs"):
            dist.launch(W.pid_worker, 2, backend="nccl")


def test_broadcast_bytes_follow_the_chain():
    # src=1 over 4 ranks: the chain 1 -> 2 -> 3 -> 0; rank 0 is last and sends nothing.
    sent = [dist.ring_bytes_sent("broadcast", 1000, 4, rank=r, src=1) for r in range(4)]
    assert sent == [0, 1000, 1000, 1000]
    assert dist.ring_bytes_sent("broadcast", 1000, 1) == 0


def test_single_process_without_a_group_is_a_group_of_one():
    # No process group initialised: the operators are identities and nothing is recorded.
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    with dist.ledger() as led:
        y = dist.reduce_from_tp_region(dist.copy_to_tp_region(x))
        y.sum().backward()
        z = dist.gather_from_tp_region(dist.scatter_to_tp_region(x))
    assert torch.equal(y, x) and torch.equal(z, x) and torch.equal(x.grad, torch.ones_like(x))
    assert led.records == [] and (dist.get_rank(), dist.get_world_size()) == (0, 1)
