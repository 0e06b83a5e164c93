"""``tpshm``: a torch.distributed backend whose collectives run over shared memory between the
ranks of one host, and over gloo otherwise.

Why: on one machine a gloo collective goes through loopback TCP and costs about 1 ms whatever
its size; a decode step of a split model makes two dozen of them. Over a shared segment
(:mod:`tensorpar.dist.shm_segment`) an all-reduce of 8 KiB between two ranks takes tens of
microseconds. No maintained package offers this for torch 2.13 on CPU without a compiler
(DeepSpeed's and vLLM's shared-memory all-reduces are C++ extensions built against their own
torch), so the backend is this small Python ``ProcessGroup``, registered with
``torch.distributed.Backend.register_backend``: groups made by ``init_process_group`` and
``new_group`` use it, and every caller (tensorpar's collectives, the ledger, DDP) sees ordinary
collectives.

Per group, at creation: if every rank is on this host (same hostname, boot, pid namespace and
``/dev/shm``) and the machine is x86-64, rank 0 makes a segment every rank maps; otherwise, or
if the segment cannot be made, the group runs on the gloo group it always builds alongside (also
used for point-to-point sends and the ops below that shared memory does not serve).
:func:`transport` says which, per group. ``TENSORPAR_TRANSPORT=gloo`` (or ``launch(...,
backend="gloo")``) turns shared memory off.

Served over shared memory: all-reduce (sum, max, min, product), all-gather (tensor and list),
reduce-scatter (tensor and list), broadcast, barrier. Exactness: every rank sums the slots in
rank order ``((x_0 + x_1) + x_2) + ...`` in the tensor's dtype, so all ranks hold the same bits; at
2 ranks that equals gloo's result bit for bit (addition commutes), at more it differs from
gloo's ring only by summation order. Tensors larger than a slot (``TENSORPAR_SHM_SLOT_BYTES``,
default 1 MiB per rank) go through in slot-sized pieces.
"""
from __future__ import annotations

import datetime
import json
import os
import secrets
import warnings

import torch
import torch.distributed as tdist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from tensorpar.dist import flight, settings, shm_segment as seg
from tensorpar.dist.ledger import active_ledger

BACKEND = "tpshm"
_REDUCE = {tdist.ReduceOp.SUM: torch.Tensor.add_, tdist.ReduceOp.PRODUCT: torch.Tensor.mul_,
           tdist.ReduceOp.MAX: lambda a, b: torch.maximum(a, b, out=a),
           tdist.ReduceOp.MIN: lambda a, b: torch.minimum(a, b, out=a)}
_KIND = {op: i for i, op in enumerate(_REDUCE)}  # compared across ranks with each round's signature
_BY_NAME = {"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN}
# Everything else goes to the gloo group each ShmProcessGroup keeps.
_TO_GLOO = {name: name for name in ("send", "recv", "recv_anysource", "gather", "scatter", "reduce", "alltoall",
                                    "alltoall_base", "allreduce_coalesced", "allgather_coalesced",
                                    "monitored_barrier")}
_TO_GLOO["all_to_all_single"] = "alltoall_base"  # ProcessGroup's name -> the gloo backend's


def _done(result) -> "tdist.Work":
    future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


class ShmProcessGroup(tdist.ProcessGroup):
    """One group: collectives over ``segment`` when every rank shares this host, else over gloo."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self._name = ""
        self._gloo = tdist.ProcessGroupGloo(store, rank, size, timeout)
        self.segment, self.why_not = _attach(store, rank, size, timeout)

    # torch names a group on its backends, and a Python process group has none: it keeps its own
    # name, which a DeviceMesh reads to find the group again (init_device_mesh on these ranks)
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def _seen(self, op: str, tensor: torch.Tensor, shape=None, src: int = 0) -> None:
        """A collective PyTorch issued on this group itself (DDP's gradient buckets, FSDP2's
        parameter all-gathers and gradient reduce-scatters), recorded into the open ledger as
        tensorpar's own are: ``phase`` backward while autograd runs a backward pass, the module the ledger
        sees running (FSDP's forward all-gathers: the block about to run), else ``data_parallel``."""
        led = active_ledger()
        if led is None or flight.own_call():
            return
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"  # also its final callbacks
        led.record(op, tensor, self.size(), phase=phase, module=led.current_module() or "data_parallel",
                   shape=shape, rank=self.rank(), src=src, broadcast_algorithm="shared" if self.segment else "tree",
                   group=self._name)

    # ---- served over shared memory --------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        for t in tensors:
            self._seen("all_reduce", t)
        op = _op(opts)
        if self.segment is None or len(tensors) != 1 or not _cpu(tensors) or op not in _REDUCE:
            return self._gloo.allreduce(tensors, opts) if opts is not None else self._gloo.allreduce(tensors)
        _allreduce(self.segment, tensors[0], op)
        return _done(tensors)

    def all_gather_single(self, output, input, opts=None):
        self._seen("all_gather", output)
        if self.segment is None or not _cpu([output, input]) or not _contiguous([output, input]):
            return self._gloo._allgather_base(output, input, *(() if opts is None else (opts,)))
        all_gather_single(self.segment, output, input)
        return _done([output])

    def allgather(self, output_lists, inputs, opts=None):
        self._seen("all_gather", inputs[0], shape=(self.size() * inputs[0].numel(),))
        if (self.segment is None or len(inputs) != 1 or not _cpu(inputs + output_lists[0])
                or not _contiguous(inputs) or any(o.numel() != inputs[0].numel() or o.dtype != inputs[0].dtype
                                                  for o in output_lists[0])):
            return self._gloo.allgather(output_lists, inputs, *(() if opts is None else (opts,)))
        outs = [o if o.is_contiguous() else torch.empty_like(o) for o in output_lists[0]]
        _allgather(self.segment, _bytes(inputs[0]), [_bytes(o) for o in outs])
        for o, tmp in zip(output_lists[0], outs):
            if tmp is not o:
                o.copy_(tmp)
        return _done(output_lists)

    def reduce_scatter_single(self, output, input, opts=None):
        self._seen("reduce_scatter", input)
        op = _op(opts)
        if self.segment is None or not _cpu([output, input]) or not _contiguous([output]) or op not in _REDUCE:
            return self._gloo._reduce_scatter_base(output, input, *(() if opts is None else (opts,)))
        _check_sizes("reduce_scatter", input, output, self.size())
        _reduce_scatter(self.segment, input.reshape(self.size(), -1), output, op)
        return _done([output])

    def reduce_scatter(self, outputs, input_lists, opts=None):
        self._seen("reduce_scatter", outputs[0], shape=(self.size() * outputs[0].numel(),))
        op = _op(opts)
        if (self.segment is None or len(outputs) != 1 or not _cpu(outputs + input_lists[0]) or op not in _REDUCE
                or not _contiguous(outputs) or any(i.numel() != outputs[0].numel() or i.dtype != outputs[0].dtype
                                                   for i in input_lists[0])):
            return self._gloo.reduce_scatter(outputs, input_lists, *(() if opts is None else (opts,)))
        stacked = torch.stack([i.reshape(-1) for i in input_lists[0]])  # (p, n)
        _reduce_scatter(self.segment, stacked, outputs[0], op)
        return _done(outputs)

    def broadcast(self, tensors, opts=None):
        self._seen("broadcast", tensors[0], src=opts.rootRank if opts is not None else 0)
        if self.segment is None or len(tensors) != 1 or not _cpu(tensors) or not _contiguous(tensors):
            return self._gloo.broadcast(tensors, *(() if opts is None else (opts,)))
        _broadcast(self.segment, tensors[0], opts.rootRank if opts is not None else 0)
        return _done(tensors)

    def barrier(self, opts=None):
        if self.segment is None:
            return self._gloo.barrier(*(() if opts is None else (opts,)))
        _barrier(self.segment)
        return _done(None)

    _allgather_base = all_gather_single  # the names older callers use
    _reduce_scatter_base = reduce_scatter_single


def _forward_to_gloo(name, gloo_name):
    def method(self, *args, **kwargs):
        return getattr(self._gloo, gloo_name)(*args, **kwargs)
    method.__name__ = name
    return method


for _name, _gloo_name in _TO_GLOO.items():
    setattr(ShmProcessGroup, _name, _forward_to_gloo(_name, _gloo_name))


def _check_sizes(what: str, big: torch.Tensor, small: torch.Tensor, p: int) -> None:
    """Before any round: ``big`` holds ``p`` times ``small``'s elements, in the same dtype."""
    if big.numel() != p * small.numel() or big.dtype != small.dtype:
        raise ValueError(f"{what} over a group of {p}: tensors of {big.numel()} {big.dtype} and {small.numel()} "
                         f"{small.dtype} elements; the larger must hold {p} x the smaller, in the same dtype")


def _contiguous(tensors) -> bool:
    return all(t.is_contiguous() for t in tensors)


def _guarded(fn):
    """A collective that raises once its rounds have begun leaves the ranks out of step: the
    group is marked failed (as a failed communicator stays failed) instead of reading stale slots."""
    def run(s: seg.Segment, *args):
        try:
            return fn(s, *args)
        except BaseException as exc:
            if not s.broken:
                s.broken = f"a collective raised on rank {s.rank} midway: {type(exc).__name__}: {exc}"
            raise
    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    return run


@_guarded
def _barrier(s: seg.Segment) -> None:
    g = s.begin()
    s.arrive(g)
    s.depart(g)


def _op(opts):
    """The options' reduction as a ``RedOpType`` (a ``ReduceOp`` does not find itself in a dict)."""
    return opts.reduceOp.op if opts is not None else tdist.ReduceOp.SUM


def _cpu(tensors) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as flat uint8 (a view: writing it writes ``t``)."""
    if not t.is_contiguous():
        raise ValueError("tpshm: collectives take contiguous tensors")
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)


def _pieces(n: int, per: int):
    per = max(per, 1)
    return [(a, min(a + per, n)) for a in range(0, max(n, 1), per)]


@_guarded
def _allreduce(s: seg.Segment, x: torch.Tensor, op) -> None:
    """In place, ``op`` a ``RedOpType``: every rank combines the slots in rank order."""
    combine, kind = _REDUCE[op], _KIND[op]
    flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
    views, size = s.typed(flat.dtype), flat.element_size()
    for a, b in _pieces(flat.numel(), views[0].numel()):
        g = s.begin()
        views[s.rank][: b - a].copy_(flat[a:b])
        s.arrive(g, 1, flat.numel() * size, kind)
        out = flat[a:b]
        out.copy_(views[0][: b - a])
        for r in range(1, s.size):  # rank order on every rank: the same bits everywhere
            combine(out, views[r][: b - a])
        s.depart(g)
    if flat.data_ptr() != x.data_ptr():
        x.copy_(flat.view_as(x))


@_guarded
def _allgather(s: seg.Segment, mine: torch.Tensor, outs: list) -> None:
    """``mine``: this rank's bytes; ``outs[r]``: where rank r's bytes go."""
    for a, b in _pieces(mine.numel(), s.slot_bytes):
        g = s.begin()
        s.slots[s.rank][: b - a].copy_(mine[a:b])
        s.arrive(g, 2, mine.numel())
        for r, out in enumerate(outs):
            out[a:b].copy_(s.slots[r][: b - a])
        s.depart(g)


@_guarded
def _reduce_scatter(s: seg.Segment, rows: torch.Tensor, out: torch.Tensor, op) -> None:
    """``rows``: (p, n), row j destined for rank j; ``out`` (n elements) gets the combined own row."""
    combine, kind = _REDUCE[op], _KIND[op]
    p, n = rows.shape
    flat_out = out.view(-1)
    size = rows.element_size()
    per = s.slot_bytes // (p * size)
    for a, b in _pieces(n, per):
        w = b - a
        g = s.begin()
        s.slots[s.rank][: p * w * size].view(rows.dtype).view(p, w).copy_(rows[:, a:b])
        s.arrive(g, 3, p * n * size, kind)
        own = [s.slots[r][: p * w * size].view(rows.dtype).view(p, w)[s.rank] for r in range(p)]  # (w,) each
        flat_out[a:b].copy_(own[0])
        for r in range(1, p):
            combine(flat_out[a:b], own[r])
        s.depart(g)


@_guarded
def _broadcast(s: seg.Segment, x: torch.Tensor, root: int) -> None:
    data = _bytes(x)
    for a, b in _pieces(data.numel(), s.slot_bytes):
        g = s.begin()
        if s.rank == root:
            s.slots[root][: b - a].copy_(data[a:b])
        s.arrive(g, 4, data.numel(), root)
        if s.rank != root:
            data[a:b].copy_(s.slots[root][: b - a])
        s.depart(g)


def _attach(store, rank: int, size: int, timeout) -> "tuple[seg.Segment | None, str | None]":
    """Every rank agrees, through the group's store, on one segment or on none (and why)."""
    why = _why_not(size)
    store.set(f"tpshm/host{rank}", json.dumps({"host": seg.host_identity(), "pid": os.getpid(), "why": why}))
    peers = [json.loads(store.get(f"tpshm/host{r}")) for r in range(size)]
    why = next((p["why"] for p in peers if p["why"]), None)
    if why is None and len({p["host"] for p in peers}) > 1:
        why = "the group's ranks are on more than one host"
    if why is not None:
        return None, why
    segment = _map_segment(store, rank, size)
    try:
        store.set(f"tpshm/mapped{rank}", "ok" if segment is not None else "failed")
        ok = all(store.get(f"tpshm/mapped{r}") == b"ok" for r in range(size))
    finally:
        if rank == 0 and segment is not None:
            os.unlink(segment.path)  # every rank has it mapped (or gave up): nothing stays in /dev/shm
    if not ok:
        return None, "a rank could not map the shared segment"
    segment.peer_pids = [p["pid"] for p in peers]
    segment.timeout_s = timeout.total_seconds()
    segment.spin = 2000 if size <= len(os.sched_getaffinity(0)) else 0
    return segment, None


def _why_not(size: int) -> str | None:
    if settings.transport() == "gloo":
        return "TENSORPAR_TRANSPORT=gloo"
    if size == 1:
        return "a group of one rank moves nothing"
    return seg.usable()


def _map_segment(store, rank: int, size: int) -> "seg.Segment | None":
    slot_bytes = settings.shm_slot_bytes()
    if rank == 0:
        seg.sweep_stale()
        path = os.path.join(seg.SHM_DIR, f"{seg.PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        try:
            segment = seg.Segment(path, 0, size, slot_bytes, create=True)
        except OSError as exc:
            warnings.warn(f"tpshm: could not make a {size * slot_bytes} B segment in {seg.SHM_DIR} ({exc}); "
                          f"this group runs over gloo", RuntimeWarning)
            store.set("tpshm/path", "")
            return None
        store.set("tpshm/path", path)
        return segment
    path = store.get("tpshm/path").decode()
    if not path:
        return None
    try:
        return seg.Segment(path, rank, size, slot_bytes, create=False)
    except OSError as exc:
        warnings.warn(f"tpshm: rank {rank} could not map {path} ({exc}); this group runs over gloo", RuntimeWarning)
        return None


def segment_of(group, tensor: torch.Tensor) -> "seg.Segment | None":
    """The shared segment ``group``'s collectives on ``tensor`` run over, or None (gloo, NCCL, a
    tensor off the CPU). tensorpar's own collectives call the transport directly then: the
    ``torch.distributed`` call around it costs half as much again as the transfer (an 8 KiB
    all-reduce between 2 ranks: 47 us directly, 70 us through ``torch.distributed.all_reduce``;
    ``tools/allreduce_latency.py``)."""
    pg = tdist.GroupMember.WORLD if group is None else group
    segment = getattr(pg, "segment", None)
    return segment if segment is not None and tensor.device.type == "cpu" else None


def all_reduce(segment: "seg.Segment", x: torch.Tensor, op: str) -> None:
    """In place, ``op`` one of ``"sum"``, ``"max"``, ``"min"``."""
    _allreduce(segment, x, _BY_NAME[op])


def all_gather_single(segment: "seg.Segment", out: torch.Tensor, x: torch.Tensor) -> None:
    """``out``: every rank's ``x`` concatenated along dim 0 (contiguous)."""
    _check_sizes("all_gather", out, x, segment.size)
    _allgather(segment, _bytes(x), [_bytes(o) for o in out.view(segment.size, -1)])


def reduce_scatter_single(segment: "seg.Segment", out: torch.Tensor, x: torch.Tensor) -> None:
    """``out``: the sum over ranks of this rank's chunk of ``x`` (dim 0 split in group-size chunks)."""
    _check_sizes("reduce_scatter", x, out, segment.size)
    _reduce_scatter(segment, x.reshape(segment.size, -1), out, tdist.ReduceOp.SUM)


def broadcast(segment: "seg.Segment", x: torch.Tensor, root: int) -> None:
    """In place, from group rank ``root``."""
    _broadcast(segment, x, root)


def transport(group=None) -> str:
    """What ``group``'s collectives travel over: ``"shm"``, ``"gloo"`` or ``"nccl"`` (``"none"``
    without a process group)."""
    if not tdist.is_initialized():
        return "none"
    pg = tdist.GroupMember.WORLD if group is None else group
    if isinstance(pg, ShmProcessGroup):
        return "shm" if pg.segment is not None else "gloo"
    return tdist.get_backend(group)


def _create(store, rank, size, timeout):
    return ShmProcessGroup(store, rank, size, timeout)


if BACKEND not in tdist.Backend.backend_list:
    tdist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
