"""Tensor-parallel versions of ``nn.Embedding`` and ``nn.Linear`` subclasses with a forward of their own.

A subclass whose forward calls ``super().forward(x)`` and then scales or normalises the result
(Gemma's scaled embedding, Dory's logit scale) keeps that forward: the module is rebased on a new
class ``<Prefix><Class>(Class, shard)`` whose ``super().forward`` is the tensor-parallel one
(:class:`~tensorpar.nn.layers.VocabParallelEmbedding`'s lookup or
:class:`~tensorpar.nn.layers.ColumnParallelLinear`'s gathered product), carrying the module's own
attributes, buffers and other parameters.
"""
from __future__ import annotations

import torch
from torch import nn

from tensorpar.nn.layers import ColumnParallelLinear, VocabParallelEmbedding, trains


class _VocabShard(nn.Embedding):
    """``nn.Embedding.forward`` replaced by the vocabulary-parallel lookup: the base an embedding
    subclass is rebased on by :func:`vocab_parallel_like`, so that its own forward, which calls
    ``super().forward(ids)`` and then scales or normalises the rows, keeps doing so."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return VocabParallelEmbedding.forward(self, ids)


_REBASED: dict = {}


def vocab_parallel_like(embedding: nn.Embedding, *, tp_group=None) -> nn.Embedding:
    """This rank's vocabulary rows of an ``nn.Embedding`` subclass with its own forward.

    The result is an instance of ``VocabParallel<Class>``, a subclass of both the embedding's own
    class and :class:`_VocabShard` (method order: the class's forward, then the vocabulary-
    parallel lookup where the class calls ``super().forward``), carrying the class's attributes
    and buffers (Gemma's ``embed_scale``). A subclass whose forward reads ``self.weight`` itself
    instead of calling ``super().forward`` would look up global ids in a local shard:
    ``parallelize`` proves the result against the dense module and leaves such a module whole.
    """
    VocabParallelEmbedding.from_dense(embedding, tp_group=tp_group)  # the same checks, first
    new = _rebase(embedding, _VocabShard, "VocabParallel")
    VocabParallelEmbedding._configure(new, embedding.num_embeddings, embedding.embedding_dim,
                                      embedding.padding_idx, tp_group, False)
    VocabParallelEmbedding._load(new, embedding.weight, embedding.weight.requires_grad)
    return new


class _ColumnShard(nn.Linear):
    """``nn.Linear.forward`` replaced by :class:`ColumnParallelLinear`'s: the base a linear subclass
    is rebased on by :func:`column_parallel_like`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ColumnParallelLinear.forward(self, x)


# every module whose forward is ColumnParallelLinear's (its own, or a rebased subclass's super())
COLUMN_FORWARDS = (ColumnParallelLinear, _ColumnShard)


def _rebase(module, mixin, prefix: str):
    """A new instance of ``<prefix><Class>(Class, mixin)`` carrying ``module``'s attributes, buffers,
    submodules and parameters (the caller replaces the ones it splits by this rank's shards)."""
    cls = type(module)
    rebased = _REBASED.get((cls, mixin))
    if rebased is None:
        rebased = _REBASED[(cls, mixin)] = type(f"{prefix}{cls.__name__}", (cls, mixin), {"__module__": __name__})
    new = rebased.__new__(rebased)
    nn.Module.__init__(new)
    skip = set(new.__dict__)  # nn.Module's own containers, fresh
    new.__dict__.update({k: v for k, v in module.__dict__.items() if k not in skip})
    new._buffers.update(module._buffers)
    new._modules.update(module._modules)
    new._parameters.update(module._parameters)  # in their order; the caller replaces weight (and bias)
    return new


def column_parallel_like(linear: nn.Linear, *, tp_group=None, gather_output: bool = True,
                         pad_out_features: bool = True) -> nn.Linear:
    """This rank's output rows of an ``nn.Linear`` subclass whose own forward calls
    ``super().forward(x)`` and then works on the whole output (Dory's head scales each logit by a
    learned per-token factor): the output is gathered, so the rest of its forward sees every logit.
    Its other parameters stay whole on every rank. ``parallelize`` proves the result."""
    ColumnParallelLinear.from_dense(linear, tp_group=tp_group, gather_output=gather_output,
                                    pad_out_features=pad_out_features)  # the same checks, first
    new = _rebase(linear, _ColumnShard, "ColumnParallel")
    ColumnParallelLinear._configure(new, linear.in_features, linear.out_features, tp_group, gather_output,
                                    False, False, pad_out_features)
    ColumnParallelLinear._load(new, linear.weight, linear.bias, trains(linear))
    return new
