"""The per-head attention maths shared by the dense and the tensor-parallel attention.

Heads are independent, so a rank holding heads ``[h0, h1)`` runs exactly this code on its own
heads; only the projections around it differ. Rotary embeddings follow the Hugging Face Llama
convention (rotate the two halves of each head), so checkpoints load unchanged (Su et al. 2021,
"RoFormer", eq. 34).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    """Keys and values of the tokens seen so far, for one attention layer on one rank.

    ``k``, ``v``: ``(B, n_kv_heads_per_partition, S, head_dim)`` after rotary, or None when empty.
    Under tensor parallelism each rank caches only its own KV heads: 1/p of the dense cache.
    """

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def seq_len(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def check(self, batch: int, n_kv_heads: int, head_dim: int,
              dtype: torch.dtype | None = None) -> None:
        """ValueError unless keys ``(batch, n_kv_heads, T, head_dim)`` (of ``dtype``, when given)
        can be appended: a layer checks this before its first collective."""
        if self.k is None:
            return
        b, h, _, d = self.k.shape
        if (b, h, d) != (batch, n_kv_heads, head_dim) or dtype not in (None, self.k.dtype):
            want = f"batch {batch}, {n_kv_heads} KV heads, head_dim {head_dim}"
            want += "" if dtype is None else f", dtype {dtype}"
            raise ValueError(f"KVCache holds keys of shape {tuple(self.k.shape)} (B, KV heads, S, "
                             f"head_dim), dtype {self.k.dtype}; this step needs {want}; use "
                             f"one KVCache per layer, rank and batch of sequences")

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's ``(B, h, T, D)`` keys and values; return all ``(B, h, S + T, D)``."""
        self.check(k.shape[0], k.shape[1], k.shape[3])
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def check_attn_mask(mask: torch.Tensor, batch: int, n_heads: int, t: int, s: int) -> torch.Tensor:
    """``mask`` viewed as 4-d ``(B|1, n_heads|1, T|1, S|1)``; ValueError unless it is bool and
    broadcastable to ``(B, n_heads, T, S)`` (queries T, keys S = cached + T)."""
    if mask.dtype != torch.bool:
        raise ValueError(f"attn_mask must be a bool tensor (True = attend); got {mask.dtype}")
    full = (batch, n_heads, t, s)
    if mask.dim() > 4 or any(m not in (1, f) for m, f in zip(mask.shape[::-1], full[::-1])):
        raise ValueError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to "
                         f"(B, n_heads, T, S) = {full}; each dim must be 1 or equal it")
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B|1, hq|1, T|1, S|1)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """``cos, sin: (T, head_dim)`` for integer ``positions: (T,)``.

    Angles ``pos * theta^(-2i/head_dim)`` are computed in float32 (float64 for float64 models),
    as Hugging Face does, then cast to ``dtype``.
    """
    work = torch.promote_types(dtype, torch.float32)
    exponents = torch.arange(0, head_dim, 2, device=positions.device).to(work) / head_dim
    inv_freq = 1.0 / (theta ** exponents)  # (D/2,)
    angles = positions.to(work)[:, None] * inv_freq[None, :]  # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, D)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: (B, h, T, D)`` by position: ``x cos + rotate_half(x) sin``."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, h, T, D/2) each
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _causal_mask(t: int, s: int, offset: int, device) -> torch.Tensor:
    """``(T, S)`` bool, True where query ``offset + i`` may attend key ``j`` (``j <= offset + i``)."""
    rows = torch.arange(t, device=device)[:, None] + offset
    return torch.arange(s, device=device)[None, :] <= rows


def attention_core(q, k, v, *, n_heads: int, n_kv_heads: int, head_dim: int, rotary: bool,
                   rope_theta: float, causal: bool, cache: KVCache | None = None,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0):
    """Multi-head / grouped-query attention on projected ``q: (B, T, n_heads*D)``, ``k, v:
    (B, T, n_kv_heads*D)``; returns ``(B, T, n_heads*D)``.

    ``cache``: keys and values of earlier tokens (positions continue after them; updated in
    place). ``attn_mask``: optional bool, broadcastable to ``(B, n_heads, T, S)``, True =
    attend; combined with the causal mask.
    """
    b, t, _ = q.shape
    q = q.view(b, t, n_heads, head_dim).transpose(1, 2)  # (B, hq, T, D)
    k = k.view(b, t, n_kv_heads, head_dim).transpose(1, 2)  # (B, hkv, T, D)
    v = v.view(b, t, n_kv_heads, head_dim).transpose(1, 2)  # (B, hkv, T, D)
    offset = 0 if cache is None else cache.seq_len
    if rotary:
        positions = torch.arange(offset, offset + t, device=q.device)
        cos, sin = rotary_cos_sin(positions, head_dim, rope_theta, q.dtype)  # (T, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    if cache is not None:
        k, v = cache.append(k, v)  # (B, hkv, S, D), S = offset + T
    if n_heads != n_kv_heads:
        k = k.repeat_interleave(n_heads // n_kv_heads, dim=1)  # (B, hq, S, D)
        v = v.repeat_interleave(n_heads // n_kv_heads, dim=1)
    mask, is_causal = attn_mask, causal and attn_mask is None and offset == 0
    if causal and not is_causal:
        causal_mask = _causal_mask(t, k.shape[2], offset, q.device)  # (T, S)
        mask = causal_mask if attn_mask is None else attn_mask & causal_mask
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                       is_causal=is_causal)  # (B, hq, T, D)
    return o.transpose(1, 2).reshape(b, t, n_heads * head_dim)  # (B, T, hq*D)
