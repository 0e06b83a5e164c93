"""Step 5 of ``parallelize``: the split model proved against the dense one, forward and backward.

Before anything changes, :meth:`Evidence.collect` runs the dense model on example inputs (random
token ids, the same on every rank): the output of the whole model and, with a fixed random
cotangent, the gradient of every parameter outside the transformer blocks; and each block on
the inputs it received, with its own random cotangent: its output, its input gradient and every
one of its parameters' gradients. After the commit, :meth:`Evidence.check` runs the split model
the same way on every rank and compares each shard with the same slice of the dense tensor
(:class:`~tensorpar.sharding.spec.ShardSpec`), each replicated tensor whole:

    error = max |split - dense| / scale

where ``scale`` is the largest dense value of the compared group (the block's output, its input
gradient, its parameter gradients together): a parameter whose exact gradient vanishes (a key
bias under softmax) is judged on its block's scale, not on its own rounding noise. A correct
split differs by rounding only (float64: ~1e-15); a missing reduction, a partial gradient, a
head paired with the wrong KV head or a per-head bias on the wrong heads is O(1). The limit per
dtype (:data:`TOLERANCE`) sits between the two. Every rank's worst error is all-reduced, so all
ranks reach the same verdict.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from tensorpar.sharding.discover import call_model, first_tensor
from tensorpar.sharding.feasibility import generic
from tensorpar.sharding.resolve import regions, region_of, unit_root
from tensorpar.sharding.spec import ShardSpec

TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
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
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    limit = limit if isinstance(limit, int) and limit > 0 else EXAMPLE_SEQ
    g = torch.Generator().manual_seed(20261201)
    ids = torch.randint(0, vocab, (EXAMPLE_BATCH, min(EXAMPLE_SEQ, limit)), generator=g)
    inputs = {"input_ids": ids.to(_device(model))}
    encoder = _encoder_states(model, ids.shape[0], g)
    return inputs if encoder is None else {**inputs, "encoder_hidden_states": encoder}


CROSS_ATTENTION = ("encoder_attn", "crossattention", "cross_attn")


def has_cross_attention(model) -> bool:
    return any(n.rpartition(".")[2] in CROSS_ATTENTION for n, _ in model.named_modules())


def _encoder_states(model, batch: int, g):
    """Random encoder states for a decoder with cross-attention (so the proof runs it too)."""
    import inspect
    if "encoder_hidden_states" not in inspect.signature(model.forward).parameters or not has_cross_attention(model):
        return None
    config = model.config.get_text_config()
    width = getattr(config, "d_model", None) or getattr(config, "hidden_size", None)
    p = next(model.parameters())
    if not width or not p.is_floating_point():
        return None
    return torch.randn((batch, 5, width), generator=g, dtype=torch.float64).to(device=p.device, dtype=p.dtype)


def _device(model):
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _call(model, inputs):
    return call_model(model, inputs)


def _cotangent(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t.shape, generator=g, dtype=torch.float64).to(device=t.device, dtype=t.dtype)


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, tuple):
        return tuple(_clone(v) for v in x)
    if isinstance(x, list):
        return [_clone(v) for v in x]
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


class _Precision(torch.overrides.TorchFunctionMode):
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
def _quiet(model, only: set | None):
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


def _grads(module, prefix: str) -> dict:
    """Every parameter's gradient by name, tied parameters under each of their names."""
    return {f"{prefix}.{n}" if prefix else n: p.grad.detach().clone()
            for n, p in module.named_parameters(remove_duplicate=False) if p.grad is not None}


def _with_input_grad(args, kwargs):
    from tensorpar.nn.regions import hidden_input, replace_input
    args, kwargs = _clone(args), _clone(kwargs)
    x = hidden_input(args, kwargs)
    if x is None or not x.is_floating_point():
        return None, args, kwargs
    leaf = x.requires_grad_(True)
    return leaf, args, kwargs


@dataclass
class _Run:
    out: torch.Tensor | None
    input_grad: torch.Tensor | None
    grads: dict


def _block_run(block, name, args, kwargs, seed) -> _Run:
    x, args, kwargs = _with_input_grad(args, kwargs)
    out = first_tensor(block(*args, **kwargs))
    (out * _cotangent(out, seed)).sum().backward()
    return _Run(out.detach(), None if x is None else x.grad, _grads(block, name))


def _signature(name: str, block) -> tuple:
    layer_type = next((getattr(m, a) for m in block.modules() for a in ("layer_type", "attention_type")
                       if isinstance(getattr(m, a, None), str)), None)
    return (type(block).__name__, layer_type,
            tuple((n, type(m).__name__) for n, m in block.named_modules()))


@dataclass
class Evidence:
    """The dense model's outputs and gradients on the example inputs.

    A model below :data:`ALL_BLOCKS_BELOW` parameters is run once, whole: its output, every
    block's output (forward hooks) and every parameter's gradient. A larger one keeps only the
    gradients outside its blocks from that run (their memory is the model's) and runs each block
    it proves on its own, with its own cotangent."""
    inputs: object
    dtype: torch.dtype
    top_out: torch.Tensor
    top_grads: dict
    block_names: list = field(default_factory=list)  # the blocks found before the split, in order
    whole_run: bool = True
    block_outs: dict = field(default_factory=dict)  # block name -> output (whole run)
    block_inputs: dict = field(default_factory=dict)  # block name -> (args, kwargs) (block runs)
    block_runs: dict = field(default_factory=dict)  # block name -> _Run (block runs)

    @classmethod
    def collect(cls, model, res, given_inputs=None) -> "Evidence":
        inputs = example_inputs(model, given_inputs)
        blist = blocks(model)
        whole = sum(p.numel() for p in model.parameters()) < ALL_BLOCKS_BELOW
        block_params = {f"{b}.{n}" for b, m in blist for n, _ in m.named_parameters()}
        all_params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        captured, outs = {}, {}
        hooks = _capture(blist, captured, outs)
        try:
            with _quiet(model, all_params if whole else all_params - block_params):
                with _Precision() as precision:
                    out = first_tensor(_call(model, inputs))
                if out is None:
                    raise ValueError(f"{type(model).__name__} returned no tensor to prove the split on")
                (out * _cotangent(out, 1)).sum().backward()
                dtype = least_precise(precision.dtypes | {out.dtype})
                ev = cls(inputs, dtype, out.detach(), _grads(model, ""), [b for b, _ in blist], whole, outs)
        finally:
            for h in hooks:
                h.remove()
        if not whole:
            chosen = _chosen(model, blist)
            for i, (bname, block) in enumerate(blist):
                if bname in chosen and bname in captured:
                    with _quiet(model, None):
                        ev.block_inputs[bname] = captured[bname]
                        ev.block_runs[bname] = _block_run(block, bname, *captured[bname], seed=100 + i)
        return ev

    def check(self, model, res, built, tp_group) -> dict:
        """``{generic block name: why}`` for every part whose split differs from the dense run
        (``"@unsync:<parameter>"``: a synchronised gradient that needs none)."""
        from tensorpar import dist
        tp_size = dist.get_world_size(tp_group)
        specs = shard_specs(model, built)
        blist = {name: model.get_submodule(name) for name in self.block_names}
        errors = self._whole_errors(model, res, blist, specs, tp_size) if self.whole_run else {}
        if not self.whole_run:
            self._block_errors(model, res, blist, specs, tp_size, errors)
            self._top_errors(model, res, blist, specs, errors)
        names = sorted(k for k in errors if " <" not in k)
        worst = torch.tensor([errors[k] for k in names], dtype=torch.float64)
        if tp_size > 1:
            dist.all_reduce(worst, tp_group, op="max")
        failed = self._verdict(model, res, dict(zip(names, worst.tolist())), errors, tp_size)
        # the verdict is every rank's (all-reduced); the wording is rank 0's, so every report agrees
        return dist.broadcast_object(failed, src=0, group=tp_group) if failed else failed

    def _whole_errors(self, model, res, blist, specs, tp_size) -> dict:
        """One run of the whole split model: its output, each block's output and every gradient."""
        errors, outs = {}, {}
        hooks = _capture(list(blist.items()), {}, outs)
        all_params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        try:
            with _quiet(model, all_params):
                out = first_tensor(_call(model, self.inputs))
                (out * _cotangent(out, 1)).sum().backward()
                grads = _grads(model, "")
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:  # same shapes on every rank
            where = _raised_in(exc, model, res)
            key = next((b for b in blist if where and (where == b or where.startswith(b + "."))), "<output>")
            return {key: float("inf"), key + " <raised>": f"{type(exc).__name__}: {exc}", key + " <where>": where}
        finally:
            for h in hooks:
                h.remove()
        errors["<output>"] = _rel(out.detach(), self.top_out)
        inside = set()
        for bname in blist:
            mine = {n: g for n, g in grads.items() if n.startswith(bname + ".")}
            dense = {n: g for n, g in self.top_grads.items() if n.startswith(bname + ".")}
            inside |= set(dense)
            errors[bname + " <out>"] = _rel(outs.get(bname), self.block_outs.get(bname))
            errors[bname] = max(errors[bname + " <out>"], _param_error(mine, dense, specs))
            errors[bname + " <params>"] = _worst_params(mine, dense, specs)
            errors[bname + " <over>"] = _over_reduced(mine, dense, res, tp_size)
        errors["<outside the blocks>"] = _param_error({n: g for n, g in grads.items() if n not in inside},
                                                      {n: g for n, g in self.top_grads.items() if n not in inside},
                                                      specs)
        return errors

    def _block_errors(self, model, res, blist, specs, tp_size, errors) -> None:
        order = list(blist)
        for bname in self.block_runs:
            dense = self.block_runs[bname]
            try:
                with _quiet(model, None):
                    run = _block_run(blist[bname], bname, *self.block_inputs[bname], seed=100 + order.index(bname))
            except (RuntimeError, ValueError, IndexError, TypeError) as exc:  # same shapes on every rank
                errors[bname], errors[bname + " <raised>"] = float("inf"), f"{type(exc).__name__}: {exc}"
                errors[bname + " <where>"] = _raised_in(exc, model, res)
                continue
            errors[bname + " <out>"] = _rel(run.out, dense.out)
            errors[bname] = max(errors[bname + " <out>"], _rel(run.input_grad, dense.input_grad),
                                _param_error(run.grads, dense.grads, specs))
            errors[bname + " <params>"] = _worst_params(run.grads, dense.grads, specs)
            errors[bname + " <over>"] = _over_reduced(run.grads, dense.grads, res, tp_size)

    def _top_errors(self, model, res, blist, specs, errors) -> None:
        block_params = {f"{b}.{n}" for b in blist for n, _ in blist[b].named_parameters()}
        all_params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        try:
            with _quiet(model, all_params - block_params):
                out = first_tensor(_call(model, self.inputs))
                (out * _cotangent(out, 1)).sum().backward()
                errors["<output>"] = _rel(out.detach(), self.top_out)
                errors["<outside the blocks>"] = _param_error(_grads(model, ""), self.top_grads, specs)
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            errors["<output>"], errors["<output> <raised>"] = float("inf"), f"{type(exc).__name__}: {exc}"

    def _verdict(self, model, res, worst: dict, errors: dict, tp_size: int) -> dict:
        tol = TOLERANCE.get(self.dtype, 1e-4)
        failed = {}
        blocks_failed = any(err > tol for key, err in worst.items() if not key.startswith("<"))
        for key, err in worst.items():
            if err <= tol or (blocks_failed and key.startswith("<")):  # a block's error reaches the output
                continue
            over = errors.get(key + " <over>")
            if over:  # a gradient all-reduced that every rank had whole: drop its synchronisation first
                failed.update({"@unsync:" + generic(n): f"its gradient came out {tp_size} times too large"
                               for n in over})
                continue
            failed.update(_blame(model, res, key, err, tol, errors.get(key + " <params>"),
                                 errors.get(key + " <raised>"), errors.get(key + " <where>"),
                                 errors.get(key + " <out>")))
        return failed


def _capture(blist, inputs: dict, outputs: dict) -> list:
    """Hooks keeping each block's first inputs (uncached) and first output; the handles."""
    hooks = []
    for bname, block in blist:
        def keep_in(module, args, kwargs, bname=bname):
            kwargs = {k: None if k in _CACHES else v for k, v in kwargs.items()}  # blocks run uncached
            inputs.setdefault(bname, (_clone(args), _clone(kwargs)))

        def keep_out(module, args, output, bname=bname):
            t = first_tensor(output)
            if t is not None:
                outputs.setdefault(bname, t.detach().clone())
        hooks += [block.register_forward_pre_hook(keep_in, with_kwargs=True), block.register_forward_hook(keep_out)]
    return hooks


def _chosen(model, blist) -> set:
    """Every block of a small model; one block of each kind (class, layer type) of a large one."""
    if sum(p.numel() for p in model.parameters()) < ALL_BLOCKS_BELOW:
        return {b for b, _ in blist}
    seen, out = set(), set()
    for bname, block in blist:
        sig = _signature(bname, block)
        if sig not in seen:
            seen.add(sig)
            out.add(bname)
    return out


def shard_specs(model, built) -> dict:
    """Parameter name -> the ShardSpec that cut it, under every name of a tied parameter."""
    by_id = {}
    for name, b in built.items():
        owner = b.module if b.module is not None else model.get_submodule(name.rpartition(".")[0])
        for attr, spec in b.specs.items():
            p = getattr(owner, attr, None)
            if isinstance(p, nn.Parameter):
                by_id[id(p)] = spec
    return {n: by_id[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if id(p) in by_id}


def _rel(a, b) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    scale = b.double().abs().max().item() or 1.0
    return (a.double() - b.double()).abs().max().item() / scale


def _dense_slice(name, dense_grad, specs):
    spec = specs.get(name)
    return dense_grad if spec is None else ShardSpec(name, spec.dim, spec.pieces, spec.pad_to,
                                                     spec.transpose).apply(dense_grad)


def _param_errors(split: dict, dense: dict, specs: dict) -> dict:
    scale = max([g.double().abs().max().item() for g in dense.values()] + [1e-300])
    out = {}
    for name, g in dense.items():
        mine = split.get(name)
        ref = _dense_slice(name, g, specs)
        if mine is None:
            out[name] = 0.0 if not ref.abs().max() else float("inf")
        elif mine.shape != ref.shape:
            out[name] = float("inf")
        else:
            out[name] = (mine.double() - ref.double()).abs().max().item() / scale
    for name in split:
        if name not in dense and split[name].abs().max() > 0:
            out[name] = float("inf")
    return out


def _over_reduced(split: dict, dense: dict, res, tp_size: int) -> list:
    """Synchronised parameters whose gradient is ``tp_size`` times the dense one: each rank had the
    whole gradient already (the parameter acts after the region's reduction, a norm on the block's
    output), and the all-reduce added it ``tp_size`` times."""
    out = []
    for name, p in res.placements.items():
        if p.style != "grad_sync" or name not in split or name not in dense:
            continue
        want = dense[name].double() * tp_size
        scale = want.abs().max().item()
        if scale and (split[name].double() - want).abs().max().item() <= 1e-6 * scale:
            out.append(name)
    return out


def _param_error(split, dense, specs) -> float:
    return max(_param_errors(split, dense, specs).values(), default=0.0)


def _worst_params(split, dense, specs) -> list:
    return sorted(_param_errors(split, dense, specs).items(), key=lambda kv: -kv[1])


def _raised_in(exc, model, res) -> str | None:
    """The unit whose module raised ``exc``: the innermost frame of its traceback that runs a module
    under a placement of the plan."""
    names = {id(m): n for n, m in model.named_modules()}
    tb, found = exc.__traceback__, None
    while tb is not None:
        module = tb.tb_frame.f_locals.get("self")
        name = names.get(id(module)) if isinstance(module, nn.Module) else None
        if name is not None and any(name == p or name.startswith(p + ".") or p.startswith(name + ".")
                                    for p in res.placements):
            found = name
        tb = tb.tb_next
    if found is None:
        return None
    owners = [p for p in res.placements if found == p or found.startswith(p + ".")]
    return unit_root(max(owners, key=len), res.placements) if owners else None


def _blame(model, res, key, err, tol, params, raised=None, where=None, errors_out=None) -> dict:
    """The blocks to leave whole for a failed check, by generic name (every layer of the kind)."""
    why = (f"the split raised {raised[:200]}" if raised else
           f"split differs from the dense model by {err:.1e} (relative; limit {tol:.0e})")
    if key.startswith("<"):
        outside = [n for n in res.placements if not any(n.startswith(b + ".") for b, _ in blocks(model))]
        roots = {unit_root(n, res.placements) for n in outside}
        return {generic(r): f"{why} {key}" for r in roots} or {"<model>": why}
    if raised and where is not None:
        return {generic(where): f"{why} in {key}"}
    order = [n for n, _ in model.named_modules()]  # definition order: forward order, as a rule
    units = sorted({unit_root(n, res.placements) for n in res.placements if n.startswith(key + ".")},
                   key=lambda u: order.index(u) if u in order else len(order))
    bad_units = [u for u in units if any(n == u or n.startswith(u + ".") for n, e in (params or []) if e > tol)]
    # A forward error flows downstream: the first unit may be the cause. A backward error flows
    # upstream: with the block's output right, the last unit whose gradients differ is.
    out_ok = errors_out is not None and errors_out <= tol
    roots = {bad_units[-1]} if out_ok and bad_units else ({units[0]} if units else set())
    worst = ", ".join(n for n, _ in (params or [])[:3])
    return {generic(r): f"{why} in {key}" + (f" (worst: {worst})" if worst else "") for r in roots}
