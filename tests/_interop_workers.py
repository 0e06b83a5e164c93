"""Rank-side code of tests/test_interop.py: PyTorch's and Hugging Face's own tensor parallelism on
the process group tensorpar's launcher makes by default (its shared-memory backend)."""
import warnings

import torch
import torch.distributed as tdist

from tensorpar import distributed as dist


def pytorch_apis_worker(checkpoint):
    """Every API on the default group; each result beside the dense one computed here from the
    same seed (float64): max abs differences, and what tensorpar's own collectives travel over."""
    from torch.distributed._functional_collectives import all_reduce as functional_all_reduce
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    p, r = tdist.get_world_size(), tdist.get_rank()
    mesh = init_device_mesh("cpu", (p,))
    out = {"transport": dist.transport()}
    full = torch.arange(4 * p * 3, dtype=torch.float64).reshape(4 * p, 3)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    partial = DTensor.from_local(torch.full((2 * p, 3), float(r + 1), dtype=torch.float64), mesh, [Partial()])
    with dist.ledger() as led:  # what DTensor's own collectives went through: this group's Python methods
        gathered = sharded.redistribute(mesh, [Replicate()]).to_local()
        scattered = partial.redistribute(mesh, [Shard(0)]).to_local()
    out["redistribute"] = _diff(gathered, full)
    out["reduce_scatter"] = _diff(scattered, torch.full((2, 3), p * (p + 1) / 2, dtype=torch.float64))
    out["functional_ledger"] = [(rec.op, rec.group_size) for rec in led.records]
    mine = torch.full((5,), float(r + 1), dtype=torch.float64)
    out["functional_all_reduce"] = _diff(functional_all_reduce(mine, "sum", mesh), torch.full((5,), p * (p + 1) / 2))
    out["mlp"] = _parallelize_module_mlp(mesh)
    out["hf_tp_plan"] = _hf_tp_plan(checkpoint)
    from tensorpar.distributed import shm
    ones = torch.ones(4)
    out["own_over_shm"] = shm.segment_of(None, ones) is not None  # tensorpar's own: the shared segment
    out["own_sum"] = dist.all_reduce(ones).tolist()
    return out


def _diff(a, b) -> float:
    return float((a.detach().to(torch.float64) - b.detach().to(torch.float64)).abs().max())


def _parallelize_module_mlp(mesh) -> dict:
    """torchtitan's way: ColwiseParallel then RowwiseParallel on a two-matrix MLP; forward, input
    gradient and every weight gradient equal the dense MLP's."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def mlp():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(8, 16, dtype=torch.float64), torch.nn.GELU(),
                                   torch.nn.Linear(16, 8, dtype=torch.float64))
    dense, split = mlp(), parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    xd, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd, ys = dense(xd), split(xs)
    yd.square().sum().backward()
    ys.square().sum().backward()
    grads = max(_diff(ps.grad.full_tensor(), pd.grad) for pd, ps in zip(dense.parameters(), split.parameters()))
    return {"forward": _diff(ys, yd), "input_grad": _diff(xs.grad, xd.grad), "weight_grads": grads,
            "sharded": tuple(split[0].weight.to_local().shape) != tuple(dense[0].weight.shape)}


def _hf_tp_plan(checkpoint) -> dict:
    """``from_pretrained(tp_plan="auto")`` on this group: logits equal to the dense model's."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    dense = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
    with warnings.catch_warnings():  # transformers' notice that tp_plan= moves to distributed_config=
        warnings.simplefilter("ignore", FutureWarning)
        split = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64, tp_plan="auto")
    weight = split.model.layers[0].mlp.down_proj.weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    with torch.no_grad():
        return {"logits": _diff(split(ids).logits, dense(ids).logits),
                "sharded": tuple(local.shape) != tuple(dense.model.layers[0].mlp.down_proj.weight.shape)}
