"""Pipeline stages on PyTorch's own engine, ``torch.distributed.pipelining``.

Each rank's stage modules become ``PipelineStage``s in the mesh's ``pp`` group and run under one
of PyTorch's schedules, chosen by name (:mod:`tensorpar.architecture.pipeline`). Stage-to-stage
sends and receives go through the ``pp`` group (over gloo, to which the shared-memory backend hands
point-to-point transfers). Each one a step's schedule issues is recorded in the open ledger as
``send`` (bytes sent: the tensor's) or ``recv`` (none sent), module ``pipeline.activation``
(phase ``forward``) for the hidden states and ``pipeline.activation_grad`` (phase ``backward``)
for their gradients;
the one-off exchanges of the first step (neighbour handshakes, shape inference) are not.

Between stages each tp rank sends only its ``1 / tp`` slice of the hidden states (when they are
whole on every tp rank, without sequence parallelism, and the hidden size divides by tp): the
receiving stage all-gathers the slices over tp (:func:`receive_chunk`), and in backward the
gradient's slices go back and are all-gathered on the sending stage (:func:`send_chunk`):
Megatron-LM's scatter/gather, ``b s h / tp`` bytes sent per rank instead of ``b s h``.

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
from tensorpar.distributed.ledger import active_ledger, ledger_for_backward


class _SendChunk(torch.autograd.Function):
    """Forward: this tp rank's slice of the hidden dim of the stage's (tp-replicated) output, the
    part it sends. Backward: the slices of its gradient each tp rank received, all-gathered."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.led = group, active_ledger()
        return collectives.split_own(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_gather(grad.contiguous(), grad.dim() - 1, ctx.group, phase="backward",
                                      module="pipeline.activation_grad", record_to=ledger_for_backward(ctx.led)), None


class _ReceiveChunk(torch.autograd.Function):
    """Forward: the slices the previous stage's tp ranks sent, all-gathered into the whole hidden
    states. Backward: this rank's slice of their (tp-replicated) gradient, the part it sends back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return collectives.all_gather(x.contiguous(), x.dim() - 1, group, module="pipeline.activation")

    @staticmethod
    def backward(ctx, grad):
        return collectives.split_own(grad, grad.dim() - 1, ctx.group), None


def send_chunk(x: torch.Tensor, tp_group) -> torch.Tensor:
    """What a stage sends of hidden states every tp rank holds whole: this rank's ``1 / tp`` of
    them (Megatron-LM's scatter/gather between stages, Narayanan et al. 2021, Sec. 4.1)."""
    return _SendChunk.apply(x, tp_group)


def receive_chunk(x: torch.Tensor, tp_group) -> torch.Tensor:
    """The whole hidden states from the slices the previous stage's tp ranks sent."""
    return _ReceiveChunk.apply(x, tp_group)


def schedule_class(name: str):
    """PyTorch's schedule class of a name (:data:`tensorpar.architecture.pipeline.SCHEDULES`)."""
    return get_schedule_class(arch.schedule_name(name))


class _RecordedStage(PipelineStage):
    """A ``PipelineStage`` whose activation and gradient transfers are recorded in the open ledger,
    and which adds up the wall time of its own forward and backward work (``busy_s``: a rank's time
    in a step less its stages' busy time is what it spent waiting, the pipeline's bubble and the
    transfers)."""

    busy_s = 0.0

    def _timed(self, work, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return work(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - t0

    def forward_one_chunk(self, *args, **kwargs):
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_weight_one_chunk, *args, **kwargs)

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
