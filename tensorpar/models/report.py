"""What ``parallelize`` did to a model, kept on it as ``model.tp_report`` (JSON via ``to_dict``)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ParallelizeReport:
    """``styles``: module name -> style applied; ``replicated``: modules with their own
    parameters left whole; ``notes``: fixes applied (KV replication, vocabulary padding) and,
    for a discovered plan, each pair checked; ``params_per_rank`` against ``params_total``
    (the dense model's unique parameters, tied ones once)."""
    family: str | None
    source: str  # "family", "user" or "discovered"
    tp_size: int
    tp_rank: int
    notes: list = field(default_factory=list)
    feasibility: object = None
    tp_group: object = None
    params_total: int = 0
    params_per_rank: int = 0
    styles: dict = field(default_factory=dict)
    replicated: list = field(default_factory=list)

    @property
    def param_fraction(self) -> float:
        """``params_per_rank / params_total``; ideal ``1 / tp_size``."""
        return self.params_per_rank / self.params_total if self.params_total else 0.0

    def to_dict(self) -> dict:
        return {"family": self.family, "source": self.source, "tp_size": self.tp_size,
                "tp_rank": self.tp_rank, "notes": list(self.notes), "styles": dict(self.styles),
                "replicated": list(self.replicated), "params_total": self.params_total,
                "params_per_rank": self.params_per_rank, "param_fraction": self.param_fraction,
                "feasibility": None if self.feasibility is None else self.feasibility.to_dict()}
