"""What ``parallelize`` did to a model, kept on it as ``model.tp_report`` (JSON via ``to_dict``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tensorpar.sharding.probes import blocks


@dataclass
class ParallelizeReport:
    """``styles``: module or parameter name -> style applied; ``replicated``: modules with their
    own parameters left whole; ``whole``: blocks left whole on purpose, and why (a style with no
    exact translation, a builder's refusal, a failed proof); ``grad_sync``: replicated parameters
    whose gradient is all-reduced; ``notes``: fixes applied (KV replication, vocabulary padding)
    and, for a discovered plan, each pair checked; ``params_per_rank`` against ``params_total``
    (the dense model's unique parameters, tied ones once); ``proved``: ``True`` when the split
    was checked against the dense model on example inputs, forward and backward (tp 1: nothing
    to prove), ``"replica"`` for a model on the meta device, proved through a small replica of
    its config (``tensorpar.sharding.replica``), ``False`` when the caller gave up the proof."""
    family: str | None
    source: str  # "tensorpar", "declared", "user" or "discovered"
    tp_size: int
    tp_rank: int
    notes: list = field(default_factory=list)
    feasibility: object = None
    tp_group: object = None
    params_total: int = 0
    params_per_rank: int = 0
    styles: dict = field(default_factory=dict)
    replicated: list = field(default_factory=list)
    whole: dict = field(default_factory=dict)
    grad_sync: list = field(default_factory=list)
    proved: bool | str = False
    layer_params_total: int = 0  # parameters of the transformer blocks, unsplit
    layer_params_per_rank: int = 0
    layers_replicated: list = field(default_factory=list)  # [(module, params)] left whole in the blocks
    data_parallel: str | None = None  # "ddp" or "fsdp" across dp_group (parallelize(mesh=...))
    sequence_parallel: bool = False  # blocks run on sequence chunks between their regions
    dp_group: object = None
    dp_size: int = 1
    # pipeline stages (parallelize(mesh=..., pipeline=...)): this rank's place among pp ranks
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: object = None
    pp_last_rank: int = 0  # the pp rank holding the last stage
    schedule: str | None = None
    microbatches: int = 1
    virtual_stages: int = 1
    stage_blocks: list | None = None  # [[first block, end)] of every stage
    stages: list | None = None  # the stages this rank holds

    @classmethod
    def of(cls, model, res, tp_group, tp_size, tp_rank, params_total, *, proved) -> "ParallelizeReport":
        styles = {n: p.style for n, p in res.placements.items()}
        replicated = [n for n, m in model.named_modules()  # modules holding only whole parameters
                      if n and any(True for _ in m.parameters(recurse=False))
                      and not any(getattr(getattr(p, "tp_spec", None), "is_shard", False)
                                  for p in m.parameters(recurse=False))]
        blist = blocks(model)
        in_blocks = [(n, m) for b, blk in blist for n, m in blk.named_modules(prefix=b)]
        layer_now = sum(p.numel() for _, blk in blist for p in blk.parameters())
        whole_layers = sorted(((n, sum(p.numel() for p in m.parameters(recurse=False)))
                               for n, m in in_blocks if n in set(replicated)), key=lambda x: -x[1])
        return cls(family=res.arch, source=res.source, tp_size=tp_size, tp_rank=tp_rank,
                   notes=list(res.notes), feasibility=res.feasibility, tp_group=tp_group,
                   params_total=params_total, params_per_rank=sum(p.numel() for p in model.parameters()),
                   styles=styles, replicated=replicated, whole=dict(res.whole),
                   grad_sync=[n for n, s in styles.items() if s in ("grad_sync", "param_rank0")],
                   proved=proved, layer_params_total=res.layer_params_total, layer_params_per_rank=layer_now,
                   layers_replicated=whole_layers)

    @property
    def layer_share(self) -> float:
        """This rank's share of the transformer blocks' parameters (ideal ``1 / tp_size``)."""
        return self.layer_params_per_rank / self.layer_params_total if self.layer_params_total else 1.0

    @property
    def status(self) -> str:
        """``"split"`` when no block was left whole and each rank holds at most ``1/tp + 0.1`` of the
        blocks' parameters; else ``"partly whole"`` (``whole`` and ``layers_replicated`` say what)."""
        if self.tp_size == 1:
            return "whole"
        return "split" if not self.whole and self.layer_share <= 1 / self.tp_size + 0.1 else "partly whole"

    @property
    def param_fraction(self) -> float:
        """``params_per_rank / params_total``; ideal ``1 / tp_size``."""
        return self.params_per_rank / self.params_total if self.params_total else 0.0

    def to_dict(self) -> dict:
        return {"family": self.family, "source": self.source, "tp_size": self.tp_size,
                "tp_rank": self.tp_rank, "notes": list(self.notes), "styles": dict(self.styles),
                "replicated": list(self.replicated), "whole": dict(self.whole),
                "grad_sync": list(self.grad_sync), "proved": self.proved, "status": self.status,
                "layer_share": self.layer_share, "layers_replicated": [list(x) for x in self.layers_replicated],
                "params_total": self.params_total, "params_per_rank": self.params_per_rank,
                "param_fraction": self.param_fraction, "data_parallel": self.data_parallel, "dp_size": self.dp_size,
                "sequence_parallel": self.sequence_parallel,
                "feasibility": None if self.feasibility is None else self.feasibility.to_dict()}
