"""Time estimates: a training step, a decode step, a prefill, term by term (not bounds).

Everything here is computed for one device (the busiest pipeline rank and tensor-parallel rank)
from the split model's own records and a :class:`~.profile.Profile` of achieved rates:

- **matmuls** (``gemm_s``): every weight matrix of the rank's stages as a GEMM of
  ``(tokens, in) @ (in, out)`` on its local shard, timed by the profile's GEMM model
  (``fixed + 2 m n k / rate + bytes / bandwidth``); backward runs two GEMMs of the same size
  (the input's and the weight's gradient); full recomputation runs the blocks' forward again.
- **attention cores** (``attention_s``): per layer and sequence, ``heads`` batched GEMMs of the
  scores ``(s, d) @ (d, keys)`` and the weighted values. A fused kernel (SDPA, FlashAttention)
  keeps the scores out of memory; an unfused one writes and re-reads them (the elementwise term).
  The keys and values are read once per layer (grouped heads share them): at decode, reading the
  K/V cache is most of the work.
- **elementwise work** (``elementwise_s``): norms, activations, residual adds, rotary, dropout,
  softmax. Each element of a tensor a block keeps for backward (Korthikanti et al. 2022's count,
  the split's ``activations``) is read or written by such work the runtime's
  ``elementwise_accesses`` times in forward and in backward (:class:`Runtime`): with fused
  kernels (Megatron's) written once and read once in forward, twice each in backward; PyTorch's
  eager modules make more passes. Unfused attention adds its score tensors (softmax, mask,
  dropout: 4 passes each way, 5 with dropout). Bytes over the achieved memory bandwidth.
- **fixed cost** (``fixed_s``): ``block_call_s`` per block call and ``step_call_s`` per step
  (embedding, head, loop) from the profile, measured under the layout's data-parallel engine
  where the profile has it (FSDP's hooks and sharded optimizer cost more per block than DDP's). On a synchronous host (CPU) it adds to the work; on
  a GPU, kernels queue behind the work, so only what exceeds the work shows.
- **collectives** (``tp_comm_s``, ``pp_comm_s``, ``dp_comm_s``): every item the planner counts
  (:mod:`.traffic`) at the link's ``alpha + n beta`` for its group size and its link (inside a
  node or across). Tensor-parallel and pipeline collectives wait for the compute (they sit on the
  critical path). Data-parallel gradient reduction overlaps the backward only where the runtime
  overlaps it (:class:`Runtime`): then only what exceeds the backward, and at least the last
  bucket, shows. FSDP and ZeRO also copy each gathered or reduced buffer in and out (read and
  written twice), and PyTorch's DDP each gradient into its bucket and back.
- **the wait for the slower rank** (``tp_wait_s``): ranks meet at every tensor-parallel
  collective, so each call runs at the pace of whichever rank was slower since the last; on a
  noisy host that costs more than the slowest rank's median work. Each call, after an equal share
  of the rank's work, waits the profile's measured wait for work of that length
  (:meth:`.Profile.wait_s`, ``calibrate``'s GEMM-then-all-reduce loop); only on a synchronous host.
- **pipeline bubble** (``bubble_s``): the time a rank waits while the other stages fill and
  drain the pipeline: ``f / (1 - f)`` (``f`` the schedule's idle share, :mod:`.schedules`) of
  ``m`` microbatches of the other stages' work; equal stages: ``busy * f / (1 - f)``.
- **optimizer** (``optimizer_s``): the rank's parameters (its ZeRO/FSDP share) times one step's
  time per parameter: measured by calibrate for tensorpar's optimizer (clipping, PyTorch's AdamW:
  its passes include fresh buffers, slower than the copy rate), else the bytes the runtime's
  optimizer moves per parameter (:class:`Runtime`) over the memory bandwidth.

Known limits (docs/planner.md): one block's fixed cost is measured on one architecture (Llama);
the wait for a slower rank is modelled at tensor-parallel collectives only (not at data-parallel
ones or pipeline sends, where a whole step's or microbatch's noise averages out), and a host
whose speed drifts after its calibration is not; a GPU profile from
public figures has one GEMM efficiency for all large shapes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tensorpar.architecture.split_model import SplitModel

from .profile import Profile
from .schedules import bubble_fraction
from tensorpar.architecture.pipeline import stages_of_rank

from .stages import Stages, blocks, layers_of
from .estimate_comm import _dp_copies, _largest_dp_payload, _last_bucket, comm_seconds, tp_wait_seconds
from .runtimes import EAGER_ELEMENTWISE, MEGATRON_2020, MEGATRON_2021, ON_CPU, ON_GPU, Runtime, default_runtime

__all__ = ["EAGER_ELEMENTWISE", "MEGATRON_2020", "MEGATRON_2021", "ON_CPU", "ON_GPU", "Runtime", "default_runtime"]


# ---- the work of one micro-batch on one rank ---------------------------------------------------

def _shapes(split: SplitModel) -> dict:
    """Parameter by name, a tied tensor under each of its names (GPT's head is its embedding)."""
    return {name: p for p in split.params for name in (p.name, *p.tied)}


def _gemm_seconds(split: SplitModel, names, rank: int, tokens: float, e: int, profile: Profile, dtype: str,
                  *, head_tokens: float | None = None) -> float:
    """Forward GEMMs of the matmuls ``names`` on ``rank`` for ``tokens`` tokens (the head's for
    ``head_tokens``). An expert tensor ``(E, out, in)`` is E GEMMs, each seeing its share."""
    g, params, total = profile.gemm_for(dtype), _shapes(split), 0.0
    for m in split.matmuls:
        if m.name not in names or not m.ranks[rank]:
            continue
        p = params.get(m.name)
        shard = p.ranks[rank].shape if p is not None else None
        if not shard or len(shard) < 2:
            continue
        n, k = shard[-2], shard[-1]
        calls = p.ranks[rank].numel // (n * k)
        t = head_tokens if (m.head and head_tokens is not None) else tokens
        rows = t * m.ranks[rank] / (2.0 * n * k * calls)  # tokens each GEMM sees (top_k / E of them in an expert)
        total += g.seconds(rows, n, k, e, calls=calls)
    return total


def _attention_seconds(split: SplitModel, layer_ids, rank: int, batch: int, queries: int, keys: float, e: int,
                       profile: Profile, dtype: str, fused: bool) -> float:
    """The scores and weighted values of ``queries`` queries over ``keys`` keys, ``batch``
    sequences: two batched GEMMs per layer (one call each, every head inside), reading the
    queries and the layer's keys and values (shared by grouped heads), writing the output;
    unfused, the scores too go through memory."""
    g, total = profile.gemm_for(dtype), 0.0
    for a in split.attention:
        if a.index not in layer_ids or not a.heads[rank]:
            continue
        c = min(keys, a.window) if a.window else keys
        heads = batch * a.heads[rank]
        flops = heads * 2.0 * queries * c * (a.qk_dim + a.v_dim)
        operands = e * (heads * queries * (a.qk_dim + a.v_dim) + batch * c * a.kv[rank])
        scores = 0.0 if fused else heads * e * 2 * queries * c
        total += 2 * g.fixed_s + flops / g.rate_flops + (operands + scores) / g.bytes_per_s
    return total


def _elementwise_parts(split: SplitModel, layer_ids, rank: int, tokens: float, keys: float, e: int,
                       fused: bool) -> tuple[float, float]:
    """``(kept, rest)`` bytes of the elementwise work in a forward (see the module docstring): one
    access to every element a block keeps for backward (the runtime's count multiplies it), and
    what else it moves (dropout masks; unfused attention's score passes)."""
    kept = rest = 0.0
    for a in split.activations:
        if a.index not in layer_ids:
            continue
        kept += tokens * e * (a.replicated + a.sharded[rank])
        rest += tokens * a.masks
        if not fused:
            passes = 5 if a.score_dropout else 4
            rest += tokens * a.score_heads[rank] * keys * e * passes
    return kept, rest


@dataclass(frozen=True)
class _Stage:
    names: frozenset     # matmuls of the stages this rank holds
    layers: frozenset    # block indices
    blocks: int
    head: bool
    ids: frozenset = frozenset({0})  # the stages


def _rank_stages(split: SplitModel, st: Stages, pp_rank: int, pp: int, virtual: int, schedule: str) -> _Stage:
    mine = stages_of_rank(pp_rank, pp, virtual, schedule)
    names = frozenset(m.name for m in split.matmuls if st.of(m.name) in mine)
    layers = frozenset(b for s in mine for b in layers_of(st, s))
    return _Stage(names, layers, len(layers), any(m.head and m.name in names for m in split.matmuls), frozenset(mine))


def _whole(split: SplitModel) -> _Stage:
    names = frozenset(m.name for m in split.matmuls)
    layers = frozenset(blocks(split))
    return _Stage(names, layers, len(layers), any(m.head for m in split.matmuls))


def forward_terms(split: SplitModel, stage: _Stage, rank: int, *, batch: int, seq: int, keys: float, e: int,
                  dtype: str, profile: Profile, runtime: Runtime, head_tokens: float | None = None) -> dict:
    """Seconds of one forward of ``batch x seq`` tokens through ``stage`` on ``rank``: matmuls,
    attention cores, elementwise work (no fixed cost, no collectives)."""
    fused = runtime.attention == "fused"
    tokens = float(batch * seq)
    return {"gemm_s": _gemm_seconds(split, stage.names, rank, tokens, e, profile, dtype, head_tokens=head_tokens),
            "attention_s": _attention_seconds(split, stage.layers, rank, batch, seq, keys, e, profile, dtype, fused),
            "elementwise_s": _elementwise_seconds(split, stage.layers, rank, tokens, keys, e, fused, profile,
                                                  runtime.elementwise_accesses[0], 1.0)}


def _elementwise_seconds(split, layer_ids, rank, tokens, keys, e, fused, profile: Profile, accesses: float,
                         rest_passes: float) -> float:
    """The elementwise work's seconds: ``accesses`` of each kept element and ``rest_passes`` of
    the rest (:func:`_elementwise_parts`) over the memory bandwidth."""
    kept, rest = _elementwise_parts(split, layer_ids, rank, tokens, keys, e, fused)
    return (accesses * kept + rest_passes * rest) / profile.memory_bytes_per_s


def _body(split: SplitModel, stage: _Stage) -> _Stage:
    """The stage without its head (what full recomputation re-runs)."""
    heads = {m.name for m in split.matmuls if m.head}
    return _Stage(stage.names - heads, stage.layers, stage.blocks, False, stage.ids)


def _micro_work(split: SplitModel, stage: _Stage, layout, seq: int, profile: Profile, runtime: Runtime):
    """One microbatch's forward and backward work through ``stage`` on its busiest tp rank:
    ``(terms, seconds, tp rank)``."""
    best = None
    kw = dict(batch=layout.micro_batch, seq=seq, keys=float(seq), e=layout.bytes_per_elem, dtype=layout.dtype,
              profile=profile, runtime=runtime)
    for rank in range(split.tp):
        fwd = forward_terms(split, stage, rank, **kw)
        # forward once, backward twice; the elementwise work by its own count: the runtime's
        # accesses each way to the kept elements, the masks and score passes once forward, twice backward
        work = {k: 3.0 * v for k, v in fwd.items() if k != "elementwise_s"}
        work["elementwise_s"] = _elementwise_seconds(split, stage.layers, rank, float(layout.micro_batch * seq),
                                                     float(seq), layout.bytes_per_elem, runtime.attention == "fused",
                                                     profile, sum(runtime.elementwise_accesses), 3.0)
        if layout.recompute == "full":
            again = forward_terms(split, _body(split, stage), rank, **kw)
            work = {k: work[k] + again[k] for k in work}
        elif layout.recompute == "selective":
            work["attention_s"] += fwd["attention_s"]
        total = sum(work.values())
        if best is None or total > best[1]:
            best = (work, total, rank)
    return best


def stage_micro_seconds(split: SplitModel, st: Stages, layout, seq: int, profile: Profile,
                        runtime: Runtime | None = None) -> list[float]:
    """Per pipeline rank, one microbatch's forward and backward through its stages (busiest tp
    rank) with their blocks' fixed costs: what the others wait for while it fills and drains the
    pipeline (:func:`training_step`'s bubble). Computed once per layout, shared by every rank's
    step."""
    runtime = runtime or default_runtime(profile)
    engine = _dp_engine(layout)
    out = []
    for s in range(layout.pp):
        stage = _rank_stages(split, st, s, layout.pp, layout.virtual_stages, layout.schedule)
        out.append(_micro_work(split, stage, layout, seq, profile, runtime)[1]
                   + stage.blocks * profile.block_s("train", split.tp, engine))
    return out


def _dp_engine(layout) -> str | None:
    """The data-parallel engine whose fixed costs a training step pays (the profile's key)."""
    return ("fsdp" if layout.zero_stage == 3 else "ddp") if layout.dp > 1 else None


def _bubble(stage_seconds: list, pp_rank: int, m: int, f: float) -> float:
    """Seconds pipeline rank ``pp_rank`` waits in the schedule: ``f / (1 - f)`` of ``m`` microbatches
    of the *other* stages' work (``stage_seconds``: :func:`stage_micro_seconds`). A rank waits
    while the others fill and drain the pipeline, so with stages of unequal work (the head on the
    last) the busiest one waits for the lighter ones: for GPipe and 1F1B, ``f / (1 - f) = (p - 1)
    / m`` and this is the sum over the other stages of one microbatch's work (Narayanan et al.
    2021, Sec. 2.2, with ``t`` per stage); with equal stages, ``f / (1 - f)`` of the rank's own
    work."""
    others = [t for s, t in enumerate(stage_seconds) if s != pp_rank]
    if not others or f <= 0:
        return 0.0
    return f / (1.0 - f) * m * sum(others) / len(others)


# ---- a training step -----------------------------------------------------------------------------

def training_step(split: SplitModel, st: Stages, layout, seq: int, items: list, placement: dict,
                  profile: Profile, runtime: Runtime | None = None, pp_rank: int = 0,
                  stage_seconds: list | None = None) -> dict:
    """Seconds of one optimizer step on the busiest tp rank of pipeline rank ``pp_rank``, term by
    term (``items``: that rank's collectives of the step, :func:`.traffic.rank_step`;
    ``stage_seconds``: :func:`stage_micro_seconds` of the layout, computed here when not given)."""
    runtime = runtime or default_runtime(profile)
    e, m = layout.bytes_per_elem, layout.num_micro_batches
    stage = _rank_stages(split, st, pp_rank, layout.pp, layout.virtual_stages, layout.schedule)
    work, per_micro, rank = _micro_work(split, stage, layout, seq, profile, runtime)
    terms = {k: m * v for k, v in work.items()}
    engine = _dp_engine(layout)
    calls = m * (stage.blocks * profile.block_s("train", split.tp, engine) + profile.step_s("train", split.tp, engine))
    terms["fixed_s"] = calls if profile.synchronous else max(0.0, calls - m * per_micro)
    comm = comm_seconds(items, placement, layout.pp, profile)
    terms["tp_comm_s"], terms["pp_comm_s"] = comm["tp"], comm["pp"]
    terms["tp_wait_s"] = tp_wait_seconds(items, m * per_micro + calls, placement, layout.pp, profile)
    f = bubble_fraction(layout.schedule, pp=layout.pp, microbatches=m, virtual=layout.virtual_stages) \
        if layout.pp > 1 else 0.0
    if layout.pp > 1 and f < 1:
        stage_seconds = stage_seconds or stage_micro_seconds(split, st, layout, seq, profile, runtime)
        terms["bubble_s"] = _bubble(stage_seconds, pp_rank, m, f)
    else:
        terms["bubble_s"] = 0.0
    copied = ("all_gather", "reduce_scatter") + (("all_reduce",) if runtime.dp_bucket_copies else ())
    dp = comm["dp"] + _dp_copies(items, profile, copied)
    if runtime.dp_overlap and dp > 0:
        backward = 2.0 / 3.0 * m * per_micro
        last = min(dp, comm_seconds([_last_bucket(items, runtime.bucket_bytes)], placement, layout.pp,
                                    profile)["dp"]) if _largest_dp_payload(items) else 0.0
        dp = max(dp - backward, last)
    terms["dp_comm_s"] = dp
    params = _rank_params(split, st, stage, rank, layout)
    terms["optimizer_s"] = params * optimizer_seconds_per_param(profile, runtime, e) if layout.workload == "train" else 0.0
    return _summary(terms, tokens=float(layout.global_batch * seq) / layout.dp, extra={"bubble_fraction": f,
                    "tp_rank": rank, "pp_rank": pp_rank, "runtime": runtime.name})


def optimizer_seconds_per_param(profile: Profile, runtime: Runtime, bytes_per_elem: int = 4) -> float:
    """One optimizer step per parameter of ``bytes_per_elem`` bytes: the float32 step calibrate
    measured where the runtime is the one it timed (tensorpar's: clipping, PyTorch's AdamW), else
    the runtime's bytes over the memory bandwidth; times ``bytes_per_elem / 4`` below float32
    unless the optimizer keeps float32 states whatever the model's dtype
    (``Runtime.optimizer_fp32_states``: apex's fused Adam, whose 32 bytes are mixed precision's)."""
    if profile.optimizer_s_per_param is not None and runtime.optimizer == "torch-adamw":
        per = profile.optimizer_s_per_param
    else:
        per = runtime.optimizer_bytes_per_param / profile.memory_bytes_per_s
    return per if runtime.optimizer_fp32_states else per * min(bytes_per_elem, 4) / 4


def _rank_params(split: SplitModel, st: Stages, stage: _Stage, rank: int, layout) -> float:
    """Parameters the optimizer of ``rank`` updates: those its stages hold (a tied copy on each),
    its 1/dp share under ZeRO or FSDP."""
    n = sum(p.ranks[rank].numel for p in split.params if set(st.homes[p.name]) & stage.ids)
    sharded = layout.zero_stage > 0 or getattr(layout, "data_parallel", None) == "fsdp"
    return n / layout.dp if sharded else float(n)


# ---- inference -----------------------------------------------------------------------------------

def decode_step(split: SplitModel, layout, context: int, items: list, placement: dict, profile: Profile,
                runtime: Runtime | None = None, *, engine: str = "decode") -> dict:
    """Seconds of one decode step: ``micro_batch`` sequences each add one token over ``context``
    keys, through every stage in turn (a token crosses the pipeline), on the busiest tp rank.
    ``engine``: ``decode`` (tensorpar's lean forward) or ``decode_hf`` (Hugging Face's forward)."""
    runtime = runtime or default_runtime(profile)
    b = layout.micro_batch
    terms = _inference(split, layout, items, placement, profile, engine,
                       kw=dict(batch=b, seq=1, keys=float(context), runtime=_fused(runtime)))
    return _summary(terms, tokens=float(b))


def _fused(runtime: Runtime) -> Runtime:
    """Decoding reads one query's scores: no score tensor worth a pass of its own."""
    return replace(runtime, attention="fused")


def prefill(split: SplitModel, layout, prompt: int, items: list, placement: dict, profile: Profile,
            runtime: Runtime | None = None, *, all_logits: bool = False, phase: str = "prefill") -> dict:
    """Seconds of one forward of ``micro_batch`` prompts of ``prompt`` tokens through every stage
    (one after another: a single prompt does not fill a pipeline), the head for the last token
    of each (``all_logits``: for every token, as a plain forward computes them). ``phase``: whose
    fixed costs (``prefill``: ``generate``'s; ``forward``: a plain forward's)."""
    runtime = runtime or default_runtime(profile)
    b = layout.micro_batch
    keys = (prompt + 1) / 2 if (split.causal and runtime.attention == "fused") else float(prompt)
    terms = _inference(split, layout, items, placement, profile, phase,
                       kw=dict(batch=b, seq=prompt, keys=keys, runtime=runtime,
                               head_tokens=None if all_logits else float(b)))
    return _summary(terms, tokens=float(b * prompt))


def _inference(split: SplitModel, layout, items: list, placement: dict, profile: Profile, phase: str, *,
               kw: dict) -> dict:
    """A forward through every stage on the busiest tp rank (``kw``: :func:`forward_terms`'),
    ``phase``'s fixed costs, and the collectives ``items``."""
    whole, b = _whole(split), layout.micro_batch
    best = max((forward_terms(split, whole, rank, e=layout.bytes_per_elem, dtype=layout.dtype, profile=profile, **kw)
                for rank in range(split.tp)), key=lambda t: sum(t.values()))
    terms = dict(best)
    calls = whole.blocks * profile.block_s(phase, split.tp, batch=b) + profile.step_s(phase, split.tp, batch=b)
    terms["fixed_s"] = calls if profile.synchronous else max(0.0, calls - sum(best.values()))
    comm = comm_seconds(items, placement, layout.pp, profile)
    terms["tp_comm_s"], terms["pp_comm_s"] = comm["tp"], comm["pp"]
    terms["tp_wait_s"] = tp_wait_seconds(items, sum(best.values()) + calls, placement, layout.pp, profile)
    return terms


def _summary(terms: dict, *, tokens: float, extra: dict | None = None) -> dict:
    total = sum(terms.values())
    dominant = max(terms, key=terms.get) if total > 0 else None
    return {"seconds": total, "tokens_per_s": tokens / total if total > 0 else None, "terms": terms,
            "dominant": dominant, **(extra or {})}
