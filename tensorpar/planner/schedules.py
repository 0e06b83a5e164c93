"""Pipeline schedules in numbers: how many microbatches each pipeline rank keeps alive at its peak,
and the share of a step the pipeline idles (standard library only).

The schedules are PyTorch's (its pipelining package's schedules, torch 2.13), named and
placed as in :mod:`tensorpar.architecture.pipeline`. A microbatch is *alive* on a rank from the
forward of one of its stages until that stage's backward (full, or input-gradient ``I`` in a
zero-bubble schedule): the activations the stage saved for it are held that long. The counts are
in stage-microbatches (a rank holding ``v`` stages keeps up to ``v`` per microbatch), read off
each schedule's action order; ``tests/test_planner_schedules.py`` checks every formula against
PyTorch's own tables (``pipeline_order``; GPipe and 1F1B against what ``_step_microbatches``
runs, as 1F1B's table skips microbatch 0 on the last rank).

Bubble: the idle share of the step, ``idle / (busy + idle)`` on every rank, with a stage's
forward, input-gradient and weight-gradient backward of one microbatch taking equal time
(``T_F = T_B = T_W``, the zero-bubble paper's assumption; a full backward is ``T_B + T_W``)
and communication free. A zero-bubble schedule is zero-bubble only in its steady phase.
"""
from __future__ import annotations

from tensorpar.architecture.pipeline import SINGLE, V_SHAPED, check, schedule_name

SOURCES = {
    "GPipe": "Huang et al. 2019 (GPipe, arXiv:1811.06965); bubble (p-1)/(m+p-1), Narayanan et al. 2021 Sec. 2.2.1",
    "1F1B": "Narayanan et al. 2021 (arXiv:2104.04473) Sec. 2.2.1: bubble (p-1)/(m+p-1); Korthikanti et al. 2022 "
            "Sec. 4.2.3: stage s keeps p - s microbatches",
    "Interleaved1F1B": "Narayanan et al. 2021 Sec. 2.2.2: bubble (p-1)/(v m+p-1); warm-up (v-1) p + 2 (p-1-r) "
                       "forwards, Megatron-LM's interleaved schedule",
    "LoopedBFS": "Lamy-Poirier 2023 (Breadth-First Pipeline Parallelism, arXiv:2211.05953): every forward "
                 "first; bubble as interleaved, (p-1)/(v m+p-1)",
    "InterleavedZeroBubble": "Qi et al. 2024 (Zero Bubble Pipeline Parallelism, arXiv:2401.10241) Sec. 3.1, "
                             "ZB-H1: bubble (p-1)(T_F+T_B-T_W) = (p-1) T, with v stages per rank (p-1)/(3 v m+p-1); "
                             "with m < p microbatches p - m units more",
    "ZBVZeroBubble": "Qi et al. 2024 Sec. 6 (ZB-V); PyTorch's table leaves the p-1 units of its warm-up "
                     "idle: (p-1)/(6m+p-1) from m >= 2p-1 microbatches, 2 units more per microbatch fewer",
    "DualPipeV": "DeepSeek-AI 2024 (DeepSeek-V3, arXiv:2412.19437) Sec. 3.2.1, DualPipe cut to a V; PyTorch's "
                 "table, F and B of an overlapped pair run one after the other: (p-1)/(6m+p-1), m >= 2p",
}


def microbatches_alive(schedule: str, *, pp: int, microbatches: int, virtual: int, rank: int) -> int:
    """Peak stage-microbatches alive on pipeline rank ``rank`` (see the module docstring)."""
    name, p, m, v, r = schedule_name(schedule), pp, microbatches, virtual, rank
    if not 0 <= r < p:
        raise ValueError(f"pipeline rank {rank!r} must be one of 0..{p - 1}")
    if name == "GPipe":  # every forward before any backward
        return m
    if name == "1F1B":  # p - r warm-up forwards, then one backward before each forward
        return min(p - r, m)
    if name == "LoopedBFS":  # every stage's forwards, all microbatches, before any backward
        return v * m
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        return min(_looped_warmup(name, p, m, v, r) + 1, v * m)  # the first steady forward comes before its backward
    if name == "ZBVZeroBubble":  # 2(p-r)-1 forwards of the first stage, then r of each: the second stage's r+1
        return min(2 * p - r - 1, m) + min(r + 1, m)
    return 2 * p + 1  # DualPipeV: 2p warm-up forwards, then an overlapped F and B, F first


def _looped_warmup(name: str, p: int, m: int, v: int, r: int) -> int:
    """Warm-up forwards of rank ``r`` in PyTorch's ``_get_warmup_ops``: ``(v-1)`` rounds of
    microbatches plus 2 (1F1B) or 1 (zero bubble) per hop from the last rank."""
    per_round = m // max(1, m // p)
    hops = 2 if name == "Interleaved1F1B" else 1
    return min((v - 1) * per_round + hops * (p - 1 - r), m * v)


def bubble_fraction(schedule: str, *, pp: int, microbatches: int, virtual: int) -> float:
    """Idle share of a step (see the module docstring; each formula's source in :data:`SOURCES`)."""
    name, p, m, v = schedule_name(schedule), pp, microbatches, virtual
    if name in SINGLE:
        return (p - 1) / (m + p - 1)
    if name in ("Interleaved1F1B", "LoopedBFS"):
        return (p - 1) / (v * m + p - 1)
    if name == "InterleavedZeroBubble":  # fewer microbatches than ranks leave one unit idle per missing one
        idle = p - 1 + max(0, p - m)
        return idle / (3 * v * m + idle)
    idle = max(p - 1, 2 * (2 * p - 1 - m))  # units of T; a rank works 3 T per stage and microbatch, 6 m T in all
    return idle / (6 * m + idle)


# The limits PyTorch's schedule classes raise on live with the other pipeline arguments' checks,
# which the runtime and the command line run too: one check, under the planner's former name.
check_schedule = check


__all__ = ["SOURCES", "microbatches_alive", "bubble_fraction", "check_schedule", "V_SHAPED"]
