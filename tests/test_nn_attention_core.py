"""``attention_core`` against attention written out by hand (float64, no shared code): the layer
tests compare the parallel attention with a dense one that calls the same core, so a core that
ignored its mask, its cache offset or its KV-head grouping would pass them all.

Reference: for each batch row b and query head h (KV head h // (hq / hkv)),
``softmax(q k^T / sqrt(D) + bias) v`` with bias -inf where the causal mask (query at position
offset + i sees keys j <= offset + i) or the given mask forbids; rotary as cos/sin of
``pos * theta^(-2i/D)`` on the two halves. Tolerance 1e-12: the same products summed in another
order in float64.
"""
import math

import pytest
import torch

from tensorpar.nn.attention_ops import KVCache, attention_core

B, HQ, HKV, D, THETA = 2, 4, 2, 8, 10000.0


def _rope(x, positions):
    """(B, h, T, D) rotated by position, written out per element pair."""
    half = D // 2
    freq = torch.tensor([THETA ** (-2 * i / D) for i in range(half)], dtype=torch.float64)
    ang = positions[:, None].double() * freq[None, :]  # (T, D/2)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _by_hand(q, k, v, mask, offset, rotary):
    """q: (B, T, HQ*D), k, v: (B, S, HKV*D) holding every key from position 0; mask (B, HQ, T, S) bool."""
    t, s = q.shape[1], k.shape[1]
    q = q.view(B, t, HQ, D).transpose(1, 2)
    k = k.view(B, s, HKV, D).transpose(1, 2)
    v = v.view(B, s, HKV, D).transpose(1, 2)
    if rotary:
        q, k = _rope(q, torch.arange(offset, offset + t)), _rope(k, torch.arange(s))
    out = torch.empty(B, HQ, t, D, dtype=torch.float64)
    for b in range(B):
        for h in range(HQ):
            g = h // (HQ // HKV)
            scores = q[b, h] @ k[b, g].T / math.sqrt(D)  # (T, S)
            for i in range(t):
                for j in range(s):
                    if j > offset + i or (mask is not None and not mask[b, h, i, j]):
                        scores[i, j] = -math.inf
            out[b, h] = torch.softmax(scores, dim=-1) @ v[b, g]
    return out.transpose(1, 2).reshape(B, t, HQ * D)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_core_equals_attention_by_hand_with_masks_and_a_cache(rotary, masked):
    prompt, new = 5, 3  # a prefill of 5 tokens, then 3 decoding steps of one token through the cache
    s = prompt + new
    q_all, k_all, v_all = _rand(B, s, HQ * D, seed=1), _rand(B, s, HKV * D, seed=2), _rand(B, s, HKV * D, seed=3)
    mask = None
    if masked:  # row 0 may not see key 1, row 1 not keys 2 and 3, for every head (no query sees nothing)
        mask = torch.ones(B, HQ, s, s, dtype=torch.bool)
        mask[0, :, :, 1] = False
        mask[1, :, :, [2, 3]] = False
    kw = dict(n_heads=HQ, n_kv_heads=HKV, head_dim=D, rotary=rotary, rope_theta=THETA, causal=True)
    cache = KVCache()
    got = [attention_core(q_all[:, :prompt], k_all[:, :prompt], v_all[:, :prompt], cache=cache,
                          attn_mask=None if mask is None else mask[:, :, :prompt, :prompt], **kw)]
    for i in range(prompt, s):
        got.append(attention_core(q_all[:, i:i + 1], k_all[:, i:i + 1], v_all[:, i:i + 1], cache=cache,
                                  attn_mask=None if mask is None else mask[:, :, i:i + 1, :i + 1], **kw))
    want = [_by_hand(q_all[:, :prompt], k_all[:, :prompt], v_all[:, :prompt],
                     None if mask is None else mask[:, :, :prompt, :prompt], 0, rotary)]
    for i in range(prompt, s):
        want.append(_by_hand(q_all[:, i:i + 1], k_all[:, :i + 1], v_all[:, :i + 1],
                             None if mask is None else mask[:, :, i:i + 1, :i + 1], i, rotary))
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() <= 1e-12 * w.abs().max().item()
    if masked:  # the mask changes the result: the comparison has power over it
        unmasked = attention_core(q_all[:, :prompt], k_all[:, :prompt], v_all[:, :prompt], **kw)
        assert (unmasked - want[0]).abs().max().item() > 1e-3
