"""`tensorpar verify`: layer by layer, does the split model compute what the unsplit one does?

For each tp size, every rank loads its shards of the checkpoint and the whole model (so verify
needs the dense model's memory on every rank: it is a check for models that fit).
Both run the same inputs forward and backward (decoders: the next-token loss, from
vocab-sharded logits on the split model; encoders: a fixed random projection of the last
hidden state). Per transformer block we compare

- the block's output activation (replicated on every rank, so directly comparable),
- the gradient of the loss with respect to that activation,
- the gradient of every parameter of the block, each rank's shard element by element against
  the same slice of the dense gradient,

as ``max |split - unsplit| / max |unsplit|`` against the dtype's tolerance, and name the first
block that diverges.

Below float64, verify asks two questions, since rounding can hide a wrong split or fake one:

- *Is the split right?* Each rank also loads its shards in float64 and runs them against the
  unsplit model in float64: relative 1e-10 (sums reordered: ~1e-15; a missing reduction, a
  partial or absent gradient, heads paired wrongly: O(1)). This is the ``structure`` column,
  judged at float64's tolerance whatever the dtype asked for (at float32's, 1e-5, where the model
  computes part of its forward in float32 even in float64: Llama's RMSNorm, MoE routers).
- *Does it round like the unsplit model?* In the dtype asked for, a tensor passes when it is
  within the dtype's tolerance *or* the split's error against float64 (a norm over the tensor) is
  at most :func:`rounding_factor` ``(tp)`` times the unsplit model's own: a quantity whose exact
  value is ~0 (the gradient of an attention key bias: softmax ignores a shift shared by all keys)
  is pure rounding noise in both models, and noise judged against its own size is O(1). The
  factor counts the roundings the split adds (below). Discrete choices (a router's top-k) are
  made once, by the float64 model, and replayed in both (:class:`RoutingReplay`): a near-tie that
  rounding flips would otherwise move a token to other experts, an O(1) difference with nothing
  wrong.

Each layer reports its worst ``excess`` (per tensor the smaller of ``rel / tolerance`` and
``error_vs_float64 / (factor · unsplit_error_vs_float64)``) and its worst ``structure`` excess
(float64 ``rel / 1e-10``); a layer is ok when both are at most 1.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field

import torch

from tensorpar import distributed as dist
from tensorpar.architecture import configs
from tensorpar.jobs.common import (DTYPES, TOLERANCE, check_length, check_tp, dense_model, is_decoder, no_phase,
                                   nonfinite, open_checkpoint, parse_dtype, quiet_transformers)
from tensorpar.jobs.routing import RoutingReplay
from tensorpar.models.checkpoint import load_sharded
from tensorpar.models.training import causal_lm_loss
from tensorpar.sharding.audit import audit


def rounding_factor(tp: int) -> float:
    """How many times the unsplit model's own rounding error (against float64) the split's may be.

    The split sums the same products in another order: each rank rounds its partial sum to the
    working precision and the all-reduce adds the p partials with p - 1 more roundings, where the
    unsplit matmul rounds its (float32-accumulated) sum once; and the partials can be larger than
    the sum (a vocabulary-parallel loss gradient cancels to ~0). So ``2 tp - 1`` roundings where the
    unsplit model makes one, times 4 for the spread of the error norms. Measured over the 156
    architectures of the matrix (tests/test_jobs_verify_sweep.py), on every tensor outside the
    dtype's tolerance, the split's error norm against float64 over the unsplit model's: float32
    at most 5.0 at tp 2 and 5.9 at tp 4; bfloat16 6.6 and 10.6 (opt); allowed 12 and 28.
    Whether the split is *right* is the float64 structure check's question, not this one's.
    """
    return 4.0 * (2 * tp - 1)


def structure_tol(routing: "RoutingReplay") -> float:
    """The structure check's tolerance: float64's (1e-10), or float32's where the float64 model
    computes part of its forward in float32 (MoE routers' softmax), as the reference run saw."""
    return TOLERANCE[routing.lowest]


@dataclass
class LayerCheck:
    name: str
    activation_rel: float
    activation_grad_rel: float
    param_grad_rel: float
    ok: bool
    excess: float = 0.0  # worst per tensor: min(rel / tolerance, error / (rounding_factor x unsplit's)); ok <= 1
    structure: float = 0.0  # worst per tensor in float64 against the float64 unsplit model / its tolerance; ok <= 1
    structure_activation: float = 0.0  # the block's output activation alone in that check (/ its tolerance)

    @classmethod
    def judged(cls, name, act, grad, pgrad, excess, structure, structure_activation=0.0) -> "LayerCheck":
        """A layer is ok when both questions say so: it rounds like the unsplit model (``excess``)
        and it is right in float64 (``structure``)."""
        return cls(name, act, grad, pgrad, excess <= 1.0 and structure <= 1.0, excess, structure,
                   structure_activation)


@dataclass
class TPCheck:
    tp: int
    tolerance_rel: float
    layers: list = field(default_factory=list)
    loss_split: float = 0.0
    loss_dense: float = 0.0
    replicas: str = ""  # tensorpar.audit's verdict on the replicated tensors
    routing: str = ""  # the top-k choices replayed from the float64 reference (below float64)
    structure_tolerance: float = 1e-10  # float32's where the float64 model computes part of its forward in float32
    nonfinite: list = field(default_factory=list)  # the checkpoint's parameters holding NaN or inf

    @property
    def first_divergence(self) -> str | None:
        """Where the split model first departs: the first layer whose forward activation
        diverges; if none does, the first in backward order (the last layer) whose gradients do
        (an error in backward propagates to every earlier layer's gradients)."""
        if self.nonfinite:
            return f"non-finite weights ({', '.join(self.nonfinite[:3])})"
        fwd = next((lay.name for lay in self.layers if not lay.ok and (lay.activation_rel > self.tolerance_rel
                                                                        or lay.structure_activation > 1.0)), None)
        return fwd or next((lay.name for lay in reversed(self.layers) if not lay.ok), None)


@dataclass
class VerifyReport:
    model: str
    family: str
    dtype: str
    batch: int
    seq: int
    checks: list

    @property
    def ok(self) -> bool:
        return all(c.first_divergence is None for c in self.checks)

    def to_dict(self) -> dict:
        return {"model": self.model, "family": self.family, "dtype": self.dtype, "batch": self.batch,
                "seq": self.seq, "ok": self.ok,
                "checks": [{**asdict(c), "first_divergence": c.first_divergence} for c in self.checks]}


def verify(model_dir, tp_sizes, *, dtype: str = "float32", batch: int = 2, seq: int = 16,
           backend: str = "auto", inject_fault: int | None = None, phase=no_phase) -> VerifyReport:
    """Compare the split and unsplit models at each tp size; ``inject_fault``: corrupt block
    ``inject_fault`` of the last rank's shard (to see what a divergence looks like); ``phase(text)``:
    a context manager around each phase (the CLI shows them with their time)."""
    with phase("checking the checkpoint (headers, sizes, tp)"):
        ckpt = _checked_args(model_dir, tp_sizes, dtype, batch, seq, inject_fault)
        for tp in tp_sizes:
            dist.check_world(tp)  # TENSORPAR_* values, torchrun's variables, room for the ranks
    checks = []
    for tp in tp_sizes:
        spec = {"path": str(ckpt.path), "dtype": dtype, "batch": batch, "seq": seq,
                "decoder": is_decoder(ckpt), "inject_fault": inject_fault}
        refs = "" if dtype == "float64" else " + float64 copies"
        with phase(f"tp={tp}: shards, unsplit model{refs}; forward, backward"):
            checks.append(dist.launch(verify_worker, tp, spec, backend=dist.resolve_backend(backend, tp))[0])
    return VerifyReport(str(ckpt.path), ckpt.family, dtype, batch, seq, checks)


def _checked_args(model_dir, tp_sizes, dtype, batch, seq, inject_fault):
    ckpt = open_checkpoint(model_dir)
    parse_dtype(dtype)
    for name, v in (("--batch", batch), ("--seq", seq)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not tp_sizes:
        raise ValueError("--tp needs at least one size, e.g. --tp 2,4")
    check_length(ckpt, seq, f"--seq {seq}")
    for tp in tp_sizes:
        check_tp(ckpt, tp)
    n_layers = _n_layers(ckpt.config)
    if inject_fault is not None and not 0 <= inject_fault < n_layers:
        raise ValueError(f"--inject-fault {inject_fault}: valid blocks are 0..{n_layers - 1}")
    return ckpt


def _n_layers(config: dict) -> int:
    """The layer count of config.json or, in a multimodal model's, of its language model's config."""
    return next((n for c in configs.text_configs(config) if (n := configs.n_layers(c))), 0)


# ---- on every rank ---------------------------------------------------------------------------

def verify_worker(spec: dict):
    """Every rank runs both models; each compares its own shards; the worst figures are reduced."""
    quiet_transformers()
    dist.check_collectives(True)  # every collective's signature compared across the ranks first
    dtype = DTYPES[spec["dtype"]]
    split, _ = load_sharded(spec["path"], dtype=dtype)
    dense = dense_model(spec["path"], dtype)
    tol = TOLERANCE[dtype]
    faulty = spec["inject_fault"] is not None and dist.get_rank() == dist.get_world_size() - 1
    if faulty:
        _corrupt(_blocks(split)[spec["inject_fault"]], tol)
    inputs = _inputs(split.config, spec)
    exact, routing = None, None
    if dtype != torch.float64:  # the reference both are measured against (see the module's docstring)
        exact, routing = reference(dense_model(spec["path"], torch.float64), inputs, spec["decoder"])
    rows, s_loss, d_loss, used = compare(split, dense, inputs, spec["decoder"], tol, exact, routing)
    if exact is None:  # float64: the comparison is the structure check itself
        structure, structure_tolerance = [(row[3], row[0] / used) for row in rows], used
    else:  # the same shards in float64 against the float64 unsplit model
        structure_tolerance = structure_tol(routing)
        split64, _ = load_sharded(spec["path"], dtype=torch.float64)
        if faulty:
            _corrupt(_blocks(split64)[spec["inject_fault"]], tol)
        with routing.replaying():  # float32 routers: a near-tie may round either way here too
            s64_acts, _ = _forward_backward(split64, inputs, spec["decoder"])
        structure = [(row[3], row[0] / structure_tolerance)
                     for row in _rows(split64, exact[0], s64_acts, exact[1], structure_tolerance)]
    replicas = audit(split, grads=True)  # every replicated tensor and its gradient equal on every rank
    worst = torch.tensor([[*row, *st] for row, st in zip(rows, structure)], dtype=torch.float64)
    dist.all_reduce(worst, split.tp_report.tp_group, op="max")  # the worst over every rank's shards
    if dist.get_rank() != 0:
        return None
    check = TPCheck(tp=dist.get_world_size(), tolerance_rel=used, loss_split=s_loss, loss_dense=d_loss,
                    structure_tolerance=structure_tolerance)
    loss_rel = abs(s_loss - d_loss) / (abs(d_loss) or 1.0)
    for name, (act, grad, pgrad, excess, struct, struct_act) in zip(_row_names(split), worst.tolist()):
        check.layers.append(LayerCheck.judged(name, act, grad, pgrad, excess, struct, struct_act))
    check.layers.append(LayerCheck("loss", loss_rel, 0.0, 0.0, loss_rel <= tol, loss_rel / tol))
    check.layers.append(LayerCheck(f"replicas ({replicas.checked} tensors, bit-identical)", 0.0, 0.0, 0.0,
                                   replicas.ok, 0.0 if replicas.ok else float("inf")))
    check.replicas = replicas.message()
    check.routing = routing.message() if routing else ""
    check.nonfinite = nonfinite(dense)
    return check


def reference(ref, inputs, decoder: bool) -> tuple:
    """The float64 model's activations and gradients (``exact`` for :func:`compare`) and the
    discrete choices it made (a :class:`RoutingReplay` to replay in the compared models)."""
    routing = RoutingReplay()
    with routing:
        exact = (ref, _forward_backward(ref, inputs, decoder)[0])
    return exact, routing


def compare(split, dense, inputs, decoder: bool, tol: float, exact=None, routing=None) -> tuple:
    """``(rows, split loss, unsplit loss, tolerance used)``: both models forward and backward on ``inputs``
    (replaying ``routing``'s choices, if given), then this rank's worst figures per checked module
    (:func:`_rows`). Without ``routing`` (float64), ``tol`` is raised to the tolerance of the lowest
    precision the unsplit model computes in (see :class:`RoutingReplay`)."""
    probe = RoutingReplay()
    with routing.replaying() if routing else contextlib.nullcontext():
        s_acts, s_loss = _forward_backward(split, inputs, decoder)
    with routing.replaying() if routing else probe:
        d_acts, d_loss = _forward_backward(dense, inputs, decoder)
    if routing is None:
        tol = max(tol, TOLERANCE[probe.lowest])
    factor = rounding_factor(split.tp_report.tp_size)
    return _rows(split, dense, s_acts, d_acts, tol, exact, factor), s_loss, d_loss, tol


def _blocks(model) -> torch.nn.ModuleList:
    """The transformer blocks: the longest ModuleList in the model."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(lists, key=len)


def _checked(model) -> list:
    """The input embedding, then every transformer block, in the order data flows."""
    return [model.get_input_embeddings(), *_blocks(model)]


def _row_names(model) -> list[str]:
    return ["embeddings", *(f"block {i}" for i in range(len(_blocks(model)))), "rest (final norm, head)"]


def _inputs(config, spec) -> dict:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, config.vocab_size, (spec["batch"], spec["seq"]), generator=g)
    return {"input_ids": ids}


@torch.no_grad()
def _corrupt(block, tol: float) -> None:
    """Scale this rank's shard of the block's last split matrix (in most blocks the projection that
    writes into the residual stream; in a mixture of experts, the experts' down projection) by
    1 + 1000 tol (1.01 in float32, 51 in bfloat16): a silently corrupted shard whose effect on the
    block's output stays far above the dtype's tolerance even where that projection's output is
    small next to the residual stream. A replicated matrix (a router) is not what a shard means."""
    matrices = [p for p in block.parameters() if p.dim() >= 2]
    shards = [p for p in matrices if getattr(getattr(p, "tp_spec", None), "is_shard", False)]
    (shards or matrices)[-1].mul_(1 + 1000 * tol)


def _forward_backward(model, inputs, decoder: bool):
    """Per-module outputs and their gradients, and the loss."""
    acts, hooks = [], []

    def keep(_module, _inp, out):
        t = out[0] if isinstance(out, (tuple, list)) else out  # a block may return a list (openai-gpt)
        if t.requires_grad:
            t.retain_grad()
        acts.append(t)

    for module in _checked(model):
        hooks.append(module.register_forward_hook(keep))
    try:
        model.train(False)
        loss = _loss(model, inputs, decoder)
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    return [(a.detach(), a.grad) for a in acts], loss.item()


def _loss(model, inputs, decoder: bool):
    if not decoder:
        hidden = model.base_model(**inputs).last_hidden_state  # (B, T, H); a head, if any, is not used
        proj = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(7), dtype=hidden.dtype)
        return (hidden @ proj).square().mean()
    return causal_lm_loss(model, inputs["input_ids"])


def _rows(split, dense, s_acts, d_acts, tol: float, exact=None, factor: float = 0.0) -> list[list[float]]:
    """Per checked module: activation, activation-gradient and parameter-gradient differences and
    the worst excess; then one row for every parameter outside them (final norm, head).
    ``exact``: ``(float64 model, its activations)``, or None (judged by ``tol`` alone);
    ``factor``: the :func:`rounding_factor` the split's error against ``exact`` is allowed."""
    dense_params = dict(dense.named_parameters(remove_duplicate=False))
    ref_params = dict(exact[0].named_parameters(remove_duplicate=False)) if exact else None
    r_acts = exact[1] if exact else [(None, None)] * len(s_acts)
    rows, seen = [], set()
    for module, (sa, sg), (da, dg), (ra, rg) in zip(_checked(split), s_acts, d_acts, r_acts):
        params = list(module.parameters())
        seen.update(id(p) for p in params)
        pgrad, p_excess = _param_grads(params, dense_params, ref_params, tol, factor)
        act, grad = _rel(sa, da), _rel(sg, dg)
        excess = max(_excess(act, sa, da, ra, tol, factor), _excess(grad, sg, dg, rg, tol, factor), p_excess)
        rows.append([act, grad, pgrad, excess])
    rest = [p for p in split.parameters() if id(p) not in seen]
    pgrad, p_excess = _param_grads(rest, dense_params, ref_params, tol, factor)
    rows.append([0.0, 0.0, pgrad, p_excess])
    return rows


def _excess(rel: float, split, dense, exact, tol: float, factor: float) -> float:
    """``min(rel / tol, ||split - exact|| / (factor ||dense - exact||))``; without a
    reference, ``rel / tol``. The rounding errors are compared as norms over the whole tensor, not
    as maxima: the largest rounding error of one model and of the other fall on different elements
    by chance (one element can be 20x the other model's largest in bfloat16 with nothing wrong),
    while a wrong split moves the norm by O(1) of the tensor's."""
    if exact is None or split is None or dense is None:
        return rel / tol
    exact = exact.double()
    err_split = (split.double() - exact).norm().item()
    err_dense = (dense.double() - exact).norm().item()
    vs_rounding = err_split / (factor * err_dense) if err_dense else float("inf")
    return min(rel / tol, vs_rounding)


def _param_grads(params, dense_params, ref_params, tol: float, factor: float) -> tuple[float, float]:
    """``(worst rel, worst excess)`` over ``params`` (this rank's shards).

    ``rel`` is ``max |g_shard - shard(g_dense)| / max |g_dense|``: each shard is compared element
    by element with the same slice of the dense gradient (the slice ``parallelize`` cut it from,
    zero-padded where the shard is), so a wrong sign, a permuted or a missing piece shows. A
    tensor whose dense gradient vanishes next to its block's (e.g. a key bias, whose gradient is
    zero without rotary) is measured against 1e-3 of the block's largest gradient instead of its
    own ~0. A parameter with no gradient where the unsplit one has one is infinitely wrong.
    """
    pairs = [(p, _dense_grad_shard(p, dense_params)) for p in params]
    pairs = [(p, ref) for p, ref in pairs if ref is not None or p.grad is not None]
    if not pairs:
        return 0.0, 0.0
    peaks = [0.0 if ref is None else ref.abs().max().item() for _, ref in pairs]
    block_scale = max(peaks) or 1.0
    worst = excess = 0.0
    for (p, ref), peak in zip(pairs, peaks):
        if p.grad is None or ref is None:  # a gradient lost (or invented) by the split
            return float("inf"), float("inf")
        scale = max(peak, 1e-3 * block_scale)
        rel = (p.grad.double() - ref.double()).abs().max().item() / scale
        exact = None if ref_params is None else _dense_grad_shard(p, ref_params)
        worst, excess = max(worst, rel), max(excess, _excess(rel, p.grad, ref, exact, tol, factor))
    return worst, excess


def _dense_grad_shard(p, dense_params) -> torch.Tensor:
    """The slice of the dense gradient this shard was cut from (None where it has none):
    ``load_sharded`` gives every parameter its ``tp_spec`` (``ShardSpec(name)`` for a replicated one)."""
    g = dense_params[p.tp_spec.key].grad
    return None if g is None else p.tp_spec.apply(g)


def _rel(a, b) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    scale = b.double().abs().max().item() or 1.0
    return (a.double() - b.double()).abs().max().item() / scale
