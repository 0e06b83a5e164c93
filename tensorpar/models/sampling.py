"""Choosing the next token from candidates that every rank holds identically.

A split model's output head leaves each rank the logits of its own vocabulary shard. Instead of
gathering ``B x V`` logits, each rank offers *candidates* — its best ``k`` values and their
vocabulary indices (``k = 1`` for greedy, ``top_k`` when sampling with it) — and one all-gather
of ``B x tp x k`` (value, index) pairs gives every rank the same candidates, from which every
rank computes the same token: no broadcast. The global best ``k`` are among the candidates,
since each is among its shard's best ``k``. Sampling without ``top_k`` needs every logit: the
shards are gathered (``B x V``) and every index is a candidate.

The choice, on candidates ``(values, indices)`` (float64 values: exact for any model dtype):

- greedy: the largest value, the smallest index among equal ones (``torch.argmax``'s rule);
- sampling (``do_sample``): values divided by ``temperature``; if ``top_k``, only the ``top_k``
  largest kept; if ``top_p < 1``, only the smallest set of the largest whose probability
  (softmax over the kept) reaches ``top_p`` (Holtzman et al. 2020, "The Curious Case of Neural
  Text Degeneration", Sec. 3.1; the order of Hugging Face's ``generate``: temperature, top-k,
  top-p); then the Gumbel-max trick (Gumbel 1954; Maddison et al. 2014, "A* Sampling", Sec. 2):
  ``argmax(value + G)``, ``G = -log(-log U)``, is an exact draw from the softmax. ``U`` for
  row ``b``, vocabulary index ``v`` at step ``t`` is element ``(b, v)`` of
  ``numpy.random.Generator(PCG64(SeedSequence(words))).random((B, V))`` (float64), ``words`` the
  four 32-bit words ``(seed mod 2**32, seed >> 32, t mod 2**32, t >> 32)``: it depends only on
  the seed, the step and the index, so a split model and the unsplit one with the same seed draw
  the same token from the same logits, and so do all ranks; and every (seed, step) has a stream
  of its own, independent of the others (SeedSequence's hash of an injective key into PCG64's
  128-bit state). torch's CPU generator would not do: it keeps only the low 32 bits of its seed
  (seeds 0 and 2**32 draw the same numbers), so no seed derived from (seed, step) can give every
  pair its own stream.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Sampler:
    """How the next token is chosen; validated at construction (``ValueError`` naming the value)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be True or False, got {self.do_sample!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature <= 0:
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")

    @property
    def shard_gumbel(self) -> bool:
        """Plain sampling (no top-k, no top-p): each shard adds its columns' Gumbel noise and
        offers its best perturbed score, since the argmax over the vocabulary is the largest of
        the shards' argmaxes."""
        return self.do_sample and self.top_k is None and self.top_p == 1

    @property
    def candidates(self) -> int | None:
        """Candidates each shard offers: 1 (greedy, plain sampling), ``top_k``, or None (top-p
        without top-k: the nucleus needs every probability, so every logit)."""
        if not self.do_sample or self.shard_gumbel:
            return 1
        return self.top_k


def uniform(seed: int, step: int, batch: int, vocab_size: int) -> torch.Tensor:
    """``U`` of step ``step`` (see the module): (B, V) float64 in [0, 1), the same on every rank."""
    # Fixed-width words: SeedSequence reads a list of ints as variable-width words, so (2**32, 5)
    # and (0, 1 + 5 * 2**32) would be one key; four 32-bit words make the key injective.
    words = np.array([seed & 0xFFFFFFFF, seed >> 32, step & 0xFFFFFFFF, step >> 32], dtype=np.uint32)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(words)))
    return torch.from_numpy(rng.random((batch, vocab_size)))


def gumbel(sampler: Sampler, step: int, batch: int, vocab_size: int, device=None) -> torch.Tensor:
    """``G = -log(-log U)`` for every row and vocabulary index of step ``step``: (B, V) float64,
    computed on the host (the same bits whatever device samples) and moved to ``device``."""
    return (-torch.log(-torch.log(uniform(sampler.seed, step, batch, vocab_size)))).to(device)


def choose(values: torch.Tensor, indices: torch.Tensor, sampler: Sampler, step: int, vocab_size: int, *,
           perturbed: bool = False) -> torch.Tensor:
    """The next token of each row, ``(B,)`` int64, from candidates ``values`` (B, M) float64 and
    their vocabulary ``indices`` (B, M); ``-inf`` values are never chosen. ``perturbed``: the
    values already carry their temperature and Gumbel noise (:attr:`Sampler.shard_gumbel`)."""
    if bool(torch.isnan(values).any()):
        raise ValueError(f"the logits of step {step} contain NaN: no token can be chosen (the model's "
                         f"weights or inputs are not finite)")
    if not sampler.do_sample or perturbed:
        return _best(values, indices)
    scores = values / sampler.temperature
    if sampler.top_k is not None and sampler.top_k < scores.shape[1]:
        keep = first_k(scores, indices, sampler.top_k)
        scores = scores.masked_fill(~keep, -math.inf)
    if sampler.top_p < 1:
        scores = _nucleus(scores, indices, sampler.top_p)
    # a shard's padding columns past the vocabulary are candidates at -inf: never chosen, noise at any index
    at = indices.clamp(max=vocab_size - 1)
    noise = gumbel(sampler, step, values.shape[0], vocab_size, values.device).gather(1, at)  # (B, M), at the candidates
    return _best(scores + noise, indices)


def _order(scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Positions (B, M) of the candidates by (score descending, index ascending): a strict order,
    so a split model's candidates (rank by rank) and the unsplit model's rank alike."""
    by_index = indices.argsort(dim=1, stable=True)  # (B, M)
    by_score = scores.gather(1, by_index).argsort(dim=1, descending=True, stable=True)
    return by_index.gather(1, by_score)


def first_k(scores: torch.Tensor, indices: torch.Tensor, k: int) -> torch.Tensor:
    """Mask (B, M) of the ``k`` first candidates in :func:`_order`: the ``k`` kept from a shard's
    candidates are the ``k`` kept from the whole vocabulary."""
    kept = _order(scores, indices)[:, :k]  # (B, k): positions in the candidates
    return torch.zeros_like(scores, dtype=torch.bool).scatter(1, kept, True)


def _best(scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Per row: the index of the largest score, the smallest index among ties."""
    top = scores.max(dim=1, keepdim=True).values  # (B, 1)
    tied = indices.masked_fill(scores != top, torch.iinfo(torch.long).max)
    return tied.min(dim=1).values


def _nucleus(scores: torch.Tensor, indices: torch.Tensor, top_p: float) -> torch.Tensor:
    """``scores`` with all but the smallest set of the largest reaching probability ``top_p`` at
    -inf, taken in :func:`_order` (ties at the boundary broken by index, as on every path)."""
    order = _order(scores, indices)  # (B, M)
    ordered = scores.gather(1, order)
    probs = ordered.softmax(dim=1)
    before = probs.cumsum(dim=1) - probs  # probability of the ones ahead in the order
    drop_sorted = before >= top_p  # the first is always kept (before = 0 < top_p)
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return scores.masked_fill(drop, -math.inf)
