"""What one engine step of ``tensorpar serve`` runs, and how rank 0 sends it to the other ranks.

A :class:`Plan` is a step's rows (:class:`Row`: tokens of one request's choice in its slot of
the cache) and draws (:class:`Draw`: how one request picks its next tokens); :class:`PlanWire`
sends it from rank 0 in one broadcast of a fixed-size buffer. The step itself:
:class:`tensorpar.models.engine.Engine`.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from tensorpar import distributed as dist
from tensorpar.models.sampling import Sampler


@dataclass(frozen=True)
class Row:
    """Tokens of one request's choice this step: ``ids`` at positions ``start ..`` of ``slot``."""

    slot: int
    start: int
    ids: tuple


@dataclass(frozen=True)
class Draw:
    """How one request picks its next tokens: ``members`` are ``(row index, choice index)`` pairs
    of its choices still running, drawn as rows ``choice`` of ``generate`` on ``n`` copies of the
    prompt at step ``step`` (the request's own count of tokens drawn so far)."""

    sampler: Sampler
    step: int
    n: int
    members: tuple
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k most likely


@dataclass(frozen=True)
class Plan:
    rows: tuple = ()
    draws: tuple = ()
    stop: bool = False  # the server is done: every rank leaves its loop


class PlanWire:
    """Rank 0's plan on every rank of ``group`` in one broadcast of a fixed-size int64 buffer.

    A step of a server with ``slots`` slots and ``step_tokens`` tokens a step has at most
    ``slots`` rows, draws and members and ``step_tokens`` token ids, so a buffer sized for the
    largest plan needs no broadcast of its size first (a pickled object takes two broadcasts and
    a pickle each step). The layout: ``stop, rows, draws, ids`` counts; per row ``slot, start,
    length``; the ids; per draw ``do_sample, temperature, top_k, top_p, seed, step, n, logprobs,
    members`` (floats as their IEEE-754 bits, None as -1) and its ``(row, choice)`` pairs.
    Lossless: :meth:`decode` of :meth:`encode` is the plan."""

    HEAD, ROW, DRAW = 4, 3, 9

    def __init__(self, slots: int, step_tokens: int, group=None, device=None):
        self.size = self.HEAD + slots * (self.ROW + self.DRAW + 2) + step_tokens
        self.group = group
        self.buf = torch.zeros(self.size, dtype=torch.int64, device=device)

    def exchange(self, plan: Plan | None) -> Plan:
        """Rank 0 passes its plan, the others None; every rank returns rank 0's plan."""
        if dist.get_world_size(self.group) == 1:
            return plan
        lead = dist.get_rank(self.group) == 0
        if lead:
            words = self.words(plan)
            self.buf[:len(words)] = torch.tensor(words, dtype=torch.int64)
        dist.broadcast(self.buf, src=0, group=self.group, module="plan")
        return plan if lead else self.decode(self.buf.tolist())

    def words(self, plan: Plan) -> list:
        """``plan`` encoded; ValueError where it is larger than the wire (the scheduler's bounds
        broken: a bug, never a truncated plan)."""
        words = self.encode(plan)
        if len(words) > self.size:
            raise ValueError(f"a plan of {len(plan.rows)} rows and {sum(len(r.ids) for r in plan.rows)} "
                             f"tokens needs {len(words)} words; the wire holds {self.size}")
        return words

    @classmethod
    def encode(cls, plan: Plan) -> list:
        ids = [t for r in plan.rows for t in r.ids]
        words = [int(plan.stop), len(plan.rows), len(plan.draws), len(ids)]
        for r in plan.rows:
            words += [r.slot, r.start, len(r.ids)]
        words += ids
        for d in plan.draws:
            s = d.sampler
            words += [int(s.do_sample), _bits(float(s.temperature)), -1 if s.top_k is None else s.top_k,
                      _bits(float(s.top_p)), s.seed, d.step, d.n, -1 if d.logprobs is None else d.logprobs,
                      len(d.members)]
            words += [x for pair in d.members for x in pair]
        return words

    @classmethod
    def decode(cls, words: list) -> Plan:
        stop, nrows, ndraws, nids = words[:cls.HEAD]
        at, lengths, starts = cls.HEAD, [], []
        for _ in range(nrows):
            slot, start, length = words[at:at + cls.ROW]
            starts.append((slot, start))
            lengths.append(length)
            at += cls.ROW
        ids, at = words[at:at + nids], at + nids
        rows, used = [], 0
        for (slot, start), length in zip(starts, lengths):
            rows.append(Row(slot, start, tuple(ids[used:used + length])))
            used += length
        draws = []
        for _ in range(ndraws):
            do_sample, temperature, top_k, top_p, seed, step, n, logprobs, members = words[at:at + cls.DRAW]
            at += cls.DRAW
            pairs = tuple((words[at + 2 * i], words[at + 2 * i + 1]) for i in range(members))
            at += 2 * members
            sampler = Sampler(do_sample=bool(do_sample), temperature=_float(temperature),
                              top_k=None if top_k == -1 else top_k, top_p=_float(top_p), seed=seed)
            draws.append(Draw(sampler, step, n, pairs, None if logprobs == -1 else logprobs))
        return Plan(tuple(rows), tuple(draws), bool(stop))


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]
