"""Workers for tests/test_dist_shm.py (spawned ranks import them)."""
import os
import resource
import signal
import time
import zlib

import torch
import torch.distributed as tdist

from tensorpar import distributed as dist
from tensorpar.distributed import shm
from tensorpar.distributed import shm_segment as seg

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
    return cpu, wall1 - wall0, x.tolist(), _stopwatched(r, seconds / 4)


def _stopwatched(rank, late):
    """Under a stopwatch, rank 1 ``late`` seconds late to each collective: an all-reduce (the
    shared-memory fast path), an all-gather (the timed path a ledger takes), a reduce-scatter, a
    broadcast, and an asynchronous all-reduce whose ``wait()`` blocks; each call's seconds on the
    stopwatch, the global module hooks seen inside, and the seconds a ledger open inside a
    stopwatch records beside the stopwatch's."""
    from torch.nn.modules import module as nn_module

    from tensorpar.distributed import collectives

    gloo = dist.new_group([0, 1], backend="gloo")  # asynchronous for real (shared memory serves in the call)
    dist.check_collectives(False)  # nor does the flight recorder's check wait for the peer in the call

    def waited_async():
        work = collectives.all_reduce(torch.ones(4), gloo, async_op=True)
        time.sleep(late / 2)  # work overlapping the call: not the collective's time
        work.wait()
    out = {}
    with collectives.stopwatch() as watch:
        for name, call in (("all_reduce", lambda: collectives.all_reduce(torch.ones(4))),
                           ("all_gather", lambda: collectives.all_gather(torch.ones(4), 0)),
                           ("reduce_scatter", lambda: collectives.reduce_scatter(torch.ones(4), 0)),
                           ("broadcast", lambda: collectives.broadcast(torch.ones(4), 0)),
                           ("async", waited_async)):
            tdist.barrier()
            if rank == 1:
                time.sleep(late)
            before = watch.seconds
            call()
            out[name] = watch.seconds - before
        torch.nn.Linear(2, 2)(torch.ones(2))
        out["hooks"] = len(nn_module._global_forward_pre_hooks) + len(nn_module._global_forward_hooks)
        before = watch.seconds
        with dist.ledger() as led:
            collectives.all_reduce(torch.ones(4))
        out["nested"] = (watch.seconds - before, led.seconds_in_collectives())
    return out


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
    from tensorpar.distributed import flight
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


# ---- every ReduceOp, every layout, against gloo (test_every_op_and_layout_...) --------------------

R_ = tdist.ReduceOp
FLOAT_OPS = (R_.SUM, R_.PRODUCT, R_.MIN, R_.MAX, R_.AVG)
INT_OPS = (R_.SUM, R_.PRODUCT, R_.MIN, R_.MAX, R_.BAND, R_.BOR, R_.BXOR)
MATRIX_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.int64)
# every one but "contiguous" is a non-contiguous view or a view with a storage offset inside a
# larger buffer whose other elements must stay as they were
LAYOUTS = ("contiguous", "strided", "transposed", "offset", "columns")
_FILL = 7
_IN_ORDER = {R_.SUM: torch.add, R_.AVG: torch.add, R_.PRODUCT: torch.mul, R_.MIN: torch.minimum,
             R_.MAX: torch.maximum, R_.BAND: torch.bitwise_and, R_.BOR: torch.bitwise_or,
             R_.BXOR: torch.bitwise_xor}


def _values(key, rank, shape, dtype):
    """Rank ``rank``'s input of case ``key``: every rank can make every rank's, so the reference
    needs no communication."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()) * 8 + rank)  # hash() differs per process
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def _laid_out(values, layout):
    """``(view, buffer)``: a view equal to ``values`` (R, C) laid out as ``layout`` in ``buffer``,
    whose other elements hold ``_FILL``."""
    r, c = values.shape
    full = lambda *shape: torch.full(shape, _FILL, dtype=values.dtype)  # noqa: E731
    if layout == "contiguous":
        buffer = values.clone()
        return buffer, buffer
    if layout == "transposed":  # no other elements: the view is the whole buffer, transposed
        buffer = values.t().contiguous()
        return buffer.t(), buffer
    if layout == "strided":
        buffer = full(r, 2 * c)
        view = buffer[:, ::2]
    elif layout == "offset":  # contiguous, at a storage offset
        buffer = full(r * c + 5)
        view = buffer[3:3 + r * c].view(r, c)
    else:  # "columns": rows with a stride longer than their length
        buffer = full(r, c + 3)
        view = buffer[:, 1:1 + c]
    view.copy_(values)
    return view, buffer


def _reduced(parts, op):
    """``op`` over ``parts`` in rank order, in their dtype (AVG: the sum divided by their count)."""
    out = parts[0].clone()
    for part in parts[1:]:
        out = _IN_ORDER[op](out, part)
    return out / len(parts) if op == R_.AVG else out


def _gamma(n, dtype):
    """gamma_n = n u / (1 - n u): the relative error bound of n roundings (Higham, eq. 3.8)."""
    u = _UNIT_ROUNDOFF[dtype]
    return n * u / (1 - n * u)


def _order_bound(parts, op):
    """Elementwise bound on the difference of two results of ``op`` over ``parts`` computed in two
    orders: each within gamma_{p-1} * sum|x_i| (SUM; / p for AVG) or * prod|x_i| (PRODUCT) of the
    exact result (Higham, eqs. 4.4 and 3.10)."""
    p, dtype = len(parts), parts[0].dtype
    wide = [x.double().abs() for x in parts]
    scale = torch.stack(wide).prod(0) if op == R_.PRODUCT else torch.stack(wide).sum(0) / (p if op == R_.AVG else 1)
    return 2 * _gamma(p - 1, dtype) * scale


class _Matrix:
    """One group's checks; ``failures`` collects what differs, ``counts`` what was checked."""

    def __init__(self, group, gloo, ranks, fallback):
        self.group, self.gloo, self.ranks, self.fallback = group, gloo, ranks, fallback
        self.p, self.me = len(ranks), ranks.index(tdist.get_rank())
        self.name = f"{'gloo fallback' if fallback else 'shm'} group {ranks}"
        self.failures, self.counts = [], {}

    def _served(self, call, what):
        """Run ``call``; over shared memory it must have taken rounds there (nothing went to gloo)."""
        seg_ = None if self.fallback else self.group.segment
        before = seg_.round if seg_ is not None else 0
        call()
        if seg_ is not None and seg_.round == before:
            self.failures.append(f"{self.name} {what}: not served over shared memory")
        self.counts[what.split()[0]] = self.counts.get(what.split()[0], 0) + 1

    def check(self, what, got_buffer, want, layout, gloo_result=None, parts=None, op=None):
        """The caller's buffer holds ``want`` in its view and ``_FILL`` elsewhere, bit for bit;
        then against gloo's result on contiguous copies of the same inputs."""
        want_buffer = _laid_out(want, layout)[1]
        if not torch.equal(got_buffer, want_buffer):
            self.failures.append(f"{self.name} {what}: differs from the rank-order result or wrote outside its view")
        if gloo_result is None:
            return
        dtype = want.dtype
        exact = (self.fallback or self.p == 2 or not dtype.is_floating_point
                 or op in (R_.MIN, R_.MAX, R_.BAND, R_.BOR, R_.BXOR))
        if exact and not torch.equal(want, gloo_result):
            self.failures.append(f"{self.name} {what}: differs from gloo's bits")
        elif not exact and bool(((want.double() - gloo_result.double()).abs() > _order_bound(parts, op)).any()):
            self.failures.append(f"{self.name} {what}: differs from gloo beyond the order of the operations")

    def everyone(self, key, shape, dtype):
        return [_values(key, r, shape, dtype) for r in range(self.p)]


def _reductions(m: _Matrix, dtype, shape):
    r, c = shape
    for op in FLOAT_OPS if dtype.is_floating_point else INT_OPS:
        parts = m.everyone(("ar", dtype, op), shape, dtype)
        ref = parts[m.me].clone()
        tdist.all_reduce(ref, op=op, group=m.gloo)
        rows = m.everyone(("rs", dtype, op), (m.p * r, c), dtype)  # chunk j of dim 0 goes to rank j
        rs_ref = torch.empty(shape, dtype=dtype)
        tdist.reduce_scatter_single(rs_ref, rows[m.me].clone(), op=op, group=m.gloo)
        mine = [chunk.clone() for chunk in rows[m.me].chunk(m.p)]
        rsl_ref = torch.empty(shape, dtype=dtype)
        tdist.reduce_scatter(rsl_ref, [x.clone() for x in mine], op=op, group=m.gloo)
        own = [row.chunk(m.p)[m.me] for row in rows]
        for layout in LAYOUTS:
            name = f"{dtype} {op.name} {layout}"
            x, buf = _laid_out(parts[m.me], layout)
            m._served(lambda: tdist.all_reduce(x, op=op, group=m.group), f"all_reduce {name}")
            m.check(f"all_reduce {name}", buf, _reduced(parts, op) if not m.fallback else ref, layout, ref, parts, op)
            src = _laid_out(rows[m.me], layout)[0]
            out, obuf = _laid_out(torch.zeros(shape, dtype=dtype), layout)
            m._served(lambda: tdist.reduce_scatter_single(out, src, op=op, group=m.group),
                      f"reduce_scatter {name}")
            m.check(f"reduce_scatter {name}", obuf, _reduced(own, op) if not m.fallback else rs_ref,
                    layout, rs_ref, own, op)
            ins = [_laid_out(chunk, layout)[0] for chunk in mine]
            out, obuf = _laid_out(torch.zeros(shape, dtype=dtype), layout)
            m._served(lambda: tdist.reduce_scatter(out, ins, op=op, group=m.group), f"reduce_scatter_list {name}")
            m.check(f"reduce_scatter (list) {name}", obuf, _reduced(own, op) if not m.fallback else rsl_ref,
                    layout, rsl_ref, own, op)


def _gathers(m: _Matrix, dtype, shape):
    r, c = shape
    parts = m.everyone(("ag", dtype), shape, dtype)
    for layout in LAYOUTS + ("expanded",):  # an expanded view is an input, never an output, here
        name = f"{dtype} {layout}"
        inputs = [p[:1].expand(shape) for p in parts] if layout == "expanded" else parts
        out_layout = "contiguous" if layout == "expanded" else layout
        x = inputs[m.me] if layout == "expanded" else _laid_out(parts[m.me], layout)[0]
        out, obuf = _laid_out(torch.zeros((m.p * r, c), dtype=dtype), out_layout)
        m._served(lambda: tdist.all_gather_single(out, x, group=m.group), f"all_gather {name}")
        m.check(f"all_gather {name}", obuf, torch.cat(inputs), out_layout)
        outs = [_laid_out(torch.zeros(shape, dtype=dtype), out_layout) for _ in range(m.p)]
        m._served(lambda: tdist.all_gather([o for o, _ in outs], x, group=m.group), f"all_gather_list {name}")
        for j, (_, b) in enumerate(outs):
            m.check(f"all_gather (list) {name} slot {j}", b, inputs[j], out_layout)
        if layout == "expanded":
            continue
        for src in range(m.p):
            y, ybuf = _laid_out(parts[m.me], layout)
            m._served(lambda: tdist.broadcast(y, group_src=src, group=m.group), f"broadcast {name}")
            m.check(f"broadcast {name} from {src}", ybuf, parts[src], layout)


def _big(m: _Matrix):
    """Past a slot (1 MiB per rank): a strided all-reduce and a reduce-scatter into a column slice
    go through in pieces."""
    shape = (600, 500)  # float32: 1.2 MB
    parts = m.everyone(("big", "ar"), shape, torch.float32)
    x, buf = _laid_out(parts[m.me], "strided")
    m._served(lambda: tdist.all_reduce(x, op=R_.AVG, group=m.group), "all_reduce big")
    ref = parts[m.me].clone()
    tdist.all_reduce(ref, op=R_.AVG, group=m.gloo)
    m.check("all_reduce float32 AVG strided 1.2 MB", buf, _reduced(parts, R_.AVG) if not m.fallback else ref,
            "strided", ref, parts, R_.AVG)


def _forwarded(m: _Matrix, shape=(3, 5)):
    """What the backend hands to gloo whatever the transport (reduce, scatter, gather), on views:
    gloo alone returned wrong values for strided reduce and scatter. Against gloo's result on
    contiguous copies (the same algorithm: the same bits), the rest of each buffer untouched."""
    dtype, root = torch.float64, m.ranks[0]
    parts = m.everyone(("forwarded", "reduce"), shape, dtype)
    ref = parts[m.me].clone()
    tdist.reduce(ref, dst=root, group=m.gloo)
    rows = m.everyone(("forwarded", "scatter"), (m.p, *shape), dtype)[0]  # the root's row j goes to rank j
    for layout in LAYOUTS:
        x, buf = _laid_out(parts[m.me], layout)
        tdist.reduce(x, dst=root, group=m.group)
        if m.me == 0:  # what the other ranks' tensors hold after a reduce is not defined
            m.check(f"reduce {layout}", buf, ref, layout)
        out, obuf = _laid_out(torch.zeros(shape, dtype=dtype), layout)
        tdist.scatter(out, [_laid_out(r, layout)[0] for r in rows] if m.me == 0 else None, src=root, group=m.group)
        m.check(f"scatter {layout}", obuf, rows[m.me], layout)
        outs = [_laid_out(torch.zeros(shape, dtype=dtype), layout) for _ in range(m.p)] if m.me == 0 else []
        tdist.gather(_laid_out(parts[m.me], layout)[0], [o for o, _ in outs] or None, dst=root, group=m.group)
        for j, (_, b) in enumerate(outs):
            m.check(f"gather {layout} into slot {j}", b, parts[j], layout)
        m.counts["forwarded"] = m.counts.get("forwarded", 0) + 3


def ops_and_layouts_worker(world_groups):
    """Every ReduceOp x dtype x layout through all_reduce, reduce_scatter (tensor and list),
    all_gather (tensor and list) and broadcast, on the shared-memory groups and on groups of the
    same backend without a segment (its gloo fallback), at 2 and 4 ranks; then the refusals."""
    r = tdist.get_rank()
    matrices = []
    for ranks in world_groups:
        shm_group, gloo_group = tdist.new_group(ranks), tdist.new_group(ranks, backend="gloo")
        if r in ranks:
            matrices.append(_Matrix(shm_group, gloo_group, ranks, False))
        if len(ranks) == 2:  # what it hands to gloo does not depend on the group's size
            os.environ["TENSORPAR_TRANSPORT"] = "gloo"  # read when a group is made: this one has no segment
            fallback = tdist.new_group(ranks)
            del os.environ["TENSORPAR_TRANSPORT"]
            if r in ranks:
                matrices.append(_Matrix(fallback, gloo_group, ranks, True))
    for m in matrices:
        if m.fallback != (shm.transport(m.group) == "gloo"):
            m.failures.append(f"{m.name} runs over {shm.transport(m.group)}")
        for dtype in MATRIX_DTYPES:
            _reductions(m, dtype, (3, 5))
            _gathers(m, dtype, (3, 5))
        _big(m)
        _forwarded(m)
    refusals = {m.name: _refusals(m) for m in matrices}
    return [(m.name, m.failures, m.counts) for m in matrices], refusals


def _refusals(m: _Matrix) -> list:
    """What no backend here does exactly: ValueError on every rank before any round; the group
    works after each."""
    premul = tdist._make_nccl_premul_sum(2.0)
    out = []
    for call in (lambda: tdist.all_reduce(torch.ones(4, dtype=torch.float64), op=premul, group=m.group),
                 lambda: tdist.all_reduce(torch.ones(4), op=R_.BAND, group=m.group),
                 lambda: tdist.all_reduce(torch.ones(4, dtype=torch.int64), op=R_.AVG, group=m.group),
                 lambda: tdist.reduce_scatter_single(torch.ones(2, dtype=torch.int64),
                                                     torch.ones(2 * m.p, dtype=torch.int64), op=R_.AVG,
                                                     group=m.group),
                 lambda: tdist.all_reduce(torch.ones(1).expand(4), group=m.group),
                 lambda: tdist.all_gather_single(torch.ones(1).expand(4 * m.p), torch.ones(4), group=m.group)):
        try:
            call()
            message = "accepted"
        except ValueError as exc:
            message = str(exc)
        x = torch.full((3,), float(m.me + 1))
        tdist.all_reduce(x, group=m.group)
        out.append((message, x.tolist() == [m.p * (m.p + 1) / 2] * 3))
    return out
