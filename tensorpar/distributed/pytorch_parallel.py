"""PyTorch's own parallelism, composed as torchtitan composes it: the baselines of the training
benchmark (:mod:`tensorpar.bench.train`). tensorpar's own code never uses these.

- :func:`fsdp2`: FSDP2 ``fully_shard`` on every block, then on the root, over a 1-D ``dp`` mesh;
- :func:`dtensor_tp`: ``parallelize_module`` over a 1-D ``tp`` mesh, from a plan of style names
  (:data:`STYLES`; the module names are the caller's, this module knows none);
- :func:`loss_parallel`: the cross-entropy of logits sharded by vocabulary (DTensor's own);
- :func:`dcp_save` / :func:`dcp_load`: ``torch.distributed.checkpoint`` of a model and its
  optimizer through ``get_state_dict`` / ``set_state_dict``, as torchtitan checkpoints;
- :class:`Pipeline1F1B`: one stage per rank under ``torch.distributed.pipelining``'s
  ``Schedule1F1B`` over a 1-D ``pp`` mesh, and clipping over the stages (the pipeline benchmark,
  :mod:`tensorpar.bench.pipeline`; the stage module, cut by hand, is the caller's).
"""
from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel import loss_parallel as _loss_parallel

# torchtitan's Llama styles without sequence parallelism: projections into a region by columns,
# out of it by rows; the embedding split by vocabulary rows (its partial sums all-reduced); the
# output head by vocabulary columns, its logits left sharded for :func:`loss_parallel`.
STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
    "head_sharded": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    "head_replicated": lambda: ColwiseParallel(output_layouts=Replicate()),
}


def fsdp2(model: torch.nn.Module, blocks, dp_size: int, device_type: str = "cpu") -> torch.nn.Module:
    """``model`` fully sharded (ZeRO-3) over ``dp_size`` ranks: each of ``blocks`` its own unit,
    then the root (torchtitan's ``apply_fsdp``)."""
    mesh = init_device_mesh(device_type, (dp_size,), mesh_dim_names=("dp",))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def dtensor_tp(model: torch.nn.Module, plan: dict, tp_size: int, device_type: str = "cpu") -> torch.nn.Module:
    """``model`` split by PyTorch's tensor parallelism: ``plan`` is ``{module name or pattern
    ("layers.*.q_proj"): style name}``, each style one of :data:`STYLES`."""
    bad = sorted({s for s in plan.values() if s not in STYLES})
    if bad:
        raise ValueError(f"unknown styles {bad}; valid: {', '.join(STYLES)}")
    mesh = init_device_mesh(device_type, (tp_size,), mesh_dim_names=("tp",))
    return parallelize_module(model, mesh, {name: STYLES[style]() for name, style in plan.items()})


def loss_parallel():
    """DTensor's cross-entropy on vocab-sharded logits; forward and backward both run inside it."""
    return _loss_parallel()


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` on a model whose gradients are DTensors, plain tensors
    (parameters no style split: the norms' weights), or both; returns the whole norm. The plain
    ones are taken as replicated (``implicit_replication``): counted once, as on one process."""
    with implicit_replication():
        return full_value(torch.nn.utils.clip_grad_norm_(list(parameters), max_norm))


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a loss or a norm), a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local shard (its storage), a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def mesh_groups(model: torch.nn.Module) -> list:
    """The process groups of the meshes ``model``'s DTensor parameters live on."""
    groups = {}
    for p in model.parameters():
        if isinstance(p, DTensor):
            for g in p.device_mesh.get_all_groups():
                groups[id(g)] = g
    return list(groups.values())


def dcp_save(model, optimizer, folder) -> None:
    """Every rank: the model's and the optimizer's state dicts (``get_state_dict``) into ``folder``."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))


def dcp_load(model, optimizer, folder) -> None:
    """Every rank: the state :func:`dcp_save` wrote, read in place and set (``set_state_dict``)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


class Pipeline1F1B:
    """This rank's stage ``module`` (stage ``stage_index`` of ``n_stages``, one per rank, the pp rank
    its index) as a ``PipelineStage`` under ``Schedule1F1B`` with ``microbatches`` microbatches
    over a 1-D ``pp`` mesh, as torchtitan builds a single-stage schedule (``build_pipeline_schedule``):
    ``loss_fn(output, target)`` the mean over a microbatch, the schedule dividing the accumulated
    gradients by ``microbatches`` (its ``scale_grads``: the batch mean's gradients, equal
    microbatches)."""

    def __init__(self, module: torch.nn.Module, stage_index: int, n_stages: int, microbatches: int, loss_fn,
                 device_type: str = "cpu"):
        self.mesh = init_device_mesh(device_type, (n_stages,), mesh_dim_names=("pp",))
        self.group = self.mesh.get_group()
        self.is_first, self.is_last, self.last = stage_index == 0, stage_index == n_stages - 1, n_stages - 1
        stage = PipelineStage(module, stage_index, n_stages, torch.device(device_type), group=self.group)
        self.schedule = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=loss_fn)

    def step(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every microbatch; the batch's mean loss on every rank (broadcast
        from the last stage's, where the schedule computes it)."""
        losses = []
        if self.is_first:
            self.schedule.step(inputs, target=target, losses=losses)
        elif self.is_last:
            self.schedule.step(target=target, losses=losses)
        else:
            self.schedule.step()
        loss = torch.stack(losses).mean().detach().float() if self.is_last else torch.zeros(())
        tdist.broadcast(loss, group=self.group, group_src=self.last)
        return loss

    @torch.no_grad()
    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        """``clip_grad_norm_`` over the whole model, torchtitan's way with a pp mesh: each stage's
        norm, its square summed over the stages (one all-reduce), the gradients scaled by that."""
        params = [p for p in parameters if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        sq = norm.pow(2)
        tdist.all_reduce(sq, group=self.group)
        total = sq.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total
