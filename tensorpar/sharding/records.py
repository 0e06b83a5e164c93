"""The typed records that carry ``parallelize``'s work from one step to the next.

``declare`` -> :class:`Declaration` (which plan, in tensorpar's styles) -> ``resolve`` ->
:class:`Resolution` (a style per concrete module and parameter, the regions, what stays whole)
-> ``check`` (a :class:`~tensorpar.architecture.tp_rules.FeasibilityReport`) -> ``place`` ->
:class:`Shards` (every replacement module and parameter shard, built; nothing changed yet) ->
``commit`` (the model changed, an undo log) -> ``prove`` (the blocks that failed).

Plans themselves are data (``tensorpar.architecture.plans``: patterns, units, generic names).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from tensorpar.architecture.plans import parent_name  # noqa: F401 - re-exported for sharding/inventory.py
from tensorpar.architecture.tp_rules import Dims


def base_prefix(model) -> str | None:
    """``"model."`` for a model whose base model sits under ``model.base_model_prefix``, else None."""
    prefix = getattr(model, "base_model_prefix", "")
    sub = getattr(model, prefix, None) if prefix else None
    return prefix + "." if isinstance(sub, nn.Module) and sub is not model else None


@dataclass(frozen=True)
class Declaration:
    """Step 1's record: the plan chosen for a model, in tensorpar's style names.

    ``source``: ``"tensorpar"`` (the registry's own plan), ``"declared"`` (the model's
    ``tp_plan``, translated), ``"user"`` or ``"discovered"`` (no entries: pairs are found by
    running the model). ``untranslated``: declared patterns with no exact translation, and why
    (their blocks stay whole); ``segments``: the widths of fused projections' segments."""
    source: str
    model_type: str | None
    entries: dict
    segments: dict = field(default_factory=dict)
    untranslated: dict = field(default_factory=dict)

    @property
    def strict(self) -> bool:
        """A user's plan: an entry that cannot be applied is an error, not a fallback."""
        return self.source == "user"


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


@dataclass
class Shards:
    """Step 4's record: every placement's :class:`Built`, for one rank; nothing in the model has
    changed. ``refused``: what the builders refused (left whole), and why."""
    tp_size: int
    tp_rank: int
    built: dict = field(default_factory=dict)  # name -> Built
    refused: dict = field(default_factory=dict)  # name -> why
