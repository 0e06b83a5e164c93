"""Tensor-parallel regions on modules tensorpar does not own (a Hugging Face attention, MLP or
mixture-of-experts block), set up with forward hooks rather than new forward code.

A region is the stretch of a block between its replicated input and its replicated output, where
activations are sharded (column outputs, heads) or partial sums (row outputs before their
reduction). Megatron-LM's ``f`` / ``g`` pair (Shoeybi et al. 2019, sec. 3) bounds it:

- :func:`enter_region`: ``f`` on the block's hidden-states input (identity forward, all-reduce
  of dX in backward), so the column-parallel linears inside share one input copy;
- :func:`exit_region`: ``g`` on the block's output (all-reduce forward, identity backward), for
  a block whose inner row-parallel linears leave partial sums (one all-reduce per
  mixture-of-experts layer: the routed experts' and the shared experts' partials summed once);
- :func:`sync_grad`: a replicated parameter used inside the region (a per-head norm, a router)
  gets only this rank's share of its gradient; during each forward that takes gradients the
  module sees ``copy_to_tp_region(param)`` instead of the parameter, so backward all-reduces
  that gradient (2(p-1)/p * numel * e bytes, recorded by the ledger under the module's name);
- :func:`rank0_only`: a replicated bias added inside a partial-sum region (an expert's down
  projection bias) would be summed ``p`` times; the module sees it on rank 0 and zeros elsewhere,
  and its gradient (rank 0's, zero elsewhere) is all-reduced so every copy steps alike.

Under sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2) the stretch between regions
(norms, residuals, dropout) runs on this rank's chunk of the sequence: ``enter_region(...,
sequence=True)`` all-gathers the chunks into the region (reduce-scatter of dX in backward), the
row-parallel linears leave by reduce-scatter, and :func:`scatter_sequence` /
:func:`gather_sequence` cut the hidden states into chunks before the first block and join them
after the last.
"""
from __future__ import annotations

from functools import partial

import torch

from tensorpar import distributed as dist


def hidden_input(args, kwargs) -> torch.Tensor | None:
    """A block's hidden-states input: its first positional tensor, else ``hidden_states=``."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    x = kwargs.get("hidden_states")
    return x if isinstance(x, torch.Tensor) else None


def replace_input(args, kwargs, x, new):
    """``args`` and ``kwargs`` with every occurrence of the tensor ``x`` (the same object: CTRL
    passes its normalised input as query, key and value) replaced by ``new``."""
    return (tuple(new if a is x else a for a in args),
            {k: new if v is x else v for k, v in kwargs.items()})


# A cross-attention's keys and values come from the encoder's states, not from its first input:
# they enter the region too.
CROSS_INPUTS = ("key_value_states", "encoder_hidden_states")


def _copy_all(module, args, kwargs, *, group):
    """``f`` on every floating-point tensor input (a fused experts module's hidden states and
    routing weights: each one's gradient is partial on every rank)."""
    def copy(v):
        return dist.copy_to_tp_region(v, group=group) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    return tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}


def _copy_in(module, args, kwargs, *, group):
    x = hidden_input(args, kwargs)
    if x is None:
        raise ValueError(f"{type(module).__name__} is a tensor-parallel region but was called without "
                         f"a positional tensor input or hidden_states=; its column-parallel linears "
                         f"would miss their input copy")
    args, kwargs = replace_input(args, kwargs, x, dist.copy_to_tp_region(x, group=group))
    for key in CROSS_INPUTS:
        kv = kwargs.get(key)
        if isinstance(kv, torch.Tensor) and kv is not x:
            kwargs = {**kwargs, key: dist.copy_to_tp_region(kv, group=group)}
    return args, kwargs


def _gather_in(module, args, kwargs, *, group):
    """The hidden states' sequence chunks all-gathered (dX reduce-scattered in backward); an
    encoder's states for cross-attention, which are not chunked, copied in as ``f``."""
    x = hidden_input(args, kwargs)
    if x is None:
        raise ValueError(f"{type(module).__name__} is a sequence-parallel region but was called without "
                         f"a positional tensor input or hidden_states=; it cannot gather the sequence")
    if x.dim() < 3:
        raise ValueError(f"{type(module).__name__}: a sequence-parallel region's input must be "
                         f"(batch, seq/tp, hidden); got shape {tuple(x.shape)}")
    args, kwargs = replace_input(args, kwargs, x, dist.gather_from_sequence_parallel_region(x, group=group, dim=1))
    for key in CROSS_INPUTS:
        kv = kwargs.get(key)
        if isinstance(kv, torch.Tensor) and kv is not x:
            kwargs = {**kwargs, key: dist.copy_to_tp_region(kv, group=group)}
    return args, kwargs


def enter_region(module, group, *, all_inputs: bool = False, sequence: bool = False):
    """``f`` on ``module``'s hidden-states input (``all_inputs``: on every floating-point tensor
    input; ``sequence``: the sequence chunks all-gathered instead); returns the hook handle."""
    if sequence and all_inputs:
        raise ValueError("a region that takes every input as a partial gradient has no sequence-parallel form")
    hook = _gather_in if sequence else _copy_all if all_inputs else _copy_in
    return module.register_forward_pre_hook(partial(hook, group=group), with_kwargs=True)


def _scatter_in(module, args, kwargs, *, group):
    x = hidden_input(args, kwargs)
    if x is None or x.dim() < 3:
        got = "no tensor" if x is None else f"shape {tuple(x.shape)}"
        raise ValueError(f"{type(module).__name__} starts the sequence-parallel stretch and needs "
                         f"hidden states (batch, seq, hidden) as its first input; got {got}")
    p = dist.get_world_size(group)
    if x.shape[1] % p:
        raise ValueError(f"sequence parallelism splits the sequence ({x.shape[1]} tokens) over tp={p} ranks; "
                         f"give a sequence length that is a multiple of {p} (pad it), or parallelize "
                         f"without sequence_parallel (decoding one token at a time needs that)")
    return replace_input(args, kwargs, x, dist.scatter_to_sequence_parallel_region(x, group=group, dim=1))


def _gather_out(module, args, output, *, group):
    def whole(t):  # what follows the blocks runs on the whole sequence, on every rank alike
        return dist.gather_from_sequence_parallel_region(t, group=group, dim=1, grad_is_partial=False)
    if isinstance(output, torch.Tensor):
        return whole(output)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (whole(output[0]), *output[1:])
    raise ValueError(f"{type(module).__name__} ends the sequence-parallel stretch but returned "
                     f"{type(output).__name__}; expected a tensor or a tuple starting with one")


def scatter_sequence(module, group):
    """Cut ``module``'s hidden-states input into this rank's sequence chunk (all-gather of dX in
    backward); returns the hook handle."""
    return module.register_forward_pre_hook(partial(_scatter_in, group=group), with_kwargs=True)


def gather_sequence(module, group):
    """All-gather ``module``'s output (its first element for a tuple) along the sequence; backward
    keeps this rank's chunk of the whole gradient. Returns the hook handle."""
    return module.register_forward_hook(partial(_gather_out, group=group))


def _reduce_out(module, args, output, *, group):
    if isinstance(output, torch.Tensor):
        return dist.reduce_from_tp_region(output, group=group)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (dist.reduce_from_tp_region(output[0], group=group), *output[1:])
    raise ValueError(f"{type(module).__name__} is a partial-sum region but returned "
                     f"{type(output).__name__}; expected a tensor or a tuple starting with one")


def exit_region(module, group):
    """``g`` on ``module``'s output (its first element for a tuple); returns the hook handle."""
    return module.register_forward_hook(partial(_reduce_out, group=group))


class _Substitutes:
    """Per-module table of ``attr -> transform``: each forward that takes gradients sees
    ``transform(param)`` in place of the parameter ``attr`` (restored right after, also when
    the forward raises)."""

    def __init__(self, module):
        self.transforms = {}
        self.saved = {}
        self.handles = (module.register_forward_pre_hook(self._swap_in),
                        module.register_forward_hook(self._swap_out, always_call=True))

    def _swap_in(self, module, _args):
        if not torch.is_grad_enabled() and all(t.grad_only for t in self.transforms.values()):
            return
        for attr, transform in self.transforms.items():
            p = module._parameters.get(attr)
            if p is None or (transform.grad_only and not (torch.is_grad_enabled() and p.requires_grad)):
                continue
            self.saved[attr] = module._parameters.pop(attr)
            module.__dict__[attr] = transform(p)

    def _swap_out(self, module, _args, _output):
        for attr, p in self.saved.items():
            module.__dict__.pop(attr, None)
            module._parameters[attr] = p
        self.saved.clear()


def _substitutes(module) -> _Substitutes:
    subs = module.__dict__.get("_tp_substitutes")
    if subs is None:
        subs = _Substitutes(module)
        module.__dict__["_tp_substitutes"] = subs
    return subs


class _GradAllReduce:
    """``copy_to_tp_region``: the forward value unchanged, the gradient all-reduced."""
    grad_only = True

    def __init__(self, group):
        self.group = group

    def __call__(self, p):
        return dist.copy_to_tp_region(p, group=self.group)


class _Rank0:
    """The value on group rank 0, zeros elsewhere, its gradient all-reduced."""
    grad_only = False

    def __init__(self, group):
        self.group = group
        self.keep = dist.get_rank(group) == 0

    def __call__(self, p):
        p = dist.copy_to_tp_region(p, group=self.group) if torch.is_grad_enabled() and p.requires_grad else p
        return p if self.keep else p * 0  # (p * 0 keeps the gradient path: rank 0's gradient, zero here)


def sync_grad(module, attr: str, group) -> None:
    """All-reduce the gradient of ``module``'s replicated parameter ``attr`` over ``group``."""
    _substitutes(module).transforms[attr] = _GradAllReduce(group)


def rank0_only(module, attr: str, group) -> None:
    """Add ``module``'s parameter ``attr`` on group rank 0 only; its gradient all-reduced."""
    _substitutes(module).transforms[attr] = _Rank0(group)


class RngFork:
    """This rank's own generator state (``tracker``'s ``TP_RNG``, :mod:`tensorpar.nn.random`) while
    a stretch of the model runs whose activations are sharded (a region's heads or columns up to
    its row-parallel reduction, the sequence chunks), the default generator outside it, which
    every rank keeps in step (the same masks for replicated activations). One object per model:
    a stretch inside a forked one forks nothing more."""

    def __init__(self, tracker):
        self.tracker, self.open = tracker, []  # [(stretch, context or None)], innermost last

    def _enter(self, stretch):
        ctx = None
        if not any(c is not None for _, c in self.open):
            ctx = self.tracker.fork()
            ctx.__enter__()
        self.open.append((stretch, ctx))

    def _leave(self, stretch):
        if self.open and self.open[-1][0] is stretch:  # a stretch already left (or never entered): no-op
            _, ctx = self.open.pop()
            if ctx is not None:
                ctx.__exit__(None, None, None)

    def close(self, module, args, output):
        """On the model itself, always: a forward that raised inside a stretch gives the default
        generator back."""
        while self.open:
            self._leave(self.open[-1][0])

    def around(self, first, ends) -> list:
        """Hooks forking from ``first``'s forward until the first of ``ends`` finishes its forward
        (each later one, and a repeat, is then a no-op); returns the handles."""
        stretch = object()
        handles = [first.register_forward_pre_hook(partial(_fork_enter, fork=self, stretch=stretch))]
        for end in ends:
            handles.append(end.register_forward_hook(partial(_fork_leave, fork=self, stretch=stretch),
                                                     always_call=True))
        return handles


def _fork_enter(module, args, *, fork, stretch):
    fork._enter(stretch)


def _fork_leave(module, args, output, *, fork, stretch):  # returns None: the output is left as it is
    fork._leave(stretch)


def same_forward(module) -> bool:
    """Whether ``module``'s forward hooks, if any, are all tensorpar's and leave the values of a
    forward without gradients as they are: region entries (``f`` is the identity forward) and
    gradient-only substitutes. Code that runs the module's arithmetic itself may then skip them."""
    subs = module.__dict__.get("_tp_substitutes")
    for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values()):
        entry = isinstance(hook, partial) and hook.func in (_copy_in, _copy_all)
        substitute = subs is not None and getattr(hook, "__self__", None) is subs
        rng = isinstance(hook, partial) and hook.func in (_fork_enter, _fork_leave)  # swaps generators, not values
        if not (entry or rng or substitute and all(t.grad_only for t in subs.transforms.values())):
            return False
    return True


def substituted(module) -> set:
    """The parameters of ``module`` that a forward sees transformed (:func:`sync_grad`, :func:`rank0_only`)."""
    subs = module.__dict__.get("_tp_substitutes")
    return set(subs.transforms) if subs is not None else set()


def drop_substitute(module, attr: str) -> None:
    """Undo :func:`sync_grad` / :func:`rank0_only` of ``module.attr`` (the hooks go with the last one)."""
    subs = module.__dict__.get("_tp_substitutes")
    if subs is not None:
        subs.transforms.pop(attr, None)
        if not subs.transforms:
            remove_substitutes(module)


def swap_entry(module, *, sequence: bool):
    """Turn the region entry installed on ``module`` by :func:`enter_region` into its
    sequence-parallel form (``sequence=True``) or back, in place (same hook slot, so the order of
    the module's hooks is kept); returns the callable that restores it."""
    want, have = (_gather_in, _copy_in) if sequence else (_copy_in, _gather_in)
    for key, hook in module._forward_pre_hooks.items():
        if isinstance(hook, partial) and hook.func is have:
            module._forward_pre_hooks[key] = partial(want, **hook.keywords)
            return lambda: module._forward_pre_hooks.__setitem__(key, hook)
    raise ValueError(f"{type(module).__name__} has no hidden-states region entry to turn into a sequence gather")


def remove_substitutes(module) -> None:
    subs = module.__dict__.pop("_tp_substitutes", None)
    if subs is not None:
        for h in subs.handles:
            h.remove()


def _rows_grad(grad, *, rows, slot, n_slots, group, name):
    """The gradient with ``rows`` summed over the ranks that hold the same ``slot``."""
    mine = torch.cat([grad[a:b] for a, b in rows])  # (replicated rows, ...)
    buf = mine.new_zeros((n_slots, *mine.shape))  # one slot per KV head: ranks add into theirs
    buf[slot] = mine
    dist.all_reduce(buf, group, phase="backward", module=name)
    out, offset = grad.clone(), 0
    for a, b in rows:
        out[a:b] = buf[slot, offset:offset + b - a]
        offset += b - a
    return out


class _RowsSum(torch.autograd.Function):
    """The parameter unchanged forward; backward, its gradient with the replicated rows summed (:func:`_rows_grad`)."""

    @staticmethod
    def forward(ctx, p, sync):
        ctx.sync = sync
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad):
        return _rows_grad(grad, **ctx.sync), None


class _RowsGradSum:
    """A substitute (:class:`_Substitutes`) applying :class:`_RowsSum` to the parameter each forward
    that takes gradients: in the autograd graph, so it acts on whatever tensor the forward uses,
    FSDP's unsharded parameter included (a hook on the parameter itself never fires there)."""
    grad_only = True

    def __init__(self, sync: dict):
        self.sync = sync

    def __call__(self, p):
        return _RowsSum.apply(p, self.sync)


def sync_rows_grad(param, rows: tuple, slot: int, n_slots: int, group, name: str, *, owner=None, attr=None):
    """Rows of a fused projection's shard that several ranks hold alike (one replicated KV head
    beside this rank's query heads): each rank's gradient of them covers its own query heads
    only, so backward sums them over the ranks sharing ``slot`` (the ``ReplicatedHeadLinear``
    slot scheme: an all-reduce of ``n_slots`` x rows, zeros outside one's own slot). The
    parameter keeps ``tp_rows_sync = {"rows", "slot", "n_slots", "name"}`` (what the planner's
    inventory reads). With ``owner`` (the module whose parameter ``attr`` it is) the sum is a
    forward substitute, which data parallelism's engines keep (FSDP2 computes with an unsharded
    copy of the parameter); without, a hook on ``param``, whose handle is returned."""
    param.tp_rows_sync = {"rows": tuple(rows), "slot": slot, "n_slots": n_slots, "name": name}
    sync = {"rows": tuple(rows), "slot": slot, "n_slots": n_slots, "group": group, "name": name}
    if owner is not None:
        _substitutes(owner).transforms[attr] = _RowsGradSum(sync)
        return None
    return param.register_hook(partial(_rows_grad, **sync))
