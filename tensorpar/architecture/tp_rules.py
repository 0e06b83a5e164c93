"""Which tensor-parallel sizes split a model, and what each rank then holds: the rules, in one place.

Each size a plan splits follows one rule (``Size.rule``), checked before anything changes:

- ``divide``: tp divides it. Query heads (Megatron-LM, Shoeybi et al. 2019, sec. 3: a head split
  across ranks would need a collective inside softmax), an MLP's or an expert's width, each
  segment of a fused projection;
- ``kv``: tp divides ``n_kv_heads`` (each rank holds ``n_kv_heads / tp`` of them), or tp is a
  multiple of it: KV-head replication (as vLLM does), rank ``r`` holding the one KV head its
  query heads use, ``r // (tp / n_kv_heads)``, copied on ``tp / n_kv_heads`` ranks (that many
  copies of each K/V projection, and one all-reduce of their gradients in training);
- ``pad``: a vocabulary, padded to ``ceil(V / tp) * tp`` rows; rank ``r`` owns
  ``[r * per_partition, min((r + 1) * per_partition, V))``, the rows past ``V`` zero padding that
  every layer masks wherever it could change a result;
- ``whole``: kept whole on every rank (the hidden size: activations between blocks).

The runtime refuses what these refuse and the planner plans what they allow. Standard library only.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

RULES = ("divide", "kv", "pad", "whole")


def fits(rule: str, value: int, tp: int) -> bool:
    """Whether ``tp`` ranks can split a size of ``value`` under ``rule``."""
    if rule == "divide":
        return value % tp == 0
    if rule == "kv":
        return value % tp == 0 or tp % value == 0
    if rule in ("pad", "whole"):
        return True
    raise ValueError(f"rule {rule!r}; valid: {', '.join(RULES)}")


def kv_split(n_kv_heads: int, tp: int) -> tuple[int, int]:
    """``(KV heads per rank, ranks holding each)``: ``(n_kv / tp, 1)`` when tp divides them, else
    ``(1, tp / n_kv)`` (replicated); ValueError when tp does neither."""
    if n_kv_heads % tp == 0:
        return n_kv_heads // tp, 1
    if tp % n_kv_heads == 0:
        return 1, tp // n_kv_heads
    raise ValueError(f"tp_size ({tp}) must divide n_kv_heads ({n_kv_heads}) or be a multiple of it")


def kv_head_of_rank(tp_rank: int, tp: int, n_kv_heads: int) -> int:
    """The KV head a rank holds when the KV heads are replicated (fewer than ranks): the one its
    query heads use."""
    return tp_rank // kv_split(n_kv_heads, tp)[1]


def local_heads(n_heads: int, n_kv_heads: int, tp: int) -> tuple[int, int]:
    """``(query heads, KV heads)`` on each rank."""
    if n_heads % tp:
        raise ValueError(f"tp_size ({tp}) must divide n_heads ({n_heads})")
    return n_heads // tp, kv_split(n_kv_heads, tp)[0]


def valid_tp_sizes(*sizes: int) -> list[int]:
    """The tp sizes that divide every one of ``sizes`` (the common divisors, ascending)."""
    return passing_tp_sizes([Size(str(s), s, "divide", "") for s in sizes], min(sizes))


def valid_attention_tp_sizes(n_heads: int, n_kv_heads: int) -> list[int]:
    """tp sizes that split attention by whole heads (query heads divide; KV heads divide or replicate)."""
    return passing_tp_sizes([Size("heads", n_heads, "divide", ""), Size("kv_heads", n_kv_heads, "kv", "")], n_heads)


def divide(n: int, tp_size: int, what: str) -> int:
    """``n // tp_size``; ValueError naming ``what`` and the valid tp sizes if it does not divide."""
    if n % tp_size != 0:
        valid = ", ".join(map(str, valid_tp_sizes(n)))
        raise ValueError(f"tp_size ({tp_size}) must divide {what} ({n}); valid tp sizes: {valid}")
    return n // tp_size


def padded_size(n: int, tp_size: int) -> int:
    """``ceil(n / tp_size) * tp_size``: the smallest multiple of tp_size holding ``n`` rows."""
    return -(-n // tp_size) * tp_size


def padded_range(n: int, tp_rank: int, tp_size: int) -> tuple[int, int, int]:
    """``(start, end, per_partition)`` of rank ``tp_rank`` under the padding rule.

    ``[start, end)`` are the real rows this rank owns; ``per_partition - (end - start)`` trailing
    rows of its shard are padding. ``end`` is clamped to ``start`` when a rank owns padding only
    (the last rank does when ``(tp_size - 1) * per_partition >= n``, e.g. n=5 or 6, tp=4:
    per_partition 2, rank 3's rows 6..7 are all >= n).
    """
    per_partition = padded_size(n, tp_size) // tp_size
    start = tp_rank * per_partition
    end = max(start, min(start + per_partition, n))
    return start, end, per_partition


@dataclass(frozen=True)
class Dims:
    """The sizes a tensor-parallel split must respect, read from a model config."""
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    hidden: int

    def local_heads(self, tp_size: int) -> tuple[int, int]:
        """``(query heads, KV heads)`` on each rank (:func:`local_heads`)."""
        return local_heads(self.n_heads, self.n_kv_heads, tp_size)


@dataclass(frozen=True)
class Size:
    """A size the plan splits: ``rule`` one of :data:`RULES`, ``what`` its unit in messages."""
    name: str
    value: int
    rule: str
    what: str


@dataclass(frozen=True)
class Constraint:
    """One size at one tp: ``status`` ``split``, ``padded``, ``replicated``, ``whole`` or ``fails``."""
    name: str
    value: int
    status: str
    detail: str
    rule: str = "divide"


_LABELS = {"heads": "n_heads", "kv_heads": "n_kv_heads", "ffn": "the MLP width ffn"}


def constraint(size: Size, tp: int) -> Constraint:
    """What ``size`` becomes at ``tp``, with the message a user reads."""
    name, value, rule, what = size.name, size.value, size.rule, size.what
    if rule == "pad":
        per = padded_size(value, tp) // tp
        if value % tp == 0:
            return Constraint(name, value, "split", f"{per} {what} per rank", rule)
        return Constraint(name, value, "padded", f"vocabulary padding: {name} ({value}) padded to "
                          f"{per * tp} rows ({per} per rank)", rule)
    if rule == "whole":
        return Constraint(name, value, "whole", what, rule)
    if value % tp == 0:
        return Constraint(name, value, "split", f"{value // tp} {what} per rank", rule)
    if rule == "kv" and fits(rule, value, tp):
        return Constraint(name, value, "replicated", f"KV-head replication: n_kv_heads ({value}) < "
                          f"tp_size ({tp}); each KV head held by {kv_split(value, tp)[1]} ranks", rule)
    if rule == "kv":
        return Constraint(name, value, "fails", f"tp_size ({tp}) must divide n_kv_heads ({value}) or be a "
                          f"multiple of it", rule)
    return Constraint(name, value, "fails", f"tp_size ({tp}) must divide {_LABELS.get(name, name)} ({value})", rule)


def passing_tp_sizes(sizes, limit: int) -> list[int]:
    """Every tp size 1 .. ``limit`` that every one of ``sizes`` fits (padding and replication allowed)."""
    return [t for t in range(1, limit + 1) if all(fits(s.rule, s.value, t) for s in sizes)]


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


def report(family: str, sizes: list[Size], tp_size: int) -> FeasibilityReport:
    """Every size at ``tp_size``, and the tp sizes up to the largest split size that all fit."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
    limit = max([s.value for s in sizes if s.rule in ("divide", "kv")] or [1])
    return FeasibilityReport(family, tp_size, [constraint(s, tp_size) for s in sizes], passing_tp_sizes(sizes, limit))


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
