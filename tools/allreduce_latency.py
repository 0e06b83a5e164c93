"""Latency of one small all-reduce between 2 local ranks, over shared memory and over gloo.

    python tools/allreduce_latency.py            # 8 KiB (2048 float32), 15 interleaved rounds

Per backend, one launch; in it, rounds of 300 calls of each variant, interleaved, medians in
microseconds: ``torch.distributed.all_reduce``, tensorpar's ``dist.all_reduce`` (flight recorder
and ledger hooks included; over shared memory it calls the transport directly) and, over shared
memory, the transport's own all-reduce and one bare synchronisation round.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402

from tensorpar import distributed as dist  # noqa: E402
from tensorpar.distributed import flight, shm  # noqa: E402


def worker(numel: int, rounds: int) -> dict:
    flight.check_collectives(False)
    y = torch.randn(numel)
    segment = getattr(tdist.GroupMember.WORLD, "segment", None)
    variants = {"torch.distributed.all_reduce": lambda: tdist.all_reduce(y),
                "tensorpar dist.all_reduce": lambda: dist.all_reduce(y)}
    if segment is not None:
        variants["transport alone"] = lambda: shm.all_reduce(segment, y, "sum")
        variants["one synchronisation round"] = lambda: _round(segment)
    samples = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            tdist.barrier()
            t0 = time.perf_counter()
            for _ in range(300):
                fn()
            samples[name].append((time.perf_counter() - t0) / 300 * 1e6)
    return {k: round(statistics.median(v), 1) for k, v in samples.items()}


def _round(segment) -> None:
    g = segment.begin()
    segment.arrive(g)
    segment.depart(g)


if __name__ == "__main__":
    for backend in ("shm", "gloo"):
        print(backend, dist.launch(worker, 2, 2048, 15, backend=backend)[0])
