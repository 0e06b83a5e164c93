"""Can a model be split over tp ranks? Every constraint checked before any module is touched.

For the families of :mod:`tensorpar.models.plans`:

- heads: query heads split whole, so tp must divide ``n_heads`` (Megatron-LM sec. 3: attention
  is split by heads; a head split across ranks would need a collective inside softmax).
- kv heads: tp divides ``n_kv_heads`` (KV heads split), or tp is a multiple of ``n_kv_heads``:
  the fix is KV-head replication, each rank holding the one KV head its query heads use
  (costs ``(tp / n_kv_heads - 1)`` extra copies of each K/V projection, and one all-reduce of
  their gradients in training).
- ffn: the MLP's hidden width is split by columns then rows, so tp must divide it.
- vocabulary: the fix is padding to ``ceil(V / tp) * tp`` rows (docs/architecture.md), zero
  rows that never win and never count.
- hidden: activations between blocks stay whole (replicated); the attention width
  ``n_heads * head_dim`` splits with the heads, so it adds no constraint of its own.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tensorpar.models.plans import Dims, model_dims, model_family


@dataclass(frozen=True)
class Constraint:
    """One size and how it splits: ``status`` is ``split``, ``padded``, ``replicated``,
    ``whole`` (not split) or ``fails``."""
    name: str
    value: int
    status: str
    detail: str


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


def _heads(d: Dims, tp: int) -> Constraint:
    if d.n_heads % tp == 0:
        return Constraint("heads", d.n_heads, "split", f"{d.n_heads // tp} query heads per rank")
    return Constraint("heads", d.n_heads, "fails", f"tp_size ({tp}) must divide n_heads ({d.n_heads})")


def _kv_heads(d: Dims, tp: int) -> Constraint:
    n = d.n_kv_heads
    if n % tp == 0:
        return Constraint("kv_heads", n, "split", f"{n // tp} KV heads per rank")
    if tp % n == 0:
        return Constraint("kv_heads", n, "replicated",
                          f"KV-head replication: n_kv_heads ({n}) < tp_size ({tp}); each KV head held by {tp // n} ranks")
    return Constraint("kv_heads", n, "fails",
                      f"tp_size ({tp}) must divide n_kv_heads ({n}) or be a multiple of it")


def _ffn(d: Dims, tp: int) -> Constraint:
    if d.ffn % tp == 0:
        return Constraint("ffn", d.ffn, "split", f"{d.ffn // tp} MLP columns per rank")
    return Constraint("ffn", d.ffn, "fails", f"tp_size ({tp}) must divide the MLP width ffn ({d.ffn})")


def _vocab(d: Dims, tp: int) -> Constraint:
    per = -(-d.vocab // tp)
    if d.vocab % tp == 0:
        return Constraint("vocab", d.vocab, "split", f"{per} vocabulary rows per rank")
    return Constraint("vocab", d.vocab, "padded",
                      f"vocabulary padding: vocab ({d.vocab}) padded to {per * tp} rows ({per} per rank)")


def _hidden(d: Dims, tp: int) -> Constraint:
    return Constraint("hidden", d.hidden, "whole",
                      f"activations between blocks stay whole; attention width {d.n_heads * d.head_dim} splits by heads")


def constraints(dims: Dims, tp_size: int) -> list[Constraint]:
    return [check(dims, tp_size) for check in (_heads, _kv_heads, _ffn, _vocab, _hidden)]


def valid_tp_sizes(dims: Dims) -> list[int]:
    """Every tp size (1 .. n_heads) that passes all constraints, fixes allowed."""
    return [t for t in range(1, dims.n_heads + 1)
            if all(c.status != "fails" for c in constraints(dims, t))]


def check_feasibility(model_or_dims, tp_size: int, family: str | None = None) -> FeasibilityReport:
    """The :class:`FeasibilityReport` of splitting a model over ``tp_size`` ranks.

    ``model_or_dims``: a Hugging Face model or config of a known family, or :class:`Dims`.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
    dims = model_or_dims
    if not isinstance(dims, Dims):
        family = model_family(model_or_dims)
        if family is None:
            kind = getattr(getattr(model_or_dims, "config", model_or_dims), "model_type", None)
            raise ValueError(f"no size constraints known for model type {kind!r}; "
                             f"known families: llama, mistral, qwen2, gpt2, bert")
        dims = model_dims(getattr(model_or_dims, "config", model_or_dims))
    family = family or "model"
    return FeasibilityReport(family, tp_size, constraints(dims, tp_size), valid_tp_sizes(dims))
