"""How ranks join one process group: locally over a file store (``launch``), or as torchrun
describes it (``init_from_env``); the backend for a world size; and leftovers of launchers that
died (rendezvous folders) or of earlier torchrun jobs (environment variables), found at once."""
from __future__ import annotations

import atexit
import datetime
import os
import tempfile
import warnings

import torch
import torch.distributed as tdist

from tensorpar.dist import shm
from tensorpar.dist.reaper import sweep_dead

BACKENDS = ("auto", "shm", "gloo", "nccl")


def resolve_backend(backend: str, world_size: int) -> str:
    """The torch.distributed backend for ``backend``: ``"auto"`` is NCCL with a GPU per rank, else
    :mod:`tensorpar.dist.shm` (shared memory between the ranks of one host, gloo between hosts,
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
    return all(k in os.environ for k in _TORCHRUN_VARS)

# Seconds the ranks of an environment torchrun's agent did not set up (no TORCHELASTIC_RUN_ID)
# wait for each other: long enough for a launcher starting processes by hand, short enough that
# variables left over from an earlier torchrun are reported instead of blocking for `timeout`.
RENDEZVOUS_S = float(os.environ.get("TENSORPAR_RENDEZVOUS_TIMEOUT", "30"))

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

def init_from_env(backend: str = "auto", timeout: float = 120.0) -> tuple[int, int]:
    """Join the process group torchrun describes (env://); returns ``(rank, world_size)``."""
    world_size, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is not below WORLD_SIZE={world_size}{_LEFTOVER}")
    if not tdist.is_initialized():
        backend = resolve_backend(backend, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        store = None
        if "TORCHELASTIC_RUN_ID" not in os.environ:  # not torchrun's agent: no store is waiting for us
            store = _rendezvous(rank, world_size)
        tdist.init_process_group(backend, init_method=None if store else "env://", store=store,
                                 rank=rank if store else -1, world_size=world_size if store else -1,
                                 timeout=datetime.timedelta(seconds=timeout))
        # A process that exits with its group alive can abort in the backend's teardown
        # ("terminate called without an active exception"): leave the group on the way out.
        atexit.register(_destroy_if_initialized)
    return tdist.get_rank(), tdist.get_world_size()

_LEFTOVER = ("; RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT make tensorpar join a torchrun job. If they "
             "are left over from an earlier one, unset them (`unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT`) "
             "to launch local ranks")

def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r} is not an integer{_LEFTOVER}") from None

def _rendezvous(rank: int, world_size: int):
    """The TCP store at MASTER_ADDR:MASTER_PORT, every rank joined within ``RENDEZVOUS_S``."""
    addr, port = os.environ["MASTER_ADDR"], _env_int("MASTER_PORT")
    try:
        return tdist.TCPStore(addr, port, world_size, is_master=rank == 0, wait_for_workers=True,
                              timeout=datetime.timedelta(seconds=RENDEZVOUS_S))
    except (RuntimeError, TimeoutError, OSError) as exc:
        raise ValueError(f"rank {rank} of {world_size}: no rendezvous at {addr}:{port} within {RENDEZVOUS_S:g}s "
                         f"({str(exc).splitlines()[0][:120]}){_LEFTOVER}; or set "
                         f"TENSORPAR_RENDEZVOUS_TIMEOUT to wait longer") from None

def _destroy_if_initialized() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()

_RDZV_PREFIX = "tensorpar-rdzv-"

def _sweep_stale_rendezvous() -> None:
    """Remove the rendezvous folders of launchers that died without cleaning up (SIGKILL): each
    folder's name carries its launcher's pid; a folder whose pid is gone is stale."""
    import shutil
    sweep_dead(tempfile.gettempdir(), _RDZV_PREFIX, lambda path: shutil.rmtree(path, ignore_errors=True))

_INIT_ATTEMPTS = 3

def _init_group(backend, store_path, rank, world_size, timeout) -> None:
    """Join the process group over the file store; retry gloo's connection mesh if it flakes.

    Under load, gloo's TCP mesh setup on loopback sometimes fails with "Connection closed by
    peer" in ``connectFullMesh`` (about 1 launch in 20 on this 2-core machine, measured; also a
    known flake in PyTorch's own gloo tests). The ranks then agree through the store, which does
    not depend on that mesh: each posts whether its attempt succeeded, and unless all did,
    every rank leaves the group and all try again under a fresh key prefix. A last barrier
    keeps any rank from returning while a peer is still connecting.
    """
    base = tdist.FileStore(store_path, world_size)
    base.set_timeout(timeout)
    for attempt in range(_INIT_ATTEMPTS):
        error = None
        try:
            tdist.init_process_group(backend, store=tdist.PrefixStore(f"attempt{attempt}/", base),
                                     rank=rank, world_size=world_size, timeout=timeout)
        except RuntimeError as exc:
            if "connectFullMesh" not in str(exc) or attempt == _INIT_ATTEMPTS - 1:
                raise
            error = exc
            warnings.warn(f"rank {rank}: gloo's connection setup failed ({str(exc).splitlines()[0][:200]}); "
                          f"every rank retries (attempt {attempt + 2} of {_INIT_ATTEMPTS})", RuntimeWarning)
        base.set(f"status{attempt}/{rank}", "ok" if error is None else "retry")
        if all(base.get(f"status{attempt}/{r}") == b"ok" for r in range(world_size)):
            tdist.barrier()
            return
        if tdist.is_initialized():
            tdist.destroy_process_group()
    raise RuntimeError(f"the process group could not be formed in {_INIT_ATTEMPTS} attempts")
