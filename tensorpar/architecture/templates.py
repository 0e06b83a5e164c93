"""The :class:`~tensorpar.architecture.split_model.SplitModel` of a decoder given by its shapes alone.

The planner plans presets, ``--family`` shapes and the published reference cases from shapes,
without torch; this module works out, by hand and standard library only, what tensorpar's runtime
does to such a model, under the module names Hugging Face gives it, so that the result equals the
meta-device producer's (``tensorpar.sharding.inventory``) record for the same model field for
field (``tests/test_planner_templates.py``). Two families, the planner's (``planner.models``):

- ``llama`` (Llama, Mistral: windows; Qwen2: q/k/v biases; Qwen3: per-head q/k RMSNorms):
  ``model.embed_tokens`` split by vocabulary, ``q_proj`` / ``k_proj`` / ``v_proj`` split by heads
  (KV heads replicated where tp exceeds them), ``o_proj`` by rows, ``gate_proj`` / ``up_proj`` by
  columns, ``down_proj`` by rows, attention and MLP each one region (one all-reduce of ``dX`` at
  its entry in backward), norms replicated, ``lm_head`` split by vocabulary;
- ``gpt`` (GPT-2's ``Conv1D`` layers with every KV head, GPT-BigCode's linear layers with fewer):
  ``c_attn`` fused q/k/v split segment by segment, ``c_proj`` by rows with the bias replicated,
  learned positions replicated, the head tied to the embedding unless said otherwise.

The tp rules are :mod:`tensorpar.architecture.tp_rules`: query heads and the MLP width divide, KV
heads divide or replicate, the vocabulary pads.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import registry, tp_rules
from .split_model import (AttentionLayer, CollectiveSite, LayerActivations, Matmul, ParamShards, RankShard,
                          SplitModel)

SITES_NOTE = "collective sites assume every module runs once per forward, on every token of the batch"
FAMILIES = ("gpt", "llama")  # the decoder families of registry.Formulas (BERT, an encoder, is not split here)


@dataclass(frozen=True, kw_only=True)
class Shape:
    """A decoder by its sizes (the planner's ``ModelSpec`` without the sequence): ``positions``
    rows of a learned position table (gpt), ``window`` keys in the last ``window_layers`` layers."""
    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    positions: int = 0
    window: int | None = None
    window_layers: int = 0
    name: str = "template"

    @property
    def model_type(self) -> str:
        if self.family == "gpt":
            return "gpt2" if self.kv_heads == self.heads else "gpt_bigcode"
        if self.qk_norm:
            return "qwen3"
        if self.qkv_bias:
            return "qwen2"
        return "mistral" if self.window and self.window_layers == self.layers else "llama"

    @property
    def dims(self) -> tp_rules.Dims:
        return tp_rules.Dims(self.heads, self.kv_heads, self.head_dim, self.ffn, self.vocab, self.hidden)


def feasibility(shape: Shape, tp: int) -> tp_rules.FeasibilityReport:
    """The runtime's rule for these sizes at ``tp`` (heads, KV heads, MLP width, vocabulary), as
    ``tp_rules.report`` gives it; the valid sizes searched up to the smallest size that must
    divide (no larger tp divides it), not the largest."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp!r}")
    sizes = tp_rules.model_sizes(shape.dims)
    limit = min(s.value for s in sizes if s.rule == "divide")
    return tp_rules.FeasibilityReport(shape.model_type, tp, [tp_rules.constraint(s, tp) for s in sizes],
                                      tp_rules.passing_tp_sizes(sizes, limit))


def split(shape: Shape, tp: int) -> SplitModel:
    """``shape`` split over ``tp`` ranks as tensorpar's runtime splits it; ValueError naming the
    valid tp sizes when ``tp`` does not fit."""
    if shape.family not in FAMILIES:
        raise ValueError(f"family ({shape.family!r}) must be one of: {', '.join(FAMILIES)}")
    feas = feasibility(shape, tp)
    if not feas.ok:
        raise ValueError(feas.error_message())
    build = _llama if shape.family == "llama" else _gpt
    params, sites, plan = build(shape, tp)
    kind = shape.model_type
    entry = registry.ARCHS[kind]
    return SplitModel(
        name=shape.name, model_type=kind, model_class=entry.formulas.model_class, tp=tp,
        plan_source="tensorpar" if entry.plan else "declared", head=True, causal=True,
        layers=shape.layers, hidden=shape.hidden, vocab=shape.vocab, params=tuple(params), sites=tuple(sites),
        matmuls=tuple(_matmuls(params)), attention=tuple(_attention(shape, tp)),
        valid_tp_sizes=tuple(feas.valid_tp_sizes), fixes=tuple(feas.fixes), notes=(SITES_NOTE,), plan=plan,
        sharded_head=tp > 1, activations=tuple(_activations(shape, tp)), dropout=shape.family == "gpt",
        heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim)


# ---- shards ----------------------------------------------------------------------------------------

def _even(n: int, r: int, tp: int, offset: int = 0) -> tuple:
    per = n // tp
    return ((offset + r * per, offset + (r + 1) * per),)


def _param(name, shape, style, placement, ranks, tied=()) -> ParamShards:
    return ParamShards(name, tuple(shape), style, placement, tuple(ranks), tuple(tied))


def _replicated(name: str, shape: tuple, tp: int, style: str = "replicate", placement: str = "") -> ParamShards:
    return _param(name, shape, style, placement, [RankShard(tuple(shape), replicas=tp)] * tp)


def _vocab(name: str, s: Shape, tp: int, style: str, tied=()) -> ParamShards:
    """Rows ``[r per, min((r + 1) per, V))`` of the vocabulary, padded to ``per = ceil(V / tp)``."""
    ranks = []
    for r in range(tp):
        start, end, per = tp_rules.padded_range(s.vocab, r, tp)
        ranks.append(RankShard((per, s.hidden), 0, ((start, end),), per))
    return _param(name, (s.vocab, s.hidden), style, name.rpartition(".")[0], ranks, tied)


def _column(module: str, out: int, inp: int, tp: int, style: str, bias: bool, *, pad: bool = True) -> list:
    """``nn.Linear`` weight ``(out, in)`` (and bias) split on ``out``; the runtime records the
    shard's row count as ``pad_to`` (no padding where tp divides)."""
    per = out // tp
    pad_to = per if pad else None
    ranks = [RankShard((per, inp), 0, _even(out, r, tp), pad_to) for r in range(tp)]
    out_ = [_param(f"{module}.weight", (out, inp), style, module, ranks)]
    if bias:
        out_.append(_param(f"{module}.bias", (out,), style, module,
                           [RankShard((per,), 0, _even(out, r, tp), pad_to) for r in range(tp)]))
    return out_


def _row(module: str, out: int, inp: int, tp: int, style: str, bias: bool) -> list:
    """``nn.Linear`` weight ``(out, in)`` split on ``in``; a bias replicated (added once)."""
    ranks = [RankShard((out, inp // tp), 1, _even(inp, r, tp)) for r in range(tp)]
    out_ = [_param(f"{module}.weight", (out, inp), style, module, ranks)]
    return out_ + ([_replicated(f"{module}.bias", (out,), tp, style, module)] if bias else [])


def _kv_pieces(s: Shape, tp: int, r: int, offset: int = 0) -> tuple:
    """Rank r's KV heads: its block when tp divides them, else the one head its queries use."""
    d, g = s.head_dim, s.kv_heads
    if g % tp == 0:
        return _even(g * d, r, tp, offset)
    head = tp_rules.kv_head_of_rank(r, tp, g)
    return ((offset + head * d, offset + (head + 1) * d),)


def _kv_column(module: str, s: Shape, tp: int, bias: bool) -> list:
    """``k_proj`` / ``v_proj`` (``colwise_kv``): split by KV heads, or one replicated head per rank."""
    per_rank, replicas = tp_rules.kv_split(s.kv_heads, tp)
    rows, split = per_rank * s.head_dim, s.kv_heads % tp == 0
    pad_to = rows if split else None
    dense = s.kv_heads * s.head_dim
    ranks = [RankShard((rows, s.hidden), 0, _kv_pieces(s, tp, r), pad_to, replicas=replicas) for r in range(tp)]
    out = [_param(f"{module}.weight", (dense, s.hidden), "colwise_kv", module, ranks)]
    if bias:
        out.append(_param(f"{module}.bias", (dense,), "colwise_kv", module,
                          [RankShard((rows,), 0, _kv_pieces(s, tp, r), pad_to, replicas=replicas)
                           for r in range(tp)]))
    return out


# ---- the llama family ----------------------------------------------------------------------------------

def _llama(s: Shape, tp: int) -> tuple[list, list, dict]:
    h, q_rows = s.hidden, s.heads * s.head_dim
    params = [_vocab("model.embed_tokens.weight", s, tp, "vocab", ("lm_head.weight",) if s.tied else ())]
    sites = [_embedding_site("model.embed_tokens", h)]
    plan = {"model.embed_tokens": "vocab"}
    for i in range(s.layers):
        layer, attn, mlp = f"model.layers.{i}", f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        params += _column(f"{attn}.q_proj", q_rows, h, tp, "colwise", s.qkv_bias)
        params += _kv_column(f"{attn}.k_proj", s, tp, s.qkv_bias) + _kv_column(f"{attn}.v_proj", s, tp, s.qkv_bias)
        params += _row(f"{attn}.o_proj", h, q_rows, tp, "rowwise", False)
        plan |= {f"{attn}.q_proj": "colwise", f"{attn}.k_proj": "colwise_kv", f"{attn}.v_proj": "colwise_kv",
                 f"{attn}.o_proj": "rowwise"}
        if s.qk_norm:
            for norm in ("q_norm", "k_norm"):
                params.append(_replicated(f"{attn}.{norm}.weight", (s.head_dim,), tp, "grad_sync",
                                          f"{attn}.{norm}.weight"))
                plan[f"{attn}.{norm}.weight"] = "grad_sync"
                sites.append(CollectiveSite(f"{attn}.{norm}", "all_reduce", "backward", fixed=s.head_dim,
                                            when="train", style="grad_sync",
                                            note="gradient of the replicated weight used on sharded activations"))
        params += _column(f"{mlp}.gate_proj", s.ffn, h, tp, "colwise", False)
        params += _column(f"{mlp}.up_proj", s.ffn, h, tp, "colwise", False)
        params += _row(f"{mlp}.down_proj", h, s.ffn, tp, "rowwise", False)
        params += [_replicated(f"{layer}.input_layernorm.weight", (h,), tp),
                   _replicated(f"{layer}.post_attention_layernorm.weight", (h,), tp)]
        plan |= {f"{mlp}.gate_proj": "colwise", f"{mlp}.up_proj": "colwise", f"{mlp}.down_proj": "rowwise",
                 mlp: "mlp", attn: "attention"}
        sites += _kv_replica_sites(attn, s, tp) + [_row_site(f"{attn}.o_proj", h, "rowwise"),
                                                   _row_site(f"{mlp}.down_proj", h, "rowwise"),
                                                   _region_site(mlp, h, "mlp"), _region_site(attn, h, "attention")]
    params.append(_replicated("model.norm.weight", (h,), tp))
    if not s.tied:
        params.append(_vocab("lm_head.weight", s, tp, "vocab_head"))
    plan["lm_head"] = "vocab_head"
    return params, sites + _head_sites(s, tp), plan


def _kv_replica_sites(attn: str, s: Shape, tp: int) -> list:
    """``ReplicatedHeadLinear``: one ``(n_kv, d, h[+1])`` slot buffer all-reduced in backward."""
    if s.kv_heads % tp == 0:
        return []
    fixed = s.kv_heads * s.head_dim * (s.hidden + (1 if s.qkv_bias else 0))
    return [CollectiveSite(f"{attn}.{p}", "all_reduce", "backward", fixed=fixed, when="train", style="colwise_kv",
                           note="gradient of the replicated KV head, one slot per KV head") for p in ("k_proj", "v_proj")]


# ---- the gpt family -------------------------------------------------------------------------------------

def _gpt(s: Shape, tp: int) -> tuple[list, list, dict]:
    h = s.hidden
    params = [_vocab("transformer.wte.weight", s, tp, "vocab", ("lm_head.weight",) if s.tied else ()),
              _replicated("transformer.wpe.weight", (s.positions, h), tp)]
    sites = [_embedding_site("transformer.wte", h)]
    plan = {"transformer.wte": "vocab"}
    conv = s.kv_heads == s.heads  # GPT-2: Conv1D layers; GPT-BigCode: linear layers, fewer KV heads
    for i in range(s.layers):
        block, attn, mlp = f"transformer.h.{i}", f"transformer.h.{i}.attn", f"transformer.h.{i}.mlp"
        params += [_replicated(f"{block}.ln_1.weight", (h,), tp), _replicated(f"{block}.ln_1.bias", (h,), tp)]
        params += (_conv_attention if conv else _fused_attention)(attn, s, tp)
        params += [_replicated(f"{block}.ln_2.weight", (h,), tp), _replicated(f"{block}.ln_2.bias", (h,), tp)]
        params += (_conv_mlp if conv else _linear_mlp)(mlp, s, tp)
        styles = (("conv1d_qkv", "conv1d_rowwise", "conv1d_colwise") if conv
                  else ("fused_colwise", "rowwise", "colwise"))
        plan |= {attn: "attention", f"{attn}.c_attn": styles[0], f"{attn}.c_proj": styles[1],
                 f"{mlp}.c_fc": styles[2], f"{mlp}.c_proj": styles[1]}
        sites += [_region_site(attn, h, "attention"), _row_site(f"{attn}.c_proj", h, styles[1]),
                  _row_site(f"{mlp}.c_proj", h, styles[1])]
        if conv:  # GPT-2's MLP is no region: c_fc all-reduces its own dX
            sites.append(CollectiveSite(f"{mlp}.c_fc", "all_reduce", "backward", per_token=h, when="train",
                                        style="conv1d_colwise", note="dX of a column split outside any region"))
        else:
            plan[mlp] = "mlp"
            sites += [_region_site(mlp, h, "mlp")] + _fused_sync_sites(f"{attn}.c_attn", s, tp)
    params += [_replicated("transformer.ln_f.weight", (h,), tp), _replicated("transformer.ln_f.bias", (h,), tp)]
    if not s.tied:
        params.append(_vocab("lm_head.weight", s, tp, "vocab_head"))
    plan["lm_head"] = "vocab_head"
    return params, sites + _head_sites(s, tp), plan


def _conv1d(name, dense, local, dim, pieces, style, module, tp) -> ParamShards:
    """A ``Conv1D`` tensor, stored ``(in, out)``: its shard transposed to ``(out, in)``."""
    ranks = [RankShard(local, dim, pieces[r], None, len(dense) == 2) for r in range(tp)]
    return _param(name, dense, style, module, ranks)


def _conv_attention(attn: str, s: Shape, tp: int) -> list:
    h, qkv = s.hidden, f"{attn}.c_attn"
    pieces = [sum((_even(h, r, tp, k * h) for k in range(3)), ()) for r in range(tp)]
    out = [_conv1d(f"{qkv}.weight", (h, 3 * h), (3 * h // tp, h), 1, pieces, "conv1d_qkv", qkv, tp),
           _conv1d(f"{qkv}.bias", (3 * h,), (3 * h // tp,), 0, pieces, "conv1d_qkv", qkv, tp)]
    rows = [_even(h, r, tp) for r in range(tp)]
    proj = f"{attn}.c_proj"
    return out + [_conv1d(f"{proj}.weight", (h, h), (h, h // tp), 0, rows, "conv1d_rowwise", proj, tp),
                  _replicated(f"{proj}.bias", (h,), tp, "conv1d_rowwise", proj)]


def _conv_mlp(mlp: str, s: Shape, tp: int) -> list:
    h, f = s.hidden, s.ffn
    cols = [_even(f, r, tp) for r in range(tp)]
    fc, proj = f"{mlp}.c_fc", f"{mlp}.c_proj"
    return [_conv1d(f"{fc}.weight", (h, f), (f // tp, h), 1, cols, "conv1d_colwise", fc, tp),
            _conv1d(f"{fc}.bias", (f,), (f // tp,), 0, cols, "conv1d_colwise", fc, tp),
            _conv1d(f"{proj}.weight", (f, h), (h, f // tp), 0, cols, "conv1d_rowwise", proj, tp),
            _replicated(f"{proj}.bias", (h,), tp, "conv1d_rowwise", proj)]


def _fused_attention(attn: str, s: Shape, tp: int) -> list:
    """GPT-BigCode's ``c_attn``: ``[q | k | v]`` rows, each segment split on its own."""
    h, q_rows, kv_rows = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    local = s.heads // tp * s.head_dim + 2 * tp_rules.kv_split(s.kv_heads, tp)[0] * s.head_dim
    pieces = [_even(q_rows, r, tp) + _kv_pieces(s, tp, r, q_rows) + _kv_pieces(s, tp, r, q_rows + kv_rows)
              for r in range(tp)]
    qkv, dense = f"{attn}.c_attn", q_rows + 2 * kv_rows
    out = [_param(f"{qkv}.weight", (dense, h), "fused_colwise", qkv,
                  [RankShard((local, h), 0, pieces[r]) for r in range(tp)]),
           _param(f"{qkv}.bias", (dense,), "fused_colwise", qkv, [RankShard((local,), 0, pieces[r]) for r in range(tp)])]
    return out + _row(f"{attn}.c_proj", h, q_rows, tp, "rowwise", True)


def _linear_mlp(mlp: str, s: Shape, tp: int) -> list:
    return _column(f"{mlp}.c_fc", s.ffn, s.hidden, tp, "colwise", True) + \
        _row(f"{mlp}.c_proj", s.hidden, s.ffn, tp, "rowwise", True)


def _fused_sync_sites(qkv: str, s: Shape, tp: int) -> list:
    """``sync_rows_grad``: the K and V rows several ranks hold alike (replicated KV heads), one
    ``(n_kv, rows, ...)`` slot buffer per tensor."""
    if s.kv_heads % tp == 0:
        return []
    rows = 2 * s.head_dim
    note = "gradient of rows several ranks hold alike, one slot per KV head"
    return [CollectiveSite(f"{qkv}.{p}", "all_reduce", "backward", fixed=s.kv_heads * rows * width, when="train",
                           style="fused_colwise", note=note) for p, width in (("weight", s.hidden), ("bias", 1))]


# ---- sites, matmuls, attention, activations -------------------------------------------------------------

def _embedding_site(module: str, h: int) -> CollectiveSite:
    return CollectiveSite(module, "all_reduce", "forward", per_token=h, style="vocab",
                          note="partial lookups of the vocabulary shards")


def _row_site(module: str, h: int, style: str) -> CollectiveSite:
    return CollectiveSite(module, "all_reduce", "forward", per_token=h, style=style, note="partial sums of the row split")


def _region_site(module: str, h: int, style: str) -> CollectiveSite:
    return CollectiveSite(module, "all_reduce", "backward", per_token=h, when="train", style=style,
                          note="dX of the block input at the region entry")


def _head_sites(s: Shape, tp: int) -> list:
    per = tp_rules.padded_range(s.vocab, 0, tp)[2]
    return [CollectiveSite("lm_head", "all_gather", "forward", per_token=per * tp, when="gathered", style="vocab_head",
                           note="output gathered over the ranks (padded columns travel too)", head=True),
            CollectiveSite("lm_head", "all_reduce", "backward", per_token=s.hidden, when="train", style="vocab_head",
                           note="dX of a column split outside any region", head=True)]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _matmuls(params: list) -> list:
    """``2 in out`` forward FLOPs per token of every weight matrix but the lookup tables; a tied
    head multiplies under its own name."""
    out = []
    for p in params:
        if len(p.shape) != 2 or not p.name.endswith("weight") or p.style in ("vocab", "replicate"):
            continue
        out.append(Matmul(p.name, "linear", 2 * p.numel, tuple(2 * r.numel for r in p.ranks), head=p.name == "lm_head.weight"))
    tied = next((p for p in params if "lm_head.weight" in p.tied), None)
    if tied is not None:
        out.append(Matmul("lm_head.weight", "linear", 2 * tied.numel, tuple(2 * r.numel for r in tied.ranks), head=True))
    return out


def _windowed(s: Shape, i: int) -> bool:
    return bool(s.window) and i >= s.layers - s.window_layers


def _attention(s: Shape, tp: int) -> list:
    q, (kv, _) = s.heads // tp, tp_rules.kv_split(s.kv_heads, tp)
    d = s.head_dim
    return [AttentionLayer(i, "sliding_attention" if _windowed(s, i) else "full_attention", s.heads, (q,) * tp,
                           d, d, 2 * s.kv_heads * d, (2 * kv * d,) * tp, s.window if _windowed(s, i) else None)
            for i in range(s.layers)]


def _activations(s: Shape, tp: int) -> list:
    """Korthikanti et al. 2022, Sec. 4.1, per token: two norms' inputs and outputs (``4h``); Q, K,
    V and o_proj's input; the MLP's intermediates (GELU's input and fc2's: ``2 f_t``; SwiGLU's gate,
    up and down inputs: ``3 f_t``); Qwen3's q/k-norm inputs; the scores; gpt's dropout masks
    (two residual ones, ``2h`` bytes, and one on the scores)."""
    a, (g, _) = s.heads // tp, tp_rules.kv_split(s.kv_heads, tp)
    f, d = s.ffn // tp, s.head_dim
    mlp = 2 * f if s.family == "gpt" else 3 * f
    sharded = (2 * a + 2 * g) * d + mlp + ((a + g) * d if s.qk_norm else 0)
    gpt = s.family == "gpt"
    return [LayerActivations(i, 4 * s.hidden, 2 * s.hidden if gpt else 0, (sharded,) * tp, (a,) * tp, gpt)
            for i in range(s.layers)]
