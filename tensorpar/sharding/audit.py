"""``audit(model)``: do the ranks still hold the same replicated state?

A parallelized model keeps some tensors whole on every rank (norms, routers, biases added after a
reduction, rotary tables, whatever stays replicated). They must stay equal: ranks seeded
differently, a gradient that was not reduced, an optimizer that stepped on one rank only or
different inputs per rank make them drift apart, and the split model then matches no unsplit
model, without any error. ``audit`` checksums every replicated parameter and buffer (optionally
its gradient too) on each rank, exchanges the checksums in one collective and names what differs
and on which ranks. :func:`check_same_inputs` does the same for the inputs of one step.

A checksum is SHA-256 of the tensor's bytes: equal replicas are bit-identical (each rank
computes them the same way), so any difference at all is drift.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from tensorpar import distributed as dist
from tensorpar.sharding.commit import restore_tags


class ReplicaDriftError(RuntimeError):
    """Tensors that should be equal on every rank of a tensor-parallel group are not."""


@dataclass
class AuditReport:
    """``checked``: how many replicated tensors were compared; ``differs``: ``{name: [ranks whose
    copy differs from rank 0's]}``."""
    checked: int
    tp_size: int
    differs: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.differs

    def message(self) -> str:
        if self.ok:
            return f"all {self.checked} replicated tensors are identical on the {self.tp_size} ranks"
        items = [f"{name} (ranks {ranks} differ from rank 0)" for name, ranks in list(self.differs.items())[:6]]
        more = f" and {len(self.differs) - 6} more" if len(self.differs) > 6 else ""
        return (f"{len(self.differs)} of {self.checked} replicated tensors differ between ranks: "
                f"{'; '.join(items)}{more}. The ranks no longer compute one model (seeded differently? a "
                f"gradient not reduced? an optimizer step on some ranks only?)")


def _digest(t: torch.Tensor) -> str:
    data = t.detach().cpu().contiguous()
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()[:16]


def _replicated(model):
    """``(name, tensor)`` of every parameter and buffer held whole on every rank."""
    seen = set()
    for name, p in model.named_parameters():
        spec = getattr(p, "tp_spec", None)
        sharded = getattr(p, "tp_sharded", None) or (spec is not None and spec.is_shard)
        if not sharded and id(p) not in seen:
            seen.add(id(p))
            yield name, p
    for name, b in model.named_buffers():
        if id(b) not in seen and not getattr(b, "tp_sharded", False):
            seen.add(id(b))
            yield name, b


def audit(model, *, grads: bool = False, raise_on_drift: bool = False) -> AuditReport:
    """Compare every replicated parameter and buffer of a parallelized ``model`` across its
    tensor-parallel group (``grads=True``: their gradients as well, after backward). Every rank
    must call it. ``raise_on_drift``: raise :class:`ReplicaDriftError` instead of returning a
    report that is not ok."""
    report = getattr(model, "tp_report", None)
    if report is None:
        raise ValueError("audit needs a model parallelized by tensorpar.parallelize or load_sharded "
                         "(it has no tp_report)")
    restore_tags(model)  # a deep copy of a parallelized model: which parameters are shards
    group = report.tp_group
    sums = {}
    for name, t in _replicated(model):
        sums[name] = _digest(t)
        if grads and getattr(t, "grad", None) is not None:
            sums[f"{name}.grad"] = _digest(t.grad)
    everyone = _gather(sums, group)
    differs = {}
    for name, digest in everyone[0].items():
        ranks = [r for r, other in enumerate(everyone) if other.get(name) != digest]
        if ranks:
            differs[name] = ranks
    for r, other in enumerate(everyone):  # a tensor rank 0 does not have at all
        for name in other.keys() - everyone[0].keys():
            differs.setdefault(name, []).append(r)
    result = AuditReport(checked=len(sums), tp_size=len(everyone), differs=differs)
    if raise_on_drift and not result.ok:
        raise ReplicaDriftError(result.message())
    return result


def check_same_inputs(group=None, **inputs) -> None:
    """Raise :class:`ReplicaDriftError` unless every rank of ``group`` passed identical tensors
    (e.g. ``check_same_inputs(group, input_ids=ids)``): one small collective."""
    sums = {k: _digest(v) if isinstance(v, torch.Tensor) else repr(v) for k, v in inputs.items()}
    everyone = _gather(sums, group)
    bad = {k: [r for r, other in enumerate(everyone) if other.get(k) != v] for k, v in everyone[0].items()}
    bad = {k: ranks for k, ranks in bad.items() if ranks}
    if bad:
        raise ReplicaDriftError("the ranks of a tensor-parallel group were given different inputs: "
                                + "; ".join(f"{k} differs from rank 0's on ranks {ranks}" for k, ranks in bad.items())
                                + " (every rank of the group must see the same batch and prompt)")


def _gather(obj, group) -> list:
    """Every rank's ``obj`` in group-rank order (one collective)."""
    return dist.all_gather_object(obj, group)
