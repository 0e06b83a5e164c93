"""Where the planner reads a model from: a :class:`ModelSource` hands it the model split at each tp.

Every feature of the planner (memory, collectives, FLOPs, bounds, estimates, the search) reads
one record, the :class:`~tensorpar.architecture.split_model.SplitModel` of the model at the tp a
layout asks for, and never knows which producer made it:

- :class:`TemplateSource`: a :class:`~tensorpar.planner.models.ModelSpec` (a preset, ``--family``
  shapes, a published reference case) worked out by :mod:`tensorpar.architecture.templates`,
  standard library only;
- ``tensorpar.sharding.inventory.MetaSource``: any ``config.json`` ``parallelize`` splits, built
  on the meta device as the runtime splits it (torch and transformers; the CLI's choice for a
  config).

A source answers ``at(tp)`` (a ``ValueError`` naming the valid tp sizes when tp does not fit),
``valid_tp_sizes()``, ``describe()`` (the model as the report shows it) and carries ``name``,
``seq`` (the sequence planned for) and ``seq_source`` (where that came from).
"""
from __future__ import annotations

from typing import Protocol

from tensorpar.architecture import templates
from tensorpar.architecture.split_model import SplitModel

from .models import ModelSpec


class ModelSource(Protocol):
    name: str
    seq: int
    seq_source: str

    def at(self, tp: int) -> SplitModel: ...

    def valid_tp_sizes(self) -> list: ...

    def describe(self) -> dict: ...


def template_shape(spec: ModelSpec) -> templates.Shape:
    """The template's sizes of ``spec`` (its sequence is the plan's, not the model's)."""
    return templates.Shape(family=spec.family, layers=spec.layers, hidden=spec.hidden, heads=spec.heads,
                   kv_heads=spec.kv_heads, head_dim=spec.head_dim, ffn=spec.ffn, vocab=spec.vocab,
                   tied=bool(spec.tied_embeddings), qkv_bias=bool(spec.qkv_bias) and spec.family == "llama",
                   qk_norm=spec.qk_norm, positions=spec.position_table if spec.family == "gpt" else 0,
                   window=spec.sliding_window, window_layers=spec.window_layers or 0, name=spec.name)


class TemplateSource:
    """A :class:`ModelSpec` as the runtime would split it (each tp worked out once)."""

    def __init__(self, spec: ModelSpec):
        self.spec, self.name, self.seq, self.seq_source = spec, spec.name, spec.seq, spec.seq_source
        self._shape = template_shape(spec)
        self._splits: dict = {}
        self._valid = list(templates.feasibility(self._shape, 1).valid_tp_sizes)

    def at(self, tp: int) -> SplitModel:
        if tp not in self._splits:
            self._splits[tp] = templates.split(self._shape, tp)
        return self._splits[tp]

    def valid_tp_sizes(self) -> list:
        return list(self._valid)

    def describe(self) -> dict:
        return {**self.spec.to_dict(), "model_type": self._shape.model_type}


def source_of(model) -> ModelSource:
    """``model`` as a source: a :class:`ModelSpec` through its template, a source as it is."""
    if isinstance(model, ModelSpec):
        return TemplateSource(model)
    if all(callable(getattr(model, m, None)) for m in ("at", "valid_tp_sizes", "describe")):
        return model
    raise ValueError(f"model must be a ModelSpec or a model source (at, valid_tp_sizes, describe); "
                     f"got {type(model).__name__}")
