"""Data parallelism around tensor parallelism, on a ``DeviceMesh`` with ``("dp", "tp")`` dimensions.

Tensor parallelism runs inside ``mesh["tp"]`` (tensorpar's own layers and collectives); data
parallelism runs across ``mesh["dp"]`` through PyTorch's own engines, never hand-written gradient
averaging:

- ``"ddp"`` (ZeRO-0): ``torch.distributed._composable.replicate``, DistributedDataParallel
  applied in place (the module keeps its class and its ``tp_report``): every dp rank holds its
  tp shard whole, and backward all-reduces (averages) the gradients over ``dp`` in DDP's buckets;
- ``"fsdp"`` (ZeRO-3): FSDP2 ``fully_shard`` on every transformer block, then on the model: each
  dp rank holds ``1/dp`` of its tp shard (dim 0, ``torch.chunk``'s rule), all-gathered before a
  block runs and freed after; backward reduce-scatters (averages) the gradients over ``dp``.

Each rank's batch is its own slice of the global batch: with equal slices the dp average of the
per-rank mean losses' gradients is the gradient of the global mean loss.
"""
from __future__ import annotations

from torch import nn

DATA_PARALLEL = ("ddp", "fsdp")
_DIMS = (("dp", "tp"), ("tp",), ("pp", "dp", "tp"))  # data parallelism alone: ("dp", "tp") with tp 1


def check_args(mesh, tp_group, data_parallel, pipeline=None) -> None:
    """The mesh and the data-parallel choice, before any collective: ``ValueError`` naming them."""
    if data_parallel is not None and data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel must be one of {', '.join(DATA_PARALLEL)} or None, got {data_parallel!r}")
    if mesh is None:
        if pipeline is not None:
            raise ValueError(f"pipeline={pipeline!r} needs mesh=, a DeviceMesh with dimensions ('pp', 'dp', 'tp') "
                             f"(init_device_mesh('cpu', (pp, dp, tp), mesh_dim_names=('pp', 'dp', 'tp')))")
        if data_parallel is not None:
            raise ValueError(f"data_parallel={data_parallel!r} needs mesh=, a DeviceMesh with a 'dp' dimension")
        return
    from torch.distributed.device_mesh import DeviceMesh
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if tp_group is not None:
        raise ValueError("pass mesh= or tp_group=, not both (the mesh's 'tp' dimension is the tp group)")
    names = tuple(mesh.mesh_dim_names or ())
    if names not in _DIMS:
        raise ValueError(f"mesh dimensions must be named ('pp', 'dp', 'tp'), ('dp', 'tp') or ('tp',); got "
                         f"{names or None} (init_device_mesh('cpu', (dp, tp), mesh_dim_names=('dp', 'tp')); "
                         f"any size may be 1)")
    if pipeline is not None and "pp" not in names:
        raise ValueError(f"pipeline={pipeline!r} needs a 'pp' dimension; the mesh has {names} "
                         f"(init_device_mesh('cpu', (pp, dp, tp), mesh_dim_names=('pp', 'dp', 'tp')))")
    if pipeline is None and "pp" in names and mesh["pp"].size() > 1:
        raise ValueError(f"the mesh has a 'pp' dimension of {mesh['pp'].size()}: choose a pipeline schedule, "
                         f"pipeline= one of GPipe, 1F1B, Interleaved1F1B, ... (or a mesh with pp 1)")
    if data_parallel is not None and "dp" not in names:
        raise ValueError(f"data_parallel={data_parallel!r} needs a 'dp' dimension; the mesh has {names} "
                         f"(init_device_mesh('cpu', (dp, tp), mesh_dim_names=('dp', 'tp')))")
    if data_parallel is None and "dp" in names and mesh["dp"].size() > 1:
        raise ValueError(f"the mesh has a 'dp' dimension of {mesh['dp'].size()}: choose data_parallel='ddp' "
                         f"(replicated) or 'fsdp' (fully sharded)")


def wrap_stage(stage: nn.Module, mesh, data_parallel: str | None, blocks=()) -> nn.Module:
    """One pipeline stage made data-parallel over ``mesh["dp"]`` in the form PyTorch's pipelining
    drives (it holds the gradient reduction back until a step's last microbatch): FSDP2's
    ``fully_shard``, or for ``"ddp"`` its replicated sibling ``replicate`` (ZeRO-0 on FSDP2's
    machinery: every parameter whole on every dp rank, gradients all-reduced), each on the stage's
    blocks and on the stage itself. FSDP2's units stay unsharded from their first forward to the
    step's end (``reshard_after_forward=False``): one all-gather per unit and step, not one per
    microbatch (torchtitan shards so under pipelining); the gradients are reduce-scattered once."""
    if data_parallel is None or mesh["dp"].size() == 1:  # nothing to average over: no engine, no calls
        return stage
    from torch.distributed.fsdp import fully_shard
    if data_parallel == "ddp":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        for block in blocks:
            replicate(block, mesh=mesh["dp"])
        replicate(stage, mesh=mesh["dp"])
        return stage
    for block in blocks:  # gathered once per step, not once per microbatch (torchtitan's choice under pp)
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=False)
    return stage


def tp_group_of(mesh):
    """The process group tensor parallelism runs in: the mesh's ``tp`` dimension."""
    return mesh["tp"].get_group()


def apply(model: nn.Module, mesh, data_parallel: str, blocks=()) -> None:
    """Wrap ``model`` (already tensor-parallel in ``mesh["tp"]``) for data parallelism over
    ``mesh["dp"]``; ``blocks``: its transformer blocks, each its own FSDP unit."""
    dp_mesh = mesh["dp"]
    if data_parallel == "ddp":
        from torch.distributed._composable.replicate import replicate
        replicate(model, process_group=dp_mesh.get_group())
        return
    from torch.distributed.fsdp import fully_shard
    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def init_mesh(dp: int, tp: int, device_type: str = "cpu", *, pp: int | None = None):
    """The ``("dp", "tp")`` DeviceMesh over the world's ``dp * tp`` ranks: rank ``r`` at
    ``(r // tp, r % tp)``, so each tp group is ``tp`` consecutive ranks (one node under torchrun).
    With ``pp``: the ``("pp", "dp", "tp")`` mesh over ``pp * dp * tp`` ranks, pipeline stages outermost."""
    from torch.distributed.device_mesh import init_device_mesh
    if pp is not None:
        return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
