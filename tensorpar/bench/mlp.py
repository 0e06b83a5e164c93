"""Tensor-parallel MLP (column -> GELU -> row) against its baselines, in one launch.

Variants, each timed on the slowest rank, interleaved round by round (the order rotating); each
ratio is the median over rounds of the two variants' times in the same round:

- ``tensorpar``: ColumnParallelLinear -> GELU -> RowParallelLinear, one thread per rank.
- ``torch_tp``: the same weights under PyTorch's ``parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel`` (DTensor), one thread per rank.
- ``dense_2t``: the unsplit MLP in one process (rank 0) with 2 threads while the other rank waits.
- ``floor``: the slowest rank's local work (its two shard matmuls, the biases and GELU, forward
  or forward+backward, on plain tensors) and one raw all-reduce of the output (plus one of dX
  with backward), in sequence: the same step hand-written with no framework at all.
- ``floor_parts``: the same two parts, each timed alone with the ranks in step before it
  (reported, not a target). It leaves out the ranks' waiting for each other inside a step, but
  the all-reduce timed alone carries its own latency noise, so it lands on either side of
  ``floor``. Its median is the sum of the two parts' medians; its ratio pairs per-round sums.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar import distributed as dist
from tensorpar.bench.baselines import torch_tp_mlp
from tensorpar.distributed.collectives import split_own
from tensorpar.bench.timing import (interleaved, medians, on_rank0_with_threads, paired_ratio,
                                    wait_ready)
from tensorpar.nn.layers import ColumnParallelLinear, RowParallelLinear

# float32's tolerance: the variants' largest relative difference from the dense MLP measured
# 5e-7 (4096 x 1024); a missing all-reduce or a bias added twice is O(1).
AGREE_REL = 1e-5
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


def _sampling(tokens: int, hidden: int, repeats: int) -> tuple[int, int]:
    """``(calls per timed sample, rounds)`` for one size.

    A sample lasts well above the timer's and the barrier's jitter: up to 40 calls, ~2 GFLOP.
    Sizes that need 8 or more calls for that (16 x 128: 40 calls; 128 x 256: 14), where a step
    is a few ms at most and much of it collective latency, run five times ``repeats`` rounds: on
    this shared machine one 8 kB gloo all-reduce took anywhere from ~0.2 to ~2.6 ms (measured),
    and many short rounds pair each variant with its baseline more closely in time than a few
    long ones.
    """
    flops = 2 * 2 * tokens * hidden * 4 * hidden
    calls = max(1, min(40, int(2e9 // max(flops, 1))))
    return calls, repeats * 5 if calls >= 8 else repeats


def _pass(model, x, grad, backward: bool):
    params = list(model.parameters())  # gradients reset by hand, as the floor does: the harness's
                                       # module walk (zero_grad) is not the layers' cost

    def run():
        if backward:
            x.grad = None
            for p in params:
                p.grad = None
            model(x).backward(grad)
        else:
            with torch.no_grad():
                wait_ready(model(x))
    return run


def _floor_parts(tp: TensorparMLP, x, grad, backward: bool):
    """The floor, and its two parts alone, on plain tensors with raw collectives.

    ``floor``: this rank's shard compute and the all-reduce(s) in sequence, as a hand-written
    tensor-parallel MLP with no modules, no autograd operators and no checks would run them
    (forward: local matmuls, all-reduce of the output in place, bias; backward: local backward,
    then the all-reduce of dX). ``compute`` and ``comm``: each part alone, the ranks in step
    before each. Both are sums of parts in sequence, as the issue's floor is: tensorpar's
    backward overlaps the dX all-reduce with the dW GEMM, so it can come in below them.
    """
    params = [t.detach().clone().requires_grad_(backward)
              for t in (tp.up.weight, tp.up.bias, tp.down.weight, tp.down.bias)]
    w1, b1, w2, b2 = params
    y_buf = torch.empty(x.shape, dtype=x.dtype)

    def compute(reduce=None):
        """One step; returns what it computed (the output; with backward also dX and the four
        parameter gradients) so that :func:`floor_max_diff` can check it against the dense MLP."""
        if backward:
            xx = x.detach().requires_grad_(True)
            y_partial = F.linear(F.gelu(F.linear(xx, w1, b1)), w2)
            if reduce:
                reduce(y_partial.detach())  # forward all-reduce of the output, in place
            y_partial.add_(b2).backward(grad)  # the bias, added once after the sum
            if reduce:
                reduce(xx.grad)  # backward all-reduce of dX
            grads = [p.grad for p in params]
            for p in params:
                p.grad = None
            return y_partial.detach(), xx.grad, grads
        with torch.no_grad():
            y_partial = F.linear(F.gelu(F.linear(x, w1, b1)), w2)
            if reduce:
                reduce(y_partial)
            return y_partial.add_(b2), None, None

    def comm():
        for _ in range(2 if backward else 1):
            dist.all_reduce(y_buf)
    return (lambda: compute(dist.all_reduce)), compute, comm


def floor_max_diff(dense: DenseMLP, tp: TensorparMLP, x, grad) -> float:
    """Largest relative difference (``max |got - dense| / max |dense|`` per tensor) of the
    hand-written floor from the dense MLP: its output, dX and this
    rank's slice of every parameter gradient (the up projection's rows and the down projection's
    columns are this rank's chunk; the down bias is whole). A floor that skipped an all-reduce or
    added the bias on every rank would be timed as a step that computes something else."""
    floor, _, _ = _floor_parts(tp, x, grad, backward=True)
    y, dx, (g_w1, g_b1, g_w2, g_b2) = floor()
    xx = x.detach().clone().requires_grad_(True)
    ref = dense(xx)
    ref.backward(grad)
    want = [(y, ref), (dx, xx.grad), (g_w1, split_own(dense.up.weight.grad, 0)),
            (g_b1, split_own(dense.up.bias.grad, 0)), (g_w2, split_own(dense.down.weight.grad, 1)),
            (g_b2, dense.down.bias.grad)]
    dense.zero_grad(set_to_none=True)
    forward, _, _ = _floor_parts(tp, x, grad, backward=False)
    want.append((forward()[0], ref))
    return max((got - exp).abs().max().item() / (exp.abs().max().item() or 1.0) for got, exp in want)


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
    floor_diff = floor_max_diff(dense, tp, x, grad)
    with torch.no_grad():
        scale = dense(x).abs().max().item() or 1.0
    if max(max_diff / scale, floor_diff) > AGREE_REL:  # a benchmark never times a wrong computation
        raise RuntimeError(f"at {tokens}x{hidden} the variants do not compute the dense MLP: tensorpar or "
                           f"PyTorch TP {max_diff / scale:.2e}, the floor {floor_diff:.2e} (relative; "
                           f"at most {AGREE_REL:g})")
    n, rounds = _sampling(tokens, hidden, repeats)
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
        samples = interleaved({k: _repeat(f, n) for k, f in variants.items()}, rounds)
        samples = {k: [t / n for t in v] for k, v in samples.items()}  # seconds per call
        med = medians(samples)
        med["floor_parts"] = med.pop("floor_compute") + med.pop("floor_comm")
        rows.append({"tokens": tokens, "hidden": hidden, "ffn": 4 * hidden,
                     "pass": "fwd+bwd" if backward else "fwd", "tp": dist.get_world_size(),
                     "rounds": rounds, "calls_per_sample": n, "max_abs_diff": max_diff,
                     "floor_max_rel_diff": floor_diff,
                     "median_s": med, "samples_s": samples,
                     **{f"tensorpar_vs_{d}": paired_ratio(samples, "tensorpar", d)
                        for d in ("torch_tp", "floor", "dense_2t")},
                     "tensorpar_vs_floor_parts": paired_ratio(samples, "tensorpar",
                                                              ["floor_compute", "floor_comm"])})
    return rows


def mlp_worker(sizes, repeats):
    torch.set_num_threads(1)
    dist.check_collectives(False)  # timed as users run: no signature exchange before each collective
    return [row for t, h in sizes for row in bench_size(t, h, repeats)]


def run_mlp_bench(sizes=DEFAULT_SIZES, repeats: int = 7, tp: int = 2) -> list[dict]:
    """All sizes in one launch of ``tp`` ranks; returns rank 0's rows (every rank has the same)."""
    return dist.launch(mlp_worker, tp, tuple(sizes), repeats, backend="gloo", timeout=600)[0]
