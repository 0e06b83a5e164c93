"""Module-level worker functions for tests/test_bench.py (spawned ranks must import them)."""
import torch

from tensorpar.bench.mlp import DenseMLP, TensorparMLP, floor_max_diff


def floor_worker(tokens, hidden):
    """The hand-written floor against the dense MLP, in float64 (exact up to summation order)."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    dense = DenseMLP(hidden, 4 * hidden)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2))
    return floor_max_diff(dense, TensorparMLP(dense), x, grad)


def train_and_pipeline_worker(path, ckpt_root, train_args, pipeline_args, estimates_args):
    """The train, pipeline and estimates suites' workers in one launch (one spawn for the three
    smokes): ``{"train": rows, "pipeline": rows, "estimates": {"rows", "profile"}}``."""
    from tensorpar.bench.estimates import estimates_worker
    from tensorpar.bench.pipeline import pipeline_worker
    from tensorpar.bench.train import train_worker

    return {"train": train_worker(path, ckpt_root, *train_args), "pipeline": pipeline_worker(path, *pipeline_args),
            "estimates": estimates_worker(path, *estimates_args), "wait": _alternating_wait()}


def _alternating_wait():
    """calibrate's wait loop over work whose noise is known: each rank sleeps 2 ms on every other
    call, the two ranks in turn (tests/test_bench.py)."""
    import itertools
    import time

    from tensorpar import distributed as dist
    from tensorpar.bench.calibrate import wait_points

    def work(m):
        turn = itertools.count()
        return lambda: time.sleep(2e-3) if next(turn) % 2 == dist.get_rank() else None
    return wait_points("shm", 2, m_sizes=(1,), work=work)
