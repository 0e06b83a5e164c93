"""Workers for tests/test_planner_mesh.py (spawned ranks import them)."""
import copy
import warnings

import torch
import torch.distributed as tdist

from tensorpar import distributed as dist
from tensorpar.apply import parallelize
from tensorpar.models.tiny import make_tiny_model
from tensorpar.models.training import train_step

BATCH, SEQ = 4, 8


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def step_worker(layouts):
    """For each ``(dp, tp, data_parallel, sequence_parallel[, arch])``: three training steps of the
    tiny model (llama unless named) on the mesh; the third under the ledger (the first two let DDP
    settle its buckets).
    Returns the records by mesh dimension and the bytes of parameters, gradients and AdamW moments
    this rank holds."""
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh
    out = {}
    for layout in layouts:
        dp, tp, kind, sp, arch = (*layout, "llama")[:5]
        dense = make_tiny_model(arch, seed=1)
        ids = torch.randint(0, dense.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        model = parallelize(copy.deepcopy(dense), mesh=mesh, data_parallel=kind, sequence_parallel=sp).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        d = mesh["dp"].get_local_rank()
        rows = ids[d * BATCH // dp:(d + 1) * BATCH // dp]
        for _ in range(2):
            train_step(model, opt, rows, max_norm=1.0)
        with dist.ledger(model) as led:
            train_step(model, opt, rows, max_norm=1.0)
        names = {mesh["tp"].get_group().group_name: "tp", mesh["dp"].get_group().group_name: "dp"}
        records = [(names.get(r.group, r.group), r.op, r.module, r.phase, r.payload_bytes, r.bytes_sent)
                   for r in led.records]
        held = {"params": sum(_local(p).numel() * p.element_size() for p in model.parameters()),
                "grads": sum(_local(p.grad).numel() * p.element_size() for p in model.parameters()),
                "optimizer": sum(_local(v).numel() * v.element_size() for s in opt.state.values()
                                 for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))}
        out[layout] = {"records": records, "held": held, "tp_rank": mesh["tp"].get_local_rank(),
                                   "dp_rank": d, "rank": tdist.get_rank()}
    return out
