"""A model cut into pipeline stages over a ``("pp", "dp", "tp")`` mesh: what ``parallelize(...,
pipeline=NAME)`` returns.

:class:`PipelinedModel` holds this rank's stages (:mod:`.stage_cut`), each tensor-parallel inside
``mesh["tp"]`` and data-parallel across ``mesh["dp"]`` (DDP or FSDP2, PyTorch's own, wrapping each
stage), and runs them under PyTorch's schedule in ``mesh["pp"]``
(:mod:`tensorpar.distributed.pipelining`). Its parameters keep the model's own names
(``model.layers.5.mlp.up_proj.weight``): an optimizer over ``parameters()`` steps this rank's
stages, and checkpoints written at one layout load at another.

It does not run a forward on its own (a stage's input comes from another rank): training goes
through :func:`tensorpar.models.training.train_step`, which runs the schedule; generation refuses
it (load the model without pipeline stages).
"""
from __future__ import annotations

import time

import torch
from torch import nn

from tensorpar import distributed as dist
from tensorpar.architecture import pipeline as arch
from tensorpar.distributed import pipelining
from tensorpar.nn import vocab_parallel_cross_entropy
from tensorpar.sharding.stage_cut import StageModule


class PipelinedModel(nn.Module):
    """This rank's pipeline stages of a causal LM, and the schedule that runs them."""

    def __init__(self, stages: list, raw: list, *, config, report, schedule: str, microbatches: int,
                 pp_group, tied: list, tied_group, names: dict):
        super().__init__()
        self._names = names  # id(parameter) -> its name in the whole model (a tied one: its first name)
        self.stages = nn.ModuleList(stages)  # as wrapped for data parallelism
        self._raw: list[StageModule] = raw  # the stage modules themselves
        self.config = config
        self.tp_report = report
        self.schedule_name, self.microbatches = schedule, microbatches
        # tied: [[its parameters on this rank]] per tensor the first and the last stage share (one
        # parameter, or two when one rank holds both stages and data parallelism made each its own)
        self._pp_group, self._tied, self._tied_group = pp_group, tied, tied_group
        self._schedules = {}
        self._total = [None]  # the token count of the running step's batch, for the loss of a microbatch
        # the last step's schedule: its wall time and this rank's stages' forward and backward time in it
        self.last_step = None

    # ---- names: the model's own ------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        seen = set()
        for stage in self._raw:
            for name, p in stage.model.named_parameters(remove_duplicate=remove_duplicate):
                if remove_duplicate and id(p) in seen:
                    continue
                seen.add(id(p))
                name = self._names.get(id(p), name)  # a tied head on the last stage: the embedding's name
                yield prefix + ("." if prefix else "") + name, p

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        memo = set() if memo is None else memo
        if self not in memo:
            memo.add(self)
            yield prefix, self
        for stage in self._raw:
            yield from stage.model.named_modules(memo=memo, prefix=prefix, remove_duplicate=remove_duplicate)

    def state_dict(self, *args, **kwargs):
        raise ValueError("a pipelined model's state is saved with tensorpar.save / export (each rank writes "
                         "its stages' pieces under the model's own names)")

    def reshard(self) -> None:
        """FSDP2 stages' parameters back to their dp shards (as a checkpoint reads them)."""
        for stage in self.stages:
            if callable(getattr(stage, "reshard", None)):
                stage.reshard()

    @property
    def stage_indices(self) -> list:
        return [s.index for s in self._raw]

    @property
    def holds_first(self) -> bool:
        return any(s.is_first for s in self._raw)

    @property
    def holds_last(self) -> bool:
        return any(s.is_last for s in self._raw)

    def get_output_embeddings(self):
        last = [s for s in self._raw if s.is_last]
        return last[0].model.get_output_embeddings() if last else None

    def forward(self, *args, **kwargs):
        raise ValueError("a model cut into pipeline stages runs through tensorpar.models.training.train_step "
                         "(its schedule passes each microbatch from stage to stage); for a forward or generate, "
                         "load the model without pipeline stages (parallelize(..., pipeline=None))")

    # ---- a step ------------------------------------------------------------------------------
    def _loss(self, logits_shard: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A microbatch's summed next-token cross-entropy over the whole batch's token count."""
        head = self.get_output_embeddings()
        target = labels[:, 1:]
        if getattr(head, "tp_size", 1) > 1:
            total = vocab_parallel_cross_entropy(logits_shard[:, :-1], target, tp_group=head.tp_group,
                                                 vocab_size=head.out_features, reduction="sum")
        else:
            total = torch.nn.functional.cross_entropy(
                logits_shard[:, :-1].reshape(-1, logits_shard.shape[-1]), target.reshape(-1), reduction="sum")
        return total / self._total[0]

    def _schedule(self, shape):
        if shape not in self._schedules:
            device = next(iter(self.parameters())).device
            indices = [s.index for s in self._raw]
            self._schedules[shape] = pipelining.build_schedule(
                list(self.stages), indices, self._raw[0].n_stages, self.schedule_name, self.microbatches,
                self._loss, self._pp_group, device)
        return self._schedules[shape]

    def check_batch(self, input_ids: torch.Tensor) -> None:
        """``ValueError`` unless the microbatches divide this dp rank's batch (before any collective)."""
        if input_ids.dim() != 2 or input_ids.shape[0] % self.microbatches:
            rows = input_ids.shape[0] if input_ids.dim() else 0
            valid = [m for m in range(1, rows + 1) if rows % m == 0]
            raise ValueError(f"microbatches={self.microbatches} does not divide the batch of {rows} sequences "
                             f"(input_ids {tuple(input_ids.shape)}, this dp rank's rows); microbatch counts that do: {valid}")

    def run_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every microbatch under the schedule, then the tied copies'
        gradients summed; returns this dp rank's batch mean loss on every pipeline rank (float64)."""
        self.check_batch(input_ids)
        valid = int((labels[:, 1:] != -100).sum())
        self._total[0] = max(valid, 1)
        losses = []
        schedule = self._schedule(tuple(input_ids.shape))
        stages = pipelining.stages_of(schedule)
        busy0, t0 = sum(s.busy_s for s in stages), time.perf_counter()
        schedule.step(input_ids, target=labels, losses=losses)
        self.last_step = {"seconds": time.perf_counter() - t0,
                          "busy_seconds": sum(s.busy_s for s in stages) - busy0}
        pipelining.sum_tied_grads(self._tied, self._tied_group)
        loss = torch.zeros(1, dtype=torch.float64)
        if self.holds_last:
            loss[0] = sum(float(x.detach()) for x in losses)
        report = self.tp_report
        if report.pp_size > 1:  # from the last stage's rank to the others of this pipeline
            dist.broadcast(loss, src=report.pp_last_rank, group=self._pp_group, module="train_step")
        return loss[0]


def check(pipeline, microbatches, virtual, stage_blocks, blocks: int, pp: int):
    """The pipeline's arguments against the model's block count (``ValueError`` before anything)."""
    return arch.check(pp=pp, blocks=blocks, schedule=pipeline, microbatches=microbatches, virtual=virtual,
                      sizes=stage_blocks)
