"""The planner's schedule formulas (tensorpar.planner.schedules) against PyTorch's own schedules:
the action order each rank runs, read from the schedule objects built over stub stages (no process
group), per rank the most stage-microbatches whose forward ran and whose backward (full or
input-gradient) had not; and the bubble of that order when every action takes its time (F, I, W
one unit, a full backward two) as soon as its rank is free and its input is ready."""
from __future__ import annotations

import logging
from fractions import Fraction

import pytest

pytest.importorskip("torch")
from torch.distributed.pipelining import schedules as S  # noqa: E402
from torch.distributed.pipelining.schedules import _ComputationType as C  # noqa: E402

from tensorpar.architecture.pipeline import LOOPED, SCHEDULES, SINGLE  # noqa: E402
from tensorpar.planner.schedules import SOURCES, bubble_fraction, check_schedule, microbatches_alive  # noqa: E402

UNITS = {C.FORWARD: 1, C.FULL_BACKWARD: 2, C.BACKWARD_INPUT: 1, C.BACKWARD_WEIGHT: 1}
BACKWARD = (C.FULL_BACKWARD, C.BACKWARD_INPUT)


class _Stage:
    """What a schedule reads of a stage when it builds its table, and what the single-stage
    schedules call when they run: forward and backward recorded, no communication."""
    submod = None
    is_first = is_last = False

    def __init__(self, index: int, n_stages: int, pp: int, rank: int, log: list | None = None):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, n_stages, pp, rank
        self.stage_index_to_group_rank, self.log = {}, log

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.log.append(S._Action(self.stage_index, C.FORWARD, mb))

    def backward_one_chunk(self, mb, **kwargs):
        self.log.append(S._Action(self.stage_index, C.FULL_BACKWARD, mb))

    def get_fwd_recv_ops(self, mb):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def perform_reduce_grad(self, *args):
        pass


def torch_order(name: str, pp: int, m: int, v: int) -> dict:
    """rank -> the compute actions PyTorch runs there, in order."""
    cls = S.get_schedule_class(name)
    if name in SINGLE:  # what _step_microbatches runs (1F1B's pipeline_order skips microbatch 0 on the last rank)
        out = {}
        for rank in range(pp):
            log: list = []
            sched = cls(_Stage(rank, pp, pp, rank, log), m)
            sched._initialize_stage = lambda *a, **k: None
            sched._step_microbatches()
            out[rank] = log
        return out
    logging.disable(logging.WARNING)
    try:
        order = cls([_Stage(s, pp * v, pp, 0) for s in range(v)], m).pipeline_order
    finally:
        logging.disable(logging.NOTSET)
    return {r: [x for a in acts for x in _flat(a)] for r, acts in order.items()}


def _flat(a) -> list:
    if a is None:
        return []
    subs = a.sub_actions if a.computation_type == C.OVERLAP_F_B else (a,)  # DualPipeV runs F, then B
    return [x for x in subs if x.computation_type in UNITS]


def peak_alive(actions: list) -> int:
    alive, peak = set(), 0
    for a in actions:
        if a.computation_type == C.FORWARD:
            alive.add((a.stage_index, a.microbatch_index))
        elif a.computation_type in BACKWARD:
            alive.discard((a.stage_index, a.microbatch_index))
        peak = max(peak, len(alive))
    return peak


def simulated_bubble(order: dict, n_stages: int) -> Fraction:
    """Idle over elapsed time on rank 0 (every rank is busy equally long), each action started when
    its rank is free and its input exists."""
    done, free, pos = {}, dict.fromkeys(order, 0), dict.fromkeys(order, 0)
    while any(pos[r] < len(order[r]) for r in order):
        moved = False
        for r, actions in order.items():
            while pos[r] < len(actions):
                a = actions[pos[r]]
                t, s, mb = a.computation_type, a.stage_index, a.microbatch_index
                if t == C.FORWARD:
                    need = ("F", s - 1, mb) if s > 0 else None
                elif t in BACKWARD:
                    need = ("B", s + 1, mb) if s < n_stages - 1 else ("F", s, mb)
                else:
                    need = ("B", s, mb)
                if need is not None and need not in done:
                    break
                free[r] = max(free[r], done.get(need, 0)) + UNITS[t]
                done[("F" if t == C.FORWARD else "B" if t in BACKWARD else "W", s, mb)] = free[r]
                pos[r] += 1
                moved = True
        assert moved, "the schedule deadlocks"
    span = max(free.values())
    busy = sum(UNITS[a.computation_type] for a in order[0])
    return Fraction(span - busy, span)


def cases():
    for name in SCHEDULES:
        for v in ((1,) if name in SINGLE else (1, 2, 3) if name in LOOPED else (2,)):
            for pp in (2, 3, 4, 5):
                for m in range(1, 4 * pp + 1):
                    try:
                        check_schedule(pp=pp, blocks=360, schedule=name, microbatches=m, virtual=v)
                    except ValueError:
                        continue
                    yield name, v, pp, m


CASES = list(cases())


def test_every_schedule_is_checked():
    assert {c[0] for c in CASES} == set(SCHEDULES) == set(SOURCES)
    assert len(CASES) > 200


@pytest.mark.parametrize("name", SCHEDULES)
def test_peak_microbatches_alive_and_bubble_match_pytorchs_schedules(name):
    for _, v, pp, m in (c for c in CASES if c[0] == name):
        order = torch_order(name, pp, m, v)
        found = [peak_alive(order[r]) for r in range(pp)]
        assert [microbatches_alive(name, pp=pp, microbatches=m, virtual=v, rank=r) for r in range(pp)] == found, \
            (name, v, pp, m)
        bubble = simulated_bubble(order, pp * v)
        assert bubble_fraction(name, pp=pp, microbatches=m, virtual=v) == pytest.approx(float(bubble), abs=1e-12), \
            (name, v, pp, m, bubble)


def test_the_papers_figures():
    assert bubble_fraction("1F1B", pp=4, microbatches=8, virtual=1) == 3 / 11  # (p-1)/(m+p-1)
    assert bubble_fraction("Interleaved1F1B", pp=4, microbatches=8, virtual=2) == 3 / 19  # (p-1)/(vm+p-1)
    assert microbatches_alive("1F1B", pp=4, microbatches=8, virtual=1, rank=0) == 4  # Korthikanti: p on stage 0


def test_bad_input_names_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"schedule 'Zigzag' does not exist; valid: GPipe, 1F1B"):
        microbatches_alive("Zigzag", pp=2, microbatches=2, virtual=1, rank=0)
    with pytest.raises(ValueError, match=r"pipeline rank 2 must be one of 0..1"):
        microbatches_alive("GPipe", pp=2, microbatches=2, virtual=1, rank=2)
    with pytest.raises(ValueError, match=r"1F1B needs microbatches >= pp \(4\); got 2"):
        check_schedule(pp=4, blocks=8, schedule="1f1b", microbatches=2)
    with pytest.raises(ValueError, match=r"DualPipeV needs microbatches >= its 8 stages; got 6"):
        check_schedule(pp=4, blocks=8, schedule="DualPipeV", microbatches=6)
    with pytest.raises(ValueError, match=r"multiple of its rounds \(microbatches // pp = 2\); got 9"):
        check_schedule(pp=4, blocks=8, schedule="Interleaved1F1B", microbatches=9, virtual=1)
