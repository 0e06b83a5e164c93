"""Plain-torch (unsplit) transformer blocks: the references the parallel blocks are sliced from.

``MLP`` and ``Attention`` use Hugging Face Llama parameter names (``gate_proj``, ``up_proj``,
``down_proj``; ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``), each an ``nn.Linear`` with
``weight: (out, in)``, so ``ParallelMLP.from_dense`` / ``ParallelAttention.from_dense`` are
slices and ``tensorpar.models`` can build reference transformers from them.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.nn.attention_ops import KVCache, attention_core, check_attn_mask
from tensorpar.nn.validation import check_choice, check_positive

ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": partial(F.gelu, approximate="tanh"), "relu": F.relu,
               "swiglu": F.silu, "geglu": F.gelu}
GATED = ("swiglu", "geglu")


def mlp_hidden(x: torch.Tensor, mlp) -> torch.Tensor:
    """``act(x U)`` or, gated, ``act(x G) * (x U)``: the FFN hidden state of ``mlp``."""
    act = ACTIVATIONS[mlp.activation]
    if mlp.gate_proj is None:
        return act(mlp.up_proj(x))
    return act(mlp.gate_proj(x)) * mlp.up_proj(x)


class MLP(nn.Module):
    """``Y = act(X U) D`` (gelu, gelu_tanh, relu) or ``Y = (act(X G) * X U) D`` (swiglu, geglu)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, activation: str = "gelu",
                 bias: bool = True, dtype=None, device=None):
        super().__init__()
        check_choice(activation, "activation", tuple(ACTIVATIONS))
        check_positive(hidden_size, "hidden_size")
        check_positive(ffn_hidden_size, "ffn_hidden_size")
        self.hidden_size, self.ffn_hidden_size, self.activation = hidden_size, ffn_hidden_size, activation
        linear = partial(nn.Linear, bias=bias, dtype=dtype, device=device)
        self.gate_proj = linear(hidden_size, ffn_hidden_size) if activation in GATED else None
        self.up_proj = linear(hidden_size, ffn_hidden_size)
        self.down_proj = linear(ffn_hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(mlp_hidden(x, self))  # (B, T, H)


class Attention(nn.Module):
    """Causal multi-head / grouped-query self-attention with rotary embeddings and a KV cache.

    ``q_proj: (n_heads*head_dim, H)``, ``k_proj, v_proj: (n_kv_heads*head_dim, H)``, rows
    grouped by head; query head ``i`` reads KV head ``i // (n_heads // n_kv_heads)``.
    """

    def __init__(self, hidden_size: int, n_heads: int, n_kv_heads: int | None = None, *,
                 head_dim: int | None = None, qkv_bias: bool = False, out_bias: bool = False,
                 rotary: bool = True, rope_theta: float = 10000.0, causal: bool = True,
                 attn_dropout: float = 0.0, dtype=None, device=None):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        _check_heads(hidden_size, n_heads, n_kv_heads, head_dim, rotary)
        self.hidden_size, self.n_heads, self.n_kv_heads = hidden_size, n_heads, n_kv_heads
        self.head_dim = hidden_size // n_heads if head_dim is None else head_dim
        self.rotary, self.rope_theta, self.causal = rotary, rope_theta, causal
        self.attn_dropout = attn_dropout
        linear = partial(nn.Linear, dtype=dtype, device=device)
        self.q_proj = linear(hidden_size, n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = linear(hidden_size, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = linear(hidden_size, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = linear(n_heads * self.head_dim, hidden_size, bias=out_bias)

    def forward(self, x: torch.Tensor, *, cache: KVCache | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x: (B, T, H)`` -> ``(B, T, H)``; ``cache`` continues an earlier sequence;
        ``attn_mask``: bool, broadcastable to ``(B, n_heads, T, S)``, True = attend."""
        if attn_mask is not None:
            s = x.shape[1] + (0 if cache is None else cache.seq_len)
            attn_mask = check_attn_mask(attn_mask, x.shape[0], self.n_heads, x.shape[1], s)
        o = attention_core(self.q_proj(x), self.k_proj(x), self.v_proj(x),
                           n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                           head_dim=self.head_dim, rotary=self.rotary, rope_theta=self.rope_theta,
                           causal=self.causal, cache=cache, attn_mask=attn_mask,
                           dropout_p=self.attn_dropout if self.training else 0.0)  # (B, T, hq*D)
        return self.o_proj(o)


def _check_heads(hidden_size, n_heads, n_kv_heads, head_dim, rotary):
    for value, name in ((hidden_size, "hidden_size"), (n_heads, "n_heads"),
                        (n_kv_heads, "n_kv_heads")):
        check_positive(value, name)
    if n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads})")
    if head_dim is None and hidden_size % n_heads:
        raise ValueError(f"n_heads ({n_heads}) must divide hidden_size ({hidden_size}) when "
                         f"head_dim is not given")
    if head_dim is not None:
        check_positive(head_dim, "head_dim")
    if rotary and (head_dim or hidden_size // n_heads) % 2:
        raise ValueError(f"head_dim ({head_dim or hidden_size // n_heads}) must be even "
                         f"(rotary embeddings rotate pairs)")
