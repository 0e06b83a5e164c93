"""Module-level worker functions for tests/test_dist.py (spawned ranks must import them)."""
import os
import time

import torch

from tensorpar import distributed as dist


def _seeded(shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def mappings_worker(shapes):
    """Each operator's forward and backward against the same computation done densely on one rank."""
    p, r = dist.get_world_size(), dist.get_rank()
    report = []
    for i, shape in enumerate(shapes):
        # Every rank builds all ranks' inputs from the same seed, so the dense result is known locally.
        xs = [_seeded(shape, 100 * i + k) for k in range(p)]
        gs = [_seeded(shape, 10_000 + 100 * i + k) for k in range(p)]
        x = xs[r].clone().requires_grad_(True)
        y = dist.copy_to_tp_region(x)
        y.backward(gs[r])
        report.append(("copy_fwd", torch.equal(y, xs[r])))
        report.append(("copy_bwd", _close(x.grad, sum(gs))))

        x = xs[r].clone().requires_grad_(True)
        y = dist.reduce_from_tp_region(x)
        y.backward(gs[r])
        report.append(("reduce_fwd", _close(y, sum(xs))))
        report.append(("reduce_bwd", torch.equal(x.grad, gs[r])))

        full = xs[0]
        x = full.clone().requires_grad_(True)
        y = dist.scatter_to_tp_region(x)
        g_shard = gs[r].chunk(p, dim=-1)[r]
        y.backward(g_shard)
        report.append(("scatter_fwd", torch.equal(y, full.chunk(p, dim=-1)[r])))
        report.append(("scatter_bwd", torch.equal(x.grad, torch.cat([gs[k].chunk(p, -1)[k] for k in range(p)], -1))))

        x = xs[r].chunk(p, dim=-1)[0].clone().requires_grad_(True)
        y = dist.gather_from_tp_region(x)
        y.backward(gs[0])
        expect = torch.cat([xs[k].chunk(p, dim=-1)[0] for k in range(p)], dim=-1)
        report.append(("gather_fwd", torch.equal(y, expect)))
        report.append(("gather_bwd", torch.equal(x.grad, gs[0].chunk(p, dim=-1)[r])))

        x = xs[r].clone().requires_grad_(True)  # (B, T, H) per rank = a sequence shard
        y = dist.gather_from_sequence_parallel_region(x)
        g_full = torch.cat([gs[k] for k in range(p)], dim=1)  # each rank's grad of the full sequence
        y.backward(g_full * (r + 1))
        report.append(("sp_gather_fwd", torch.equal(y, torch.cat(xs, dim=1))))
        summed = sum((k + 1) * g_full for k in range(p))
        report.append(("sp_gather_bwd", _close(x.grad, summed.chunk(p, dim=1)[r])))

        x = torch.cat(xs, dim=1).mul(r + 1).requires_grad_(True)  # (B, p*T, H) partial
        y = dist.reduce_scatter_to_sequence_parallel_region(x)
        y.backward(gs[r])
        total = sum((k + 1) * torch.cat(xs, dim=1) for k in range(p))
        report.append(("sp_rs_fwd", _close(y, total.chunk(p, dim=1)[r])))
        report.append(("sp_rs_bwd", torch.equal(x.grad, torch.cat(gs, dim=1))))

        x = torch.cat(xs, dim=1).clone().requires_grad_(True)
        y = dist.scatter_to_sequence_parallel_region(x)
        y.backward(gs[r])
        report.append(("sp_scatter_fwd", torch.equal(y, xs[r])))
        report.append(("sp_scatter_bwd", torch.equal(x.grad, torch.cat(gs, dim=1))))
        report += _bare_forward_checks(xs, r, p)
        report += _in_place_reduce_checks(xs, gs, r)
        report += _fused_linear_checks(xs, gs, r, p, seed=1_000 + i)
    return report


def _bare_forward_checks(xs, r, p):
    """With no gradient to carry, the operators run without autograd: same values, inputs intact."""
    checks = []
    for mode, make in (("no_grad", lambda t: t.clone().requires_grad_(True)),
                       ("no_requires_grad", lambda t: t.clone())):
        with torch.set_grad_enabled(mode != "no_grad"):
            x = make(xs[r])
            y = dist.reduce_from_tp_region(x)
            checks.append((f"{mode}_reduce", _close(y, sum(xs)) and torch.equal(x, xs[r])
                           and y.grad_fn is None))
            checks.append((f"{mode}_copy", dist.copy_to_tp_region(x) is x))
            y = dist.gather_from_tp_region(x.chunk(p, dim=-1)[0].contiguous())
            checks.append((f"{mode}_gather", torch.equal(y, torch.cat([t.chunk(p, -1)[0] for t in xs], -1))
                           and y.grad_fn is None))
    return checks


def _in_place_reduce_checks(xs, gs, r):
    """reduce_from_tp_region(in_place=True): the sum lands in the caller's own tensor, the
    gradient passes through unchanged, and an op that saved that tensor fails loudly."""
    x = xs[r].clone().requires_grad_(True)
    z = x * 2.0  # MulBackward keeps the scalar, not z
    y = dist.reduce_from_tp_region(z, in_place=True)
    y.backward(gs[r])
    checks = [("in_place_same_tensor", y is z), ("in_place_fwd", _close(y, 2.0 * sum(xs))),
              ("in_place_bwd", _close(x.grad, 2.0 * gs[r]))]
    x = xs[r].clone().requires_grad_(True)
    z = x.exp()  # ExpBackward saves its output: summing into it must break backward
    y = dist.reduce_from_tp_region(z, in_place=True)
    try:
        y.backward(gs[r])
        checks.append(("in_place_saved_output_fails", False))
    except RuntimeError as e:
        checks.append(("in_place_saved_output_fails", "modified by an inplace operation" in str(e)))
    return checks


def _fused_linear_checks(xs, gs, r, p, seed):
    """linear_with_grad_allreduce against F.linear(copy_to_tp_region(x)): rank k holds W_k, b_k.

    y_r = x W_r^T + b_r; dX = sum_k g_k W_k (all-reduced); dW_r = g_r^T x; db_r = sum of g_r.
    """
    h = xs[r].shape[-1]
    ws = [_seeded((2 * h, h), seed + k) for k in range(p)]
    bs = [_seeded((2 * h,), seed + 100 + k) for k in range(p)]
    gys = [torch.cat([g, g.flip(-1)], dim=-1) * (k + 1) for k, g in enumerate(gs)]  # (..., 2h)
    x = xs[0].clone().requires_grad_(True)  # replicated input
    w, b = ws[r].clone().requires_grad_(True), bs[r].clone().requires_grad_(True)
    y = dist.linear_with_grad_allreduce(x, w, b)
    y.backward(gys[r])
    dx = sum(gy @ wk for gy, wk in zip(gys, ws))
    g2, x2 = gys[r].reshape(-1, 2 * h), xs[0].reshape(-1, h)
    checks = [("fused_fwd", _close(y, torch.nn.functional.linear(xs[0], ws[r], bs[r]))),
              ("fused_dx", _close(x.grad, dx)), ("fused_dw", _close(w.grad, g2.t() @ x2)),
              ("fused_db", _close(b.grad, g2.sum(0)))]
    # its output takes in-place ops (ReLU(inplace=True) after a column-parallel layer)
    x = xs[0].clone().requires_grad_(True)
    y = dist.linear_with_grad_allreduce(x, ws[r].clone().requires_grad_(True), bs[r]).relu_()
    y.backward(gys[r])
    masks = [torch.nn.functional.linear(xs[0], wk, bk) > 0 for wk, bk in zip(ws, bs)]
    checks.append(("fused_then_in_place", _close(x.grad, sum((gy * m) @ wk for gy, m, wk in zip(gys, masks, ws)))))
    return checks


def _close(a, b):
    # Sums of p float64 terms in a different order: error <= p * eps * sum|terms|.
    return torch.allclose(a, b, rtol=1e-12, atol=1e-12)


class Block(torch.nn.Module):
    """copy -> linear -> reduce: the f/g pattern of a tensor-parallel layer pair."""

    def __init__(self, h):
        super().__init__()
        self.inner = torch.nn.Linear(h, h, dtype=torch.float64)

    def forward(self, x):
        return dist.reduce_from_tp_region(self.inner(dist.copy_to_tp_region(x)))


def ledger_worker(shape):
    p = dist.get_world_size()
    block = Block(shape[-1])
    x = _seeded(shape, 1).requires_grad_(True)
    with dist.ledger(model=block) as led:
        block(x).sum().backward()
        g = dist.gather_from_tp_region(x.detach())
        rs = dist.reduce_scatter(torch.cat([x.detach()] * p, dim=1), dim=1)
        m = dist.all_reduce(x.detach().clone() + dist.get_rank(), op="max")  # recorded, and still reduced
        dist.broadcast(x.detach().clone(), src=0)
    outside = dist.reduce_from_tp_region(x.detach())  # no ledger open: must not be recorded
    return {"max_ok": torch.equal(m, x.detach() + (p - 1)),
            "records": [r.to_dict() for r in led.records], "by_op": led.by_op(),
            "by_module": led.by_module(), "total": led.total_bytes_sent(),
            "shapes": [tuple(g.shape), tuple(rs.shape), tuple(m.shape), tuple(outside.shape)]}


def autograd_modes_worker():
    """Forward-mode AD and torch.func transforms are refused by name, before any collective."""
    import torch.autograd.forward_ad as fwAD

    x, t = torch.ones(2, 4, dtype=torch.float64), torch.ones(2, 4, dtype=torch.float64)
    w = torch.ones(4, 4, dtype=torch.float64)
    ops = {"reduce": dist.reduce_from_tp_region, "copy": dist.copy_to_tp_region,
           "gather": dist.gather_from_tp_region, "scatter": dist.scatter_to_tp_region,
           "linear": lambda a: dist.linear_with_grad_allreduce(a, w, None)}
    out = {}
    for name, op in ops.items():
        for mode in ("forward_ad", "jvp", "vmap"):
            with dist.ledger() as led:
                try:
                    if mode == "forward_ad":
                        with fwAD.dual_level():
                            op(fwAD.make_dual(x.clone(), t))
                    elif mode == "jvp":
                        torch.func.jvp(op, (x,), (t,))
                    else:
                        torch.func.vmap(op)(x)
                    out[(name, mode)] = "no error"
                except NotImplementedError as e:
                    out[(name, mode)] = str(e)
            if led.records:  # refused before any collective, or not at all
                out[(name, mode)] += f" after {len(led.records)} collective(s)"
    with fwAD.dual_level():  # a plain tensor inside a dual level is still fine
        out[("reduce", "plain in dual level")] = dist.reduce_from_tp_region(x.clone()).tolist()
    return out


def flaky_init_rank(rank, world_size, store, results, before_mesh=False, timeout_s=30):
    """_init_group when rank 1's first attempt fails: after the mesh formed (as gloo's flake
    usually does), or, with ``before_mesh``, before rank 1 wrote its address, so that rank 0 is
    left waiting in the store for a key that never comes until its own attempt times out."""
    import contextlib
    import datetime
    import time
    import warnings

    import torch.distributed as tdist
    import torch.distributed.distributed_c10d as c10d

    from tensorpar.distributed import rendezvous

    real, calls = tdist.init_process_group, []

    def flaky(*args, **kwargs):
        calls.append(kwargs["store"])
        if rank == 1 and len(calls) == 1 and before_mesh:
            # a real init that fails (as gloo's does: the group it numbered is never made), on
            # keys rank 0 never sees, then gloo's message
            with contextlib.suppress(RuntimeError):
                real(*args, **{**kwargs, "store": tdist.PrefixStore("never-met/", kwargs["store"]),
                               "timeout": datetime.timedelta(seconds=1)})
            raise RuntimeError("Gloo connectFullMesh failed with [pair.cc] Connection closed by peer (simulated)")
        if rank == 0 and len(calls) == 1 and before_mesh:
            time.sleep(6)  # rank 0 comes later (still importing): its attempt ends after rank 1's store wait would
        real(*args, **kwargs)
        if rank == 1 and len(calls) == 1:
            # the mesh failed inside init on this rank only: torch had numbered the group ("0") and a
            # failed init leaves that count, where its peer's destroy_process_group resets its own
            tdist.destroy_process_group()
            c10d._world.group_count = 1
            raise RuntimeError("Gloo connectFullMesh failed with [pair.cc] Connection closed by peer (simulated)")

    tdist.init_process_group = flaky
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            rendezvous._init_group("gloo", store, rank, world_size, datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            results.put((before_mesh, rank, len(calls), f"raised: {str(exc).splitlines()[0][:200]}",
                         [str(w.message) for w in caught]))
            return
    x = torch.ones(3) * (rank + 1)
    tdist.all_reduce(x)
    results.put((before_mesh, rank, len(calls), x.tolist(), [str(w.message) for w in caught]))
    tdist.destroy_process_group()


def fused_ledger_worker(shape):
    """A column-parallel linear's overlapped backward all-reduce, as the ledger sees it."""
    from tensorpar.nn import ColumnParallelLinear

    model = torch.nn.ModuleDict({"up": ColumnParallelLinear(shape[-1], 2 * shape[-1], dtype=torch.float64)})
    x = _seeded(shape, 1).requires_grad_(True)
    with dist.ledger(model=model) as train:
        model["up"](x).sum().backward()
    with dist.ledger(model=model) as infer, torch.no_grad():
        model["up"](x)
    return [r.to_dict() for r in train.records], len(infer.records)


def subgroup_worker():
    """Two tp groups of 2 inside a world of 4: a reduction stays inside its group. Then what
    :func:`group_timeouts` finds (the same spawn)."""
    r = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[r // 2]
    x = torch.full((2, 4), float(r), dtype=torch.float64)
    y = dist.reduce_from_tp_region(x, mine)
    rs = dist.reduce_scatter(torch.arange(8, dtype=torch.float64).reshape(1, 8) * (r + 1), dim=1, group=mine)
    return y[0, 0].item(), rs.tolist(), dist.get_rank(mine), dist.get_world_size(mine), group_timeouts()


def dying_worker(bad_rank):
    if dist.get_rank() == bad_rank:
        os.kill(os.getpid(), 9)
    dist.all_reduce(torch.ones(3))
    time.sleep(60)
    return "unreachable"


def pid_worker():
    return os.getpid()


class HoldsALock:
    """A module-level callable the ranks cannot receive: its lock does not pickle."""

    def __init__(self):
        import threading
        self.lock = threading.Lock()

    def __call__(self):
        return 0


def thread_backward_worker():
    """Backward on another thread (as the autograd engine does on CUDA) still records."""
    import threading

    block = Block(8)
    x = _seeded((2, 3, 8), 1).requires_grad_(True)
    with dist.ledger(model=block) as led:
        y = block(x)
        t = threading.Thread(target=lambda: y.sum().backward())
        t.start()
        t.join()
    return [(r.op, r.phase, r.module) for r in led.records]


def ring_bytes_worker(shape):
    """Count the bytes the gloo reduce-scatter fallback really hands to isend."""
    import torch.distributed as tdist  # tests may look under the hood; the package may not

    sent = []
    real = tdist.batch_isend_irecv

    def counting(ops):
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is tdist.isend)
        return real(ops)

    tdist.batch_isend_irecv = counting
    try:
        with dist.ledger() as led:
            dist.reduce_scatter(_seeded(shape, 3), dim=1)
    finally:
        tdist.batch_isend_irecv = real
    return sum(sent), led.records[0].bytes_sent


class SlowToUnpickle:
    """A result the parent takes a while to unpickle (a big object on a loaded machine)."""

    def __reduce__(self):
        return (_slow_rebuild, ())


def _slow_rebuild():
    time.sleep(1.5)
    return "slow"


def staggered_results_worker():
    if dist.get_rank() == 0:
        return SlowToUnpickle()
    return "fast"


def pid_file_worker(directory, bad_rank, how):
    """Write this rank's pid; the bad rank fails; the others sleep outside any collective."""
    with open(os.path.join(directory, f"rank{dist.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    dist.barrier()  # every pid is on disk before anyone fails
    if dist.get_rank() == bad_rank:
        if how == "raise":
            raise KeyError("boom on purpose")
        os.kill(os.getpid(), 9)
    time.sleep(300)  # only the launcher can stop these ranks in time
    return "unreachable"


def torchrun_user_code(out_path):
    """The same user code as under the local launcher, run by two env:// processes."""
    results = dist.launch(mappings_worker, 2, [(2, 3, 8)])
    with open(out_path, "w") as f:
        f.write(repr([all(ok for _, ok in checks) for checks in results]))


def sleepy_worker_with_pid(directory):
    """Each rank starts a process of its own (a grandchild of the launcher), then sleeps."""
    import subprocess
    child = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(directory, f"rank{dist.get_rank()}.child.pid"), "w") as f:
        f.write(str(child.pid))
    with open(os.path.join(directory, f"rank{dist.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


def mismatched_worker(kind):
    """Rank 0 and rank 1 issue different collectives at the same point of their schedules."""
    dist.check_collectives(False)  # what the launcher sees by itself (the suite turns the rank-side check on)
    x = torch.ones(2, 4)
    dist.all_reduce(x)  # one agreed collective first: the mismatch is the second
    if kind == "op":
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(4, 8), module="model.layers.0.mlp")
        else:
            dist.all_gather(torch.ones(4, 8), 0, module="model.layers.0.self_attn")
    elif kind == "extra":  # rank 1 issues a collective rank 0 does not
        if dist.get_rank() == 1:
            dist.all_reduce(torch.ones(3))
        dist.all_gather(torch.ones(5), 0)
    return "finished"


def checked_mismatch_worker():
    """The rank-side signature check on: both ranks raise naming both calls."""
    dist.check_collectives(True)
    try:
        dist.all_reduce(torch.ones(2, 4) if dist.get_rank() == 0 else torch.ones(4, 2), module="block")
    except dist.CollectiveMismatchError as exc:
        return str(exc)
    return "not detected"


def stuck_rank_worker():
    """Rank 1 never reaches the collective rank 0 waits in."""
    dist.check_collectives(False)  # a signature exchange would wait in rank 1's place
    dist.all_reduce(torch.ones(3))
    if dist.get_rank() == 1:
        time.sleep(300)
    dist.all_reduce(torch.ones(3), module="model.layers.1.mlp")
    return "finished"


def raising_peer_worker():
    """Rank 1 raises while rank 0 waits for it in a collective: rank 0's error is an echo."""
    if dist.get_rank() == 1:
        time.sleep(0.5)
        raise ValueError("the real cause, on purpose")
    dist.all_reduce(torch.ones(3))
    return "finished"


def child_starting_worker(directory):
    """Each rank starts a long-running process of its own and returns at once."""
    import subprocess
    child = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(directory, f"child{dist.get_rank()}.pid"), "w") as f:
        f.write(str(child.pid))
    return child.pid


def wire_worker(numels, dtype_name):
    """Each collective of each size under a ``wire=True`` ledger, on the world and on a sub-group of
    the even ranks: per call, the ring formula and what the sockets carried."""
    dtype = getattr(torch, dtype_name)
    p, r = dist.get_world_size(), dist.get_rank()
    evens = dist.new_group(list(range(0, p, 2))) if p >= 4 else None
    rows = []
    for group in [None] + ([evens] if evens is not None and r % 2 == 0 else []):
        q = dist.get_world_size(group)
        for n in numels:
            x = torch.ones(n * q, dtype=dtype)
            with dist.ledger(wire=True) as led:
                dist.all_reduce(x.clone(), group)
                dist.all_gather(x, 0, group)
                dist.reduce_scatter(x, 0, group)
                dist.broadcast(x.clone(), 0, group)
            rows += [(q, rec.op, rec.payload_bytes, rec.bytes_sent, rec.wire_bytes_sent) for rec in led.records]
    with dist.ledger(wire=True) as led:  # an asynchronous call is not measured (its bytes move later)
        dist.all_reduce(torch.ones(8), async_op=True).wait()
    with dist.ledger() as plain:  # nor anything unless the ledger asks
        dist.all_reduce(torch.ones(8))
    return rows, led.records[0].wire_bytes_sent, plain.records[0].wire_bytes_sent, plain.wire_bytes_sent(), _strided()


def _strided() -> dict:
    """All-reduce and broadcast of views that are not contiguous (a strided column, a transpose),
    on this (gloo) group: each equals the same call on a contiguous copy, the rest of the buffer
    untouched (gloo given such a view returns wrong values and writes past it)."""
    p, r = dist.get_world_size(), dist.get_rank()
    out = {}
    for name, view in (("column", lambda b: b[:, 1]), ("transpose", lambda b: b[1:, :3].t())):
        base = torch.arange(24, dtype=torch.float64).reshape(6, 4) * (r + 1)
        x = view(base)
        want = view(torch.arange(24, dtype=torch.float64).reshape(6, 4)) * (p * (p + 1) // 2)
        outside = base.clone()
        dist.all_reduce(x)
        view(outside).copy_(want)
        out[f"all_reduce {name}"] = bool(torch.equal(base, outside))
        base = torch.arange(24, dtype=torch.float64).reshape(6, 4) * (r + 1)
        outside = base.clone()
        dist.broadcast(view(base), 0)
        view(outside).copy_(view(torch.arange(24, dtype=torch.float64).reshape(6, 4)))
        out[f"broadcast {name}"] = bool(torch.equal(base, outside))
    return out


# ---- hangs and stuck ranks: every group's timeout, a peer that never comes, stopped and silent ranks ----

def _timeout_s(pg) -> tuple:
    """The seconds ``pg`` waits: a tpshm group's segment and its gloo group, or a gloo group's."""
    import torch.distributed as tdist  # tests may look under the hood; the package may not

    if hasattr(pg, "_gloo"):  # tensorpar's shared-memory group
        return (pg.segment.timeout_s if pg.segment is not None else None,
                pg._gloo.options._timeout.total_seconds())
    return (pg._get_backend(torch.device("cpu")).options._timeout.total_seconds(),)


def group_timeouts():
    """The timeout of every kind of group a rank can make without giving one (tensorpar's and
    torch's new_group, init_device_mesh's dimensions, new_subgroups), and what a launch from
    inside a rank says."""
    import torch.distributed as tdist
    from tensorpar.distributed import dp_engines

    r = dist.get_rank()
    pairs = [[0, 1], [2, 3]]
    kinds = {"world": tdist.group.WORLD}
    for name, make in (("tensorpar new_group", lambda ranks: dist.new_group(ranks)),
                       ("tensorpar new_group gloo", lambda ranks: dist.new_group(ranks, backend="gloo")),
                       ("torch new_group", lambda ranks: tdist.new_group(ranks)),
                       ("torch new_group gloo", lambda ranks: tdist.new_group(ranks, backend="gloo"))):
        kinds[name] = [make(ranks) for ranks in pairs][r // 2]  # every rank makes every group
    device_mesh = dp_engines.init_mesh(2, 2)
    kinds["mesh dp"], kinds["mesh tp"] = device_mesh["dp"].get_group(), device_mesh["tp"].get_group()
    kinds["new_subgroups"] = tdist.new_subgroups(2)[0]
    try:
        dist.launch(pid_worker, 2)
        nested = "no error"
    except ValueError as exc:
        nested = str(exc)
    return {name: _timeout_s(pg) for name, pg in kinds.items()}, nested


def _stamp(directory, name) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(repr(time.time()))


def _write_pid(directory) -> None:
    with open(os.path.join(directory, f"rank{dist.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))


def mesh_peer_never_comes_worker(directory):
    """dp 2 x tp 2: rank 0 all-reduces on its tp group ([0, 1]); rank 1 never comes. The tp group
    is init_device_mesh's: it waits the launch's timeout, not torch's 30-minute default."""
    from tensorpar.distributed import dp_engines

    _write_pid(directory)
    tp_group = dp_engines.init_mesh(2, 2)["tp"].get_group()
    if dist.get_rank() == 1:
        time.sleep(300)
    if dist.get_rank() == 0:
        _stamp(directory, "entered")
    dist.all_reduce(torch.ones(3, dtype=torch.float64), group=tp_group, module="model.layers.0.mlp")
    return "finished"


def long_timeout_group_worker(directory):
    """A group made with a timeout of its own (an hour) longer than the launch's: rank 0 waits in
    it for rank 1, which never comes; only the launcher's watch can end the wait in time."""
    import datetime

    import torch.distributed as tdist

    _write_pid(directory)
    group = tdist.new_group([0, 1], timeout=datetime.timedelta(hours=1))
    if dist.get_rank() == 1:
        time.sleep(300)
    _stamp(directory, "entered")
    dist.all_reduce(torch.ones(3), group=group)
    return "finished"


def stopped_rank_worker(directory):
    """Rank 1 is stopped (SIGSTOP) right after its second all-reduce moved its data, before the
    flight recorder saw it leave: its slot still says "in all_reduce #2" while rank 0 waits in #3
    (the state once reported as "ranks 0 and 1 are in different collectives")."""
    import signal

    from tensorpar.distributed import flight

    dist.check_collectives(False)  # a signature exchange would not change what is watched
    _write_pid(directory)
    if dist.get_rank() == 1:
        real_leave = flight.leave

        def leave_then_stop(seq):
            if seq == 2:
                _stamp(directory, "stopped")
                os.kill(os.getpid(), signal.SIGSTOP)
            real_leave(seq)
        flight.leave = leave_then_stop
    for _ in range(3):
        dist.all_reduce(torch.ones(3))
    return "finished"


def silent_rank_worker(directory):
    """Rank 1 holds Python's GIL in native code (libc's sleep through ctypes.PyDLL, which keeps
    the GIL): it is not stopped, but nothing of it runs, not even its heartbeat."""
    import ctypes

    dist.check_collectives(False)
    _write_pid(directory)
    dist.all_reduce(torch.ones(3))
    if dist.get_rank() == 1:
        _stamp(directory, "silent")
        ctypes.PyDLL(None).sleep(60)
    dist.all_reduce(torch.ones(3))
    return "finished"


def nested_launch_worker():
    """`make faults`: a launch inside a rank, refused there (the message, or "no error")."""
    try:
        dist.launch(pid_worker, 2)
        return "no error"
    except ValueError as exc:
        return str(exc)


def environment_worker(name):
    """What a rank sees: the variable ``name`` and its parent process."""
    return os.environ.get(name), os.getppid()


def sigterm_worker():
    """Whether SIGTERM has its default action in this rank, and the rank's parent."""
    import signal
    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, os.getppid()


def freed_memory_worker(blocks: int = 12, mib: int = 8):
    """The rank's setting, what its allocator was set to, and the page faults of filling
    ``blocks`` blocks of ``mib`` MiB after they were filled and freed three times (as a training
    step frees and allocates its buffers every step). A rank that keeps its freed memory
    (:mod:`tensorpar.distributed.host_memory`) takes next to none. Under glibc's defaults the count
    depends on the heap's history (whether small blocks pin its top against a trim), from none to
    every page: not a figure a test can hold."""
    import resource
    from tensorpar.distributed import host_memory, settings
    for _ in range(3):
        held = [torch.ones(mib << 18) for _ in range(blocks)]
        del held
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = [torch.ones(mib << 18) for _ in range(blocks)]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del held
    return settings.host_memory(), host_memory._applied, faults
