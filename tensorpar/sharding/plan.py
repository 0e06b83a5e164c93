"""Plans as data: module-name patterns, the sizes a split must respect, and the typed records that
carry ``parallelize``'s work from one step to the next (resolve -> check -> build -> commit).

A plan maps module (or parameter) name patterns to style names. Patterns are matched against a
name in full and relative to the model's base model (``model.`` in ``LlamaForCausalLM``,
``transformer.`` in GPT-2, ``bert.`` in BERT heads), so one plan serves the bare model and its
heads; ``*`` matches one name component (a layer index). The model code is untouched: only plans
know tensor parallelism. Style names are those of :mod:`tensorpar.sharding.styles`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


def join_name(anchor: str, suffix: str) -> str:
    """``anchor.suffix``, or ``anchor`` for the empty suffix (the anchor itself)."""
    return f"{anchor}.{suffix}" if suffix else anchor


def parent_name(name: str) -> str:
    return name.rpartition(".")[0]


def pattern_regex(pattern: str) -> re.Pattern:
    return re.compile("".join("[^.]+" if part == "*" else re.escape(part)
                              for part in re.split(r"(\*)", pattern)) + r"\Z")


def compile_plan(styles: dict, valid: tuple) -> list:
    """``[(pattern, regex, style)]``; ValueError for a style outside ``valid``."""
    if not isinstance(styles, dict) or not styles:
        raise ValueError(f"a plan must be a non-empty dict of module-name pattern -> style; got {styles!r}")
    compiled = []
    for pattern, style in styles.items():
        if not isinstance(pattern, str) or style not in valid:
            raise ValueError(f"plan entry {pattern!r}: style {style!r} is not one of {', '.join(valid)}")
        compiled.append((pattern, pattern_regex(pattern), style))
    return compiled


def match_style(compiled: list, names: tuple) -> tuple[str, str] | None:
    """``(pattern, style)`` of the first entry matching any of ``names`` (full, relative)."""
    for pattern, regex, style in compiled:
        if any(n is not None and regex.match(n) for n in names):
            return pattern, style
    return None


def base_prefix(model) -> str | None:
    """``"model."`` for a model whose base model sits under ``model.base_model_prefix``, else None."""
    prefix = getattr(model, "base_model_prefix", "")
    sub = getattr(model, prefix, None) if prefix else None
    from torch import nn
    return prefix + "." if isinstance(sub, nn.Module) and sub is not model else None


def relative_names(name: str, prefix: str | None) -> tuple:
    """``(name, name inside the base model or None)``: what plan patterns are matched against."""
    return name, (name[len(prefix):] if prefix and name.startswith(prefix) else None)


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
        """``(query heads, KV heads)`` on each rank: KV heads split when tp divides them, else one
        replicated KV head per rank."""
        hkv = self.n_kv_heads // tp_size if self.n_kv_heads % tp_size == 0 else 1
        return self.n_heads // tp_size, hkv


@dataclass(frozen=True)
class Unit:
    """Modules of one family block that split together or not at all (an attention block, an MLP).

    Once a user plan shards any module of the unit, every ``members`` entry needs its style: a
    column split without its row partner leaves a sharded activation where a whole one is
    expected, and q split without k, v and the per-rank head counts computes another function
    (heads mixed up) without any error. Names are ``anchor`` + ``.`` + suffix (``""``: the
    anchor itself). ``optional`` entries may be left out: the MLP region entry saves one
    all-reduce of dX in backward but changes no result.
    """
    kind: str  # "attention" or "mlp"
    anchor: str
    members: tuple  # ((suffix, style), ...)
    optional: tuple = ()

    def entries(self) -> list[tuple[str, str]]:
        """``[(pattern, style)]``: the unit's plan entries, optional ones first."""
        return [(join_name(self.anchor, sfx), style) for sfx, style in self.optional + self.members]


def plan_of_units(first: dict, units: tuple, last: dict) -> dict:
    return {**first, **{pat: style for u in units for pat, style in u.entries()}, **last}


@dataclass(frozen=True)
class Placement:
    """One decision of a plan: ``style`` for the module or parameter ``name`` (full name).

    ``options``: what the style needs beyond the module (the widths of a fused projection's
    segments); ``why``: where the decision came from, for the report."""
    name: str
    style: str
    why: str = ""
    options: tuple = ()

    def option(self, key: str, default=None):
        return dict(self.options).get(key, default)


@dataclass
class Resolution:
    """A plan resolved against one model: every placement by concrete name, and what stays whole.

    ``source``: ``"tensorpar"`` (the registry's own plan), ``"declared"`` (the model's
    ``tp_plan``, translated), ``"user"`` or ``"discovered"``. ``whole``: module name -> why
    it is left whole on every rank (a block no style splits exactly, or one that failed its
    proof)."""
    source: str
    arch: str | None
    dims: Dims | None
    placements: dict = field(default_factory=dict)  # name -> Placement
    strict: bool = True  # user plans: an entry that cannot be applied is an error, not a fallback
    whole: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    head_attrs: tuple = ()
    head_config: tuple = ()
    experts: list = field(default_factory=list)  # mixture-of-experts modules whose parameters split
    feasibility: object = None  # the FeasibilityReport of the plan at this tp
    layer_params_total: int = 0  # parameters of the transformer blocks before the split

    def styles(self) -> dict:
        return {n: p.style for n, p in self.placements.items()}


@dataclass(frozen=True)
class StyleContext:
    tp_group: object
    tp_size: int
    tp_rank: int
    dims: Dims | None
    in_region: bool  # an enclosing region entry already copies the input into the TP region
    placement: Placement
    reduce_later: bool = False  # an enclosing region reduces the block's output once


@dataclass
class Built:
    """A builder's result: a replacement ``module`` (None: the dense module stays and gets
    ``params``), the spec of each new parameter (attribute -> ShardSpec, key relative), and the
    attributes of replicated parameters that need :func:`tensorpar.nn.regions.rank0_only`."""
    module: nn.Module | None = None
    specs: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    rank0: tuple = ()
