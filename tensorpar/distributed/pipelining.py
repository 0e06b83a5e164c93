"""Pipeline stages on PyTorch's own engine, ``torch.distributed.pipelining``.

Each rank's stage modules become ``PipelineStage``s in the mesh's ``pp`` group and run under one
of PyTorch's schedules, chosen by name (:mod:`tensorpar.architecture.pipeline`). Stage-to-stage
sends and receives go through the ``pp`` group (over gloo, to which the shared-memory backend hands
point-to-point transfers). Each one a step's schedule issues is recorded in the open ledger as
``send`` (bytes sent: the tensor's) or ``recv`` (none sent), module ``pipeline.activation``
(phase ``forward``) for the hidden states and ``pipeline.activation_grad`` (phase ``backward``)
for their gradients;
the one-off exchanges of the first step (neighbour handshakes, shape inference) are not.

The loss of a microbatch is its tokens' summed cross-entropy divided by the token count of the
whole (per dp rank) batch, and the schedule does not rescale (``scale_grads=False``): the
gradients the schedule accumulates are then those of the batch's mean loss exactly as one
process computes it, ignored (``-100``) labels and all.

A tied input embedding and output head live on the first and the last stage: after the schedule
their gradients are summed over the two ranks holding them (one all-reduce per tp shard, in a
group of the two), so both copies take the same optimizer step, as Megatron-LM's embedding group.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as tdist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from tensorpar.architecture import pipeline as arch
from tensorpar.distributed import collectives, groups
from tensorpar.distributed.ledger import active_ledger


def schedule_class(name: str):
    """PyTorch's schedule class of a name (:data:`tensorpar.architecture.pipeline.SCHEDULES`)."""
    return get_schedule_class(arch.schedule_name(name))


class _RecordedStage(PipelineStage):
    """A ``PipelineStage`` whose activation and gradient transfers are recorded in the open ledger,
    and which adds up the wall time of its own forward and backward work (``busy_s``: a rank's time
    in a step less its stages' busy time is what it spent waiting, the pipeline's bubble and the
    transfers)."""

    busy_s = 0.0

    def forward_one_chunk(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - t0

    def backward_one_chunk(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - t0

    def backward_weight_one_chunk(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return super().backward_weight_one_chunk(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - t0

    def _recorded(self, ops, phase: str):
        led = active_ledger()
        if led is not None:
            for o in ops:
                led.record("send" if o.op is tdist.isend else "recv", o.tensor, groups.get_world_size(self.group),
                           phase=phase, module="pipeline.activation" if phase == "forward" else "pipeline.activation_grad",
                           group=groups.group_name(self.group))
        return ops

    def get_fwd_recv_ops(self, fwd_chunk_id):
        return self._recorded(super().get_fwd_recv_ops(fwd_chunk_id), "forward")

    def get_fwd_send_ops(self, fwd_chunk_id):
        return self._recorded(super().get_fwd_send_ops(fwd_chunk_id), "forward")

    def get_bwd_recv_ops(self, bwd_chunk_id):
        return self._recorded(super().get_bwd_recv_ops(bwd_chunk_id), "backward")

    def get_bwd_send_ops(self, bwd_chunk_id):
        return self._recorded(super().get_bwd_send_ops(bwd_chunk_id), "backward")


def build_schedule(modules: list, indices: list, n_stages: int, schedule: str, microbatches: int, loss_fn,
                   pp_group, device: torch.device):
    """The schedule running this rank's stage ``modules`` (stage ``indices[i]`` each) in ``pp_group``."""
    stages = [_RecordedStage(m, i, n_stages, device, group=pp_group) for m, i in zip(modules, indices)]
    cls = schedule_class(schedule)
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


def stages_of(schedule) -> list:
    """The ``PipelineStage``s a schedule runs on this rank."""
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def tied_groups(mesh, holders_first: int, holders_last: int):
    """For every ``(dp, tp)`` position of ``mesh`` (``("pp", "dp", "tp")``), a group of the ranks of
    pipeline ranks ``holders_first`` and ``holders_last`` at that position (every rank creates
    every group, in one order); returns this rank's, or None."""
    ranks = mesh.mesh  # (pp, dp, tp) tensor of global ranks
    mine = None
    me = tdist.get_rank()
    for d in range(ranks.shape[1]):
        for t in range(ranks.shape[2]):
            pair = sorted({int(ranks[holders_first, d, t]), int(ranks[holders_last, d, t])})
            group = groups.new_group(pair)
            if me in pair:
                mine = group
    return mine


def sum_tied_grads(tied: list, group) -> None:
    """Make every copy of each tied tensor on this rank and across ``group`` (the first and the last
    stage's ranks; None: this rank holds both) hold the sum of their gradients. ``tied``: per
    tensor, its parameters on this rank (two when one rank holds both stages and data parallelism
    made each stage its own copy)."""
    for copies in tied:
        grads = [_local(p.grad) for p in copies if p.grad is not None]
        if not grads:
            continue
        total = grads[0]
        for g in grads[1:]:  # both stages on this rank: their copies' gradients added here
            total.add_(g)
        if group is not None:
            collectives.all_reduce(total, group=group, module="pipeline.tied_embedding")
        for g in grads[1:]:
            g.copy_(total)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def pp_rank_of_stage(stage: int, pp: int, schedule: str) -> int:
    return arch.rank_of_stage(stage, pp, schedule)
