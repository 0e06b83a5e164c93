"""Tensor-parallel MLP (column -> GELU -> row) against its baselines, in one launch.

Variants, each timed on the slowest rank, interleaved round by round:

- ``tensorpar``: ColumnParallelLinear -> GELU -> RowParallelLinear, one thread per rank.
- ``torch_tp``: the same weights under PyTorch's ``parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel`` (DTensor), one thread per rank.
- ``dense_2t``: the unsplit MLP in one process (rank 0) with 2 threads while the other rank waits.
- ``floor``: the slowest rank's local work (its two shard matmuls, bias and GELU, forward or
  forward+backward, on plain tensors) and one raw all-reduce of the output (plus one of dX with
  backward), in sequence: the same step hand-written with no framework at all.
- ``floor_parts``: the same two parts, each timed alone with the ranks in step before it; below
  ``floor`` by what the ranks lose waiting for each other inside a step (reported, not a target).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar import dist
from tensorpar.bench.baselines import torch_tp_mlp
from tensorpar.bench.timing import interleaved, medians, on_rank0_with_threads, wait_ready
from tensorpar.nn.layers import ColumnParallelLinear, RowParallelLinear

# (tokens, hidden): decode-like to large; ffn = 4 * hidden.
DEFAULT_SIZES = ((16, 128), (128, 256), (1024, 512), (4096, 1024))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class TensorparMLP(nn.Module):
    def __init__(self, dense: DenseMLP):
        super().__init__()
        self.up = ColumnParallelLinear.from_dense(dense.up)
        self.down = RowParallelLinear.from_dense(dense.down)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def _inner_iters(tokens: int, hidden: int) -> int:
    """Calls per timed sample, so a sample lasts well above the timer's and barrier's jitter."""
    flops = 2 * 2 * tokens * hidden * 4 * hidden
    return max(1, min(200, int(2e9 // max(flops, 1))))


def _pass(model, x, grad, backward: bool):
    def run():
        if backward:
            x.grad = None
            model.zero_grad(set_to_none=True)
            model(x).backward(grad)
        else:
            with torch.no_grad():
                wait_ready(model(x))
    return run


def _floor_parts(tp: TensorparMLP, x, grad, backward: bool):
    """The floor, and its two parts alone, on plain tensors with raw collectives.

    ``floor``: this rank's shard compute and the all-reduce(s) in sequence, as a hand-written
    tensor-parallel MLP with no modules, no autograd operators and no checks would run them
    (forward: local matmuls, all-reduce of the output; backward: local backward, all-reduce of
    dX). ``compute`` and ``comm``: each part alone, the ranks in step before each.
    """
    w1, b1 = tp.up.weight.detach().clone(), tp.up.bias.detach().clone()
    w2 = tp.down.weight.detach().clone()
    if backward:
        w1.requires_grad_(True), b1.requires_grad_(True), w2.requires_grad_(True)
    y_buf = torch.empty(x.shape, dtype=x.dtype)

    def compute(reduce=None):
        if backward:
            xx = x.detach().requires_grad_(True)
            y_partial = F.linear(F.gelu(F.linear(xx, w1, b1)), w2)
            if reduce:
                reduce(y_partial.detach().clone())  # forward all-reduce of the output
            y_partial.backward(grad)
            if reduce:
                reduce(xx.grad)  # backward all-reduce of dX
            w1.grad = b1.grad = w2.grad = None
        else:
            with torch.no_grad():
                y_partial = F.linear(F.gelu(F.linear(x, w1, b1)), w2)
                if reduce:
                    reduce(y_partial)

    def comm():
        for _ in range(2 if backward else 1):
            dist.all_reduce(y_buf)
    return (lambda: compute(dist.all_reduce)), compute, comm


def _repeat(fn, n):
    def run():
        for _ in range(n):
            fn()
    return run


def _check_equal(dense, tp, ttp, x) -> float:
    """Largest difference of the two parallel MLPs from the dense one (a sanity check, fp32)."""
    with torch.no_grad():
        ref = dense(x)
        return max((tp(x) - ref).abs().max().item(), (ttp(x) - ref).abs().max().item())


def bench_size(tokens: int, hidden: int, repeats: int, seed: int = 0) -> list[dict]:
    torch.manual_seed(seed)
    dense = DenseMLP(hidden, 4 * hidden)
    tp, ttp = TensorparMLP(dense), torch_tp_mlp(dense, dist.get_world_size())
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed + 1))
    grad = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed + 2))
    max_diff = _check_equal(dense, tp, ttp, x)
    n = _inner_iters(tokens, hidden)
    rows = []
    for backward in (False, True):
        floor, local, comm = _floor_parts(tp, x, grad, backward)
        variants = {
            "tensorpar": _pass(tp, x.clone().requires_grad_(backward), grad, backward),
            "torch_tp": _pass(ttp, x.clone().requires_grad_(backward), grad, backward),
            "dense_2t": on_rank0_with_threads(_pass(dense, x.clone().requires_grad_(backward), grad, backward)),
            "floor": floor,
            "floor_compute": local,
            "floor_comm": comm,
        }
        samples = interleaved({k: _repeat(f, n) for k, f in variants.items()}, repeats)
        med = {k: v / n for k, v in medians(samples).items()}
        med["floor_parts"] = med.pop("floor_compute") + med.pop("floor_comm")
        rows.append({"tokens": tokens, "hidden": hidden, "ffn": 4 * hidden,
                     "pass": "fwd+bwd" if backward else "fwd", "tp": dist.get_world_size(),
                     "repeats": repeats, "calls_per_sample": n, "max_abs_diff": max_diff,
                     "median_s": med,
                     "tensorpar_vs_torch_tp": med["tensorpar"] / med["torch_tp"],
                     "tensorpar_vs_floor": med["tensorpar"] / med["floor"],
                     "tensorpar_vs_dense_2t": med["tensorpar"] / med["dense_2t"]})
    return rows


def mlp_worker(sizes, repeats):
    torch.set_num_threads(1)
    return [row for t, h in sizes for row in bench_size(t, h, repeats)]


def run_mlp_bench(sizes=DEFAULT_SIZES, repeats: int = 7, tp: int = 2) -> list[dict]:
    """All sizes in one launch of ``tp`` ranks; returns rank 0's rows (every rank has the same)."""
    return dist.launch(mlp_worker, tp, tuple(sizes), repeats, backend="gloo", timeout=600)[0]
