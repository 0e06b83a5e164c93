"""How a model is split and run: tp x pp x dp, batch, recomputation, precision, optimizer sharding.

Rank order follows Megatron-LM (Narayanan et al. 2021, Sec. 3.3): tensor-parallel ranks are
consecutive (innermost), then data-parallel, then pipeline stages, so a tp group sits inside one
node whenever ``tp`` divides the devices per node.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from tensorpar.architecture.pipeline import LOOPED, SINGLE, default_virtual, schedule_name

DTYPE_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}
RECOMPUTE = ("none", "selective", "full")
WORKLOADS = ("train", "inference")
ZERO_STAGES = (0, 1, 2, 3)
OPTIMIZERS = ("adam-mixed", "adamw")  # planner.memory.optimizer_bytes_per_param


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A parallel layout and run configuration; validated on construction.

    ``global_batch`` (sequences per optimizer step) defaults to ``micro_batch * dp`` (one
    micro-batch per step); it must be a multiple of ``micro_batch * dp``. ``optimizer``: the
    state Adam keeps per parameter (:func:`tensorpar.planner.memory.optimizer_bytes_per_param`).
    ``schedule``: PyTorch's pipeline schedule by name (:mod:`tensorpar.architecture.pipeline`),
    ``virtual_stages`` its stages per pipeline rank (default: 1 for GPipe and 1F1B, else 2).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    micro_batch: int = 1
    global_batch: int | None = None
    recompute: str = "none"
    dtype: str = "bf16"
    zero_stage: int = 0
    workload: str = "train"
    optimizer: str = "adam-mixed"
    schedule: str = "1F1B"
    virtual_stages: int | None = None

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "micro_batch"):
            check_size(name, getattr(self, name))
        if self.global_batch is None:
            object.__setattr__(self, "global_batch", self.micro_batch * self.dp)
        check_size("global_batch", self.global_batch)
        check_choice("recompute", self.recompute, RECOMPUTE)
        check_choice("dtype", self.dtype, tuple(DTYPE_BYTES))
        check_choice("zero_stage", self.zero_stage, ZERO_STAGES)
        check_choice("workload", self.workload, WORKLOADS)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        object.__setattr__(self, "schedule", schedule_name(self.schedule))
        if self.virtual_stages is None:
            object.__setattr__(self, "virtual_stages", default_virtual(self.schedule))
        check_virtual(self.schedule, self.virtual_stages)
        if self.global_batch % (self.micro_batch * self.dp):
            per = self.micro_batch * self.dp
            raise ValueError(f"global_batch ({self.global_batch}) must be a multiple of micro_batch x dp "
                             f"({self.micro_batch} x {self.dp} = {per}); valid: {per}, {2 * per}, {3 * per}, ...")

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches each pipeline runs per optimizer step: B / (b * dp)."""
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def bytes_per_elem(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def to_dict(self) -> dict:
        return {**asdict(self), "devices": self.devices, "num_micro_batches": self.num_micro_batches}


def check_size(name: str, value) -> None:
    """ValueError unless ``value`` is a positive int (a bool is not a size)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} ({value!r}) must be a positive integer")


def check_virtual(schedule: str, virtual) -> None:
    """Stages per pipeline rank: 1 under a single-stage schedule, 2 under a V, any under a loop."""
    check_size("virtual_stages", virtual)
    if schedule in SINGLE and virtual != 1:
        raise ValueError(f"virtual_stages ({virtual}) must be 1 under {schedule}; schedules with more stages per "
                         f"rank: {', '.join(s for s in LOOPED)}, ZBVZeroBubble, DualPipeV")
    if schedule not in SINGLE + LOOPED and virtual != 2:
        raise ValueError(f"virtual_stages ({virtual}) must be 2 under {schedule} (a V: two stages per rank)")


def check_choice(name: str, value, choices: tuple) -> None:
    """ValueError naming ``name``, ``value`` and the valid ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} ({value!r}) must be one of: {', '.join(map(str, choices))}")


def group_placement(layout: Layout, devices_per_node: int) -> dict:
    """Members of each group that share a node, with rank order tp (innermost), dp, pp.

    Returns ``{"tp": m_tp, "dp": m_dp, "pp": m_pp}``: how many members of one group sit in the same
    node (the group spans ``size / m`` nodes). Assumes groups are packed, which needs the group
    stride times the members per node to fit in a node.
    """
    k = devices_per_node
    tp_in = min(layout.tp, k)
    dp_in = max(1, min(layout.dp, k // layout.tp)) if layout.tp <= k else 1
    stride_pp = layout.tp * layout.dp
    pp_in = max(1, min(layout.pp, k // stride_pp)) if stride_pp <= k else 1
    return {"tp": tp_in, "dp": dp_in, "pp": pp_in}
