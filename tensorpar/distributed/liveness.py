"""Whether each rank of a launch still runs: a rank stopped or silent ends the launch, named, in
seconds, instead of leaving its peers waiting in a collective until its timeout.

The launcher reads two signs every half second, for every rank that has not returned:

- the rank's state in ``/proc/<pid>/stat``: ``T`` (stopped by SIGSTOP, or by SIGTSTP/SIGTTIN/SIGTTOU)
  or ``t`` (stopped by a debugger or tracer). A stopped rank is named once it has been seen
  stopped for ``STOPPED_S``: a profiler that pauses a rank to sample its stack (py-spy) pauses it
  for milliseconds.
- a heartbeat: a daemon thread of each rank writes ``time.monotonic()`` (one clock for every
  process of the machine) into a shared double every ``BEAT_S``. A rank whose heartbeat is older
  than ``SILENT_S`` is named too: it is not stopped, but its interpreter does not run (frozen by a
  cgroup freezer such as ``docker pause``, or a thread holding Python's GIL in native code for that
  long). The heartbeat thread sleeps between beats and takes the GIL for microseconds; collectives
  release the GIL while they wait, so a rank waiting for its peers still beats.

``TENSORPAR_UNRESPONSIVE_TIMEOUT`` (seconds) replaces both bounds, e.g. to attach a debugger to a
rank. Linux only: where ``/proc`` is missing, the heartbeat alone is read.

When the launch ends because a rank is silent or stuck, or passes its deadline, the error carries
that rank's Python stack: each rank registers :mod:`faulthandler` on :data:`STACK_SIGNAL` (a
real-time signal, ``SIGRTMIN + 6``: ``SIGUSR1`` and ``SIGUSR2`` are the ones job schedulers and
user code take, e.g. a checkpoint before a requeue), which writes every thread's stack from the
signal handler itself, without the GIL, so a rank whose GIL a native call holds still answers.
The launcher signals every rank it asks about, then reads their files back (:meth:`Watch.stacks`,
up to ``STACK_WAIT_S`` in all). A rank that installs its own handler for that signal gives no stack.
"""
from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import threading
import time

from tensorpar.distributed import settings

BEAT_S = 1.0
STOPPED_S = 5.0
SILENT_S = 30.0
STACK_SIGNAL = signal.SIGRTMIN + 6
STACK_WAIT_S = 2.0  # how long the launcher waits for the stacks of the ranks it signalled
STACK_SETTLED_S = 0.3  # a dump is whole once its size has held this long (the main thread comes last)
_STOPPED = {"T": "stopped by a signal: SIGSTOP, or SIGTSTP/SIGTTIN/SIGTTOU",
            "t": "stopped by a debugger or tracer"}


def new_beat(ctx):
    """The shared heartbeat of one rank, made by the launcher before it spawns the rank (0: none yet)."""
    return ctx.RawValue(ctypes.c_double, 0.0)


def start_heartbeat(beat) -> None:
    """Called in each spawned rank: beat until the process ends."""
    threading.Thread(target=_beat, args=(beat,), name="tensorpar-heartbeat", daemon=True).start()


def _beat(beat) -> None:
    while True:
        beat.value = time.monotonic()  # one aligned 8-byte store: the launcher never reads half of it
        time.sleep(BEAT_S)


def dump_stacks_on_signal(path: str) -> None:
    """Called in each spawned rank: on :data:`STACK_SIGNAL`, write every thread's Python stack to
    ``path`` (faulthandler keeps the file open until the rank ends). The file takes its name once
    the handler is in place: the launcher signals only a rank whose file exists, since the
    signal's default action would end the rank."""
    staging = path + ".new"
    faulthandler.register(STACK_SIGNAL, file=open(staging, "w"), all_threads=True)  # noqa: SIM115
    os.replace(staging, path)


def read_stacks(targets: dict, wait: float = STACK_WAIT_S) -> dict:
    """``{key: (pid, path)}`` -> ``{key: text}``: every process signalled for its stacks first, then
    what each wrote to its ``path`` once it settled ("" where nothing came within ``wait`` seconds:
    a stopped process, or one that replaced the handler; or where it had no file yet)."""
    start = {}
    for key, (pid, path) in targets.items():
        try:
            size = os.path.getsize(path)
            os.kill(pid, STACK_SIGNAL)
        except OSError:
            continue
        start[key] = size
    sizes, since = dict(start), {key: time.monotonic() for key in start}
    t_end = time.monotonic() + wait
    while time.monotonic() < t_end and any(
            sizes[k] == start[k] or time.monotonic() - since[k] < STACK_SETTLED_S for k in start):
        time.sleep(0.05)
        for k in start:
            new = os.path.getsize(targets[k][1])
            if new != sizes[k]:
                sizes[k], since[k] = new, time.monotonic()
    out = dict.fromkeys(targets, "")
    for key, size in start.items():
        with open(targets[key][1], "rb") as f:
            f.seek(size)
            out[key] = f.read().decode(errors="replace").strip()
    return out


def proc_state(pid: int) -> str | None:
    """The one-letter state of process ``pid`` (``R``, ``S``, ``D``, ``T``, ``t``, ``Z``...), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()  # the name before ")" may hold spaces
    except (OSError, IndexError):
        return None


class Watch:
    """One launch's view of its ranks' liveness: ``unresponsive`` names a rank stopped for
    ``stopped_s`` or silent for ``silent_s``; ``stopped`` lists the ranks stopped now."""

    def __init__(self, pids: list, beats: list, stack_paths: list | None = None):
        self._pids, self._beats, self._stack_paths = pids, beats, stack_paths
        bound = settings.unresponsive_timeout()
        self.stopped_s = bound if bound is not None else STOPPED_S
        self.silent_s = bound if bound is not None else SILENT_S
        self._since: dict = {}  # rank -> when it was first seen stopped

    def stopped(self, ranks) -> dict:
        """``{rank: (state, seconds seen stopped)}`` of the ranks among ``ranks`` stopped now."""
        now, out = time.monotonic(), {}
        for r in ranks:
            state = proc_state(self._pids[r])
            if state in _STOPPED:
                out[r] = (state, now - self._since.setdefault(r, now))
            else:
                self._since.pop(r, None)
        return out

    def unresponsive(self, ranks, stopped: dict) -> tuple[int, str] | None:
        """``(rank, why)`` for the first rank of ``ranks`` past its bound, else None; ``stopped``:
        what :meth:`stopped` just returned."""
        for r, (state, seconds) in stopped.items():
            if seconds >= self.stopped_s:
                return r, self.describe_stopped(r, state, seconds) + self._hint()
        now = time.monotonic()
        for r in ranks:
            beat = self._beats[r].value
            if beat and now - beat >= self.silent_s:
                return r, (f"process {self._pids[r]} has not run for {now - beat:.1f}s (no heartbeat; /proc state "
                           f"{proc_state(self._pids[r])!r}): frozen, or a thread holds Python's GIL in native "
                           f"code{self._hint()}")
        return None

    def lagging(self, ranks, seconds: float) -> list:
        """The ranks among ``ranks`` whose last heartbeat is ``seconds`` old or older."""
        now = time.monotonic()
        return [r for r in ranks if self._beats[r].value and now - self._beats[r].value >= seconds]

    def stacks(self, ranks) -> str:
        """The Python stacks of ``ranks`` (those not stopped: a stopped rank cannot answer), as text
        to append to an error; "" where none came."""
        if not self._stack_paths:
            return ""
        states = {r: proc_state(self._pids[r]) for r in ranks}
        texts = read_stacks({r: (self._pids[r], self._stack_paths[r]) for r in ranks if states[r] not in _STOPPED})
        return "".join(f"\n--- Python stack of rank {r} (process {self._pids[r]}, /proc state {states[r]!r}) ---\n{text}"
                       for r, text in texts.items() if text)

    def describe_stopped(self, rank: int, state: str, seconds: float) -> str:
        return (f"process {self._pids[rank]} is stopped (/proc state {state!r}, {_STOPPED[state]}) and has "
                f"been for {seconds:.1f}s while its peers wait")

    def _hint(self) -> str:
        return (f"; the launch ends a rank stopped for {self.stopped_s:g}s or silent for {self.silent_s:g}s "
                f"(TENSORPAR_UNRESPONSIVE_TIMEOUT sets both, e.g. to attach a debugger)")
