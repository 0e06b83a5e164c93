"""Process-group queries and construction. ``group=None`` is the default (world) group."""
from __future__ import annotations

import torch.distributed as tdist


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


def get_rank(group=None) -> int:
    """This process's rank within ``group`` (0 when no process group is initialised)."""
    pg = _process_group(group)
    if isinstance(pg, tdist.ProcessGroup):
        return pg.rank()
    return tdist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    """Ranks in ``group`` (1 when no process group is initialised)."""
    pg = _process_group(group)
    if isinstance(pg, tdist.ProcessGroup):
        return pg.size()
    return tdist.get_world_size(group) if is_initialized() else 1


def get_backend(group=None) -> str:
    return tdist.get_backend(group) if is_initialized() else "none"


def new_group(ranks: list[int]):
    """A sub-group of the given global ranks; every rank must call it with the same list."""
    world = tdist.get_world_size()
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or len(set(ranks)) != len(ranks) or not ranks:
        raise ValueError(f"ranks {ranks} must be distinct global ranks in [0, {world}); invalid: {bad}")
    return tdist.new_group(ranks=sorted(ranks))


def barrier(group=None) -> None:
    if is_initialized():
        tdist.barrier(group=group)


def broadcast_object(obj, src: int = 0, group=None):
    """Every rank returns ``src``'s object (picklable)."""
    if not is_initialized() or get_world_size(group) == 1:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=src, group=group)
    return box[0]
