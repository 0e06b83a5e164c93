"""Interleaved, synchronised timing across ranks."""
from __future__ import annotations

import statistics
import time

import torch

from tensorpar import dist


def timed(fn, group=None) -> float:
    """Wall time of ``fn()`` on the slowest rank: barrier, run, then the max over ranks."""
    dist.barrier(group)
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, group, op="max")  # outside any ledger: not accounted
    return float(elapsed.item())


def interleaved(variants: dict, repeats: int, warmup: int = 1, group=None) -> dict:
    """Run every variant once per round, ``repeats`` rounds; returns the per-variant samples.

    Interleaving puts each variant under the same background load, so their ratio is fair even
    when the machine's speed drifts between rounds.
    """
    for _ in range(warmup):
        for fn in variants.values():
            timed(fn, group)
    samples = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            samples[name].append(timed(fn, group))
    return samples


def medians(samples: dict) -> dict:
    return {name: statistics.median(v) for name, v in samples.items()}
