"""Raw collectives on torch.distributed, each recorded in the open ledger (if any).

These are the only calls into torch.distributed's collectives; the autograd-aware operators in
:mod:`tensorpar.distributed.mappings` are built on them. All take the group explicitly (``None``: world).

Each group's collectives travel over shared memory between the ranks of one host, gloo or NCCL
(:func:`tensorpar.distributed.shm.transport`). Over gloo, reduce-scatter is tensorpar's own ring over point-to-point sends (p - 1 steps, each
sending one chunk of N/p): gloo's native reduce-scatter does not document its algorithm, and the
ledger must record the bytes really sent, ``(p - 1)/p * N``. ``record_to`` names the ledger a
collective records into (the backward of an autograd operator passes the one its forward saw,
since backward may run on another thread); by default, the ledger open in this context.

A tensor on a device its group's backend cannot move travels through one it can
(:func:`_carrier`): a host tensor (a verdict, a loss, a digest) through this rank's GPU on NCCL,
a CUDA tensor through host memory on gloo's point-to-point ring. The ledger records the
collective as issued, on the caller's tensor.

The in-place collectives (all-reduce, broadcast) bump the tensor's version counter, which c10d
does not: a tensor that autograd saved and a collective then overwrote makes backward fail with
torch's "modified by an inplace operation" error instead of using the new values silently.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as tdist
from torch.autograd.graph import increment_version

from tensorpar.distributed import flight, wire
from tensorpar.distributed.groups import get_rank as group_rank
from tensorpar.distributed.groups import get_world_size as group_size
from tensorpar.distributed.groups import group_name, refuse_planning
from tensorpar.distributed.ledger import Ledger, active_ledger
from tensorpar.distributed import shm
from tensorpar.distributed.shm import transport

_OPS = {"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN}


@dataclass
class Stopwatch:
    """Wall seconds this rank spent in the collectives of this module while :func:`stopwatch` was
    open: each call whole (waiting for peers, and the flight recorder's checks, included) and, for
    an asynchronous one, as long as its ``wait()`` blocked (not the work done meanwhile)."""
    seconds: float = 0.0


# The open stopwatch of this process: a module global, not a ContextVar, so that a backward pass
# on autograd's own threads (always on CUDA) counts into it too; nested stopwatches restore it.
_WATCH: "Stopwatch | None" = None
_INSIDE = threading.local()  # a collective made of others counts once


@contextlib.contextmanager
def stopwatch():
    """Time the collectives inside the block and nothing else: no records, no module hooks, the
    shared-memory fast path kept. A ledger's ``seconds_in_collectives`` times the backend calls
    too, but its hooks and records run in the step (and a decode step's all-reduces leave the
    fast path under it): a tiny model's decode step ran up to a third slower. ``calibrate`` takes
    the collectives out of a block's fixed cost with this."""
    global _WATCH
    outer, watch = _WATCH, Stopwatch()
    _WATCH = watch
    try:
        yield watch
    finally:
        _WATCH = outer


class _TimedWork:
    """An asynchronous collective's handle whose ``wait()`` adds the time it blocked to ``watch``."""

    def __init__(self, work, watch: Stopwatch):
        self._work, self._watch = work, watch

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._watch.seconds += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._work, name)


def _watched(fn):
    """``fn`` (a collective) timed into the open stopwatch; an ``async_op`` call also by its handle's wait."""
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        watch = _WATCH
        if watch is None or getattr(_INSIDE, "on", False):
            return fn(*args, **kwargs)
        _INSIDE.on, t0 = True, time.perf_counter()
        try:
            out = fn(*args, **kwargs)
        finally:
            watch.seconds += time.perf_counter() - t0
            _INSIDE.on = False
        # an asynchronous call's handle: the time its wait() blocks too (the issuing call may
        # itself have blocked: the flight recorder's check, a transport that serves it at once)
        return _TimedWork(out, watch) if kwargs.get("async_op") and out is not None else out
    return timed


def _record(op: str, tensor: torch.Tensor, group, phase: str, module: str | None, *,
            record_to: Ledger | None = None, shape=None, src: int = 0) -> "Ledger | None":
    """Every collective's first step: a planning stand-in refuses, an open ledger records it (the
    flight recorder, :mod:`tensorpar.distributed.flight`, and :func:`_on_wire` are around the call
    itself). Returns the ledger recorded into."""
    refuse_planning(group, op)
    led = record_to if record_to is not None else active_ledger()
    if led is not None:
        algorithm = {"gloo": "tree", "shm": "shared"}.get(transport(group), "chain")
        led.record(op, tensor, group_size(group), phase=phase, module=module, shape=shape,
                   rank=group_rank(group), src=src, broadcast_algorithm=algorithm, group=group_name(group))
    return led


@contextlib.contextmanager
def _on_wire(led: "Ledger | None", group):
    """Around the backend call alone (inside the flight recorder's signature check): its wall time
    and, when the ledger asks and the transport is TCP, the bytes the sockets carried, into the
    record just made."""
    if led is None:
        yield
        return
    index = len(led.records) - 1
    count = led.wire and transport(group) == "gloo"
    before = wire.counters() if count else None
    t0 = time.perf_counter()
    yield
    led.set_seconds(index, time.perf_counter() - t0)
    after = wire.counters() if count else None
    if before is not None and after is not None:
        led.set_wire(index, after[0] - before[0], after[1] - before[1])


@_watched
def all_reduce(x: torch.Tensor, group=None, op: str = "sum", *, phase: str = "forward",
               module: str | None = None, record_to: Ledger | None = None,
               async_op: bool = False):
    """In-place all-reduce of ``x`` (no autograd); returns ``x``.

    ``async_op=True`` returns at once with a handle instead: ``x`` holds the sum after
    ``handle.wait()`` (``None`` for a group of one, where there is nothing to wait for).
    """
    if op not in _OPS:
        raise ValueError(f"all_reduce op {op!r} is not supported; valid: {', '.join(_OPS)}")
    if async_op and not x.is_contiguous():
        raise ValueError(f"an asynchronous all_reduce needs a contiguous tensor (got shape {tuple(x.shape)}, "
                         f"strides {x.stride()}): pass x.contiguous() and copy the result back after wait()")
    segment = None if async_op else shm.segment_of(group, x)  # only groups of 2 or more have one
    if segment is None and group_size(group) == 1:
        return None if async_op else x
    led = _record("all_reduce", x, group, phase, module, record_to=record_to)
    seq = flight.enter("all_reduce", x, group, module)
    if segment is not None and led is None:  # a decode step's dozen small all-reduces: the least Python
        shm.all_reduce(segment, x, op)
        work = None
    else:
        try:
            with _on_wire(None if async_op else led, group):
                if segment is not None:
                    work = shm.all_reduce(segment, x, op)
                elif async_op and _carrier(x, group) is not None:
                    buf = _moved_to(x, _carrier(x, group))
                    work = _CopiedBack(tdist.all_reduce(buf, op=_OPS[op], group=group, async_op=True), buf, x)
                else:
                    with _staged(x, group) as buf:
                        work = tdist.all_reduce(buf, op=_OPS[op], group=group, async_op=async_op)
        except BaseException:
            flight.own_done()  # the backend records PyTorch's own calls again
            raise
    flight.leave(seq)
    increment_version(x)
    return work if async_op else x


@_watched
def all_gather(x: torch.Tensor, dim: int, group=None, *, phase: str = "forward",
               module: str | None = None, record_to: Ledger | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    p = group_size(group)
    if p == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()  # (d, ...): all_gather_single concatenates dim 0
    out = moved.new_empty((p * moved.shape[0], *moved.shape[1:]))  # (p*d, ...)
    full = (*x.shape[:dim % x.dim()], p * x.shape[dim], *x.shape[dim % x.dim() + 1:])  # the gathered shape
    led = _record("all_gather", out, group, phase, module, record_to=record_to, shape=full)
    segment = shm.segment_of(group, moved)
    with flight.issuing("all_gather", moved, group, module), _on_wire(led, group):
        if segment is not None:
            shm.all_gather_single(segment, out, moved)
        else:
            with _staged(out, group) as buf:
                tdist.all_gather_single(buf, _moved_to(moved, buf.device), group=group)
    return _back(out, dim)


def _back(out: torch.Tensor, dim: int) -> torch.Tensor:
    """``out`` (gathered or scattered along dim 0) with that dim moved back to ``dim``, as a tensor
    of its own: a caller may change it in place (a view returned from an autograd Function cannot)."""
    return out if dim == 0 else out.movedim(0, dim).contiguous()


@_watched
def reduce_scatter(x: torch.Tensor, dim: int, group=None, *, phase: str = "forward",
                   module: str | None = None, record_to: Ledger | None = None) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's chunk of ``dim`` (size ``x.shape[dim] // p``)."""
    p = group_size(group)
    if p == 1:
        return x
    check_divisible(x, dim, p, "reduce_scatter")
    moved = x.movedim(dim, 0).contiguous()  # (p*c, ...)
    led = _record("reduce_scatter", moved, group, phase, module, record_to=record_to, shape=tuple(x.shape))
    with flight.issuing("reduce_scatter", moved, group, module), _on_wire(led, group):
        segment = shm.segment_of(group, moved)
        if segment is not None:
            out = moved.new_empty((moved.shape[0] // p, *moved.shape[1:]))
            shm.reduce_scatter_single(segment, out, moved)
        elif transport(group) in ("gloo", "shm"):  # gloo, or a GPU tensor on shm (gloo): sends read host memory
            out = _ring_reduce_scatter(moved.cpu(), group).to(moved.device)
        else:
            out = moved.new_empty((moved.shape[0] // p, *moved.shape[1:]))
            with _staged(out, group) as buf:
                tdist.reduce_scatter_single(buf, _moved_to(moved, buf.device), group=group)
    return _back(out, dim)


def _ring_reduce_scatter(moved: torch.Tensor, group) -> torch.Tensor:
    """Ring reduce-scatter over point-to-point sends: step k sends chunk (r-k-1) to the right.

    After p-1 steps rank r holds chunk r summed over all ranks (each chunk travelled the ring once).
    """
    p, r = group_size(group), group_rank(group)
    chunks = [c.clone() for c in moved.chunk(p, dim=0)]  # p x (c, ...)
    right = tdist.get_global_rank(group, (r + 1) % p) if group is not None else (r + 1) % p
    left = tdist.get_global_rank(group, (r - 1) % p) if group is not None else (r - 1) % p
    incoming = torch.empty_like(chunks[0])
    for k in range(p - 1):
        ops = [tdist.P2POp(tdist.isend, chunks[(r - k - 1) % p], right, group),
               tdist.P2POp(tdist.irecv, incoming, left, group)]
        for work in tdist.batch_isend_irecv(ops):
            work.wait()
        chunks[(r - k - 2) % p].add_(incoming)
    return chunks[r]


@_watched
def broadcast(x: torch.Tensor, src: int = 0, group=None, *, module: str | None = None) -> torch.Tensor:
    """In-place broadcast from group rank ``src``."""
    if group_size(group) == 1:
        return x
    led = _record("broadcast", x, group, "forward", module, src=src)
    global_src = tdist.get_global_rank(group, src) if group is not None else src
    segment = shm.segment_of(group, x) if x.is_contiguous() else None
    with flight.issuing("broadcast", x, group, module), _on_wire(led, group):
        if segment is not None:
            shm.broadcast(segment, x, src)
        else:
            with _staged(x, group) as buf:
                tdist.broadcast(buf, src=global_src, group=group)
    increment_version(x)
    return x


@contextlib.contextmanager
def _staged(x: torch.Tensor, group=None):
    """``x``, or a contiguous copy of it (on :func:`_carrier`'s device where the backend needs
    one) written back after the call: gloo given a strided view (a slice with a stride, a
    transpose) returns wrong values and writes past the view, silently (torch 2.13), and NCCL
    needs contiguous memory on a GPU."""
    device = _carrier(x, group)
    if x.is_contiguous() and device is None:
        yield x
        return
    buf = x.contiguous() if device is None else _moved_to(x, device)
    yield buf
    x.copy_(buf)


def _carrier(x: torch.Tensor, group) -> "torch.device | None":
    """The device ``x`` must travel on over ``group`` when its own will not do: NCCL moves CUDA
    tensors only, so a host tensor goes through this rank's GPU (the one the launcher or torchrun's
    LOCAL_RANK set); None where ``x`` can go as it is."""
    if x.device.type == "cpu" and transport(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


class _CopiedBack:
    """An asynchronous collective run on a copy (:func:`_carrier`): waiting for it copies the
    result back into the caller's tensor."""

    def __init__(self, work, copy: torch.Tensor, x: torch.Tensor):
        self._work, self._copy, self._x = work, copy, x

    def wait(self) -> bool:
        self._work.wait()
        self._x.copy_(self._copy)
        return True


def _moved_to(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` on ``device``, contiguous (``x`` itself when it already is)."""
    return x if x.device == device else x.to(device=device, memory_format=torch.contiguous_format)


def split_own(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's contiguous chunk of ``dim`` (no communication)."""
    p = group_size(group)
    if p == 1:
        return x
    check_divisible(x, dim, p, "split")
    return x.chunk(p, dim=dim)[group_rank(group)].contiguous()


def check_divisible(x: torch.Tensor, dim: int, p: int, what: str) -> None:
    size = x.shape[dim]
    if size % p:
        valid = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(f"{what}: dimension {dim} of size {size} does not divide by the group size {p}; "
                         f"group sizes that divide it: {valid}")
