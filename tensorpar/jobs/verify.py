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
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from tensorpar import dist
from tensorpar.jobs.common import (DTYPES, TOLERANCE, check_length, check_tp, dense_model, is_decoder,
                                   open_checkpoint, parse_dtype, quiet_transformers)


@dataclass
class LayerCheck:
    name: str
    activation_rel: float
    activation_grad_rel: float
    param_grad_rel: float
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
    check_length(ckpt, seq, f"--seq {seq}")
    for tp in tp_sizes:
        check_tp(ckpt, tp)
    n_layers = _n_layers(ckpt.config)
    if inject_fault is not None and not 0 <= inject_fault < n_layers:
        raise ValueError(f"--inject-fault {inject_fault}: valid blocks are 0..{n_layers - 1}")
    checks = []
    for tp in tp_sizes:
        spec = {"path": str(ckpt.path), "dtype": dtype, "batch": batch, "seq": seq,
                "decoder": is_decoder(ckpt), "inject_fault": inject_fault}
        checks.append(dist.launch(verify_worker, tp, spec, backend=dist.resolve_backend(backend, tp))[0])
    return VerifyReport(str(ckpt.path), ckpt.family, dtype, batch, seq, checks)


def _n_layers(config: dict) -> int:
    return (config.get("num_hidden_layers") or config.get("n_layer") or config.get("num_layers")
            or config.get("decoder_layers") or 0)


# ---- on every rank ---------------------------------------------------------------------------

def verify_worker(spec: dict):
    """Every rank runs both models; each compares its own shards; the worst figures are reduced."""
    from tensorpar.models.checkpoint import load_sharded

    quiet_transformers()
    dtype = DTYPES[spec["dtype"]]
    split, _ = load_sharded(spec["path"], dtype=dtype)
    dense = dense_model(spec["path"], dtype)
    tol = TOLERANCE[dtype]
    if spec["inject_fault"] is not None and dist.get_rank() == dist.get_world_size() - 1:
        _corrupt(_blocks(split)[spec["inject_fault"]], tol)
    inputs = _inputs(split.config, spec)
    s_acts, s_loss = _forward_backward(split, inputs, spec["decoder"])
    d_acts, d_loss = _forward_backward(dense, inputs, spec["decoder"])
    rows = _rows(split, dense, s_acts, d_acts)  # (n_rows, 3): this rank's worst relative differences
    worst = torch.tensor(rows, dtype=torch.float64)
    dist.all_reduce(worst, split.tp_report.tp_group, op="max")  # the worst over every rank's shards
    if dist.get_rank() != 0:
        return None
    check = TPCheck(tp=dist.get_world_size(), tolerance_rel=tol, loss_split=s_loss, loss_dense=d_loss)
    loss_rel = abs(s_loss - d_loss) / (abs(d_loss) or 1.0)
    for name, (act, grad, pgrad) in zip(_row_names(split), worst.tolist()):
        check.layers.append(LayerCheck(name, act, grad, pgrad, max(act, grad, pgrad) <= tol))
    check.layers.append(LayerCheck("loss", loss_rel, 0.0, 0.0, loss_rel <= tol))
    return check


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
    """Scale this rank's shard of the block's last matrix (the projection that writes into the
    residual stream) by 1 + 1000 tol (1.01 in float32, 51 in bfloat16): a silently corrupted
    shard whose effect on the block's output stays far above the dtype's tolerance even where
    that projection's output is small next to the residual stream."""
    last = [p for p in block.parameters() if p.dim() == 2][-1]
    last.mul_(1 + 1000 * tol)


def _forward_backward(model, inputs, decoder: bool):
    """Per-module outputs and their gradients, and the loss."""
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
    from tensorpar.models.training import causal_lm_loss
    return causal_lm_loss(model, inputs["input_ids"])


def _rows(split, dense, s_acts, d_acts) -> list[list[float]]:
    """Per checked module: activation, activation-gradient and parameter-gradient differences;
    then one row for every parameter outside them (final norm, head)."""
    dense_params = dict(dense.named_parameters(remove_duplicate=False))
    rows, seen = [], set()
    for module, (sa, sg), (da, dg) in zip(_checked(split), s_acts, d_acts):
        params = list(module.parameters())
        seen.update(id(p) for p in params)
        rows.append([_rel(sa, da), _rel(sg, dg), _param_grads_rel(params, dense_params)])
    rest = [p for p in split.parameters() if id(p) not in seen]
    rows.append([0.0, 0.0, _param_grads_rel(rest, dense_params)])
    return rows


def _param_grads_rel(params, dense_params) -> float:
    """Worst ``max |g_shard - shard(g_dense)| / max |g_dense|`` over ``params`` (this rank's shards).

    Each shard is compared element by element with the same slice of the dense gradient (the
    slice ``parallelize`` cut it from, zero-padded where the shard is), so a wrong sign, a
    permuted or a missing piece shows. A tensor whose dense gradient vanishes next to its
    block's (e.g. a key bias, whose gradient is zero without rotary) is measured against 1e-3 of
    the block's largest gradient instead of its own ~0.
    """
    pairs = [(p, _dense_grad_shard(p, dense_params)) for p in params if p.grad is not None]
    if not pairs:
        return 0.0
    peaks = [ref.abs().max().item() for _, ref in pairs]
    block_scale = max(peaks) or 1.0
    worst = 0.0
    for (p, ref), peak in zip(pairs, peaks):
        scale = max(peak, 1e-3 * block_scale)
        worst = max(worst, (p.grad.double() - ref.double()).abs().max().item() / scale)
    return worst


def _dense_grad_shard(p, dense_params) -> torch.Tensor:
    """The slice of the dense gradient this shard was cut from: ``load_sharded`` gives every
    parameter its ``tp_spec`` (``ShardSpec(name)`` for a replicated one)."""
    g = dense_params[p.tp_spec.key].grad
    return torch.zeros_like(p) if g is None else p.tp_spec.apply(g)


def _rel(a, b) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    scale = b.double().abs().max().item() or 1.0
    return (a.double() - b.double()).abs().max().item() / scale
