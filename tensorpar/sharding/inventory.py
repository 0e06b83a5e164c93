"""The :class:`~tensorpar.architecture.split_model.SplitModel` of any model ``parallelize`` splits,
from its config alone: no weights read, no forward run. The planner's meta-device producer
(:class:`MetaSource`; the templates of ``tensorpar.architecture.templates`` are the other one).

``build_inventory(config_or_path, tp)`` builds the model on the meta device and, for every rank
``r``, runs ``parallelize(copy, tp_group=PlanningGroup(tp, r), prove=False)``: the real
resolution (pairs a plan leaves to discovery are checked on a small replica, as ``load_sharded``
does) and the real builders, which hold each rank's shards as meta tensors. The proof is left
out: it needs real collectives. The registry records the blocks a proof leaves whole
(``Arch.whole``), so the plan is the one ``parallelize`` applies; a block only the proof finds
inexact, and the registry does not name, is counted here as split. From those models it reads:

- every parameter's shard per rank (``p.tp_spec``, ``p.tp_replicas``: what ``load_sharded``
  reads from a checkpoint);
- the collective sites, by the rules the layers follow (each function below names its layer):
  what a vocabulary split, a column or row split inside or outside a region, a region entry and
  exit, a replicated KV head and a gradient-synchronised parameter issue per forward call;
- the FLOPs of every weight matrix, and the attention layers: heads per rank, head sizes,
  window, KV-cache elements per token (transformers' own cache layer types);
- what each block keeps for its backward (:func:`layer_activations`: Korthikanti et al. 2022's
  tensor-by-tensor count, generalised over the block's modules and their styles).

``predict_collectives`` then returns the planner's ``RuntimePrediction`` for any architecture, and
:class:`MetaSource` hands the planner the split at each tp it asks for (built once per tp).
"""
from __future__ import annotations

import copy
import inspect
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from tensorpar.distributed.groups import PlanningGroup
from tensorpar.nn import ColumnParallelLinear, ReplicatedHeadLinear, RowParallelLinear, VocabParallelEmbedding
from tensorpar.nn.norm import ShardedRMSNorm
from tensorpar.architecture.split_model import (AttentionLayer, CollectiveSite, LayerActivations, Matmul, ParamShards,
                                                RankShard, SplitModel)
from tensorpar.planner.runtime import predict_from_inventory
from tensorpar.sharding.pipeline import parallelize
from tensorpar.sharding.commit import module_heads
from tensorpar.sharding.marks import _is_experts
from tensorpar.architecture import configs, registry
from tensorpar.architecture.plans import parent_name
from tensorpar.sharding.model_classes import meta_model, model_class
from tensorpar.sharding.records import Placement
from tensorpar.sharding.sizes import model_dims, text_config
from tensorpar.sharding.styles import STYLES

EXPERT_COUNT = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
EXPERT_TOP_K = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k", "top_k")
_CACHED_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention")
_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


# ---- the config and the meta model -------------------------------------------------------------------

def load_config(config_or_path):
    """``(config, name)`` from a transformers config, a ``config.to_dict()`` or a checkpoint
    directory / ``config.json`` (read locally; nothing is downloaded)."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if isinstance(config_or_path, PretrainedConfig):
        return config_or_path, getattr(config_or_path, "_name_or_path", "") or config_or_path.model_type
    if isinstance(config_or_path, dict):
        d = dict(config_or_path)
    else:
        path = Path(config_or_path)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"no such config.json: {path}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        d.setdefault("_name_or_path", path.parent.name)
    # transformers writes a float JSON cannot hold as {"__float__": "Infinity"} (Bamba's
    # time_step_limit (0, inf)) and decodes it on reading: read it back as transformers does.
    d = PretrainedConfig._decode_special_floats(d)
    kind = d.get("model_type")
    if kind not in CONFIG_MAPPING:
        import transformers
        raise ValueError(f"model_type {kind!r} is not known to transformers {transformers.__version__}")
    fields = {k: v for k, v in d.items() if k not in ("model_type", "transformers_version")}
    if "torch_dtype" in fields:  # the name older checkpoints use
        fields.setdefault("dtype", fields.pop("torch_dtype"))
    return AutoConfig.for_model(kind, **fields), d.get("_name_or_path") or kind


def _meta_model(config, head: bool):
    import transformers
    declared = (getattr(config, "architectures", None) or [None])[0] if head else None
    cls = getattr(transformers, declared, None) if declared else None
    try:
        with torch.device("meta"):  # buffers too: a full-size rotary or mask table is gigabytes (DeepSeek-V3: 28 GiB)
            return meta_model(config, cls or model_class(config, head))
    except Exception as exc:  # noqa: BLE001 - any failure to build: the model cannot be planned
        raise ValueError(f"cannot build a {config.model_type} model from this config on the meta device "
                         f"({type(exc).__name__}: {exc})") from None


def _split(model, tp: int, rank: int):
    out = copy.deepcopy(model)  # a copy costs a quarter of building the meta model again
    parallelize(out, tp_group=PlanningGroup(tp, rank), prove=False)
    return out


# ---- the inventory ----------------------------------------------------------------------------

def build_inventory(config_or_path, tp: int, *, head: bool = True) -> SplitModel:
    """The model of ``config_or_path`` split over ``tp`` ranks. ``head``: the model with its
    output head (the causal-LM class, the masked-LM class of an encoder), else the bare model.
    ValueError when tensorpar cannot split it at this tp, with the reason."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp ({tp!r}) must be a positive integer")
    config, name = load_config(config_or_path)
    return split_meta(_meta_model(config, head), config, name, tp, head=head)


def split_meta(dense, config, name, tp: int, *, head: bool) -> SplitModel:
    """:func:`build_inventory` of a meta model already built (``dense`` is left as it is: each
    rank splits a copy), so that a source builds it once for every tp it plans."""
    ranks = [_split(dense, tp, r) for r in range(tp)]
    report, dims, text = ranks[0].tp_report, model_dims(dense), text_config(config)
    params = param_shards(dense, ranks)
    if tp > 1 and not any(r.pieces is not None for p in params for r in p.ranks):
        why = "; ".join(f"{k}: {v}" for k, v in report.whole.items()) or "its plan splits no module"
        raise ValueError(f"tensorpar splits nothing of {type(dense).__name__} at tp {tp} ({why})")
    feas = report.feasibility
    attention = tuple(attention_layers(dense, ranks[0], dims, text, tp))
    mats = tuple(matmuls(dense, ranks, text))
    return SplitModel(
        name=str(name), model_type=config.model_type, model_class=type(dense).__name__, tp=tp,
        plan_source=report.source, head=head, causal=_causal(dense), layers=_layers(text),
        hidden=_width(text, dims, "hidden"), vocab=_width(text, dims, "vocab"),
        params=tuple(params), sites=tuple(collective_sites(ranks[0], dims)),
        matmuls=mats, attention=attention,
        dtype_bytes=_dtype_bytes(text), n_experts=_first(text, EXPERT_COUNT), top_k=_first(text, EXPERT_TOP_K),
        valid_tp_sizes=tuple(feas.valid_tp_sizes) if feas else (), fixes=tuple(report.notes),
        whole=dict(report.whole), notes=tuple(_notes(dense, report)), plan=dict(report.styles),
        sharded_head=_sharded_head(ranks[0]),
        activations=tuple(layer_activations(dense, params, {m.name for m in mats}, attention, dims, text, tp)),
        dropout=_dropout(text, _RESIDUAL_DROPOUT), heads=dims.n_heads if dims else 0,
        kv_heads=dims.n_kv_heads if dims else 0, head_dim=dims.head_dim if dims else 0)


def _width(config, dims, field: str) -> int:
    """The hidden size or vocabulary of ``config``, read from the config itself where its head
    counts cannot be (``model_dims`` None: RWKV and Mamba have no attention heads, yet a pipeline
    stage still sends ``b s h`` activations and the head still splits the vocabulary)."""
    if dims:
        return getattr(dims, field)
    arch = registry.arch(config.model_type)
    names = (arch.config_names[field],) if arch and field in arch.config_names else configs.NAMES[field]
    return configs.count(config, names) or 0


def _first(config, names):
    for n in names:
        v = getattr(config, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _layers(config) -> int:
    return _first(config, ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")) or 0


def _dtype_bytes(config) -> int | None:
    dtype = getattr(config, "dtype", None)
    return _DTYPE_BYTES.get(str(dtype).removeprefix("torch.")) if dtype is not None else None


def _causal(model) -> bool:
    """A decoder that keeps a KV cache: its forward takes one (``past_key_values`` or ``cache``, as
    ``tensorpar.models.generation`` passes it) and it is no encoder. An encoder: a masked-LM type,
    or a model whose layers say ``is_decoder = False`` (BERT's kin read it to mask and to cache),
    neither configured as a decoder nor an encoder-decoder."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES as MASKED
    config = model.config
    takes_cache = any(k in inspect.signature(type(model).forward).parameters for k in ("past_key_values", "cache"))
    encoder_layers = config.model_type in MASKED or any(getattr(m, "is_decoder", None) is False for m in model.modules())
    encoder = encoder_layers and not getattr(config, "is_decoder", False) and not getattr(config, "is_encoder_decoder", False)
    return takes_cache and not encoder


def _notes(model, report) -> list:
    notes = ["collective sites assume every module runs once per forward, on every token of the batch"]
    if any(name.split(".")[-1] == "pooler" for name, _ in model.named_modules()):
        notes.append("the pooler runs on one token per sequence: its FLOPs are left out of the per-token count")
    if report.whole:
        notes.append(f"left whole: {', '.join(sorted(report.whole))}")
    return notes


# ---- parameters ----------------------------------------------------------------------------------

def _tie_groups(model) -> dict:
    """Every parameter name -> the name ``model.parameters()`` counts it under (its first holder)."""
    first, canon = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canon[name] = first.setdefault(id(p), name)
    return canon


def _placement_of(name: str, styles: dict) -> tuple[str, str]:
    """``(style, placement)`` that splits parameter ``name``: its own, its module's, or none."""
    if name in styles:
        return styles[name], name
    owner = parent_name(name)
    if owner in styles and STYLES[styles[owner]].target == "module":
        return styles[owner], owner
    return "replicate", ""


def param_shards(dense, ranks) -> list:
    """:class:`ParamShards` of every dense parameter, read from each rank's ``tp_spec``."""
    canon = _tie_groups(dense)
    per_rank = []
    for model in ranks:
        shards = {}
        for p in model.parameters():
            spec = p.tp_spec
            shards[canon.get(spec.key, spec.key)] = RankShard(
                tuple(p.shape), spec.dim, spec.pieces, spec.pad_to, spec.transpose, p.tp_replicas)
        per_rank.append(shards)
    tied = {}
    for name, c in canon.items():
        if name != c:
            tied.setdefault(c, []).append(name)
    styles = ranks[0].tp_report.styles
    out = []
    for name, p in dense.named_parameters():
        style, placement = _placement_of(name, styles)
        out.append(ParamShards(name, tuple(p.shape), style, placement,
                               tuple(shards[name] for shards in per_rank), tuple(tied.get(name, ()))))
    return out


# ---- collective sites ------------------------------------------------------------------------------

def collective_sites(model, dims) -> list:
    """Every collective rank 0's split ``model`` issues per forward call of each module."""
    styles = model.tp_report.styles
    placements = {n: Placement(n, s) for n, s in styles.items()}
    head = _output_head(model)
    sites = []
    for name, style in styles.items():
        kind = STYLES[style].kind
        if kind == "region":
            sites += region_sites(model, name, style, placements, dims)
        elif kind == "param" or style == "grad_sync":
            sites += param_sites(model, name, style)
        elif kind == "norm":
            sites += norm_sites(name, style, model.get_submodule(name))
        elif kind in ("column", "row", "vocab"):
            found = module_sites(name, style, model.get_submodule(name))
            sites += [_as_head(s) for s in found] if name == head else found
        elif kind != "replicate":
            raise ValueError(f"the inventory knows no collective rule for style {style!r} ({kind}) on {name!r}")
    return sites + row_sync_sites(model, styles)


def _sharded_head(model) -> bool:
    """The output head split by vocabulary: ``causal_lm_loss`` then keeps the logits sharded and
    computes the vocabulary-parallel cross-entropy (three all-reduces), else a local one."""
    head = _output_head(model)
    mod = model.get_submodule(head) if head is not None else None
    return isinstance(mod, ColumnParallelLinear) and mod.tp_size > 1


def _output_head(model) -> str | None:
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        head = None
    return next((n for n, m in model.named_modules() if m is head), None) if head is not None else None


def _as_head(site: CollectiveSite) -> CollectiveSite:
    return replace(site, head=True)


def module_sites(name: str, style: str, module) -> list:
    """The layers' own collectives (``tensorpar.nn.layers``, ``tensorpar.nn.attention``)."""
    if isinstance(module, VocabParallelEmbedding) or style == "vocab":
        # VocabParallelEmbedding: all-reduce of the (B, T, H) partial lookups; no backward
        return [CollectiveSite(name, "all_reduce", "forward", per_token=module.embedding_dim, style=style,
                               note="partial lookups of the vocabulary shards")]
    if isinstance(module, ReplicatedHeadLinear):
        # ReplicatedHeadLinear: one (n_kv, D, H[+1]) slot buffer all-reduced in backward
        if not any(p.requires_grad for p in module.parameters()):
            return []
        rows, cols = module.weight.shape
        width = cols + (1 if module.bias is not None else 0)
        return [CollectiveSite(name, "all_reduce", "backward", fixed=module.n_kv_heads * rows * width,
                               when="train", style=style,
                               note="gradient of the replicated KV head, one slot per KV head")]
    if isinstance(module, ColumnParallelLinear) or hasattr(module, "out_features_per_partition"):
        return _column_sites(name, style, module)  # a ColumnParallelLinear, or a linear subclass rebased on it
    if isinstance(module, RowParallelLinear):
        return _row_sites(name, style, module)
    raise AssertionError(f"{name}: style {style!r} built a {type(module).__name__}")


def _column_sites(name, style, mod) -> list:
    out = []
    if mod.gather_output:  # all-gather of the padded output, trimmed after
        # causal_lm_loss keeps a ColumnParallelLinear head's logits sharded; a rebased head gathers
        toggled = style == "vocab_head" and isinstance(mod, ColumnParallelLinear)
        out.append(CollectiveSite(name, "all_gather", "forward", per_token=mod.out_features_per_partition * mod.tp_size,
                                  when="gathered" if toggled else "always", style=style,
                                  note="output gathered over the ranks (padded columns travel too)"))
    if not mod.skip_input_comm:  # linear_with_grad_allreduce: dX all-reduced
        out.append(CollectiveSite(name, "all_reduce", "backward", per_token=mod.in_features, when="train",
                                  style=style, note="dX of a column split outside any region"))
    return out


def row_sync_sites(model, styles: dict) -> list:
    """``tensorpar.nn.regions.sync_rows_grad``: rows of a shard that several ranks hold alike (a
    replicated KV head in a fused projection or a sharded norm) have their gradient summed in an
    ``(n_slots, rows, ...)`` buffer, named after the parameter."""
    out = []
    for pname, p in model.named_parameters():
        sync = getattr(p, "tp_rows_sync", None)
        if sync is None or not p.requires_grad:
            continue
        rows = sum(b - a for a, b in sync["rows"])
        out.append(CollectiveSite(sync["name"], "all_reduce", "backward", when="train",
                                  fixed=sync["n_slots"] * rows * (p[0].numel() if p.dim() > 1 else 1),
                                  style=styles.get(parent_name(pname), ""),
                                  note="gradient of rows several ranks hold alike, one slot per KV head"))
    return out


def _row_sites(name, style, mod: RowParallelLinear) -> list:
    out = []
    if mod.reduce_output:
        out.append(CollectiveSite(name, "all_reduce", "forward", per_token=mod.out_features, style=style,
                                  note="partial sums of the row split"))
    elif mod.bias is not None and mod.bias.requires_grad:  # partial sum left to the region; bias on rank 0, summed
        out.append(CollectiveSite(name, "all_reduce", "backward", fixed=mod.bias.numel(), when="train",
                                  style=style, note="bias gradient of a row split inside a partial-sum region"))
    if not mod.input_is_parallel:  # scatter_to_tp_region: all-gather of dX
        out.append(CollectiveSite(name, "all_gather", "backward", per_token=mod.in_features, when="train",
                                  style=style, note="dX of a row split whose input was whole"))
    return out


def norm_sites(name, style, module) -> list:
    """``tensorpar.nn.norm.ShardedRMSNorm``: the per-token float32 sum of squares all-reduced
    forward, and its gradient backward."""
    if not isinstance(module, ShardedRMSNorm):
        raise ValueError(f"the inventory knows no collective rule for a {type(module).__name__} ({style!r} on {name!r})")
    note = "float32 sum of squares of this rank's features, per token"
    return [CollectiveSite(name, "all_reduce", "forward", per_token=1, style=style, note=note, elem_bytes=4),
            CollectiveSite(name, "all_reduce", "backward", per_token=1, when="train", style=style,
                           note="its gradient", elem_bytes=4)]


def region_sites(model, name, style, placements, dims) -> list:
    """``tensorpar.nn.regions``: the entry's f (all-reduce of dX), and a ``moe`` region's g
    (all-reduce of its output), which the ledger names after the caller: its global hook pops
    the region before the region's own forward hook runs."""
    width = _region_width(model, name, placements, dims)
    out = [CollectiveSite(name, "all_reduce", "backward", per_token=width, when="train", style=style,
                          note="dX of the block input at the region entry")]
    if style == "moe":
        out.append(CollectiveSite(parent_name(name), "all_reduce", "forward", per_token=width, style=style,
                                  note="partial sums of routed and shared experts, reduced once"))
    elif style == "moe_experts":
        out.append(CollectiveSite(name, "all_reduce", "backward", per_token=_top_k(model), when="train",
                                  style=style, note="gradient of the routing weights at the region entry"))
        out.append(CollectiveSite(parent_name(name), "all_reduce", "forward", per_token=width, style=style,
                                  note="partial sums of the routed experts"))
    elif style == "moe_split":
        out += [CollectiveSite(parent_name(sub), "all_reduce", "forward", per_token=width, style=style,
                               note="partial sums of the routed experts, reduced where they are made")
                for sub, m in model.get_submodule(name).named_modules(prefix=name) if _is_experts(m)]
    return out


_TOP_K_NAMES = ("num_experts_per_tok", "top_k_experts", "moe_topk", "num_experts_per_token", "moe_k", "top_k")


def _top_k(model) -> int:
    """Experts per token: the width of the routing weights a ``moe_experts`` region takes in."""
    config = text_config(model)
    for field in _TOP_K_NAMES:
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"no experts-per-token count in the config of {type(model).__name__} "
                     f"(looked for {', '.join(_TOP_K_NAMES)})")


def _region_width(model, anchor, placements, dims) -> int:
    """Width of a region's input, the block's hidden states: the model's hidden size (without
    head counts, the in_features of a column split inside the region)."""
    if dims is not None:
        return dims.hidden
    for name, p in placements.items():
        if name.startswith(anchor + ".") and STYLES[p.style].kind == "column":
            width = getattr(model.get_submodule(name), "in_features", None)
            if width:
                return width
    raise ValueError(f"region {anchor!r}: no hidden size in the config and no column split inside it")


def param_sites(model, name, style) -> list:
    """``grad_sync`` / ``param_rank0`` (``tensorpar.nn.regions``): the parameter's gradient
    all-reduced once per forward of its module; the split parameter styles issue nothing."""
    if style not in ("grad_sync", "param_rank0"):
        return []
    owner, _, attr = name.rpartition(".")
    param = getattr(model.get_submodule(owner), attr)
    if not param.requires_grad:  # frozen: its substitute is skipped, nothing to reduce
        return []
    numel = param.numel()
    return [CollectiveSite(owner, "all_reduce", "backward", fixed=numel, when="train", style=style,
                           note=f"gradient of the replicated {attr} used on sharded activations")]


# ---- FLOPs ------------------------------------------------------------------------------------------

def _skipped(name: str, module) -> bool:
    """An embedding (a lookup) or a pooler (one token per sequence): no FLOPs per token."""
    return isinstance(module, (nn.Embedding, VocabParallelEmbedding)) or "pooler" in name.split(".")


def _module_matmuls(model, n_experts, top_k) -> dict:
    """``{parameter name: (kind, forward FLOPs per token)}``: a 2-D ``weight`` does ``2 in out``;
    a 3-D expert tensor ``(E, ...)`` ``top_k`` of its E matrices per token."""
    out = {}
    for mname, module in model.named_modules():
        if _skipped(mname, module):
            continue
        for pname, p in module._parameters.items():
            full = f"{mname}.{pname}" if mname else pname
            if p is not None and pname == "weight" and p.dim() == 2:
                out[full] = ("linear", 2 * p.numel())
            elif p is not None and p.dim() == 3 and n_experts and top_k and p.shape[0] == n_experts:
                out[full] = ("experts", 2 * (p.numel() // n_experts) * top_k)
    return out


def matmuls(dense, ranks, config) -> list:
    """:class:`Matmul` of every weight matrix, dense and on each rank (tied ones under each holder:
    an output head tied to the embedding still multiplies)."""
    n_experts, top_k = _first(config, EXPERT_COUNT), _first(config, EXPERT_TOP_K)
    per_rank = [_module_matmuls(m, n_experts, top_k) for m in ranks]
    head = _output_head(dense)
    return [Matmul(name, kind, flops, tuple(r[name][1] for r in per_rank),
                   head=head is not None and name.startswith(head + "."))
            for name, (kind, flops) in _module_matmuls(dense, n_experts, top_k).items()]


# ---- attention layers and the KV cache -----------------------------------------------------------------

def _layer_index(name: str) -> int | None:
    return next((int(part) for part in name.split(".") if part.isdigit()), None)


def _cache_layers(config) -> list:
    """``[(kind, window)]`` per layer as transformers' ``DynamicCache`` types them."""
    from transformers.cache_utils import get_layer_types_and_kwargs
    try:
        kinds, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except Exception:  # noqa: BLE001 - a config transformers cannot type per layer: every layer full
        return [("full_attention", None)] * _layers(config)
    return [(k, kw.get("sliding_window")) for k, kw in zip(kinds, kwargs)]


_KEY_NAMES = ("k_proj", "key", "Wk", "k")  # tensorpar.sharding.commit's key projections


def _split_attention(styles: dict) -> dict:
    """``{layer: region}`` of the layers whose attention runs on this rank's heads: an
    ``attention`` region, or any region holding a column split of the keys or GPT-2's fused qkv."""
    regs = {n for n, s in styles.items() if STYLES[s].kind == "region"}
    out = {_layer_index(n): n for n, s in styles.items() if s == "attention"}
    for name, style in styles.items():
        keys = STYLES[style].kind == "column" and (name.rpartition(".")[2] in _KEY_NAMES or style == "conv1d_qkv")
        anchor = parent_name(name)
        if keys and anchor in regs:
            out.setdefault(_layer_index(name), anchor)
    return out


def attention_layers(dense, model, dims, config, tp: int) -> list:
    """One :class:`AttentionLayer` per layer with a KV cache layer (full, sliding, chunked):
    where the layer's attention is a region, its own heads (``commit.module_heads``: layers may
    differ) split as ``parallelize`` splits them, else the config's, whole."""
    if dims is None:
        return []
    regions = _split_attention(model.tp_report.styles)
    qk = getattr(config, "qk_head_dim", None) or dims.head_dim
    v = getattr(config, "v_head_dim", None) or dims.head_dim
    latent = getattr(config, "kv_lora_rank", None)
    out = []
    for i, (kind, window) in enumerate(_cache_layers(config)):
        if kind not in _CACHED_KINDS:
            continue
        q, kv = dims.n_heads, dims.n_kv_heads
        hq, hkv = q, kv
        if i in regions:
            q, kv = module_heads(dense.get_submodule(regions[i]), regions[i], SimpleNamespace(dims=dims))
            hq, hkv = q // tp, (kv // tp if kv % tp == 0 else 1)
        if latent:  # multi-head latent attention caches one latent and one rope key, shared by the heads
            kv_dense = kv_rank = latent + (getattr(config, "qk_rope_head_dim", None) or 0)
        else:
            kv_dense, kv_rank = 2 * kv * dims.head_dim, 2 * hkv * dims.head_dim
        out.append(AttentionLayer(i, kind, q, (hq,) * tp, qk, v, kv_dense, (kv_rank,) * tp, window))
    return out


# ---- the planner's prediction ---------------------------------------------------------------------------

def predict_collectives(config_or_path, tp: int, batch: int, seq: int, bytes_per_elem: int,
                        workload: str = "forward", *, new_tokens: int = 1, candidates: int = 1,
                        backend: str = "gloo"):
    """The planner's ``RuntimePrediction`` (``tensorpar.planner.predict``) of ``workload`` for any
    architecture ``parallelize`` splits: ``forward`` runs the bare model, every other workload the
    model with its output head."""
    inv = build_inventory(config_or_path, tp, head=workload != "forward")
    return predict_from_inventory(inv, batch, seq, bytes_per_elem, workload, new_tokens=new_tokens,
                                  candidates=candidates, backend=backend)


# ---- activations: what each block keeps for its backward --------------------------------------------------

# Dropout probabilities transformers' configurations name: on the residual stream (and the
# embedding's output), and on the attention probabilities.
_RESIDUAL_DROPOUT = ("resid_pdrop", "hidden_dropout_prob", "hidden_dropout", "residual_dropout", "dropout")
_SCORE_DROPOUT = ("attn_pdrop", "attention_probs_dropout_prob", "attention_dropout")


def _dropout(config, names) -> bool:
    return any(isinstance(p := getattr(config, n, None), (int, float)) and not isinstance(p, bool) and p > 0
               for n in names)


def _is_norm(module) -> bool:
    w = getattr(module, "weight", None)
    return "Norm" in type(module).__name__ and w is not None and w.dim() == 1


def _in_out(module, p) -> tuple[int, int]:
    """``(in, out)`` of a dense weight matrix: ``nn.Linear`` stores ``(out, in)``, GPT-2's
    ``Conv1D`` ``(in, out)``."""
    rows, cols = p.shape
    return (rows, cols) if type(module).__name__ == "Conv1D" else (cols, rows)


def _matrix_terms(dense, shards: dict, name: str, tp: int, hidden: int, top_k: int) -> tuple[int, list]:
    """``(replicated, per-rank sharded)`` elements per token a weight matrix's neighbours keep:
    a column split's output (the next op's input), a row split's input, an unsplit matrix's
    output; an expert tensor ``top_k`` times its intermediate, this rank's share of it."""
    owner, _, _ = name.rpartition(".")
    p, shard = dense.get_parameter(name), shards[name]
    local = [r.numel for r in shard.ranks]
    if p.dim() == 3:  # (E, a, b): each token visits top_k experts; the width is the non-hidden dim
        width = p.shape[2] if p.shape[1] == hidden else p.shape[1]
        return 0, [top_k * width * n // p.numel() for n in local]
    inp, out = _in_out(dense.get_submodule(owner), p)
    kind = STYLES[shard.style].kind if shard.style in STYLES else "replicate"
    if kind == "param":
        kind = "row" if "row" in shard.style else "column"
    if kind == "column":
        return 0, [n // inp for n in local]
    if kind == "row":
        return 0, [n // out for n in local]
    return out, [0] * tp


def _norm_terms(name: str, module, shards: dict, heads: tuple, kv: tuple, dims, tp: int):
    """A sharded norm keeps its shard of the input; a per-head one (Qwen3's ``q_norm``,
    ``k_norm``: one head's width) its input, this rank's heads' worth; any other its input and
    its output (the next projection's input)."""
    shard = shards.get(f"{name}.weight")
    width = module.weight.numel()
    if shard is not None and shard.style in STYLES and STYLES[shard.style].kind == "norm":
        return 0, [r.numel for r in shard.ranks]
    if width == dims.head_dim != dims.hidden:
        per = kv if name.rpartition(".")[2].startswith("k") else heads
        return 0, [width * h for h in per]
    return 2 * width, [0] * tp


def _block_terms(dense, name, module, shards, matrices, a, dims, tp, top_k) -> list:
    """``(replicated, per-rank sharded)`` terms of one module of a block: a norm, and each
    weight matrix it holds."""
    heads = a.heads if a else (dims.n_heads,) * tp
    kv = tuple(k // (2 * dims.head_dim) for k in a.kv) if a and dims.head_dim else heads
    terms = [_norm_terms(name, module, shards, heads, kv, dims, tp)] if _is_norm(module) else []
    for pname, p in module._parameters.items():
        if p is not None and f"{name}.{pname}" in matrices:
            terms.append(_matrix_terms(dense, shards, f"{name}.{pname}", tp, dims.hidden, top_k))
    return terms


def layer_activations(dense, params, matrices, attention, dims, config, tp: int) -> list:
    """:class:`LayerActivations` of every block (the modules under an index: ``model.layers.3``),
    from its norms and weight ``matrices`` and the styles that split them, its attention layer's
    heads, and the config's dropout (two residual masks per block, one on the scores)."""
    if dims is None:
        return []
    shards = {p.name: p for p in params}
    attn = {a.index: a for a in attention}
    top_k = _first(config, EXPERT_TOP_K) or 1
    blocks: dict = {}
    for name, module in dense.named_modules():
        i = _layer_index(name)
        if i is None:
            continue
        block = blocks.setdefault(i, [0, [0] * tp])
        for rep, sharded in _block_terms(dense, name, module, shards, matrices, attn.get(i), dims, tp, top_k):
            block[0] += rep
            block[1] = [x + y for x, y in zip(block[1], sharded)]
    masks = 2 * dims.hidden if _dropout(config, _RESIDUAL_DROPOUT) else 0
    drop = _dropout(config, _SCORE_DROPOUT)
    return [LayerActivations(i, rep, masks, tuple(sharded), attn[i].heads if i in attn else (0,) * tp,
                             drop and i in attn)
            for i, (rep, sharded) in sorted(blocks.items())]


# ---- the planner's source --------------------------------------------------------------------------------

class MetaSource:
    """A model the planner plans from its config (:mod:`tensorpar.planner.source`): the split at
    each tp built once, on the meta device, as ``parallelize`` would split it. ``seq``: the
    sequence planned for (default: the config's position limit, else 2048)."""

    def __init__(self, config_or_path, *, seq: int | None = None):
        self._label = config_or_path if isinstance(config_or_path, (str, Path)) else None
        self.config, self.name = _named(SimpleNamespace(model_type=_kind(config_or_path)), self._label,
                                        lambda: load_config(config_or_path))
        self._splits: dict = {}
        self.seq, self.seq_source = self._sequence(seq)
        self._dense = None

    def _sequence(self, seq: int | None) -> tuple[int, str]:
        """The sequence planned for and where it comes from: ``--seq``, the text model's position
        limit (its field named), else 2048."""
        if seq is not None:
            return seq, "--seq"
        text = text_config(self.config)
        field = next((n for n in configs.NAMES["positions"] if configs.is_count(configs.get(text, n))), None)
        if field is None:
            return 2048, "default 2048 (the config gives no position limit)"
        return configs.get(text, field), f"{field} in {self._label or self.name}"

    def at(self, tp: int) -> SplitModel:
        """The split at ``tp``; ValueError with the reason when tensorpar cannot split it there, and
        one line naming the config when transformers refuses it or the model cannot be built."""
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp ({tp!r}) must be a positive integer")
        if tp not in self._splits:
            self._splits[tp] = _named(self.config, self._label or self.name, lambda: self._split(tp))
        return self._splits[tp]

    def _split(self, tp: int) -> SplitModel:
        if self._dense is None:  # built once: a full-size meta model costs seconds
            self._dense = _meta_model(self.config, head=True)
        return split_meta(self._dense, self.config, self.name, tp, head=True)

    def valid_tp_sizes(self) -> list:
        return list(self.at(1).valid_tp_sizes)

    def describe(self) -> dict:
        one = self.at(1)
        windows = [a.window for a in one.attention if a.window]
        return {"name": str(self.name), "family": one.model_type, "model_type": one.model_type,
                "model_class": one.model_class, "plan_source": one.plan_source, "layers": one.layers,
                "hidden": one.hidden, "heads": one.heads, "kv_heads": one.kv_heads, "head_dim": one.head_dim,
                "vocab": one.vocab, "seq": self.seq, "seq_source": self.seq_source, "causal": one.causal,
                "n_experts": one.n_experts, "top_k": one.top_k, "sliding_window": max(windows, default=None),
                "window_layers": len(windows) or None}


# What transformers raises for a config its configuration class refuses (a validator's error, a
# size that divides by zero), and what building a model tensorpar cannot plan raises (a vision or
# audio model missing what a text model has): named, in one line.
_BUILD_ERRORS = (TypeError, AttributeError, KeyError, IndexError, ZeroDivisionError, RuntimeError,
                 NotImplementedError, AssertionError)


def _kind(config_or_path) -> str:
    """The model type a config names, for a message about it (before transformers reads it)."""
    if isinstance(config_or_path, (str, Path)):
        path = Path(config_or_path)
        path = path / "config.json" if path.is_dir() else path
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            return "?"
        return str(d.get("model_type")) if isinstance(d, dict) else "?"
    return str(getattr(config_or_path, "model_type", None) or dict(config_or_path).get("model_type"))


def _named(config, name, build):
    from huggingface_hub.errors import StrictDataclassError
    try:
        return build()
    except StrictDataclassError as exc:  # a validator of the configuration class: its own words
        raise ValueError(f"{name}: transformers refuses this {config.model_type} config: "
                         f"{_words(exc.__cause__ or exc)}") from None
    except _BUILD_ERRORS as exc:
        raise ValueError(f"{name}: tensorpar cannot build and split this {config.model_type} model for a plan "
                         f"({type(exc).__name__}: {_words(exc)})") from None


def _words(exc) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


