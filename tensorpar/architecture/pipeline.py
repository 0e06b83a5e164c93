"""Pipeline stages, torch-free: how blocks are cut into stages, which schedules exist, which rank
holds which stage, and the arguments checked before any rank starts (standard library only).

The runtime (:mod:`tensorpar.sharding.stage_cut`, :mod:`tensorpar.distributed.pipelining`), the
planner (:mod:`tensorpar.planner.stages`) and the command line read these, so that the plan and
the run cut the same way.

Schedules are PyTorch's own (its pipelining package's schedules, torch 2.13), chosen by
name (case-insensitive). A *single* schedule runs one stage per rank; a *multi* schedule runs
``virtual`` stages per rank (virtual stages, Narayanan et al. 2021, Sec. 2.2), placed in a loop
(stage ``s`` on rank ``s % pp``) or in a V (rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``:
the zero-bubble V schedules, Qi et al. 2024).
"""
from __future__ import annotations

SINGLE = ("GPipe", "1F1B")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE + LOOPED + V_SHAPED
# schedules whose backward runs in two passes, input gradients then weight gradients (Qi et al. 2024)
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def schedule_name(name: str) -> str:
    """The canonical spelling of a schedule name, or ``ValueError`` listing the valid ones."""
    for known in SCHEDULES:
        if isinstance(name, str) and name.lower() == known.lower():
            return known
    raise ValueError(f"pipeline schedule {name!r} does not exist; valid: {', '.join(SCHEDULES)}")


def default_virtual(schedule: str) -> int:
    """Stages per rank when not given: 1 for a single schedule, 2 otherwise."""
    return 1 if schedule_name(schedule) in SINGLE else 2


def stage_sizes(blocks: int, stages: int) -> list[int]:
    """Blocks per stage, in stage order: ``blocks // stages`` each, the remainder one each to the
    first stages (the last stage also runs the output head and the loss, the first only an
    embedding lookup)."""
    if stages < 1 or blocks < stages:
        raise ValueError(f"{stages} pipeline stages need at least {stages} blocks; the model has {blocks}")
    base, extra = divmod(blocks, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def stage_ranges(sizes) -> list[tuple[int, int]]:
    """``[(first block, end)]`` of each stage from its block count."""
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


def stages_of_rank(rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """The stage indices pipeline rank ``rank`` holds, in order."""
    if schedule_name(schedule) in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(virtual)]


def rank_of_stage(stage: int, pp: int, schedule: str) -> int:
    """The pipeline rank holding ``stage``."""
    if schedule_name(schedule) in V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def check(*, pp: int, blocks: int, schedule: str, microbatches: int, virtual: int | None = None,
          batch: int | None = None, sizes=None) -> tuple[str, int, list[int]]:
    """Every pipeline argument, before anything runs: ``(schedule, virtual, blocks per stage)``, or
    ``ValueError`` naming the value and the valid choices."""
    name = schedule_name(schedule)
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be a positive integer, got {pp!r}")
    v = default_virtual(name) if virtual is None else virtual
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"virtual stages per rank must be a positive integer, got {virtual!r}")
    if name in SINGLE and v != 1:
        raise ValueError(f"schedule {name} runs one stage per rank; got virtual={v} (multi-stage schedules: "
                         f"{', '.join(LOOPED + V_SHAPED)})")
    if name in V_SHAPED and v != 2:
        raise ValueError(f"schedule {name} runs two stages per rank (a V); got virtual={v}")
    stages = pp * v
    if stages > blocks:
        valid = [p for p in range(1, blocks // v + 1)]
        raise ValueError(f"pp={pp} x {v} stage(s) per rank = {stages} stages, more than the model's {blocks} "
                         f"blocks; valid pp with {v} stage(s) per rank: {valid}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
    if batch is not None and batch % microbatches:
        valid = [m for m in range(1, batch + 1) if batch % m == 0]
        raise ValueError(f"microbatches={microbatches} does not divide the batch of {batch} sequences "
                         f"(per data-parallel rank); valid: {valid}")
    if name in LOOPED and v > 1 and microbatches % pp:  # whole rounds of pp microbatches: the planner's formulas
        valid = [m for m in range(pp, 4 * pp + 1, pp)]
        raise ValueError(f"schedule {name} with {v} stages per rank needs microbatches divisible by pp={pp}; "
                         f"got {microbatches} (valid, e.g.: {valid})")
    _check_torch_limits(name, pp, microbatches)
    if sizes is None:
        if name in LOOPED + V_SHAPED and v > 1 and blocks % stages:
            valid = [d for d in range(1, blocks + 1) if blocks % d == 0]
            raise ValueError(f"{stages} virtual stages (pp={pp} x {v}) do not divide the model's {blocks} blocks; "
                             f"stages that do: {valid} (or give the blocks per stage)")
        sizes = stage_sizes(blocks, stages)
    sizes = list(sizes)
    if len(sizes) != stages or sum(sizes) != blocks or min(sizes) < 1:
        raise ValueError(f"blocks per stage {sizes} must be {stages} positive counts adding up to the model's "
                         f"{blocks} blocks")
    return name, v, sizes


def _check_torch_limits(name: str, pp: int, m: int) -> None:
    """What PyTorch's schedule classes raise on at construction (torch 2.13), said before any rank
    starts: 1F1B needs a microbatch per stage in flight, DualPipeV one per each of its ``2 pp``
    stages, the interleaved schedules a whole number of rounds (``m // pp`` microbatches each)."""
    if name == "1F1B" and m < pp:
        raise ValueError(f"schedule 1F1B needs microbatches >= pp ({pp}); got {m} (valid: {pp}, {2 * pp}, ...)")
    if name == "DualPipeV" and m < 2 * pp:
        raise ValueError(f"schedule DualPipeV needs microbatches >= its {2 * pp} stages; got {m} "
                         f"(valid: {2 * pp}, {3 * pp}, ...)")
    rounds = max(1, m // pp)
    if name in LOOPED and name != "LoopedBFS" and m % rounds:
        raise ValueError(f"schedule {name} needs microbatches a multiple of its rounds (microbatches // pp = "
                         f"{rounds}); got {m} (valid, e.g.: {pp}, {2 * pp}, {3 * pp})")
