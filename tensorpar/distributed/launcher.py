"""Run a function on several ranks: local spawn with fail-fast, or under torchrun.

``launch(fn, world_size, *args)`` spawns ``world_size`` processes on this machine, joins them in
one process group (rendezvous over a ``file://`` store in a private temporary directory), calls
``fn(*args)`` on every rank and returns the results in rank order. Under ``torchrun`` (env://
rendezvous, one or several nodes) the same call runs ``fn`` on this process only and gathers
every rank's result, so user code is the same in both cases.

Fail-fast: the parent watches every rank. The first rank that raises or dies (a signal, an exit,
the OOM killer) makes the parent stop all the others and raise :class:`RankFailedError` naming
that rank and its exception. Collectives carry ``timeout`` seconds, and ``deadline`` bounds the
whole launch (one hour unless given), so nothing waits forever; children also ask the kernel to
kill them if the parent dies (``PR_SET_PDEATHSIG``), so no rank outlives its launcher, and a
reaper process (:mod:`tensorpar.distributed.reaper`) stops what the ranks started if the launcher is
SIGKILLed.

The flight recorder (:mod:`tensorpar.distributed.flight`) tells the parent which collective each rank is
in: two ranks in different collectives of one group stop the launch within seconds with
:class:`~tensorpar.distributed.flight.CollectiveMismatchError` naming both calls, and every failure or
timeout says where each rank was (a rank in no collective while its peers wait is the stuck one).
The launcher's watch (:mod:`tensorpar.distributed.monitor`) also ends a launch whose rank is stopped or
silent (:class:`RankUnresponsiveError`, in seconds: :mod:`tensorpar.distributed.liveness`) or has left
its peers waiting past the timeout (:class:`RankStuckError`); every group a rank makes waits at
most ``timeout`` (:func:`~tensorpar.distributed.rendezvous.bound_group_timeouts`).

Before any process starts, :mod:`tensorpar.distributed.preflight` refuses what cannot work: a function
the ranks cannot import, a launch inside a rank, more ranks than the machine holds, bad
``TENSORPAR_*`` variables, torchrun's variables left over from another job.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import io
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
import warnings
from multiprocessing import forkserver

import torch
import torch.distributed as tdist

from tensorpar.distributed import flight, host_memory, liveness, preflight, settings
from tensorpar.distributed.monitor import (LaunchTimeoutError, MismatchedCollectivesError, Monitor, RankFailedError,
                                    RankStuckError, RankUnresponsiveError)
from tensorpar.distributed.reaper import Reaper
from tensorpar.distributed.shm_segment import sweep_stale
from tensorpar.distributed.rendezvous import (_RDZV_PREFIX, _init_group, _sweep_stale_rendezvous, init_from_env,
                                       resolve_backend, under_torchrun)

__all__ = ["launch", "RankFailedError", "RankStuckError", "RankUnresponsiveError", "LaunchTimeoutError",
           "MismatchedCollectivesError"]

_POLL_S = 0.05
_WATCH_POLL_S = 0.5
# A launch with no deadline of its own ends after an hour: a hang never outlives its launcher.
# Pass ``deadline=None`` for a job meant to run longer.
DEFAULT_DEADLINE_S = 3600.0
_DEFAULT = object()


def launch(fn, world_size: int, *args, backend: str = "auto", timeout: float = 120.0,
           deadline: float | None = _DEFAULT) -> list:
    """Run ``fn(*args)`` on ``world_size`` ranks and return their results in rank order.

    ``timeout``: seconds any one collective may wait. ``deadline``: seconds the whole launch may
    take (default ``DEFAULT_DEADLINE_S``, one hour; ``None``: no limit beyond the collectives'
    timeout). ``fn`` must be picklable (a module-level function) and return a picklable value;
    tensors come back on the CPU.
    """
    deadline = DEFAULT_DEADLINE_S if deadline is _DEFAULT else deadline
    preflight.check_launch(fn, world_size, timeout, deadline)
    if under_torchrun():
        return _run_under_torchrun(fn, world_size, args, backend, timeout)
    backend = resolve_backend(backend, world_size)
    ctx = _context()
    results = _Inbox(ctx, world_size)
    slots = [flight.new_slot(ctx) for _ in range(world_size)]
    beats = [liveness.new_beat(ctx) for _ in range(world_size)]
    _sweep_stale_rendezvous()
    with tempfile.TemporaryDirectory(prefix=f"{_RDZV_PREFIX}{os.getpid()}-") as tmp:
        store = os.path.join(tmp, "store")
        stacks = [os.path.join(tmp, f"stack{rank}") for rank in range(world_size)]
        procs = [ctx.Process(target=_rank_main, daemon=True, name=f"tensorpar-rank{rank}",
                             args=(rank, world_size, store, backend, timeout, fn, args, results.sender(rank),
                                   slots[rank], beats[rank], dict(os.environ), stacks[rank]))
                 for rank in range(world_size)]
        reaper = Reaper()  # stops the ranks' groups and removes tmp if this process dies without doing it
        reaper.folder(tmp)
        try:
            _start(procs, results, reaper)
            return _collect(procs, results, deadline, Monitor([p.pid for p in procs], slots, beats, timeout, stacks))
        finally:
            _stop_all(procs)
            sweep_stale()  # a segment a rank made and died before unlinking
            reaper.done()
            results.close()


# What the fork server imports once, so that each rank forked from it starts with them loaded
# (a rank that imports torch and transformers itself takes seconds; a fork, milliseconds).
# Modules missing here (transformers is an optional extra) are skipped by the server. The first
# makes the server ignore SIGTERM (see fork_server.py).
PRELOAD = ("tensorpar.distributed.fork_server", "torch", "torch.distributed", "tensorpar.distributed",
           "tensorpar.nn", "transformers", "transformers.modeling_utils")
_SERVER_ENV: dict = {}  # {"key": the environment the fork server started with}
# Variables no module reads at import, which change while a process runs: pytest names the
# running test in PYTEST_CURRENT_TEST (a restart per test would cost each test the imports).
_NOT_READ_AT_IMPORT = ("PYTEST_CURRENT_TEST",)


def _context():
    """multiprocessing's ``forkserver`` context (the standard library's fork server, started once
    per launching process, with :data:`PRELOAD` imported), or ``spawn`` where the platform has no
    fork server or ``TENSORPAR_START_METHOD=spawn`` asks. The server is restarted when the
    environment differs from the one it started with (outside ``TENSORPAR_*``, which are read
    when used, and :data:`_NOT_READ_AT_IMPORT`): what a module read from it at import
    (``HF_HUB_OFFLINE``, thread counts) must be what the launcher has now. Each rank still gets the launcher's whole environment at start."""
    if settings.start_method() == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    key = sorted((k, v) for k, v in os.environ.items()
                 if not k.startswith("TENSORPAR_") and k not in _NOT_READ_AT_IMPORT)
    if _SERVER_ENV.get("key") not in (None, key):
        forkserver._forkserver._stop()  # the standard library's own way to stop its server
    if _SERVER_ENV.get("key") != key:
        ctx.set_forkserver_preload(list(PRELOAD))
        with _single_threaded():  # the server forks every rank: no thread pool of its own to copy
            forkserver.ensure_running()
        _SERVER_ENV["key"] = key
    return ctx


@contextlib.contextmanager
def _single_threaded():
    """While the fork server starts (it inherits this environment): one OpenMP / BLAS thread, so
    that importing numpy and torch there starts no worker threads, which a fork would not copy."""
    names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update({k: "1" for k in names})
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _start(procs, results, reaper) -> None:
    for rank, p in enumerate(procs):
        try:
            p.start()
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            if rank:  # rank 0 took the same arguments: not a pickling problem
                raise
            # spawn pickles fn and args before it starts a process: nothing runs yet
            raise ValueError(f"the arguments of launch() cannot be sent to the spawned ranks "
                             f"({str(exc).splitlines()[0][:200]}); pass picklable values") from None
        results.started(rank)
        reaper.add(p.pid)


class _Inbox:
    """The ranks' results, one pipe per rank (no named semaphore, unlike ``multiprocessing.Queue``:
    nothing left in /dev/shm and no "leaked semaphore" warning when this process is SIGKILLed, and
    no reader lock for a Ctrl-C to interrupt). ``get`` takes one message, like ``Queue.get``."""

    def __init__(self, ctx, world_size: int):
        pairs = [ctx.Pipe(duplex=False) for _ in range(world_size)]  # (receive end, send end)
        self._receivers = [r for r, _ in pairs]
        self._senders = [w for _, w in pairs]

    def sender(self, rank: int):
        return self._senders[rank]

    def started(self, rank: int) -> None:
        self._senders[rank].close()  # the rank holds its own copy: a rank gone means EOF here

    def get(self, timeout: float):
        """``(rank, status, payload)``; ``queue.Empty`` if no rank sends one within ``timeout``."""
        open_ = [r for r in self._receivers if not r.closed]
        if not open_:  # every rank has sent or gone: the caller looks at exit codes
            time.sleep(timeout)
            raise queue.Empty
        for conn in mp.connection.wait(open_, timeout):
            try:
                return conn.recv()
            except (EOFError, OSError):  # the rank exited (its exit code says how); stop watching it
                conn.close()
        raise queue.Empty

    def close(self) -> None:
        for conn in (*self._receivers, *self._senders):
            conn.close()


def _collect(procs, results, deadline, monitor: Monitor | None = None) -> list:
    out = monitor.out if monitor is not None else {}
    t_end = (time.monotonic() + deadline) if deadline else None
    t_watch = time.monotonic()
    while len(out) < len(procs):
        failure = _receive(results, out, wait=_POLL_S)
        dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
        if failure or dead:
            # A rank that exited may just have sent its result: only a real failure stops the launch.
            failure = _root_cause(procs, results, out, failure)
            if failure is not None:
                raise monitor.explain(failure) if monitor is not None else failure
        if monitor is not None and time.monotonic() > t_watch:
            t_watch = time.monotonic() + _WATCH_POLL_S
            monitor.check()
        if t_end is not None and time.monotonic() > t_end:
            missing = [r for r in range(len(procs)) if r not in out]
            raise LaunchTimeoutError(f"launch passed its deadline of {deadline:g}s; ranks {missing} "
                                     f"had not finished and were stopped"
                                     + (monitor.where() + monitor.stacks(missing) if monitor else ""))
    return [out[r] for r in range(len(procs))]


def _receive(results, out: dict, wait: float) -> "RankFailedError | None":
    """Take one message if any arrives within ``wait``; returns a rank's failure, if it was one."""
    try:
        rank, status, payload = results.get(timeout=wait)
    except queue.Empty:
        return None
    if status == "error":
        return RankFailedError(rank, *payload)
    out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return None


# gloo/NCCL messages of a rank that only saw its peer go away: a consequence, not the cause.
_PEER_LOSS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "timed out", "Timeout",
              "Timed out")


def _root_cause(procs, results, out, first) -> "RankFailedError | None":
    """The failure to report: a rank that died without a word, else one that raised by itself.

    When one rank fails, its peers fail too (their collectives lose the connection). Wait a
    moment for every message, then prefer the cause over its echoes.
    """
    failures = [first] if first else []
    t_grace = time.monotonic() + 1.0
    while time.monotonic() < t_grace:
        f = _receive(results, out, wait=_POLL_S)
        if f:
            failures.append(f)
    reported = {f.rank for f in failures}
    for rank, p in enumerate(procs):
        if rank not in out and rank not in reported and p.exitcode is not None:
            return _died(rank, p)
    own = [f for f in failures if not any(s in f.detail for s in _PEER_LOSS)]
    return (own or failures)[0] if failures else None


def _died(rank: int, proc) -> RankFailedError:
    code = proc.exitcode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    hint = ("; it may have failed while starting (spawned ranks re-import the main module: guard a "
            "script's entry point with `if __name__ == '__main__':`, and pass a module-level function); "
            "its stderr says more") if code > 0 else ""
    return RankFailedError(rank, "RankDied", f"process {proc.pid} {how} before returning a result{hint}")


def _stop_all(procs) -> None:
    """Stop every rank and whatever it started: each rank leads its own process group."""
    procs = [p for p in procs if p.pid is not None]  # a start that failed left later ranks unstarted
    for p in procs:
        _signal_group(p, signal.SIGTERM)
        _signal_group(p, signal.SIGCONT)  # a stopped rank acts on SIGTERM only once continued
    for p in procs:
        p.join(timeout=5)
        _signal_group(p, signal.SIGKILL)  # the rank if it ignored SIGTERM, and any child left behind
        p.join(timeout=5)
        if p.is_alive():  # not dead 5 s after SIGKILL: in uninterruptible sleep (I/O on a loaded machine)
            warnings.warn(f"rank process {p.pid} is still alive 5 s after SIGKILL; not waiting for it "
                          f"(the kernel ends it when its I/O completes)", RuntimeWarning)
            # multiprocessing's exit handler joins every child it knows without a timeout: a rank
            # the kernel has not let die yet must not hold this process's exit forever
            mp.process._children.discard(p)


def _signal_group(p, sig) -> None:
    try:
        os.killpg(p.pid, sig)  # the rank's group: the rank and the processes it started
    except (ProcessLookupError, PermissionError):
        if p.is_alive():  # the rank had not made its group yet
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the parent's terminate/kill still stops this rank


def _rank_main(rank, world_size, store, backend, timeout, fn, args, results, slot=None, beat=None,
               environ=None, stack_path=None) -> None:
    if environ is not None:  # the launcher's environment now, not the fork server's when it started
        os.environ.clear()
        os.environ.update(environ)
    # as torchrun sets them: libraries read a process's place from these (Hugging Face's tp_plan)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle: it stops every rank
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the fork server ignores it (fork_server.py); a rank does not
    os.setpgid(0, 0)  # a group of its own: the launcher stops the rank with whatever it starts
    if slot is not None:
        flight.install(slot)
    if beat is not None:
        liveness.start_heartbeat(beat)
    if stack_path is not None:
        liveness.dump_stacks_on_signal(stack_path)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    host_memory.keep_freed_memory()
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        _init_group(backend, store, rank, world_size, datetime.timedelta(seconds=timeout))
        value = fn(*args)
        buf = io.BytesIO()
        torch.save(_to_cpu(value), buf)
        results.send((rank, "ok", buf.getvalue()))
    except BaseException as exc:  # report everything, including KeyboardInterrupt/SystemExit
        results.send((rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))
        raise SystemExit(1)
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _run_under_torchrun(fn, world_size, args, backend, timeout) -> list:
    init_from_env(backend, timeout)  # preflight checked WORLD_SIZE and who set the variables
    value = _to_cpu(fn(*args))
    gathered = [None] * world_size
    tdist.all_gather_object(gathered, value)
    return gathered
