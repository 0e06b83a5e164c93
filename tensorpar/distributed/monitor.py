"""The launcher's watch over its running ranks, and the errors that end a launch.

Every half second (:meth:`Monitor.check`) the launcher asks, in this order:

1. is a rank stopped or silent (:mod:`tensorpar.distributed.liveness`)? :class:`RankUnresponsiveError`;
2. are two ranks of one group in different collectives (:func:`tensorpar.distributed.flight.find_mismatch`)?
   :class:`MismatchedCollectivesError` — not asked while a rank is stopped or its heartbeat lags:
   its last recorded state may be a collective it had finished when it stopped, and the ranks
   would look out of step when one of them is only stopped;
3. has a rank waited in a collective past the launch's timeout (plus ``STUCK_GRACE_S``) for a
   peer that never came? :class:`RankStuckError` naming that peer. The rank's own timeout
   normally ends it first; this bounds a group made with a longer timeout of its own.

When a rank fails, :meth:`Monitor.explain` names the cause from where each rank was: a stopped
rank before anything else, then a mismatch, then, when the failure is a timeout, the peer the
failing rank waited for; else the failure itself, with every rank's state.
"""
from __future__ import annotations

import re

from tensorpar.distributed import flight, liveness

# A rank past its collective timeout raises by itself within milliseconds; the launcher steps in
# only when it has not, this long after.
STUCK_GRACE_S = 5.0
_TIMED_OUT = re.compile(r"time[ds]?[ -]?out", re.IGNORECASE)  # gloo, tpshm, NCCL's watchdog


class RankFailedError(RuntimeError):
    """A rank raised or died; the launch was stopped. ``rank``, ``exc_type``, ``detail`` say which and why."""

    def __init__(self, rank: int, exc_type: str, detail: str, remote_traceback: str = ""):
        self.rank, self.exc_type, self.detail, self.remote_traceback = rank, exc_type, detail, remote_traceback
        super().__init__(self._text())

    def _headline(self) -> str:
        return f"rank {self.rank} failed: {self.exc_type}: "

    def _text(self) -> str:
        tb = self.remote_traceback
        return self._headline() + self.detail + (f"\n--- traceback on rank {self.rank} ---\n{tb}" if tb else "")

    def add(self, more: str) -> None:
        """Append ``more`` to the detail (and the message)."""
        self.detail += more
        self.args = (self._text(),)


class RankStuckError(RankFailedError):
    """A rank never reached the collective its peers waited in; the launch was stopped. ``rank``: that rank."""

    def __init__(self, rank: int, detail: str):
        super().__init__(rank, "RankStuck", detail)

    def _headline(self) -> str:
        return f"rank {self.rank} is stuck: "


class RankUnresponsiveError(RankFailedError):
    """A rank was stopped (SIGSTOP, a debugger) or silent (no heartbeat); the launch was stopped."""

    def __init__(self, rank: int, detail: str):
        super().__init__(rank, "RankUnresponsive", detail)

    def _headline(self) -> str:
        return f"rank {self.rank} is unresponsive: "


class LaunchTimeoutError(TimeoutError):
    """The launch ran past its deadline; every rank was stopped."""


class MismatchedCollectivesError(RankFailedError):
    """Two ranks of one group were in different collectives; the launch was stopped."""

    def __init__(self, message: str):
        super().__init__(-1, "CollectiveMismatchError", message)

    def _headline(self) -> str:
        return ""


def _first_line(failure: RankFailedError) -> str:
    return f"rank {failure.rank} failed: {failure.exc_type}: {failure.detail.splitlines()[0][:300]}"


class Monitor:
    """One launch's ranks: ``out`` holds the results of those that returned."""

    def __init__(self, pids: list, slots: list, beats: list, timeout: float, stack_paths: list | None = None):
        self.out: dict = {}
        self._slots, self._timeout = slots, timeout
        self._watch = liveness.Watch(pids, beats, stack_paths)

    def running(self) -> list:
        return [r for r in range(len(self._slots)) if r not in self.out]

    def states(self, returned: bool = False) -> dict:
        """``{rank: its flight-recorder state}`` for the ranks that have not returned (and those
        that have, with ``returned``: their last call)."""
        ranks = range(len(self._slots)) if returned else self.running()
        return {r: flight.read(self._slots[r]) for r in ranks}

    def where(self) -> str:
        return "; where each rank was: " + "; ".join(f"rank {r} {flight.describe(s)}"
                                                     for r, s in self.states().items())

    def check(self) -> None:
        """Raise the error that ends the launch, if a rank is unresponsive, out of step or stuck."""
        running = self.running()
        stopped = self._watch.stopped(running)
        found = self._watch.unresponsive(running, stopped)
        if found is not None:
            raise RankUnresponsiveError(found[0], found[1] + self.where() + self.stacks([found[0]]))
        if stopped or self._watch.lagging(running, flight.SETTLE_S):
            return
        states = self.states()
        mismatch = flight.find_mismatch(states)
        if mismatch:
            raise MismatchedCollectivesError(mismatch)
        stuck = flight.find_stuck(self.states(returned=True), set(self.out), self._timeout + STUCK_GRACE_S)
        if stuck is not None:
            raise RankStuckError(stuck[0], f"{stuck[1]}, past the launch's timeout of {self._timeout:g}s"
                                 + self.where() + self.stacks([stuck[0]]))

    def stacks(self, ranks) -> str:
        """The Python stacks of ``ranks`` that still run (:meth:`liveness.Watch.stacks`)."""
        return self._watch.stacks(ranks)

    def explain(self, failure: RankFailedError) -> RankFailedError:
        """The error to raise for ``failure``: its cause, where the ranks' states show one."""
        stopped = {r: s for r, s in self._watch.stopped(self.running()).items() if r != failure.rank}
        if stopped:
            rank = min(stopped)
            return RankUnresponsiveError(rank, f"{self._watch.describe_stopped(rank, *stopped[rank])} "
                                         f"(then {_first_line(failure)})" + self.where())
        states = self.states()
        mismatch = flight.find_mismatch(states)
        if mismatch and failure.exc_type != "CollectiveMismatchError":
            return MismatchedCollectivesError(f"{mismatch} (then {_first_line(failure)})")
        timed_out = _TIMED_OUT.search(failure.detail)
        stuck = flight.stuck_peer(failure.rank, self.states(returned=True), set(self.out)) if timed_out else None
        if stuck is not None:
            return RankStuckError(stuck[0], f"{stuck[1]} (then {_first_line(failure)})" + self.where()
                                  + self.stacks([stuck[0]]))
        if any(s is not None for s in states.values()):
            failure.add(self.where())
        if failure.exc_type == "CollectiveMismatchError":
            return MismatchedCollectivesError(f"rank {failure.rank}: {failure.detail}")
        return failure
