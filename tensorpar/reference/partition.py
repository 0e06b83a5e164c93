"""Partition one axis of an N-d array into ``p`` shards, one per simulated device, and undo it.

An axis of ``n`` elements is split by one of three modes:

``"even"``
    ``n % p == 0`` and ``n >= p``; rank ``r`` owns ``[r * n/p, (r + 1) * n/p)``. Anything else is a
    ``ValueError`` listing the valid ``p``.
``"pad"``
    The rule of ``docs/architecture.md``, which the torch runtime uses for vocabularies:
    ``padded = ceil(n / p) * p``, ``per_partition = padded // p``, rank ``r`` owns
    ``[min(r * per_partition, n), min((r + 1) * per_partition, n))``. Each shard is zero-padded at
    the end of the axis to ``per_partition`` elements, so all shards have one shape (what real
    collectives need); the last rank holds only padding when ``n <= padded - per_partition``. Zero
    padding adds nothing to a contraction, and a gathered result is trimmed back to ``n``.
``"remainder"``
    ``numpy.array_split``'s rule: the first ``n % p`` ranks own ``n // p + 1`` elements, the rest
    ``n // p``; no padding, so shard shapes differ by at most one along the axis.
"""
from __future__ import annotations

import numpy as np

from .validation import as_numeric, check_choice, check_divides, check_p, check_shape, normalize_axis

MODES = ("even", "pad", "remainder")


def partition_bounds(n, p, mode: str = "even") -> list[tuple[int, int]]:
    """The ``[start, stop)`` of the real (unpadded) elements each rank owns on an axis of ``n``."""
    (n,) = check_shape((n,), "n")
    p = check_p(p)
    check_choice(mode, "mode", MODES)
    if mode == "even":
        check_divides(n, p, "the axis", hint="; or use mode='pad' or mode='remainder'")
        per = n // p
        return [(r * per, (r + 1) * per) for r in range(p)]
    if mode == "pad":
        per = per_partition(n, p)
        return [(min(r * per, n), min((r + 1) * per, n)) for r in range(p)]
    base, extra = divmod(n, p)
    starts = [r * base + min(r, extra) for r in range(p + 1)]
    return list(zip(starts[:-1], starts[1:]))


def per_partition(n: int, p: int) -> int:
    """Elements per shard under ``"pad"``: ``ceil(n / p)``."""
    return -(-n // p)


def partition(x, p, axis: int = -1, mode: str = "even") -> list[np.ndarray]:
    """Split ``x`` along ``axis`` into ``p`` shards (copies: each simulated device owns its memory)."""
    x = as_numeric(x, "x")
    p = check_p(p)
    axis = normalize_axis(axis, x.ndim, "x")
    n = x.shape[axis]
    if mode == "even":
        check_divides(n, p, f"axis {axis} of x (shape {x.shape})",
                      hint="; or use mode='pad' or mode='remainder'")
    bounds = partition_bounds(n, p, mode)
    shards = [np.take(x, np.arange(start, stop), axis=axis) for start, stop in bounds]
    if mode == "pad":
        shards = [_pad_to(s, per_partition(n, p), axis) for s in shards]
    return shards


def unpartition(shards, axis: int = -1, size: int | None = None) -> np.ndarray:
    """Concatenate shards along ``axis`` and, if ``size`` is given, trim padding back to ``size``."""
    shards = [as_numeric(s, f"shards[{r}]") for r, s in enumerate(shards)]
    if not shards:
        raise ValueError("shards must hold at least one array, got none")
    axis = normalize_axis(axis, shards[0].ndim, "shards[0]")
    full = np.concatenate(shards, axis=axis)
    if size is None:
        return full
    (size,) = check_shape((size,), "size")
    if size > full.shape[axis]:
        raise ValueError(f"size ({size}) exceeds the {full.shape[axis]} elements "
                         f"the shards hold on axis {axis}")
    return np.take(full, np.arange(size), axis=axis)


def _pad_to(shard: np.ndarray, length: int, axis: int) -> np.ndarray:
    widths = [(0, 0)] * shard.ndim
    widths[axis] = (0, length - shard.shape[axis])
    return np.pad(shard, widths)
