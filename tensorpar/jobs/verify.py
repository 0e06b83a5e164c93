"""`tensorpar verify`: layer by layer, does the split model compute what the unsplit one does?

For each tp size, every rank loads its shards of the checkpoint and rank 0 also the whole model.
Both run the same inputs forward and backward (decoders: the next-token loss, from
vocab-sharded logits on the split model; encoders: a fixed random projection of the last
hidden state). Per transformer block we compare

- the block's output activation (replicated on every rank, so directly comparable),
- the gradient of the loss with respect to that activation,
- the norm of the gradient of the block's parameters (shards summed over ranks, replicated
  parameters counted once),

as ``max |split - unsplit| / max |unsplit|`` against the dtype's tolerance, and name the first
block that diverges.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from tensorpar import dist
from tensorpar.jobs.common import DTYPES, TOLERANCE, check_tp, open_checkpoint, parse_dtype, quiet_transformers
from tensorpar.jobs.run import _dense


@dataclass
class LayerCheck:
    name: str
    activation_rel: float
    activation_grad_rel: float
    param_grad_norm_rel: float
    ok: bool


@dataclass
class TPCheck:
    tp: int
    tolerance_rel: float
    layers: list = field(default_factory=list)
    loss_split: float = 0.0
    loss_dense: float = 0.0

    @property
    def first_divergence(self) -> str | None:
        """Where the split model first departs: the first layer whose forward activation
        diverges; if none does, the first in backward order (the last layer) whose gradients do
        (an error in backward propagates to every earlier layer's gradients)."""
        fwd = next((lay.name for lay in self.layers if lay.activation_rel > self.tolerance_rel), None)
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
           backend: str = "auto", inject_fault: int | None = None) -> VerifyReport:
    """Compare the split and unsplit models at each tp size; ``inject_fault``: corrupt block
    ``inject_fault`` of the last rank's shard (to see what a divergence looks like)."""
    ckpt = open_checkpoint(model_dir)
    parse_dtype(dtype)
    for name, v in (("--batch", batch), ("--seq", seq)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not tp_sizes:
        raise ValueError("--tp needs at least one size, e.g. --tp 2,4")
    for tp in tp_sizes:
        check_tp(ckpt, tp)
    n_layers = _n_layers(ckpt.config)
    if inject_fault is not None and not 0 <= inject_fault < n_layers:
        raise ValueError(f"--inject-fault {inject_fault}: valid blocks are 0..{n_layers - 1}")
    checks = []
    for tp in tp_sizes:
        spec = {"path": str(ckpt.path), "dtype": dtype, "batch": batch, "seq": seq,
                "family": ckpt.family, "inject_fault": inject_fault}
        checks.append(dist.launch(verify_worker, tp, spec, backend=dist.resolve_backend(backend, tp))[0])
    return VerifyReport(str(ckpt.path), ckpt.family, dtype, batch, seq, checks)


def _n_layers(config: dict) -> int:
    return config.get("num_hidden_layers") or config.get("n_layer") or 0


# ---- on every rank ---------------------------------------------------------------------------

def verify_worker(spec: dict):
    from tensorpar.models.checkpoint import load_sharded

    quiet_transformers()
    dtype = DTYPES[spec["dtype"]]
    split, _ = load_sharded(spec["path"], dtype=dtype)
    if spec["inject_fault"] is not None and dist.get_rank() == dist.get_world_size() - 1:
        _corrupt(_blocks(split)[spec["inject_fault"]])
    inputs = _inputs(split.config, spec)
    s_acts, s_loss = _forward_backward(split, inputs, spec["family"])
    s_norms = [_grad_norm(m, split) for m in _checked(split)]  # collective: every rank
    if dist.get_rank() != 0:
        return None
    dense = _dense(spec["path"], dtype)
    d_acts, d_loss = _forward_backward(dense, inputs, spec["family"])
    d_norms = [_grad_norm(m, None) for m in _checked(dense)]
    return _compare(spec, s_acts, d_acts, s_norms, d_norms, s_loss, d_loss, dtype)


def _blocks(model) -> torch.nn.ModuleList:
    """The transformer blocks: the longest ModuleList in the model."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(lists, key=len)


def _checked(model) -> list:
    """The input embedding, then every transformer block, in the order data flows."""
    return [model.get_input_embeddings(), *_blocks(model)]


def _inputs(config, spec) -> dict:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, config.vocab_size, (spec["batch"], spec["seq"]), generator=g)
    return {"input_ids": ids}


@torch.no_grad()
def _corrupt(block) -> None:
    """Scale this rank's shard of the block's first matrix by 1.001: a relative error of 1e-3,
    far above every tolerance but float16's, as a silently corrupted shard would be."""
    next(p for p in block.parameters() if p.dim() == 2).mul_(1.001)


def _forward_backward(model, inputs, family):
    """Per-block outputs and their gradients, and the loss."""
    acts, hooks = [], []

    def keep(_module, _inp, out):
        t = out[0] if isinstance(out, tuple) else out
        if t.requires_grad:
            t.retain_grad()
        acts.append(t)

    for module in _checked(model):
        hooks.append(module.register_forward_hook(keep))
    try:
        model.train(False)
        loss = _loss(model, inputs, family)
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    return [(a.detach(), a.grad) for a in acts], loss.item()


def _loss(model, inputs, family):
    if family == "bert":
        hidden = model(**inputs).last_hidden_state  # (B, T, H)
        proj = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(7), dtype=hidden.dtype)
        return (hidden @ proj).square().mean()
    from tensorpar.models.training import causal_lm_loss
    return causal_lm_loss(model, inputs["input_ids"])


def _grad_norm(block, split_model) -> float:
    """The 2-norm of the block's parameter gradients over the whole (unsplit) block."""
    sq = torch.zeros((), dtype=torch.float64)
    for p in block.parameters():
        if p.grad is not None:
            sq += p.grad.double().square().sum() / getattr(p, "tp_replicas", 1)
    if split_model is not None:
        group = split_model.tp_report.tp_group
        dist.all_reduce(sq, group)
    return sq.sqrt().item()


def _rel(a, b) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    scale = b.double().abs().max().item() or 1.0
    return (a.double() - b.double()).abs().max().item() / scale


def _compare(spec, s_acts, d_acts, s_norms, d_norms, s_loss, d_loss, dtype) -> TPCheck:
    tol = TOLERANCE[dtype]
    check = TPCheck(tp=dist.get_world_size(), tolerance_rel=tol, loss_split=s_loss, loss_dense=d_loss)
    for i, ((sa, sg), (da, dg), sn, dn) in enumerate(zip(s_acts, d_acts, s_norms, d_norms)):
        act, grad = _rel(sa, da), _rel(sg, dg)
        norm = abs(sn - dn) / (dn or 1.0)
        name = "embeddings" if i == 0 else f"block {i - 1}"
        check.layers.append(LayerCheck(name, act, grad, norm, max(act, grad, norm) <= tol))
    return check
