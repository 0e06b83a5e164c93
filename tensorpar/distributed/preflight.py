"""What a launch refuses before any process starts: each a one-line ``ValueError`` naming the
value and what is valid.

- ``fn`` the spawned ranks cannot import: a lambda, a local function or closure, anything that
  does not pickle by reference, a function of an interactive ``__main__`` (no file to re-import);
- a launch from inside a rank (a rank cannot start ranks of its own);
- a world size that is not a positive integer, or more local ranks than the machine can hold
  (:func:`check_local_world`);
- a bad ``TENSORPAR_*`` variable (:mod:`tensorpar.distributed.settings`), and torchrun's variables left
  over from another job (:func:`tensorpar.distributed.rendezvous.check_torchrun_env`).

:func:`check_world` is everything about the world, for a command (``tensorpar train``) that wants
the refusal before its own preparation.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
from multiprocessing.reduction import ForkingPickler

from tensorpar.distributed import settings
from tensorpar.distributed.rendezvous import check_torchrun_env, under_torchrun

# Ranks per CPU core a machine is allowed: each rank runs one compute thread (OMP_NUM_THREADS=1);
# at 4 per core a rank still gets a quarter of a core, enough to answer its peers and its
# heartbeat. The suite runs 4 ranks on 2 cores.
RANKS_PER_CPU = 4
# The memory a rank takes before any model: measured 146 MiB private (anonymous) and 83 MiB of
# shared library pages (RSS 230 MiB) on a rank that imported torch 2.13 and joined a group.
RANK_MIB = 150


def check_launch(fn, world_size, timeout, deadline) -> None:
    """Everything :func:`~tensorpar.distributed.launch` refuses before it starts a process."""
    check_not_in_rank()
    check_fn(fn)
    if not timeout > 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    if deadline is not None and not deadline > 0:
        raise ValueError(f"deadline must be positive seconds or None, got {deadline!r}")
    check_world(world_size)


def check_world(world_size) -> None:
    """The world of a launch of ``world_size`` ranks: the ``TENSORPAR_*`` variables, then
    torchrun's variables if they describe a job, else this machine's room for local ranks."""
    _check_positive(world_size)
    settings.check_all()
    if under_torchrun():
        check_torchrun_env(world_size)
    else:
        check_local_world(world_size)


def check_local_world(n) -> None:
    """``n`` local ranks fit this machine: at most ``RANKS_PER_CPU`` per usable CPU core and
    ``RANK_MIB`` each within the available memory, unless ``TENSORPAR_MAX_LOCAL_RANKS`` sets
    the limit instead."""
    _check_positive(n)
    override = settings.max_local_ranks()
    if override is not None:
        if n > override:
            raise ValueError(f"world size {n} is more local ranks than TENSORPAR_MAX_LOCAL_RANKS={override} allows")
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    by_cpu, free_mib = RANKS_PER_CPU * cpus, _available_mib()
    by_memory = free_mib // RANK_MIB if free_mib is not None else None
    if n <= by_cpu and (by_memory is None or n <= by_memory):
        return
    memory = f", {free_mib / 1024:.1f} GiB of available memory at most {by_memory} ({RANK_MIB} MiB a rank)" \
        if by_memory is not None else ""
    raise ValueError(f"world size {n} is more local ranks than this machine can hold: {cpus} CPU cores allow at "
                     f"most {by_cpu} ({RANKS_PER_CPU} a core){memory}; use fewer ranks, or set "
                     f"TENSORPAR_MAX_LOCAL_RANKS={n} to start them anyway")


def _check_positive(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"world_size must be a positive integer, got {n!r}")


def _available_mib() -> int | None:
    """MemAvailable, or less where this process's cgroup allows less; None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) // 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    limit = _cgroup_room_mib()
    return min(free, limit) if limit is not None else free


def _cgroup_room_mib(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """What this process's cgroup still allows: its memory limit less what it holds, file pages
    the kernel can drop (inactive_file) not counted; None without a limit. cgroup v2 and v1."""
    try:
        with open(proc) as f:
            lines = [line.strip().split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in (parts for parts in lines if len(parts) == 3):
        if not controllers:  # v2: one hierarchy
            files = (f"{root}{path.rstrip('/')}", "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            files = (f"{root}/memory{path.rstrip('/')}", "memory.limit_in_bytes", "memory.usage_in_bytes",
                     "total_inactive_file")
        else:
            continue
        room = _room(*files)
        if room is not None:
            return room
    return None


def _room(base: str, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        with open(f"{base}/{limit_file}") as f:
            limit = f.read().strip()
        with open(f"{base}/{usage_file}") as f:
            used = int(f.read())
        with open(f"{base}/memory.stat") as f:
            stat = dict(line.split() for line in f if len(line.split()) == 2)
    except (OSError, ValueError):
        return None
    if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as a page-rounded 2**63
        return None
    return max(0, int(limit) - used + int(stat.get(inactive_key, 0))) // (1 << 20)


def check_not_in_rank() -> None:
    """A rank cannot launch ranks of its own (its process is a daemon, and the world is taken)."""
    name = mp.current_process().name
    if name.startswith("tensorpar-rank"):
        raise ValueError(f"launch() called inside {name.replace('tensorpar-', '')} of another launch: a rank cannot "
                         f"start ranks of its own; launch once, from the main process, with every rank the job "
                         f"needs (dist.new_group makes sub-groups of them)")


def check_fn(fn) -> None:
    """``fn`` reaches the spawned ranks by reference (its module and name): they import it."""
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    hint = ("; pass a function defined at the top level of a module the ranks can import "
            "(not a lambda, a local function or a closure)")
    if "<lambda>" in name or "<locals>" in name:
        kind = "a lambda" if "<lambda>" in name else "a local function or closure"
        raise ValueError(f"fn {name!r} is {kind}: the spawned ranks cannot import it{hint}")
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(f"fn {name!r} is defined in an interactive session or `python -c` (its __main__ has no "
                         f"file): the spawned ranks cannot import it; define it in a module file and import it")
    try:
        ForkingPickler.dumps(fn)
    except Exception as exc:  # noqa: BLE001 - whatever pickling raises, the ranks could not get fn
        raise ValueError(f"fn {name!r} cannot be sent to the spawned ranks ({str(exc).splitlines()[0][:200]})"
                         f"{hint}") from None
