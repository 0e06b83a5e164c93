"""The seconds of a step's collectives for :mod:`.estimate`: every item the planner counts at its
link's ``alpha + n beta``, the wait at tensor-parallel collectives for the slower rank, and the
copies through memory data parallelism adds (FSDP's and ZeRO's buffers, DDP's buckets).
"""
from __future__ import annotations

from dataclasses import replace

from .profile import Profile
from .timing import on_one_node


def group_of(item) -> str:
    """The group an item's time counts under: ``pp``, ``dp`` (the tied-embedding group with it) or ``tp``."""
    return "pp" if item.group == "pp" else "dp" if item.group in ("dp", "embedding") else "tp"


def comm_seconds(items, placement: dict, pp: int, profile: Profile) -> dict:
    """Seconds of ``items`` by group (``tp``, ``pp``, ``dp``; the tied-embedding group counts as dp)."""
    out = {"tp": 0.0, "pp": 0.0, "dp": 0.0}
    for it in items:
        local, _ = on_one_node(it, placement, pp)
        link = profile.link(local)
        if it.op == "send":
            one = link.seconds("send", it.bytes_sent_per_device, 2)
        else:
            one = link.seconds(it.op, it.payload_bytes, it.group_size)
        out[group_of(it)] += it.count * one
    return out


def tp_wait_seconds(items, work_s: float, placement: dict, pp: int, profile: Profile) -> float:
    """The wait at the tensor-parallel collectives for the slower rank: each of the ``items``'
    synchronizing calls (all but pipeline sends and data-parallel ones) after an equal share of
    ``work_s``, the rank's work between them, at the profile's measured wait for work of that
    length over the call's link (:meth:`.Profile.wait_s`). Only on a synchronous host: a GPU's
    kernels queue."""
    tp = [it for it in items if group_of(it) == "tp" and it.op != "send"]
    calls = sum(it.count for it in tp)
    if not calls or not profile.synchronous or work_s <= 0:
        return 0.0
    segment = work_s / calls
    return sum(it.count * profile.wait_s(segment, profile.link(on_one_node(it, placement, pp)[0]).name, it.group_size)
               for it in tp)


def _largest_dp_payload(items) -> float:
    return max((it.payload_bytes for it in items if it.group in ("dp", "embedding")), default=0.0)


def _dp_copies(items, profile: Profile, ops: tuple) -> float:
    """Two passes through memory, read and written, of the bytes the data-parallel ``ops`` move:
    FSDP and ZeRO copy each gathered or reduced buffer in and out (``all_gather``,
    ``reduce_scatter``: parameters into the all-gather's buffer and out to the unit, gradients into
    the reduce-scatter's); PyTorch's DDP each gradient into its bucket and back (``all_reduce``)."""
    moved = sum(it.count * it.payload_bytes for it in items if it.group == "dp" and it.op in ops)
    return 4.0 * moved / profile.memory_bytes_per_s


def _last_bucket(items, bucket_bytes: float):
    it = max((i for i in items if i.group in ("dp", "embedding")), key=lambda i: i.payload_bytes)
    return replace(it, payload_bytes=min(it.payload_bytes, bucket_bytes), count=1)
