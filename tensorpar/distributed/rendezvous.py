"""How ranks join one process group: locally over a file store (``launch``), or as torchrun
describes it (``init_from_env``); the backend for a world size; and leftovers of launchers that
died (rendezvous folders) or of earlier torchrun jobs (environment variables), found at once."""
from __future__ import annotations

import atexit
import datetime
import os
import shutil
import tempfile
import warnings

import torch
import torch.distributed as tdist

from tensorpar.distributed import host_memory, settings, shm
from tensorpar.distributed.reaper import sweep_dead

BACKENDS = ("auto", "shm", "gloo", "nccl")


def resolve_backend(backend: str, world_size: int) -> str:
    """The torch.distributed backend for ``backend``: ``"auto"`` is NCCL with a GPU per rank, else
    :mod:`tensorpar.distributed.shm` (shared memory between the ranks of one host, gloo between hosts,
    chosen per group); ``"shm"`` that backend; ``"gloo"`` gloo only."""
    if backend == shm.BACKEND:  # already resolved
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not supported; valid: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else shm.BACKEND
    if backend == "shm":
        return shm.BACKEND
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend 'nccl' needs {world_size} GPUs, this machine has "
                         f"{torch.cuda.device_count()}; use backend='gloo'")
    return backend

def under_torchrun() -> bool:
    """Whether torchrun's variables describe a job this process belongs to (whether a launch
    joins it rather than starting local ranks); ``TENSORPAR_RENDEZVOUS=local`` says they do not."""
    return all(k in os.environ for k in _TORCHRUN_VARS) and settings.rendezvous() != "local"

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

def check_torchrun_env(world_size: int) -> None:
    """Before any rendezvous, for a launch of ``world_size`` ranks :func:`under_torchrun`: the
    variables are whole numbers, ``WORLD_SIZE`` is the launch's, and torchrun's agent set them
    (``TORCHELASTIC_RUN_ID``) or ``TENSORPAR_RENDEZVOUS=env`` says to join them anyway. Variables
    left over from an earlier job are found here at once, not after a rendezvous timed out."""
    env_world, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
    _env_int("MASTER_PORT")
    if env_world != world_size:
        raise ValueError(f"launch(world_size={world_size}) under torchrun with WORLD_SIZE={env_world}; "
                         f"pass world_size={env_world}{_LEFTOVER}")
    if not 0 <= rank < env_world:
        raise ValueError(f"RANK={rank} is not below WORLD_SIZE={env_world}{_LEFTOVER}")
    if "TORCHELASTIC_RUN_ID" not in os.environ and settings.rendezvous() != "env":
        raise ValueError("RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set, but torchrun did not start this "
                         "process (no TORCHELASTIC_RUN_ID): if they are left over from an earlier job, unset them "
                         "(`unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT`) or set TENSORPAR_RENDEZVOUS=local to "
                         "start local ranks; to join processes started without torchrun, set "
                         "TENSORPAR_RENDEZVOUS=env")

def init_from_env(backend: str = "auto", timeout: float = 120.0) -> tuple[int, int]:
    """Join the process group torchrun describes (env://); returns ``(rank, world_size)``."""
    world_size, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is not below WORLD_SIZE={world_size}{_LEFTOVER}")
    if not tdist.is_initialized():
        host_memory.keep_freed_memory()
        backend = resolve_backend(backend, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        store = None
        if "TORCHELASTIC_RUN_ID" not in os.environ:  # not torchrun's agent: no store is waiting for us
            store = _rendezvous(rank, world_size)
        tdist.init_process_group(backend, init_method=None if store else "env://", store=store,
                                 rank=rank if store else -1, world_size=world_size if store else -1,
                                 timeout=datetime.timedelta(seconds=timeout))
        bound_group_timeouts(datetime.timedelta(seconds=timeout))  # before any sub-group is made
        # A process that exits with its group alive can abort in the backend's teardown
        # ("terminate called without an active exception"): leave the group on the way out.
        atexit.register(_destroy_if_initialized)
    return tdist.get_rank(), tdist.get_world_size()

_LEFTOVER = ("; RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT make tensorpar join a torchrun job. If they "
             "are left over from an earlier one, unset them (`unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT`) "
             "or set TENSORPAR_RENDEZVOUS=local to launch local ranks")

def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r} is not an integer{_LEFTOVER}") from None

def _rendezvous(rank: int, world_size: int):
    """The TCP store at MASTER_ADDR:MASTER_PORT, every rank joined within
    ``TENSORPAR_RENDEZVOUS_TIMEOUT`` seconds (default 30): long enough for processes started by
    hand, short enough that a peer that never starts is reported instead of waited on for
    ``timeout``."""
    addr, port, wait_s = os.environ["MASTER_ADDR"], _env_int("MASTER_PORT"), settings.rendezvous_timeout()
    try:
        return tdist.TCPStore(addr, port, world_size, is_master=rank == 0, wait_for_workers=True,
                              timeout=datetime.timedelta(seconds=wait_s))
    except (RuntimeError, TimeoutError, OSError) as exc:
        raise ValueError(f"rank {rank} of {world_size}: no rendezvous at {addr}:{port} within {wait_s:g}s "
                         f"({str(exc).splitlines()[0][:120]}){_LEFTOVER}; or set "
                         f"TENSORPAR_RENDEZVOUS_TIMEOUT to wait longer") from None

def bound_group_timeouts(timeout: datetime.timedelta) -> None:
    """Make ``timeout`` the wait of every group this process makes without a timeout of its own.

    Only the world group is given the launch's timeout explicitly; torch gives the others
    (``new_group``, ``init_device_mesh``'s dimensions, FSDP's and DCP's groups, tensorpar's
    :func:`~tensorpar.distributed.groups.new_group`) its process-wide default, 30 minutes: a rank whose
    sub-group peer never came waited half an hour. Set in a rank's own process, before any group."""
    import torch.distributed.distributed_c10d as c10d
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout

def _destroy_if_initialized() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()

_RDZV_PREFIX = "tensorpar-rdzv-"

def _sweep_stale_rendezvous() -> None:
    """Remove the rendezvous folders of launchers that died without cleaning up (SIGKILL): each
    folder's name carries its launcher's pid; a folder whose pid is gone is stale."""
    sweep_dead(tempfile.gettempdir(), _RDZV_PREFIX, lambda path: shutil.rmtree(path, ignore_errors=True))

_INIT_ATTEMPTS = 3

def _init_group(backend, store_path, rank, world_size, timeout) -> None:
    """Join the process group over the file store; retry gloo's connection mesh if it flakes.

    Under load, gloo's TCP mesh setup on loopback sometimes fails with "Connection closed by
    peer" in ``connectFullMesh`` (about 1 launch in 20 on this 2-core machine, measured; also a
    known flake in PyTorch's own gloo tests). The ranks then agree through the store, which does
    not depend on that mesh: each posts whether its attempt succeeded, and unless all did,
    every rank leaves the group and all try again under a fresh key prefix. A peer of the rank
    that failed may instead be left waiting in the store for a key that rank never wrote, and
    fail later with a plain "Wait timeout": it retries too when a peer has already posted that
    its attempt failed (the same flake, seen from the other side). Any other failure, with no
    peer asking to retry, is raised as it is (a peer that never came). A last barrier keeps any
    rank from returning while a peer is still connecting.
    """
    bound_group_timeouts(timeout)
    base = tdist.FileStore(store_path, world_size)
    base.set_timeout(timeout)
    for attempt in range(_INIT_ATTEMPTS):
        error = None
        try:
            tdist.init_process_group(backend, store=tdist.PrefixStore(f"attempt{attempt}/", base),
                                     rank=rank, world_size=world_size, timeout=timeout)
        except RuntimeError as exc:
            flake = "connectFullMesh" in str(exc) or any(
                base.check([f"status{attempt}/{r}"]) and base.get(f"status{attempt}/{r}") == b"retry"
                for r in range(world_size) if r != rank)
            if not flake or attempt == _INIT_ATTEMPTS - 1:
                raise
            error = exc
            _destroy_if_initialized()
            # the failed init numbered a group that was never made ("0" prefixes its store keys);
            # destroy_process_group resets that count, a failed init does not: reset it as destroy
            # would, or this rank's next attempt waits under "1/" for peers writing under "0/"
            import torch.distributed.distributed_c10d as c10d
            c10d._world.group_count = 0
            warnings.warn(f"rank {rank}: gloo's connection setup failed ({str(exc).splitlines()[0][:200]}); "
                          f"every rank retries (attempt {attempt + 2} of {_INIT_ATTEMPTS})", RuntimeWarning)
        base.set(f"status{attempt}/{rank}", "ok" if error is None else "retry")
        # a peer may still be in its own attempt, waiting out the timeout for this rank's key
        base.wait([f"status{attempt}/{r}" for r in range(world_size)], 2 * timeout)
        if all(base.get(f"status{attempt}/{r}") == b"ok" for r in range(world_size)):
            tdist.barrier()
            return
        _destroy_if_initialized()
    raise RuntimeError(f"the process group could not be formed in {_INIT_ATTEMPTS} attempts")
