"""tensorpar.distributed: process groups, the local launcher, autograd-aware collectives and the ledger.

The only package that calls torch.distributed. Every collective takes its group explicitly
(``group=None``: the default, world group).
"""
from tensorpar.distributed.collectives import all_gather, all_reduce, broadcast, reduce_scatter
from tensorpar.distributed.flight import CollectiveMismatchError, check_collectives
from tensorpar.distributed.groups import (PlanningGroup, PlanningGroupError, all_gather_object, barrier, broadcast_object,
                                   get_backend, get_rank, get_world_size, is_initialized, new_group, rank_device)
from tensorpar.distributed.launcher import (LaunchTimeoutError, MismatchedCollectivesError, RankFailedError, RankStuckError,
                                     RankUnresponsiveError, launch)
from tensorpar.distributed.preflight import check_local_world, check_world
from tensorpar.distributed.rendezvous import init_from_env, resolve_backend
from tensorpar.distributed.shm import transport
from tensorpar.distributed.shm_segment import ShmPeerError
from tensorpar.distributed.ledger import CollectiveRecord, Ledger, ledger, ring_bytes_sent
from tensorpar.distributed.mappings import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    linear_with_grad_allreduce,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)

__all__ = [
    "launch", "init_from_env", "resolve_backend", "RankFailedError", "LaunchTimeoutError",
    "RankStuckError", "RankUnresponsiveError", "check_local_world", "check_world",
    "CollectiveMismatchError", "MismatchedCollectivesError", "check_collectives",
    "get_rank", "get_world_size", "get_backend", "new_group", "barrier", "broadcast_object", "all_gather_object",
    "is_initialized", "rank_device", "transport", "ShmPeerError",
    "PlanningGroup", "PlanningGroupError",
    "all_reduce", "all_gather", "reduce_scatter", "broadcast",
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "linear_with_grad_allreduce",
    "ledger", "Ledger", "CollectiveRecord", "ring_bytes_sent",
]
