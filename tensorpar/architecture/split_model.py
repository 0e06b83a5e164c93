"""A model as tensorpar's runtime splits it over ``tp`` ranks, as plain data: :class:`SplitModel`.

Two producers build it, and the planner never knows which one ran: the meta-device producer
(``tensorpar.sharding.inventory.build_inventory``: the plan ``parallelize`` would apply, resolved
and built for every rank on a model on the meta device, from any ``config.json``) and the
templates (:mod:`tensorpar.architecture.templates`: the gpt and llama shapes worked out by hand,
standard library only). Everything the planner needs lives here, with the standard library only:

- **parameters**: every dense tensor (tied ones once), the style that splits it and the shard
  each rank holds (``RankShard``: pieces of one dim, padding, transpose), so parameter counts and
  bytes per rank are sums of shapes, vocabulary padding included;
- **collective sites**: each collective the runtime issues per forward call of a module, its
  payload per token (activations) or per call (parameter gradients), and when it runs;
- **matmuls**: forward FLOPs per token of every weight matrix, ``2 in out`` (a multiply-add is 2
  FLOPs; Kaplan et al. 2020, Sec. 2.1), an expert weight ``top_k / n_experts`` of that (each token
  visits ``top_k`` experts), dense and on each rank;
- **attention layers**: query heads per rank and head sizes for the attention core,
  ``2 c h (d_qk + d_v)`` FLOPs per token attending to ``c`` keys (``Q K^T`` and ``P V``), and the
  KV-cache elements each rank stores per token, with the layer's window (a sliding-window layer
  keeps its last ``W - 1`` tokens, as transformers' ``DynamicSlidingWindowLayer``);
- **activations**: per block, the tensors it keeps for its backward, per token
  (:class:`LayerActivations`, the tensor-by-tensor count of Korthikanti et al. 2022, Sec. 4.1).

``to_dict`` / ``from_dict`` round-trip through JSON, so a split model saved once is planned later
without torch. ``ModelInventory`` is its former name.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

WHEN = ("always", "train", "gathered")  # every forward; only with gradients; the gathered output head


@dataclass(frozen=True)
class RankShard:
    """What one rank holds of a dense tensor: ``shape`` locally; ``pieces`` ``[start, end)`` of
    ``dim`` of the dense tensor (None: the whole tensor), zero-padded to ``pad_to`` rows,
    transposed for GPT-2's Conv1D; ``replicas``: ranks holding an identical copy."""
    shape: tuple
    dim: int = 0
    pieces: tuple | None = None
    pad_to: int | None = None
    transpose: bool = False
    replicas: int = 1

    @property
    def numel(self) -> int:
        return _prod(self.shape)


@dataclass(frozen=True)
class ParamShards:
    """One dense parameter: ``name`` (its first holder; ``tied``: the others), dense ``shape``,
    the ``style`` of the ``placement`` that splits it (``"replicate"``, placement ``""``: none),
    and ``ranks[r]``: rank r's :class:`RankShard`."""
    name: str
    shape: tuple
    style: str
    placement: str
    ranks: tuple
    tied: tuple = ()

    @property
    def numel(self) -> int:
        return _prod(self.shape)


@dataclass(frozen=True)
class CollectiveSite:
    """One collective the runtime issues each time ``module`` runs forward (the ledger's module
    name). Its payload is ``per_token`` elements per token of the call plus ``fixed`` elements
    (a parameter's gradient), of ``elem_bytes`` each (None: the model's dtype; a float32
    statistic: 4); ``when``: ``always``, ``train`` (only when gradients are taken) or
    ``gathered`` (the output head gathering its logits, not in training). ``style``: the
    placement whose rule issues it."""
    module: str
    op: str
    phase: str
    per_token: int = 0
    fixed: int = 0
    when: str = "always"
    style: str = ""
    note: str = ""
    head: bool = False  # belongs to the output head (absent without it)
    elem_bytes: int | None = None

    def payload_bytes(self, tokens: int, bytes_per_elem: int) -> int:
        return self.payload_elems(tokens) * (self.elem_bytes or bytes_per_elem)

    def payload_elems(self, tokens: int) -> int:
        return self.per_token * tokens + self.fixed


@dataclass(frozen=True)
class Matmul:
    """Forward FLOPs per token of one weight matrix: ``flops`` dense, ``ranks[r]`` on rank r;
    ``kind``: ``linear`` or ``experts`` (already scaled by ``top_k / n_experts``)."""
    name: str
    kind: str
    flops: int
    ranks: tuple
    head: bool = False


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer: ``heads_dense`` query heads (``heads[r]`` on rank r), head sizes
    ``qk_dim`` and ``v_dim``, ``window`` keys at most (None: all), and the KV-cache elements one
    token adds: ``kv_dense`` in the unsplit layer, ``kv[r]`` on rank r."""
    index: int
    kind: str
    heads_dense: int
    heads: tuple
    qk_dim: int
    v_dim: int
    kv_dense: int
    kv: tuple
    window: int | None = None

    def core_flops_per_token(self, context: float, rank: int | None = None) -> float:
        """``2 c h (d_qk + d_v)``: the scores ``Q K^T`` and the weighted values ``P V`` of one
        token over ``c`` keys (at most the window), on ``rank`` (None: the unsplit layer)."""
        c = min(context, self.window) if self.window else context
        heads = self.heads_dense if rank is None else self.heads[rank]
        return 2.0 * c * heads * (self.qk_dim + self.v_dim)

    def cached_tokens(self, context: int) -> int:
        """Tokens the cache keeps after ``context`` tokens: all, or ``W - 1`` in a window."""
        return context if not self.window else min(context, self.window - 1)


@dataclass(frozen=True)
class LayerActivations:
    """What block ``index`` keeps for its backward, per token of a micro-batch (Korthikanti et al.
    2022, Sec. 4.1, tensor by tensor, no FlashAttention):

    - ``replicated``: elements every tp rank holds whole (each norm's input and output, the
      inputs of the column-split projections); sequence parallelism splits them over the ranks;
    - ``masks``: bytes of dropout masks on those tensors (1 byte per element);
    - ``sharded[r]``: elements rank r holds of the split tensors: a column split's output
      (queries, keys, values, the MLP's intermediate), a row split's input, per-head norms' inputs,
      an expert's intermediate ``top_k`` times;
    - ``score_heads[r]``: query heads whose softmax output (one element per key) rank r keeps,
      and with ``score_dropout`` its dropout mask (1 byte) and output (one element) as well.
    """
    index: int
    replicated: int
    masks: int
    sharded: tuple
    score_heads: tuple
    score_dropout: bool = False

    def bytes_per_token(self, rank: int, keys: int, bytes_per_elem: int, *, tp: int = 1,
                        sequence_parallel: bool = False, recompute: str = "none") -> float:
        """Bytes rank ``rank`` keeps per token, the scores over ``keys`` keys; selective
        recomputation drops the scores (Korthikanti et al. 2022, Sec. 4.2)."""
        e = bytes_per_elem
        whole = self.replicated * e + self.masks
        out = (whole / tp if sequence_parallel else float(whole)) + self.sharded[rank] * e
        if recompute == "none":
            out += self.score_heads[rank] * keys * (2 * e + 1 if self.score_dropout else e)
        return out


@dataclass(frozen=True)
class SplitModel:
    """A model split over ``tp`` ranks by tensorpar's runtime (see the module docstring).

    ``plan``: the resolved plan (``model.tp_report.styles``); ``params``, ``sites``, ``matmuls``,
    ``attention``, ``activations``: what it makes of each tensor, collective, weight matrix,
    attention layer and block; ``whole``: blocks left whole and why; ``fixes``: KV-head
    replication, vocabulary padding; ``dropout``: dropout on the residual stream (the embedding's
    output too); ``heads``, ``kv_heads``, ``head_dim``: the config's attention sizes (0: none)."""
    name: str
    model_type: str
    model_class: str
    tp: int
    plan_source: str
    head: bool
    causal: bool
    layers: int
    hidden: int
    vocab: int
    params: tuple
    sites: tuple
    matmuls: tuple
    attention: tuple
    dtype_bytes: int | None = None
    n_experts: int | None = None
    top_k: int | None = None
    valid_tp_sizes: tuple = ()
    fixes: tuple = ()
    whole: dict = field(default_factory=dict)
    notes: tuple = ()
    plan: dict = field(default_factory=dict)  # module or parameter name -> style, as parallelize applies it
    sharded_head: bool = False  # output head split by vocabulary: training keeps the logits sharded
    activations: tuple = ()
    dropout: bool = False
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0

    # ---- parameters ---------------------------------------------------------------------------

    @property
    def params_total(self) -> int:
        """The dense model's parameters, tied ones once (``sum(p.numel() for p in model.parameters())``)."""
        return sum(p.numel for p in self.params)

    def params_per_rank(self) -> list:
        """Parameters each rank holds after ``parallelize`` (padding rows included)."""
        return [sum(p.ranks[r].numel for p in self.params) for r in range(self.tp)]

    def param_bytes_per_rank(self, bytes_per_elem: int) -> list:
        return [n * bytes_per_elem for n in self.params_per_rank()]

    def param_styles(self) -> dict:
        """Parameter name -> the style that splits it (``replicate`` where none does)."""
        return {p.name: p.style for p in self.params}

    # ---- FLOPs and KV cache ---------------------------------------------------------------------

    def matmul_flops_per_token(self, rank: int | None = None, *, head: bool = True) -> int:
        """Forward FLOPs of every weight matrix for one token (``rank`` None: the dense model)."""
        return sum(m.flops if rank is None else m.ranks[rank] for m in self.matmuls if head or not m.head)

    def attention_flops_per_token(self, context: float, rank: int | None = None) -> float:
        return sum(a.core_flops_per_token(context, rank) for a in self.attention)

    def forward_flops_per_token(self, context: float, rank: int | None = None, *, head: bool = True) -> float:
        """Matmul FLOPs plus every attention layer's core over ``context`` keys."""
        return self.matmul_flops_per_token(rank, head=head) + self.attention_flops_per_token(context, rank)

    def kv_elems_per_token(self, rank: int | None = None) -> int:
        """KV-cache elements one token adds on ``rank`` (None: the unsplit model), all layers."""
        if not self.causal:
            return 0
        return sum(a.kv_dense if rank is None else a.kv[rank] for a in self.attention)

    def kv_cache_elems(self, context: int, rank: int | None = None) -> int:
        """KV-cache elements per sequence after ``context`` tokens (windows keep fewer)."""
        if not self.causal:
            return 0
        return sum(a.cached_tokens(context) * (a.kv_dense if rank is None else a.kv[rank]) for a in self.attention)

    # ---- JSON -------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SplitModel":
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["params"] = tuple(ParamShards(**{**p, "shape": tuple(p["shape"]), "tied": tuple(p["tied"]),
                                            "ranks": tuple(_rank_shard(s) for s in p["ranks"])})
                             for p in d["params"])
        kw["sites"] = tuple(CollectiveSite(**s) for s in d["sites"])
        kw["matmuls"] = tuple(Matmul(**{**m, "ranks": tuple(m["ranks"])}) for m in d["matmuls"])
        kw["attention"] = tuple(AttentionLayer(**{**a, "heads": tuple(a["heads"]), "kv": tuple(a["kv"])})
                                for a in d["attention"])
        kw["activations"] = tuple(LayerActivations(**{**a, "sharded": tuple(a["sharded"]),
                                                       "score_heads": tuple(a["score_heads"])})
                                  for a in d.get("activations", ()))
        for key in ("valid_tp_sizes", "fixes", "notes"):
            kw[key] = tuple(d.get(key, ()))
        return cls(**kw)


ModelInventory = SplitModel  # the former name


def _rank_shard(s: dict) -> RankShard:
    pieces = None if s["pieces"] is None else tuple(tuple(p) for p in s["pieces"])
    return RankShard(**{**s, "shape": tuple(s["shape"]), "pieces": pieces})


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
