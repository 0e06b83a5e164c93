"""Each style of a plan: how one dense module becomes this rank's parallel module.

A builder takes the dense module and a :class:`StyleContext` and returns the new module and,
for each of its parameters, the :class:`ShardSpec` that cuts it out of the dense tensor. The
specs let a checkpoint loader read exactly this rank's slices from disk (``get_slice``) into a
module built on the meta device; in memory the tensorpar.nn ``from_dense`` constructors slice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tensorpar.models.plans import Dims
from tensorpar.nn import (ColumnParallelLinear, ReplicatedHeadLinear, RowParallelLinear,
                          VocabParallelEmbedding)


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


@dataclass(frozen=True)
class StyleContext:
    tp_group: object
    tp_size: int
    tp_rank: int
    dims: Dims | None
    in_region: bool  # an ancestor ("attention"/"mlp") already copies the input into the region


def _expect(module, types, style, name):
    if not isinstance(module, types):
        allowed = " or ".join(t.__name__ for t in types)
        raise ValueError(f"plan style {style!r} needs {allowed} but module {name!r} is "
                         f"{type(module).__name__}; use 'replicate' or a matching style")


def _rows_spec(start, end, per):
    return ShardSpec("", 0, ((start, end),), per)


def _column(linear: nn.Linear, ctx: StyleContext, **kw):
    mod = ColumnParallelLinear.from_dense(linear, tp_group=ctx.tp_group, **kw)
    spec = _rows_spec(mod.output_start_index, mod.output_end_index, mod.out_features_per_partition)
    return mod, {"weight": spec, "bias": spec}


def _row(linear: nn.Linear, ctx: StyleContext):
    mod = RowParallelLinear.from_dense(linear, tp_group=ctx.tp_group)
    start = mod.tp_rank * mod.in_features_per_partition
    cols = ShardSpec("", 1, ((start, start + mod.in_features_per_partition),))
    return mod, {"weight": cols, "bias": ShardSpec("")}


def colwise(module, ctx, name):
    _expect(module, (nn.Linear,), "colwise", name)
    return _column(module, ctx, skip_input_comm=ctx.in_region)


def rowwise(module, ctx, name):
    _expect(module, (nn.Linear,), "rowwise", name)
    return _row(module, ctx)


def colwise_kv(module, ctx, name):
    """Split by KV heads, or replicate this rank's KV head when n_kv_heads < tp."""
    _expect(module, (nn.Linear,), "colwise_kv", name)
    d = ctx.dims
    if d is None or not ctx.in_region:
        raise ValueError(f"style 'colwise_kv' ({name!r}) needs a family plan and an enclosing "
                         f"'attention' module; use 'colwise' instead")
    if d.n_kv_heads % ctx.tp_size == 0:
        return _column(module, ctx, skip_input_comm=True)
    kv_head = ctx.tp_rank // (ctx.tp_size // d.n_kv_heads)  # the KV head of this rank's query heads
    mod = ReplicatedHeadLinear(module, kv_head, d.n_kv_heads, d.head_dim, ctx.tp_group)
    rows = ShardSpec("", 0, ((kv_head * d.head_dim, (kv_head + 1) * d.head_dim),))
    return mod, {"weight": rows, "bias": rows}


def _conv_as_linear(conv, weight_t: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight_t: (out, in)`` (a transposed Conv1D weight), no copy kept."""
    out_f, in_f = weight_t.shape
    lin = nn.Linear(in_f, out_f, bias=bias is not None, device="meta", dtype=weight_t.dtype)
    lin.weight = nn.Parameter(weight_t, conv.weight.requires_grad)
    if bias is not None:
        lin.bias = nn.Parameter(bias, conv.bias.requires_grad)
    return lin


def _is_conv1d(module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def splits_module(style: str, module) -> bool:
    """Whether ``module`` is the kind of module split style ``style`` builds from (the builders'
    own check, for the plan checks to make before anything is built)."""
    return _is_conv1d(module) if style.startswith("conv1d_") else isinstance(module, nn.Linear)


def _check_conv(module, style, name):
    if not _is_conv1d(module):
        raise ValueError(f"plan style {style!r} needs a transformers Conv1D but module {name!r} "
                         f"is {type(module).__name__}")


def conv1d_colwise(module, ctx, name):
    _check_conv(module, "conv1d_colwise", name)
    mod, _ = _column(_conv_as_linear(module, module.weight.t(), module.bias), ctx,
                     skip_input_comm=ctx.in_region)
    cols = ShardSpec("", 1, ((mod.output_start_index, mod.output_end_index),), transpose=True)
    return mod, {"weight": cols, "bias": ShardSpec("", 0, cols.pieces)}


def conv1d_rowwise(module, ctx, name):
    _check_conv(module, "conv1d_rowwise", name)
    mod, _ = _row(_conv_as_linear(module, module.weight.t(), module.bias), ctx)
    start = mod.tp_rank * mod.in_features_per_partition
    rows = ShardSpec("", 0, ((start, start + mod.in_features_per_partition),), transpose=True)
    return mod, {"weight": rows, "bias": ShardSpec("")}


def conv1d_qkv(module, ctx, name):
    """GPT-2 ``c_attn``: out = [q | k | v], each of width h; rank i takes [q_i | k_i | v_i].

    The dense rows are permuted so that rank i's three blocks are contiguous, then the
    column-parallel split gives each rank ``3h/p`` rows; the attention's ``split_size`` is
    set to ``h/p`` so its ``split`` still separates q, k and v.
    """
    _check_conv(module, "conv1d_qkv", name)
    if not ctx.in_region:
        raise ValueError(f"style 'conv1d_qkv' ({name!r}) needs an enclosing 'attention' module "
                         f"(its split_size becomes h/tp)")
    h, p = module.nf // 3, ctx.tp_size
    if module.nf % 3 or h % p:
        raise ValueError(f"{name!r}: fused qkv width {module.nf} must be 3 * h with tp_size ({p}) dividing h")
    per = h // p
    pieces = tuple((part * h + r * per, part * h + (r + 1) * per) for r in range(p) for part in range(3))
    order = torch.cat([torch.arange(a, b) for a, b in pieces])  # rank-major [q_r, k_r, v_r]
    w_t = module.weight.t()[order.to(module.weight.device)]  # (3h, in), permuted rows
    linear = _conv_as_linear(module, w_t, module.bias[order.to(module.bias.device)])
    mod, _ = _column(linear, ctx, skip_input_comm=ctx.in_region)
    mine = pieces[3 * ctx.tp_rank: 3 * ctx.tp_rank + 3]
    return mod, {"weight": ShardSpec("", 1, mine, transpose=True), "bias": ShardSpec("", 0, mine)}


def vocab(module, ctx, name):
    _expect(module, (nn.Embedding,), "vocab", name)
    mod = VocabParallelEmbedding.from_dense(module, tp_group=ctx.tp_group)
    spec = _rows_spec(mod.vocab_start_index, mod.vocab_end_index, mod.num_embeddings_per_partition)
    return mod, {"weight": spec}


def vocab_head(module, ctx, name):
    _expect(module, (nn.Linear,), "vocab_head", name)
    return _column(module, ctx, gather_output=True, pad_out_features=True)


BUILDERS = {"colwise": colwise, "rowwise": rowwise, "colwise_kv": colwise_kv,
            "conv1d_colwise": conv1d_colwise, "conv1d_rowwise": conv1d_rowwise,
            "conv1d_qkv": conv1d_qkv, "vocab": vocab, "vocab_head": vocab_head}
