"""A Hugging Face causal LM cut into pipeline stages, whatever its architecture.

A stage holds a contiguous run of the model's blocks (:func:`tensorpar.sharding.probes.blocks`);
the first also what the model registers before its blocks (the embeddings), the last also what
it registers after them (the final norm, the output head): the planner's rule
(:mod:`tensorpar.planner.stages`), checked here against the order the model really runs them in.

Each stage is the model's own ``forward`` over a *skeleton*: shallow copies of the modules on the
way from the root to the blocks, holding

- the stage's blocks at their own indices in a ModuleList as long as the model's (a block that
  reads its index, a sliding-window layer type, sees the right one), the other positions holding
  parameter-free stand-ins that pass their input on;
- on a stage after the first, a :class:`_HandIn` in the position before its first block: it
  returns the hidden states received from the previous stage, and everything before it (the
  embedding, replaced by zeros of its output's shape, the positions, the mask) only prepares what
  the blocks need besides them;
- on a stage before the last, a :class:`_HandOff` in the position after its last block: it stops
  the forward there and the stage returns the hidden states it was given;
- the pieces before the blocks on the first stage only, those after them on the last only (a
  tied output head, which shares the embedding's weight, on both: its gradients are summed across
  the two, :mod:`tensorpar.distributed.pipelining`).

Nothing is copied that holds a parameter, so the stages' parameters are the model's own, split
by tensor parallelism as ``parallelize`` left them; a block's hooks (tensor parallelism's regions,
sequence parallelism's chunks) come with it.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from tensorpar.nn import ColumnParallelLinear
from tensorpar.sharding import probes


class _Stopped(Exception):
    """Raised by :class:`_HandOff` to end a stage's forward after its last block."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("pipeline stage hand-off")
        self.hidden = hidden


def _hidden_of(args, kwargs) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


class _Skip(nn.Module):
    """A block held by another stage: its input passes on (before :class:`_HandIn`, unused)."""

    def __init__(self, as_tuple: bool):
        super().__init__()
        self.as_tuple = as_tuple

    def forward(self, *args, **kwargs):
        hidden = _hidden_of(args, kwargs)
        return (hidden,) if self.as_tuple else hidden


class _HandIn(nn.Module):
    """The position before a stage's first block: the hidden states from the previous stage."""

    def __init__(self, box: dict, as_tuple: bool):
        super().__init__()
        self.box, self.as_tuple = box, as_tuple

    def forward(self, *args, **kwargs):
        hidden = self.box["hidden"]
        return (hidden,) if self.as_tuple else hidden


class _HandOff(nn.Module):
    """The position after a stage's last block: its hidden states leave the stage."""

    def forward(self, *args, **kwargs):
        raise _Stopped(_hidden_of(args, kwargs))


class _Zeros(nn.Module):
    """An embedding held by the first stage, on another: zeros of its output's shape (no storage)."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, *args, **kwargs):
        ids = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))  # as the piece was given
        return torch.zeros((), dtype=self.dtype, device=ids.device).expand(*ids.shape, self.dim)


class _Same(nn.Module):
    """A shape-keeping piece before the blocks (a norm of the embeddings), on a later stage."""

    def forward(self, *args, **kwargs):
        return next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))


class _Elsewhere(nn.Module):
    """A piece after the blocks on a stage before the last: never reached (the stage stops first)."""

    def __init__(self, name: str):
        super().__init__()
        self.held = name

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.held} is held by the last pipeline stage")


@dataclass
class Anatomy:
    """Where a model's blocks and other pieces are, and how its forward uses them."""
    stack_name: str
    blocks: int
    before: list = field(default_factory=list)  # [(name, stand-in factory)] registered and run before the blocks
    after: list = field(default_factory=list)   # [name] registered and run after them
    block_tuple: bool = False  # a block returns a tuple (hidden, ...) rather than a tensor
    hidden: int = 0  # the width of the hidden states between blocks (the last dim of a block's output)


def anatomy(model: nn.Module, ranges=None) -> Anatomy:
    """The model's pieces by the registration rule, checked against one short forward (a batch of
    one sequence of three tokens): ``ValueError`` naming a piece that runs on the other side of the
    blocks from where it is registered, or one before them that a later stage cannot stand in for.
    With ``ranges`` (each stage's ``(first block, end)``), the cut is then proved: every stage built
    and run in turn on the same tokens gives the model's logits exactly, and holds its share of the
    parameters, or ``ValueError`` says how it differs. The model runs in eval mode for both, and
    the random number generator's state is left as it was."""
    if not callable(getattr(model, "get_output_embeddings", None)) or model.get_output_embeddings() is None:
        raise ValueError(f"pipeline stages need a causal LM with an output head; {type(model).__name__} has none")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("pipeline stages need a model with weights (it is run once to check its order); "
                         "this one is on the meta device")
    blist = probes.blocks(model)
    if len(blist) < 2:
        raise ValueError(f"pipeline stages need at least 2 transformer blocks; {type(model).__name__} has {len(blist)}")
    stack_name = blist[0][0].rsplit(".", 1)[0]
    pieces = _pieces(model, stack_name)
    order, shapes = [], {}
    hooks = [model.get_submodule(n).register_forward_hook(_recorder(n, order, shapes), with_kwargs=True)
             for n, _ in pieces]
    hooks += [b.register_forward_hook(_recorder(n, order, shapes), with_kwargs=True) for n, b in blist]
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.tensor([[1 % vocab, 2 % vocab, 3 % vocab]], device=probes.device_of(model))
    try:
        with _quiet_run(model):
            reference = model(input_ids=ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    first_block, last_block = order.index(blist[0][0]), order.index(blist[-1][0])
    out = Anatomy(stack_name, len(blist), block_tuple=shapes[blist[0][0]][2], hidden=shapes[blist[0][0]][1].shape[-1])
    for name, registered_before in pieces:
        if name not in order:
            continue  # never runs in a causal LM's forward: held by the stage of its registration
        ran_before = order.index(name) < first_block
        if ran_before != registered_before or (not ran_before and order.index(name) < last_block):
            raise ValueError(f"{type(model).__name__} cannot be cut into pipeline stages: {name} is registered "
                             f"{'before' if registered_before else 'after'} its blocks but runs "
                             f"{'before' if ran_before else 'among or after'} them")
        if registered_before:
            out.before.append((name, _stand_in(name, *shapes[name][:2], type(model).__name__)))
        else:
            out.after.append(name)
    out.before += [(n, None) for n, before in pieces if before and n not in order]
    out.after += [n for n, before in pieces if not before and n not in order]
    if ranges is not None:
        _prove(model, out, ranges, ids, reference)
    return out


def _prove(model, anat: Anatomy, ranges, ids, reference) -> None:
    """Every stage of ``ranges``, run in turn on ``ids``, gives ``reference`` (the model's logits)
    bit for bit, and the stages hold every parameter of the model between them."""
    name = type(model).__name__
    stages = [build_stage(model, anat, i, ranges) for i in range(len(ranges))]
    held = {id(p) for st in stages for p in st.parameters()}
    missing = [n for n, p in model.named_parameters() if id(p) not in held]
    if missing:
        raise ValueError(f"{name} cannot be cut into pipeline stages: no stage holds {missing[0]}")
    try:
        with _quiet_run(model):
            x = ids
            for st in stages:
                x = st(x)
    except Exception as exc:  # the model's forward does not run over the skeleton: said, not raised as is
        raise ValueError(f"{name} cannot be cut into pipeline stages: its stages do not run "
                         f"({type(exc).__name__}: {exc})") from exc
    if x.shape != reference.shape or not torch.equal(x, reference):
        diff = float((x - reference).abs().max()) if x.shape == reference.shape else float("inf")
        raise ValueError(f"{name} cannot be cut into pipeline stages: its stages run in turn give other logits "
                         f"than the model (largest difference {diff:.3g}); its forward does more than its "
                         f"blocks in order")


class _quiet_run:
    """Eval mode and no gradients for a check's forward; the mode and the RNG state restored after."""

    def __init__(self, model):
        self.model, self.modes = model, None

    def __enter__(self):
        self.modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        self.rng = torch.random.fork_rng(devices=[])
        self.rng.__enter__()
        self.grad = torch.no_grad()
        self.grad.__enter__()

    def __exit__(self, *exc):
        self.grad.__exit__(*exc)
        self.rng.__exit__(*exc)
        for m, training in self.modes:
            m.training = training
        return False


def _pieces(model, stack_name: str) -> list[tuple[str, bool]]:
    """``[(name, registered before the blocks)]``: the largest modules outside the block stack that
    hold parameters, beside it or beside one of its ancestors."""
    out, seen_stack = [], [False]

    def walk(mod, prefix):
        for name, child in mod._modules.items():
            full = f"{prefix}{name}"
            if full == stack_name:
                seen_stack[0] = True
            elif stack_name.startswith(full + "."):
                walk(child, full + ".")
            elif child is not None and any(True for _ in child.parameters()):
                out.append((full, not seen_stack[0]))

    walk(model, "")
    return out


def _recorder(name, order, shapes):
    def hook(module, args, kwargs, output):
        if name not in shapes:
            order.append(name)
            given = [*args, *kwargs.values()]
            first = next((a for a in given if isinstance(a, torch.Tensor)), None)
            main = output[0] if isinstance(output, tuple) else output
            shapes[name] = (first, main, isinstance(output, tuple))
    return hook


def _stand_in(name, given, made, model_name):
    """A factory of what a later stage runs in place of the piece ``name`` before the blocks."""
    if isinstance(given, torch.Tensor) and isinstance(made, torch.Tensor):
        if not given.is_floating_point() and made.shape[:-1] == given.shape:
            dim, dtype = made.shape[-1], made.dtype
            return lambda: _Zeros(dim, dtype)
        if made.shape == given.shape:
            return _Same
    raise ValueError(f"{model_name} cannot be cut into pipeline stages: {name} runs before its blocks and is "
                     f"neither an embedding nor shape-preserving (no stand-in for it on a later stage)")


def _shallow(mod: nn.Module) -> nn.Module:
    """A copy of ``mod`` sharing its children, parameters and buffers, with containers of its own
    (its module, parameter, buffer and hook dicts): changing the copy leaves ``mod`` as it is."""
    new = copy.copy(mod)
    for key, val in list(vars(mod).items()):
        if isinstance(val, (dict, OrderedDict)):
            setattr(new, key, type(val)(val) if isinstance(val, OrderedDict) else dict(val))
    return new


class StageModule(nn.Module):
    """One pipeline stage: ``forward(x)`` takes token ids (the first stage) or the previous stage's
    hidden states and returns hidden states, or the logits (the last stage; with tensor
    parallelism this rank's vocabulary shard of them)."""

    def __init__(self, skeleton: nn.Module, index: int, n_stages: int, box: dict, *, seq_chunks: int = 1,
                 tp_chunks=None):
        super().__init__()
        self.model = skeleton
        self.index, self.n_stages, self._box, self.seq_chunks = index, n_stages, box, seq_chunks
        # (send, receive, tp group): the hidden states leave as this tp rank's slice and arrive whole
        self._tp_chunks = tp_chunks

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            ids = x
        else:  # (B, T, H), or under sequence parallelism this rank's (B, T / tp, H) chunk
            if self._tp_chunks is not None and self._tp_chunks[1] is not None:
                x = self._tp_chunks[1](x, self._tp_chunks[2])  # this rank's slice -> (B, T, H)
            self._box["hidden"] = x
            ids = torch.zeros((), dtype=torch.long, device=x.device).expand(x.shape[0], x.shape[1] * self.seq_chunks)
        head = self.model.get_output_embeddings() if self.is_last else None
        sharded = isinstance(head, ColumnParallelLinear) and head.tp_size > 1
        if sharded:
            head.gather_output = False  # logits stay split by vocabulary, into the vocab-parallel loss
        try:
            return self.model(input_ids=ids, use_cache=False).logits
        except _Stopped as stop:
            if self._tp_chunks is not None and self._tp_chunks[0] is not None:
                return self._tp_chunks[0](stop.hidden, self._tp_chunks[2])  # (B, T, H / tp)
            return stop.hidden
        finally:
            self._box["hidden"] = None
            if sharded:
                head.gather_output = True


def build_stage(model: nn.Module, anat: Anatomy, index: int, ranges: list, *, seq_chunks: int = 1,
                tp_chunks=None) -> StageModule:
    """Stage ``index`` of ``model`` (``ranges[s] = (first block, end)`` of every stage); ``tp_chunks``:
    ``(send, receive, tp group)`` when the hidden states travel between stages as tp slices (either
    None where the neighbouring stage is on this rank: a V's tip hands them over whole)."""
    n_stages = len(ranges)
    start, end = ranges[index]
    first, last = index == 0, index == n_stages - 1
    box = {"hidden": None}
    swaps = {}  # dotted name -> the module the skeleton holds there
    stack = model.get_submodule(anat.stack_name)
    new_stack = _shallow(stack)
    for i, key in enumerate(list(stack._modules)):
        if start <= i < end:
            continue
        if not first and i == start - 1:
            new_stack._modules[key] = _HandIn(box, anat.block_tuple)
        elif not last and i == end:
            new_stack._modules[key] = _HandOff()
        else:
            new_stack._modules[key] = _Skip(anat.block_tuple)
    swaps[anat.stack_name] = new_stack
    if not first:
        for name, factory in anat.before:
            swaps[name] = factory() if factory is not None else _Elsewhere(name)
    if not last:
        for name in anat.after:
            swaps[name] = _Elsewhere(name)
    return StageModule(_skeleton(model, swaps), index, n_stages, box, seq_chunks=seq_chunks, tp_chunks=tp_chunks)


def _skeleton(model: nn.Module, swaps: dict) -> nn.Module:
    """Shallow copies of ``model`` and of every module above a name in ``swaps``, with the swapped
    modules in place: the rest is shared with ``model``."""
    copies = {"": _shallow(model)}
    for name in sorted(swaps, key=lambda n: n.count(".")):
        parts = name.split(".")
        for depth in range(1, len(parts)):
            path = ".".join(parts[:depth])
            if path not in copies:
                parent = copies[".".join(parts[:depth - 1])]
                copies[path] = _shallow(parent._modules[parts[depth - 1]])
                parent._modules[parts[depth - 1]] = copies[path]
        copies[".".join(parts[:-1])]._modules[parts[-1]] = swaps[name]
    return copies[""]
