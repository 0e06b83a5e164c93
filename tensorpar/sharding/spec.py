"""Which slices of a dense tensor one rank holds: :class:`ShardSpec`, and the piece arithmetic.

A shard is the concatenation, along one dim, of ``pieces`` ``[start, end)`` of the dense tensor
(several pieces for a fused projection: this rank's query heads, then its key heads, then its
value heads), zero-padded to ``pad_to`` rows where a size does not divide (a vocabulary), and
transposed for GPT-2's ``Conv1D``, which stores ``(in, out)``. The same spec slices a dense
tensor in memory (``apply``), reads a checkpoint's slices from disk (``take`` with a
``safe_open`` slice getter), and cuts the dense gradient a test compares a shard's gradient with.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    """This rank's shard of a dense tensor ``key``: the ``pieces`` ``[start, end)`` of ``dim``
    concatenated (None: the whole tensor), zero-padded along ``dim`` to ``pad_to`` rows, then
    transposed if ``transpose`` (GPT-2 Conv1D stores ``(in, out)``)."""
    key: str
    dim: int = 0
    pieces: tuple | None = None
    pad_to: int | None = None
    transpose: bool = False

    @property
    def is_shard(self) -> bool:
        """False for a replicated tensor (the whole of it on every rank)."""
        return self.pieces is not None

    def take(self, get, dtype=None) -> torch.Tensor:
        """The shard, with ``get(index_tuple)`` returning one indexed block of the dense tensor.

        Blocks may be views (of a memory-mapped file or of the dense tensor): each is copied
        once, straight into the result (allocated padded, and transposed in memory when
        ``transpose``), so no block is copied twice and the result owns its memory.
        """
        dim = self.dim if self.pieces is not None else 0
        blocks = [get(())] if self.pieces is None else [
            get((slice(None),) * dim + (slice(start, end),)) for start, end in self.pieces]
        shape = list(blocks[0].shape)
        if shape:
            shape[dim] = max(sum(b.shape[dim] for b in blocks), self.pad_to or 0)
        flip = self.transpose and len(shape) == 2
        buf = blocks[0].new_empty(shape[::-1] if flip else shape, dtype=dtype or blocks[0].dtype)
        out = buf.t() if flip else buf  # (shape) view of buf
        if not shape:
            return buf.copy_(blocks[0])
        offset = 0
        for b in blocks:
            out.narrow(dim, offset, b.shape[dim]).copy_(b)
            offset += b.shape[dim]
        out.narrow(dim, offset, shape[dim] - offset).zero_()  # padding rows
        return buf

    def apply(self, full: torch.Tensor) -> torch.Tensor:
        return self.take(lambda index: full[index])


def even_pieces(size: int, tp_rank: int, tp_size: int, *, offset: int = 0) -> tuple:
    """Rank ``tp_rank``'s contiguous block ``((start, end),)`` of ``size`` split evenly, from ``offset``."""
    per = size // tp_size
    return ((offset + tp_rank * per, offset + (tp_rank + 1) * per),)


def segment_pieces(widths: tuple, tp_rank: int, tp_size: int) -> tuple:
    """Rank ``tp_rank``'s block of every segment of a fused dim ``[seg_0 | seg_1 | ...]``.

    A fused projection stores its outputs side by side (Phi-3's ``qkv_proj``: ``[q | k | v]``;
    a fused MLP: ``[gate | up]``); splitting the fused dim in ``tp`` contiguous blocks would give
    rank 0 all of q and none of v. Each segment is split on its own instead, and this rank's
    blocks concatenated: ``[q_r | k_r | v_r]``, so the module's own ``chunk``/slicing of its
    output still finds q, k and v (with per-rank sizes).
    """
    pieces, start = [], 0
    for width in widths:
        pieces += even_pieces(width, tp_rank, tp_size, offset=start)
        start += width
    return tuple(pieces)
