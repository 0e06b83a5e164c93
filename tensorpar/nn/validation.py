"""Input checks that raise ValueError before any collective is issued.

A collective issued with a bad tensor on one rank either hangs the other ranks or fails far from
the cause; so every parallel layer validates shapes, sizes and dtypes on entry, with a message
that names the value and what would have been valid.
"""
from __future__ import annotations

import torch


def check_choice(value, name: str, choices) -> None:
    """``value`` must be one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} ({value!r}) must be one of {', '.join(map(repr, choices))}")


def check_positive(value: int, name: str) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} ({value!r}) must be a positive integer")


def check_last_dim(x: torch.Tensor, expected: int, name: str, why: str = "") -> None:
    """``x.shape[-1] == expected`` (e.g. the layer's in_features_per_partition)."""
    if x.dim() < 1 or x.shape[-1] != expected:
        got = tuple(x.shape)
        raise ValueError(f"input of shape {got}: last dim must equal {name} ({expected}){why}")


def check_dtype(x: torch.Tensor, weight: torch.Tensor, layer: str) -> None:
    """Input and weight dtypes must match (unless autocast chooses the compute dtype)."""
    if x.dtype == weight.dtype or torch.is_autocast_enabled(x.device.type):
        return
    raise ValueError(f"{layer}: input dtype ({x.dtype}) does not match the weight dtype "
                     f"({weight.dtype}); cast one of them (x.to({weight.dtype}))")


def check_sequence_input(x: torch.Tensor, what: str) -> None:
    """A sequence-parallel input is a ``(B, T/p, H)`` chunk of the sequence."""
    if x.dim() < 3:
        raise ValueError(f"{what}: a sequence_parallel input must be (B, T/p, H); "
                         f"got shape {tuple(x.shape)}")


def check_seq_divisible(x: torch.Tensor, dim: int, tp_size: int, what: str) -> None:
    """Sequence-parallel reduce-scatter needs ``x.shape[dim]`` divisible by tp_size."""
    if x.dim() <= dim or x.shape[dim] % tp_size != 0:
        raise ValueError(f"{what}: sequence parallelism splits dim {dim} of the input "
                         f"{tuple(x.shape)} into tp_size ({tp_size}) parts; that size must be "
                         f"a multiple of {tp_size}")


def check_ids(ids: torch.Tensor, num_embeddings: int) -> None:
    """Token ids: integer dtype, every id in ``[0, num_embeddings)``."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"token ids must be an integer tensor; got dtype {ids.dtype}")
    if not ids.numel():
        return
    lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # one pass over the ids, one device sync
    if lo < 0 or hi >= num_embeddings:
        raise ValueError(f"token ids must lie in [0, {num_embeddings}); got min {lo}, max {hi}")
