"""PyTorch's own tensor parallelism (DTensor), the baseline tensorpar is measured against.

This module is the one place outside tensorpar.distributed that touches torch.distributed: it must,
since the baseline *is* torch.distributed.tensor.parallel. tensorpar's own code never uses it.
"""
from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def torch_tp_mlp(dense: torch.nn.Module, tp_size: int, device_type: str = "cpu") -> torch.nn.Module:
    """A copy of ``dense`` (with ``up`` and ``down`` linears) parallelised by PyTorch's TP API."""
    mesh = init_device_mesh(device_type, (tp_size,))
    return parallelize_module(copy.deepcopy(dense), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
