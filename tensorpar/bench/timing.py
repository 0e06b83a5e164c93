"""Interleaved, synchronised timing across ranks."""
from __future__ import annotations

import statistics
import time

import torch

from tensorpar import distributed as dist


def timed(fn, group=None) -> float:
    """Wall time of ``fn()`` on the slowest rank: barrier, run, then the max over ranks."""
    dist.barrier(group)
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, group, op="max")  # outside any ledger: not accounted
    return float(elapsed.item())


def interleaved(variants: dict, repeats: int, warmup: int = 1, group=None, before=None, start: int = 0) -> dict:
    """Run every variant once per round, ``repeats`` rounds; returns the per-variant samples;
    ``before(name)``, where given, runs before each sample, outside its time; ``start``: the first
    round's number in the rotation (a later call continuing an earlier one's rounds).

    Interleaving puts each variant under the same background load, so their ratio is fair even
    when the machine's speed drifts between rounds. The order rotates by one each round and runs
    backwards in every other cycle of rotations, so no variant always runs first after the
    barrier, and each follows either neighbour as often as the other.
    """
    names = list(variants)
    for _ in range(warmup):
        for fn in variants.values():
            timed(fn, group)
    samples = {name: [] for name in names}
    for i in range(start, start + repeats):
        for name in round_order(names, i):
            if before is not None:
                before(name)
            samples[name].append(timed(variants[name], group))
    return samples


def spread(n: int, count: int) -> list:
    """``n`` rounds in ``count`` groups, as even as they go, the larger first: 5 in 3 -> [2, 2, 1]
    (a calibration's windows, a bench's groups between its other cases)."""
    return [n // count + (i < n % count) for i in range(count)]


def round_order(names: list, i: int) -> list:
    """Round ``i``'s order: ``names`` rotated by i, reversed when ``i // len(names)`` is odd."""
    k = i % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if (i // len(names)) % 2 else order


def medians(samples: dict) -> dict:
    return {name: statistics.median(v) for name, v in samples.items()}


def paired_ratio(samples: dict, num: str, den) -> float:
    """Median over rounds of ``num``'s time over ``den``'s in the same round.

    ``den``: a variant name, or a list of names whose times are added (parts timed apart). A
    round's pair ran within the same round, seconds apart at most, so this ratio is steadier on
    a shared machine than the ratio of two medians, whose rounds may have met different load.
    """
    parts = [den] if isinstance(den, str) else list(den)
    per_round = [a / sum(samples[d][i] for d in parts) for i, a in enumerate(samples[num])]
    return statistics.median(per_round)


def on_rank0_with_threads(fn, threads: int = 2):
    """``fn`` on rank 0 only, with ``threads`` intra-op threads (the unsplit baseline), while the
    other ranks idle in the timing collectives."""
    def run():
        if dist.get_rank() == 0:
            torch.set_num_threads(threads)
            try:
                fn()
            finally:
                torch.set_num_threads(1)
    return run


def wait_ready(y: torch.Tensor) -> torch.Tensor:
    """Wait for ``y``: DTensor returns outputs whose collective is still in flight (an
    AsyncCollectiveTensor, waited on first use); a pass is timed until its result exists."""
    wait = getattr(y, "wait", None)
    return wait() if wait is not None else y
