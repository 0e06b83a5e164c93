"""Tensor-parallel self-attention, split by whole heads (Shoeybi et al. 2019, sec. 3, Fig. 3b).

Grouped-query attention with fewer KV heads than ranks replicates KV heads (as vLLM does):
tp must then be a multiple of n_kv_heads, and ranks ``r`` with equal ``r // (p / n_kv_heads)``
share one KV head.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar import distributed as dist
from tensorpar.nn.attention_ops import KVCache, attention_core, check_attn_mask
from tensorpar.nn.dense import Attention
from tensorpar.nn.layers import ColumnParallelLinear, RowParallelLinear, enter_tp_region, tp_info
from tensorpar.architecture.tp_rules import kv_head_of_rank, kv_split, valid_attention_tp_sizes
from tensorpar.nn.validation import check_dtype, check_last_dim, check_sequence_input


def check_head_split(n_heads: int, n_kv_heads: int, tp_size: int) -> None:
    """ValueError listing the valid tp sizes when heads cannot be split over ``tp_size`` ranks."""
    valid = valid_attention_tp_sizes(n_heads, n_kv_heads)
    if tp_size not in valid:
        raise ValueError(f"tp_size ({tp_size}) cannot split n_heads ({n_heads}) and n_kv_heads "
                         f"({n_kv_heads}) by whole heads; valid tp sizes: "
                         f"{', '.join(map(str, valid))}")


class ReplicatedHeadLinear(nn.Module):
    """The projection of one KV head, ``(head_dim, H)``, held by each rank whose query heads use it.

    - forward: none (every replica computes the same keys or values).
    - backward: each replica's weight gradient holds only its own query heads' share; so that
      all replicas step identically, every rank writes its head's gradient into slot ``kv_head``
      of a zero ``(n_kv_heads, head_dim, H[+1])`` buffer and the buffer is all-reduced over the
      tp group (2(p-1)/p * n_kv_heads*head_dim*(H+1)*e bytes; bias in the last column).
      Only when gradients are being taken.
    """

    def __init__(self, linear: nn.Linear, kv_head: int, n_kv_heads: int, head_dim: int, tp_group):
        super().__init__()
        rows = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
        with torch.no_grad():
            self.weight = nn.Parameter(linear.weight[rows].clone(), linear.weight.requires_grad)
            self.bias = (None if linear.bias is None else
                         nn.Parameter(linear.bias[rows].clone(), linear.bias.requires_grad))
        self.kv_head, self.n_kv_heads, self.tp_group = kv_head, n_kv_heads, tp_group

    def _synced(self):
        params = (self.weight,) if self.bias is None else (self.weight, self.bias)
        if not (torch.is_grad_enabled() and any(p.requires_grad for p in params)):
            return self.weight, self.bias  # inference: no buffer, no concatenation
        w = self.weight if self.bias is None else torch.cat([self.weight, self.bias[:, None]], -1)
        h = self.kv_head
        slots = F.pad(w[None], (0, 0, 0, 0, h, self.n_kv_heads - h - 1))  # (n_kv, D, H[+1])
        w = dist.copy_to_tp_region(slots, group=self.tp_group)[h]  # backward: all-reduce
        return (w, None) if self.bias is None else (w[:, :-1], w[:, -1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._synced()
        return F.linear(x, weight, bias)  # (B, T, head_dim)


class ParallelAttention(nn.Module):
    """Self-attention with q/k/v split by whole heads (columns) and the output rows split.

    Rank i holds query heads ``[i*hq, (i+1)*hq)``, ``hq = n_heads/p``, their KV heads
    (``n_kv_heads/p`` of them, or one replicated KV head when ``n_kv_heads < p``), the matching
    rows of ``W_q, W_k, W_v`` and the columns ``W_o,i: (hq*D, H)`` of the output projection;
    ``O_i = attention(X W_q,i, X W_k,i, X W_v,i)`` needs no communication (heads are
    independent), and ``Y = sum_i O_i W_o,i + b_o``.

    - forward: one all-reduce of Y, ``N = B*T*H*e``, 2(p-1)/p * N bytes sent per rank.
    - backward: one all-reduce of dX (same N), shared by q, k and v; plus, with replicated KV
      heads, one all-reduce of each replicated projection's gradient (ReplicatedHeadLinear).
    - ``sequence_parallel``: all-gather X ``(B, T/p, H)`` before, reduce-scatter Y after.
    - KV cache: each rank caches only its own KV heads (a ``KVCache`` per layer per rank).
    - dropout on the attention probabilities acts on sharded heads, so it draws from
      ``rng_tracker`` (tensorpar.nn.random), a different stream on every rank.
    """

    def __init__(self, hidden_size: int, n_heads: int, n_kv_heads: int | None = None, *,
                 head_dim: int | None = None, qkv_bias: bool = False, out_bias: bool = False,
                 rotary: bool = True, rope_theta: float = 10000.0, causal: bool = True,
                 attn_dropout: float = 0.0, rng_tracker=None, tp_group=None,
                 sequence_parallel: bool = False, dtype=None, device=None):
        super().__init__()
        tp_size = tp_info(tp_group)[0]  # a non-member of tp_group is told so first
        n_kv = n_heads if n_kv_heads is None else n_kv_heads
        check_head_split(n_heads, n_kv, tp_size)  # before allocating
        dense = Attention(hidden_size, n_heads, n_kv_heads, head_dim=head_dim, qkv_bias=qkv_bias,
                          out_bias=out_bias, rotary=rotary, rope_theta=rope_theta, causal=causal,
                          attn_dropout=attn_dropout, dtype=dtype, device=device)
        self._shard(dense, tp_group, sequence_parallel, rng_tracker)

    @classmethod
    def from_dense(cls, attention: Attention, *, tp_group=None, sequence_parallel: bool = False,
                   rng_tracker=None) -> "ParallelAttention":
        """This rank's heads of a dense ``tensorpar.nn.dense.Attention``."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._shard(attention, tp_group, sequence_parallel, rng_tracker)
        return self

    def _shard(self, attn, tp_group, sequence_parallel, rng_tracker):
        self.tp_size, self.tp_rank = tp_info(tp_group)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        check_head_split(attn.n_heads, attn.n_kv_heads, self.tp_size)
        if attn.attn_dropout > 0 and rng_tracker is None:
            raise ValueError(f"attn_dropout ({attn.attn_dropout}) > 0 acts on sharded heads and "
                             f"needs rng_tracker= (tensorpar.nn.random.model_parallel_seed)")
        for name in ("hidden_size", "n_heads", "n_kv_heads", "head_dim", "rotary", "rope_theta",
                     "causal", "attn_dropout"):
            setattr(self, name, getattr(attn, name))
        self.rng_tracker = rng_tracker
        self.n_heads_per_partition = attn.n_heads // self.tp_size
        self.n_kv_heads_per_partition, self.kv_replicas = kv_split(attn.n_kv_heads, self.tp_size)
        self.q_proj = ColumnParallelLinear.from_dense(attn.q_proj, tp_group=tp_group,
                                                      skip_input_comm=True)
        self.k_proj, self.v_proj = self._kv(attn.k_proj), self._kv(attn.v_proj)
        self.o_proj = RowParallelLinear.from_dense(attn.o_proj, tp_group=tp_group,
                                                   sequence_parallel=sequence_parallel)

    def _kv(self, linear: nn.Linear) -> nn.Module:
        if self.kv_replicas == 1:
            return ColumnParallelLinear.from_dense(linear, tp_group=self.tp_group,
                                                   skip_input_comm=True)
        return ReplicatedHeadLinear(linear, kv_head_of_rank(self.tp_rank, self.tp_size, self.n_kv_heads),
                                    self.n_kv_heads, self.head_dim, self.tp_group)

    def forward(self, x: torch.Tensor, *, cache: KVCache | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x: (B, T, H)`` (``(B, T/p, H)`` with sequence parallelism) -> same shape.

        ``attn_mask``: bool, broadcastable to ``(B, n_heads, T, S)`` over the full sequence
        (T tokens, S = cached + T keys), True = attend; a per-head mask is cut to this rank's
        heads.
        """
        mask_shard = self._check_inputs(x, cache, attn_mask)
        x = enter_tp_region(x, self.tp_group, self.sequence_parallel)  # (B, T, H)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (B, T, heads_local*D)
        dropout_p = self.attn_dropout if self.training else 0.0
        fork = self.rng_tracker.fork() if dropout_p > 0 else contextlib.nullcontext()
        with fork:
            o_shard = attention_core(q, k, v, n_heads=self.n_heads_per_partition,
                                     n_kv_heads=self.n_kv_heads_per_partition,
                                     head_dim=self.head_dim, rotary=self.rotary,
                                     rope_theta=self.rope_theta, causal=self.causal, cache=cache,
                                     attn_mask=mask_shard, dropout_p=dropout_p)  # (B, T, hq*D)
        return self.o_proj(o_shard)  # (B, T, H) summed over ranks

    def _check_inputs(self, x, cache, attn_mask) -> torch.Tensor | None:
        """Every check of the input, cache and mask, before the first collective (the sequence
        all-gather or, in o_proj, the all-reduce); returns this rank's heads of the mask."""
        check_last_dim(x, self.hidden_size, "hidden_size")
        check_dtype(x, self.q_proj.weight, type(self).__name__)
        if self.sequence_parallel:
            check_sequence_input(x, type(self).__name__)
        if cache is not None:
            autocast = torch.is_autocast_enabled(x.device.type)
            cache.check(x.shape[0], self.n_kv_heads_per_partition, self.head_dim,
                        None if autocast else self.q_proj.weight.dtype)
        if attn_mask is None:
            return None
        t = x.shape[1] * (self.tp_size if self.sequence_parallel else 1)  # the full sequence
        s = t + (0 if cache is None else cache.seq_len)
        mask = check_attn_mask(attn_mask, x.shape[0], self.n_heads, t, s)  # (B|1, hq|1, T|1, S|1)
        if mask.shape[1] == 1:
            return mask
        hq = self.n_heads_per_partition
        return mask[:, self.tp_rank * hq:(self.tp_rank + 1) * hq]  # (B|1, n_heads/p, T|1, S|1)
