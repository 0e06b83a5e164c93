"""The styles a plan can name, in one registry: what each splits, how, and what it needs.

A style's builder takes the dense module (or, for a parameter style, the module holding the
parameter) and a :class:`StyleContext` and returns a :class:`Built`: the replacement module, or
the new parameters of a module that stays, with the :class:`~tensorpar.sharding.spec.ShardSpec`
that cuts each out of the dense tensor (a checkpoint loader reads exactly those slices). Nothing
here touches the model: ``parallelize`` commits the results once every builder has succeeded.

Only modules whose forward tensorpar knows exactly are replaced: ``nn.Linear`` and
``nn.Embedding`` and subclasses that keep their forward, GPT-2's ``Conv1D``; an embedding
subclass with a forward of its own keeps it (:func:`tensorpar.nn.rebase.vocab_parallel_like`).
Parameter styles keep the model's own module and forward (a fused mixture-of-experts module
indexes its 3-D weights per expert and acts elementwise along the expert width, so a slice of
that width computes the slice of every expert's output).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from tensorpar.architecture import registry
from tensorpar.architecture.tp_rules import fits, kv_head_of_rank, kv_split
from tensorpar.nn import (ColumnParallelLinear, ReplicatedHeadLinear, RowParallelLinear, ShardedRMSNorm,
                          VocabParallelEmbedding)
from tensorpar.nn.rebase import column_parallel_like, vocab_parallel_like
from tensorpar.nn.regions import sync_rows_grad
from tensorpar.sharding.param_styles import (param_colwise, param_heads, param_packed_colwise, param_packed_rowwise,
                                             param_rank0, param_rowwise)
from tensorpar.sharding.records import Built, StyleContext
from tensorpar.sharding.spec import ShardSpec, even_pieces, segment_pieces


@dataclass(frozen=True)
class Style:
    """``kind``: ``column``, ``row``, ``vocab``, ``region`` (hooks on a block, no new module),
    ``param`` (one parameter of a module that stays) or ``replicate``; ``needs_heads``: the
    builder needs the model's head counts."""
    name: str
    kind: str
    build: Callable | None
    doc: str
    needs_heads: bool = False

    @property
    def target(self) -> str:
        return "param" if self.kind == "param" else "module"


def knows_forward(module, base: type) -> bool:
    """``module`` is a ``base`` whose class does not replace ``base``'s forward (or, for a linear,
    one of the registry's subclasses whose own forward computes exactly ``x W^T + b``)."""
    if not isinstance(module, base):
        return False
    if type(module).forward is base.forward:
        return True
    return base is nn.Linear and type(module).__name__ in registry.linear_equivalents()


def _expect_linear(module, style, name):
    if not knows_forward(module, nn.Linear):
        what = (f"a {type(module).__name__} with a forward of its own" if isinstance(module, nn.Linear)
                else type(module).__name__)
        raise ValueError(f"plan style {style!r} needs an nn.Linear but module {name!r} is {what}; "
                         f"use 'replicate' or a matching style")


def _rows_spec(start, end, per):
    return ShardSpec("", 0, ((start, end),), per)


def _column(linear: nn.Linear, ctx: StyleContext, **kw) -> Built:
    mod = ColumnParallelLinear.from_dense(linear, tp_group=ctx.tp_group, **kw)
    if mod.rows is not None:
        spec = ShardSpec("", 0, mod.rows)
    else:
        spec = _rows_spec(mod.output_start_index, mod.output_end_index, mod.out_features_per_partition)
    return Built(mod, {"weight": spec, "bias": spec})


def _row(linear: nn.Linear, ctx: StyleContext, **kw) -> Built:
    mod = RowParallelLinear.from_dense(linear, tp_group=ctx.tp_group, **kw)
    start = mod.tp_rank * mod.in_features_per_partition
    cols = ShardSpec("", 1, ((start, start + mod.in_features_per_partition),))
    return Built(mod, {"weight": cols, "bias": ShardSpec("")})


def colwise(module, ctx, name):
    _expect_linear(module, "colwise", name)
    return _column(module, ctx, skip_input_comm=ctx.in_region)


def colwise_gather(module, ctx, name):
    """Split by columns, the output all-gathered: what follows sees the whole output."""
    _expect_linear(module, "colwise_gather", name)
    return _column(module, ctx, skip_input_comm=ctx.in_region, gather_output=True,
                   pad_out_features=True)


def rowwise(module, ctx, name):
    _expect_linear(module, "rowwise", name)
    return _row(module, ctx, reduce_output=not ctx.reduce_later)


def rowwise_split(module, ctx, name):
    """Split by rows with a whole input: each rank keeps its slice of the input first."""
    _expect_linear(module, "rowwise_split", name)
    return _row(module, ctx, input_is_parallel=False)


def colwise_kv(module, ctx, name):
    """Split by KV heads, or replicate this rank's KV head when n_kv_heads < tp."""
    _expect_linear(module, "colwise_kv", name)
    d = ctx.dims
    if d is None or not ctx.in_region:
        raise ValueError(f"style 'colwise_kv' ({name!r}) needs the model's head counts and an "
                         f"enclosing 'attention' region; use 'colwise' instead")
    if fits("divide", d.n_kv_heads, ctx.tp_size):
        return _column(module, ctx, skip_input_comm=True)
    if not fits("kv", d.n_kv_heads, ctx.tp_size) or module.out_features != d.n_kv_heads * d.head_dim:
        raise ValueError(f"{name!r}: {module.out_features} outputs are not {d.n_kv_heads} KV heads of "
                         f"{d.head_dim} that tp_size ({ctx.tp_size}) divides or is a multiple of")
    kv_head = kv_head_of_rank(ctx.tp_rank, ctx.tp_size, d.n_kv_heads)  # the KV head of this rank's query heads
    mod = ReplicatedHeadLinear(module, kv_head, d.n_kv_heads, d.head_dim, ctx.tp_group)
    rows = ShardSpec("", 0, ((kv_head * d.head_dim, (kv_head + 1) * d.head_dim),))
    return Built(mod, {"weight": rows, "bias": rows})


def fused_colwise(module, ctx, name):
    """A fused projection ``[seg_0 | seg_1 | ...]`` (Phi-3's qkv_proj, a fused gate/up): every
    segment split on its own, this rank's blocks side by side (``segment_pieces``). A KV segment
    with fewer heads than ranks keeps this rank's KV head whole (replicated over the ranks whose
    query heads use it, its gradient summed over them)."""
    _expect_linear(module, "fused_colwise", name)
    rows, replicated, local = [], [], 0
    for start, width, count, mode in fused_segments(module, ctx, name):
        if mode == "split":
            piece = even_pieces(width, ctx.tp_rank, ctx.tp_size, offset=start)[0]
        else:  # one KV head, the one of this rank's query heads
            d = ctx.dims
            head = kv_head_of_rank(ctx.tp_rank, ctx.tp_size, d.n_kv_heads)
            piece = (start + head * d.head_dim, start + (head + 1) * d.head_dim)
            replicated.append((local, local + d.head_dim))
        rows.append(piece)
        local += piece[1] - piece[0]
    built = _column(module, ctx, skip_input_comm=ctx.in_region, rows=tuple(rows))
    if replicated:
        d = ctx.dims
        slot = kv_head_of_rank(ctx.tp_rank, ctx.tp_size, d.n_kv_heads)
        for attr in ("weight", "bias"):
            p = getattr(built.module, attr)
            if p is not None:
                sync_rows_grad(p, replicated, slot, d.n_kv_heads, ctx.tp_group, f"{name}.{attr}",
                               owner=built.module, attr=attr)
        built.module.replicated_rows = tuple(replicated)
        built.module.row_replicas = kv_split(d.n_kv_heads, ctx.tp_size)[1]
    return built


def fused_segments(module, ctx, name) -> list:
    """``[(start, width, count, mode)]`` of a fused projection: the placement's ``segments`` in
    units of the model's sizes (``"q"``: query heads, ``"kv"``: KV heads, ``"ffn"``, or an int),
    checked against the module's output width and the tp size. ``mode``: ``split``, or
    ``replicated`` for KV heads fewer than (and dividing) tp."""
    d, tp = ctx.dims, ctx.tp_size
    units = {"q": (d.n_heads * d.head_dim, d.n_heads, "query heads"),
             "kv": (d.n_kv_heads * d.head_dim, d.n_kv_heads, "KV heads"),
             # half the heads: DiffLlama pairs head i with head i + n/2
             "q/2": (d.n_heads * d.head_dim // 2, d.n_heads // 2, "query heads of each half"),
             "kv/2": (d.n_kv_heads * d.head_dim // 2, d.n_kv_heads // 2, "KV heads of each half"),
             "ffn": (d.ffn, d.ffn, "ffn")} if d is not None else {}
    segs = ctx.placement.option("segments") or ()
    out, start = [], 0
    for seg in segs:
        width, count, what = units[seg] if isinstance(seg, str) else (seg, seg, "width")
        if count % tp == 0:
            mode = "split"
        elif seg == "kv" and fits("kv", count, tp):
            mode = "replicated"
        else:
            raise ValueError(f"{name!r}: tp_size ({tp}) must divide the {what} ({count}) of each "
                             f"segment of the fused projection {tuple(segs)}")
        out.append((start, width, count, mode))
        start += width
    width = getattr(module, "out_features", None) or getattr(module, "nf", None)
    if not out or start != width:
        raise ValueError(f"{name!r}: fused segments {tuple(segs)} give {start} outputs, the module has {width}")
    return out


def vocab(module, ctx, name):
    if not isinstance(module, nn.Embedding):
        raise ValueError(f"plan style 'vocab' needs an nn.Embedding but module {name!r} is "
                         f"{type(module).__name__}; use 'replicate' or a matching style")
    if knows_forward(module, nn.Embedding):
        mod = VocabParallelEmbedding.from_dense(module, tp_group=ctx.tp_group)
    else:
        mod = vocab_parallel_like(module, tp_group=ctx.tp_group)
    spec = _rows_spec(mod.vocab_start_index, mod.vocab_end_index, mod.num_embeddings_per_partition)
    return Built(mod, {"weight": spec})


def vocab_head(module, ctx, name):
    """The output head split by vocabulary, its logits gathered; a head subclass with a forward of
    its own (a learned logit scale) keeps it, on the gathered logits."""
    if isinstance(module, nn.Linear) and not knows_forward(module, nn.Linear):
        mod = column_parallel_like(module, tp_group=ctx.tp_group)
        spec = _rows_spec(mod.output_start_index, mod.output_end_index, mod.out_features_per_partition)
        return Built(mod, {"weight": spec, "bias": spec})
    _expect_linear(module, "vocab_head", name)
    return _column(module, ctx, gather_output=True, pad_out_features=True)


# ---- GPT-2's Conv1D (weight stored (in, out)) -----------------------------------------------------

def _conv_as_linear(conv, weight_t: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight_t: (out, in)`` (a transposed Conv1D weight), no copy kept."""
    out_f, in_f = weight_t.shape
    lin = nn.Linear(in_f, out_f, bias=bias is not None, device="meta", dtype=weight_t.dtype)
    lin.weight = nn.Parameter(weight_t, conv.weight.requires_grad)
    if bias is not None:
        lin.bias = nn.Parameter(bias, conv.bias.requires_grad)
    return lin


def is_conv1d(module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _check_conv(module, style, name):
    if not is_conv1d(module):
        raise ValueError(f"plan style {style!r} needs a transformers Conv1D but module {name!r} "
                         f"is {type(module).__name__}")


def conv1d_colwise(module, ctx, name):
    _check_conv(module, "conv1d_colwise", name)
    built = _column(_conv_as_linear(module, module.weight.t(), module.bias), ctx,
                    skip_input_comm=ctx.in_region)
    mod = built.module
    cols = ShardSpec("", 1, ((mod.output_start_index, mod.output_end_index),), transpose=True)
    return Built(mod, {"weight": cols, "bias": ShardSpec("", 0, cols.pieces)})


def conv1d_rowwise(module, ctx, name):
    _check_conv(module, "conv1d_rowwise", name)
    mod = _row(_conv_as_linear(module, module.weight.t(), module.bias), ctx).module
    start = mod.tp_rank * mod.in_features_per_partition
    rows = ShardSpec("", 0, ((start, start + mod.in_features_per_partition),), transpose=True)
    return Built(mod, {"weight": rows, "bias": ShardSpec("")})


def conv1d_qkv(module, ctx, name):
    """GPT-2 ``c_attn``: out = [q | k | v], each of width h; rank i takes [q_i | k_i | v_i]."""
    _check_conv(module, "conv1d_qkv", name)
    if not ctx.in_region:
        raise ValueError(f"style 'conv1d_qkv' ({name!r}) needs an enclosing 'attention' module "
                         f"(its split_size becomes h/tp)")
    h, p = module.nf // 3, ctx.tp_size
    if module.nf % 3 or h % p:
        raise ValueError(f"{name!r}: fused qkv width {module.nf} must be 3 * h with tp_size ({p}) dividing h")
    mine = segment_pieces((h, h, h), ctx.tp_rank, p)
    mod = _column(_conv_as_linear(module, module.weight.t(), module.bias), ctx,
                  skip_input_comm=True, rows=mine).module
    return Built(mod, {"weight": ShardSpec("", 1, mine, transpose=True), "bias": ShardSpec("", 0, mine)})


def norm_sharded(module, ctx, name):
    """An RMSNorm over features that a column split shards (OLMo-2's ``q_norm`` over all query
    heads): this rank's features of its weight, the statistic summed over the ranks. Over KV heads
    fewer than the ranks, each rank holds its query heads' KV head, replicated."""
    d = ctx.dims
    width = module.weight.shape[0] if isinstance(getattr(module, "weight", None), torch.Tensor) else None
    if d is None or width is None:
        raise ValueError(f"style 'norm_sharded' on {name!r} needs an RMSNorm with a weight and the model's heads")
    kv = width == d.n_kv_heads * d.head_dim and d.n_kv_heads != d.n_heads
    if kv and d.n_kv_heads % ctx.tp_size and fits("kv", d.n_kv_heads, ctx.tp_size):
        replicas = kv_split(d.n_kv_heads, ctx.tp_size)[1]
        head = kv_head_of_rank(ctx.tp_rank, ctx.tp_size, d.n_kv_heads)
        pieces = ((head * d.head_dim, (head + 1) * d.head_dim),)
        mod = ShardedRMSNorm.from_dense(module, pieces, tp_group=ctx.tp_group, replicas=replicas)
        sync_rows_grad(mod.weight, ((0, d.head_dim),), head, d.n_kv_heads, ctx.tp_group, f"{name}.weight",
                       owner=mod, attr="weight")
        mod.replicated_rows = ((0, d.head_dim),)
        mod.row_replicas = replicas
        return Built(mod, {"weight": ShardSpec("", 0, pieces)})
    heads = {d.n_heads * d.head_dim: d.n_heads, d.n_kv_heads * d.head_dim: d.n_kv_heads}.get(width)
    if heads is None and width <= d.head_dim:
        raise ValueError(f"{name!r} normalises {width} features, one head's: a per-head norm stays whole "
                         f"on every rank, its gradient synchronised")
    count = heads if heads is not None else width
    if count % ctx.tp_size:
        raise ValueError(f"{name!r}: tp_size ({ctx.tp_size}) must divide the {count} heads or features it normalises")
    pieces = even_pieces(width, ctx.tp_rank, ctx.tp_size)
    mod = ShardedRMSNorm.from_dense(module, pieces, tp_group=ctx.tp_group)
    return Built(mod, {"weight": ShardSpec("", 0, pieces)})


def _doc(fn) -> str:
    return (fn.__doc__ or "").strip().split("\n")[0]


STYLES = {s.name: s for s in (
    Style("colwise", "column", colwise, "nn.Linear split along out_features (output sharded)"),
    Style("colwise_gather", "column", colwise_gather, _doc(colwise_gather)),
    Style("colwise_kv", "column", colwise_kv, _doc(colwise_kv), needs_heads=True),
    Style("fused_colwise", "column", fused_colwise, _doc(fused_colwise), needs_heads=True),
    Style("rowwise", "row", rowwise, "nn.Linear split along in_features (output all-reduced, or "
          "left partial inside a 'moe' region)"),
    Style("rowwise_split", "row", rowwise_split, _doc(rowwise_split)),
    Style("conv1d_colwise", "column", conv1d_colwise, "GPT-2 Conv1D as colwise"),
    Style("conv1d_rowwise", "row", conv1d_rowwise, "GPT-2 Conv1D as rowwise"),
    Style("conv1d_qkv", "column", conv1d_qkv, _doc(conv1d_qkv), needs_heads=True),
    Style("vocab", "vocab", vocab, "nn.Embedding split along the vocabulary (padded)"),
    Style("vocab_head", "vocab", vocab_head, "output head split along the vocabulary, logits gathered"),
    Style("attention", "region", None, "attention block: input copied into the region once, "
          "per-rank head counts set", needs_heads=True),
    Style("mlp", "region", None, "MLP block: input copied into the region once"),
    Style("moe", "region", None, "mixture-of-experts block: input copied in once, the partial "
          "sums of routed and shared experts all-reduced once at its output"),
    Style("moe_split", "region", None, "mixture-of-experts block whose output is not a sum of its "
          "experts' (a norm after them): input copied in once, the routed experts' output and the "
          "shared experts' each all-reduced where they are made"),
    Style("moe_experts", "region", None, "fused experts module called by its transformer block with "
          "routing weights made outside it: every floating input copied in (the routing weights' "
          "gradients are partial too), its partial sums all-reduced at its output"),
    Style("param_colwise", "param", param_colwise, _doc(param_colwise)),
    Style("param_rowwise", "param", param_rowwise, _doc(param_rowwise)),
    Style("param_packed_colwise", "param", param_packed_colwise, _doc(param_packed_colwise)),
    Style("param_packed_rowwise", "param", param_packed_rowwise, _doc(param_packed_rowwise)),
    Style("param_heads", "param", param_heads, _doc(param_heads), needs_heads=True),
    Style("param_rank0", "param", param_rank0, _doc(param_rank0)),
    Style("norm_sharded", "norm", norm_sharded, _doc(norm_sharded), needs_heads=True),
    Style("grad_sync", "param", None, "replicated parameter acting on sharded activations: "
          "gradient all-reduced"),
    Style("replicate", "replicate", None, "whole on every rank"),
)}
STYLE_NAMES = tuple(STYLES)
REGION_STYLES = tuple(n for n, s in STYLES.items() if s.kind == "region")
COLUMN_STYLES = tuple(n for n, s in STYLES.items() if s.kind == "column")
ROW_STYLES = tuple(n for n, s in STYLES.items() if s.kind == "row")


def splits_module(style: str, module) -> bool:
    """Whether ``module`` is the kind of module split style ``style`` builds from (the builders'
    own check, for the plan checks to make before anything is built)."""
    if style.startswith("conv1d_"):
        return is_conv1d(module)
    if STYLES[style].kind == "vocab" and style == "vocab":
        return isinstance(module, nn.Embedding)
    return knows_forward(module, nn.Linear)
