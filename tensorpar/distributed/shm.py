"""``tpshm``: a torch.distributed backend whose collectives run over shared memory between the
ranks of one host, and over gloo otherwise.

Why: on one machine a gloo collective goes through loopback TCP and costs about 1 ms whatever
its size; a decode step of a split model makes two dozen of them. Over a shared segment
(:mod:`tensorpar.distributed.shm_segment`) an all-reduce of 8 KiB between two ranks takes tens of
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

Served over shared memory: all-reduce and reduce-scatter (tensor and list) with every
``ReduceOp`` but ``PREMUL_SUM`` (SUM, PRODUCT, MIN, MAX, AVG; BAND, BOR, BXOR on integers and
bool), all-gather (tensor and list), broadcast, barrier, on tensors of any layout: a
non-contiguous one (a strided slice, a transpose, an expanded input) travels as a contiguous
copy and the result is copied back into the caller's view. Refused with ``ValueError`` before
any round, on every transport (gloo would refuse too, or write elsewhere): ``PREMUL_SUM``, AVG
on integers, a bitwise op on floating point, MIN/MAX on complex, a result written into a tensor
whose elements share memory (an expanded view). Exactness: every rank combines the slots in
rank order ``((x_0 + x_1) + x_2) + ...`` in the tensor's dtype (AVG: that sum divided by the
group size), so all ranks hold the same bits; at 2 ranks that equals gloo's result bit for bit
(addition and multiplication commute), at more ranks too for MIN, MAX, the bitwise ops and
integer SUM/PRODUCT (exact), while floating SUM, PRODUCT and AVG differ from gloo's ring only by
the order of the operations. Tensors larger than a slot (``TENSORPAR_SHM_SLOT_BYTES``, default
1 MiB per rank) go through in slot-sized pieces.

GPU tensors are never put in the segment: every collective on them goes to gloo, which takes
CUDA tensors for all-reduce, broadcast, all-gather and reduce-scatter (through pinned host
memory) but not for point-to-point sends, whose CUDA tensors tensorpar's own collectives move
through host memory themselves (:mod:`tensorpar.distributed.collectives`).

What goes to gloo (a group across hosts, ``TENSORPAR_TRANSPORT=gloo``, several tensors per call
but the coalesced all-gather and reduce-scatter PyTorch's functional collectives use, which go
pair by pair; tensors off the CPU; gather, scatter, reduce, all-to-all, point-to-point) goes there with
contiguous tensors only: gloo reads and writes a tensor's
storage from its data pointer as if it were contiguous, so on torch 2.13 an all-reduce,
broadcast, list reduce-scatter, reduce or scatter of a strided view returns wrong values on some
ranks and writes past the view into the rest of its buffer (measured; no error is raised).
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

from tensorpar.distributed import flight, settings, shm_segment as seg
from tensorpar.distributed.ledger import active_ledger

BACKEND = "tpshm"
_R = tdist.ReduceOp
# AVG combines as SUM; the sum is then divided by the group size (as gloo does)
_REDUCE = {_R.SUM: torch.Tensor.add_, _R.PRODUCT: torch.Tensor.mul_,
           _R.MAX: lambda a, b: torch.maximum(a, b, out=a),
           _R.MIN: lambda a, b: torch.minimum(a, b, out=a),
           _R.AVG: torch.Tensor.add_, _R.BAND: torch.Tensor.bitwise_and_,
           _R.BOR: torch.Tensor.bitwise_or_, _R.BXOR: torch.Tensor.bitwise_xor_}
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
        # Code that asks a group for its backend by device type (torch.distributed's helpers for
        # DTensor and the functional collectives) finds the gloo one, which takes GPU tensors too
        # (staged through pinned host memory; shared memory never sees them). The functional
        # collectives themselves come to this class's methods (see all_gather_single_coalesced)
        for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
            self._register_backend(torch.device(device), tdist.ProcessGroup.BackendType.GLOO, self._gloo)
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
        op = _op(opts)
        _check_reduce("all_reduce", op, tensors)
        _check_writable("all_reduce", tensors)
        for t in tensors:
            self._seen("all_reduce", t)
        if self.segment is None or len(tensors) != 1 or not _cpu(tensors):
            return _via_gloo(self._gloo.allreduce, tensors, *_given(opts))
        _allreduce(self.segment, tensors[0], op)
        return _done(tensors)

    def all_gather_single(self, output, input, opts=None):
        _check_writable("all_gather", [output])
        self._seen("all_gather", output)
        if self.segment is None or not _cpu([output, input]):
            return _via_gloo(self._gloo._allgather_base, output, input, *_given(opts))
        out = _staged(output)
        all_gather_single(self.segment, out, input.contiguous())
        _write_back(output, out)
        return _done([output])

    def allgather(self, output_lists, inputs, opts=None):
        _check_writable("all_gather", [o for outs in output_lists for o in outs])
        self._seen("all_gather", inputs[0], shape=(self.size() * inputs[0].numel(),))
        if (self.segment is None or len(inputs) != 1 or not _cpu(inputs + output_lists[0])
                or not _alike(output_lists[0], inputs[0], self.size())):
            return _via_gloo(self._gloo.allgather, output_lists, inputs, *_given(opts))
        outs = [_staged(o) for o in output_lists[0]]
        _allgather(self.segment, _bytes(inputs[0].contiguous()), [_bytes(o) for o in outs])
        for o, tmp in zip(output_lists[0], outs):
            _write_back(o, tmp)
        return _done(output_lists)

    def reduce_scatter_single(self, output, input, opts=None):
        op = _op(opts)
        _check_reduce("reduce_scatter", op, [input])
        _check_writable("reduce_scatter", [output])
        self._seen("reduce_scatter", input)
        if self.segment is None or not _cpu([output, input]):
            return _via_gloo(self._gloo._reduce_scatter_base, output, input, *_given(opts))
        _check_sizes("reduce_scatter", input, output, self.size())
        out = _staged(output)
        _reduce_scatter(self.segment, input.reshape(self.size(), -1), out, op)
        _write_back(output, out)
        return _done([output])

    def reduce_scatter(self, outputs, input_lists, opts=None):
        op = _op(opts)
        _check_reduce("reduce_scatter", op, outputs)
        _check_writable("reduce_scatter", outputs)
        self._seen("reduce_scatter", outputs[0], shape=(self.size() * outputs[0].numel(),))
        if (self.segment is None or len(outputs) != 1 or not _cpu(outputs + input_lists[0])
                or not _alike(input_lists[0], outputs[0], self.size())):
            return _via_gloo(self._gloo.reduce_scatter, outputs, input_lists, *_given(opts))
        stacked = torch.stack([i.reshape(-1) for i in input_lists[0]])  # (p, n)
        out = _staged(outputs[0])
        _reduce_scatter(self.segment, stacked, out, op)
        _write_back(outputs[0], out)
        return _done(outputs)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        if self.rank() != root:  # the root's tensor is only read
            _check_writable("broadcast", tensors)
        self._seen("broadcast", tensors[0], src=root)
        if self.segment is None or len(tensors) != 1 or not _cpu(tensors):
            return _via_gloo(self._gloo.broadcast, tensors, *_given(opts))
        x = _staged(tensors[0])
        _broadcast(self.segment, x, root)
        _write_back(tensors[0], x)
        return _done(tensors)

    def barrier(self, opts=None):
        if self.segment is None:
            return self._gloo.barrier(*_given(opts))
        _barrier(self.segment)
        return _done(None)

    # PyTorch's functional collectives (DTensor's redistribute, parallelize_module, Hugging Face's
    # tp_plan) call these from C++ with the GIL held. Left to ProcessGroup's own, they queued into
    # gloo there, and gloo's worker frees a finished call's tensors (which takes the GIL) under
    # that queue's lock: a deadlock, 1 launch in ~150 of tests/test_interop's worker. Here each
    # pair is one call of the above, over shared memory, or into gloo through its Python binding,
    # which lets go of the GIL.
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return _each(self.all_gather_single, outputs, inputs, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return _each(self.reduce_scatter_single, outputs, inputs, opts)

    _allgather_base = all_gather_single  # the names older callers use
    _reduce_scatter_base = reduce_scatter_single


def _each(op, outputs, inputs, opts) -> "tdist.Work":
    """``op(output, input, opts)`` for each pair in order, every one finished before this returns."""
    for work in [op(o, i, opts) for o, i in zip(outputs, inputs)]:
        work.wait()
    return _done(outputs)


def _forward_to_gloo(name, gloo_name):
    def method(self, *args, **kwargs):
        return _via_gloo(getattr(self._gloo, gloo_name), *args, **kwargs)
    method.__name__ = name
    return method


for _name, _gloo_name in _TO_GLOO.items():
    setattr(ShmProcessGroup, _name, _forward_to_gloo(_name, _gloo_name))


def _check_sizes(what: str, big: torch.Tensor, small: torch.Tensor, p: int) -> None:
    """Before any round: ``big`` holds ``p`` times ``small``'s elements, in the same dtype."""
    if big.numel() != p * small.numel() or big.dtype != small.dtype:
        raise ValueError(f"{what} over a group of {p}: tensors of {big.numel()} {big.dtype} and {small.numel()} "
                         f"{small.dtype} elements; the larger must hold {p} x the smaller, in the same dtype")


def _check_reduce(what: str, op, tensors) -> None:
    """Before any round, on every transport: the reductions no backend here does exactly, named."""
    valid = ", ".join(o.name for o in _REDUCE)
    if op not in _REDUCE:
        raise ValueError(f"tpshm: {what} with ReduceOp.{op.name} is not supported (gloo has none either); "
                         f"valid: {valid}")
    dtype = tensors[0].dtype
    exact = not (dtype.is_floating_point or dtype.is_complex)
    if op in (_R.BAND, _R.BOR, _R.BXOR) and not exact:
        raise ValueError(f"tpshm: {what} with ReduceOp.{op.name} takes integer or bool tensors, got {dtype}")
    if op == _R.AVG and exact:
        raise ValueError(f"tpshm: {what} with ReduceOp.AVG takes floating-point tensors (an integer mean "
                         f"would round), got {dtype}; use SUM and divide")
    if op in (_R.MIN, _R.MAX) and dtype.is_complex:
        raise ValueError(f"tpshm: {what} with ReduceOp.{op.name} has no order on complex {dtype}")


def _check_writable(what: str, tensors) -> None:
    """Before any round: a result cannot go into a tensor whose elements share memory."""
    for t in tensors:
        if torch._debug_has_internal_overlap(t) == 1:  # 1: certainly overlapping (a stride 0)
            raise ValueError(f"tpshm: {what} writes into a tensor of shape {tuple(t.shape)} and strides "
                             f"{t.stride()} whose elements share memory (an expanded view); pass one of "
                             f"its own, e.g. .clone()")


def _alike(many, one, p: int) -> bool:
    """``many`` is one tensor per rank, each of ``one``'s size and dtype (else gloo says what is wrong)."""
    return len(many) == p and all(t.numel() == one.numel() and t.dtype == one.dtype for t in many)


def _staged(t: torch.Tensor) -> torch.Tensor:
    """``t`` if contiguous, else a contiguous copy of it (the transport works on flat memory)."""
    return t if t.is_contiguous() else t.contiguous()


def _write_back(view: torch.Tensor, staged: torch.Tensor) -> None:
    """A result computed in ``staged`` (a copy of ``view``), into the caller's ``view``."""
    if staged is not view:
        view.copy_(staged)


def _given(opts) -> tuple:
    return () if opts is None else (opts,)


def _via_gloo(call, *args, **kwargs):
    """``call`` (a gloo op whose first argument is what it writes) on contiguous copies of
    non-contiguous tensors, the results copied back into the first argument once it is done (the
    call then waits: see the module's note)."""
    back: list = []
    staged = [_staged_all(a, back if i == 0 else None) if _tensors(a) else a for i, a in enumerate(args)]
    work = call(*staged, **kwargs)
    if not back:
        return work
    work.wait()
    for view, copy in back:
        _write_back(view, copy)
    return _done(args[0])


def _tensors(obj) -> bool:
    """A tensor or a non-empty (nested) list of them, not the ints and options an op also takes."""
    return isinstance(obj, torch.Tensor) or (isinstance(obj, (list, tuple)) and len(obj) > 0
                                             and all(_tensors(o) for o in obj))


def _staged_all(obj, back):
    """A tensor or (nested) list of them, each :func:`_staged`; ``back`` collects (view, copy) pairs."""
    if not isinstance(obj, torch.Tensor):
        return [_staged_all(o, back) for o in obj]
    staged = _staged(obj)
    if back is not None and staged is not obj:
        back.append((obj, staged))
    return staged


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
        if op == _R.AVG:
            out.div_(s.size)
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
        if op == _R.AVG:
            flat_out[a:b].div_(p)
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
