"""Timing one collective on a group, for ``tensorpar calibrate`` (:mod:`tensorpar.bench.calibrate`).

Every member calls :func:`time_collective` with the same arguments; each returns the median of
``repeats`` samples, each a barrier then back-to-back calls (up to 32, fewer for large payloads:
the same count on every rank), so a rank's wait for a late peer at the start is spread thin. ``op``: ``all_reduce``,
``all_gather``, ``reduce_scatter``, ``broadcast`` (through :mod:`.collectives`, as the runtime
calls them) or ``send`` (a point-to-point send from group rank 0 to group rank 1 and back, as
pipeline stages exchange activations; half the round trip).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as tdist

from tensorpar.distributed import collectives
from tensorpar.distributed.groups import barrier

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send")


def _call(op: str, x: torch.Tensor, group, peers: list) -> None:
    if op == "all_reduce":
        collectives.all_reduce(x, group)
    elif op == "all_gather":
        collectives.all_gather(x, 0, group)
    elif op == "reduce_scatter":
        collectives.reduce_scatter(x, 0, group)
    elif op == "broadcast":
        collectives.broadcast(x, 0, group)
    else:
        me = tdist.get_rank()
        if me == peers[0]:
            tdist.send(x, peers[1], group=group)
            tdist.recv(x, peers[1], group=group)
        elif me == peers[1]:
            tdist.recv(x, peers[0], group=group)
            tdist.send(x, peers[0], group=group)


def time_collective(op: str, payload_bytes: int, group, ranks: list, *, repeats: int = 7,
                    dtype: torch.dtype = torch.float32, device=None) -> float:
    """Median seconds of one ``op`` whose payload is ``payload_bytes`` (all-gather: the gathered
    result; reduce-scatter: the input; as the planner counts a payload) on ``group`` (global
    ``ranks``, in order), its tensors on ``device`` (default: the host; on a GPU each sample
    ends when the device has finished)."""
    if op not in OPS:
        raise ValueError(f"op {op!r}: valid: {', '.join(OPS)}")
    p, elem = len(ranks), torch.empty((), dtype=dtype).element_size()
    n = max(p, payload_bytes // elem)
    n -= n % p
    x = torch.ones(n // p if op == "all_gather" else n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    _call(op, x.clone(), group, ranks)  # warm-up: buffers, segments, communicators
    calls = max(1, min(32, (1 << 20) // max(payload_bytes, 1)))  # back to back: the barrier's skew amortised
    times = []
    for _ in range(repeats):
        barrier(group)
        t0 = time.perf_counter()
        for _ in range(calls):
            _call(op, x, group, ranks)
        sync()
        times.append((time.perf_counter() - t0) / calls)
    t = statistics.median(times)
    return t / 2 if op == "send" else t
