"""Rank 0's continuous-batching scheduler: which rows each engine step runs.

Requests wait in a bounded queue (:class:`QueueFull` past it: the server answers 429) and join
the running batch between steps, first come first served, as soon as a slot of the KV cache is
free for each of their choices; a choice leaves when it finishes (its job says so), its slot
free for the next step. Each step runs every running choice's next token first (decode rows),
then spends what is left of ``step_tokens`` on prompt chunks, oldest request first (chunked
prefill): a long prompt is prefilled over several steps, and the streams already running never
wait for more than one step's budget of prompt tokens. A cancelled request (the client went
away) gives its slots back at the next step.

A job is the API's side of a request (:class:`tensorpar.jobs.serve_job.Job`): ``prompt``, ``n``,
``sampler``, ``logprobs``, ``cancelled``, and ``deliver({choice: token}, {choice: Logprobs} or
None) -> finished choices``, called after each step that drew its tokens.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from tensorpar.models.engine_plan import Draw, Plan, Row


class QueueFull(Exception):
    """More requests waiting than the queue holds."""


@dataclass
class _Running:
    job: object
    slots: list  # one per choice
    live: set  # choices still drawing
    prefilled: int = 0  # prompt tokens in the cache
    steps: int = 0  # tokens drawn per choice
    last: dict = field(default_factory=dict)  # choice -> its last token (the next decode row's input)


class Scheduler:
    """Thread-safe: the HTTP side calls :meth:`submit` and :meth:`cancel`; the engine loop calls
    :meth:`next_plan` and :meth:`finish`, one after the other."""

    def __init__(self, slots: int, step_tokens: int, max_queue: int):
        if step_tokens < slots:
            raise ValueError(f"max tokens in flight ({step_tokens}) must be at least the batch size ({slots}): "
                             f"every running stream takes one token a step")
        self.slots, self.step_tokens, self.max_queue = slots, step_tokens, max_queue
        self._free = list(range(slots))
        self._waiting: deque = deque()
        self._running: list[_Running] = []
        self._drawn: list = []  # the last plan's (request, draw) pairs, in its order
        self._cv = threading.Condition()

    # ---- the HTTP side ---------------------------------------------------------------------------

    def submit(self, job) -> None:
        with self._cv:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting, the most this server queues "
                                f"(--max-queue {self.max_queue}); retry later")
            self._waiting.append(job)
            self._cv.notify()

    def cancel(self, job) -> None:
        """Wakes the loop; the job's ``cancelled`` says the rest."""
        with self._cv:
            self._cv.notify()

    # ---- the engine loop ---------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running

    def next_plan(self, timeout: float) -> Plan:
        """The next step's plan; waits up to ``timeout`` s for work (then an empty plan)."""
        with self._cv:
            if self.idle:
                self._cv.wait(timeout)
            self._drop_cancelled()
            self._admit()
        rows, draws = [], []
        self._drawn = []
        budget = self.step_tokens - self._decode(rows, draws)
        self._prefill(rows, draws, budget)
        return Plan(tuple(rows), tuple(draws))

    def finish(self, tokens: list[list[int]], logprobs: list | None = None) -> None:
        """The step's tokens (per draw, per member) and log-probabilities (per draw: None, or per
        member), handed to their jobs; finished choices leave."""
        for (run, draw), got, lps in zip(self._drawn, tokens, logprobs or [None] * len(tokens), strict=True):
            run.steps += 1
            by_choice = {c: t for (_, c), t in zip(draw.members, got)}
            run.last.update(by_choice)
            by_lp = None if lps is None else {c: lp for (_, c), lp in zip(draw.members, lps)}
            for c in run.job.deliver(by_choice, by_lp):
                self._release(run, c)

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._waiting if j.cancelled]:
            self._waiting.remove(job)
        for run in [r for r in self._running if r.job.cancelled]:
            for c in list(run.live):
                self._release(run, c)

    def _admit(self) -> None:
        while self._waiting and len(self._free) >= self._waiting[0].n:
            job = self._waiting.popleft()
            self._free.sort()  # the lowest slots first: the decode rows' slots stay packed at the bottom
            slots, self._free = self._free[:job.n], self._free[job.n:]
            self._running.append(_Running(job, slots, set(range(job.n))))

    def _release(self, run: _Running, choice: int) -> None:
        if choice in run.live:
            run.live.discard(choice)
            self._free.append(run.slots[choice])
        if not run.live and run in self._running:
            self._running.remove(run)

    def _decode(self, rows: list, draws: list) -> int:
        """One row per live choice of every request past its prompt; returns the tokens spent."""
        spent = 0
        for run in self._running:
            if run.steps == 0:
                continue
            members = []
            for c in sorted(run.live):
                members.append((len(rows), c))
                rows.append(Row(run.slots[c], len(run.job.prompt) + run.steps - 1, (run.last[c],)))
            spent += len(members)
            self._add_draw(run, members, draws)
        return spent

    def _prefill(self, rows: list, draws: list, budget: int) -> None:
        for run in self._running:
            prompt, n = run.job.prompt, run.job.n
            if run.steps or budget < n:
                continue
            chunk = min(len(prompt) - run.prefilled, budget // n)
            members = []
            for c in range(n):
                members.append((len(rows), c))
                rows.append(Row(run.slots[c], run.prefilled, tuple(prompt[run.prefilled:run.prefilled + chunk])))
            run.prefilled += chunk
            budget -= chunk * n
            if run.prefilled == len(prompt):  # the prompt's last position gives the first token
                self._add_draw(run, members, draws)

    def _add_draw(self, run: _Running, members: list, draws: list) -> None:
        draw = Draw(run.job.sampler, run.steps, run.job.n, tuple(members), run.job.logprobs)
        draws.append(draw)
        self._drawn.append((run, draw))
