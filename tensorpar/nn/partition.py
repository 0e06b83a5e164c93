"""How a dimension is split across the ``tp_size`` ranks of a tensor-parallel group.

Even splits (heads, hidden and FFN widths) must divide exactly; ``divide`` raises otherwise.
Uneven splits (a vocabulary) follow the padding rule of docs/architecture.md:

    padded        = ceil(n / tp_size) * tp_size
    per_partition = padded // tp_size
    rank r owns [r * per_partition, min((r + 1) * per_partition, n))

Rows past ``n`` are zero padding; every layer masks them wherever they could change a result.
"""
from __future__ import annotations


def valid_tp_sizes(*sizes: int) -> list[int]:
    """The tp sizes that divide every one of ``sizes`` (the common divisors, ascending)."""
    limit = min(sizes)
    return [t for t in range(1, limit + 1) if all(s % t == 0 for s in sizes)]


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


def valid_attention_tp_sizes(n_heads: int, n_kv_heads: int) -> list[int]:
    """tp sizes that split attention by whole heads.

    tp must divide n_heads; the KV heads either split too (tp divides n_kv_heads) or, when
    there are fewer KV heads than ranks, are replicated (tp is a multiple of n_kv_heads).
    """
    return [t for t in range(1, n_heads + 1)
            if n_heads % t == 0 and (n_kv_heads % t == 0 or t % n_kv_heads == 0)]
