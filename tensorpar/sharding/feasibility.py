"""Can a model be split over tp ranks? Every constraint of its plan, checked before anything changes.

The constraints come from the resolved plan itself, not from a table per family:

- heads: attention regions split query heads whole, so tp must divide ``n_heads`` (Megatron-LM
  sec. 3: a head split across ranks would need a collective inside softmax);
- kv heads: tp divides ``n_kv_heads`` (KV heads split), or tp is a multiple of it: the fix is
  KV-head replication, each rank holding the one KV head its query heads use (costs
  ``tp / n_kv_heads - 1`` extra copies of each K/V projection and one all-reduce of their
  gradients in training);
- every other split dimension (an MLP's width, an expert's width, a fused projection's
  segments): tp must divide it;
- vocabulary: padded to ``ceil(V / tp) * tp`` rows (docs/architecture.md), zero rows that never
  win and never count;
- hidden: activations between blocks stay whole (replicated).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from tensorpar.sharding.plan import Dims


@dataclass(frozen=True)
class Constraint:
    """One size and how it splits: ``rule`` ``divide`` (tp must divide ``value``), ``kv`` (divide
    or be a multiple), ``pad`` (padded) or ``whole``; ``status`` at this tp: ``split``,
    ``padded``, ``replicated``, ``whole`` or ``fails``."""
    name: str
    value: int
    status: str
    detail: str
    rule: str = "divide"


@dataclass
class FeasibilityReport:
    family: str
    tp_size: int
    constraints: list = field(default_factory=list)
    valid_tp_sizes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.status != "fails" for c in self.constraints)

    @property
    def fixes(self) -> list[str]:
        return [c.detail for c in self.constraints if c.status in ("padded", "replicated")]

    def error_message(self) -> str:
        failed = "; ".join(c.detail for c in self.constraints if c.status == "fails")
        valid = ", ".join(map(str, self.valid_tp_sizes))
        return f"tp_size ({self.tp_size}) does not fit this {self.family} model: {failed}; valid tp sizes: {valid}"

    def to_dict(self) -> dict:
        return {"family": self.family, "tp_size": self.tp_size, "ok": self.ok,
                "constraints": [asdict(c) for c in self.constraints],
                "valid_tp_sizes": self.valid_tp_sizes, "fixes": self.fixes}


def _status(rule: str, name: str, value: int, tp: int, what: str) -> Constraint:
    if rule == "pad":
        per = -(-value // tp)
        if value % tp == 0:
            return Constraint(name, value, "split", f"{per} {what} per rank", rule)
        return Constraint(name, value, "padded", f"vocabulary padding: {name} ({value}) padded to "
                          f"{per * tp} rows ({per} per rank)", rule)
    if rule == "whole":
        return Constraint(name, value, "whole", what, rule)
    if value % tp == 0:
        return Constraint(name, value, "split", f"{value // tp} {what} per rank", rule)
    if rule == "kv" and tp % value == 0:
        return Constraint(name, value, "replicated", f"KV-head replication: n_kv_heads ({value}) < "
                          f"tp_size ({tp}); each KV head held by {tp // value} ranks", rule)
    if rule == "kv":
        return Constraint(name, value, "fails", f"tp_size ({tp}) must divide n_kv_heads ({value}) or be a "
                          f"multiple of it", rule)
    label = _LABELS.get(name, name)
    return Constraint(name, value, "fails", f"tp_size ({tp}) must divide {label} ({value})", rule)


_LABELS = {"heads": "n_heads", "kv_heads": "n_kv_heads", "ffn": "the MLP width ffn"}


@dataclass(frozen=True)
class Size:
    """A size the plan splits: ``rule`` as in :class:`Constraint`, ``what`` its unit in messages."""
    name: str
    value: int
    rule: str
    what: str


def head_sizes(dims: Dims) -> list[Size]:
    return [Size("heads", dims.n_heads, "divide", "query heads"),
            Size("kv_heads", dims.n_kv_heads, "kv", "KV heads")]


def hidden_size(dims: Dims) -> Size:
    return Size("hidden", dims.hidden, "whole", f"activations between blocks stay whole; attention "
                f"width {dims.n_heads * dims.head_dim} splits by heads")


def model_sizes(dims: Dims, *, heads: bool = True) -> list[Size]:
    """The sizes of a standard decoder split: heads, KV heads, ffn, vocabulary, hidden."""
    return [*(head_sizes(dims) if heads else []), Size("ffn", dims.ffn, "divide", "MLP columns"),
            Size("vocab", dims.vocab, "pad", "vocabulary rows"), hidden_size(dims)]


def generic(name: str) -> str:
    """A layer's name with its index replaced by ``*`` (``model.layers.*.mlp.up_proj``)."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def valid_tp_sizes(sizes: list[Size], limit: int) -> list[int]:
    """Every tp size 1 .. ``limit`` that passes all constraints, fixes allowed."""
    return [t for t in range(1, limit + 1)
            if all(_status(s.rule, s.name, s.value, t, s.what).status != "fails" for s in sizes)]


def report(family: str, sizes: list[Size], tp_size: int) -> FeasibilityReport:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
    limit = max([s.value for s in sizes if s.rule in ("divide", "kv")] or [1])
    constraints = [_status(s.rule, s.name, s.value, tp_size, s.what) for s in sizes]
    return FeasibilityReport(family, tp_size, constraints, valid_tp_sizes(sizes, limit))


def check_feasibility(model_or_config, tp_size: int, family: str | None = None) -> FeasibilityReport:
    """The :class:`FeasibilityReport` of splitting a model over ``tp_size`` ranks.

    ``model_or_config``: a Hugging Face model or config (its plan is resolved on a copy built on
    the meta device, so every split the plan makes is checked), or :class:`Dims` (the sizes of a
    standard decoder split).
    """
    if isinstance(model_or_config, Dims):
        return report(family or "model", model_sizes(model_or_config), tp_size)
    from tensorpar.sharding.sizes import model_type, plan_sizes
    kind = model_type(model_or_config) or type(model_or_config).__name__
    return report(kind, plan_sizes(model_or_config, tp_size), tp_size)
