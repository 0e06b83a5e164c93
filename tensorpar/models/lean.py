"""A lean forward for generating with Llama-family models (Llama, Mistral, Qwen2), split or not.

Why: at batch 1 a decode step of a small model is mostly Python, not arithmetic. Hugging Face's
forward walks ~15 modules per layer, builds masks and cache objects every step; under tensor
parallelism every rank pays all of that in full while its matmuls shrink by ``tp``, so the
split model can be slower than the unsplit one (the decode suite measured 1.5x). This path runs
the same arithmetic as straight-line code over the model's own weights, with a preallocated
KV cache, and calls the model's own modules where its numerics live (RMSNorm, the rotary
embedding, the embedding table, the activation), so it computes what the model computes: the
generation tests compare every step's logits against Hugging Face's forward of the unsplit
model (float64, 1e-10).

Per layer, on each rank (``B`` rows, ``T`` new tokens, ``L`` cached + new positions, ``nh`` /
``nkv`` this rank's query / KV heads, ``hd`` the head size)::

    a = rms1(x);  q, k, v = a Wq_i, a Wk_i, a Wv_i        # (B, T, nh hd), (B, T, nkv hd) x2
    q, k = rope(q), rope(k);  cache[:, :, L-T:L] = k, v    # (B, nkv, L, hd)
    o = sdpa(q, K, V, causal, padding) Wo_i               # (B, T, H) partial -> all-reduce
    x = x + o;  x = x + (silu(b Wg_i) * b Wu_i) Wd_i      # b = rms2(x); partial -> all-reduce

Who may take it is decided once, structurally (:func:`lean_decoder` says why not, and the
caller falls back to the model's forward): a model type in :data:`FAMILIES` (the registry's
entries with a ``lean`` class prefix), SDPA attention, a rotary embedding whose frequencies do
not depend on the length, no sliding window reached, eval mode, no hooks on the modules it steps
over, and linears that are dense, column- or row-split by tensorpar, or a replicated KV head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module

from tensorpar import distributed as dist
from tensorpar.architecture import registry
from tensorpar.distributed.ledger import Ledger, active_ledger
from tensorpar.nn import regions
from tensorpar.nn.attention import ReplicatedHeadLinear
from tensorpar.nn.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

FAMILIES = registry.LEAN_TYPES  # llama, mistral, qwen2
# Rotary types whose frequencies do not change with the sequence: the model's own rotary module is
# called with the same positions either way, but a length-dependent one is left to the model.
ROPE_TYPES = ("default", "linear", "llama3")
ATTENTION = ("sdpa",)  # eager attention takes its softmax in float32: not what this path computes


class Unsupported(ValueError):
    """Why a model cannot take the lean path (the caller uses the model's own forward)."""




def _check_hooks(module, name: str) -> None:
    """This path steps over ``module``'s forward: only hooks that change nothing there may be on
    it, and no forward of its own set on the instance (accelerate's offloading does that)."""
    if not regions.same_forward(module):
        raise Unsupported(f"{name} has forward hooks that change its output")
    if "forward" in module.__dict__:
        raise Unsupported(f"{name} has a forward of its own set on the instance")


def _check_global_hooks() -> None:
    """Hooks registered for every module (``register_module_forward_hook``) would run in the model's
    forward and not here; the ledger's, which only name the module a collective comes from, may."""
    for table in ("_global_forward_hooks", "_global_forward_pre_hooks"):
        for hook in getattr(nn_module, table, {}).values():
            if not isinstance(getattr(hook, "__self__", None), Ledger):
                raise Unsupported("a global module forward hook is registered (register_module_forward_hook)")


def _linear(module, name: str) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """``(weight^T, bias, reduce)`` of one projection (``weight^T`` a view, ``(in, out)``): ``reduce``
    when its output is a partial sum that an all-reduce completes (a row split; the bias is then
    added after the sum)."""
    _check_hooks(module, name)
    if type(module) is nn.Linear or type(module) is ReplicatedHeadLinear:
        return module.weight.t(), module.bias, False
    if type(module) is ColumnParallelLinear:
        if module.gather_output or module.sequence_parallel or module.rows is not None or module.pad_out_features:
            raise Unsupported(f"{name} is a column split with gathered, sequence-split, fused or padded output")
        return module.weight.t(), module.bias, False
    if type(module) is RowParallelLinear:
        if not module.input_is_parallel or module.sequence_parallel or not module.reduce_output:
            raise Unsupported(f"{name} is a row split without a plain all-reduce of its output")
        return module.weight.t(), module.bias, module.tp_size > 1
    raise Unsupported(f"{name} is a {type(module).__name__}")


def _input(module, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection that reads the full hidden state: dense, a column split or a replicated KV head."""
    wt, bias, reduce = _linear(module, name)
    if reduce:
        raise Unsupported(f"{name} is split by rows where this path expects its full output or a column shard")
    return wt, bias


def _output(module, name: str, hidden: int) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """A projection back to the hidden size: dense, or a row split completed by its all-reduce."""
    wt, bias, reduce = _linear(module, name)
    if wt.shape[1] != hidden:
        raise Unsupported(f"{name} gives {wt.shape[1]} features per rank, not the hidden size {hidden}")
    return wt, bias, reduce


def _head(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output head: dense, or this rank's vocabulary shard (its logits stay sharded; the
    caller exchanges candidates, and masks the zero rows that pad the vocabulary to ``tp``)."""
    _check_hooks(module, "lm_head")
    if type(module) is ColumnParallelLinear and module.rows is None and not module.sequence_parallel:
        return module.weight.t(), module.bias
    return _input(module, "lm_head")


class _Layer:
    """One decoder layer's weights and modules, as this rank holds them."""

    def __init__(self, layer, name: str, head_dim: int, hidden: int, prefix: str):
        attn, mlp = layer.self_attn, layer.mlp
        extra = set(dict(attn.named_children())) - {"q_proj", "k_proj", "v_proj", "o_proj"}
        if extra or set(dict(mlp.named_children())) - {"gate_proj", "up_proj", "down_proj", "act_fn"}:
            raise Unsupported(f"{name} has modules this path does not run: {sorted(extra) or 'in its MLP'}")
        for part, mod, kind in (("", layer, "DecoderLayer"), (".self_attn", attn, "Attention"), (".mlp", mlp, "MLP")):
            _check_hooks(mod, name + part)
            if type(mod).__name__ != prefix + kind or not type(mod).__module__.startswith("transformers."):
                raise Unsupported(f"{name + part} is a {type(mod).__name__}, not transformers' own "
                                  f"{prefix + kind}: its forward may differ")
        self.norm1, self.norm2, self.act = layer.input_layernorm, layer.post_attention_layernorm, mlp.act_fn
        self.q, self.k, self.v = (_input(getattr(attn, p), f"{name}.self_attn.{p}") for p in ("q_proj", "k_proj", "v_proj"))
        self.gate, self.up = (_input(getattr(mlp, p), f"{name}.mlp.{p}") for p in ("gate_proj", "up_proj"))
        self.o = _output(attn.o_proj, f"{name}.self_attn.o_proj", hidden)
        self.down = _output(mlp.down_proj, f"{name}.mlp.down_proj", hidden)
        self.o_module, self.down_module = attn.o_proj, mlp.down_proj  # what the ledger names their all-reduces
        q_out, k_out = self.q[0].shape[1], self.k[0].shape[1]
        self.heads, self.kv_heads = q_out // head_dim, k_out // head_dim
        if (self.heads * head_dim != q_out or self.kv_heads * head_dim != k_out
                or self.heads % self.kv_heads):
            raise Unsupported(f"{name}: {self.heads} query and {self.kv_heads} KV heads of {head_dim} here")
        self.scaling = attn.scaling


class LeanCache:
    """Every layer's keys and values, ``(B, nkv, capacity, hd)`` each, filled up to ``length``."""

    def __init__(self, layers, batch: int, capacity: int, head_dim: int, dtype, device=None):
        self.k = [torch.empty(batch, lay.kv_heads, capacity, head_dim, dtype=dtype, device=device) for lay in layers]
        self.v = [torch.empty_like(k) for k in self.k]
        self.length, self.capacity = 0, capacity

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)


class LeanDecoder:
    """The lean forward of one (split or dense) model; see the module docstring."""

    def __init__(self, model, group=None):
        cfg = model.config
        if cfg.model_type not in FAMILIES:
            raise Unsupported(f"model type {cfg.model_type!r} is not one of {', '.join(FAMILIES)}")
        training = [n or "model" for n, m in model.named_modules() if m.training]
        if training:
            raise Unsupported(f"{training[0]} is in training mode (dropout)")
        _check_global_hooks()
        if getattr(cfg, "_attn_implementation", None) not in ATTENTION:
            raise Unsupported(f"attention implementation {cfg._attn_implementation!r}; this path is {ATTENTION}")
        base = model.model
        rope = base.rotary_emb
        if getattr(rope, "rope_type", "default") not in ROPE_TYPES:
            raise Unsupported(f"rope type {rope.rope_type!r}; this path takes {', '.join(ROPE_TYPES)}")
        for name, mod in (("model", model), ("model.model", base)):
            _check_hooks(mod, name)
        kinds = set(getattr(cfg, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
        if kinds:
            raise Unsupported(f"layer types {sorted(kinds)}")
        self.window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.embed, self.norm, self.rope = base.embed_tokens, base.norm, rope
        embed = self.embed  # a vocabulary split without hooks: its lookup, then one all-reduce in place
        self.embed_split = (type(embed) is VocabParallelEmbedding and embed.tp_size > 1
                            and not embed.sequence_parallel and regions.same_forward(embed))
        self.layers = [_Layer(layer, f"model.layers.{i}", self.head_dim, cfg.hidden_size,
                              registry.ARCHS[cfg.model_type].lean)
                       for i, layer in enumerate(base.layers)]
        self.head = _head(model.lm_head)
        half, self.device = self.head_dim // 2, self.head[0].device
        self.sign = torch.cat([-torch.ones(half), torch.ones(self.head_dim - half)]).to(self.device)  # (hd,): _rope
        self.group = group

    def check_length(self, total: int) -> None:
        if self.window is not None and total > self.window:
            raise Unsupported(f"{total} positions pass the sliding window of {self.window}")

    def new_cache(self, batch: int, capacity: int) -> LeanCache:
        return LeanCache(self.layers, batch, capacity, self.head_dim, self.head[0].dtype, self.device)

    def __call__(self, ids, mask, positions, cache: LeanCache) -> torch.Tensor:
        """This rank's logits of the last position, ``(B, V)`` or ``(B, V/tp)``. ``ids``: ``(B, T)``
        new tokens; ``mask``: ``(B, L)`` of every position so far (1 real, 0 padding) or None
        (no padding); ``positions``: ``(B, T)``."""
        B, T = ids.shape
        start, L = cache.length, cache.length + T
        if L > cache.capacity:
            raise ValueError(f"the cache holds {cache.capacity} positions; this step needs {L}")
        x = self._embed(ids)                                             # (B, T, H)
        cos, sin = self.rope(x, positions)                               # (B, T, hd) each
        rot = (cos[:, None], (sin * self.sign.to(sin.dtype))[:, None])  # (B, 1, T, hd) each
        allowed = _allowed(mask, start, T, L, ids.device)                # (B, 1, T, L) bool or None
        x = x.view(B * T, -1)                                            # (B T, H)
        for i, lay in enumerate(self.layers):
            x = x + self._attention(lay, lay.norm1(x), B, rot, cache, i, start, allowed)
            x = x + self._mlp(lay, lay.norm2(x), B)
        cache.length = L
        h = self.norm(x.view(B, T, -1)[:, -1])                           # (B, H): the last position only
        return _mm(h, self.head)                                         # (B, V or V/tp)

    def _embed(self, ids):
        """``E[ids]``; ids in range (the caller's check: ``generate`` checks the prompts, and it
        chooses every new token from the vocabulary)."""
        if not self.embed_split:
            return self.embed(ids)
        x = self.embed.partial_lookup(ids)                               # (B, T, H) partial
        led = active_ledger()
        dist.all_reduce(x, group=self.embed.tp_group, module=None if led is None else led.name_of(self.embed))
        return x

    def _attention(self, lay, a, B, rot, cache, i, start, allowed):
        T, hd = a.shape[0] // B, self.head_dim
        q = _mm(a, lay.q).view(B, T, lay.heads, hd).transpose(1, 2)     # (B, nh, T, hd)
        k = _mm(a, lay.k).view(B, T, lay.kv_heads, hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = _mm(a, lay.v).view(B, T, lay.kv_heads, hd).transpose(1, 2)
        end = start + T
        cache.k[i][:, :, start:end] = _rope(k, *rot)
        cache.v[i][:, :, start:end] = v
        o = F.scaled_dot_product_attention(_rope(q, *rot), cache.k[i][:, :, :end], cache.v[i][:, :, :end],
                                           attn_mask=allowed, scale=lay.scaling,
                                           enable_gqa=lay.heads != lay.kv_heads)  # (B, nh, T, hd)
        o = o.transpose(1, 2).reshape(B * T, lay.heads * hd)                      # (B T, nh hd)
        return self._out(o, lay.o, lay.o_module, B)

    def _mlp(self, lay, b, B):
        return self._out(lay.act(_mm(b, lay.gate)) * _mm(b, lay.up), lay.down, lay.down_module, B)

    def _out(self, x, linear, module, B):
        wt, bias, reduce = linear
        if not reduce:
            return _mm(x, (wt, bias))
        y_partial = torch.mm(x, wt)                                      # (B T, H)
        # reduced as (B, T, H) under the module's name: the record the model's own forward leaves
        led = active_ledger()
        dist.all_reduce(y_partial.view(B, -1, y_partial.shape[-1]), group=self.group,
                        module=None if led is None else led.name_of(module))
        return y_partial if bias is None else y_partial.add_(bias)       # once, after the sum, as RowParallelLinear


def _mm(x, linear):
    """``x W^T + b`` for a 2-d ``x``: ``linear`` holds ``W^T`` (a view) and the bias, so each call
    is one BLAS call (what ``F.linear`` does after reshaping and transposing)."""
    wt, bias = linear
    return torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)


def _rope(x, cos, sin_signed):
    """Hugging Face's ``x cos + rotate_half(x) sin`` with ``rotate_half(x) sin`` computed as
    ``roll(x, hd/2) (sign sin)``: the same products (a negation is exact), two ops fewer."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def _allowed(mask, start: int, T: int, L: int, device=None):
    """Which keys each new position attends to, ``(B, 1, T, L)``; None where every earlier key
    is allowed (one new token, no padding). A padded query attends to itself alone: its output
    is never used, and a row with no key would be NaN, which the cache would then carry."""
    if mask is None and T == 1:
        return None
    rows = torch.arange(start, start + T, device=device)[:, None]    # (T, 1) absolute positions
    cols = torch.arange(L, device=device)[None, :]                    # (1, L)
    causal = cols <= rows                                             # (T, L)
    if mask is None:
        return causal
    keys = mask[:, None, None, :L].bool()                             # (B, 1, 1, L)
    return (causal & keys) | (cols == rows)                           # (B, 1, T, L)


def lean_decoder(model, group=None, positions: int | None = None) -> tuple[LeanDecoder | None, str]:
    """``(decoder, "")`` when ``model`` can take the lean path for up to ``positions`` positions,
    else ``(None, why not)``."""
    try:
        decoder = LeanDecoder(model, group)
        if positions is not None:
            decoder.check_length(positions)
        return decoder, ""
    except Unsupported as exc:
        return None, str(exc)
    except AttributeError as exc:  # a family member laid out otherwise (no rotary_emb, no lm_head, ...)
        return None, f"unexpected layout: {exc}"
