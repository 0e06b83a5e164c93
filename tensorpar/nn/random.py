"""Dropout randomness under tensor parallelism (Megatron-LM ``random.py``, Shoeybi et al. 2019).

Two kinds of activation need two kinds of randomness:

- replicated activations (the residual stream without sequence parallelism): every rank holds
  the same tensor and must drop the same elements, or the copies diverge. They use the default
  torch generator, seeded with the same ``seed`` on every rank of the group.
- sharded activations (attention heads, sequence-parallel chunks): each rank holds different
  elements and must draw independent masks, or the shards' masks would repeat one pattern.
  They use a tracker's state seeded with ``seed + 2718 + tp_rank`` (Megatron's offset).

A tracker is an explicit object passed to the layers that need it; there is no global tracker.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.nn.layers import tp_info

TP_RNG = "tensor-parallel"
_TP_SEED_OFFSET = 2718


class RNGStatesTracker:
    """Named generator states to swap into the default generator of one device type."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: dict[str, int] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists; names in use: {sorted(self._states)}")
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        self._states[name] = generator.get_state()
        self._seeds[name] = seed

    def on(self, device: str | torch.device) -> "RNGStatesTracker":
        """A tracker of the same seeds for ``device``'s generator (a model split on one device and
        run on another: a generator's state is not portable between device types), its states
        drawn afresh from their seeds; this tracker itself when ``device`` is its own."""
        device = torch.device(device)
        if device == self.device:
            return self
        moved = RNGStatesTracker(device)
        for name, seed in self._seeds.items():
            moved.add(name, seed)
        return moved

    def get_state(self, name: str = TP_RNG) -> torch.Tensor:
        """State ``name`` as it stands (a checkpoint keeps it)."""
        return self._states[name].clone()

    def set_state(self, name: str, state: torch.Tensor) -> None:
        if name not in self._states:
            raise ValueError(f"unknown RNG state {name!r}; known: {sorted(self._states)}")
        self._states[name] = state.clone()

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self, name: str = TP_RNG):
        """Draw from state ``name`` inside the block; the default generator is restored after."""
        if name not in self._states:
            raise ValueError(f"unknown RNG state {name!r}; known: {sorted(self._states)}")
        saved = self._get()
        self._set(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self._get()
            self._set(saved)


def model_parallel_seed(seed: int, *, tp_group=None, device: str | torch.device = "cpu"):
    """Seed the default generator with ``seed`` (same on every rank: replicated dropout) and
    return a tracker whose ``TP_RNG`` state is seeded ``seed + 2718 + tp_rank`` (sharded dropout).
    """
    tp_rank = tp_info(tp_group)[1]  # before seeding: a non-member must not disturb the RNG
    torch.manual_seed(seed)
    tracker = RNGStatesTracker(device)
    tracker.add(TP_RNG, seed + _TP_SEED_OFFSET + tp_rank)
    return tracker


class ParallelDropout(nn.Module):
    """Dropout that draws the right kind of mask for where its input lives.

    ``sharded=False`` (replicated input): the default generator, the same mask on every rank.
    ``sharded=True`` (e.g. a sequence-parallel ``(B, T/p, H)`` chunk): ``rng_tracker``'s
    per-rank state, a different mask on every rank. No communication.
    """

    def __init__(self, p: float = 0.0, *, sharded: bool = False, rng_tracker=None):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout p ({p}) must lie in [0, 1)")
        if sharded and rng_tracker is None:
            raise ValueError("sharded=True needs rng_tracker= (see model_parallel_seed)")
        self.p, self.sharded, self.rng_tracker = p, sharded, rng_tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if not self.sharded:
            return F.dropout(x, self.p, training=True)
        with self.rng_tracker.fork():
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}, sharded={self.sharded}"
