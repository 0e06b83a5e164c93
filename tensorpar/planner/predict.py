"""The collectives tensorpar's runtime issues for a Hugging Face model, predicted before it runs.

``predict_collectives(hf_config, tp, batch, seq, bytes_per_elem, workload)`` lists, per tp rank,
every collective that ``tensorpar.distributed.ledger`` records when a model parallelized by
``tensorpar.parallelize`` runs one of these workloads on a batch of ``batch`` sequences:

    workload   what runs                                            items (N = b s h e, t = tp)
    forward    the bare model (AutoModel), e.g. sentence            embedding all_reduce N;
               embeddings from BERT / MiniLM                        per layer 2 x all_reduce N
    logits     the model with its head, an ordinary forward         + lm_head all_gather of the
               (the head gathers the logits)                          logits, b s ceil(V/t) t e
    train      causal_lm_loss forward + backward: logits stay       + per layer 2 x all_reduce N
               vocab-sharded, vocab-parallel cross-entropy            of dX; lm_head all_reduce N
               over the b (s - 1) predicted tokens                    of dX; 3 x all_reduce of
                                                                      b (s-1) max(e, 4) (loss);
                                                                      t > kv heads: 2 x all_reduce
                                                                      of (g, d, h[+1]) per layer
    decode     one greedy step with a KV cache: a (b, 1) forward,   forward with s = 1, the head
               the head's logits left vocab-sharded, then each        without a gather; then an
               rank's best (value, index) exchanged                   all_gather of b t k 2 float64
               (tensorpar.models.generation)                          (16 bytes per candidate;
                                                                      k = candidates, 1 for greedy)
    generate   generate(..., max_new_tokens=new_tokens): the        the prompt step (s = seq, the
               prompt step then new_tokens - 1 decode steps           head on its last position
                                                                      only) and new_tokens - 1
                                                                      decode steps

The items come from :func:`.comm.tp_collectives` (Shoeybi et al. 2019, Sec. 3; docs/architecture.md)
with the head as the runtime runs it; bytes sent per rank are the ring figures of
:func:`.collectives.ring_bytes_sent` (all-reduce ``2(t-1)/t N``, all-gather ``(t-1)/t N``) and,
the same figures the ledger records.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .collectives import ring_bytes_sent
from .comm import tp_collectives
from .hf import check_tp, hf_model, params_per_rank
from .layout import Layout, check_size

WORKLOADS = ("forward", "logits", "train", "decode", "generate")
ENCODER_WORKLOADS = ("forward", "logits")
_DTYPE_OF = {8: "fp64", 4: "fp32", 2: "bf16"}
BACKENDS = ("gloo", "nccl", "shm")
CANDIDATE_BYTES = 16  # generate exchanges (value, index) pairs as float64


@dataclass(frozen=True)
class PredictedCollective:
    """``count`` collectives of one kind, each of ``payload_bytes`` (N); ``bytes_sent_per_rank[r]``
    is what tp rank r sends for one of them."""

    op: str
    where: str
    phase: str
    group_size: int
    payload_bytes: int
    bytes_sent_per_rank: tuple
    count: int = 1
    note: str = ""

    @property
    def total_bytes_sent_per_rank(self) -> list:
        return [b * self.count for b in self.bytes_sent_per_rank]

    def to_dict(self) -> dict:
        return {**asdict(self), "bytes_sent_per_rank": list(self.bytes_sent_per_rank),
                "total_bytes_sent_per_rank": self.total_bytes_sent_per_rank}


@dataclass(frozen=True)
class RuntimePrediction:
    """What each rank sends in one workload, item by item, and holds in parameters.

    ``items``: the whole workload; ``per_layer``: one transformer layer (counts per layer, every
    layer the same); ``bytes_sent_per_rank``: totals over ``items`` per tp rank.
    """

    family: str
    workload: str
    backend: str
    tp: int
    batch: int
    seq: int
    bytes_per_elem: int
    new_tokens: int
    layers: int
    items: list
    per_layer: list
    bytes_sent_per_rank: list
    per_layer_bytes_sent_per_rank: list
    params_total: int
    params_per_rank: int
    param_bytes_per_rank: int
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["items"] = [i.to_dict() for i in self.items]
        d["per_layer"] = [i.to_dict() for i in self.per_layer]
        return d


@dataclass(frozen=True)
class _Step:
    phase: str
    seq: int
    head: str  # tp_collectives' head: "none", "gathered", "sharded"
    loss: bool = False
    next_token: bool = False
    count: int = 1


def candidates_per_rank(candidates: int, vocab: int, tp: int) -> int:
    """Candidates each rank offers per row in a decode step: ``candidates`` (1 for greedy, top_k
    when sampling with it), at most its vocabulary shard, ``ceil(V / tp)`` (padding included)."""
    return min(candidates, -(-vocab // tp))


def _steps(workload: str, seq: int, new_tokens: int) -> list[_Step]:
    if workload == "forward":
        return [_Step("inference", seq, "none")]
    if workload == "logits":
        return [_Step("inference", seq, "gathered")]
    if workload == "train":
        return [_Step("training", seq, "sharded", loss=True)]
    decode = _Step("inference", 1, "sharded", next_token=True)
    if workload == "decode":
        return [decode]
    later = [_Step("inference", 1, "sharded", next_token=True, count=new_tokens - 1)] if new_tokens > 1 else []
    return [_Step("inference", seq, "sharded", next_token=True)] + later


def predict_collectives(hf_config: dict, tp: int, batch: int, seq: int, bytes_per_elem: int,
                        workload: str = "forward", *, new_tokens: int = 1, candidates: int = 1,
                        backend: str = "gloo") -> RuntimePrediction:
    """Every collective one tp rank issues in ``workload`` (see the module docstring).

    ``hf_config``: ``config.to_dict()`` of a llama, mistral, qwen2, gpt2 or bert model;
    ``seq``: tokens per sequence (for ``decode`` the context already cached, which changes no
    collective; for ``generate`` the prompt length); ``bytes_per_elem``: the model's dtype
    (8 float64, 4 float32, 2 bf16/fp16); ``new_tokens``: generated tokens (``generate``);
    ``candidates``: the (value, index) pairs each rank offers per row and decode step (1 greedy,
    ``top_k`` when sampling with it; sampling without top_k gathers the logits: not predicted);
    ``backend``: ``"gloo"``, ``"nccl"`` or ``"shm"`` (recorded in the prediction; the ring figures
    are the same for each).
    """
    _check_args(tp, batch, seq, bytes_per_elem, workload, new_tokens, candidates)
    if backend not in BACKENDS:
        raise ValueError(f"backend ({backend!r}) must be one of: {', '.join(BACKENDS)}")
    model = hf_model(hf_config, seq=seq)
    check_tp(model, tp)
    if not model.is_causal and workload not in ENCODER_WORKLOADS:
        raise ValueError(f"workload {workload!r} needs a causal LM; {model.kind} is an encoder; "
                         f"valid workloads: {', '.join(ENCODER_WORKLOADS)}")
    layout = Layout(tp=tp, micro_batch=batch, dtype=_DTYPE_OF[bytes_per_elem], workload="inference")
    items, per_layer = [], []
    for step in _steps(workload, seq, new_tokens):
        step_items, step_layer = _step_items(model, layout, step, candidates)
        items += step_items
        per_layer += step_layer
    items, per_layer = _merge(items), _merge(per_layer)
    head = workload != "forward"
    params = params_per_rank(hf_config, tp, head=head)
    return RuntimePrediction(
        family=model.kind, workload=workload, backend=backend, tp=tp, batch=batch, seq=seq,
        bytes_per_elem=bytes_per_elem,
        new_tokens=new_tokens if workload == "generate" else 0, layers=model.spec.layers,
        items=items, per_layer=per_layer, bytes_sent_per_rank=_totals(items, tp),
        per_layer_bytes_sent_per_rank=_totals(per_layer, tp),
        params_total=params_per_rank(hf_config, 1, head=head), params_per_rank=params,
        param_bytes_per_rank=params * bytes_per_elem, notes=_notes(workload))


def _step_items(model, layout, step: _Step, candidates: int = 1) -> tuple[list, list]:
    """(items, per-layer items) of one forward (and backward), times ``step.count``."""
    b, e, tp = layout.micro_batch, layout.bytes_per_elem, layout.tp
    comm = tp_collectives(model.spec, layout, phase=step.phase, seq=step.seq, head=step.head,
                          with_loss=step.loss, loss_bytes=max(e, 4), loss_tokens=b * (step.seq - 1))
    items = [_from_comm(i, tp, step.count) for i in comm["per_micro_batch"]]
    per_layer = [_from_comm(i, tp, step.count) for i in comm["per_layer"]]
    if step.next_token and tp > 1:
        n = b * tp * candidates_per_rank(candidates, model.spec.vocab, tp) * CANDIDATE_BYTES  # (b, tp k, 2) float64
        sent = (ring_bytes_sent("all_gather", n, tp),) * tp
        items.append(PredictedCollective("all_gather", "next_token", "forward", tp, n, sent, step.count,
                                         "each rank's best (value, index): every rank picks the same token"))
    return items, per_layer


def _from_comm(i, tp: int, repeat: int) -> PredictedCollective:
    return PredictedCollective(i.op, i.where, i.phase, i.group_size, i.payload_bytes,
                               (i.bytes_sent_per_device,) * tp, i.count * repeat, i.note)


def _merge(items: list) -> list:
    """Items of the same kind (op, where, phase, payload) from several steps, counts summed."""
    merged: dict = {}
    for i in items:
        key = (i.op, i.where, i.phase, i.payload_bytes)
        old = merged.get(key)
        merged[key] = i if old is None else PredictedCollective(
            i.op, i.where, i.phase, i.group_size, i.payload_bytes, i.bytes_sent_per_rank,
            old.count + i.count, i.note)
    return list(merged.values())


def _totals(items: list, tp: int) -> list:
    return [sum(i.total_bytes_sent_per_rank[r] for i in items) for r in range(tp)]


def _notes(workload: str) -> list:
    if workload == "train":
        return ["forward + backward of causal_lm_loss; gradient clipping (clip_grad_norm_) adds one "
                "all_reduce of 8 bytes, not counted here"]
    if workload == "generate":
        return ["assumes no sequence stops early at an eos token"]
    return []


def _check_args(tp, batch, seq, bytes_per_elem, workload, new_tokens, candidates=1) -> None:
    for name, value in (("tp", tp), ("batch", batch), ("seq", seq), ("new_tokens", new_tokens),
                        ("candidates", candidates)):
        check_size(name, value)
    if bytes_per_elem not in _DTYPE_OF:
        raise ValueError(f"bytes_per_elem ({bytes_per_elem!r}) must be one of: 8 (float64), 4 (float32), "
                         f"2 (bf16/fp16)")
    if workload not in WORKLOADS:
        raise ValueError(f"workload ({workload!r}) must be one of: {', '.join(WORKLOADS)}")
    if workload == "train" and seq < 2:
        raise ValueError(f"seq ({seq}) must be at least 2 for 'train' (each position predicts the next token)")
