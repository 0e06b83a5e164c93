"""Workers for tests/test_dist_shm.py (spawned ranks import them)."""
import os
import resource
import signal
import time

import torch
import torch.distributed as tdist

from tensorpar import dist
from tensorpar.dist import shm
from tensorpar.dist import shm_segment as seg

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# 1 element to 6 MB of float32: below a slot, exactly one, and several slots (1 MiB each)
SIZES = (1, 7, 2048, 262_144, 262_145, 1_500_000)


def _inputs(n, dtype, rank, seed):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def _in_order(parts, combine):
    """The transport's documented result, computed here without it: rank order, in the dtype."""
    out = parts[0].clone()
    for part in parts[1:]:
        out = combine(out, part)
    return out


def exactness_worker(groups):
    """Every op, dtype and size over shared memory, on the world and on sub-groups, against
    (a) the rank-order result computed from every rank's inputs gathered over gloo, bit for bit,
    (b) gloo's own collective: bit for bit on two ranks, within rounding on more."""
    r = tdist.get_rank()
    failures, checked = [], 0
    for ranks in groups:
        shm_group, gloo_group = tdist.new_group(ranks), tdist.new_group(ranks, backend="gloo")
        if r not in ranks:
            continue
        if shm.transport(shm_group) != "shm":
            return [f"group {ranks} runs over {shm.transport(shm_group)}"], 0
        me, p = ranks.index(r), len(ranks)
        for seed, (dtype, n) in enumerate((d, n) for d in DTYPES for n in SIZES):
            before = shm_group.segment.round
            calls = _check_group(shm_group, gloo_group, me, p, dtype, n, seed, failures, ranks)
            if shm_group.segment.round - before < calls:  # each call at least one round: none went to gloo
                failures.append(f"group {ranks} {dtype} n={n}: {calls} calls took "
                                f"{shm_group.segment.round - before} shared-memory rounds")
            checked += calls
    return failures, checked


def _check_group(shm_group, gloo_group, me, p, dtype, n, seed, failures, ranks):
    x = _inputs(n, dtype, me, seed)
    everyone = [torch.empty_like(x) for _ in range(p)]
    tdist.all_gather(everyone, x, group=gloo_group)  # the inputs, moved by gloo
    name = f"group {ranks} {dtype} n={n}"
    checks = 0
    for op, combine in (("sum", torch.add), ("max", torch.maximum), ("min", torch.minimum)):
        got = x.clone()
        tdist.all_reduce(got, op=getattr(tdist.ReduceOp, op.upper()), group=shm_group)
        via_gloo = x.clone()
        tdist.all_reduce(via_gloo, op=getattr(tdist.ReduceOp, op.upper()), group=gloo_group)
        expected = _in_order(everyone, combine)
        if not torch.equal(got, expected):
            failures.append(f"{name}: all_reduce {op} differs from the rank-order result")
        exact_vs_gloo = p == 2 or op != "sum"
        if exact_vs_gloo and not torch.equal(got, via_gloo):
            failures.append(f"{name}: all_reduce {op} differs from gloo's bits")
        if not exact_vs_gloo:  # two orders of p terms: each within (p-1) u sum|x| of the exact sum
            bound = 2 * (p - 1) * _UNIT_ROUNDOFF[dtype] * sum(e.double().abs() for e in everyone)
            if bool(((got.double() - via_gloo.double()).abs() > bound).any()):
                failures.append(f"{name}: all_reduce {op} differs from gloo beyond summation order")
        checks += 1
    gathered = torch.empty(p * n, dtype=dtype)
    tdist.all_gather_single(gathered, x, group=shm_group)
    if not torch.equal(gathered, torch.cat(everyone)):
        failures.append(f"{name}: all_gather")
    listed = [torch.empty_like(x) for _ in range(p)]
    tdist.all_gather(listed, x, group=shm_group)
    if not all(torch.equal(a, b) for a, b in zip(listed, everyone)):
        failures.append(f"{name}: all_gather (list)")
    if n * p < 4_000_000:
        rows = _inputs(p * n, dtype, me, seed + 500)  # (p * n,): chunk j goes to rank j
        all_rows = [torch.empty_like(rows) for _ in range(p)]
        tdist.all_gather(all_rows, rows, group=gloo_group)
        out = torch.empty(n, dtype=dtype)
        tdist.reduce_scatter_single(out, rows, group=shm_group)
        expected = _in_order([row.view(p, n)[me] for row in all_rows], torch.add)
        if not torch.equal(out, expected):
            failures.append(f"{name}: reduce_scatter")
    for src in range(p):
        b = x.clone()
        tdist.broadcast(b, group_src=src, group=shm_group)
        if not torch.equal(b, everyone[src]):
            failures.append(f"{name}: broadcast from {src}")
    return checks + 2 + (1 if n * p < 4_000_000 else 0) + p


# u of each dtype: recursive summation of p terms in any order is within (p-1) u sum|x_i| of the
# exact sum (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 4.4)
_UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53, torch.bfloat16: 2.0 ** -8}


def transport_worker():
    return shm.transport(None), tdist.get_backend()


def fallback_worker():
    """A group whose ranks look as if on two hosts runs over gloo, on every rank, and is exact."""
    r = tdist.get_rank()
    real = seg.host_identity
    if r == 1:
        seg.host_identity = lambda: "another-host"
    group = tdist.new_group([0, 1])
    seg.host_identity = real
    x = torch.full((3,), float(r + 1))
    tdist.all_reduce(x, group=group)
    return shm.transport(group), x.tolist(), group.why_not


def killed_in_collective_worker(folder):
    """Rank 1 dies by SIGKILL once rank 0 waits in an all-reduce over shared memory."""
    r = tdist.get_rank()
    with open(os.path.join(folder, f"rank{r}.pid"), "w") as f:
        f.write(str(os.getpid()))
    x = torch.ones(1000)
    if r == 1:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    tdist.all_reduce(x)
    return "unreachable"


def idle_wait_worker(seconds):
    """Rank 0 waits ``seconds`` in an all-reduce while rank 1 sleeps: its CPU time while waiting."""
    r = tdist.get_rank()
    x = torch.ones(4)
    tdist.barrier()
    if r == 1:
        time.sleep(seconds)
    cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    tdist.all_reduce(x)
    cpu1, wall1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    return cpu, wall1 - wall0, x.tolist()


def peer_timeout_worker():
    """Rank 1 never enters the collective: rank 0's wait ends at the group's timeout."""
    if tdist.get_rank() == 1:
        time.sleep(60)
    x = torch.ones(2)
    dist.all_reduce(x)  # tensorpar's: the flight recorder says where each rank was


def mismatch_worker():
    """Ranks in collectives of different sizes with the rank-side signature check off: the
    transport itself refuses to read a peer's bytes; the group then stays failed. Then, on fresh
    groups, collectives of different kinds, and sizes that differ only past the first slot."""
    from tensorpar.dist import flight
    flight.check_collectives(False)
    r, messages = tdist.get_rank(), []
    fresh, third = tdist.new_group([0, 1]), tdist.new_group([0, 1])
    for call in (lambda: tdist.all_reduce(torch.ones(4 if r == 0 else 6)),
                 lambda: tdist.all_reduce(torch.ones(4)),
                 lambda: tdist.all_reduce(torch.ones(4), group=fresh) if r == 0
                 else tdist.broadcast(torch.ones(4), src=0, group=fresh),
                 # 300 000 floats (2 slots) against 262 144 (exactly one): the first pieces are alike
                 lambda: tdist.all_reduce(torch.ones(300_000 if r == 0 else 262_144), group=third)):
        try:
            call()
            messages.append("not detected")
        except (flight.CollectiveMismatchError, seg.ShmPeerError) as exc:
            messages.append(str(exc))
    return messages


def bad_sizes_worker():
    """Outputs of the wrong size or dtype: ValueError before any round, and the group still works."""
    group = tdist.new_group([0, 1])
    errors = []
    for call in (lambda: tdist.all_gather_single(torch.empty(10), torch.ones(4), group=group),
                 lambda: tdist.all_gather_single(torch.empty(8, dtype=torch.float64), torch.ones(4), group=group),
                 lambda: tdist.reduce_scatter_single(torch.empty(3), torch.ones(8), group=group)):
        try:
            call()
            errors.append("accepted")
        except ValueError as exc:
            errors.append(str(exc))
    x = torch.ones(3)
    tdist.all_reduce(x, group=group)
    return errors, x.tolist()


def unlinked_worker():
    """While the ranks run, after their groups are made: their segments are already gone from
    /dev/shm (unlinked once mapped), so no crash can leave them behind."""
    tdist.new_group([0, 1])  # a second segment, besides the world's
    pids = [None] * tdist.get_world_size()
    tdist.all_gather_object(pids, os.getpid())
    tdist.barrier()
    return [n for n in os.listdir(seg.SHM_DIR)
            if n.startswith(seg.PREFIX) and n[len(seg.PREFIX):].split("-")[0] in {str(p) for p in pids}]


def inference_mode_worker():
    """Collectives first issued under ``torch.inference_mode`` (a decode step), then outside it: the
    segment's views made in the first must serve the second (they did not: in-place write to an
    inference tensor)."""
    rank = dist.get_rank()
    out = []
    with torch.inference_mode():
        x = torch.full((3,), float(rank + 1))
        dist.all_reduce(x)
        out.append(x.tolist())
    for dtype in (torch.float32, torch.float64):
        y = torch.full((3,), float(rank + 1), dtype=dtype, requires_grad=False)
        dist.all_reduce(y)
        out.append(y.tolist())
    return out
