"""How the proof drives a model: its blocks, example inputs, cotangents, and runs of a block alone.

The proof compares runs of the dense and the split model on the same inputs with the same random
cotangents (:func:`cotangent`); a block run alone (:func:`block_run`) gets the inputs its forward
pre-hook kept in the whole run (:func:`capture`), uncached. :class:`Precision` records the least
precise floating dtype on the gradient path, whose tolerance applies.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from tensorpar.architecture import configs
from tensorpar.nn.regions import hidden_input
from tensorpar.sharding.discover import call_model, first_tensor

EXAMPLE_BATCH, EXAMPLE_SEQ = 2, 12
_CACHES = ("cache", "past_key_values", "past_key_value", "layer_past")
ALL_BLOCKS_BELOW = 200_000_000  # parameters: below, every block is proved; above, one per kind


def blocks(model) -> list[tuple[str, nn.Module]]:
    """The transformer blocks: the items of the model's ModuleList holding the most parameters."""
    best, best_n = [], 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 1:
            n = sum(p.numel() for p in mod.parameters())
            if n > best_n:
                best, best_n = [(f"{name}.{i}", m) for i, m in enumerate(mod)], n
    return best


def example_inputs(model, given=None):
    if given is not None:
        return given
    config = getattr(model, "config", None)
    vocab = getattr(getattr(config, "get_text_config", lambda: config)(), "vocab_size", None)
    if not vocab:
        dummy = getattr(model, "dummy_inputs", None)
        if dummy is None:
            raise ValueError(f"parallelize(prove=True) needs example_inputs=... for {type(model).__name__}")
        return dummy
    limit = configs.max_positions(config) or EXAMPLE_SEQ
    g = torch.Generator().manual_seed(20261201)
    ids = torch.randint(0, vocab, (EXAMPLE_BATCH, min(EXAMPLE_SEQ, limit)), generator=g)
    inputs = {"input_ids": ids.to(device_of(model))}
    encoder = encoder_states(model, ids.shape[0], g)
    return inputs if encoder is None else {**inputs, "encoder_hidden_states": encoder}


CROSS_ATTENTION = ("encoder_attn", "crossattention", "cross_attn")


def has_cross_attention(model) -> bool:
    return any(n.rpartition(".")[2] in CROSS_ATTENTION for n, _ in model.named_modules())


def encoder_states(model, batch: int, g):
    """Random encoder states for a decoder with cross-attention (so the proof runs it too)."""
    if "encoder_hidden_states" not in inspect.signature(model.forward).parameters or not has_cross_attention(model):
        return None
    config = model.config.get_text_config()
    width = getattr(config, "d_model", None) or getattr(config, "hidden_size", None)
    p = next(model.parameters())
    if not width or not p.is_floating_point():
        return None
    return torch.randn((batch, 5, width), generator=g, dtype=torch.float64).to(device=p.device, dtype=p.dtype)


def device_of(model):
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def call(model, inputs):
    return call_model(model, inputs)


def cotangent(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t.shape, generator=g, dtype=torch.float64).to(device=t.device, dtype=t.dtype)


def clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, tuple):
        return tuple(clone(v) for v in x)
    if isinstance(x, list):
        return [clone(v) for v in x]
    if isinstance(x, dict):
        return {k: clone(v) for k, v in x.items()}
    return x


class Precision(torch.overrides.TorchFunctionMode):
    """Records the floating dtypes of the results that gradients flow through: a float64 model
    whose router runs its softmax in float32 is exact to float32's rounding, not float64's. A
    float32 computation on constants (rotary cos/sin from positions) is the same in the split
    model and the dense one and does not count."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                self.dtypes.add(t.dtype)
        return out


def least_precise(dtypes) -> torch.dtype:
    """The dtype with the largest rounding unit among ``dtypes``."""
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


@contextlib.contextmanager
def quiet(model, only: set | None):
    """Eval mode, gradients only for the parameters named in ``only`` (None: as they are), and
    every parameter's ``.grad`` and ``requires_grad`` put back afterwards."""
    modes = {m: m.training for m in model.modules()}
    params = dict(model.named_parameters(remove_duplicate=False))
    saved = {n: (p.grad, p.requires_grad) for n, p in params.items()}
    model.eval()
    try:
        for n, p in params.items():
            p.grad = None
            if only is not None:
                p.requires_grad_(n in only and saved[n][1])
        yield
    finally:
        for n, p in params.items():
            p.grad, rg = saved[n]
            p.requires_grad_(rg)
        for m, t in modes.items():
            m.training = t


def grads_by_name(module, prefix: str) -> dict:
    """Every parameter's gradient by name, tied parameters under each of their names."""
    return {f"{prefix}.{n}" if prefix else n: p.grad.detach().clone()
            for n, p in module.named_parameters(remove_duplicate=False) if p.grad is not None}


def with_input_grad(args, kwargs):
    args, kwargs = clone(args), clone(kwargs)
    x = hidden_input(args, kwargs)
    if x is None or not x.is_floating_point():
        return None, args, kwargs
    leaf = x.requires_grad_(True)
    return leaf, args, kwargs


@dataclass
class Run:
    out: torch.Tensor | None
    input_grad: torch.Tensor | None
    grads: dict


def block_run(block, name, args, kwargs, seed) -> Run:
    x, args, kwargs = with_input_grad(args, kwargs)
    out = first_tensor(block(*args, **kwargs))
    (out * cotangent(out, seed)).sum().backward()
    return Run(out.detach(), None if x is None else x.grad, grads_by_name(block, name))


def signature(name: str, block) -> tuple:
    layer_type = next((getattr(m, a) for m in block.modules() for a in ("layer_type", "attention_type")
                       if isinstance(getattr(m, a, None), str)), None)
    return (type(block).__name__, layer_type,
            tuple((n, type(m).__name__) for n, m in block.named_modules()))


def capture(blist, inputs: dict, outputs: dict) -> list:
    """Hooks keeping each block's first inputs (uncached) and first output; the handles."""
    hooks = []
    for bname, block in blist:
        def keep_in(module, args, kwargs, bname=bname):
            kwargs = {k: None if k in _CACHES else v for k, v in kwargs.items()}  # blocks run uncached
            inputs.setdefault(bname, (clone(args), clone(kwargs)))

        def keep_out(module, args, output, bname=bname):
            t = first_tensor(output)
            if t is not None:
                outputs.setdefault(bname, t.detach().clone())
        hooks += [block.register_forward_pre_hook(keep_in, with_kwargs=True), block.register_forward_hook(keep_out)]
    return hooks


def chosen(model, blist) -> set:
    """Every block of a small model; one block of each kind (class, layer type) of a large one."""
    if sum(p.numel() for p in model.parameters()) < ALL_BLOCKS_BELOW:
        return {b for b, _ in blist}
    seen, out = set(), set()
    for bname, block in blist:
        sig = signature(bname, block)
        if sig not in seen:
            seen.add(sig)
            out.add(bname)
    return out
