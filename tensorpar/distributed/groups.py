"""Process-group queries and construction. ``group=None`` is the default (world) group."""
from __future__ import annotations

import torch
import torch.distributed as tdist

from tensorpar.distributed import flight, shm


def is_initialized() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def _process_group(group):
    """``group`` itself, or the world group for ``None``; ``None`` when nothing is initialised.

    Every parallel layer asks for its group's size and rank on each forward and backward:
    ``ProcessGroup.size()`` / ``.rank()`` answer directly, where ``tdist.get_world_size`` walks
    several Python checks first (about 10 us a call, measured; a decode step asks ~10 times).
    """
    if group is None:
        return tdist.GroupMember.WORLD if tdist.is_available() else None
    return group


class PlanningGroup:
    """A stand-in tensor-parallel group of ``size`` ranks, seen from rank ``rank``: it answers
    :func:`get_world_size` and :func:`get_rank` and moves no data.

    ``parallelize(meta_model, tp_group=PlanningGroup(tp, r), prove=False)`` runs the real
    builders for rank ``r`` without processes, so the shards every rank would hold are read from a
    config alone (``tensorpar.sharding.inventory``). A collective on it raises
    :class:`PlanningGroupError` (:func:`refuse_planning`, the first step of every collective of
    :mod:`tensorpar.distributed`).
    """

    def __init__(self, size: int, rank: int):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"PlanningGroup size ({size!r}) must be a positive integer")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"PlanningGroup rank ({rank!r}) must be an integer in [0, {size})")
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"PlanningGroup(size={self._size}, rank={self._rank})"


class PlanningGroupError(RuntimeError):
    """A collective was issued on a :class:`PlanningGroup`."""


def refuse_planning(group, op: str) -> None:
    """Raise :class:`PlanningGroupError` for a collective ``op`` on a :class:`PlanningGroup`."""
    if isinstance(group, PlanningGroup):
        raise PlanningGroupError(f"{op} on {group!r}: a planning stand-in moves no data (use a process "
                                 f"group from tensorpar.distributed.launch or new_group)")


def get_rank(group=None) -> int:
    """This process's rank within ``group`` (0 when no process group is initialised)."""
    if isinstance(group, PlanningGroup):
        return group.rank()
    pg = _process_group(group)
    if isinstance(pg, tdist.ProcessGroup):
        return pg.rank()
    return tdist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    """Ranks in ``group`` (1 when no process group is initialised)."""
    if isinstance(group, PlanningGroup):
        return group.size()
    pg = _process_group(group)
    if isinstance(pg, tdist.ProcessGroup):
        return pg.size()
    return tdist.get_world_size(group) if is_initialized() else 1


def group_name(group=None) -> str:
    """``group``'s name as torch keeps it (``ProcessGroup.group_name``; ``""`` without one): what
    the ledger records, so that collectives on the dp and tp groups of a mesh can be told apart."""
    pg = _process_group(group)
    return getattr(pg, "group_name", "") if isinstance(pg, tdist.ProcessGroup) else ""


def get_backend(group=None) -> str:
    return tdist.get_backend(group) if is_initialized() else "none"


def rank_device() -> torch.device:
    """The device this rank computes on: under NCCL its GPU (the launcher, or torchrun's
    LOCAL_RANK, set it before the group was made), else the host (gloo and shared memory; a
    GPU there is the caller's to choose)."""
    if get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def new_group(ranks: list[int], backend: str | None = None):
    """A sub-group of the given global ranks; every rank must call it with the same list.
    ``backend``: the world's (default), ``"shm"`` (shared memory where the ranks share a host,
    :mod:`tensorpar.distributed.shm`) or ``"gloo"``."""
    world = tdist.get_world_size()
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or len(set(ranks)) != len(ranks) or not ranks:
        raise ValueError(f"ranks {ranks} must be distinct global ranks in [0, {world}); invalid: {bad}")
    if backend not in (None, "shm", "gloo"):
        raise ValueError(f"backend {backend!r} is not supported for a sub-group; valid: None (the world's), shm, gloo")
    return tdist.new_group(ranks=sorted(ranks), backend=shm.BACKEND if backend == "shm" else backend)


def barrier(group=None) -> None:
    refuse_planning(group, "barrier")
    if is_initialized():
        with flight.issuing("barrier", None, group):
            tdist.barrier(group=group)


def all_gather_object(obj, group=None) -> list:
    """Every rank's ``obj`` (picklable), in group-rank order."""
    refuse_planning(group, "all_gather_object")
    if not is_initialized() or get_world_size(group) == 1:
        return [obj]
    out = [None] * get_world_size(group)
    with flight.issuing("all_gather_object", None, group):
        tdist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src: int = 0, group=None):
    """Every rank returns the object of ``src`` (its rank in ``group``; picklable)."""
    refuse_planning(group, "broadcast_object")
    if not is_initialized() or get_world_size(group) == 1:
        return obj
    box = [obj]
    global_src = tdist.get_global_rank(group, src) if group is not None else src
    with flight.issuing("broadcast_object", None, group):
        tdist.broadcast_object_list(box, src=global_src, group=group)
    return box[0]
